"""The KV-cache sampler's greedy tokens against transformers' `generate` (the oracle) on the
same imported random Llama, and dpo/tools/bench_sampler.py run as a user runs it.

tests/test_sampler.py checks the sampler against our own uncached forward and tests/test_hf.py
the imported logits against transformers'; neither decodes with transformers, which is what
this file adds: left padding, per-row RoPE positions and the cache, end to end.
"""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import configs  # noqa: E402
from models import hf, sampler, sharding, transformer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, PAD, N = 128, 0, 12


def _random_llama():
  config = transformers.LlamaConfig(
      vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
      rms_norm_eps=1e-5, tie_word_embeddings=False)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).float().eval()
  # Larger random weights (norm scales included) than the initialiser's, so the logits have
  # clear maxima and a greedy tie is not decided by float rounding.
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.15 * torch.randn_like(p))
  return model


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_generate(tmp_path):
  model = _random_llama()
  model.save_pretrained(tmp_path)
  cfg, params = hf.load(str(tmp_path), sharding.make_mesh("data:-1"))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, V, n).tolist() for n in (1, 3, 6, 9, 11, 5, 2, 8)]

  # transformers: left-padded to the longest prompt, with an attention mask; the EOS id is
  # outside the vocabulary, so every row generates N tokens.
  P = max(map(len, prompts))
  ids = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
  out = model.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False,
                       use_cache=True, pad_token_id=PAD, eos_token_id=V)
  want = out[:, P:].numpy()
  assert want.shape == (len(prompts), N)

  # Ours: left-padded to a multiple of 8 (as evaluation pads), greedy, the same EOS id.
  tokens, segments = sampler.left_pad(prompts, PAD, multiple=8)
  scfg = sampler.SamplingConfig(max_new_tokens=N, eos_id=V, pad_id=PAD, temperature=0.0)
  got = sampler.generate(cfg, scfg, params, sampler.Prompts(jnp.asarray(tokens),
                                                            jnp.asarray(segments)),
                         jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(got.tokens), want)
  assert np.asarray(got.lengths).tolist() == [N] * len(prompts)
  # A random model must not collapse to one token, or the comparison says little.
  assert len(np.unique(want)) > 10


@pytest.mark.slow
def test_tool_runs_end_to_end():
  args = ["--vocab_size=256", "--d_model=32", "--n_layers=2", "--n_heads=4", "--n_kv_heads=2",
          "--head_dim=8", "--mlp_dim=64", "--batch=3", "--min_prompt_len=2",
          "--max_prompt_len=12", "--new_tokens=6", "--repeats=1", "--threads=1",
          "--bucket_lengths=3,17", "--bucket_new_tokens=2"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  done = subprocess.run([sys.executable, "-m", "dpo.tools.bench_sampler", *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stdout.splitlines()
  assert any(line.startswith("CPU: ") for line in lines), done.stdout
  theirs = [line for line in lines if line.startswith("transformers, torch 1 thread: median")]
  assert len(theirs) == 1 and "greedy tokens equal" in theirs[0], done.stdout
  assert any(line.startswith("ours: prefill + first token") for line in lines), done.stdout
  assert any(line.startswith("ours / transformers' fastest (1 thread): ") for line in lines)
  assert "bucketed: 15 prompt lengths 3..17 padded to [8, 16, 24]: 3 executables compiled" \
      in done.stdout, done.stdout


def test_preset_mode_times_ours_alone_with_the_decode_steps_traffic():
  """--preset: our sampler alone on a preset's shape (what runs on a TPU host without torch):
  a decode step's time, and its bytes (every weight but an untied embedding table, the whole
  KV cache of prompt + new slots with its segment ids) over that time. Flags of the transformers side are refused."""
  from dpo.tools import bench_sampler
  cfg = configs.get_config("bench-small").model
  params = jax.eval_shape(lambda: transformer.init(cfg, jax.random.key(0),
                                                   sharding.make_mesh("data:1", jax.devices()[:1])))
  weights, cache = bench_sampler.decode_bytes(cfg, params, batch=3, slots=40)
  assert not cfg.tie_embeddings
  assert weights == 4 * (sum(x.size for x in jax.tree.leaves(params)) - cfg.vocab_size * cfg.d_model)
  item = jnp.dtype(cfg.compute_dtype).itemsize
  kv = 2 * cfg.n_layers * 3 * cfg.n_kv_heads * 40 * cfg.head_dim * item
  assert cache == kv + 3 * 40 * 4  # and the slots' int32 segment ids
  # In bfloat16 the weights are read at 2 bytes (the float32 ones are converted once, outside
  # the decode loop).
  bf16 = dataclasses.replace(cfg, compute_dtype="bfloat16")
  assert bench_sampler.decode_bytes(bf16, params, 3, 40)[0] == weights // 2
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  run = lambda *args: subprocess.run(
      [sys.executable, "-m", "dpo.tools.bench_sampler", "--preset=bench-small", *args], cwd=ROOT,
      env=env, capture_output=True, text=True, timeout=300)
  done = run("--batch=2", "--max_prompt_len=10", "--new_tokens=4", "--repeats=1")
  assert done.returncode == 0, done.stderr[-3000:]
  step = [line for line in done.stdout.splitlines() if line.startswith("ours: compile")]
  assert len(step) == 1 and " ms a decode step, " in step[0], done.stdout
  traffic = [line for line in done.stdout.splitlines() if line.startswith("a decode step reads")]
  assert len(traffic) == 1 and "of KV cache (20 slots): " in traffic[0], done.stdout
  refused = run("--threads=1", "--d_model=64")
  assert refused.returncode != 0 and "Traceback" not in refused.stderr
  assert "--threads, --d_model: --preset times our sampler alone" in refused.stderr

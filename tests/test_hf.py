"""Hugging Face import / export parity against transformers (torch CPU, test-only).

Each architecture: a tiny random model built by transformers from a config object (no download)
is saved, imported on an 8-device mesh (fsdp x tensor, so the sliced reads are exercised), and
must give transformers' float32 logits within 1e-4 on a right-padded batch; summed completion
log-probs match; the export (LoRA merged) loads back into transformers with the same logits; the
PEFT adapter equals the merged delta; import errors name the offending tensor.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import configs  # noqa: E402
from dpo import logprobs  # noqa: E402
from dpo.batches import Rows  # noqa: E402
from models import archs, hf, lora as lora_lib, quant, sharding, transformer  # noqa: E402
from test_checkpoint import deny_each, permission_cases  # noqa: E402

V, T = 96, 10
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)

ARCH_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **{**COMMON, "max_position_embeddings": 128}, rms_norm_eps=1e-5, tie_word_embeddings=False,
        # llama3 scaling with these numbers puts the 4 frequencies in all three bands.
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=4,
                                                  tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True,
                                              rope_parameters={"rope_type": "default",
                                                               "rope_theta": 1e6}),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, tie_word_embeddings=False),
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON, sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
        query_pre_attn_scalar=12, hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **COMMON, sliding_window=4, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 10000.0,
                                            "factor": 4.0}}),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True, tie_word_embeddings=False),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4,
                                                  num_experts_per_tok=2, tie_word_embeddings=False),
    "olmoe": lambda: transformers.OlmoeConfig(
        **{k: v for k, v in COMMON.items() if k != "head_dim"}, num_experts=5,
        num_experts_per_tok=3, norm_topk_prob=False, tie_word_embeddings=False),
}


def _hf_model(arch):
  config = ARCH_CONFIGS[arch]()
  config._attn_implementation = "eager"
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  model = model.float().eval()
  # Random values everywhere (biases and norm scales included, which init leaves at 0 / 1).
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.15 * torch.randn_like(p))
  return model


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, V, size=(3, T)).astype(np.int32)
  lengths = np.array([T, 7, 4])
  seg = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)  # right padding
  tokens = tokens * seg
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (3, T)).copy()
  loss_mask = (seg * (np.arange(T)[None] >= 2)).astype(np.float32)  # completion after 2 tokens
  return tokens, positions, seg, loss_mask


def _hf_logits(model, tokens, seg):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(seg, dtype=torch.long))
  return out.logits.float().numpy()


def _torch_completion_logps(logits, tokens, loss_mask):
  """Independent summed log-probs: log_softmax in torch, token t scored by logits at t-1."""
  lp = torch.log_softmax(torch.tensor(logits[:, :-1], dtype=torch.float64), -1)
  picked = lp.gather(-1, torch.tensor(tokens[:, 1:], dtype=torch.long)[..., None])[..., 0]
  return (picked.numpy() * loss_mask[:, 1:]).sum(-1)


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh("data:2,fsdp:2,tensor:2")


@pytest.mark.parametrize("arch", archs.ARCHS)
@pytest.mark.slow
def test_import_parity_and_export_roundtrip(arch, mesh, tmp_path):
  model = _hf_model(arch)
  src = tmp_path / "src"
  model.save_pretrained(src)
  cfg, params = hf.load(str(src), mesh)
  assert cfg.arch == arch
  # Params arrive in their target shardings.
  want_sh = transformer.shardings(transformer.param_specs(cfg), mesh)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_sh)):
    assert got.sharding.is_equivalent_to(want, got.ndim)

  tokens, positions, seg, loss_mask = _batch()
  ref = _hf_logits(model, tokens, seg)
  ours = np.asarray(jax.jit(lambda p: transformer.forward(cfg, p, transformer.Inputs(tokens,
      positions, seg)))(params))
  real = seg.astype(bool)
  diff = np.abs(ours - ref)[real].max()
  print(f"{arch}: max |logit diff| vs transformers = {diff:.2e}")
  assert diff < 1e-4, diff

  lp, n = logprobs.sequence_logps(cfg, params, Rows(tokens, positions, seg, loss_mask))
  np.testing.assert_allclose(np.asarray(lp), _torch_completion_logps(ref, tokens, loss_mask),
                             atol=1e-4, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(n), loss_mask.sum(-1))

  # Export with a non-zero LoRA (random B) on every target; transformers must see the merge.
  targets = tuple(t for t in lora_lib.TARGETS if not (cfg.n_experts and t in ("gate", "up", "down")))
  lcfg = configs.LoraConfig(lora_rank=2, lora_alpha=4.0, lora_targets=targets)
  lora = lora_lib.init(cfg, lcfg, jax.random.key(1), mesh)
  lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), lora)
  policy = np.asarray(transformer.forward(cfg, params, transformer.Inputs(tokens, positions, seg),
      transformer.Adapter(lora, lcfg.scale)))
  out = tmp_path / "export"
  hf.save(str(out), cfg, params, hf.Lora(lora, lcfg),
          hf.SaveOptions(source=json.load(open(src / "config.json"))))
  back = transformers.AutoModelForCausalLM.from_pretrained(
      out, attn_implementation="eager", dtype=torch.float32).eval()
  assert type(back).__name__ == archs.ARCHITECTURES[arch].hf_class
  # Our tensor names are exactly the ones transformers wrote.
  assert set(hf.SafetensorsDir(str(out)).entries) == set(hf.SafetensorsDir(str(src)).entries)
  diff_export = np.abs(_hf_logits(back, tokens, seg) - policy)[real].max()
  print(f"{arch}: max |logit diff| export round trip = {diff_export:.2e}")
  assert diff_export < 1e-4, diff_export
  assert np.abs(policy - ours)[real].max() > 1e-3  # the LoRA delta is really in the export

  # PEFT layout (PEFT itself is not installed): every adapter key is
  # base_model.model.<an nn.Linear of the transformers model>.lora_{A,B}.weight, and
  # W_hf + (alpha / r) * B_peft @ A_peft reproduces the merged export.
  hf.save_peft(str(tmp_path / "adapter"), cfg, lora, lcfg)
  adapter = hf.SafetensorsDir(str(tmp_path / "adapter"))
  acfg = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
  assert acfg["peft_type"] == "LORA" and acfg["r"] == 2
  linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
  adapted = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in adapter.entries}
  assert adapted == linears - {"lm_head"}
  assert acfg["target_modules"] == sorted({n.rsplit(".", 1)[1] for n in adapted})
  base_sd, merged_sd = model.state_dict(), back.state_dict()
  for module in adapted:
    a = np.asarray(adapter.get(f"base_model.model.{module}.lora_A.weight"))
    b = np.asarray(adapter.get(f"base_model.model.{module}.lora_B.weight"))
    w = base_sd[f"{module}.weight"].numpy() + acfg["lora_alpha"] / acfg["r"] * b @ a
    np.testing.assert_allclose(w, merged_sd[f"{module}.weight"].numpy(), atol=1e-6)


def test_peft_export_covers_only_the_configured_targets(mesh, tmp_path):
  cfg = configs.ModelConfig(n_layers=2)
  lcfg = configs.LoraConfig(lora_rank=2, lora_targets=("v", "gate"))
  hf.save_peft(str(tmp_path), cfg, lora_lib.init(cfg, lcfg, jax.random.key(0), mesh), lcfg)
  names = set(hf.SafetensorsDir(str(tmp_path)).entries)
  assert names == {f"base_model.model.model.layers.{i}.{m}.lora_{x}.weight"
                   for i in range(2) for m in ("self_attn.v_proj", "mlp.gate_proj") for x in "AB"}
  acfg = json.load(open(tmp_path / "adapter_config.json"))
  assert acfg["target_modules"] == ["gate_proj", "v_proj"]


@pytest.mark.parametrize("arch", archs.ARCHS)
def test_registry_matches_transformers(arch):
  """Each registered architecture: transformers' default config for its model_type imports, with
  the family's switches, and the registry's class is the one transformers builds for it."""
  a = archs.ARCHITECTURES[arch]
  assert a.model_type == arch
  hf_cfg = transformers.AutoConfig.for_model(arch)
  cfg = hf.config_from_hf(hf_cfg.to_dict())
  assert cfg.arch == arch
  assert {k: getattr(cfg, k) for k in a.switches._fields} == a.switches._asdict()
  mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
  assert mapping[arch] == a.hf_class
  assert hf.hf_config(cfg)["architectures"] == [a.hf_class]


def test_registry_switches_are_model_config_fields():
  fields = {f.name: f for f in dataclasses.fields(configs.ModelConfig)}
  for name in archs.Switches._fields:
    assert fields[name].type in (bool, "bool"), name


def test_models_import_neither_configs_nor_dpo():
  """ModelConfig and LoraConfig live in models/config.py, so models.hf, which reads them, runs
  without configs.py or dpo/ (configs.py imports models, not the other way round)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = ("import sys\n"
          "import models.config, models.hf, models.lora, models.quant, models.archs\n"
          "bad = sorted(m for m in sys.modules if m == 'configs' or m.startswith('dpo'))\n"
          "assert not bad, bad\n")
  subprocess.run([sys.executable, "-c", code], cwd=root, check=True,
                 env={**os.environ, "PYTHONPATH": root})


def test_export_rejects_switches_the_family_lacks():
  cfg = configs.ModelConfig(arch="llama", post_norms=True)
  with pytest.raises(hf.HFError, match=r"post_norms=True does not match model_type llama"):
    hf.hf_config(cfg)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("llama")
  _hf_model("llama").save_pretrained(path)
  return path


def _edit(src, dst, fn):
  shutil.copytree(src, dst)
  f = os.path.join(dst, "model.safetensors")
  files = hf.SafetensorsDir(str(dst))
  tensors = {k: np.array(files.get(k)) for k in files.entries}
  fn(tensors)
  hf.write_safetensors(f, tensors)


def test_missing_tensor_is_named(llama_dir, tmp_path, mesh):
  name = "model.layers.1.mlp.up_proj.weight"
  _edit(llama_dir, tmp_path / "m", lambda t: t.pop(name))
  with pytest.raises(hf.HFError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
    hf.load(str(tmp_path / "m"), mesh)


def test_misshapen_tensor_is_named(llama_dir, tmp_path, mesh):
  name = "model.layers.2.self_attn.k_proj.weight"
  _edit(llama_dir, tmp_path / "m", lambda t: t.__setitem__(name, t[name][:8]))
  with pytest.raises(hf.HFError, match=r"k_proj\.weight.*shape \[8, 32\], expected \[16, 32\]"):
    hf.load(str(tmp_path / "m"), mesh)


def test_unsupported_architecture_is_named(llama_dir, tmp_path, mesh):
  shutil.copytree(llama_dir, tmp_path / "m")
  cfg = json.load(open(tmp_path / "m" / "config.json"))
  cfg["model_type"] = "gpt2"
  json.dump(cfg, open(tmp_path / "m" / "config.json", "w"))
  with pytest.raises(hf.HFError, match=r"config\.json: model_type 'gpt2' is not supported"):
    hf.load(str(tmp_path / "m"), mesh)


@pytest.mark.parametrize("real_chmod", permission_cases())
def test_a_folder_it_may_not_read_is_one_line_naming_it(llama_dir, tmp_path, mesh, monkeypatch,
                                                        real_chmod):
  """--init_from=hf:DIR behind chmod 000 (or the denial simulated where root reads through it):
  the check before any work and the import each stop in one line naming the folder's file,
  never "config.json is missing"; the folder stays as it was."""
  from dpo import checkpoint
  d = tmp_path / "m"
  shutil.copytree(llama_dir, d)
  files = {name: (d / name).read_bytes() for name in os.listdir(d)}
  with deny_each(real_chmod)(d, monkeypatch):
    with pytest.raises(checkpoint.Unreadable) as e:
      checkpoint.check_model_source("init_from", f"hf:{d}")
    assert str(e.value).startswith(f"--init_from=hf:{d}: permission denied reading {d}/")
    with pytest.raises(hf.HFError) as e2:
      hf.load(str(d), mesh)
    assert str(e2.value).startswith(f"{d}/config.json: cannot read (")
    assert "Permission denied" in str(e2.value)
    with pytest.raises(hf.HFError, match="Permission denied"):  # what an export carries over
      hf.source_config(f"hf:{d}")
  for message in (str(e.value), str(e2.value)):
    assert "\n" not in message
  assert {name: (d / name).read_bytes() for name in os.listdir(d)} == files


def test_sharded_checkpoint_and_bfloat16(llama_dir, tmp_path, mesh):
  """A multi-file checkpoint with an index, stored in bfloat16, loads to the same values."""
  cfg, params = hf.load(str(llama_dir), mesh)
  hf.save(str(tmp_path / "s"), cfg, params,
          options=hf.SaveOptions(dtype="bfloat16", max_shard_bytes=20_000))
  assert os.path.exists(tmp_path / "s" / "model.safetensors.index.json")
  assert len([f for f in os.listdir(tmp_path / "s") if f.endswith(".safetensors")]) > 2
  cfg2, params2 = hf.load(str(tmp_path / "s"), mesh)
  assert cfg2 == cfg
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "s", dtype=torch.bfloat16)
  want = back.state_dict()["model.layers.1.self_attn.q_proj.weight"].float().numpy()
  got = np.asarray(params2["layers"]["q"][1]).reshape(32, -1).T
  np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(np.asarray(params2["embed"]), np.asarray(params["embed"]),
                             rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_import_straight_into_a_quantized_base(llama_dir, mesh, mode):
  """hf.load(quantize=...) reads and quantizes one layer at a time, on a data x fsdp x tensor
  mesh: the same arrays (values, dtypes, shardings) as quantizing the float import."""
  cfg, floats = hf.load(str(llama_dir), mesh)
  want = quant.quantize_params(transformer.param_specs(cfg), mode, floats, mesh)
  cfg2, got = hf.load(str(llama_dir), mesh, quantize=mode)
  assert cfg2 == cfg and jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert (a.dtype, a.sharding) == (b.dtype, b.sharding)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

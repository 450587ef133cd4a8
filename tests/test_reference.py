"""dpo/reference.py: precomputed reference log-probs (cache, fingerprint, equality with the
in-step reference), TR-DPO updates, and the reference-free path of dpo_step."""

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import numerics
from dpo import data as data_lib
from dpo import logprobs, reference, task, train
from dpo.batches import PairBatch
from dpo.tokenizer import ByteTokenizer
from models import lora as lora_lib
from models import sharding, transformer

TINY = configs.Config().replace(
    d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, lora_rank=4,
    lora_alpha=8.0, lora_dropout=0.0, max_prompt_length=24, max_target_length=24,
    global_batch_size=8, steps=3, learning_rate=1e-2, warmup_ratio=0.0)


def cached(cfg, mesh, frozen, arrays, tok):
  return reference.cached(train.StepConfig.dpo(cfg), mesh, frozen, arrays,
                          reference.Cache(cfg.reference.ref_cache_dir, tok),
                          cfg.optim.global_batch_size)


@pytest.fixture(scope="module")
def setup():
  mesh = sharding.make_mesh("data:-1")
  tok = ByteTokenizer()
  arrays = data_lib.tokenize_pairs(task.preference_records(24, 0), tok, 24, 24)
  params = transformer.init(TINY.model, jax.random.key(0), mesh)
  lora = lora_lib.init(TINY.model, TINY.lora, jax.random.key(1), mesh)
  # a non-zero B so the adapter changes the model
  lora = jax.tree.map(lambda x: x + 0.5 * jax.random.normal(jax.random.key(2), x.shape), lora)
  return mesh, tok, arrays, params, lora


def _run_steps(cfg, mesh, frozen, trainable, arrays, n_steps):
  """Losses of n_steps un-donated dpo_steps over the first batches of `arrays`."""
  spec = train.StepConfig.dpo(cfg)
  state = train.init_state(trainable, spec.optimizer()[0], cfg.run.seed, mesh)
  step = jax.jit(functools.partial(train.dpo_step, spec))
  bs = cfg.optim.global_batch_size
  out = []
  for i in range(n_steps):
    batch = train.device_batch(mesh, PairBatch.of({k: v[i * bs:(i + 1) * bs]
                                                   for k, v in arrays.items()}))
    state, m = step(state, frozen, batch)
    out.append(jax.device_get(m))
  return out


@pytest.mark.parametrize("lora_rank", [4, 0])
@pytest.mark.slow
def test_precomputed_equals_in_step(setup, tmp_path, lora_rank):
  mesh, tok, arrays, params, lora = setup
  cfg = TINY.replace(lora_rank=lora_rank, ref_cache_dir=str(tmp_path), ld_alpha=0.5,
                     loss_type=("sigmoid", "ipo"))
  trainable = lora if lora_rank else jax.tree.map(lambda x: x + 0.0, params)
  frozen = train.Frozen(params)
  ref_arrays, info = cached(cfg, mesh, frozen, arrays, tok)
  assert not info["hit"] and os.path.exists(info["path"])
  assert ref_arrays["ref_logps"].shape == (len(arrays["tokens"]), 2)
  in_step = _run_steps(cfg, mesh, frozen, trainable, arrays, 2)
  pre = _run_steps(cfg, mesh, frozen, trainable, {**arrays, **ref_arrays}, 2)
  for a, b in zip(in_step, pre):
    for k in ("loss", "rewards/margins", "rewards/accuracies", "grad_norm"):
      np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
  again, info2 = cached(cfg, mesh, frozen, arrays, tok)
  assert info2["hit"] and info2["path"] == info["path"]
  np.testing.assert_array_equal(again["ref_logps"], ref_arrays["ref_logps"])


SPEC = train.StepConfig.dpo(TINY)


def test_fingerprint_changes_with_data_tokenizer_and_weights(setup):
  mesh, tok, arrays, params, _ = setup
  frozen = train.Frozen(params)
  key = reference.fingerprint(SPEC, arrays, tok, frozen)
  assert key == reference.fingerprint(SPEC, dict(arrays), tok, frozen)
  tokens = arrays["tokens"].copy()
  tokens[0, 0, -1] ^= 1
  assert key != reference.fingerprint(SPEC, {**arrays, "tokens": tokens}, tok, frozen)
  bumped = jax.tree.map(lambda x: x, params)
  bumped["final_norm"] = params["final_norm"] + 1e-3
  assert key != reference.fingerprint(SPEC, arrays, tok, train.Frozen(bumped))

  class OtherTok(ByteTokenizer):
    pass
  assert key != reference.fingerprint(SPEC, arrays, OtherTok(), frozen)


def test_stale_cache_is_rejected(setup, tmp_path):
  mesh, tok, arrays, params, _ = setup
  cfg = TINY.replace(ref_cache_dir=str(tmp_path))
  _, info = cached(cfg, mesh, train.Frozen(params), arrays, tok)
  with np.load(info["path"]) as f:
    body = {k: f[k] for k in f.files}
  body["fingerprint"] = np.asarray("0" * 64)
  with open(info["path"], "wb") as f:
    np.savez(f, **body)
  with pytest.raises(ValueError, match="fingerprint"):
    cached(cfg, mesh, train.Frozen(params), arrays, tok)


def test_tr_dpo_updates(setup):
  mesh, _, _, params, lora = setup
  cfg = TINY.replace(ref_update="soft", ref_update_alpha=0.25, ref_update_every=4)
  zero = jax.tree.map(jnp.zeros_like, lora)
  frozen = train.initial_frozen(params, zero)
  assert frozen.ref_lora is not None
  state = train.TrainState(jnp.int32(4), lora, None, None, None, None)
  assert reference.maybe_update(cfg.reference, 3, state, frozen) is frozen  # not a multiple of k
  soft = reference.maybe_update(cfg.reference, 4, state, frozen)
  # The adapter products mix (tests/test_tr_dpo.py checks non-zero adapters against numpy).
  product = lambda f: lora_lib.delta(f["a"], f["b"], f["a"].ndim - 2, 1.0)
  for name, f in soft.ref_lora["layers"].items():
    np.testing.assert_allclose(np.asarray(product(f)), 0.25 * np.asarray(product(
        lora["layers"][name])), rtol=1e-5, atol=1e-7)
  assert soft.params is params  # with LoRA the base never changes
  hard = reference.maybe_update(cfg.replace(ref_update="hard").reference, 8, state, frozen)
  for got, new in zip(jax.tree.leaves(hard.ref_lora), jax.tree.leaves(lora)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(new))
    ptr = lambda a: a.addressable_shards[0].data.unsafe_buffer_pointer()
    assert ptr(got) != ptr(new)  # a fresh buffer: the policy's is donated by the next step
  # Full fine-tuning: the reference copy itself is mixed.
  full = TINY.replace(lora_rank=0, ref_update="soft", ref_update_alpha=0.5, ref_update_every=1)
  other = jax.tree.map(lambda x: x + 1.0, params)
  mixed = reference.maybe_update(full.reference, 1, state._replace(params=other),
                                 train.initial_frozen(params))
  np.testing.assert_allclose(np.asarray(mixed.params["final_norm"]),
                             np.asarray(params["final_norm"]) + 0.5, rtol=1e-6)


@pytest.mark.slow
def test_reference_lora_copy_is_the_reference(setup):
  """With ref_lora equal to the policy adapter (no dropout), policy == reference: DPO loss ln 2."""
  mesh, _, arrays, params, lora = setup
  frozen = train.Frozen(params, jax.tree.map(lambda x: x + 0.0, lora))
  m = _run_steps(TINY, mesh, frozen, lora, arrays, 1)[0]
  np.testing.assert_allclose(m["loss"], math.log(2.0), rtol=1e-5)
  m = _run_steps(TINY, mesh, train.Frozen(params), lora, arrays, 1)[0]
  assert abs(m["loss"] - math.log(2.0)) > 1e-4  # base-only reference differs from the policy


@pytest.mark.slow
def test_reference_free_runs_no_reference_forward(setup):
  """Full fine-tuning with a reference-free loss: frozen=None would fail if a reference ran."""
  mesh, _, arrays, params, _ = setup
  for loss in ("simpo", "cpo", "orpo", "sft"):
    cfg = TINY.replace(lora_rank=0, loss_type=(loss,))
    m = _run_steps(cfg, mesh, None, jax.tree.map(lambda x: x + 0.0, params), arrays, 1)[0]
    assert np.isfinite(m["loss"])
  with pytest.raises(Exception):
    _run_steps(TINY.replace(lora_rank=0), mesh, None, jax.tree.map(lambda x: x + 0.0, params),
               arrays, 1)


def test_config_rejects_bad_combinations():
  with pytest.raises(ValueError, match="precompute_ref"):
    configs.ReferenceConfig(precompute_ref=True, ref_update="soft")
  with pytest.raises(ValueError, match="reference-free"):
    configs.DEFAULT.replace(precompute_ref=True, loss_type=("simpo",), rpo_alpha=0.0)
  with pytest.raises(ValueError, match="KL guard"):
    configs.DEFAULT.replace(precompute_ref=True, kl_max=0.5)
  # --log_kl cannot be honoured without the reference in the step: the step computes no KL.
  assert configs.DEFAULT.step_kl and not configs.DEFAULT.replace(precompute_ref=True).step_kl
  assert not configs.DEFAULT.replace(loss_type=("simpo",), rpo_alpha=0.0).step_kl


@pytest.mark.parametrize("lora_rank", [4, 0])
@pytest.mark.slow
def test_separate_reference_model_is_the_steps_reference(setup, tmp_path, lora_rank):
  """--ref_init_from: the step's rewards are beta * (log pi - log pi_ref) with pi_ref the given
  model (not the policy's initial weights), in the step and precomputed alike."""
  mesh, tok, arrays, params, lora = setup
  cfg = TINY.replace(lora_rank=lora_rank, ref_cache_dir=str(tmp_path))
  spec = train.StepConfig.dpo(cfg)
  other = transformer.init(cfg.model, jax.random.key(9), mesh)
  zero_lora = lora_lib.init(cfg.model, cfg.lora, jax.random.key(1), mesh) if lora_rank else None
  trainable = zero_lora if lora_rank else jax.tree.map(lambda x: x + 0.0, params)
  frozen = train.initial_frozen(params, reference=other, lora_on=bool(lora_rank))
  first = _run_steps(cfg, mesh, frozen, trainable, arrays, 1)[0]
  batch = PairBatch.of({k: v[:8] for k, v in arrays.items()})
  pol = logprobs.pair_stats(cfg.model, params, batch).logps  # policy = initial weights at step 1
  ref = logprobs.pair_stats(cfg.model, other, batch).logps
  # The step and these eager forwards are compiled apart: each log-prob within the forward's
  # reordering bound tau of its magnitude, a reward within beta times the sum of two such.
  tau = numerics.forward_tol(cfg.model, arrays["tokens"].shape[-1])
  want = cfg.loss.beta * (pol - ref)[:, 0].mean()
  assert abs(float(first["rewards/chosen"]) - want) <= numerics.implicit_reward_noise(
      cfg.loss.beta, tau, np.abs(pol[:, 0]).mean(), np.abs(ref[:, 0]).mean())
  noise = numerics.implicit_reward_noise(cfg.loss.beta, tau, *np.abs(pol).mean(0),
                                         *np.abs(ref).mean(0))
  # Beyond rounding: the default reference (the policy's own start) would give only noise.
  assert abs(float(first["rewards/margins"])) > noise
  ref_arrays, _ = cached(cfg, mesh, frozen, arrays, tok)
  numerics.assert_close({"precomputed reference log-probs": (ref_arrays["ref_logps"][:8], ref,
                                                             tau)})
  assert (reference.fingerprint(spec, arrays, tok, frozen) !=
          reference.fingerprint(spec, arrays, tok, train.initial_frozen(params)))


@pytest.mark.slow
def test_run_with_ref_init_from_trains_and_evaluates_against_it(tmp_path):
  """A --stage=dpo run with --ref_init_from=<params checkpoint>, int8-quantized and
  precomputed: the first step's rewards and the evaluation's reference are that model."""
  from dpo import checkpoint, evaluate, loop
  from models import quant
  mesh = sharding.make_mesh("data:2", jax.devices()[:2])
  ref_dir = str(tmp_path / "ref")
  cfg = configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, stage="dpo",
      steps=2, log_every=1, eval_every=0, task_train_pairs=16, task_eval_pairs=8,
      task_eval_prompts=4, eval_max_new_tokens=4, global_batch_size=8, base_quant="int8",
      precompute_ref=True, ref_init_from=ref_dir, output_dir=str(tmp_path / "run"))
  other = transformer.init(cfg.model, jax.random.key(9), mesh)
  checkpoint.save_params(ref_dir, other, cfg.model, stage="test")
  summary = loop.run(cfg, mesh=mesh)
  assert summary["ref_cache"]["hit"] is False
  held = loop.Data(cfg).held
  q = quant.quantize_params(transformer.param_specs(cfg.model), "int8", other, mesh)
  want = evaluate.pair_metrics(cfg, mesh, evaluate.Weights(q), q, held, 8)["perplexity"]
  assert summary["reference_perplexity"] == pytest.approx(want, rel=1e-5)
  import json
  first = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
  assert first["step"] == 1 and abs(first["rewards/margins"]) > 1e-4


def test_hf_reference_of_another_architecture_is_refused(tmp_path):
  """--ref_init_from=hf:DIR must describe the policy's architecture: the error names the
  fields that differ."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from dpo import checkpoint
  torch.manual_seed(0)
  transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
      vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
      num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
  cfg = TINY.replace(ref_init_from=f"hf:{tmp_path}", vocab_size=272)
  with pytest.raises(checkpoint.CheckpointError, match=r"another architecture.*'arch': \('qwen2', 'llama'\)"):
    reference.load(cfg, sharding.make_mesh("data:1", jax.devices()[:1]))

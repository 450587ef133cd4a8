"""Frozen base in less than float32: bf16 / int8 / NF4 against independent numpy conversions, logit
error, sharding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from models import lora as lora_lib
from models import quant, sharding, transformer

# Stated tolerances for the tiny random model below (init_std 0.1, logits std ~0.8): relative
# RMS logit error ||quantized - float32|| / ||float32||. Measured values are printed by
# test_logit_error_vs_float32_and_memory (see WORKSPACE.md for the figures).
TOL = {"bf16": 0.01, "int8": 0.03, "nf4": 0.4}


def as_float(w):
  """A stored base matrix as float32 (bf16 is a plain array)."""
  return quant.dequantize(w) if quant.is_quantized(w) else w.astype(jnp.float32)


def np_int8(w, n_lead, n_in):
  axes = tuple(range(n_lead, n_lead + n_in))
  scale = np.abs(w).max(axis=axes, keepdims=True) / 127.0
  return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale


def np_nf4_dequant(w, n_lead):
  """Independent NF4: per 64-block absmax, nearest level by argmin, then back to floats."""
  lead = w.shape[:n_lead]
  flat = w.reshape(*lead, -1)
  n = flat.shape[-1]
  flat = np.concatenate([flat, np.zeros((*lead, (-n) % 64))], -1)
  blocks = flat.reshape(*lead, -1, 64)
  absmax = np.abs(blocks).max(-1, keepdims=True)
  idx = np.abs(blocks[..., None] / absmax[..., None] - quant.NF4_LEVELS).argmin(-1)
  return (quant.NF4_LEVELS[idx] * absmax).reshape(*lead, -1)[..., :n].reshape(w.shape)


def test_int8_matches_numpy():
  w = np.random.default_rng(0).normal(size=(3, 16, 4, 8)).astype(np.float32)
  qw = quant.quantize_int8(jnp.asarray(w), 1, 1)
  q, scale = np_int8(w, 1, 1)
  np.testing.assert_allclose(np.asarray(qw.scale), scale, rtol=1e-6)
  assert np.mean(np.asarray(qw.q) == q) > 0.999  # ties at .5 may round differently in float32
  err = np.abs(np.asarray(quant.dequantize(qw)) - w)
  assert np.all(err <= scale / 2 * (1 + 1e-5))


def test_nf4_matches_numpy_and_packs_two_per_byte():
  w = np.random.default_rng(1).normal(size=(2, 24, 10)).astype(np.float32)  # 240: not a multiple
  qw = quant.quantize_nf4(jnp.asarray(w), 1)
  assert qw.packed.dtype == jnp.uint8 and qw.packed.shape == (2, 4, 32)
  assert qw.absmax.shape == (2, 4) and qw.shape == (24, 10)
  np.testing.assert_allclose(np.asarray(quant.dequantize(qw)), np_nf4_dequant(w, 1), rtol=1e-6)


def _cfg(mode):
  return configs.ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=16, mlp_dim=128, init_std=0.1, base_quant=mode)


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (4, 12)).astype(np.int32)
  positions = np.broadcast_to(np.arange(12, dtype=np.int32), (4, 12))
  return tokens, positions, np.ones((4, 12), np.int32)


@pytest.mark.parametrize("mode", ["bf16", "int8", "nf4"])
@pytest.mark.slow
def test_logit_error_vs_float32_and_memory(mode):
  cfg = _cfg(mode)
  mesh = sharding.make_mesh("data:-1")
  params = transformer.init(cfg, jax.random.key(0), mesh)
  qparams = quant.quantize_params(transformer.param_specs(cfg), mode, params, mesh)
  batch = _batch()
  fwd = jax.jit(lambda p: transformer.forward(cfg, p, transformer.Inputs(*batch)))
  ref, got = np.asarray(fwd(params)), np.asarray(fwd(qparams))
  rel = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2))
  print(f"{mode}: relative RMS logit error {rel:.4f}, max |error| {np.abs(got - ref).max():.4f}"
        f" (float32 logits std {ref.std():.3f})")
  assert 0 < rel < TOL[mode]

  # Bytes: matrices shrink to 1 byte (int8) or half a byte + 4 bytes per 64 (nf4) per weight.
  specs = transformer.param_specs(cfg)
  mats = [s for s in specs["layers"].values() if s.fan_in]
  rest = transformer.num_params(params) - sum(math.prod(s.shape) for s in mats)
  if mode == "bf16":
    want = sum(2 * math.prod(s.shape) for s in mats) + 4 * rest
    for w, f in zip(jax.tree.leaves(qparams["layers"]), jax.tree.leaves(params["layers"])):
      want_w = np.asarray(f).astype(jnp.bfloat16) if w.dtype == jnp.bfloat16 else np.asarray(f)
      np.testing.assert_array_equal(np.asarray(w), want_w)  # round to nearest, matrices only
  elif mode == "int8":
    scales = sum(math.prod(s.shape) // math.prod(s.shape[1:1 + s.fan_in]) for s in mats)
    want = sum(math.prod(s.shape) for s in mats) + 4 * scales + 4 * rest
  else:
    want = sum(math.prod(s.shape) // 2 + 4 * math.prod(s.shape) // 64 for s in mats) + 4 * rest
  assert transformer.nbytes(qparams) == want
  abstract = quant.abstract_quantized(specs, mode, transformer.abstract(specs))
  assert transformer.nbytes(abstract) == want
  assert jax.tree.structure(abstract) == jax.tree.structure(qparams)


@pytest.mark.parametrize("mode", ["bf16", "int8", "nf4"])
@pytest.mark.slow
def test_forward_is_dequantized_float_forward_sharded_and_lora_trains(mode):
  cfg = _cfg(mode)
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  params = transformer.init(cfg, jax.random.key(0), mesh)
  qparams = quant.quantize_params(transformer.param_specs(cfg), mode, params, mesh)
  deq = jax.tree.map(as_float, qparams, is_leaf=quant.is_quantized)
  batch = _batch()
  fwd = jax.jit(lambda p: transformer.forward(cfg, p, transformer.Inputs(*batch)))
  np.testing.assert_allclose(np.asarray(fwd(qparams)), np.asarray(fwd(deq)), atol=1e-5)
  lcfg = configs.LoraConfig(lora_rank=4, lora_targets=("q", "v", "down"))
  lora = lora_lib.init(cfg, lcfg, jax.random.key(1), mesh)

  def loss(lp, base):
    return transformer.forward(cfg, base, transformer.Inputs(*batch), transformer.Adapter(lp,
        lcfg.scale)).mean()

  grad = jax.jit(jax.grad(loss))
  g_q, g_f = grad(lora, qparams), grad(lora, deq)
  for a, b in zip(jax.tree.leaves(g_q), jax.tree.leaves(g_f)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  assert float(jnp.abs(g_q["layers"]["q"]["b"]).sum()) > 0


def test_none_leaves_params_alone():
  cfg = _cfg("none")
  mesh = sharding.make_mesh("data:-1")
  params = transformer.init(cfg, jax.random.key(0), mesh)
  specs = transformer.param_specs(cfg)
  assert quant.quantize_params(specs, "none", params, mesh) is params
  base = transformer.abstract(specs)
  assert quant.abstract_quantized(specs, "none", base) is base


@pytest.mark.parametrize("mode", ["bf16", "int8", "nf4"])
def test_base_born_quantized_one_layer_at_a_time(mode):
  """transformer.init_base: the tree, dtypes and shardings quantize_params gives the float init,
  the float leaves value for value, the quantized layers drawn from the same distribution; and
  its compiled init never holds a stacked float32 matrix (its temporaries stay below one)."""
  cfg = configs.ModelConfig(vocab_size=256, d_model=128, n_layers=32, n_heads=4, n_kv_heads=2,
                    head_dim=32, mlp_dim=512, base_quant=mode)
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  born = transformer.init_base(cfg, jax.random.key(0), mesh)
  float_init = transformer.init(cfg, jax.random.key(0), mesh)
  want = quant.quantize_params(transformer.param_specs(cfg), mode, float_init, mesh)
  assert jax.tree.structure(born) == jax.tree.structure(want)
  for got, ref in zip(jax.tree.leaves(born), jax.tree.leaves(want)):
    assert (got.shape, got.dtype, got.sharding) == (ref.shape, ref.dtype, ref.sharding)
  np.testing.assert_array_equal(born["embed"], float_init["embed"])
  gate = np.asarray(as_float(born["layers"]["gate"]))
  assert abs(gate.std() / cfg.init_std - 1) < 0.05 and abs(gate.mean()) < 1e-3
  assert not np.allclose(gate[0], gate[1])  # each layer its own draw
  stacked = 4 * cfg.n_layers * cfg.d_model * cfg.mlp_dim  # one stacked float32 gate matrix
  temp = transformer.quantized_init(cfg, mesh).lower(jax.random.key(0)).compile()
  assert temp.memory_analysis().temp_size_in_bytes < stacked


def test_a_random_run_with_a_frozen_base_is_born_quantized():
  """A run's random init (dpo.loop.initial_params): with no sft stage the base never trains, so
  it is born in --base_quant's format (`init_base`, an 8B base never exists in float32); with
  an sft stage first it starts in float32 (SFT trains it) and the DPO stage quantizes it."""
  from dpo import loop
  cfg = configs.Config().replace(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                                 n_kv_heads=2, head_dim=16, mlp_dim=128, base_quant="nf4",
                                 stage="dpo")
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  key = jax.random.key(3)
  _, params = loop.initial_params(cfg, key, mesh)
  want = transformer.init_base(cfg.model, key, mesh)
  assert isinstance(params["layers"]["q"], quant.NF4Weight)
  for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(got, ref)
  _, float_params = loop.initial_params(cfg.replace(stage="sft,dpo"), key, mesh)
  assert float_params["layers"]["q"].dtype == jnp.float32
  # The run's log counts a quantized matrix by its float shape.
  assert transformer.num_params(params) == transformer.num_params(float_params)
  int8 = quant.quantize_params(transformer.param_specs(cfg.model), "int8", float_params, mesh)
  assert transformer.num_params(int8) == transformer.num_params(float_params)

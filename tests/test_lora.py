"""LoRA: zero-B identity, merge == base + delta, dropout only in training, sharding follows base."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import LoraConfig, ModelConfig
from models import lora as lora_lib
from models import sharding, transformer

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=48, init_std=0.2)
ALL = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.5,
                 lora_targets=tuple(lora_lib.TARGETS))


@pytest.fixture(scope="module")
def mesh1():
  return sharding.make_mesh("data:1", jax.devices()[:1])


def _inputs():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (2, 9)).astype(np.int32)
  return tokens, np.tile(np.arange(9, dtype=np.int32), (2, 1)), np.ones((2, 9), np.int32)


def _randomize_b(lora, key):
  leaves, tree = jax.tree.flatten(lora)
  keys = jax.random.split(key, len(leaves))
  return tree.unflatten([0.1 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def test_targets_are_the_layer_matrices():
  """Every per-layer matrix (in param_specs order: the dropout stream ids) is a target."""
  specs = transformer.param_specs(CFG)
  matrices = [("layers", n) for n, s in specs["layers"].items() if s.fan_in]
  assert [t.path for t in lora_lib.TARGETS.values()] == matrices
  assert all(name == t.name for name, t in lora_lib.TARGETS.items())


@pytest.mark.parametrize("targets", [("v", "q"), ("down",), tuple(lora_lib.TARGETS)])
def test_specs_sit_at_the_target_paths(targets):
  """The LoRA tree mirrors the params tree: each target's factors at its weight's path."""
  specs = lora_lib.lora_specs(CFG, LoraConfig(lora_rank=3, lora_targets=targets))
  base = transformer.param_specs(CFG)
  got = {path[:-1] for path, _ in jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda x: isinstance(x, transformer.ParamSpec))[0]}
  want = {tuple(jax.tree_util.DictKey(k) for k in lora_lib.TARGETS[t].path) for t in targets}
  assert got == want
  for t in targets:
    group, leaf = lora_lib.TARGETS[t].path
    w, ab = base[group][leaf], specs[group][leaf]
    assert ab["a"].shape[:-1] == w.shape[:1 + w.fan_in] and ab["a"].shape[-1] == 3
    assert ab["b"].shape[0] == w.shape[0] and ab["b"].shape[2:] == w.shape[1 + w.fan_in:]


def test_shapes_follow_base_specs():
  specs = lora_lib.lora_specs(CFG, ALL)["layers"]
  assert specs["q"]["a"].shape == (2, 32, 4) and specs["q"]["b"].shape == (2, 4, 4, 8)
  assert specs["o"]["a"].shape == (2, 4, 8, 4) and specs["o"]["b"].shape == (2, 4, 32)
  assert specs["down"]["a"].axes == ("layers", "mlp", "lora_rank")
  assert specs["down"]["b"].axes == ("layers", "lora_rank", "embed")


@pytest.mark.slow
def test_zero_b_is_exactly_base(mesh1):
  params = transformer.init(CFG, jax.random.key(0), mesh1)
  lora = lora_lib.init(CFG, ALL, jax.random.key(1), mesh1)
  assert all(float(jnp.abs(ab["b"]).max()) == 0.0 for ab in lora["layers"].values())
  args = _inputs()
  base = transformer.forward(CFG, params, transformer.Inputs(*args))
  with_lora = transformer.forward(CFG, params, transformer.Inputs(*args), transformer.Adapter(lora,
      ALL.scale))
  np.testing.assert_array_equal(np.asarray(base), np.asarray(with_lora))


@pytest.mark.slow
def test_merge_equals_base_plus_delta(mesh1):
  params = transformer.init(CFG, jax.random.key(0), mesh1)
  lora = _randomize_b(lora_lib.init(CFG, ALL, jax.random.key(1), mesh1), jax.random.key(2))
  args = _inputs()
  adapted = transformer.forward(CFG, params, transformer.Inputs(*args), transformer.Adapter(lora,
      ALL.scale))
  merged = transformer.forward(CFG, lora_lib.merge(params, lora, ALL), transformer.Inputs(*args))
  base = transformer.forward(CFG, params, transformer.Inputs(*args))
  assert np.abs(np.asarray(adapted) - np.asarray(base)).max() > 1e-2
  np.testing.assert_allclose(np.asarray(adapted), np.asarray(merged), atol=1e-4, rtol=1e-4)
  # The merged q weight is W + scale * A @ B, written out with numpy.
  a, b = (np.asarray(lora["layers"]["q"][k]) for k in ("a", "b"))
  want = np.asarray(params["layers"]["q"]) + ALL.scale * np.einsum("ldr,lrhk->ldhk", a, b)
  np.testing.assert_allclose(np.asarray(lora_lib.merge(params, lora, ALL)["layers"]["q"]), want,
                             rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dropout_only_with_key(mesh1):
  params = transformer.init(CFG, jax.random.key(0), mesh1)
  lora = _randomize_b(lora_lib.init(CFG, ALL, jax.random.key(1), mesh1), jax.random.key(2))
  args = _inputs()
  run = lambda key: np.asarray(transformer.forward(CFG, params, transformer.Inputs(*args),
      transformer.Adapter(lora, ALL.scale, dropout_key=key, dropout_rate=ALL.lora_dropout)))
  assert np.array_equal(run(None), run(None))
  a, b = run(jax.random.key(3)), run(jax.random.key(4))
  assert not np.allclose(a, run(None)) and not np.allclose(a, b)
  np.testing.assert_array_equal(a, run(jax.random.key(3)))


@pytest.mark.parametrize("rng", ["threefry", "rbg"])
def test_dropout_masks_keep_rate_per_key_on_any_mesh(rng):
  """Both mask generators keep 1 - rate of the slots (within 5 sigma of 2^20 draws), give the
  same mask for the same key and another for another key, and the same mask whether or not the
  masked array is sharded over 4 devices (as `dense` draws it inside a sharded step)."""
  shape, rate = (16, 256, 256), 0.05
  key = jax.random.key(7)
  mask = np.asarray(transformer.keep_mask(key, rate, shape, rng))
  n = mask.size
  assert abs(mask.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / n)
  np.testing.assert_array_equal(mask, transformer.keep_mask(key, rate, shape, rng))
  assert (mask != np.asarray(transformer.keep_mask(jax.random.key(8), rate, shape, rng))).mean() > 0.05
  mesh = sharding.make_mesh("data:4", jax.devices()[:4])
  spread = jax.sharding.NamedSharding(mesh, P("data"))
  x = jax.device_put(jnp.ones(shape, jnp.float32), spread)
  drop = jax.jit(lambda x, k: jnp.where(transformer.keep_mask(k, rate, x.shape, rng), x, 0.0),
                 out_shardings=spread)
  np.testing.assert_array_equal(np.asarray(drop(x, key)), mask.astype(np.float32))


def test_rbg_masks_are_another_stream_and_auto_is_threefry_off_tpu():
  """rbg draws other masks than threefry from the same key (so it is not threefry renamed), and
  --lora_dropout_rng=auto keeps threefry on a CPU: the masks the rest of the suite checks."""
  key, shape = jax.random.key(3), (64, 512)
  a = np.asarray(transformer.keep_mask(key, 0.5, shape, "threefry"))
  b = np.asarray(transformer.keep_mask(key, 0.5, shape, "rbg"))
  assert 0.4 < (a != b).mean() < 0.6
  assert LoraConfig().dropout_rng_impl() == ("rbg" if jax.default_backend() == "tpu"
                                             else "threefry")
  assert LoraConfig(lora_dropout_rng="rbg").dropout_rng_impl() == "rbg"


def test_dropout_rng_without_dropout_refused():
  with pytest.raises(ValueError, match="--lora_dropout_rng=rbg: no LoRA dropout reads it"):
    LoraConfig(lora_dropout=0.0, lora_dropout_rng="rbg")
  with pytest.raises(ValueError, match="--lora_dropout_rng"):
    LoraConfig(lora_dropout_rng="philox")


def test_factor_shardings_follow_base():
  mesh = sharding.make_mesh("fsdp:2,tensor:4", jax.devices()[:8])
  lora = lora_lib.init(CFG, ALL, jax.random.key(1), mesh)
  base = transformer.shardings(transformer.param_specs(CFG), mesh)["layers"]
  assert base["q"].spec == P(None, "fsdp", "tensor", None)
  assert lora["layers"]["q"]["a"].sharding.spec == P(None, "fsdp", None)
  assert lora["layers"]["q"]["b"].sharding.spec == P(None, None, "tensor", None)
  assert lora["layers"]["down"]["a"].sharding.spec == P(None, "tensor", None)


def test_bad_targets_rejected():
  with pytest.raises(ValueError, match="lora_targets"):
    LoraConfig(lora_targets=("q", "qkv"))


def test_explicit_backward_gives_the_factors_autodiff_gradients(mesh1):
  """--matmul_backward=explicit writes out the LoRA factors' backward too (each factor's
  gradient formed in its own layout, so XLA:CPU never transposes the activation gradients it
  contracts); the factors' gradients, dropout on, are JAX's up to summation order."""
  import numerics
  params = transformer.init(CFG, jax.random.key(0), mesh1)
  lora = _randomize_b(lora_lib.init(CFG, ALL, jax.random.key(1), mesh1), jax.random.key(2))
  inputs = transformer.Inputs(*_inputs())
  def grads(cfg):
    adapter = lambda f: transformer.Adapter(f, ALL.scale, dropout_key=jax.random.key(3),
                                            dropout_rate=ALL.lora_dropout)
    return jax.grad(lambda f: transformer.forward(cfg, params, inputs, adapter(f)).mean())(lora)
  explicit = ModelConfig(**{**CFG.__dict__, "matmul_backward": "explicit"})
  tol = numerics.reorder_tol(_inputs()[0].size, numerics.backprop_depth(CFG.n_layers))
  numerics.assert_close({"explicit": (grads(explicit), grads(CFG), tol)})
  # The bound catches a factor gradient that misses the last token of its sum.
  @jax.custom_vjp
  def wrong(x, w):
    return jnp.tensordot(x, w, axes=1)
  def bwd(res, dy):
    x, w = res
    dx, dw = jax.vjp(lambda x, w: jnp.tensordot(x, w, axes=1), x, w)[1](dy)
    lead = list(range(x.ndim - 1))
    return dx, dw - jnp.tensordot(x[:, -1:], dy[:, -1:], axes=(lead, lead))  # [B, T, ...]
  wrong.defvjp(lambda x, w: (wrong(x, w), (x, w)), bwd)
  original = transformer._explicit_matmul
  try:
    is_b = lambda x, w, n_in: n_in == 1 and x.shape[-1] == w.shape[0] == ALL.lora_rank
    transformer._explicit_matmul = lambda x, w, n_in: (wrong(x, w) if is_b(x, w, n_in)
                                                       else original(x, w, n_in))
    numerics.assert_mistake_caught({"explicit": (grads(explicit), grads(CFG), tol)},
                                   "a LoRA B gradient missing the last token")
  finally:
    transformer._explicit_matmul = original

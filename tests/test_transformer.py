"""Model tests: shapes, jit, causality, padding, and a golden check against a numpy transformer."""

import functools
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numerics
from configs import ModelConfig
from models import sharding, transformer

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=48, init_std=0.2)


@pytest.fixture(scope="module")
def mesh1():
  return sharding.make_mesh("data:1", jax.devices()[:1])


@pytest.fixture(scope="module")
def params(mesh1):
  return transformer.init(CFG, jax.random.key(0), mesh1)


def _inputs(B=2, T=10, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
  segments = np.ones((B, T), np.int32)
  return tokens, positions, segments


def _np_forward(cfg, p, tokens, positions):
  """Independent numpy transformer (explicit loops over heads, repeated kv heads)."""
  p = jax.tree.map(np.asarray, p)
  x = p["embed"][tokens].astype(np.float64)
  B, T, _ = x.shape

  def norm(v, w):
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.norm_eps) * w

  def rot(v):  # v [B, T, H, Hd]
    half = v.shape[-1] // 2
    inv = cfg.rope_theta ** (-np.arange(half) / half)
    ang = positions[:, :, None, None] * inv
    a, b = v[..., :half], v[..., half:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)

  group = cfg.n_heads // cfg.n_kv_heads
  for l in range(cfg.n_layers):
    w = {k: v[l] for k, v in p["layers"].items()}
    h = norm(x, w["attn_norm"])
    q = rot(np.einsum("btd,dhk->bthk", h, w["q"]))
    k = rot(np.einsum("btd,dhk->bthk", h, w["k"]))
    v = np.einsum("btd,dhk->bthk", h, w["v"])
    out = np.zeros((B, T, cfg.n_heads, cfg.head_dim))
    for head in range(cfg.n_heads):
      kv = head // group
      s = np.einsum("btk,bsk->bts", q[:, :, head], k[:, :, kv]) / math.sqrt(cfg.head_dim)
      s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
      s = np.exp(s - s.max(-1, keepdims=True))
      s /= s.sum(-1, keepdims=True)
      out[:, :, head] = np.einsum("bts,bsk->btk", s, v[:, :, kv])
    x = x + np.einsum("bthk,hkd->btd", out, w["o"])
    h = norm(x, w["mlp_norm"])
    g = np.einsum("btd,df->btf", h, w["gate"])
    x = x + np.einsum("btf,fd->btd", g / (1 + np.exp(-g)) * np.einsum("btd,df->btf", h, w["up"]),
                      w["down"])
  x = norm(x, p["final_norm"])
  return x @ (p["embed"].T if cfg.tie_embeddings else p["lm_head"])


def test_param_tree_derives_from_specs(params):
  specs = transformer.param_specs(CFG)
  shapes = jax.tree.map(lambda s: s.shape, specs, is_leaf=transformer.is_spec)
  assert jax.tree.map(lambda x: x.shape, params) == shapes
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  assert "lm_head" in params and "lm_head" not in transformer.param_specs(
      ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}))


@pytest.mark.parametrize("jit", [False, True])
def test_forward_shapes_finite(params, jit):
  tokens, positions, segments = _inputs()
  fn = lambda p, t, q, s: transformer.forward(CFG, p, transformer.Inputs(t, q, s))
  fn = jax.jit(fn) if jit else fn
  logits = fn(params, tokens, positions, segments)
  assert logits.shape == (2, 10, CFG.vocab_size) and logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("tie", [False, True])
def test_matches_numpy_reference(mesh1, tie):
  cfg = ModelConfig(**{**CFG.__dict__, "tie_embeddings": tie})
  p = transformer.init(cfg, jax.random.key(1), mesh1)
  tokens, positions, segments = _inputs(T=12)
  got = np.asarray(transformer.forward(cfg, p, transformer.Inputs(tokens, positions, segments)))
  want = _np_forward(cfg, p, tokens, positions)
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.slow
def test_causality_by_gradient(params):
  """d logits[t] / d (input embedding at position s) is zero for every s > t.

  Each position gets its own embedding row (ids V + s), so the gradient with respect to row
  V + s is the gradient with respect to position s's input.
  """
  T, V = 8, CFG.vocab_size
  tokens, positions, segments = _inputs(B=1, T=T)
  cfg = ModelConfig(**{**CFG.__dict__, "vocab_size": V + T})
  p = dict(params, embed=jnp.concatenate([params["embed"], params["embed"][tokens[0]]], 0),
           lm_head=jnp.pad(params["lm_head"], ((0, 0), (0, T))))
  ids = (V + np.arange(T, dtype=np.int32))[None]

  def logit_sum(embed, t):
    return transformer.forward(cfg, dict(p, embed=embed), transformer.Inputs(ids, positions,
        segments))[0, t].sum()

  for t in (0, 3, 6):
    g = np.abs(np.asarray(jax.grad(logit_sum)(p["embed"], t))[V:]).sum(-1)
    assert g[t + 1:].max() == 0.0
    assert g[: t + 1].min() > 0.0


def test_right_padding_does_not_change_real_positions(params):
  tokens, positions, segments = _inputs(B=1, T=6)
  padded = np.concatenate([tokens, np.full((1, 4), 5, np.int32)], 1)
  pos = np.concatenate([positions, np.zeros((1, 4), np.int32)], 1)
  seg = np.concatenate([segments, np.zeros((1, 4), np.int32)], 1)
  a = transformer.forward(CFG, params, transformer.Inputs(tokens, positions, segments))
  b = transformer.forward(CFG, params, transformer.Inputs(padded, pos, seg))[:, :6]
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.slow
def test_packed_segments_are_independent(params):
  """Two sequences packed in one row (segments 1, 2) give the same logits as run alone."""
  t1, p1, s1 = _inputs(B=1, T=5, seed=1)
  t2, p2, s2 = _inputs(B=1, T=7, seed=2)
  packed = transformer.forward(CFG, params, transformer.Inputs(np.concatenate([t1, t2], 1),
      np.concatenate([p1, p2], 1), np.concatenate([s1, 2 * s2], 1)))
  a = transformer.forward(CFG, params, transformer.Inputs(t1, p1, s1))
  b = transformer.forward(CFG, params, transformer.Inputs(t2, p2, s2))
  np.testing.assert_allclose(np.asarray(packed[:, :5]), np.asarray(a), atol=1e-5)
  np.testing.assert_allclose(np.asarray(packed[:, 5:]), np.asarray(b), atol=1e-5)


def test_branches_after_a_shared_prefix_are_independent(params):
  """prompt | a | b in one row, b's positions restarting after the prompt and branch ids 0/1/2,
  gives a's and b's logits as the rows prompt + a and prompt + b run alone."""
  tp, pp, sp = _inputs(B=1, T=4, seed=3)
  ta, tb = _inputs(B=1, T=3, seed=4)[0], _inputs(B=1, T=5, seed=5)[0]
  row = np.concatenate([tp, ta, tb], 1)
  pos = np.concatenate([pp, 4 + np.arange(3)[None], 4 + np.arange(5)[None]], 1).astype(np.int32)
  branch = np.array([[0] * 4 + [1] * 3 + [2] * 5], np.int32)
  shared = transformer.forward(CFG, params, transformer.Inputs(row, pos, np.ones_like(row), branch))
  for t, sl in ((ta, slice(4, 7)), (tb, slice(7, 12))):
    alone = np.concatenate([tp, t], 1)
    want = transformer.forward(CFG, params, transformer.Inputs(alone,
        np.arange(alone.shape[1])[None], np.ones_like(alone)))
    np.testing.assert_allclose(np.asarray(shared[:, :4]), np.asarray(want[:, :4]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(shared[:, sl]), np.asarray(want[:, 4:]), atol=1e-5)


@pytest.mark.slow
def test_bfloat16_remat_unrolled_layers_and_explicit_backward(mesh1, params, monkeypatch):
  tokens, positions, segments = _inputs()
  ref = transformer.forward(CFG, params, transformer.Inputs(tokens, positions, segments))
  bf = ModelConfig(**{**CFG.__dict__, "compute_dtype": "bfloat16"})
  out = transformer.forward(bf, params, transformer.Inputs(tokens, positions, segments))
  assert out.dtype == jnp.float32
  assert np.abs(np.asarray(out) - np.asarray(ref)).max() < 0.1
  loss = lambda c: lambda p: transformer.forward(c, p, transformer.Inputs(tokens, positions,
      segments)).mean()
  grads = lambda switch: jax.grad(loss(ModelConfig(**{**CFG.__dict__, **switch})))(params)
  g1 = grads({})
  # Rematerialised layers, the layers unrolled out of the scan, and the explicit matmul
  # backward give the same gradients, up to the reordering bound of tests/numerics.py (the
  # weight gradients sum over the tokens).
  tol = numerics.reorder_tol(tokens.size, numerics.backprop_depth(CFG.n_layers))
  explicit = {"matmul_backward": "explicit"}
  numerics.assert_close({str(switch): (grads(switch), g1, tol) for switch in (
      {"remat": True}, {"remat": True, "remat_policy": "dots"}, {"scan_unroll": CFG.n_layers},
      explicit, {**explicit, "scan_unroll": CFG.n_layers}, {**explicit, "remat": True})})
  # Negative control: a written-out backward whose weight gradient misses the last token of
  # the sum misses the same bound by orders of magnitude.
  @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
  def short_sum(x, w, n_in):
    return jnp.tensordot(x, w, axes=n_in)

  def bwd(n_in, res, dy):
    x, w = res
    dx, dw = jax.vjp(lambda x, w: jnp.tensordot(x, w, axes=n_in), x, w)[1](dy)
    last = (slice(None),) * (x.ndim - n_in - 1) + (slice(-1, None),)
    return dx, dw - jnp.tensordot(x[last], dy[last], axes=(list(range(x.ndim - n_in)),) * 2)

  short_sum.defvjp(lambda x, w, n_in: (short_sum(x, w, n_in), (x, w)), bwd)
  monkeypatch.setattr(transformer, "_explicit_matmul", short_sum)
  numerics.assert_mistake_caught({"explicit": (grads(explicit), g1, tol)},
                                 "a weight gradient missing the last token")


@pytest.mark.parametrize("lead,n_in,out", [((5,), 1, (3,)), ((2, 3, 5), 1, (4,)),
                                           ((2, 3), 2, (7,)), ((4,), 1, (2, 3))])
def test_matmul_gradients_are_autodiffs(lead, n_in, out):
  """transformer.matmul's explicit backward gives JAX's own gradients of tensordot, for
  any lead (token) and input/output dims, under jit and vmap."""
  rng = np.random.default_rng(0)
  ins = (4, 6)[:n_in]
  x = jnp.asarray(rng.normal(size=(*lead, *ins)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(*ins, *out)), jnp.float32)
  c = jnp.asarray(rng.normal(size=(*lead, *out)), jnp.float32)
  ours = lambda x, w: jnp.sum(jnp.sin(transformer.matmul(x, w, n_in, explicit=True)) * c)
  theirs = lambda x, w: jnp.sum(jnp.sin(jnp.tensordot(x, w, axes=n_in)) * c)
  for a, b in zip(jax.jit(jax.grad(ours, (0, 1)))(x, w), jax.grad(theirs, (0, 1))(x, w)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  # Under vmap over rows (three of them, the weight shared): per-row gradients, and the
  # gradient of the summed rows (the unshared layout's vmap over chosen/rejected).
  xs = jnp.stack([x, 2 * x, -x])
  per_row = lambda f: jax.vmap(jax.grad(f, 1), in_axes=(0, None))(xs, w)
  summed = lambda f: jax.grad(lambda w: jax.vmap(f, in_axes=(0, None))(xs, w).sum())(w)
  for g in (per_row, summed):
    np.testing.assert_allclose(np.asarray(g(ours)), np.asarray(g(theirs)), rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize("n_kv_heads,head_dim,packing", [(2, 16, 1), (4, 32, 2), (8, 64, 2), (8, 16, 4),
                                                         (3, 64, 1), (2, 128, 1), (1, 48, 1)])
def test_kv_cache_packs_heads_into_lanes_and_attends_as_attention_does(n_kv_heads, head_dim,
                                                                       packing):
  """The cache holds `cache_packing` kv heads side by side in a row's lanes; a prefill and a
  decode step written through `_cache_writer` and read by `_attend_cache` give `attend`'s
  output over the same keys, values and mask."""
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2 * n_kv_heads,
                    n_kv_heads=n_kv_heads, head_dim=head_dim, mlp_dim=48)
  assert transformer.cache_packing(cfg) == packing
  if (n_kv_heads, head_dim) == (8, 64):  # a mesh splitting the 8 heads 8 ways keeps 8 rows
    assert transformer.cache_packing(cfg, ways=4) == 2 and transformer.cache_packing(cfg, 8) == 1
  B, S, G = 3, 16, 2
  k_q, k_k, k_v, k_m = jax.random.split(jax.random.key(0), 4)
  k_BSKk = jax.random.normal(k_k, (B, S, n_kv_heads, head_dim))
  v_BSKk = jax.random.normal(k_v, (B, S, n_kv_heads, head_dim))
  mask_BS = jax.random.bernoulli(k_m, 0.7, (B, S)).at[:, 0].set(True)
  cache = jax.tree.map(lambda x: x.astype(jnp.float32), transformer.init_cache(cfg, B, S))
  assert cache.k[0].shape == (B, n_kv_heads // packing, S, packing * head_dim)
  for start, T in ((0, S - 1), (S - 1, 1)):  # a prefill, then one decode step
    write = transformer._cache_writer(cache.k[0], cache.v[0], start)
    k_all, v_all = write(k_BSKk[:, start:start + T], v_BSKk[:, start:start + T])
    cache = cache._replace(k=(k_all,), v=(v_all,))
    q_BTKGk = jax.random.normal(jax.random.fold_in(k_q, start), (B, T, n_kv_heads, G, head_dim))
    written_BS = mask_BS & (jnp.arange(S) < start + T)
    mask_BTS = jnp.broadcast_to(written_BS[:, None], (B, T, S))
    got = transformer._attend_cache(cfg, q_BTKGk, k_all, v_all, mask_BTS)
    want = transformer.attend(cfg, q_BTKGk, k_BSKk, v_BSKk, mask_BTS)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_config_rejected():
  with pytest.raises(ValueError, match="n_kv_heads"):
    ModelConfig(n_heads=4, n_kv_heads=3)


def test_model_modules_import_neither_configs_nor_each_other_in_a_cycle():
  """configs.py imports models.lora and models.archs; none of models/ but hf.py may import it
  back, and quant (imported by transformer) must not import transformer."""
  code = ("import sys\n"
          "import models.archs, models.quant\n"
          "assert 'models.transformer' not in sys.modules\n"
          "import models.lora, models.sampler, models.sharding\n"
          "bad = sorted(m for m in sys.modules if m == 'configs' or m.startswith('dpo'))\n"
          "assert not bad, bad\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  subprocess.run([sys.executable, "-c", code], cwd=root, check=True,
                 env={**os.environ, "PYTHONPATH": root})

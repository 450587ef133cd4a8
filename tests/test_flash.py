"""The Pallas attention kernel (models/flash.py) against the XLA path it must equal.

The XLA path (`transformer.attention_mask` and `transformer.attend`) is the definition. On a
CPU the kernel runs in Pallas's interpret mode, the same tile program a TPU runs. Outputs are
compared at real query slots only: a padding slot sees no key, and the kernel gives it 0 where
the XLA path averages every value; no real slot depends on it.
"""

import contextlib
import dataclasses
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import flash, sharding, transformer
from models.config import ModelConfig
from tests import numerics


def _rows(B, T, *, packed=False, branches=False, pad=0):
  """Segment and branch ids of B rows of T slots: one sequence a row, or packed ones, prompt |
  chosen | rejected branches, `pad` padding slots at the end of the last row."""
  segment = np.ones((B, T), np.int32)
  branch = np.zeros((B, T), np.int32)
  if packed:
    segment[:, T // 2:] = 2
  if branches:
    for start in (0, T // 2) if packed else (0,):
      n = T // 2 if packed else T
      branch[:, start + n // 3:start + 2 * n // 3] = 1
      branch[:, start + 2 * n // 3:start + n] = 2
  if pad:
    segment[-1, T - pad:] = 0
    branch[-1, T - pad:] = 0
  return jnp.asarray(segment), jnp.asarray(branch) if branches else None


def _xla(q, k, v, segment, branch, window, scale, softcap):
  index = jnp.broadcast_to(jnp.arange(q.shape[1]), segment.shape)
  slots = transformer.Slots(segment, index, branch)
  cfg = ModelConfig(head_dim=q.shape[-1], query_scale=scale ** -2, attn_softcap=softcap)
  return transformer.attend(cfg, q, k, v, transformer.attention_mask(slots, slots, window))


def _inputs(B, T, K, G, d, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, T, K, G, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(B, T, K, d)), dtype) for _ in range(2))
  return q, k, v, jnp.asarray(rng.normal(size=(B, T, K, G, d)), jnp.float32)


def _value_and_grads(fn, q, k, v, weights, real):
  """The output at real slots and the gradients of sum(out * weights) (weights 0 at padding)."""
  w = weights * real[:, :, None, None, None]
  loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
  out = fn(q, k, v) * real[:, :, None, None, None]
  return out, jax.grad(loss, (0, 1, 2))(q, k, v)


CASES = {  # name: (rows, window, softcap, G, T)
    "causal": (dict(), 0, 0.0, 1, 200),
    "packed_padded": (dict(packed=True, pad=37), 0, 0.0, 2, 300),
    "branches": (dict(branches=True), 0, 0.0, 4, 256),
    "packed_branches": (dict(packed=True, branches=True, pad=20), 0, 0.0, 2, 300),
    "window_inside_tile": (dict(packed=True), 37, 0.0, 2, 300),
    "window_across_tiles": (dict(branches=True), 170, 0.0, 2, 384),
    "softcap": (dict(branches=True), 0, 5.0, 2, 200),
    "softcap_window": (dict(), 50, 3.0, 1, 256),
    # Tile-aligned rows: FULL tiles (no mask built) and EMPTY ones (skipped) inside the causal range.
    "branches_tile_aligned": (dict(branches=True), 0, 0.0, 4, 384),
    "packed_tile_aligned": (dict(packed=True), 0, 0.0, 2, 512),
    "window_whole_tiles": (dict(), 256, 0.0, 2, 512),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tile_kinds_against_the_mask(case):
  """flash.tile_kinds: a FULL tile has every score unmasked and an EMPTY one none (the
  definition's mask, transformer.attention_mask); on the tile-aligned rows every tile is
  classified exactly, and FULL and EMPTY tiles both occur."""
  rows, window, _, _, T = CASES[case]
  segment, branch = _rows(2, T, **rows)
  tile = 128
  Tp = -(-T // tile) * tile
  pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)])
  branch_ids = jnp.zeros_like(segment) if branch is None else branch
  spec = flash.Spec(1.0, 0.0, branch is not None, tile, tile, True)
  kinds = np.asarray(flash.tile_kinds(pad(segment), pad(branch_ids), jnp.asarray([window]), spec))
  index = jnp.broadcast_to(jnp.arange(Tp), (2, Tp))
  slots = transformer.Slots(pad(segment), index, None if branch is None else pad(branch))
  mask = np.asarray(transformer.attention_mask(slots, slots, window))  # [B, Tp, Tp]
  n = Tp // tile
  seen = mask.reshape(2, n, tile, n, tile).transpose(0, 1, 3, 2, 4).reshape(2, n, n, -1)
  kinds = kinds.reshape(2, n, n)
  assert seen[kinds == flash.FULL].all() and not seen[kinds == flash.EMPTY].any()
  if "aligned" in case or "whole" in case:
    exact = np.where(seen.all(-1), flash.FULL, np.where(seen.any(-1), flash.PARTIAL, flash.EMPTY))
    np.testing.assert_array_equal(kinds, exact)
    causal = np.broadcast_to(np.tril(np.ones((n, n), bool)), kinds.shape)
    assert (kinds == flash.FULL).any() and (kinds[causal] == flash.EMPTY).any()


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_equals_xla_outputs_and_gradients(case):
  rows, window, softcap, G, T = CASES[case]
  B, K, d = 2, 2, 32
  segment, branch = _rows(B, T, **rows)
  q, k, v, weights = _inputs(B, T, K, G, d)
  scale = d ** -0.5
  kernel = lambda q, k, v: flash.attention(q, k, v, segment, branch, window, scale=scale,
                                           softcap=softcap, block=128)
  xla = lambda q, k, v: _xla(q, k, v, segment, branch, window, scale, softcap)
  real = (segment != 0).astype(jnp.float32)
  got, want = (_value_and_grads(f, q, k, v, weights, real) for f in (kernel, xla))
  tol = numerics.reorder_tol(T, depth=4)
  numerics.assert_close({"out": (got[0], want[0], tol), "grads": (got[1], want[1], tol)})


def test_heads_a_step_fit_the_chips_vmem():
  """A grid step takes all G heads of a kv head when their blocks fit the scoped VMEM, else the
  largest divisor of G that does; past the default limit the kernels ask for more explicitly."""
  spec = flash.Spec(0.125, 0.0, True, 512, 512, False)
  v5e, v4 = 96 * 2**20, flash.DEFAULT_VMEM
  # Llama-3.2-1B (4 heads of 64 a kv head, bfloat16) fits the default limit whole.
  assert flash.heads_a_step(4, 64, 2, spec, v5e) == (4, flash.vmem_bytes(4, 64, 2, spec))
  assert flash.vmem_bytes(4, 64, 2, spec) <= flash.DEFAULT_VMEM
  # Qwen2.5-0.5B (7 heads): over the default 16 MiB (the compiler asked 18.4 MiB for the
  # forward on a v5e), within a v5e's 96 MiB; on a 16 MiB v4 core one head a step (7 is prime).
  assert flash.heads_a_step(7, 64, 2, spec, v5e)[0] == 7
  assert flash.vmem_bytes(7, 64, 2, spec) > flash.DEFAULT_VMEM
  assert flash.heads_a_step(7, 64, 2, spec, v4)[0] == 1
  assert flash.heads_a_step(8, 64, 2, spec, v4)[0] == 4
  assert flash.vmem_capacity() == flash.DEFAULT_VMEM  # off a TPU: plan as a 16 MiB core


@pytest.mark.slow
@pytest.mark.parametrize("heads", [1, 2])
def test_kernel_with_heads_in_groups_equals_xla(heads):
  """With too little VMEM for all G = 4 heads a step, the kernel runs groups of `heads` (the dk
  and dv accumulators run over the groups in turn) and still equals the XLA path."""
  B, T, K, G, d, window = 2, 384, 2, 4, 32, 170
  segment, branch = _rows(B, T, packed=True, branches=True, pad=20)
  q, k, v, weights = _inputs(B, T, K, G, d, seed=3)
  spec = flash.Spec(1.0, 0.0, True, 128, 128, True)
  vmem = flash.vmem_bytes(heads, d, 4, spec)
  assert flash.heads_a_step(G, d, 4, spec, vmem)[0] == heads
  kernel = lambda q, k, v: flash.attention(q, k, v, segment, branch, window, scale=d ** -0.5,
                                           block=128, vmem=vmem)
  xla = lambda q, k, v: _xla(q, k, v, segment, branch, window, d ** -0.5, 0.0)
  real = (segment != 0).astype(jnp.float32)
  got, want = (_value_and_grads(f, q, k, v, weights, real) for f in (kernel, xla))
  tol = numerics.reorder_tol(T, depth=4)
  numerics.assert_close({"out": (got[0], want[0], tol), "grads": (got[1], want[1], tol)})


@pytest.mark.slow
def test_a_kernel_without_the_branch_mask_misses_the_bound():
  """The negative control: the same comparison with the branches dropped from the kernel (sibling
  completions see each other) misses the bound by orders of magnitude."""
  B, T, K, G, d = 1, 256, 1, 2, 32
  segment, branch = _rows(B, T, branches=True)
  q, k, v, weights = _inputs(B, T, K, G, d)
  kernel = lambda q, k, v: flash.attention(q, k, v, segment, None, 0, scale=d ** -0.5, block=128)
  xla = lambda q, k, v: _xla(q, k, v, segment, branch, 0, d ** -0.5, 0.0)
  real = jnp.ones((B, T))
  got, want = (_value_and_grads(f, q, k, v, weights, real) for f in (kernel, xla))
  tol = numerics.reorder_tol(T, depth=4)
  numerics.assert_mistake_caught({"out": (got[0], want[0], tol), "grads": (got[1], want[1], tol)},
                                 "kernel without branches")


@pytest.mark.slow
def test_bfloat16_kernel_is_as_close_to_float32_as_xla_in_bfloat16():
  """In bfloat16 neither path equals float32; the kernel, whose tile scores stay float32, is at
  least as close to the float32 definition as the XLA path in bfloat16 is."""
  B, T, K, G, d = 2, 256, 2, 2, 64
  segment, branch = _rows(B, T, packed=True, branches=True)
  q, k, v, _ = _inputs(B, T, K, G, d)
  exact = _xla(q, k, v, segment, branch, 0, d ** -0.5, 0.0)
  low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  kernel = flash.attention(*low, segment, branch, 0, scale=d ** -0.5, block=128)
  xla = _xla(*low, segment, branch, 0, d ** -0.5, 0.0)
  assert kernel.dtype == jnp.bfloat16
  assert numerics.rel_err(kernel, exact) <= 1.5 * numerics.rel_err(xla, exact)


CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  mlp_dim=96, sliding_window=24, sliding_pattern=2, attn_softcap=20.0)


def _model_grads(cfg, mesh):
  """Loss and parameter gradients of `forward` on packed, branched, padded rows."""
  params = transformer.init(cfg, jax.random.key(0), mesh)
  B, T = 4, 150
  segment, branch = _rows(B, T, packed=True, branches=True, pad=30)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  inputs = transformer.Inputs(tokens, positions, segment, branch)

  def loss(p):
    logp = jax.nn.log_softmax(transformer.forward(cfg, p, inputs))
    return jnp.sum(jnp.where(segment[..., None] != 0, logp, 0.0)[..., :8])

  with jax.set_mesh(mesh):
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["data:1", "data:2,tensor:2"])
def test_model_with_the_kernel_equals_the_xla_model(mesh_spec):
  """The whole forward and backward (sliding and global layers, soft-cap, GQA, packed rows with
  branches and padding) with --attention=pallas equals --attention=xla; on a data x tensor mesh
  the kernel runs per shard under shard_map."""
  mesh = sharding.make_mesh(mesh_spec, jax.devices()[:math.prod(
      int(p.split(":")[1]) for p in mesh_spec.split(","))])
  want = _model_grads(dataclasses.replace(CFG, attention="xla"), mesh)
  got = _model_grads(dataclasses.replace(CFG, attention="pallas"), mesh)
  tol = numerics.reorder_tol(150, depth=numerics.backprop_depth(CFG.n_layers))
  numerics.assert_close({"loss": (got[0], want[0], tol), "grads": (got[1], want[1], tol)})


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["attention", "projections"])
def test_remat_policies_keep_the_kernels_values_and_the_gradients(policy):
  """--remat_policy=attention / projections: the gradients equal the plain remat's; the backward
  reads the kernel's output and log-sum-exp that the forward kept (among the layer's saved
  residuals, of which --remat_policy=nothing keeps none), with projections also the kernel's q,
  k, v and each layer's residual stream after attention and MLP gate and up. Off the kernel the
  policy is refused."""
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  cfg = dataclasses.replace(CFG, attention="pallas", remat=True)
  want = _model_grads(cfg, mesh)
  got = _model_grads(dataclasses.replace(cfg, remat_policy=policy), mesh)
  tol = numerics.reorder_tol(150, depth=numerics.backprop_depth(CFG.n_layers))
  numerics.assert_close({"loss": (got[0], want[0], tol), "grads": (got[1], want[1], tol)})

  q, k, v, _ = _inputs(2, 128, 2, 2, 16)
  segment, branch = _rows(2, 128, branches=True)
  layer = lambda q, k, v: jnp.sin(flash.attention(q, k, v, segment, branch, scale=0.25,
                                                  block=128))

  def saved(fn, policy, *args):  # jax.ad_checkpoint's printout: a line per residual kept
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(
          jax.checkpoint(fn, policy=transformer._REMAT_POLICIES[policy]), *args)
    return out.getvalue().splitlines()

  kept = [w for w in saved(layer, policy, q, k, v) if flash.RESIDUALS in w]
  assert len(kept) == 2  # the output [B, K, G, T, d] and the log-sum-exp [B, K, G, T]
  assert not [w for w in saved(layer, "nothing", q, k, v) if flash.RESIDUALS in w]
  if policy == "projections":
    assert len([w for w in saved(layer, policy, q, k, v) if flash.INPUTS in w]) == 3
    # A model layer keeps exactly q, k, v and the output (the kernel's [B, K, G, T, d] layout),
    # the log-sum-exp, its input and the residual stream after attention [B, T, D], and the MLP's
    # gate and up [B, T, F]; with --remat_policy=nothing, its input only.
    lcfg = dataclasses.replace(cfg, n_layers=1)
    params = transformer.init(lcfg, jax.random.key(0), mesh)
    B, T, D, F = 2, 128, CFG.d_model, CFG.mlp_dim
    H, K, d = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    inputs = transformer.Inputs(jnp.zeros((B, T), jnp.int32),
                                jnp.broadcast_to(jnp.arange(T), (B, T)),
                                jnp.ones((B, T), jnp.int32))

    def kept_by_layers(policy):
      out = io.StringIO()
      with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda p: transformer.hidden(
            dataclasses.replace(lcfg, remat_policy=policy), p, inputs).sum(), params)
      return sorted(w.split()[0] for w in out.getvalue().splitlines() if "output of scan" in w
                    and w.startswith("f32[1,"))

    shape = lambda *dims: "f32[" + ",".join(map(str, (1, *dims))) + "]"
    assert kept_by_layers("projections") == sorted(
        [shape(B, K, H // K, T, d)] * 2 + [shape(B, K, T, d)] * 2 + [shape(B, K, H // K, T)]
        + [shape(B, T, D)] * 2 + [shape(B, T, F)] * 2)
    assert kept_by_layers("nothing") == [shape(B, T, D)]
  with pytest.raises(ValueError, match=f"--remat_policy={policy}: keeps the Pallas attention's "
                                       "values, and this cpu run's attention is XLA's"):
    _model_grads(dataclasses.replace(cfg, attention="auto", remat_policy=policy), mesh)
  with pytest.raises(ValueError, match=f"--remat_policy={policy}: .* --attention=xla has none"):
    ModelConfig(attention="xla", remat=True, remat_policy=policy)


def test_platform_picks_the_kernel_and_config_rules():
  assert not ModelConfig().flash_attention()  # auto: xla off a TPU (this test runs on a CPU)
  assert ModelConfig(attention="pallas").flash_attention()
  assert not ModelConfig(attention="xla").flash_attention()
  with pytest.raises(ValueError, match="--attention_block=64: applies to --attention=xla"):
    ModelConfig(attention="pallas", attention_block=64)
  with pytest.raises(ValueError, match="attention_tile"):
    ModelConfig(attention_tile=100)
  with pytest.raises(ValueError, match="--attention_tile=256: the Pallas kernel's tile"):
    ModelConfig(attention="xla", attention_tile=256)
  with pytest.raises(ValueError, match="--remat_policy=dots: applies with --remat=True"):
    ModelConfig(remat_policy="dots")

"""Attention without [T, T] scores in memory: a Pallas flash-attention kernel, forward and backward.

The definition it must equal is the XLA path in models/transformer.py (`attention_mask` and
`attend`): softmax over scaled (and optionally soft-capped) query-key scores, masked by the
slots' segments (same segment, never a padding key), causality, an optional sliding window and
the shared-prefix rows' branches (a prompt key is seen by every later query of its segment, a
completion key only by its own branch). Here the scores of one [block_q, block_k] tile live in
on-chip memory only: the forward keeps a running max and sum per query (online softmax) and
saves the log-sum-exp; the backward recomputes each tile's probabilities from it (FlashAttention-2,
Dao 2023, Algorithms 1 and 2). Tiles wholly above the causal diagonal or outside the window are
skipped, neither computed nor fetched. Every other tile has a kind (`tile_kinds`, from the ids'
ranges over the tile, passed to the kernels as a scalar-prefetch table): EMPTY tiles (a rejected
completion's queries against the chosen one's keys, another packed sequence) are skipped, FULL
tiles (every score unmasked: a completion against its prompt) build no mask, PARTIAL ones mask
slot by slot. A grid step takes the G query heads that share a key/value head together, so each
tile's keys, values and mask are fetched and built once for the G heads; when G heads' blocks do
not fit the chip's on-chip vector memory (VMEM), a grid step takes the largest divisor of G that
does (`heads_a_step`), and the key/value gradients accumulate over the groups in turn.

Layout: queries [B, T, K, G, head_dim] (G query heads per kv head, grouped-query attention), keys
and values [B, T, K, head_dim], the slots' segment and branch ids [B, T]; query and key slots are
the same 0..T-1 (a training forward, no KV cache). Inside, the kernels read queries as
[B, K, G, T, head_dim] and keys and values as [B, K, T, head_dim]. The kernel runs on a TPU; elsewhere it runs in
Pallas's interpret mode (slow, for tests). A query that sees no key (a padding slot) gets 0, where
the XLA path averages every value; no real slot is such a query (each sees itself).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES, SUBLANES = 128, 8
RESIDUALS = "flash_attention_out"  # the checkpoint name of the kernel's output and log-sum-exp
INPUTS = "flash_attention_in"  # the checkpoint name of its q, k and v, in the kernel's layout
_MASKED = -0.7 * float(np.finfo(np.float32).max)  # finite: exp(_MASKED - m) is 0, never NaN


DEFAULT_VMEM = 16 * 2**20  # the scoped VMEM a Mosaic kernel may use unless its call says more


class Spec(NamedTuple):
  """The kernel's static settings: score scale, logit soft-cap (0: none), whether rows carry
  branch ids, tile sizes (multiples of 128), interpret mode (off a TPU), the query heads a grid
  step takes (a divisor of G) and the scoped VMEM the kernels ask for (None: the default)."""
  scale: float
  softcap: float
  branches: bool
  block_q: int
  block_k: int
  interpret: bool
  heads: int = 1
  vmem_limit: int | None = None


def attention(q_BTKGd, k_BTKd, v_BTKd, segment_BT, branch_BT, window=0, *, scale: float,
              softcap: float = 0.0, block: int = 512, vmem: int | None = None) -> jax.Array:
  """Masked softmax attention [B, T, K, G, head_dim] of the queries over the keys (see the module
  docstring). `window` (an int or an int32 scalar, traced or not) > 0 keeps only the keys with
  q - k < window; `branch_BT` None means rows without branches. `vmem`: the on-chip memory a
  kernel may plan for (default: `vmem_capacity()`). Differentiable in q, k and v."""
  B, T, K, G, d = q_BTKGd.shape
  tile = min(block, _round_up(T, LANES))
  Tp = _round_up(T, tile)
  spec = Spec(float(scale), float(softcap), branch_BT is not None, tile, tile,
              jax.default_backend() != "tpu")
  capacity = vmem_capacity() if vmem is None else vmem
  heads, need = heads_a_step(G, d, jnp.dtype(q_BTKGd.dtype).itemsize, spec, capacity)
  if need > capacity and not spec.interpret:
    raise ValueError(f"--attention_tile={block}: a grid step of one head of {d} holds about "
                     f"{need / 2**20:.1f} MiB of VMEM, over the {capacity / 2**20:.0f} MiB this "
                     f"chip gives a kernel; take a smaller tile")
  spec = spec._replace(heads=heads, vmem_limit=None if need <= DEFAULT_VMEM else capacity)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
  q_BKGTd = jnp.moveaxis(pad(q_BTKGd), 1, 3)
  k_BKTd, v_BKTd = (jnp.moveaxis(pad(x), 1, 2) for x in (k_BTKd, v_BTKd))
  branch_BT = jnp.zeros_like(segment_BT) if branch_BT is None else branch_BT
  segment_BT, branch_BT = (pad(x.astype(jnp.int32)) for x in (segment_BT, branch_BT))
  window = jnp.asarray(window, jnp.int32).reshape(1)
  kinds = tile_kinds(segment_BT, branch_BT, window, spec)
  o_BKGTd = _flash(q_BKGTd, k_BKTd, v_BKTd, _Ids.of(segment_BT, branch_BT), window, kinds, spec)
  return jnp.moveaxis(o_BKGTd, 3, 1)[:, :T]


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def vmem_capacity() -> int:
  """The scoped VMEM a kernel may plan for on this platform: three quarters of a TPU core's
  VMEM, and never less than the default scoped limit (a TPU v4 core's whole 16 MiB; 96 MiB on a
  v5e). Off a TPU (interpret mode, no such limit), the default, so a CPU plans as a v4 does."""
  if jax.default_backend() != "tpu":
    return DEFAULT_VMEM
  return max(DEFAULT_VMEM, pltpu.get_tpu_info().vmem_capacity_bytes * 3 // 4)


def vmem_bytes(heads: int, d: int, itemsize: int, spec: Spec) -> int:
  """An upper estimate of the scoped VMEM one grid step of the largest of the three kernels
  holds with `heads` query heads a step: every block double-buffered, the minor dimension padded
  to 128 lanes, the float32 scratch, and four float32 [block_q, block_k] tile temporaries (scores,
  probabilities, mask, their gradient). At 7 heads of 64 with 512-slot tiles in bfloat16 this
  gives 20.6 MiB; the TPU v5e compiler asked 18.4 MiB for the forward kernel there."""
  bq, bk, width = spec.block_q, spec.block_k, _round_up(d, LANES)
  block = lambda rows, cols, size: rows * cols * size
  # The dq kernel holds the most a head: q, dO and dq blocks, lse and D_i in 128 float32 lanes
  # (all double-buffered), and its float32 accumulator.
  per_head = (2 * 3 * block(bq, width, itemsize) + 2 * 2 * block(bq, LANES, 4)
              + block(bq, width, 4))
  shared = (2 * 2 * block(bk, width, itemsize)                       # k, v
            + 2 * 2 * (block(bq, LANES, 4) + block(SUBLANES, bk, 4))  # the ids
            + 2 * 2 * block(bk, width, itemsize) + 2 * block(bk, width, 4)  # dk, dv, accumulators
            + 4 * block(bq, bk, 4))                                   # tile temporaries
  return heads * per_head + shared


def heads_a_step(G: int, d: int, itemsize: int, spec: Spec, capacity: int) -> tuple[int, int]:
  """The most query heads of a kv head's G that a grid step can take within `capacity` bytes of
  VMEM (a divisor of G; 1 when even one head is over), and the VMEM estimate at that count."""
  fits = [g for g in range(1, G + 1) if G % g == 0 and vmem_bytes(g, d, itemsize, spec) <= capacity]
  heads = max(fits, default=1)
  return heads, vmem_bytes(heads, d, itemsize, spec)


class _Ids(NamedTuple):
  """Segment and branch ids in the layouts a tile reads: per query slot down the sublanes
  ([B, T, 128], a column per tile) and per key slot along the lanes ([B, 8, T], a row)."""
  q_segment: jax.Array
  q_branch: jax.Array
  kv_segment: jax.Array
  kv_branch: jax.Array

  @classmethod
  def of(cls, segment_BT, branch_BT):
    B, T = segment_BT.shape
    column = lambda x: jax.lax.broadcast_in_dim(x, (B, T, LANES), (0, 1))
    row = lambda x: jax.lax.broadcast_in_dim(x, (B, SUBLANES, T), (0, 2))
    return cls(column(segment_BT), column(branch_BT), row(segment_BT), row(branch_BT))


# --- which tiles can hold an unmasked score --------------------------------------------------

EMPTY, PARTIAL, FULL = 0, 1, 2  # a tile's kind: no score unmasked, some, all (no mask to build)


def tile_kinds(segment_BT, branch_BT, window, spec: Spec) -> jax.Array:
  """The kind of every [block_q, block_k] tile of every row, flattened [B * n_q * n_k] (row-major),
  from the ids' ranges over each tile: FULL when every query of the tile sees every key (keys
  wholly before the queries and within the window, one segment on both sides, and keys of the
  prompt or of the queries' one branch), EMPTY when none can (keys wholly after the queries or
  out of the window, segment or branch ranges apart, all padding), else PARTIAL. Conservative:
  a tile it cannot prove FULL or EMPTY is PARTIAL, and the kernels mask it slot by slot."""
  B, T = segment_BT.shape
  bq, bk = spec.block_q, spec.block_k
  n_q, n_k = T // bq, T // bk
  span = lambda x, b: (x.reshape(B, -1, b).min(-1), x.reshape(B, -1, b).max(-1))
  (qs_lo, qs_hi), (ks_lo, ks_hi) = span(segment_BT, bq), span(segment_BT, bk)
  (qb_lo, qb_hi), (kb_lo, kb_hi) = span(branch_BT, bq), span(branch_BT, bk)
  q, k = (lambda x: x[:, :, None]), (lambda x: x[:, None, :])  # [B, n_q, 1], [B, 1, n_k]
  i, j = jnp.arange(n_q)[:, None], jnp.arange(n_k)[None, :]
  q_first, q_last, k_first, k_last = i * bq, (i + 1) * bq - 1, j * bk, (j + 1) * bk - 1
  w = window[0]
  full = ((k_last <= q_first) & ((w <= 0) | (q_last - k_first < w))
          & (q(qs_lo) == q(qs_hi)) & (k(ks_lo) == k(ks_hi)) & (q(qs_lo) == k(ks_lo))
          & (k(ks_lo) != 0))
  empty = ((k_first > q_last) | ((w > 0) & (q_first - k_last >= w)) | (k(ks_hi) == 0)
           | (q(qs_hi) < k(ks_lo)) | (q(qs_lo) > k(ks_hi)))
  if spec.branches:
    prompt_keys = (k(kb_lo) == 0) & (k(kb_hi) == 0)
    one_branch = (q(qb_lo) == q(qb_hi)) & (k(kb_lo) == k(kb_hi)) & (q(qb_lo) == k(kb_lo))
    full &= prompt_keys | one_branch
    empty |= (k(kb_lo) > 0) & ((q(qb_hi) < k(kb_lo)) | (q(qb_lo) > k(kb_hi)))
  kinds = jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL))
  return jnp.broadcast_to(kinds, (B, n_q, n_k)).reshape(-1).astype(jnp.int32)


def _kv_blocks(i, window, spec: Spec):
  """First and last key tile that query tile i can see: causal, and within the window."""
  last = ((i + 1) * spec.block_q - 1) // spec.block_k
  first = jnp.where(window > 0, jnp.maximum(i * spec.block_q - window + 1, 0) // spec.block_k, 0)
  return first, last


def _q_blocks(j, window, n_q: int, spec: Spec):
  """First and last query tile that can see key tile j."""
  first = (j * spec.block_k) // spec.block_q
  last = jnp.where(window > 0, jnp.minimum(((j + 1) * spec.block_k + window - 2) // spec.block_q,
                                            n_q - 1), n_q - 1)
  return first, last


def _clamp(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def _id_specs(spec: Spec, q_map, kv_map) -> list:
  """Block specs of the four `_Ids` arrays: a query tile's column of ids (q_map), a key tile's
  row (kv_map)."""
  column = pl.BlockSpec((1, spec.block_q, LANES), q_map)
  row = pl.BlockSpec((1, SUBLANES, spec.block_k), kv_map)
  return [column, column, row, row]


def _each_kind(kind, live, tile) -> None:
  """Runs `tile(masked)` for a live tile that is PARTIAL (masked) or FULL (no mask built)."""
  pl.when(live & (kind == PARTIAL))(lambda: tile(True))
  pl.when(live & (kind == FULL))(lambda: tile(False))


# --- the tile math shared by the three kernels -------------------------------------------------

def _scores(q, k, spec: Spec):
  """[bq, bk] float32 scores of a tile, scaled and soft-capped; and tanh of the capped ones (for
  the cap's derivative; None without a cap)."""
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  s = s * spec.scale
  if not spec.softcap:
    return s, None
  t = jnp.tanh(s / spec.softcap)
  return spec.softcap * t, t


def _mask(i, j, window, ids, spec: Spec):
  """[bq, bk] boolean: the tile's unmasked scores (transformer.attention_mask's rule)."""
  q_segment_ref, q_branch_ref, kv_segment_ref, kv_branch_ref = ids
  shape = (spec.block_q, spec.block_k)
  rows = i * spec.block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  cols = j * spec.block_k + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  reps = spec.block_k // LANES
  kv_segment = kv_segment_ref[0, :1, :]
  mask = (rows >= cols) & (jnp.tile(q_segment_ref[0], (1, reps)) == kv_segment) & (kv_segment != 0)
  mask &= (window <= 0) | (rows - cols < window)
  if spec.branches:
    kv_branch = kv_branch_ref[0, :1, :]
    mask &= (kv_branch == 0) | (kv_branch == jnp.tile(q_branch_ref[0], (1, reps)))
  return mask


def _lanes(x, n: int):
  """A [rows, 128] array of equal lanes as [rows, n]."""
  return x[:, :n] if n <= LANES else jnp.tile(x, (1, n // LANES))


def _probabilities(q, k, lse, mask, spec: Spec):
  """A tile's softmax probabilities from the forward's log-sum-exp (0 where `mask` is False; no
  mask: a FULL tile), and the derivative of the soft-cap (None without one)."""
  s, t = _scores(q, k, spec)
  p = jnp.exp(s - _lanes(lse, spec.block_k))
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  return p, None if t is None else 1.0 - t * t


def _score_grads(p, cap, do, v, di, spec: Spec):
  """A tile's gradient of the scaled scores: p * (dO . V^T - D_i), through the soft-cap's
  derivative `cap` when there is one, times the score scale (`di`: [bq, 128] lanes of D_i)."""
  dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  ds = p * (dp - _lanes(di, spec.block_k))
  return (ds if cap is None else ds * cap) * spec.scale


def _kind_index(b, i, j, n_q: int, n_k: int):
  return (b * n_q + i) * n_k + j


# --- forward -----------------------------------------------------------------------------------
# Each grid step takes one key tile against one query tile of all G query heads that share the
# key/value head: the tile's mask is built once for the G heads, the keys and values are fetched
# once, and the grid has G times fewer steps than one head a step.

def _forward_kernel(window_ref, kinds_ref, q_ref, k_ref, v_ref, *refs, spec: Spec, n_q: int,
                    n_k: int, G: int):
  ids, (o_ref, lse_ref, m_ref, l_ref, acc_ref) = refs[:4], refs[4:]
  b, i, j, window = pl.program_id(0), pl.program_id(2), pl.program_id(3), window_ref[0]

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def tile(masked: bool):
    k, v = k_ref[0, 0], v_ref[0, 0]
    mask = _mask(i, j, window, ids, spec) if masked else None
    for g in range(G):
      s, _ = _scores(q_ref[0, 0, g], k, spec)
      if masked:
        s = jnp.where(mask, s, _MASKED)
      m_prev = m_ref[g]
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1)[:, None])  # [bq, 128]
      p = jnp.exp(s - _lanes(m_next, spec.block_k))
      if masked:
        p = jnp.where(mask, p, 0.0)
      alpha = jnp.exp(m_prev - m_next)
      l_ref[g] = alpha * l_ref[g] + jnp.sum(p, axis=1)[:, None]
      m_ref[g] = m_next
      pv = jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
      acc_ref[g] = _lanes(alpha, v.shape[-1]) * acc_ref[g] + pv

  first, last = _kv_blocks(i, window, spec)
  _each_kind(kinds_ref[_kind_index(b, i, j, n_q, n_k)], (j >= first) & (j <= last), tile)

  @pl.when(j == n_k - 1)
  def _():
    for g in range(G):
      l = l_ref[g]
      seen = l > 0.0
      inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
      o_ref[0, 0, g] = (acc_ref[g] * _lanes(inv, o_ref.shape[-1])).astype(o_ref.dtype)
      # A query that saw no key: a log-sum-exp that makes every exp(s - lse) 0 in the backward.
      lse_ref[0, 0, g] = jnp.where(seen, m_ref[g] + jnp.log(jnp.where(seen, l, 1.0)), -_MASKED)


def _forward(q, k, v, ids: _Ids, window, kinds, spec: Spec):
  B, K, G, T, d = q.shape
  n_q, n_k = T // spec.block_q, T // spec.block_k
  g, groups = spec.heads, G // spec.heads  # grid axis 1 runs over (kv head, group of g heads)

  def kv_block(i, j, window_ref):
    first, last = _kv_blocks(i, window_ref[0], spec)
    return _clamp(j, first, last)  # a skipped tile repeats its neighbour's index: no fetch

  q_map = lambda b, h, i, j, w, t: (b, h // groups, h % groups, i, 0)
  kv_map = lambda b, h, i, j, w, t: (b, h // groups, kv_block(i, j, w), 0)
  q_ids = lambda b, h, i, j, w, t: (b, i, 0)
  kv_ids = lambda b, h, i, j, w, t: (b, 0, kv_block(i, j, w))
  bq, bk = spec.block_q, spec.block_k
  o, lse = pl.pallas_call(
      functools.partial(_forward_kernel, spec=spec, n_q=n_q, n_k=n_k, G=g),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(B, K * groups, n_q, n_k),
          in_specs=[pl.BlockSpec((1, 1, g, bq, d), q_map), pl.BlockSpec((1, 1, bk, d), kv_map),
                    pl.BlockSpec((1, 1, bk, d), kv_map), *_id_specs(spec, q_ids, kv_ids)],
          out_specs=[pl.BlockSpec((1, 1, g, bq, d), q_map),
                     pl.BlockSpec((1, 1, g, bq, LANES), q_map)],
          scratch_shapes=[pltpu.VMEM((g, bq, LANES), jnp.float32),
                          pltpu.VMEM((g, bq, LANES), jnp.float32),
                          pltpu.VMEM((g, bq, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, K, G, T, LANES), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=spec.vmem_limit),
      interpret=spec.interpret,
  )(window, kinds, q, k, v, *ids)
  return o, lse[..., 0]


# --- backward ----------------------------------------------------------------------------------

def _dq_kernel(window_ref, kinds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs,
               spec: Spec, n_q: int, n_k: int, G: int):
  ids, (dq_ref, acc_ref) = refs[:4], refs[4:]
  b, i, j, window = pl.program_id(0), pl.program_id(2), pl.program_id(3), window_ref[0]

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def tile(masked: bool):
    k, v = k_ref[0, 0], v_ref[0, 0]
    mask = _mask(i, j, window, ids, spec) if masked else None
    for g in range(G):
      do = do_ref[0, 0, g]
      p, cap = _probabilities(q_ref[0, 0, g], k, lse_ref[0, 0, g], mask, spec)
      ds = _score_grads(p, cap, do, v, di_ref[0, 0, g], spec)
      acc_ref[g] += jax.lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  first, last = _kv_blocks(i, window, spec)
  _each_kind(kinds_ref[_kind_index(b, i, j, n_q, n_k)], (j >= first) & (j <= last), tile)

  @pl.when(j == n_k - 1)
  def _():
    dq_ref[0, 0] = acc_ref[...].astype(dq_ref.dtype)


def _dkv_kernel(window_ref, kinds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs,
                spec: Spec, n_q: int, n_k: int, G: int):
  # The innermost grid axis runs over the groups of G heads, and within a group the query tiles.
  ids, (dk_ref, dv_ref, dk_acc, dv_acc) = refs[:4], refs[4:]
  b, j, step, window = pl.program_id(0), pl.program_id(2), pl.program_id(3), window_ref[0]
  i = step % n_q

  @pl.when(step == 0)
  def _():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  def tile(masked: bool):
    k, v = k_ref[0, 0], v_ref[0, 0]
    mask = _mask(i, j, window, ids, spec) if masked else None
    for g in range(G):
      q, do = q_ref[0, 0, g], do_ref[0, 0, g]
      p, cap = _probabilities(q, k, lse_ref[0, 0, g], mask, spec)
      dv_acc[...] += jax.lax.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
      ds = _score_grads(p, cap, do, v, di_ref[0, 0, g], spec)
      dk_acc[...] += jax.lax.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)

  first, last = _q_blocks(j, window, n_q, spec)
  _each_kind(kinds_ref[_kind_index(b, i, j, n_q, n_k)], (i >= first) & (i <= last), tile)

  @pl.when(step == pl.num_programs(3) - 1)
  def _():
    dk_ref[0, 0] = dk_acc[...].astype(dk_ref.dtype)
    dv_ref[0, 0] = dv_acc[...].astype(dv_ref.dtype)


def _backward(q, k, v, o, lse, do, ids: _Ids, window, kinds, spec: Spec):
  B, K, G, T, d = q.shape
  n_q, n_k = T // spec.block_q, T // spec.block_k
  bq, bk = spec.block_q, spec.block_k
  g, groups = spec.heads, G // spec.heads
  lanes = lambda x: jax.lax.broadcast_in_dim(x, (*x.shape, LANES), tuple(range(x.ndim)))
  di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, K, G, T]
  lse_lanes, di_lanes = lanes(lse), lanes(di)
  params = pltpu.CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",),
                                vmem_limit_bytes=spec.vmem_limit)
  kernel_args = dict(spec=spec, n_q=n_q, n_k=n_k, G=g)

  def kv_block(i, j, window_ref):
    first, last = _kv_blocks(i, window_ref[0], spec)
    return _clamp(j, first, last)

  q_map = lambda b, h, i, j, w, t: (b, h // groups, h % groups, i, 0)
  kv_map = lambda b, h, i, j, w, t: (b, h // groups, kv_block(i, j, w), 0)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, **kernel_args),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(B, K * groups, n_q, n_k),
          in_specs=[pl.BlockSpec((1, 1, g, bq, d), q_map), pl.BlockSpec((1, 1, bk, d), kv_map),
                    pl.BlockSpec((1, 1, bk, d), kv_map), pl.BlockSpec((1, 1, g, bq, d), q_map),
                    pl.BlockSpec((1, 1, g, bq, LANES), q_map),
                    pl.BlockSpec((1, 1, g, bq, LANES), q_map),
                    *_id_specs(spec, lambda b, h, i, j, w, t: (b, i, 0),
                               lambda b, h, i, j, w, t: (b, 0, kv_block(i, j, w)))],
          out_specs=pl.BlockSpec((1, 1, g, bq, d), q_map),
          scratch_shapes=[pltpu.VMEM((g, bq, d), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params, interpret=spec.interpret,
  )(window, kinds, q, k, v, do, lse_lanes, di_lanes, *ids)

  def q_block(j, step, window_ref):
    first, last = _q_blocks(j, window_ref[0], n_q, spec)
    return _clamp(step % n_q, first, last)

  qh_map = lambda b, h, j, s, w, t: (b, h, s // n_q, q_block(j, s, w), 0)
  k_map = lambda b, h, j, s, w, t: (b, h, j, 0)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, **kernel_args),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(B, K, n_k, groups * n_q),
          in_specs=[pl.BlockSpec((1, 1, g, bq, d), qh_map), pl.BlockSpec((1, 1, bk, d), k_map),
                    pl.BlockSpec((1, 1, bk, d), k_map), pl.BlockSpec((1, 1, g, bq, d), qh_map),
                    pl.BlockSpec((1, 1, g, bq, LANES), qh_map),
                    pl.BlockSpec((1, 1, g, bq, LANES), qh_map),
                    *_id_specs(spec, lambda b, h, j, s, w, t: (b, q_block(j, s, w), 0),
                               lambda b, h, j, s, w, t: (b, 0, j))],
          out_specs=[pl.BlockSpec((1, 1, bk, d), k_map), pl.BlockSpec((1, 1, bk, d), k_map)],
          scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params, interpret=spec.interpret,
  )(window, kinds, q, k, v, do, lse_lanes, di_lanes, *ids)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, ids, window, kinds, spec):
  return _forward(q, k, v, ids, window, kinds, spec)[0]


def _flash_fwd(q, k, v, ids, window, kinds, spec):
  o, lse = _forward(q, k, v, ids, window, kinds, spec)
  # Named, so a remat policy can keep them (--remat_policy=attention, projections): the backward
  # then reads the forward kernel's results instead of running it again, and (projections) the
  # q, k and v it was given instead of running their projections again.
  o, lse = checkpoint_name(o, RESIDUALS), checkpoint_name(lse, RESIDUALS)
  q, k, v = (checkpoint_name(x, INPUTS) for x in (q, k, v))
  return o, (q, k, v, o, lse, ids, window, kinds)


def _flash_bwd(spec, res, do):
  q, k, v, o, lse, ids, window, kinds = res
  dq, dk, dv = _backward(q, k, v, o, lse, do, ids, window, kinds, spec)
  return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)

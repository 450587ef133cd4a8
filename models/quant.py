"""A frozen base stored in less than float32: bfloat16, int8 per-channel absmax and block-wise
NF4 (Q-LoRA).

Only the frozen base is quantized; LoRA factors stay float32 and gradients never reach the
quantized weights. `transformer.dense` is the single place a weight is applied, and it
dequantizes there, on the fly, so a float copy of a matrix exists only transiently in a step.

* bf16: the matrix rounded to bfloat16, a plain array: half the bytes, and exact for weights
  imported from a bfloat16 checkpoint (most Hugging Face folders). A bfloat16 step computes with
  it as it is, so no converted copy of it is made in the step.
* int8: per output channel c, scale_c = max |W[:, c]| / 127 over the input axes, q = round(W /
  scale) in int8. Stored with the weight's own logical axes, so it shards exactly like W.
* nf4: the per-layer matrix is flattened (row-major) into 64-element blocks; each block stores
  its absmax (float32) and, per element, the index of the nearest of the 16 NF4 levels to
  W / absmax, two indices per byte. The levels are the NormalFloat4 code book of Dettmers et
  al. 2023, "QLoRA" (Appendix E; the bitsandbytes table). The block axis has the logical
  name "qblocks" (split as sharding.RULES says). Double quantization of absmax is not done.

Which leaves are quantized: the per-layer matrices (q, k, v, o, gate, up, down). The embedding
table, an untied lm_head (kept in float as bitsandbytes' 4-bit loading does by default, since
it sets the logits directly), norms and biases stay float32.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from models import sharding

BLOCK = 64

# NormalFloat4 levels (QLoRA, Dettmers et al. 2023, Appendix E).
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
  """W ~= q * scale. q: int8, W's shape; scale: float32, W's shape with input axes of size 1."""
  q: jax.Array
  scale: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NF4Weight:
  """packed: uint8 [*lead, blocks, 32] (two 4-bit level indices per byte, first in the high
  nibble); absmax: float32 [*lead, blocks]. `shape` is the matrix shape after the lead axes
  (the layer axis for stacked weights); it is static, so scan slices only the lead axis."""
  packed: jax.Array
  absmax: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})


def is_quantized(w) -> bool:
  return isinstance(w, (Int8Weight, NF4Weight))


def dequantize(w, dtype=jnp.float32) -> jax.Array:
  """The float weight of an Int8Weight or NF4Weight."""
  if isinstance(w, Int8Weight):
    return (w.q.astype(jnp.float32) * w.scale).astype(dtype)
  lead = w.packed.shape[:-2]
  hi = (w.packed >> 4).astype(jnp.int32)
  lo = (w.packed & 0xF).astype(jnp.int32)
  idx = jnp.stack([hi, lo], axis=-1).reshape(*lead, -1, BLOCK)
  vals = jnp.asarray(NF4_LEVELS)[idx] * w.absmax[..., None]
  n = math.prod(w.shape)
  return vals.reshape(*lead, -1)[..., :n].reshape(*lead, *w.shape).astype(dtype)


def quantize_int8(w: jax.Array, n_lead: int, n_in: int) -> Int8Weight:
  """Per-output-channel absmax over the n_in input axes that follow n_lead leading axes."""
  in_axes = tuple(range(n_lead, n_lead + n_in))
  absmax = jnp.max(jnp.abs(w), axis=in_axes, keepdims=True)
  scale = jnp.where(absmax > 0, absmax / 127.0, 1.0).astype(jnp.float32)
  q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
  return Int8Weight(q, scale)


def quantize_nf4(w: jax.Array, n_lead: int) -> NF4Weight:
  """Block-wise NF4 of everything after the first n_lead axes (zero-padded to whole blocks)."""
  lead, shape = w.shape[:n_lead], w.shape[n_lead:]
  flat = w.reshape(*lead, -1).astype(jnp.float32)
  pad = (-flat.shape[-1]) % BLOCK
  flat = jnp.pad(flat, [(0, 0)] * n_lead + [(0, pad)])
  blocks = flat.reshape(*lead, -1, BLOCK)
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  normed = blocks / jnp.where(absmax > 0, absmax, 1.0)[..., None]
  # Nearest level: the levels are sorted, so compare against the midpoints between them.
  mids = jnp.asarray((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2)
  idx = jnp.searchsorted(mids, normed).astype(jnp.uint8)
  pairs = idx.reshape(*lead, idx.shape[-2], BLOCK // 2, 2)
  packed = (pairs[..., 0] << 4) | pairs[..., 1]
  return NF4Weight(packed.astype(jnp.uint8), absmax.astype(jnp.float32), tuple(shape))


def targets(specs) -> dict:
  """{path: (n_lead, ParamSpec)} of the matrices that get quantized."""
  out = {}
  for name, s in specs["layers"].items():
    if s.fan_in:
      out[("layers", name)] = (1, s)
  return out


def quantize_one(mode: str, w, n_lead: int, spec):
  if mode == "bf16":
    return w.astype(jnp.bfloat16)
  if mode == "int8":
    return quantize_int8(w, n_lead, spec.fan_in)
  return quantize_nf4(w, n_lead)


def in_format(w, mode: str) -> bool:
  """Whether the matrix `w` is already stored as --base_quant=`mode` says (e.g. imported so)."""
  return w.dtype == jnp.bfloat16 if mode == "bf16" else is_quantized(w)


def quantized_sharding(mode: str, mesh: Mesh, n_lead: int, spec, qw):
  if mode == "bf16":
    return sharding.named(mesh, spec.axes, qw.shape)
  if mode == "int8":
    return Int8Weight(sharding.named(mesh, spec.axes, qw.q.shape),
                      sharding.named(mesh, spec.axes, qw.scale.shape))
  lead_axes = spec.axes[:n_lead]
  return NF4Weight(sharding.named(mesh, (*lead_axes, "qblocks", None), qw.packed.shape),
                   sharding.named(mesh, (*lead_axes, "qblocks"), qw.absmax.shape), qw.shape)


def _quantize_tree(specs, mode: str, tree):
  out = {**tree, "layers": dict(tree["layers"])}
  for path, (n_lead, spec) in targets(specs).items():
    parent = out if len(path) == 1 else out["layers"]
    leaf = tree[path[0]] if len(path) == 1 else tree["layers"][path[1]]
    parent[path[-1]] = quantize_one(mode, leaf, n_lead, spec)
  return out


def quantize_params(specs, mode: str, params, mesh: Mesh):
  """`params` with their matrices quantized per `mode` (ModelConfig.base_quant), born sharded.

  `specs` is the ParamSpec tree the params were built from (transformer.param_specs(cfg)).
  """
  if mode == "none":
    return params
  quantize = lambda tree: _quantize_tree(specs, mode, tree)
  shapes = jax.eval_shape(quantize, params)
  out_sh = jax.tree.map(lambda x: x.sharding, params)
  out_sh = {**out_sh, "layers": dict(out_sh["layers"])}
  for path, (n_lead, spec) in targets(specs).items():
    parent = out_sh if len(path) == 1 else out_sh["layers"]
    leaf = shapes[path[0]] if len(path) == 1 else shapes["layers"][path[1]]
    parent[path[-1]] = quantized_sharding(mode, mesh, n_lead, spec, leaf)
  return jax.jit(quantize, out_shardings=out_sh)(params)


def abstract_quantized(specs, mode: str, abstract_params):
  """Shapes and dtypes `quantize_params` gives for float params of these shapes; allocates
  nothing. `abstract_params` is transformer.abstract(specs)."""
  if mode == "none":
    return abstract_params
  return jax.eval_shape(lambda tree: _quantize_tree(specs, mode, tree), abstract_params)

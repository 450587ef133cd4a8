"""A decoder-only transformer as a pytree of plain arrays.

Every parameter is described once in `param_specs` (shape, logical axes, initializer). The
parameter pytree (`init`), its abstract shapes (`abstract`), its shardings (`shardings`) and
the LoRA pytree (models/lora.py) are all derived from that one description.

Layers are stacked on a leading "layers" axis and run with `jax.lax.scan`, so compile time does
not grow with depth and per-layer rematerialization is one `jax.checkpoint`.

Shape suffixes: B batch, T query time, S key time, D d_model, H heads, G query heads per kv
head, K kv heads (in names) / head_dim (in einsums), F mlp hidden, V vocab, R LoRA rank.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from configs import ModelConfig
from models import sharding


class ParamSpec(NamedTuple):
  """One parameter: shape, logical axes, initializer, and for matrices its LoRA split.

  `fan_in` counts the leading non-layer axes that are contracted with the input (1 for
  q/k/v/gate/up/down, 2 for o); it fixes the init scale and the LoRA factor shapes. 0 means
  "not a matrix" (norm scales), which never get adapters.
  """
  shape: tuple[int, ...]
  axes: tuple[str, ...]
  init: str  # "normal" | "ones" | "zeros"
  fan_in: int = 0


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
  D, L, H, K, Hd, F, V = (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                          cfg.mlp_dim, cfg.vocab_size)
  layer = {
      "attn_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
      "q": ParamSpec((L, D, H, Hd), ("layers", "embed", "heads", "head_dim"), "normal", 1),
      "k": ParamSpec((L, D, K, Hd), ("layers", "embed", "kv_heads", "head_dim"), "normal", 1),
      "v": ParamSpec((L, D, K, Hd), ("layers", "embed", "kv_heads", "head_dim"), "normal", 1),
      "o": ParamSpec((L, H, Hd, D), ("layers", "heads", "head_dim", "embed"), "normal", 2),
      "mlp_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
      "gate": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal", 1),
      "up": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal", 1),
      "down": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal", 1),
  }
  specs = {
      "embed": ParamSpec((V, D), ("vocab", "embed"), "normal"),
      "layers": layer,
      "final_norm": ParamSpec((D,), ("norm",), "ones"),
  }
  if not cfg.tie_embeddings:
    specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), "normal", 1)
  return specs


def _is_spec(x) -> bool:
  return isinstance(x, ParamSpec)


def _init_one(spec: ParamSpec, key: jax.Array, std: float) -> jax.Array:
  if spec.init == "ones":
    return jnp.ones(spec.shape, jnp.float32)
  if spec.init == "zeros":
    return jnp.zeros(spec.shape, jnp.float32)
  return std * jax.random.normal(key, spec.shape, jnp.float32)


def init_from_specs(specs, key: jax.Array, std: float):
  leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten([_init_one(s, k, std) for s, k in zip(leaves, keys)])


def abstract(specs):
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), specs, is_leaf=_is_spec)


def shardings(specs, mesh: Mesh):
  return jax.tree.map(lambda s: sharding.named(mesh, s.axes, s.shape), specs, is_leaf=_is_spec)


def init(cfg: ModelConfig, key: jax.Array, mesh: Mesh):
  """Initialises parameters directly into their shardings (no host ever holds them whole)."""
  specs = param_specs(cfg)
  fn = jax.jit(lambda k: init_from_specs(specs, k, cfg.init_std), out_shardings=shardings(specs, mesh))
  return fn(key)


# --- forward -------------------------------------------------------------------------------------

def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale).astype(x.dtype)


def rope(x_BTHK: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, rotate-half convention (pairs dimension i with i + head_dim/2)."""
  half = x_BTHK.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_BTk = positions_BT[..., None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angle_BTk)[:, :, None, :], jnp.cos(angle_BTk)[:, :, None, :]
  x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHK.dtype)


def attention_mask(q_segment_BT, kv_segment_BS, q_index_BT, kv_index_BS) -> jax.Array:
  """[B, T, S] boolean: causal by slot index, same segment, and never a padding key (segment 0).

  Padding, packed sequences and (later) shared-prefix layouts are all expressed through the
  segment ids and slot indices passed here; the attention itself never changes.
  """
  causal = q_index_BT[:, :, None] >= kv_index_BS[:, None, :]
  same = q_segment_BT[:, :, None] == kv_segment_BS[:, None, :]
  return causal & same & (kv_segment_BS[:, None, :] != 0)


class Lora(NamedTuple):
  """What a projection needs to add its LoRA delta: factors, scale, dropout key and rate."""
  a: jax.Array
  b: jax.Array
  scale: float
  key: jax.Array | None
  rate: float


def dense(x: jax.Array, w: jax.Array, n_in: int, lora: Lora | None = None) -> jax.Array:
  """x[..., *in] @ w[*in, *out] (+ scale * dropout(x) @ A[*in, R] @ B[R, *out])."""
  y = jnp.tensordot(x, w.astype(x.dtype), axes=n_in)
  if lora is not None:
    xd = x
    if lora.key is not None and lora.rate > 0.0:
      keep = jax.random.bernoulli(lora.key, 1.0 - lora.rate, x.shape)
      xd = jnp.where(keep, x / (1.0 - lora.rate), 0).astype(x.dtype)
    h = jnp.tensordot(xd, lora.a.astype(x.dtype), axes=n_in)
    y = y + lora.scale * jnp.tensordot(h, lora.b.astype(x.dtype), axes=1)
  return y


def _layer(cfg: ModelConfig, x_BTD, p, lora_p, lora_scale, key, rate, rope_pos_BT, mask_BTS,
           cache=None):
  """One pre-norm block. `lora_p` maps target name -> {"a", "b"} for this layer (or is empty)."""
  def proj(name, inp, n_in):
    lp = lora_p.get(name) if lora_p else None
    if lp is None:
      return dense(inp, p[name], n_in)
    k = None if key is None else jax.random.fold_in(key, _TARGET_ID[name])
    return dense(inp, p[name], n_in, Lora(lp["a"], lp["b"], lora_scale, k, rate))

  B, T, D = x_BTD.shape
  h = rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps)
  q_BTHk = rope(proj("q", h, 1), rope_pos_BT, cfg.rope_theta)
  k_BTKk = rope(proj("k", h, 1), rope_pos_BT, cfg.rope_theta)
  v_BTKk = proj("v", h, 1)
  if cache is not None:
    k_BTKk, v_BTKk, cache = cache(k_BTKk, v_BTKk)
  G = cfg.n_heads // cfg.n_kv_heads
  q_BTKGk = q_BTHk.reshape(B, T, cfg.n_kv_heads, G, cfg.head_dim)
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGk, k_BTKk).astype(jnp.float32)
  scores = scores / math.sqrt(cfg.head_dim)
  scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BTKk.dtype)
  attn_BTKGk = jnp.einsum("bkgts,bskd->btkgd", probs, v_BTKk)
  x_BTD = x_BTD + proj("o", attn_BTKGk.reshape(B, T, cfg.n_heads, cfg.head_dim), 2)

  h = rms_norm(x_BTD, p["mlp_norm"], cfg.norm_eps)
  gated = jax.nn.silu(proj("gate", h, 1)) * proj("up", h, 1)
  x_BTD = x_BTD + proj("down", gated, 1)
  return x_BTD, cache


_TARGET_ID = {n: i for i, n in enumerate(("q", "k", "v", "o", "gate", "up", "down"))}


class KVCache(NamedTuple):
  """Keys and values of every layer for S slots, and the segment id of each slot.

  Slots are written in order by successive `forward` calls (`cache_index` = first slot of the
  call's tokens); a slot with segment 0 (padding or not yet written) is never attended to.
  """
  k: jax.Array            # [L, B, S, K, head_dim] in the compute dtype
  v: jax.Array            # [L, B, S, K, head_dim]
  segment_ids: jax.Array  # [B, S] int32


def init_cache(cfg: ModelConfig, batch: int, slots: int) -> KVCache:
  shape = (cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.head_dim)
  dtype = jnp.dtype(cfg.compute_dtype)
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                 jnp.zeros((batch, slots), jnp.int32))


def _cache_writer(k_BSKk, v_BSKk, index):
  """The `_layer` cache hook: writes this call's keys/values at `index`, returns all S slots."""
  def write(k_BTKk, v_BTKk):
    k_all = jax.lax.dynamic_update_slice_in_dim(k_BSKk, k_BTKk.astype(k_BSKk.dtype), index, 1)
    v_all = jax.lax.dynamic_update_slice_in_dim(v_BSKk, v_BTKk.astype(v_BSKk.dtype), index, 1)
    return k_all, v_all, (k_all, v_all)
  return write


def forward(cfg: ModelConfig, params, tokens_BT, positions_BT, segment_ids_BT, lora=None,
            lora_scale: float = 1.0, dropout_key: jax.Array | None = None,
            dropout_rate: float = 0.0, return_hidden: bool = False,
            cache: KVCache | None = None, cache_index: jax.Array | int = 0):
  """Logits [B, T, V] in float32 (or final hidden states [B, T, D] with return_hidden).

  tokens, positions and segment ids are all [B, T] int32. Segment 0 marks padding. `lora` is a
  LoRA pytree from models/lora.py or None (the frozen base: the reference policy). Dropout on
  the LoRA input path applies only when `dropout_key` is given.

  With a `cache` (decoding), the T tokens occupy cache slots [cache_index, cache_index + T),
  attend to every earlier non-padding slot of the same segment, and the result is
  (logits or hidden, updated cache). Positions (for RoPE) are independent of slots.
  """
  dtype = jnp.dtype(cfg.compute_dtype)
  x_BTD = params["embed"].astype(dtype)[tokens_BT]
  x_BTD = sharding.constrain(x_BTD, ("batch", "seq", "embed"))
  index_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
  if cache is None:
    mask_BTS = attention_mask(segment_ids_BT, segment_ids_BT, index_BT, index_BT)
    layer_cache = None
  else:
    kv_segment_BS = jax.lax.dynamic_update_slice_in_dim(cache.segment_ids, segment_ids_BT,
                                                        cache_index, 1)
    kv_index_BS = jnp.broadcast_to(jnp.arange(kv_segment_BS.shape[1]), kv_segment_BS.shape)
    mask_BTS = attention_mask(segment_ids_BT, kv_segment_BS, cache_index + index_BT, kv_index_BS)
    layer_cache = (cache.k, cache.v)
  lora_layers = None if lora is None else lora["layers"]

  def body(x, xs):
    p, lp, i, c = xs
    key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
    hook = None if c is None else _cache_writer(*c, cache_index)
    x, c = _layer(cfg, x, p, lp, lora_scale, key, dropout_rate, positions_BT, mask_BTS, hook)
    return sharding.constrain(x, ("batch", "seq", "embed")), c

  if cfg.remat:
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
  xs = (params["layers"], lora_layers if lora_layers is not None else {},
        jnp.arange(cfg.n_layers), layer_cache)
  x_BTD, new_kv = jax.lax.scan(body, x_BTD, xs)
  h_BTD = rms_norm(x_BTD, params["final_norm"], cfg.norm_eps)
  out = h_BTD if return_hidden else unembed(cfg, params, h_BTD)
  if cache is None:
    return out
  return out, KVCache(new_kv[0], new_kv[1], kv_segment_BS)


def unembed(cfg: ModelConfig, params, h_BTD: jax.Array) -> jax.Array:
  w_DV = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  logits = jnp.einsum("btd,dv->btv", h_BTD, w_DV.astype(h_BTD.dtype))
  return logits.astype(jnp.float32)


def num_params(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))

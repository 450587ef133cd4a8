"""A decoder-only transformer as a pytree of plain arrays.

Every parameter is described once in `param_specs` (shape, logical axes, initializer). The
parameter pytree (`init`), its abstract shapes (`abstract`), its shardings (`shardings`) and
the LoRA pytree (models/lora.py) are all derived from that one description.

Layers are stacked on a leading "layers" axis and run with `jax.lax.scan`, so compile time does
not grow with depth and per-layer rematerialization is one `jax.checkpoint`. Decoding with a KV
cache runs them as a Python loop instead (`_decode_layers`), so a decode loop neither slices the
stacked weights nor copies the cache at every step.

Shape suffixes: B batch, T query time, S key time, D d_model, H heads, G query heads per kv
head, K kv heads (in names) / head_dim (in einsums), F mlp hidden, V vocab, R LoRA rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec as P

from models import flash, moe, quant, sharding

if TYPE_CHECKING:
  from models.config import LoraConfig, ModelConfig


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
  # With (1 + w) norms (Gemma) the identity scale is w = 0.
  norm_init = "zeros" if cfg.norm_plus_one else "ones"
  layer = {
      "attn_norm": ParamSpec((L, D), ("layers", "norm"), norm_init),
      "q": ParamSpec((L, D, H, Hd), ("layers", "embed", "heads", "head_dim"), "normal", 1),
      "k": ParamSpec((L, D, K, Hd), ("layers", "embed", "kv_heads", "head_dim"), "normal", 1),
      "v": ParamSpec((L, D, K, Hd), ("layers", "embed", "kv_heads", "head_dim"), "normal", 1),
      "o": ParamSpec((L, H, Hd, D), ("layers", "heads", "head_dim", "embed"), "normal", 2),
      "mlp_norm": ParamSpec((L, D), ("layers", "norm"), norm_init),
      "gate": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal", 1),
      "up": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal", 1),
      "down": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal", 1),
  }
  if cfg.n_experts:  # a mixture of experts in place of the dense MLP (models/moe.py)
    for name in ("gate", "up", "down"):
      del layer[name]
    layer.update(moe.param_specs(cfg, ParamSpec))
  if cfg.qkv_bias:
    layer["q_bias"] = ParamSpec((L, H, Hd), ("layers", "heads", "head_dim"), "zeros")
    layer["k_bias"] = ParamSpec((L, K, Hd), ("layers", "kv_heads", "head_dim"), "zeros")
    layer["v_bias"] = ParamSpec((L, K, Hd), ("layers", "kv_heads", "head_dim"), "zeros")
  if cfg.qk_norm and cfg.qk_norm_full:  # one scale over all heads (OLMoE)
    layer["q_norm"] = ParamSpec((L, H, Hd), ("layers", "heads", "head_dim"), norm_init)
    layer["k_norm"] = ParamSpec((L, K, Hd), ("layers", "kv_heads", "head_dim"), norm_init)
  elif cfg.qk_norm:
    layer["q_norm"] = ParamSpec((L, Hd), ("layers", "norm"), norm_init)
    layer["k_norm"] = ParamSpec((L, Hd), ("layers", "norm"), norm_init)
  if cfg.post_norms:
    layer["post_attn_norm"] = ParamSpec((L, D), ("layers", "norm"), norm_init)
    layer["post_mlp_norm"] = ParamSpec((L, D), ("layers", "norm"), norm_init)
  specs = {
      "embed": ParamSpec((V, D), ("vocab", "embed"), "normal"),
      "layers": layer,
      "final_norm": ParamSpec((D,), ("norm",), norm_init),
  }
  if not cfg.tie_embeddings:
    specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), "normal", 1)
  return specs


def score_spec(cfg: ModelConfig) -> ParamSpec:
  """A reward model's head `score` [D, 1] (transformers' `score.weight` of a one-label
  `*ForSequenceClassification`, transposed): read at the last scored token's final hidden state
  (dpo/algorithms/rm.py); its embed axis is sharded as the weights'."""
  return ParamSpec((cfg.d_model, 1), ("embed", None), "normal", 1)


def is_spec(x) -> bool:
  return isinstance(x, ParamSpec)


def _init_one(spec: ParamSpec, key: jax.Array, std: float) -> jax.Array:
  if spec.init == "ones":
    return jnp.ones(spec.shape, jnp.float32)
  if spec.init == "zeros":
    return jnp.zeros(spec.shape, jnp.float32)
  return std * jax.random.normal(key, spec.shape, jnp.float32)


def init_from_specs(specs, key: jax.Array, std: float):
  leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten([_init_one(s, k, std) for s, k in zip(leaves, keys)])


def abstract(specs):
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), specs, is_leaf=is_spec)


def shardings(specs, mesh: Mesh):
  return jax.tree.map(lambda s: sharding.named(mesh, s.axes, s.shape), specs, is_leaf=is_spec)


def init(cfg: ModelConfig, key: jax.Array, mesh: Mesh):
  """Initialises parameters directly into their shardings (no host ever holds them whole)."""
  specs = param_specs(cfg)
  fn = jax.jit(lambda k: init_from_specs(specs, k, cfg.init_std), out_shardings=shardings(specs, mesh))
  return fn(key)


def init_base(cfg: ModelConfig, key: jax.Array, mesh: Mesh):
  """A random frozen base as --base_quant stores it, born so. With bf16 / int8 / nf4 each
  per-layer matrix is drawn and converted one layer at a time inside one jit (`lax.map` over the
  layers), so no float32 copy of a stacked matrix ever exists (an 8B model's is 28 GiB): layer l
  of a matrix is drawn from fold_in(the matrix's key, l), the same distribution as `init`'s (whose
  values it does not repeat). The other leaves are `init`'s, value for value."""
  if cfg.base_quant == "none":
    return init(cfg, key, mesh)
  return quantized_init(cfg, mesh)(key)


def quantized_init(cfg: ModelConfig, mesh: Mesh):
  """`init_base`'s jitted function of the key (bf16 / int8 / nf4), for its memory analysis."""
  specs = param_specs(cfg)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
  quantized = quant.targets(specs)
  names = [tuple(p.key for p in path) for path, _ in leaves]

  def build(key):
    out = []
    for name, (_, spec), k in zip(names, leaves, jax.random.split(key, len(leaves))):
      if name not in quantized:
        out.append(_init_one(spec, k, cfg.init_std))
        continue
      one = spec._replace(shape=spec.shape[1:])
      draw = lambda i, k=k, one=one, spec=spec: quant.quantize_one(
          cfg.base_quant, _init_one(one, jax.random.fold_in(k, i), cfg.init_std), 0, spec)
      out.append(jax.lax.map(draw, jnp.arange(spec.shape[0])))
    return treedef.unflatten(out)

  shapes = jax.tree.leaves(jax.eval_shape(build, jax.random.key(0)), is_leaf=quant.is_quantized)
  out_shardings = [
      quant.quantized_sharding(cfg.base_quant, mesh, 1, spec, shape) if name in quantized
      else sharding.named(mesh, spec.axes, spec.shape)
      for name, (_, spec), shape in zip(names, leaves, shapes)]
  return jax.jit(build, out_shardings=treedef.unflatten(out_shardings))


# --- forward -------------------------------------------------------------------------------------

def rms_norm(x: jax.Array, scale: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
  """x / rms(x) * w (or * (1 + w) for Gemma), computed in float32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale = scale.astype(jnp.float32)
  return (y * (1.0 + scale if plus_one else scale)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, local: bool) -> np.ndarray:
  """Inverse frequencies [head_dim / 2] (float32) of global or local (sliding) layers.

  Base theta ** (-2i / head_dim). Global layers apply `rope_scaling`: "linear" divides every
  frequency by the factor; "llama3" divides low frequencies by the factor, keeps high ones and
  interpolates in between by wavelength (Llama 3.1 model card / reference rope code). Local
  layers with their own base (`rope_local_theta`, Gemma 3) are never scaled.
  """
  half = cfg.head_dim // 2
  exponent = np.arange(half, dtype=np.float64) / half
  if local and cfg.rope_local_theta:
    return (cfg.rope_local_theta ** -exponent).astype(np.float32)
  freq = cfg.rope_theta ** -exponent
  if cfg.rope_scaling == "linear":
    freq = freq / cfg.rope_factor
  elif cfg.rope_scaling == "llama3":
    wavelen = 2 * np.pi / freq
    long_wave = cfg.rope_original_max_len / cfg.rope_low_freq_factor
    short_wave = cfg.rope_original_max_len / cfg.rope_high_freq_factor
    smooth = ((cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor)
              / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
    mid = (1 - smooth) * freq / cfg.rope_factor + smooth * freq
    freq = np.where(wavelen > long_wave, freq / cfg.rope_factor,
                    np.where(wavelen < short_wave, freq, mid))
  return freq.astype(np.float32)


def rope(x_BTHK: jax.Array, positions_BT: jax.Array, freq_k: jax.Array) -> jax.Array:
  """Rotary embedding, rotate-half convention (pairs dimension i with i + head_dim/2)."""
  angle_BTk = positions_BT[..., None].astype(jnp.float32) * freq_k
  sin, cos = jnp.sin(angle_BTk)[:, :, None, :], jnp.cos(angle_BTk)[:, :, None, :]
  x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHK.dtype)


class Slots(NamedTuple):
  """Where each slot of a [B, T] (queries) or [B, S] (keys) layout sits for attention: its
  segment (0 = padding), its slot index (causality) and, in shared-prefix rows, its branch
  (0 prompt, b > 0 completion b; None when rows have no branches)."""
  segment: jax.Array
  index: jax.Array
  branch: jax.Array | None = None


def attention_mask(q: Slots, kv: Slots, window: int = 0) -> jax.Array:
  """[B, T, S] boolean: causal by slot index, same segment, and never a padding key (segment 0).

  Padding, packed sequences and shared-prefix layouts are all expressed through the slots'
  segments, indices and branches; the attention itself never changes. `window` > 0 keeps only
  the last `window` keys (q.index - kv.index < window): sliding-window layers. Branches
  (shared-prefix rows, dpo/packing.py): a key of branch 0 (the prompt) is seen by every later
  query of its segment, a key of branch b > 0 (a completion) only by queries of branch b, so
  the chosen and rejected completions after one prompt never see each other.
  """
  causal = q.index[:, :, None] >= kv.index[:, None, :]
  same = q.segment[:, :, None] == kv.segment[:, None, :]
  mask = causal & same & (kv.segment[:, None, :] != 0)
  if window:
    mask &= q.index[:, :, None] - kv.index[:, None, :] < window
  if kv.branch is not None:
    kv_b = kv.branch[:, None, :]
    mask &= (kv_b == 0) | (kv_b == q.branch[:, :, None])
  return mask


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(x / cap) (Gemma 2 logit soft-capping); identity for cap = 0."""
  return cap * jnp.tanh(x / cap) if cap else x


class Delta(NamedTuple):
  """What one projection (`dense`) needs to add its LoRA delta: its factors A and B, the scale,
  the dropout key and rate, and where each slot's dropout mask comes from (`DropoutSource`, or
  None: drawn for x itself)."""
  a: jax.Array
  b: jax.Array
  scale: float
  key: jax.Array | None
  rate: float
  source: DropoutSource | None = None
  rng: str = "threefry"


@functools.partial(jax.tree_util.register_dataclass, data_fields=("index_BT",),
                   meta_fields=("rows",))
@dataclasses.dataclass(frozen=True)
class DropoutSource:
  """Dropout masks drawn over a [rows, T] grid of slots and gathered: slot (b, t) takes the
  mask of grid slot index_BT[b, t] (flattened, row * T + slot). Packed rows (dpo/packing.py)
  take their pairs' masks from the grid of the unpacked shared-prefix rows, so the masks do not
  depend on how pairs were packed (nor, through that, on the mesh). `rows` is static (a shape)."""
  index_BT: jax.Array
  rows: int


class Inputs(NamedTuple):
  """What `forward` reads of a batch: [B, T] int32 tokens, RoPE positions and segment ids
  (0 marks padding; distinct ids are sequences that never attend to each other), and for
  shared-prefix rows the branch ids that keep sibling completions apart (see `attention_mask`)."""
  tokens_BT: jax.Array
  positions_BT: jax.Array
  segment_ids_BT: jax.Array
  branch_BT: jax.Array | None = None


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("lora", "dropout_key", "dropout_source"),
                   meta_fields=("scale", "dropout_rate", "dropout_rng"))
@dataclasses.dataclass(frozen=True)
class Adapter:
  """A LoRA delta on the frozen base: the LoRA pytree (models/lora.py: {"layers": {target:
  {"a", "b"}}}; after `at_layer`, one layer's {target: {"a", "b"}}), its scale alpha / rank,
  and the dropout on its input path, applied only with a `dropout_key` (training); masks come
  from `dropout_source`'s grid when given (packed rows), else are drawn per slot. Scale and
  rate are static (part of a jitted function's cache key), the rest are arrays. `dropout_rng`
  is how masks are drawn from the key (`keep_mask`)."""
  lora: Any
  scale: float
  dropout_key: jax.Array | None = None
  dropout_rate: float = 0.0
  dropout_source: DropoutSource | None = None
  dropout_rng: str = "threefry"

  @classmethod
  def training(cls, lora, lora_cfg: LoraConfig, dropout_key: jax.Array | None) -> "Adapter":
    """The adapter a training step applies: `lora_cfg`'s scale and dropout, masks drawn from
    `dropout_key` as --lora_dropout_rng says."""
    return cls(lora, lora_cfg.scale, dropout_key, lora_cfg.lora_dropout,
               dropout_rng=lora_cfg.dropout_rng_impl())

  def at_layer(self, lora_layer, key: jax.Array | None) -> "Adapter":
    """This adapter for one layer: that layer's factors and dropout key."""
    return dataclasses.replace(self, lora=lora_layer, dropout_key=key)


class Decode(NamedTuple):
  """Decoding with a KV cache: the call's T tokens occupy cache slots [index, index + T)."""
  cache: KVCache
  index: jax.Array | int


def matmul(x: jax.Array, w: jax.Array, n_in: int, explicit: bool = False) -> jax.Array:
  """x[*lead, *in] @ w[*in, *out]; with `explicit` (--matmul_backward=explicit) its backward is
  written out: dx = dy . w^T over the output dims and dw = x^T . dy over the lead (token) dims,
  formed directly in w's [*in, *out] layout. JAX's own transpose rule forms the same sums with
  another operand order, which XLA:CPU may lay out with more transposed copies (timings:
  docs/benchmarks.md). Same values up to float rounding (tests/test_transformer.py).
  """
  return _explicit_matmul(x, w, n_in) if explicit else jnp.tensordot(x, w, axes=n_in)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _explicit_matmul(x, w, n_in):
  return jnp.tensordot(x, w, axes=n_in)


def _matmul_fwd(x, w, n_in):
  return jnp.tensordot(x, w, axes=n_in), (x, w)


def _matmul_bwd(n_in, res, dy):
  x, w = res
  lead = list(range(x.ndim - n_in))
  dx = jnp.tensordot(dy, w, axes=(list(range(len(lead), dy.ndim)), list(range(n_in, w.ndim))))
  return dx.astype(x.dtype), jnp.tensordot(x, dy, axes=(lead, lead)).astype(w.dtype)


_explicit_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def keep_mask(key: jax.Array, rate: float, shape: tuple[int, ...], rng: str) -> jax.Array:
  """Dropout's keep mask (True with probability 1 - rate) drawn from a threefry `key`.

  threefry: JAX's counter-based generator, the same bits on every platform and mesh. Each 32-bit
  draw is a 20-round hash on the vector units; on a TPU the LoRA masks of a Llama-3.2-1B DPO
  step cost a fifth of the step (docs/tpu.md). rbg: XLA's RngBitGenerator (the platform's own
  bit generator, JAX's "rbg" key), seeded with four words hashed from `key`; with it that step
  takes 2.78 s instead of 3.19 s on a TPU v5e, and its bits differ between platforms.
  """
  if rng == "rbg":
    seed = jax.random.key_data(jax.random.split(key)).reshape(4)
    key = jax.random.wrap_key_data(seed, impl="rbg")
  return jax.random.bernoulli(key, 1.0 - rate, shape)


def dense(x: jax.Array, w, n_in: int, lora: Delta | None = None,
          explicit: bool = False) -> jax.Array:
  """x[..., *in] @ w[*in, *out] (+ scale * dropout(x) @ A[*in, R] @ B[R, *out]).

  The one place weights are applied: a quantized `w` (models/quant.py) is dequantized here, on
  the fly, so the float weight exists only transiently inside the step. `explicit` gives the
  `w` matmul and the LoRA factors' matmuls `matmul`'s written-out backward (--matmul_backward).
  """
  if quant.is_quantized(w):
    w = quant.dequantize(w)
  y = matmul(x, w.astype(x.dtype), n_in, explicit)
  if lora is not None:
    xd = x
    if lora.key is not None and lora.rate > 0.0:
      if lora.source is None:
        keep = keep_mask(lora.key, lora.rate, x.shape, lora.rng)
      else:
        T, index_BT = x.shape[1], lora.source.index_BT
        keep = keep_mask(lora.key, lora.rate, (lora.source.rows, *x.shape[1:]), lora.rng)
        keep = keep[index_BT // T, index_BT % T]
      xd = jnp.where(keep, x / (1.0 - lora.rate), 0).astype(x.dtype)
    h = matmul(xd, lora.a.astype(x.dtype), n_in, explicit)
    y = y + lora.scale * matmul(h, lora.b.astype(x.dtype), 1, explicit)
  return y


def attend(cfg: ModelConfig, q_BTKGk, k_BSKk, v_BSKk, mask_BTS) -> jax.Array:
  """Masked softmax attention of T queries over S keys (scores and softmax in float32)."""
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGk, k_BSKk).astype(jnp.float32)
  scores = soft_cap(scores / math.sqrt(cfg.query_scale or cfg.head_dim), cfg.attn_softcap)
  scores = jnp.where(mask_BTS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKk.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v_BSKk)


class _LayerInputs(NamedTuple):
  """What one layer reads besides the residual stream: RoPE positions, its attention mask and
  RoPE inverse frequencies (sliding-window layers get a banded mask and possibly their own RoPE
  base), and the cache hook (`_cache_writer`) when decoding, whose updated (keys, values) of all
  cache slots the layer attends over and returns. With the Pallas kernel (`flash`: the slots and
  this layer's window, 0 for a global layer) the mask is never formed: `mask_BTS` is None."""
  positions_BT: jax.Array
  mask_BTS: jax.Array | None
  freq_k: jax.Array
  cache_writer: Callable | None = None
  flash: tuple[Slots, jax.Array] | None = None


def _layer(cfg: ModelConfig, x_BTD, p, adapter: Adapter | None, inputs: _LayerInputs):
  """One pre-norm block: (the residual stream after it, the cache hook's (keys, values) or None,
  a mixture's router logits [B, T, E] or None); `adapter` holds this layer's LoRA factors
  (target name -> {"a", "b"})."""
  def proj(name, inp, n_in):
    lp = adapter.lora.get(name) if adapter is not None and adapter.lora else None
    if lp is None:
      y = dense(inp, p[name], n_in, explicit=cfg.explicit_backward)
    else:
      # Each adapted matrix draws its dropout from its own stream: its index among the layer's
      # matrices in param_specs order.
      key = adapter.dropout_key
      key = None if key is None else jax.random.fold_in(key, _matrices(cfg).index(name))
      y = dense(inp, p[name], n_in, Delta(lp["a"], lp["b"], adapter.scale, key,
                                          adapter.dropout_rate, adapter.dropout_source,
                                          adapter.dropout_rng),
                cfg.explicit_backward)
    bias = p.get(name + "_bias")
    return y if bias is None else y + bias.astype(y.dtype)

  def norm(name, h):
    return rms_norm(h, p[name], cfg.norm_eps, cfg.norm_plus_one)

  B, T, D = x_BTD.shape
  c = sharding.constrain
  h = norm("attn_norm", x_BTD)
  q_BTHk, k_BTKk, v_BTKk = proj("q", h, 1), proj("k", h, 1), proj("v", h, 1)
  if cfg.qk_norm_full:  # over all heads' values at once
    q_BTHk, k_BTKk = (rms_norm(x.reshape(B, T, -1), p[name].reshape(-1), cfg.norm_eps,
                               cfg.norm_plus_one).reshape(x.shape)
                      for x, name in ((q_BTHk, "q_norm"), (k_BTKk, "k_norm")))
  elif cfg.qk_norm:
    q_BTHk, k_BTKk = norm("q_norm", q_BTHk), norm("k_norm", k_BTKk)
  q_BTHk = c(rope(q_BTHk, inputs.positions_BT, inputs.freq_k), _ACT_Q)
  k_BTKk = c(rope(k_BTKk, inputs.positions_BT, inputs.freq_k), _ACT_KV)
  v_BTKk = c(v_BTKk, _ACT_KV)
  G = cfg.n_heads // cfg.n_kv_heads
  q_BTKGk = q_BTHk.reshape(B, T, cfg.n_kv_heads, G, cfg.head_dim)
  cache = None
  if inputs.flash is not None:
    attn_BTKGk = _flash_attention(cfg, q_BTKGk, k_BTKk, v_BTKk, *inputs.flash)
  elif inputs.cache_writer is None:
    attn_BTKGk = _blocked_attention(cfg, q_BTKGk, k_BTKk, v_BTKk, inputs.mask_BTS)
  else:
    cache = inputs.cache_writer(k_BTKk, v_BTKk)
    attn_BTKGk = _attend_cache(cfg, q_BTKGk, *cache, inputs.mask_BTS)
  out_BTD = proj("o", attn_BTKGk.reshape(B, T, cfg.n_heads, cfg.head_dim), 2)
  x_BTD = x_BTD + (norm("post_attn_norm", out_BTD) if cfg.post_norms else out_BTD)
  x_BTD = checkpoint_name(x_BTD, ATTN_RESIDUAL)

  h = norm("mlp_norm", x_BTD)
  router_BTE = None
  if cfg.n_experts:
    out_BTD, router_BTE = moe.mlp(cfg, h, p, _ACTIVATIONS[cfg.mlp_act])
  else:
    gate_BTF, up_BTF = (checkpoint_name(proj(name, h, 1), name_)
                        for name, name_ in (("gate", MLP_GATE), ("up", MLP_UP)))
    gated_BTF = c(_ACTIVATIONS[cfg.mlp_act](gate_BTF) * up_BTF, _ACT_MLP)
    out_BTD = proj("down", gated_BTF, 1)
  x_BTD = x_BTD + (norm("post_mlp_norm", out_BTD) if cfg.post_norms else out_BTD)
  return x_BTD, cache, router_BTE


def _attend_cache(cfg: ModelConfig, q_BTKGk, k_BCSl, v_BCSl, mask_BTS) -> jax.Array:
  """`attend` over a KV cache laid out [B, C, S, lanes] (`KVCache`: f = lanes / head_dim kv heads
  side by side in each row's lanes, `cache_packing`). The G x T queries of a kv head form one matrix, written in
  their head's lanes with zeros in the other f - 1 heads' (exact: the zeros add nothing to a
  score), so both contractions are plain matmuls batched over (B, C) that read the cache as it
  lies; the output keeps each query's own head's lanes. With f = 1 (a head_dim of 128 or more)
  the lanes are one head's and nothing is padded."""
  B, T, K, G, Hd = q_BTKGk.shape
  f = k_BCSl.shape[-1] // Hd  # the cache's packing (`init_cache`)
  C, Q = K // f, G * T
  q_BCfQk = jnp.moveaxis(q_BTKGk, 1, 3).reshape(B, C, f, Q, Hd)
  if f > 1:  # [B, C, f, Q, f, Hd]: head j's queries in lane block j
    own = jnp.eye(f, dtype=bool)[:, None, :, None]
    q_BCfQk = jnp.where(own, q_BCfQk[:, :, :, :, None], 0).astype(q_BTKGk.dtype)
  q_BCql = q_BCfQk.reshape(B, C, f * Q, f * Hd)
  scores = jnp.einsum("bcql,bcsl->bcqs", q_BCql, k_BCSl).astype(jnp.float32)
  scores = soft_cap(scores / math.sqrt(cfg.query_scale or cfg.head_dim), cfg.attn_softcap)
  mask_BQS = jnp.broadcast_to(mask_BTS[:, None], (B, G, *mask_BTS.shape[1:])).reshape(B, Q, -1)
  scores = jnp.where(mask_BQS[:, None, None], scores.reshape(B, C, f, Q, -1),
                     jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BCSl.dtype).reshape(B, C, f * Q, -1)
  out = jnp.einsum("bcqs,bcsl->bcql", probs, v_BCSl).reshape(B, C, f, Q, f, Hd)
  out_BKQk = jnp.stack([out[:, :, j, :, j] for j in range(f)], axis=2).reshape(B, K, Q, Hd)
  return jnp.moveaxis(out_BKQk.reshape(B, K, G, T, Hd), 3, 1)


def _blocked_attention(cfg: ModelConfig, q_BTKGk, k_BTKk, v_BTKk, mask_BTS):
  """`attend` over query blocks of cfg.attention_block slots. Query and key slots are the same
  0..T-1 (no cache), so a block of queries ending at slot e can only see keys before e (causal
  by slot), and the blocks above the diagonal are skipped."""
  T = q_BTKGk.shape[1]
  block = cfg.attention_block if cfg.attention_block < T else 0
  if not block:
    return attend(cfg, q_BTKGk, k_BTKk, v_BTKk, mask_BTS)
  return jnp.concatenate([
      attend(cfg, q_BTKGk[:, s:s + block], k_BTKk[:, :s + block], v_BTKk[:, :s + block],
              mask_BTS[:, s:s + block, :s + block])
      for s in range(0, T, block)], axis=1)


def _flash_attention(cfg: ModelConfig, q_BTKGk, k_BTKk, v_BTKk, slots: Slots, window):
  """`attend` under `attention_mask(slots, slots, window)` by the Pallas kernel (models/flash.py),
  which never holds more than a tile of scores. Under a mesh it runs per shard (`shard_map`):
  rows split as the batch, kv heads as the tensor axis; a row's slots are never split."""
  scale = 1.0 / math.sqrt(cfg.query_scale or cfg.head_dim)
  kernel = functools.partial(flash.attention, scale=scale, softcap=cfg.attn_softcap,
                             block=cfg.attention_tile)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return kernel(q_BTKGk, k_BTKk, v_BTKk, slots.segment, slots.branch, window)
  spec = lambda axes, x: sharding.logical_to_spec(axes, x.shape, mesh)
  q_spec = spec(("batch", "seq", "act_kv_heads", None, "head_dim"), q_BTKGk)
  kv_spec = spec(_ACT_KV, k_BTKk)
  row_spec = spec(("batch", "seq"), slots.segment)
  branch_spec = None if slots.branch is None else row_spec
  run = jax.shard_map(kernel, mesh=mesh,
                      in_specs=(q_spec, kv_spec, kv_spec, row_spec, branch_spec, P()),
                      out_specs=q_spec, check_vma=False)
  return run(q_BTKGk, k_BTKk, v_BTKk, slots.segment, slots.branch, jnp.asarray(window, jnp.int32))


# Checkpoint names of a layer's values that --remat_policy=projections keeps: the residual stream
# after the attention block (the MLP norm's input) and the MLP's gate and up projections, LoRA
# deltas included.
ATTN_RESIDUAL, MLP_GATE, MLP_UP = "attn_residual", "mlp_gate", "mlp_up"

# --remat_policy: what a rematerialised layer keeps for its backward. dots keeps the outputs of
# contractions without batch dimensions: the weight matmuls (and LoRA factors), not attention.
# attention keeps the Pallas kernel's output and log-sum-exp (models/flash.py), so the backward
# runs the projections again but not the attention forward. projections adds the kernel's q, k
# and v and the values above: what the backward reads of every matmul with a frozen or adapted
# weight, so only elementwise work (norms, RoPE, the activation, dropout masks) and LoRA's
# rank-r products run again.
_REMAT_POLICIES: dict[str, Callable] = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attention": jax.checkpoint_policies.save_only_these_names(flash.RESIDUALS),
    "projections": jax.checkpoint_policies.save_only_these_names(
        flash.RESIDUALS, flash.INPUTS, ATTN_RESIDUAL, MLP_GATE, MLP_UP),
}

_ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}

# Logical axes of the activations that get sharding constraints (see models/sharding.py RULES).
_ACT_RESID = ("batch", "seq", "act_embed")
_ACT_Q = ("batch", "seq", "act_heads", "head_dim")
_ACT_KV = ("batch", "seq", "act_kv_heads", "head_dim")
_ACT_MLP = ("batch", "seq", "act_mlp")
_ACT_LOGITS = ("batch", "seq", "act_vocab")


def _matrices(cfg: ModelConfig) -> list[str]:
  """Names of the per-layer matrices (the ones LoRA can adapt), in param_specs order."""
  return [name for name, s in param_specs(cfg)["layers"].items() if s.fan_in]


class KVCache(NamedTuple):
  """Keys and values of every layer for S slots, and the segment id of each slot.

  Slots are written in order by successive `forward` / `hidden` calls with `Decode(cache,
  index)` (`index` = the first slot of the call's tokens); a slot with segment 0 (padding or not
  yet written) is never attended to. Each layer's keys and values are their own array, laid out
  [B, C, S, lanes]: the K kv heads in C = K / f rows of f heads side by side (`cache_packing`),
  lanes = f x head_dim. A decode loop carrying the cache writes each step's slot into them in
  place (no stacked [L, ...] array to slice and restack every step), and attention reads them
  as they lie (`_attend_cache`).

  Why the packing: a TPU tiles an array's two minor dimensions by (8, 128), so a head_dim of 64
  as the minor one would be padded to 128 lanes; XLA then lays the cache out slot-minor
  instead, and writing one slot rewrites the whole array at every decode step (measured on a
  v5e at the Llama-3.2-1B shape: 53 us per layer's keys or values, 30% of the step). With two
  64-wide heads in 128 lanes the slot stays a major dimension and a step's write touches one
  row of each tile.
  """
  k: tuple[jax.Array, ...]  # L x [B, C, S, lanes] in the compute dtype
  v: tuple[jax.Array, ...]  # L x [B, C, S, lanes]
  segment_ids: jax.Array    # [B, S] int32


def cache_packing(cfg: ModelConfig, ways: int = 1) -> int:
  """f, the kv heads side by side in one row of the KV cache: up to 128 // head_dim (a head of
  128 lanes or more fills a tile alone), dividing the kv heads into at least two rows (with a
  single row XLA drops the size-1 dimension and copies the cache at every decode step) whose
  count the mesh's `ways` split of the kv heads still divides (else each device would hold the
  whole cache)."""
  f = 128 // cfg.head_dim if cfg.head_dim < 128 and 128 % cfg.head_dim == 0 else 1
  K = cfg.n_kv_heads
  while f > 1 and (K % f or K // f < 2 or (K % ways == 0 and (K // f) % ways)):
    f //= 2
  return f


def init_cache(cfg: ModelConfig, batch: int, slots: int) -> KVCache:
  """An empty cache; under a mesh its rows are packed so that the mesh still splits them as it
  splits the kv heads (`cache_packing`)."""
  f = cache_packing(cfg, sharding.ways("kv_heads"))
  shape = (batch, cfg.n_kv_heads // f, slots, f * cfg.head_dim)
  dtype = jnp.dtype(cfg.compute_dtype)
  zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  return KVCache(zeros(), zeros(), jnp.zeros((batch, slots), jnp.int32))


def unstack_layers(layers, n_layers: int) -> tuple:
  """A stacked `{"name": [L, ...]}` layer pytree (parameters or LoRA factors, quantized or not)
  as a tuple of L per-layer pytrees. A decode loop run over the tuple reads each layer's weights
  as the loop-invariant arrays they are; over the stacked pytree it would copy every layer's
  slice out of the stack at every step. Slice once, before the loop."""
  return tuple(jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n_layers))


def _cache_writer(k_BCSl, v_BCSl, index):
  """The `_layer` cache hook: writes this call's keys/values at `index` (each row's f heads
  side by side, `KVCache`), returns all S slots."""
  def write(k_BTKk, v_BTKk):
    def put(cache, new_BTKk):
      B, T, K, Hd = new_BTKk.shape
      C = cache.shape[1]
      new_BCTl = jnp.swapaxes(new_BTKk.reshape(B, T, C, (K // C) * Hd), 1, 2)
      return jax.lax.dynamic_update_slice_in_dim(cache, new_BCTl.astype(cache.dtype), index, 2)
    return put(k_BCSl, k_BTKk), put(v_BCSl, v_BTKk)
  return write


def forward(cfg: ModelConfig, params, inputs: Inputs, adapter: Adapter | None = None,
            decode: Decode | None = None):
  """Float32 logits [B, T, V] of `inputs` (with `decode`: (logits, the updated KVCache)).

  `adapter` is the LoRA delta (None: the frozen base alone, i.e. the reference policy).
  """
  out = hidden(cfg, params, inputs, adapter, decode)
  if decode is None:
    return unembed(cfg, params, out)
  return unembed(cfg, params, out[0]), out[1]


def hidden_and_router(cfg: ModelConfig, params, inputs: Inputs, adapter: Adapter | None = None):
  """(`hidden` of `inputs`, every layer's router logits [L, B, T, E] float32) of a mixture of
  experts (models/moe.py): what the router's auxiliary loss and load figures read."""
  if not cfg.n_experts:
    raise ValueError("router logits: the model has no experts (--n_experts=0)")
  return _hidden(cfg, params, inputs, adapter, router=True)


def hidden(cfg: ModelConfig, params, inputs: Inputs, adapter: Adapter | None = None,
           decode: Decode | None = None):
  """Final hidden states [B, T, D] (after the final norm) of `inputs`: `forward` without the LM
  head, for callers that apply it to a few slots only.

  With `decode` (a KV cache) the T tokens occupy cache slots [decode.index, decode.index + T),
  attend to every earlier non-padding slot of the same segment, and the result is (hidden, the
  updated cache). Positions (for RoPE) are independent of slots. Branch ids are not supported
  with a cache.
  """
  if decode is not None:
    return _decode_layers(cfg, params, _embed(cfg, params, inputs.tokens_BT), inputs, adapter,
                          decode)
  return _hidden(cfg, params, inputs, adapter, router=False)[0]


def _hidden(cfg: ModelConfig, params, inputs: Inputs, adapter: Adapter | None, router: bool):
  """`hidden`'s layer scan: (final hidden states, the router logits [L, B, T, E] with `router`,
  else None)."""
  x_BTD = _embed(cfg, params, inputs.tokens_BT)
  q, kv = _slots(inputs, None)
  # Per-layer variation (sliding window, local RoPE base) rides along the scan as a flag.
  local_L = np.asarray(cfg.layer_is_local())
  use_flash = cfg.flash_attention()
  mask_BTS = local_mask_BTS = None
  if not use_flash:
    mask_BTS = attention_mask(q, kv)
    local_mask_BTS = attention_mask(q, kv, cfg.sliding_window) if local_L.any() else mask_BTS
  freq_global, freq_local = (jnp.asarray(rope_frequencies(cfg, local)) for local in (False, True))

  def body(x, xs):
    p, lp, i, local = xs
    key = None if adapter is None or adapter.dropout_key is None else jax.random.fold_in(
        adapter.dropout_key, i)
    mask, freq = mask_BTS, freq_global
    if local_L.any():
      mask = None if use_flash else jnp.where(local, local_mask_BTS, mask_BTS)
      freq = jnp.where(local, freq_local, freq_global)
    window = jnp.where(local, cfg.sliding_window, 0) if use_flash else None
    layer_inputs = _LayerInputs(inputs.positions_BT, mask, freq,
                                flash=(q, window) if use_flash else None)
    x, _, router_BTE = _layer(cfg, x, p, None if adapter is None else adapter.at_layer(lp, key),
                              layer_inputs)
    return sharding.constrain(x, _ACT_RESID), router_BTE if router else None

  if cfg.remat:
    if cfg.remat_policy in ("attention", "projections") and not use_flash:
      raise ValueError(f"--remat_policy={cfg.remat_policy}: keeps the Pallas attention's "
                       f"values, and this {jax.default_backend()} run's attention is XLA's "
                       "(--attention=auto picks the kernel on a TPU): give --attention=pallas "
                       "or another --remat_policy")
    body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat_policy])
  lora_layers = {} if adapter is None or adapter.lora is None else adapter.lora["layers"]
  xs = (params["layers"], lora_layers, jnp.arange(cfg.n_layers), jnp.asarray(local_L))
  x_BTD, router_LBTE = jax.lax.scan(body, x_BTD, xs, unroll=min(cfg.scan_unroll, cfg.n_layers))
  return rms_norm(x_BTD, params["final_norm"], cfg.norm_eps, cfg.norm_plus_one), router_LBTE


def _embed(cfg: ModelConfig, params, tokens_BT: jax.Array) -> jax.Array:
  """The residual stream's input [B, T, D]: the tokens' embedding rows (scaled for Gemma)."""
  dtype = jnp.dtype(cfg.compute_dtype)
  # Gather the table's embed dimension first (rows stay split by "vocab"); a lookup into a
  # table whose embed dimension is split makes XLA replicate the whole table instead.
  table_VD = sharding.constrain(params["embed"].astype(dtype), ("vocab", "act_embed"))
  x_BTD = table_VD[tokens_BT]
  if cfg.embed_scale:
    x_BTD = x_BTD * jnp.asarray(math.sqrt(cfg.d_model), dtype)
  return sharding.constrain(x_BTD, _ACT_RESID)


def _decode_layers(cfg: ModelConfig, params, x_BTD, inputs: Inputs, adapter: Adapter | None,
                   decode: Decode):
  """`hidden`'s layers over a KV cache: (final hidden states [B, T, D], the updated cache).

  A Python loop over the layers, not the training path's scan: each layer reads its own cache
  arrays (updated in place when a decode loop carries them) and its own weights, without a
  per-step slice of the stacked ones when `params["layers"]` (and the adapter's
  `lora["layers"]`) are `unstack_layers` tuples, as models/sampler.py passes them. Stacked
  pytrees work too (sliced here). Sliding-window layers are known per layer, so each gets its
  own mask statically. Same math as the scan, layer by layer.
  """
  q, kv = _slots(inputs, decode)
  local_L = cfg.layer_is_local()
  mask = {local: attention_mask(q, kv, cfg.sliding_window if local else 0)
          for local in set(local_L)}
  freq = {local: jnp.asarray(rope_frequencies(cfg, local)) for local in set(local_L)}
  layers = _per_layer(params["layers"], cfg.n_layers)
  lora = None if adapter is None or adapter.lora is None else adapter.lora["layers"]
  lora = None if lora is None else _per_layer(lora, cfg.n_layers)
  ks, vs = [], []
  for i, local in enumerate(local_L):
    layer_adapter = None
    if adapter is not None:
      key = None if adapter.dropout_key is None else jax.random.fold_in(adapter.dropout_key, i)
      layer_adapter = adapter.at_layer({} if lora is None else lora[i], key)
    hook = _cache_writer(decode.cache.k[i], decode.cache.v[i], decode.index)
    x_BTD, (k, v), _ = _layer(cfg, x_BTD, layers[i], layer_adapter,
                              _LayerInputs(inputs.positions_BT, mask[local], freq[local], hook))
    x_BTD = sharding.constrain(x_BTD, _ACT_RESID)
    ks.append(k)
    vs.append(v)
  h_BTD = rms_norm(x_BTD, params["final_norm"], cfg.norm_eps, cfg.norm_plus_one)
  return h_BTD, KVCache(tuple(ks), tuple(vs), kv.segment)


def _per_layer(layers, n_layers: int) -> tuple:
  """Per-layer pytrees: an `unstack_layers` tuple as it is, a stacked pytree sliced."""
  return layers if isinstance(layers, tuple) else unstack_layers(layers, n_layers)


def _slots(inputs: Inputs, decode: Decode | None) -> tuple[Slots, Slots]:
  """The query and key slots of a forward: the same T slots, or (decoding) the call's T slots
  against the cache's S with this call's segment ids written in."""
  index_BT = jnp.broadcast_to(jnp.arange(inputs.tokens_BT.shape[1]), inputs.tokens_BT.shape)
  if decode is None:
    q = Slots(inputs.segment_ids_BT, index_BT, inputs.branch_BT)
    return q, q
  if inputs.branch_BT is not None:
    raise ValueError("branch ids (shared-prefix rows) are not supported with a KV cache")
  kv_segment_BS = jax.lax.dynamic_update_slice_in_dim(decode.cache.segment_ids,
                                                      inputs.segment_ids_BT, decode.index, 1)
  kv_index_BS = jnp.broadcast_to(jnp.arange(kv_segment_BS.shape[1]), kv_segment_BS.shape)
  return Slots(inputs.segment_ids_BT, decode.index + index_BT), Slots(kv_segment_BS, kv_index_BS)


def unembed(cfg: ModelConfig, params, h_BTD: jax.Array) -> jax.Array:
  """Float32 logits [B, T, V] from final hidden states (soft-capped when configured)."""
  if cfg.tie_embeddings:
    logits = jnp.einsum("btd,vd->btv", h_BTD, params["embed"].astype(h_BTD.dtype))
  else:
    logits = dense(h_BTD, params["lm_head"], 1, explicit=cfg.explicit_backward)
  return sharding.constrain(soft_cap(logits.astype(jnp.float32), cfg.final_softcap), _ACT_LOGITS)


def num_params(tree) -> int:
  """Parameters of a (possibly quantized) pytree: a quantized matrix counts its float shape."""
  def count(x):
    if isinstance(x, quant.NF4Weight):
      return math.prod(x.packed.shape[:-2]) * math.prod(x.shape)
    return math.prod((x.q if isinstance(x, quant.Int8Weight) else x).shape)
  return sum(count(x) for x in jax.tree.leaves(tree, is_leaf=quant.is_quantized))


def nbytes(tree) -> int:
  """Bytes held by a (possibly quantized) parameter pytree or its abstract shapes."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

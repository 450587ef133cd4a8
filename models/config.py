"""The model's config sections, `ModelConfig` and `LoraConfig`, and the helpers every section uses.

They live with the models so that nothing in models/ imports configs.py or dpo/ at run time;
configs.py imports them from here and puts them beside the other sections of a `Config`.

Each field is written out with its default and its help text (`option`); the flag of the same
name shows the help. Validation has one form in every section: single-field rules as
`rules(section, name=(test, allowed))`, the test written as what is allowed (so NaN fails it),
and cross-field rules as `check(ok, message)`. Every message is one line that starts with the
flag and its value: `--name=value: must be ...`, a cross-field one naming the other flag too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from models import archs
from models import lora as lora_lib

ARCHS = archs.ARCHS  # the architecture registry (models/archs.py)
LORA_TARGETS = tuple(lora_lib.TARGETS)  # the LoRA target registry (models/lora.py)

Rule = tuple[Callable[[Any], bool], str]  # (test of the value, what is allowed)


def option(default: Any, help: str) -> Any:
  """A config field: its default and its help text (the flag of the same name shows it)."""
  if isinstance(default, (list, dict, set)):
    raise TypeError("use tuples for sequence defaults so configs stay hashable")
  return dataclasses.field(default=default, metadata={"help": help})


def check(ok: bool, message: str) -> None:
  """A cross-field rule: `message` (`--name=value: must ...`, naming the other flag) unless ok."""
  if not ok:
    raise ValueError(message)


def shown(value: Any) -> str:
  """A value as a message shows it: tuples comma-joined as the flag takes them, else repr."""
  return ",".join(map(str, value)) if isinstance(value, tuple) else repr(value)


def rules(section, **named_rules: Rule) -> None:
  """Each `name=(test, allowed)`: the field's value must pass `test`, else one line naming the
  flag, the value and what is allowed. Tests are written as what is allowed, so NaN fails them."""
  for name, (test, allowed) in named_rules.items():
    value = getattr(section, name)
    check(bool(test(value)), f"--{name}={shown(value)}: must be {allowed}")


def _spoken(choices: Sequence[str]) -> str:
  return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


def one_of(choices: Sequence[str]) -> Rule:
  """The value is one of `choices`."""
  return (lambda v: v in choices, _spoken(choices))


def each_of(choices: Sequence[str]) -> Rule:
  """Every item of a tuple value is one of `choices`."""
  return (lambda v: all(x in choices for x in v), f"names from {', '.join(choices)}")


def at_least(n: int) -> Rule:
  return (lambda v: v >= n, f">= {n}")


POS = (lambda v: v > 0, "> 0")
NONNEG = (lambda v: v >= 0, ">= 0")
FINITE_NONNEG = (lambda v: 0 <= v < float("inf"), "a finite number >= 0")
FINITE_POS = (lambda v: 0 < v < float("inf"), "a finite number > 0")
UNIT = (lambda v: 0 <= v < 1, "in [0, 1)")
FRACTION = (lambda v: 0 < v <= 1, "in (0, 1]")


@dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = option(264, "Vocabulary size (model rows; >= tokenizer vocab).")
  d_model: int = option(128, "Residual stream width.")
  n_layers: int = option(4, "Number of transformer blocks.")
  n_heads: int = option(4, "Query heads.")
  n_kv_heads: int = option(2, "Key/value heads (grouped-query attention); divides n_heads.")
  head_dim: int = option(32, "Width of each attention head.")
  mlp_dim: int = option(384, "SwiGLU hidden width.")
  rope_theta: float = option(10_000.0, "Rotary embedding base.")
  norm_eps: float = option(1e-5, "RMSNorm epsilon.")
  tie_embeddings: bool = option(False, "Share the token embedding with the LM head.")
  init_std: float = option(0.02, "Stddev of the normal initializer for matrices.")
  compute_dtype: str = option("float32", "Matmul dtype: float32 or bfloat16 (params stay float32).")
  remat: bool = option(False, "Rematerialize each layer in the backward pass (saves activations; "
                       "needs scan_unroll=1).")
  remat_policy: str = option("nothing", "With --remat, what each layer keeps for the backward: "
                             "nothing (the whole layer runs again), dots (the weight matmuls' "
                             "outputs, [tokens, width] each; only the elementwise work and "
                             "attention run again) or attention (the Pallas attention's output "
                             "and log-sum-exp: the projections run again, the attention forward "
                             "does not; needs the Pallas kernel) or projections (attention's, "
                             "plus the kernel's q, k, v, the residual stream after attention and "
                             "the MLP's gate and up: only elementwise work and LoRA's rank-r "
                             "products run again; needs the Pallas kernel).")
  prefix_sharing: bool = option(True, "DPO: one row per pair, prompt | chosen | rejected, so the "
                                "prompt is computed once per model (dpo/packing.py); off where the "
                                "pair rows do not share a prompt (logged).")
  packing: bool = option(False, "DPO with prefix sharing: several pairs' shared rows one after "
                         "another in each row of the longest one's length, no attention across "
                         "pairs, each step's pairs, LoRA dropout masks and loss unchanged "
                         "(dpo/packing.py); helps when pair lengths vary.")
  logits_chunk: int = option(0, "With prefix sharing: log-softmax over vocabulary chunks of this "
                             "size (a divisor of vocab_size), so [tokens, vocab] logits never "
                             "exist; 0 = the whole vocabulary at once.")
  scan_unroll: int = option(1, "Layers per iteration of the layer scan (jax.lax.scan's unroll); >= "
                            "n_layers runs the layers as straight-line code, without the scan's "
                            "stacked per-layer buffers, at a compile time that grows with depth.")
  matmul_backward: str = option("autodiff", "Backward of the model's weight matmuls (projections, "
                                "LM head, LoRA factors): autodiff (JAX's transpose rule) "
                                "or explicit (the weight gradient x^T.dy formed in the weight's "
                                "layout; same sums; models/transformer.py matmul).")
  attention_block: int = option(0, "Attention over query blocks of this many slots, each against "
                                "the keys up to its own last slot only, so fully masked blocks "
                                "above the causal diagonal are never computed (training and "
                                "scoring; decoding with a cache is unchanged); 0 = one block. "
                                "The XLA attention only (--attention=xla).")
  attention: str = option("auto", "Training and scoring attention: xla (scores and softmax as "
                          "XLA ops, [T, T] scores per head in memory), pallas (the flash "
                          "kernel of models/flash.py: [tile, tile] scores on chip only; on a "
                          "TPU, elsewhere in Pallas's slow interpret mode) or auto (pallas on "
                          "a TPU unless --attention_block is set, xla elsewhere). Decoding "
                          "with a KV cache is always xla.")
  attention_tile: int = option(512, "--attention=pallas: query and key tile of the kernel, a "
                               "multiple of 128 (rows shorter than a tile use one tile).")
  # Architecture switches (one model definition; Hugging Face families differ only here).
  arch: str = option("llama", f"Hugging Face model_type written on export, from {ARCHS}.")
  mlp_act: str = option("silu", "Gated-MLP activation: silu (SwiGLU), gelu_tanh or gelu (GeGLU).")
  qkv_bias: bool = option(False, "Biases on the q, k and v projections (Qwen2).")
  qk_norm: bool = option(False, "RMSNorm over head_dim on queries and keys before RoPE (Qwen3, "
                         "Gemma 3).")
  norm_plus_one: bool = option(False, "RMSNorm scales by (1 + w) instead of w (Gemma).")
  post_norms: bool = option(False, "Extra RMSNorm on the attention and MLP outputs (Gemma 2/3).")
  embed_scale: bool = option(False, "Multiply token embeddings by sqrt(d_model) (Gemma).")
  attn_softcap: float = option(0.0, "Attention logit soft-cap c: c * tanh(s / c); 0 disables.")
  final_softcap: float = option(0.0, "Final logit soft-cap; 0 disables.")
  query_scale: float = option(0.0, "Attention scores are scaled by query_scale**-0.5; 0 = "
                              "head_dim.")
  sliding_window: int = option(0, "Local layers attend to the last N keys only; 0 = all layers "
                               "global.")
  sliding_pattern: int = option(1, "With sliding_window: layer i is global iff (i + 1) % N == 0 (1 "
                                "= every layer local, 2 = Gemma 2, 6 = Gemma 3).")
  rope_local_theta: float = option(0.0, "RoPE base of local (sliding) layers; 0 = as global "
                                   "layers.")
  rope_scaling: str = option("none", "RoPE frequency scaling of global layers: none, linear or "
                             "llama3.")
  rope_factor: float = option(1.0, "RoPE scaling factor (linear, llama3).")
  rope_low_freq_factor: float = option(1.0, "llama3 RoPE scaling: low-frequency factor.")
  rope_high_freq_factor: float = option(4.0, "llama3 RoPE scaling: high-frequency factor.")
  rope_original_max_len: int = option(8192, "llama3 RoPE scaling: original context length.")
  n_experts: int = option(0, "Mixture of experts: experts of every layer's MLP, each a gated "
                          "MLP of --mlp_dim (0 = one dense MLP; models/moe.py).")
  experts_per_token: int = option(2, "Mixture of experts: experts each token is routed to (the "
                                  "router's top-k).")
  router_norm_topk: bool = option(False, "Mixture of experts: renormalise the top-k routing "
                                  "probabilities to sum to 1 (Mixtral always; Qwen3-MoE and "
                                  "OLMoE as norm_topk_prob says).")
  router_aux_loss_coef: float = option(0.0, "Mixture of experts: weight of the router's "
                                       "load-balancing loss added to every training loss "
                                       "(transformers' router_aux_loss_coef, as TRL adds it; "
                                       "0 = off).")
  router_z_loss_coef: float = option(0.0, "Mixture of experts: weight of the router z-loss "
                                     "(ST-MoE) added to every training loss (0 = off).")
  qk_norm_full: bool = option(False, "With --qk_norm: one RMSNorm over all heads' queries (and "
                              "one over all keys) instead of one per head (OLMoE).")
  base_quant: str = option("none", "Store the frozen base's layer matrices in less than "
                           "float32: none, bf16 (bfloat16; exact for a bfloat16 checkpoint), int8 "
                           "(per-channel absmax) or nf4 (64-element blocks, QLoRA code book). "
                           "Needs LoRA.")

  def __post_init__(self):
    rules(self, **{k: POS for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                    "mlp_dim")},
          head_dim=(lambda v: v > 0 and v % 2 == 0, "> 0 and even (rotary embeddings)"),
          rope_theta=FINITE_POS, norm_eps=FINITE_POS, init_std=FINITE_POS,
          attn_softcap=FINITE_NONNEG, final_softcap=FINITE_NONNEG, query_scale=FINITE_NONNEG,
          rope_local_theta=FINITE_NONNEG, rope_factor=FINITE_POS,
          rope_low_freq_factor=FINITE_POS, rope_high_freq_factor=FINITE_POS,
          rope_original_max_len=POS, compute_dtype=one_of(("float32", "bfloat16")),
          arch=one_of(ARCHS), mlp_act=one_of(("silu", "gelu_tanh", "gelu")),
          rope_scaling=one_of(("none", "linear", "llama3")),
          base_quant=one_of(("none", "bf16", "int8", "nf4")),
          matmul_backward=one_of(("autodiff", "explicit")), sliding_window=NONNEG,
          sliding_pattern=at_least(1), scan_unroll=at_least(1), attention_block=NONNEG,
          logits_chunk=NONNEG, attention=one_of(("auto", "xla", "pallas")),
          remat_policy=one_of(("nothing", "dots", "attention", "projections")),
          attention_tile=(lambda v: v > 0 and v % 128 == 0, "a positive multiple of 128"))
    check(self.attention != "pallas" or not self.attention_block,
          f"--attention_block={self.attention_block}: applies to --attention=xla; the pallas "
          "kernel skips the tiles above the causal diagonal itself (give --attention_block=0)")
    check(not self.n_experts or 1 <= self.experts_per_token <= self.n_experts,
          f"--experts_per_token={self.experts_per_token}: must be in [1, --n_experts="
          f"{self.n_experts}]")
    check(self.n_experts >= 0, f"--n_experts={self.n_experts}: must be >= 0 (0: a dense MLP)")
    check(not self.n_experts or self.base_quant == "none",
          f"--base_quant={self.base_quant}: the experts of --n_experts={self.n_experts} are not "
          "quantized; give --base_quant=none")
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
      check(getattr(self, name) >= 0, f"--{name}={getattr(self, name)}: must be >= 0")
    check(self.qk_norm or not self.qk_norm_full, "--qk_norm_full=True: must go with --qk_norm")
    moe_archs = [a for a, x in archs.ARCHITECTURES.items() if x.experts is not None]
    check(bool(self.n_experts) == (self.arch in moe_archs),
          f"--n_experts={self.n_experts} with --arch={self.arch}: a mixture of experts is one of "
          f"--arch={','.join(moe_archs)} (its export's family), a dense MLP any other")
    check(self.n_heads % self.n_kv_heads == 0,
          f"--n_kv_heads={self.n_kv_heads}: must divide --n_heads={self.n_heads}")
    check(self.prefix_sharing or not self.packing,
          "--packing=True: must go with --prefix_sharing=True (it packs shared-prefix rows)")
    # Unrolled layers let XLA schedule each layer's recomputation early and keep what remat frees.
    check(not self.remat or min(self.scan_unroll, self.n_layers) <= 1,
          f"--remat=True: must go with --scan_unroll=1, not {self.scan_unroll}: it recomputes "
          f"each layer inside the layer scan, and unrolled layers keep the activations it would "
          f"free")
    check(self.attention != "xla" or self.attention_tile == 512,
          f"--attention_tile={self.attention_tile}: the Pallas kernel's tile; --attention=xla "
          "never reads it")
    check(self.remat or self.remat_policy == "nothing",
          f"--remat_policy={self.remat_policy}: applies with --remat=True")
    check(self.remat_policy not in ("attention", "projections") or self.attention != "xla",
          f"--remat_policy={self.remat_policy}: keeps the Pallas attention's values; "
          "--attention=xla has none")
    check(not self.logits_chunk or self.vocab_size % self.logits_chunk == 0,
          f"--logits_chunk={self.logits_chunk}: must be 0 or a divisor of "
          f"--vocab_size={self.vocab_size}")

  @property
  def router_losses(self) -> bool:
    """Whether training forwards keep the router's statistics (models/moe.py) for its losses."""
    return bool(self.router_aux_loss_coef or self.router_z_loss_coef)

  @property
  def explicit_backward(self) -> bool:
    """Whether the weight matmuls use models/transformer.matmul's written-out backward."""
    return self.matmul_backward == "explicit"

  def flash_attention(self) -> bool:
    """Whether training and scoring attention runs the Pallas kernel (models/flash.py): asked
    for, or `auto` on a TPU without an XLA-only --attention_block. Read while tracing."""
    if self.attention == "auto":
      return jax.default_backend() == "tpu" and not self.attention_block
    return self.attention == "pallas"

  def layer_is_local(self) -> tuple[bool, ...]:
    """Per layer: True where attention is restricted to the sliding window."""
    if not self.sliding_window:
      return (False,) * self.n_layers
    return tuple((i + 1) % self.sliding_pattern != 0 or self.sliding_pattern == 1
                 for i in range(self.n_layers))


@dataclass(frozen=True)
class LoraConfig:
  lora_rank: int = option(16, "LoRA rank r; 0 disables LoRA (full fine-tuning, frozen reference "
                          "copy).")
  lora_alpha: float = option(32.0, "LoRA alpha; the delta is scaled by alpha / rank.")
  lora_dropout: float = option(0.05, "Dropout on the LoRA input path during training.")
  lora_dropout_rng: str = option("auto", "How the LoRA dropout masks are drawn: threefry (JAX's "
                                 "default generator: the same masks on every platform and mesh), "
                                 "rbg (the platform's own bit generator, seeded from the same "
                                 "key: far cheaper on a TPU, docs/tpu.md; masks differ between "
                                 "platforms) or auto (rbg on a TPU, threefry elsewhere).")
  lora_targets: tuple[str, ...] = option(("q", "v"), f"Projections that get adapters, from "
                                                     f"{LORA_TARGETS}.")

  def __post_init__(self):
    rules(self, lora_targets=each_of(LORA_TARGETS), lora_rank=NONNEG,
          lora_alpha=(lambda v: 0 < v < float("inf"),
                      "a finite number > 0 (the delta is scaled by alpha / rank)"),
          lora_dropout=UNIT, lora_dropout_rng=one_of(("auto", "threefry", "rbg")))
    check(self.lora_dropout_rng == "auto" or (self.lora_rank > 0 and self.lora_dropout > 0),
          f"--lora_dropout_rng={self.lora_dropout_rng}: no LoRA dropout reads it (give "
          "--lora_rank > 0 and --lora_dropout > 0)")

  @property
  def enabled(self) -> bool:
    return self.lora_rank > 0

  def dropout_rng_impl(self) -> str:
    """--lora_dropout_rng with auto resolved for the backend this process computes on."""
    if self.lora_dropout_rng != "auto":
      return self.lora_dropout_rng
    return "rbg" if jax.default_backend() == "tpu" else "threefry"

  @property
  def scale(self) -> float:
    return self.lora_alpha / self.lora_rank if self.enabled else 1.0

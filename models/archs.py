"""The supported Hugging Face architectures: one entry per family, carrying all it implies.

One model definition (models/transformer.py) covers every family; an entry says which of its
switches the family turns on, what config.json calls things, and the checkpoint's names for the
tensors that are not projections. The projections' names (q_proj, ..., down_proj, and the
q/k/v biases) are the same in every family and live with the LoRA targets (models/lora.py
TARGETS), since PEFT addresses the same modules. models/hf.py reads both.

This module imports nothing from the project, so models/config.py can take `ARCHS` from it.
"""

from __future__ import annotations

from typing import NamedTuple


class Switches(NamedTuple):
  """The ModelConfig fields a family fixes (field name = ModelConfig field name)."""
  qkv_bias: bool = False       # biases on q, k, v (Qwen2)
  qk_norm: bool = False        # RMSNorm on queries and keys (Qwen3, Gemma 3)
  norm_plus_one: bool = False  # RMSNorm scales by (1 + w) (Gemma)
  post_norms: bool = False     # RMSNorm on the attention and MLP outputs (Gemma 2/3)
  embed_scale: bool = False    # embeddings times sqrt(d_model) (Gemma)
  qk_norm_full: bool = False   # the q / k norms over all heads at once (OLMoE)


class Experts(NamedTuple):
  """How config.json describes a mixture of experts (models/moe.py)."""
  count_keys: tuple[str, ...]  # the number of experts, the first key found (written on export)
  width_key: str         # each expert's hidden width
  norm_topk: bool | None  # top-k weights renormalised: always (True), or as norm_topk_prob says


class Arch(NamedTuple):
  """One architecture.

  `sliding` says how config.json marks sliding-window layers:
    "none":      never (Qwen2/3: use_sliding_window=true is rejected, layer_types ignored);
    "listed":    only through layer_types (Llama);
    "all":       every layer when sliding_window is set (Mistral);
    "alternate": layer_types, else every second layer global (Gemma 2);
    "periodic":  layer_types, else every sliding_window_pattern-th layer global (Gemma 3).
  `tensor_names` maps our param path to the checkpoint name ({i} = layer index) for every
  tensor but the projections.
  """
  model_type: str      # config.json "model_type"; also ModelConfig.arch
  hf_class: str        # config.json "architectures" entry (the transformers class)
  switches: Switches
  tensor_names: dict[tuple[str, ...], str]
  sliding: str
  tied_default: bool = False  # tie_word_embeddings when config.json leaves it out
  act_key: str = "hidden_act"  # the config.json key the export writes the activation under
  gemma_scalars: bool = False  # config.json has query_pre_attn_scalar and logit soft-caps
  local_rope: bool = False     # sliding layers may have their own RoPE base
  experts: Experts | None = None  # a mixture of experts in place of the dense MLP


LAYER = "model.layers.{i}."  # the name prefix of layer i's tensors, in every family
_LLAMA_NAMES = {
    ("embed",): "model.embed_tokens.weight",
    ("final_norm",): "model.norm.weight",
    ("lm_head",): "lm_head.weight",
    ("layers", "attn_norm"): LAYER + "input_layernorm.weight",
    ("layers", "mlp_norm"): LAYER + "post_attention_layernorm.weight",
    ("layers", "q_norm"): LAYER + "self_attn.q_norm.weight",
    ("layers", "k_norm"): LAYER + "self_attn.k_norm.weight",
}
# Gemma's post_attention_layernorm normalizes the attention output; the norm before the MLP is
# pre_feedforward_layernorm.
_GEMMA_NAMES = {
    **_LLAMA_NAMES,
    ("layers", "mlp_norm"): LAYER + "pre_feedforward_layernorm.weight",
    ("layers", "post_attn_norm"): LAYER + "post_attention_layernorm.weight",
    ("layers", "post_mlp_norm"): LAYER + "post_feedforward_layernorm.weight",
}
_GEMMA = dict(tied_default=True, act_key="hidden_activation", gemma_scalars=True)
_GEMMA_SWITCHES = dict(norm_plus_one=True, post_norms=True, embed_scale=True)

# A mixture's router and experts ({e} = the expert's index): Qwen3-MoE's and OLMoE's under
# mlp, Mixtral's under block_sparse_moe with w1 / w3 / w2 for gate / up / down.
_MOE_NAMES = {
    **_LLAMA_NAMES,
    ("layers", "router"): LAYER + "mlp.gate.weight",
    ("layers", "expert_gate"): LAYER + "mlp.experts.{e}.gate_proj.weight",
    ("layers", "expert_up"): LAYER + "mlp.experts.{e}.up_proj.weight",
    ("layers", "expert_down"): LAYER + "mlp.experts.{e}.down_proj.weight",
}
_MIXTRAL_NAMES = {
    **_LLAMA_NAMES,
    ("layers", "router"): LAYER + "block_sparse_moe.gate.weight",
    ("layers", "expert_gate"): LAYER + "block_sparse_moe.experts.{e}.w1.weight",
    ("layers", "expert_up"): LAYER + "block_sparse_moe.experts.{e}.w3.weight",
    ("layers", "expert_down"): LAYER + "block_sparse_moe.experts.{e}.w2.weight",
}

# transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the Hub's files and OLMoE
# say num_experts.
_COUNT = ("num_experts", "num_local_experts")

ARCHITECTURES: dict[str, Arch] = {a.model_type: a for a in (
    Arch("llama", "LlamaForCausalLM", Switches(), _LLAMA_NAMES, "listed"),
    Arch("mistral", "MistralForCausalLM", Switches(), _LLAMA_NAMES, "all"),
    Arch("qwen2", "Qwen2ForCausalLM", Switches(qkv_bias=True), _LLAMA_NAMES, "none"),
    Arch("qwen3", "Qwen3ForCausalLM", Switches(qk_norm=True), _LLAMA_NAMES, "none"),
    Arch("gemma2", "Gemma2ForCausalLM", Switches(**_GEMMA_SWITCHES), _GEMMA_NAMES, "alternate",
         **_GEMMA),
    Arch("gemma3_text", "Gemma3ForCausalLM", Switches(qk_norm=True, **_GEMMA_SWITCHES),
         _GEMMA_NAMES, "periodic", **_GEMMA, local_rope=True),
    Arch("qwen3_moe", "Qwen3MoeForCausalLM", Switches(qk_norm=True), _MOE_NAMES, "none",
         experts=Experts(_COUNT, "moe_intermediate_size", None)),
    Arch("mixtral", "MixtralForCausalLM", Switches(), _MIXTRAL_NAMES, "all",
         experts=Experts(("num_local_experts", "num_experts"), "intermediate_size", True)),
    Arch("olmoe", "OlmoeForCausalLM", Switches(qk_norm=True, qk_norm_full=True), _MOE_NAMES,
         "none", experts=Experts(_COUNT, "intermediate_size", None)),
)}
ARCHS = tuple(ARCHITECTURES)

"""Hugging Face checkpoints: import into sharded params, export merged weights and PEFT adapters.

`load(dir, mesh)` reads `config.json` and `*.safetensors` (a single file or a sharded set with
`model.safetensors.index.json`) straight into the parameter shardings: every array is built by
`jax.make_array_from_callback`, whose callback reads, through a memory map, only the rows and
columns of the tensors that the local devices hold. No host reads the whole model.

`save(...)` writes the policy (LoRA merged, a quantized base dequantized) as `config.json` +
`model*.safetensors` that transformers loads; `save_peft(...)` writes the LoRA factors alone as
`adapter_config.json` + `adapter_model.safetensors` with PEFT's key names; `save_tokenizer` and
`save_generation_config` add the tokenizer files (with the chat template the data was rendered
with) and `generation_config.json` (its eos_token_id lists every end-of-turn id, so `generate`
stops at the end of the assistant's turn).

Safetensors files are read and written with the `safetensors` library (`safe_open` slices only
the rows and columns asked for, bfloat16 included via ml_dtypes).

Layouts. HF linear weights are [out, in]; ours are [layers, *in, *out] (q: [L, D, H, Hd],
o: [L, H, Hd, D]), so a layer's matrix is HF.T reshaped. Norm scales and biases are flat
vectors in both. What differs by family (switches, config.json keys, tensor names) is in
models/archs.py ARCHITECTURES; the projections' names are the LoRA targets' modules
(models/lora.py TARGETS).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from models import archs
from models import lora as lora_lib
from models import quant, sharding, transformer
from models.config import LoraConfig, ModelConfig


class HFError(ValueError):
  """An unsupported or inconsistent Hugging Face checkpoint (names the file and field/tensor)."""


# --- safetensors files ---------------------------------------------------------------------------

_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"}


def _safe_open(path: str):
  try:
    from safetensors import safe_open
  except ImportError as e:
    raise ImportError("Hugging Face checkpoints need the `safetensors` package: pip install "
                      "'dpo-jax[hf]'") from e
  try:
    return safe_open(path, framework="numpy")
  except Exception as e:  # safetensors' own error type: name the file instead
    raise HFError(f"{path}: not a readable safetensors file ({e})") from None


class LazyTensor:
  """One tensor of a safetensors file; indexing with slices reads only that block."""

  def __init__(self, path: str, name: str, shape: tuple[int, ...]):
    self.path, self.name, self.shape = path, name, shape

  def __getitem__(self, index):
    with _safe_open(self.path) as f:
      return f.get_slice(self.name)[index]

  def __array__(self, dtype=None, copy=None):
    with _safe_open(self.path) as f:
      out = f.get_tensor(self.name)
    return out if dtype is None else out.astype(dtype)


def _read_json(path: str) -> Any:
  """A JSON file of a folder; one that is missing, that this process may not read or that is
  not JSON raises HFError naming it."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise HFError(f"{path}: cannot read ({e})") from None


class SafetensorsDir:
  """Every tensor of a checkpoint directory, by name; `get` returns a `LazyTensor`. A folder or
  file this process may not read raises HFError naming it (safetensors' own error calls it
  missing)."""

  def __init__(self, directory: str):
    self.dir = directory
    try:
      names = os.listdir(directory)
    except OSError as e:
      raise HFError(f"{directory}: cannot read ({e})") from None
    if "model.safetensors.index.json" in names:
      index = _read_json(os.path.join(directory, "model.safetensors.index.json"))
      files = [os.path.join(directory, x) for x in sorted(set(index["weight_map"].values()))]
    else:
      files = sorted(os.path.join(directory, n) for n in names
                     if n.endswith(".safetensors") and not n.startswith("."))
    if not files:
      raise HFError(f"{directory}: no *.safetensors files")
    self.entries: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for path in files:
      try:
        open(path, "rb").close()
      except OSError as e:
        raise HFError(f"{path}: cannot read ({e})") from None
      with _safe_open(path) as f:
        for name in f.keys():
          sl = f.get_slice(name)
          if sl.get_dtype() not in _DTYPES:
            raise HFError(f"{path}: tensor {name!r} has unsupported dtype {sl.get_dtype()}")
          self.entries[name] = (path, sl.get_dtype(), tuple(sl.get_shape()))

  def shape(self, name: str) -> tuple[int, ...] | None:
    e = self.entries.get(name)
    return None if e is None else e[2]

  def get(self, name: str) -> LazyTensor:
    path, _, shape = self.entries[name]
    return LazyTensor(path, name, shape)


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None):
  import safetensors.numpy
  safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path,
                              metadata={"format": "pt", **(metadata or {})})


# --- config.json <-> ModelConfig ---------------------------------------------------------------

_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
         "gelu_new": "gelu_tanh", "gelu": "gelu"}


def _rope(hf: dict, where: str) -> dict:
  """ModelConfig rope fields from either transformers' rope_parameters or legacy keys."""
  rp = hf.get("rope_parameters")
  local = None
  if rp and ("full_attention" in rp or "sliding_attention" in rp):
    glob_rp, local = dict(rp.get("full_attention") or {}), rp.get("sliding_attention")
  elif rp:
    glob_rp = dict(rp)
  else:
    glob_rp = dict(hf.get("rope_scaling") or {})
    glob_rp.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
    if "rope_local_base_freq" in hf:
      local = {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
  kind = glob_rp.get("rope_type", glob_rp.get("type", "default"))
  out: dict[str, Any] = {"rope_theta": float(glob_rp.get("rope_theta", 10_000.0)),
                         "rope_scaling": "none", "rope_factor": 1.0, "rope_local_theta": 0.0}
  if kind == "linear":
    out.update(rope_scaling="linear", rope_factor=float(glob_rp["factor"]))
  elif kind == "llama3":
    out.update(rope_scaling="llama3", rope_factor=float(glob_rp["factor"]),
               rope_low_freq_factor=float(glob_rp["low_freq_factor"]),
               rope_high_freq_factor=float(glob_rp["high_freq_factor"]),
               rope_original_max_len=int(glob_rp["original_max_position_embeddings"]))
  elif kind != "default":
    raise HFError(f"{where}: rope type {kind!r} is not supported (default, linear, llama3)")
  if local is not None:
    if local.get("rope_type", local.get("type", "default")) != "default":
      raise HFError(f"{where}: scaled RoPE on sliding-window layers is not supported")
    out["rope_local_theta"] = float(local["rope_theta"])
  return out


def _layer_types(hf: dict, a: archs.Arch, n_layers: int, where: str) -> list[bool]:
  """Per layer: True = sliding-window attention (how config.json says so: `Arch.sliding`)."""
  if a.sliding == "none":
    if hf.get("use_sliding_window"):
      raise HFError(f"{where}: use_sliding_window=true is not supported for {a.model_type}")
    return [False] * n_layers
  types = hf.get("layer_types")
  if types is not None:
    bad = set(types) - {"sliding_attention", "full_attention"}
    if bad or len(types) != n_layers:
      raise HFError(f"{where}: layer_types {types} not understood")
    return [t == "sliding_attention" for t in types]
  if a.sliding == "all":
    return [bool(hf.get("sliding_window"))] * n_layers
  if a.sliding == "alternate":
    return [i % 2 == 0 for i in range(n_layers)]
  if a.sliding == "periodic":
    n = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    return [(i + 1) % n != 0 for i in range(n_layers)]
  return [False] * n_layers


def _experts(hf: dict, a: archs.Arch, where: str) -> dict:
  """ModelConfig's mixture-of-experts fields (models/moe.py) of a family with experts; what
  the layer cannot compute is refused by the key that asks for it."""
  e = a.experts
  if e is None:
    return {"n_experts": 0}
  if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
    raise HFError(f"{where}: dense MLP layers among the experts' (mlp_only_layers="
                  f"{hf.get('mlp_only_layers')}, decoder_sparse_step="
                  f"{hf.get('decoder_sparse_step')}) are not supported: every layer is sparse")
  for key in ("router_jitter_noise", "clip_qkv"):
    if hf.get(key):
      raise HFError(f"{where}: {key}={hf[key]} is not supported")
  count = next((k for k in e.count_keys if hf.get(k) is not None), e.count_keys[0])
  try:
    return dict(n_experts=int(hf[count]), experts_per_token=int(hf["num_experts_per_tok"]),
                mlp_dim=int(hf[e.width_key]),
                router_norm_topk=e.norm_topk or bool(hf.get("norm_topk_prob", False)))
  except KeyError as err:
    raise HFError(f"{where}: missing field {err.args[0]!r} (a {a.model_type} mixture of "
                  f"experts)") from None


def config_from_hf(hf: dict, where: str = "config.json", base: ModelConfig | None = None) -> ModelConfig:
  """A ModelConfig for a transformers config dict; raises HFError for what it cannot express."""
  arch = hf.get("model_type")
  if arch not in archs.ARCHITECTURES:
    raise HFError(f"{where}: model_type {arch!r} is not supported; supported: {archs.ARCHS}")
  a = archs.ARCHITECTURES[arch]
  for key in ("mlp_bias", "use_bidirectional_attention"):
    if hf.get(key):
      raise HFError(f"{where}: {key}=true is not supported")
  if hf.get("attention_bias") and not a.switches.qkv_bias:
    raise HFError(f"{where}: attention_bias=true is not supported for {arch}")
  scalars = hf if a.gemma_scalars else {}  # keys only Gemma's config.json gives meaning to
  act_name = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
  if act_name not in _ACTS:
    raise HFError(f"{where}: activation {act_name!r} is not supported")
  try:
    D, H, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    fields = dict(
        arch=arch, vocab_size=hf["vocab_size"], d_model=D, n_layers=L, n_heads=H,
        n_kv_heads=hf.get("num_key_value_heads") or H, head_dim=hf.get("head_dim") or D // H,
        mlp_dim=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", a.tied_default)),
        mlp_act=_ACTS[act_name], **a.switches._asdict(),
        attn_softcap=float(scalars.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(scalars.get("final_logit_softcapping") or 0.0),
        query_scale=float(scalars.get("query_pre_attn_scalar") or 0.0),
        **_rope(hf, where))
  except KeyError as e:
    raise HFError(f"{where}: missing field {e.args[0]!r}") from None
  fields.update(_experts(hf, a, where))
  local = _layer_types(hf, a, L, where)
  if any(local):
    window = hf.get("sliding_window")
    if not window:
      raise HFError(f"{where}: sliding-window layers but no sliding_window size")
    pattern = next((n for n in range(1, L + 2)
                    if [(i + 1) % n != 0 or n == 1 for i in range(L)] == local), None)
    if pattern is None:
      raise HFError(f"{where}: sliding-window layer pattern {local} is not periodic")
    fields.update(sliding_window=int(window), sliding_pattern=pattern)
  else:
    fields.update(sliding_window=0, sliding_pattern=1)
  base = base or ModelConfig()
  return dataclasses.replace(base, **fields)


def _experts_config(cfg: ModelConfig, a: archs.Arch, source: dict) -> dict:
  """config.json's mixture-of-experts keys for `cfg` (none for a dense family); a model whose
  experts the family cannot hold, or a family that needs them, is refused."""
  if (a.experts is None) != (not cfg.n_experts):
    raise HFError(f"n_experts={cfg.n_experts} does not match model_type {a.model_type} ("
                  f"{'a mixture of experts' if a.experts else 'a dense MLP'})")
  if a.experts is None:
    return {}
  if a.experts.norm_topk and not cfg.router_norm_topk:
    raise HFError(f"router_norm_topk=False cannot be expressed in a {a.model_type} config.json "
                  "(its top-k weights are always renormalised)")
  out = {a.experts.count_keys[0]: cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
         a.experts.width_key: cfg.mlp_dim}
  if a.experts.norm_topk is None:
    out["norm_topk_prob"] = cfg.router_norm_topk
  if a.experts.width_key != "intermediate_size":  # the dense layers' width: none are dense
    out.update(intermediate_size=source.get("intermediate_size", cfg.mlp_dim),
               decoder_sparse_step=1, mlp_only_layers=[])
  return out


def hf_config(cfg: ModelConfig, source: dict | None = None) -> dict:
  """The transformers config.json dict for `cfg` (over `source`'s non-architecture keys)."""
  arch = cfg.arch
  a = archs.ARCHITECTURES[arch]
  for name, want in a.switches._asdict().items():
    if getattr(cfg, name) != want:
      raise HFError(f"{name}={getattr(cfg, name)} does not match model_type {arch} "
                    f"({name}={want})")
  drop = {"num_experts", "num_local_experts", "rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq", "layer_types",
          "sliding_window_pattern", "_sliding_window_pattern", "use_sliding_window",
          "sliding_window", "architectures", "dtype", "torch_dtype", "hidden_act",
          "hidden_activation"}
  out = {k: v for k, v in (source or {}).items() if k not in drop}
  act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[cfg.mlp_act]
  out.update({
      "model_type": arch, "architectures": [a.hf_class], "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "rope_theta": cfg.rope_theta, "torch_dtype": "float32",
      a.act_key: act,
  })
  out.setdefault("max_position_embeddings", 8192)
  out.update(_experts_config(cfg, a, source or {}))
  if cfg.rope_scaling == "linear":
    out["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_factor}
  elif cfg.rope_scaling == "llama3":
    out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_factor,
                           "low_freq_factor": cfg.rope_low_freq_factor,
                           "high_freq_factor": cfg.rope_high_freq_factor,
                           "original_max_position_embeddings": cfg.rope_original_max_len}
  if cfg.rope_local_theta:
    if not a.local_rope:
      raise HFError(f"rope_local_theta cannot be expressed in a {arch} config.json")
    out["rope_local_base_freq"] = cfg.rope_local_theta
  local = cfg.layer_is_local()
  if any(local):
    out["sliding_window"] = cfg.sliding_window
    if a.sliding in ("alternate", "periodic"):
      out["layer_types"] = ["sliding_attention" if x else "full_attention" for x in local]
      out["sliding_window_pattern"] = cfg.sliding_pattern
    elif not (a.sliding == "all" and all(local)):
      raise HFError(f"a sliding-window pattern of {cfg.sliding_pattern} cannot be expressed "
                    f"in a {arch} config.json")
  elif a.sliding == "all":
    out["sliding_window"] = None
  elif a.sliding in ("alternate", "periodic"):
    out["sliding_window"] = max(cfg.rope_original_max_len, 4096)
    out["layer_types"] = ["full_attention"] * cfg.n_layers
  if a.gemma_scalars:
    scalar = cfg.query_scale or cfg.head_dim
    out.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
               attn_logit_softcapping=cfg.attn_softcap or None,
               final_logit_softcapping=cfg.final_softcap or None)
  return out


# --- parameter names and layouts ---------------------------------------------------------------

def _tensor_names(arch: str) -> dict[tuple[str, ...], str]:
  """{our param path: HF tensor name, with {i} for the layer}: the family's own names, then each
  projection's weight and bias under its module's name.

  A matrix (spec.fan_in > 0) is stored as HF[out, in], so a layer's weight is HF.T reshaped;
  anything else holds the same values in row-major order.
  """
  names = dict(archs.ARCHITECTURES[arch].tensor_names)
  for t in lora_lib.TARGETS.values():
    *group, leaf = t.path
    names[t.path] = archs.LAYER + t.hf_module + ".weight"
    names[(*group, leaf + "_bias")] = archs.LAYER + t.hf_module + ".bias"
  return names


def _flat_specs(specs) -> dict[tuple[str, ...], transformer.ParamSpec]:
  out = {(k,): v for k, v in specs.items() if k != "layers"}
  out.update({("layers", k): v for k, v in specs["layers"].items()})
  return out


def _stacked(spec: transformer.ParamSpec, path: tuple[str, ...]) -> int:
  """How many leading axes of a parameter are one HF tensor each: 0 (embedding, final norm, LM
  head), 1 (a layer's: {i}) or 2 (an expert's of a layer: {i} and {e})."""
  if path[0] != "layers":
    return 0
  return 2 if spec.axes[:2] == ("layers", "experts") else 1


def _names(template: str, spec: transformer.ParamSpec, n_stack: int) -> list[str]:
  """The HF tensor names of a parameter, in row-major order of its `n_stack` leading axes."""
  if n_stack == 0:
    return [template]
  if n_stack == 1:
    return [template.format(i=i) for i in range(spec.shape[0])]
  return [template.format(i=i, e=e) for i in range(spec.shape[0]) for e in range(spec.shape[1])]


def _hf_shape(spec: transformer.ParamSpec, n_stack: int) -> tuple[int, ...]:
  shape = spec.shape[n_stack:]
  if spec.fan_in:
    return (math.prod(shape[spec.fan_in:]), math.prod(shape[:spec.fan_in]))
  return tuple(shape) if spec.axes == ("vocab", "embed") else (math.prod(shape),)


def _flat_indices(shape, slices) -> np.ndarray:
  """Row-major flat indices of the block `slices` of an array of `shape` (block order)."""
  ranges = [np.arange(*s.indices(n)) for s, n in zip(slices, shape)]
  return np.ravel_multi_index(np.ix_(*ranges), shape).ravel() if shape else np.zeros(1, int)


def _read_block(tensor: np.ndarray, shape, fan_in: int, slices) -> np.ndarray:
  """Our block `slices` of a per-layer array of `shape`, read from the HF tensor."""
  block_shape = tuple(len(range(*s.indices(n))) for s, n in zip(slices, shape))
  if not fan_in and tensor.shape == tuple(shape):  # e.g. the embedding: slice directly
    return np.asarray(tensor[tuple(slices)])
  if not fan_in:  # stored flat (load checked the HF shape is (prod(shape),))
    flat = _flat_indices(shape, slices)
    lo, hi = flat.min(), flat.max() + 1
    return np.asarray(tensor[lo:hi])[flat - lo].reshape(block_shape)
  i_flat = _flat_indices(shape[:fan_in], slices[:fan_in])
  o_flat = _flat_indices(shape[fan_in:], slices[fan_in:])
  ilo, ihi, olo, ohi = i_flat.min(), i_flat.max() + 1, o_flat.min(), o_flat.max() + 1
  sub = np.asarray(tensor[olo:ohi, ilo:ihi])
  return sub[np.ix_(o_flat - olo, i_flat - ilo)].T.reshape(block_shape)


def load(directory: str, mesh: Mesh, base: ModelConfig | None = None, reward: bool = False,
         quantize: str = "none"):
  """(ModelConfig, params) from a Hugging Face directory, each array born in its sharding.

  `base` supplies the fields config.json does not decide (compute_dtype, remat, base_quant).
  With `quantize` (bf16 / int8 / nf4: a frozen base, models/quant.py) the per-layer matrices are
  read and converted one layer at a time, so no stacked float32 matrix ever exists on the devices
  (an 8B model's are 28 GiB); the result equals `quant.quantize_params` of the float import.
  With `reward` the folder is a one-label `*ForSequenceClassification`: no LM head is read
  and the params hold the head `score` [D, 1] (`load_score`). Raises HFError naming
  config.json's field or the missing / misshapen tensor.
  """
  where = os.path.join(directory, "config.json")
  cfg = config_from_hf(_read_json(where), where, base)
  files = SafetensorsDir(directory)
  specs = transformer.param_specs(cfg)
  if reward:  # a sequence classifier has `score` in place of the LM head
    specs.pop("lm_head", None)
  names = _tensor_names(cfg.arch)
  plan = {}
  for path, spec in _flat_specs(specs).items():
    n_stack = _stacked(spec, path)
    want = _hf_shape(spec, n_stack)
    layer_names = _names(names[path], spec, n_stack)
    for name in layer_names:
      got = files.shape(name)
      if got is None:
        raise HFError(f"{directory}: tensor {name!r} is missing (needed for {'/'.join(path)})")
      if got != want:
        raise HFError(f"{directory}: tensor {name!r} has shape {list(got)}, expected "
                      f"{list(want)} from config.json")
    plan[path] = (spec, n_stack, layer_names)

  def build(spec, n_stack, layer_names):
    def callback(index):
      index = tuple(index) + (slice(None),) * (len(spec.shape) - len(index))
      if not n_stack:
        return _read_block(files.get(layer_names[0]), spec.shape, spec.fan_in,
                           index).astype(np.float32)
      lead = [range(*s.indices(n)) for s, n in zip(index[:n_stack], spec.shape[:n_stack])]
      tensors = [_read_block(files.get(layer_names[np.ravel_multi_index(at, spec.shape[:n_stack])]),
                             spec.shape[n_stack:], spec.fan_in, index[n_stack:])
                 for at in itertools.product(*lead)]
      return np.stack(tensors).reshape(*map(len, lead), *tensors[0].shape).astype(np.float32)
    sh = transformer.shardings(spec, mesh)
    return jax.make_array_from_callback(spec.shape, sh, callback)

  def build_quantized(spec, layer_names):
    one = spec._replace(shape=spec.shape[1:], axes=spec.axes[1:])
    quantize_layer = jax.jit(lambda w: quant.quantize_one(quantize, w, 0, spec))
    pieces = []
    for name in layer_names:
      read = lambda index, name=name: _read_block(
          files.get(name), one.shape, spec.fan_in,
          tuple(index) + (slice(None),) * (len(one.shape) - len(index))).astype(np.float32)
      pieces.append(quantize_layer(jax.make_array_from_callback(
          one.shape, transformer.shardings(one, mesh), read)))
    stack = lambda *layers: jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    stacked = jax.eval_shape(stack, *pieces)
    return jax.jit(stack, out_shardings=quant.quantized_sharding(
        quantize, mesh, 1, spec, stacked))(*pieces)

  quantized = quant.targets(specs) if quantize != "none" else {}
  flat = {path: build_quantized(p[0], p[2]) if path in quantized else build(*p)
          for path, p in plan.items()}
  params = {k: flat[(k,)] for k in specs if k != "layers"}
  params["layers"] = {k: flat[("layers", k)] for k in specs["layers"]}
  if reward:
    params["score"] = load_score(directory, cfg, mesh)
  return cfg, params


def load_score(directory: str, cfg: ModelConfig, mesh: Mesh) -> jax.Array:
  """The reward head [D, 1] of a `*ForSequenceClassification` folder with one label: its
  `score.weight` [1, D], transposed, replicated over `mesh` as the head's ParamSpec says
  (dpo/algorithms/rm.py). Raises HFError naming the folder when it is missing or misshapen."""
  files = SafetensorsDir(directory)
  got = files.shape("score.weight")
  if got != (1, cfg.d_model):
    raise HFError(f"{directory}: tensor 'score.weight' is "
                  f"{'missing' if got is None else f'of shape {list(got)}'}; a reward model "
                  f"has one label, shape [1, {cfg.d_model}]")
  spec = transformer.score_spec(cfg)
  value = np.asarray(files.get("score.weight"), np.float32).T
  return jax.device_put(value, transformer.shardings(spec, mesh))


def is_reward_model(directory: str) -> bool:
  """Whether config.json names a `*ForSequenceClassification` (read by `load(reward=True)`)."""
  names = _read_json(os.path.join(directory, "config.json")).get("architectures") or []
  return any(str(n).endswith("ForSequenceClassification") for n in names)


def source_config(init_from: str) -> dict | None:
  """The config.json of an `hf:DIR` init, to carry token ids etc. into an export."""
  if not init_from.startswith("hf:"):
    return None
  return _read_json(os.path.join(init_from[3:], "config.json"))


# --- export --------------------------------------------------------------------------------------

def _to_hf(value: np.ndarray, spec, n_stack: int) -> list[np.ndarray]:
  """Our array -> HF tensor(s), one per layer (and expert) of its `n_stack` leading axes."""
  per_layer = list(value.reshape(-1, *spec.shape[n_stack:])) if n_stack else [value]
  shape = _hf_shape(spec, n_stack)
  if spec.fan_in:
    n_in = math.prod(spec.shape[n_stack:][:spec.fan_in])
    return [np.ascontiguousarray(v.reshape(n_in, -1).T) for v in per_layer]
  return [v.reshape(shape) for v in per_layer]


class Lora(NamedTuple):
  """LoRA factors (models/lora.py's pytree) and their config: what `save` merges into the base."""
  factors: dict
  cfg: LoraConfig


class SaveOptions(NamedTuple):
  """How `save` writes the folder."""
  source: dict | None = None             # the config.json imported from (its keys carry over)
  dtype: str = "float32"                 # of the tensors written: float32 or bfloat16
  max_shard_bytes: int = 4 << 30         # a larger model is split into indexed shards
  metadata: dict[str, str] | None = None  # in every safetensors header
  extra: dict[str, np.ndarray] | None = None  # tensors written beside the model's (HF names)


def save(directory: str, cfg: ModelConfig, params, lora: Lora | None = None,
         options: SaveOptions = SaveOptions()):
  """Writes config.json + model(-0000k-of-0000n).safetensors of params (+ merged LoRA).

  A quantized base is dequantized first, so the export is the model the policy computes;
  `options.metadata` goes into every safetensors header (e.g. that the base was dequantized).
  Every process takes part in gathering; only process 0 writes. Raises HFError before writing
  anything when `cfg` cannot be expressed as a transformers config.json.
  """
  config = hf_config(cfg, options.source)
  config["torch_dtype"] = options.dtype
  params = jax.tree.map(lambda w: quant.dequantize(w) if quant.is_quantized(w) else w, params,
                        is_leaf=quant.is_quantized)
  if lora is not None:
    params = lora_lib.merge(params, lora.factors, lora.cfg)
  np_dtype = np.dtype(ml_dtypes.bfloat16 if options.dtype == "bfloat16" else options.dtype)
  names = _tensor_names(cfg.arch)
  specs = transformer.param_specs(cfg)
  if "lm_head" not in params and "score.weight" in (options.extra or {}):
    specs.pop("lm_head", None)  # a reward model imported from a classifier has no LM head
  tensors = {}
  for path, spec in _flat_specs(specs).items():
    value = sharding.to_host(params[path[0]] if len(path) == 1 else params["layers"][path[1]])
    n_stack = _stacked(spec, path)
    for name, t in zip(_names(names[path], spec, n_stack), _to_hf(value, spec, n_stack),
                       strict=True):
      tensors[name] = t.astype(np_dtype)
  tensors.update({k: v.astype(np_dtype) for k, v in (options.extra or {}).items()})
  if jax.process_index() != 0:
    return
  os.makedirs(directory, exist_ok=True)
  shards, current, size = [], {}, 0
  for name, t in tensors.items():
    if current and size + t.nbytes > options.max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = t
    size += t.nbytes
  shards.append(current)
  if len(shards) == 1:
    write_safetensors(os.path.join(directory, "model.safetensors"), shards[0], options.metadata)
  else:
    weight_map = {}
    for k, shard in enumerate(shards):
      fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
      write_safetensors(os.path.join(directory, fname), shard, options.metadata)
      weight_map.update({name: fname for name in shard})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": weight_map}, f, indent=2)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f, indent=2)


def save_reward_model(directory: str, cfg: ModelConfig, params, pad_id: int,
                      options: SaveOptions = SaveOptions()) -> None:
  """A transformers `*ForSequenceClassification` folder with one label from a reward model's
  params (the transformer's and the head `score` [D, 1], dpo/algorithms/rm.py): the model's
  tensors, `score.weight` [1, D] and a config.json with one label and `pad_token_id` (which
  transformers needs to find each row's last non-padding token)."""
  body = {k: v for k, v in params.items() if k != "score"}
  score = np.ascontiguousarray(sharding.to_host(params["score"]).T)
  source = {**(options.source or {}), "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
            "pad_token_id": pad_id}
  save(directory, cfg, body, None, options._replace(source=source, extra={"score.weight": score}))
  if jax.process_index() != 0:
    return
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    config = json.load(f)
  head = archs.ARCHITECTURES[cfg.arch].hf_class.replace("ForCausalLM", "ForSequenceClassification")
  with open(path, "w") as f:
    json.dump({**config, "architectures": [head]}, f, indent=2)


def save_peft(directory: str, cfg: ModelConfig, lora, lora_cfg: LoraConfig,
              base_model: str = "", metadata: dict[str, str] | None = None):
  """LoRA factors alone: PEFT's lora_A.weight [R, in] and lora_B.weight [out, R] per module.

  PEFT's delta is (alpha / r) * B @ A applied as x @ (B @ A).T, which equals our
  scale * x @ A @ B with A_peft = A.T and B_peft = B.T (flattened over head axes).
  """
  adapted = [t for t in lora_lib.TARGETS.values() if t.path[-1] in lora[t.path[0]]]
  tensors = {}
  for t in adapted:
    group, leaf = t.path
    a, b = sharding.to_host(lora[group][leaf]["a"]), sharding.to_host(lora[group][leaf]["b"])
    L, R = a.shape[0], a.shape[-1]
    for i in range(L):
      key = "base_model.model." + (archs.LAYER + t.hf_module).format(i=i)
      tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, R).T)
      tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(R, -1).T)
  if jax.process_index() != 0:
    return
  os.makedirs(directory, exist_ok=True)
  write_safetensors(os.path.join(directory, "adapter_model.safetensors"), tensors, metadata)
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.lora_rank,
            "lora_alpha": lora_cfg.lora_alpha, "lora_dropout": lora_cfg.lora_dropout,
            "target_modules": sorted(t.hf_module.split(".")[-1] for t in adapted),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "base_model_name_or_path": base_model, "inference_mode": True}
  with open(os.path.join(directory, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)


def save_peft_reward(directory: str, cfg: ModelConfig, lora, lora_cfg: LoraConfig, score,
                     base_model: str = "") -> None:
  """A reward model's PEFT adapter (`save_peft`'s factors, task SEQ_CLS) with the trained head
  as PEFT's `modules_to_save` (`base_model.model.score.weight` [1, D]); its base is a
  `save_reward_model` folder."""
  save_peft(directory, cfg, lora, lora_cfg, base_model)
  head = np.ascontiguousarray(sharding.to_host(score).T)
  if jax.process_index() != 0:
    return
  from safetensors.numpy import load_file
  path = os.path.join(directory, "adapter_model.safetensors")
  write_safetensors(path, {**load_file(path), "base_model.model.score.weight": head})
  with open(os.path.join(directory, "adapter_config.json")) as f:
    config = json.load(f)
  with open(os.path.join(directory, "adapter_config.json"), "w") as f:
    json.dump({**config, "task_type": "SEQ_CLS", "modules_to_save": ["score"]}, f, indent=2)


# --- tokenizer and generation settings ---------------------------------------------------------

def save_tokenizer(directory: str, tok, chat_template: str | None) -> None:
  """tokenizer.json and a tokenizer_config.json with the special tokens as the run resolved them
  and `chat_template` (the Jinja source the data was rendered with), so that
  `AutoTokenizer.from_pretrained(directory).apply_chat_template` renders what was trained."""
  if jax.process_index() != 0:
    return
  os.makedirs(directory, exist_ok=True)
  shutil.copyfile(tok.path, os.path.join(directory, "tokenizer.json"))
  config = {k: v for k, v in tok.config.items() if k != "chat_template"}
  config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
  config.update(bos_token=tok.bos_token, eos_token=tok.eos_token, pad_token=tok.pad_token)
  if chat_template:
    config["chat_template"] = chat_template
  with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)


def save_generation_config(directory: str, bos_id: int | None, stop_ids: list[int],
                           pad_id: int) -> None:
  """generation_config.json: `generate` stops at any of `stop_ids` (EOS and the chat template's
  end-of-turn tokens)."""
  if jax.process_index() != 0:
    return
  os.makedirs(directory, exist_ok=True)
  config = {"eos_token_id": stop_ids[0] if len(stop_ids) == 1 else list(stop_ids),
            "pad_token_id": pad_id}
  if bos_id is not None:
    config["bos_token_id"] = bos_id
  with open(os.path.join(directory, "generation_config.json"), "w") as f:
    json.dump(config, f, indent=2)

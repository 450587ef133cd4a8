"""LoRA adapters derived from the model's parameter description.

For a targeted matrix W with spec axes (layers, *in, *out) the adapter is
A: (layers, *in, R) and B: (layers, R, *out), so the delta for one layer is
scale * A @ B with scale = alpha / R (Hu et al. 2021, "LoRA", eq. 3). B starts at zero, so a
fresh adapter leaves the model unchanged. Factor shardings follow the base weight's logical axes,
so A and B are split exactly like the rows and columns of W.

`TARGETS` is the one list of adaptable projections: the flag value, where the weight sits in the
params pytree, and the transformers / PEFT module it is (which also names the projection's
weight and bias in a Hugging Face checkpoint, models/hf.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models import transformer
from models.transformer import ParamSpec

if TYPE_CHECKING:
  from models.config import LoraConfig, ModelConfig


class Target(NamedTuple):
  """One adaptable projection."""
  name: str              # as written in --lora_targets
  path: tuple[str, ...]  # its weight in the params pytree
  hf_module: str         # its module under model.layers.{i} in transformers and PEFT


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("q", ("layers", "q"), "self_attn.q_proj"),
    Target("k", ("layers", "k"), "self_attn.k_proj"),
    Target("v", ("layers", "v"), "self_attn.v_proj"),
    Target("o", ("layers", "o"), "self_attn.o_proj"),
    Target("gate", ("layers", "gate"), "mlp.gate_proj"),
    Target("up", ("layers", "up"), "mlp.up_proj"),
    Target("down", ("layers", "down"), "mlp.down_proj"),
)}


def lora_specs(model_cfg: ModelConfig, lora_cfg: LoraConfig) -> dict:
  """{"a": ParamSpec, "b": ParamSpec} at each configured target's param path.

  The LoRA pytree mirrors the params pytree: {"layers": {"q": {"a", "b"}, ...}}.
  """
  base = transformer.param_specs(model_cfg)
  R = lora_cfg.lora_rank
  out: dict = {"layers": {}}
  for name in lora_cfg.lora_targets:
    group, leaf = TARGETS[name].path
    if leaf not in base[group]:
      raise ValueError(f"--lora_targets={name}: the model has no {leaf} projection (the MLP of a "
                       f"mixture of experts, models/moe.py, takes no adapters)")
    s = base[group][leaf]
    n_in = s.fan_in
    in_shape, out_shape = s.shape[1:1 + n_in], s.shape[1 + n_in:]
    in_axes, out_axes = s.axes[1:1 + n_in], s.axes[1 + n_in:]
    out.setdefault(group, {})[leaf] = {
        "a": ParamSpec((s.shape[0], *in_shape, R), ("layers", *in_axes, "lora_rank"), "normal", n_in),
        "b": ParamSpec((s.shape[0], R, *out_shape), ("layers", "lora_rank", *out_axes), "zeros", 1),
    }
  return out


def init(model_cfg: ModelConfig, lora_cfg: LoraConfig, key: jax.Array, mesh: Mesh):
  """A ~ N(0, 1/fan_in) (Kaiming-style, as in the LoRA reference code), B = 0; born sharded."""
  specs = lora_specs(model_cfg, lora_cfg)

  def make(k):
    leaves, treedef = jax.tree.flatten(specs, is_leaf=transformer.is_spec)
    keys = jax.random.split(k, len(leaves))
    arrays = []
    for s, kk in zip(leaves, keys):
      if s.init == "zeros":
        arrays.append(jnp.zeros(s.shape, jnp.float32))
      else:
        fan_in = 1
        for d in s.shape[1:1 + s.fan_in]:
          fan_in *= d
        arrays.append(jax.random.normal(kk, s.shape, jnp.float32) / jnp.sqrt(fan_in))
    return treedef.unflatten(arrays)

  return jax.jit(make, out_shardings=transformer.shardings(specs, mesh))(key)


def delta(w_a: jax.Array, w_b: jax.Array, n_in: int, scale: float) -> jax.Array:
  """scale * A @ B with A [L, *in, R], B [L, R, *out] -> [L, *in, *out]."""
  L, R = w_a.shape[0], w_a.shape[-1]
  a2 = w_a.reshape(L, -1, R)
  b2 = w_b.reshape(L, R, -1)
  d = scale * jnp.einsum("lir,lro->lio", a2, b2)
  return d.reshape(w_a.shape[:-1] + w_b.shape[2:])


def merge(params: dict, lora: dict, lora_cfg: LoraConfig) -> dict:
  """Plain weights W + scale * A @ B for every adapted projection; other leaves unchanged."""
  layers = dict(params["layers"])
  for name, ab in lora["layers"].items():
    layers[name] = layers[name] + delta(ab["a"], ab["b"], ab["a"].ndim - 2, lora_cfg.scale)
  return {**params, "layers": layers}

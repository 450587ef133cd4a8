"""Mixture-of-experts MLP: a router, top-k routing, and dropless grouped matmuls.

A layer of a model with `n_experts` > 0 has, in place of the dense gate / up / down:

  router       [D, E]     token -> expert logits (transformers' `mlp.gate`)
  expert_gate  [E, D, F]  each expert's gated MLP (`mlp.experts.{e}.gate_proj`, Mixtral's w1)
  expert_up    [E, D, F]  (`up_proj`, w3)
  expert_down  [E, F, D]  (`down_proj`, w2)

Routing, as Qwen3-MoE, Mixtral and OLMoE do it in transformers: softmax over the E logits (in
float32), the top k probabilities, renormalised to sum to 1 with `router_norm_topk` (Mixtral's
top-k of the logits followed by a softmax is the same). A token's output is the sum over its k
experts of the routing weight times that expert's gated MLP of the token.

Dispatch drops nothing: the N x k (token, expert) assignments are sorted by expert, each expert
multiplies its contiguous group with `jax.lax.ragged_dot` (a grouped matmul whose group sizes
are data), and the outputs are gathered back into token order and weighted. Every token gets
all k of its experts whatever the load (tests/test_moe.py holds the layer equal to running
every expert on every token).

`jax.lax.ragged_dot` has no batching rule (JAX 0.10: "vmap over any dim but 0 - NYI"), so a
model with experts is never vmapped: dpo/logprobs.py's `pair_stats` runs a pair's two sides as
two forwards instead.

The router's auxiliary load-balancing loss (`load_balancing_loss`) is Switch Transformer's
(Fedus et al. 2021, arXiv:2101.03961, eqs. 4-6) as transformers' `load_balancing_loss_func`
computes it over all layers: E * sum_e f_e * P_e, f_e the fraction of the (token, slot)
assignments that go to expert e, P_e the mean routing probability of e, over non-padding tokens.
A training step adds it times --router_aux_loss_coef (and the z-loss times
--router_z_loss_coef) to its loss, as TRL's trainers add `router_aux_loss_coef * aux_loss`;
`router_stats` of a forward are sums, so a pair's two sides count as TRL's concatenated forward.

Shape suffixes as models/transformer.py, plus E experts, K experts per token (top-k), N tokens
(B x T flattened), M = N x K assignments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
  from models.config import ModelConfig


def param_specs(cfg: ModelConfig, spec) -> dict:
  """The MoE MLP's per-layer parameters (`spec` is transformer.ParamSpec). A matrix's input
  axes come after its expert axis; `fan_in` counts them from there (models/hf.py reads each
  expert's [out, in] tensor as the dense MLP's)."""
  L, D, E, F = cfg.n_layers, cfg.d_model, cfg.n_experts, cfg.mlp_dim
  return {
      "router": spec((L, D, E), ("layers", "embed", "experts"), "normal", 1),
      "expert_gate": spec((L, E, D, F), ("layers", "experts", "embed", "mlp"), "normal", 1),
      "expert_up": spec((L, E, D, F), ("layers", "experts", "embed", "mlp"), "normal", 1),
      "expert_down": spec((L, E, F, D), ("layers", "experts", "mlp", "embed"), "normal", 1),
  }


def route(cfg: ModelConfig, x_ND: jax.Array, router_DE: jax.Array):
  """(routing weights [N, K] float32, chosen experts [N, K] int32, router logits [N, E]
  float32) of tokens `x_ND`: softmax, top k, renormalised with `router_norm_topk`."""
  logits_NE = jnp.dot(x_ND, router_DE.astype(x_ND.dtype)).astype(jnp.float32)
  probs_NE = jax.nn.softmax(logits_NE, axis=-1)
  weights_NK, experts_NK = jax.lax.top_k(probs_NE, cfg.experts_per_token)
  if cfg.router_norm_topk:
    weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
  return weights_NK, experts_NK.astype(jnp.int32), logits_NE


def experts(x_ND: jax.Array, weights_NK: jax.Array, experts_NK: jax.Array, p: dict,
            act: Callable) -> jax.Array:
  """sum_k weights[n, k] * MLP_{experts[n, k]}(x[n]) [N, D], every assignment computed: the
  assignments sorted by expert (a stable sort), one `ragged_dot` per matrix over the experts'
  contiguous groups, then gathered back into token order."""
  N, K = experts_NK.shape
  E = p["expert_gate"].shape[0]
  flat_M = experts_NK.reshape(-1)
  order_M = jnp.argsort(flat_M, stable=True)          # assignment slots sorted by expert
  sizes_E = jnp.bincount(flat_M, length=E).astype(jnp.int32)
  x_MD = x_ND[order_M // K]                            # each sorted slot's token
  w = lambda name: p[name].astype(x_ND.dtype)
  gate_MF = jax.lax.ragged_dot(x_MD, w("expert_gate"), sizes_E)
  up_MF = jax.lax.ragged_dot(x_MD, w("expert_up"), sizes_E)
  y_MD = jax.lax.ragged_dot(act(gate_MF) * up_MF, w("expert_down"), sizes_E)
  y_NKD = y_MD[jnp.argsort(order_M)].reshape(N, K, -1)  # back into (token, slot) order
  return jnp.einsum("nkd,nk->nd", y_NKD, weights_NK.astype(y_NKD.dtype))


def mlp(cfg: ModelConfig, h_BTD: jax.Array, p: dict, act: Callable):
  """(the MoE MLP's output [B, T, D], the router's logits [B, T, E] float32) of one layer's
  normalised residual `h_BTD` with that layer's parameters `p`."""
  B, T, D = h_BTD.shape
  x_ND = h_BTD.reshape(B * T, D)
  weights_NK, experts_NK, logits_NE = route(cfg, x_ND, p["router"])
  out_ND = experts(x_ND, weights_NK, experts_NK, p, act)
  return out_ND.reshape(B, T, D), logits_NE.reshape(B, T, -1)


class RouterStats(NamedTuple):
  """What the router's losses and load figures read of one or more forwards, as sums (so the
  stats of a pair's two sides, or of chosen and rejected concatenated as TRL runs them, add up):
  over the non-padding tokens of every layer, each expert's top-k assignment count [L, E] and
  routing probability [L, E], the token count, and the sum of squared log-sum-exps of the
  logits over (layer, token) rows."""
  counts_LE: jax.Array
  probs_LE: jax.Array
  tokens: jax.Array
  z: jax.Array


def router_stats(logits_LBTE: jax.Array, mask_BT: jax.Array, top_k: int) -> RouterStats:
  """`RouterStats` of every layer's router logits [L, B, T, E] over the tokens where `mask_BT`
  is true."""
  L, E = logits_LBTE.shape[0], logits_LBTE.shape[-1]
  logits_LNE = logits_LBTE.reshape(L, -1, E).astype(jnp.float32)
  m_N = mask_BT.reshape(-1).astype(jnp.float32)
  probs_LNE = jax.nn.softmax(logits_LNE, axis=-1)
  _, chosen_LNK = jax.lax.top_k(probs_LNE, top_k)
  counts_LNE = jnp.sum(jax.nn.one_hot(chosen_LNK, E, dtype=jnp.float32), axis=-2)
  z_LN = jax.nn.logsumexp(logits_LNE, axis=-1) ** 2
  return RouterStats(jnp.einsum("lne,n->le", counts_LNE, m_N),
                     jnp.einsum("lne,n->le", probs_LNE, m_N), jnp.sum(m_N),
                     jnp.einsum("ln,n->", z_LN, m_N))


def combine(*stats: RouterStats) -> RouterStats:
  """The stats of several forwards together (each field summed)."""
  return RouterStats(*(sum(fields) for fields in zip(*stats)))


def load_balancing_loss(stats: RouterStats) -> jax.Array:
  """Switch Transformer's auxiliary loss E * sum_e f_e P_e (float32 scalar): f_e the fraction of
  the top-k assignments (per row, so the f_e sum to k) that go to expert e, P_e the mean routing
  probability of e, over every counted (layer, token) row, as transformers'
  `load_balancing_loss_func` computes it with an attention mask."""
  L, E = stats.counts_LE.shape
  rows = jnp.maximum(L * stats.tokens, 1.0)
  return E * jnp.sum((stats.counts_LE.sum(0) / rows) * (stats.probs_LE.sum(0) / rows))


def z_loss(stats: RouterStats) -> jax.Array:
  """The router z-loss: the mean over counted (layer, token) rows of logsumexp(router logits)^2
  (ST-MoE, Zoph et al. 2022, arXiv:2202.08906, eq. 5)."""
  return stats.z / jnp.maximum(stats.counts_LE.shape[0] * stats.tokens, 1.0)


def expert_load(stats: RouterStats) -> jax.Array:
  """[L, E] float32: each layer's share of the top-k assignments that each expert receives
  (1 / E each when balanced; a row sums to 1)."""
  return stats.counts_LE / jnp.maximum(stats.counts_LE.sum(-1, keepdims=True), 1.0)


def router_loss(cfg: ModelConfig, stats: RouterStats | None) -> tuple[jax.Array, dict]:
  """(--router_aux_loss_coef x the load-balancing loss + --router_z_loss_coef x the z-loss, and
  as metrics the two losses and `expert_load_max`, the busiest expert's share times E over the
  layers: 1 balanced, E all on one) of a training forward's stats; (0, {}) without stats."""
  if stats is None:
    return jnp.float32(0.0), {}
  aux, z = load_balancing_loss(stats), z_loss(stats)
  load = expert_load(stats)
  return (cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z,
          {"router_aux_loss": aux, "router_z_loss": z,
           "expert_load_max": jnp.max(load) * load.shape[-1]})

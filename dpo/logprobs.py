"""Per-sequence completion log-probabilities.

`token_logps` scores token t with the logits at t - 1 (log-softmax in float32). `pair_logps`
runs the model on the chosen and rejected sequences of each pair with `jax.vmap` over the pair
axis and returns summed log-probs and token counts, prompt and padding positions masked out.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from configs import ModelConfig
from models import transformer


def token_logps(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """[B, T] log p(tokens[t] | tokens[:t]) in nats; position 0 (no context) is 0."""
  logits = logits_BTV[:, :-1].astype(jnp.float32)
  target_BT = tokens_BT[:, 1:]
  picked = jnp.take_along_axis(logits, target_BT[..., None], axis=-1)[..., 0]
  lp = picked - jax.nn.logsumexp(logits, axis=-1)
  return jnp.pad(lp, ((0, 0), (1, 0)))


def token_kl(p_logits_TV: jax.Array, q_logits_TV: jax.Array, loss_mask_T: jax.Array) -> jax.Array:
  """Summed exact KL(p || q) in nats between the next-token distributions that score each masked
  token (logits at t - 1 score token t, as in `token_logps`). Leading axes are batch axes;
  arrays are [..., T, V] and [..., T]; returns [...]."""
  logp = jax.nn.log_softmax(p_logits_TV[..., :-1, :].astype(jnp.float32), axis=-1)
  logq = jax.nn.log_softmax(q_logits_TV[..., :-1, :].astype(jnp.float32), axis=-1)
  kl_T = (jnp.exp(logp) * (logp - logq)).sum(-1)
  return (kl_T * loss_mask_T[..., 1:]).sum(-1)


def sequence_logps(cfg: ModelConfig, params, tokens_BT, positions_BT, segment_ids_BT,
                   loss_mask_BT, lora=None, lora_scale=1.0, dropout_key=None, dropout_rate=0.0):
  """(summed log-prob [B], scored-token count [B]) of each sequence's masked tokens."""
  logits = transformer.forward(cfg, params, tokens_BT, positions_BT, segment_ids_BT, lora=lora,
                               lora_scale=lora_scale, dropout_key=dropout_key,
                               dropout_rate=dropout_rate)
  lp_BT = token_logps(logits, tokens_BT) * loss_mask_BT
  return lp_BT.sum(-1), loss_mask_BT.sum(-1)


def pair_logps(cfg: ModelConfig, params, batch, lora=None, lora_scale=1.0, dropout_key=None,
               dropout_rate=0.0):
  """vmap of `sequence_logps` over the pair axis of [B, 2, T] arrays -> ([B, 2], [B, 2])."""
  keys = None if dropout_key is None else jax.random.split(dropout_key, 2)

  def one(tokens, positions, segment_ids, loss_mask, key):
    return sequence_logps(cfg, params, tokens, positions, segment_ids, loss_mask, lora,
                          lora_scale, key, dropout_rate)

  return jax.vmap(one, in_axes=(1, 1, 1, 1, None if keys is None else 0), out_axes=1)(
      batch["tokens"], batch["positions"], batch["segment_ids"], batch["loss_mask"], keys)


class PairStats(NamedTuple):
  """Per-sequence statistics of the chosen (index 0) and rejected (index 1) completions."""
  logps: jax.Array         # [B, 2] summed log-probs, nats
  tokens: jax.Array        # [B, 2] scored-token counts
  shared_logps: jax.Array  # [B, 2] log-probs of each completion's first min(|y_w|, |y_l|) tokens
  wpo_logw: jax.Array | None  # [B, 2] mean over tokens of log p(y_t) - log sum_v p(v)^2, or None


def wpo_token_logw(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """[B, T] log(p(y_t) / sum_v p(v)^2) per token, the WPO weight-alignment term (Zhou et al.
  2024, "WPO", weight alignment); position 0 is 0."""
  logp = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(picked - jax.nn.logsumexp(2.0 * logp, axis=-1), ((0, 0), (1, 0)))


def pair_stats(cfg: ModelConfig, params, batch, lora=None, lora_scale=1.0, dropout_key=None,
               dropout_rate=0.0, wpo: bool = False, with_logits: bool = False):
  """Like `pair_logps`, plus the shared-length split (LD-DPO) and optionally WPO log-weights.

  Returns PairStats, or (PairStats, logits [B, 2, T, V] or None) when called with with_logits
  set (the logits feed the in-step KL measure).

  One forward per side (vmap over the pair axis), then per-token reductions: the shared-length
  sum keeps completion tokens whose rank within their completion is <= min(|y_w|, |y_l|).
  """
  keys = None if dropout_key is None else jax.random.split(dropout_key, 2)

  def one(tokens, positions, segment_ids, key):
    logits = transformer.forward(cfg, params, tokens, positions, segment_ids, lora=lora,
                                 lora_scale=lora_scale, dropout_key=key, dropout_rate=dropout_rate)
    lp = token_logps(logits, tokens)
    return (lp, (wpo_token_logw(logits, tokens) if wpo else jnp.zeros_like(lp)),
            logits if with_logits else None)

  lp_B2T, logw_B2T, logits_B2TV = jax.vmap(
      one, in_axes=(1, 1, 1, None if keys is None else 0), out_axes=1)(
          batch["tokens"], batch["positions"], batch["segment_ids"], keys)
  mask_B2T = batch["loss_mask"].astype(jnp.float32)
  lp_B2T, logw_B2T = lp_B2T * mask_B2T, logw_B2T * mask_B2T
  tokens_B2 = mask_B2T.sum(-1)
  rank_B2T = jnp.cumsum(mask_B2T, axis=-1)
  shared_B1 = tokens_B2.min(axis=1, keepdims=True)
  shared_B2 = (lp_B2T * (rank_B2T <= shared_B1[..., None])).sum(-1)
  logw = logw_B2T.sum(-1) / jnp.maximum(tokens_B2, 1.0) if wpo else None
  stats = PairStats(lp_B2T.sum(-1), tokens_B2, shared_B2, logw)
  return (stats, logits_B2TV) if with_logits else stats

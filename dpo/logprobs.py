"""Per-sequence completion log-probabilities.

`token_logps` scores token t with the logits at t - 1 (log-softmax in float32). `score` is the
one path from a batch to per-token log-probs; `sequence_logps` sums it per sequence, and
`pair_stats` runs it on the chosen and rejected sequences of each pair with `jax.vmap` over the
pair axis. Prompt and padding positions are masked out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from models import transformer

if TYPE_CHECKING:
  from configs import ModelConfig


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


def wpo_token_logw(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """[B, T] log(p(y_t) / sum_v p(v)^2) per token, the WPO weight-alignment term (Zhou et al.
  2024, "WPO", weight alignment); position 0 is 0."""
  logp = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(picked - jax.nn.logsumexp(2.0 * logp, axis=-1), ((0, 0), (1, 0)))


class TokenStats(NamedTuple):
  """Per-token scores of [B, T] sequences; prompt and padding positions are 0."""
  logps: jax.Array            # [B, T] log p(token), nats, masked
  mask: jax.Array             # [B, T] float32 loss mask
  wpo_logw: jax.Array | None  # [B, T] WPO log-weights, masked (wpo=True)
  logits: jax.Array | None    # [B, T, V] (with_logits=True)


def score(cfg: ModelConfig, params, batch, wpo: bool = False, with_logits: bool = False,
          **forward_kw) -> TokenStats:
  """The one scoring path (policy, reference, SFT, evaluation, precompute): forward the [B, T]
  sequences of `batch` (tokens, positions, segment_ids, loss_mask) and score each masked token.

  forward_kw go to `transformer.forward` (lora, lora_scale, dropout_key, dropout_rate).
  """
  logits = transformer.forward(cfg, params, batch["tokens"], batch["positions"],
                               batch["segment_ids"], **forward_kw)
  mask = batch["loss_mask"].astype(jnp.float32)
  return TokenStats(token_logps(logits, batch["tokens"]) * mask, mask,
                    wpo_token_logw(logits, batch["tokens"]) * mask if wpo else None,
                    logits if with_logits else None)


def sequence_logps(cfg: ModelConfig, params, batch, **forward_kw) -> tuple[jax.Array, jax.Array]:
  """(summed log-prob [B], scored-token count [B]) of each [B, T] sequence's masked tokens."""
  s = score(cfg, params, batch, **forward_kw)
  return s.logps.sum(-1), s.mask.sum(-1)


class PairStats(NamedTuple):
  """Per-sequence statistics of the chosen (index 0) and rejected (index 1) completions."""
  logps: jax.Array         # [B, 2] summed log-probs, nats
  tokens: jax.Array        # [B, 2] scored-token counts
  shared_logps: jax.Array  # [B, 2] log-probs of each completion's first min(|y_w|, |y_l|) tokens
  wpo_logw: jax.Array | None  # [B, 2] mean over tokens of log p(y_t) - log sum_v p(v)^2, or None
  logits: jax.Array | None    # [B, 2, T, V] with_logits (the in-step KL measure), else None


_SEQUENCE_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


def pair_stats(cfg: ModelConfig, params, batch, dropout_key=None, wpo: bool = False,
               with_logits: bool = False, **forward_kw) -> PairStats:
  """`score` vmapped over the pair axis of [B, 2, T] arrays, then per-pair reductions.

  Each side gets its own dropout key. The shared-length sum (LD-DPO) keeps completion tokens
  whose rank within their completion is <= min(|y_w|, |y_l|).
  """
  keys = None if dropout_key is None else jax.random.split(dropout_key, 2)

  def one(seq, key):
    return score(cfg, params, seq, wpo=wpo, with_logits=with_logits, dropout_key=key,
                 **forward_kw)

  s = jax.vmap(one, in_axes=(1, None if keys is None else 0), out_axes=1)(
      {k: batch[k] for k in _SEQUENCE_KEYS}, keys)
  tokens_B2 = s.mask.sum(-1)
  rank_B2T = jnp.cumsum(s.mask, axis=-1)
  shared_B1 = tokens_B2.min(axis=1, keepdims=True)
  shared_B2 = (s.logps * (rank_B2T <= shared_B1[..., None])).sum(-1)
  logw = None if s.wpo_logw is None else s.wpo_logw.sum(-1) / jnp.maximum(tokens_B2, 1.0)
  return PairStats(s.logps.sum(-1), tokens_B2, shared_B2, logw, s.logits)

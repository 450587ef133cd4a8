"""Per-sequence completion log-probabilities.

`token_logps` scores token t with the logits at t - 1 (log-softmax in float32). `score` is the
one path from a batch to per-token log-probs; `sequence_logps` sums it per sequence, and
`pair_stats` runs it on the chosen and rejected sequences of each pair with `jax.vmap` over the
pair axis. Prompt and padding positions are masked out.

A batch that carries shared-prefix rows (`PairBatch.shared`, dpo/packing.py) takes
`shared_pair_stats` instead: one forward per pair over prompt | chosen | rejected (or per row of
several such pairs, packed), the LM head only at the scored slots (`head_logps`, optionally over
vocabulary chunks), the same `PairStats`.

A mixture of experts with router losses (--router_aux_loss_coef, --router_z_loss_coef) also
returns each forward's router statistics (`router`, models/moe.py's `RouterStats` over its
non-padding tokens; a pair's two sides summed), which the training steps turn into the loss
they add (`moe.router_loss`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from dpo.batches import PairBatch, Rows
from models import moe, quant, transformer
from models.transformer import Adapter

if TYPE_CHECKING:
  from models.config import ModelConfig


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
  kl_T = _kl(p_logits_TV[..., :-1, :], q_logits_TV[..., :-1, :])
  return (kl_T * loss_mask_T[..., 1:]).sum(-1)


def _kl(p_logits: jax.Array, q_logits: jax.Array) -> jax.Array:
  """Exact KL(p || q) in nats over the last (vocabulary) axis, in float32."""
  logp = jax.nn.log_softmax(p_logits.astype(jnp.float32), axis=-1)
  logq = jax.nn.log_softmax(q_logits.astype(jnp.float32), axis=-1)
  return (jnp.exp(logp) * (logp - logq)).sum(-1)


def pair_kl(p_logits: jax.Array, q_logits: jax.Array, batch: PairBatch) -> jax.Array:
  """Summed exact token KL(p || q) over each pair's scored tokens, from `PairStats.logits`: the
  [B, 2, T, V] logits of the unshared layout (-> [B, 2]) or, for shared-prefix (or packed)
  rows, the [R, K, V] logits at the scored slots (-> [R]). Either sums to the batch total."""
  if batch.shared is not None:
    return (_kl(p_logits, q_logits) * batch.shared.score_weight).sum(-1)
  return token_kl(p_logits, q_logits, batch.pairs.loss_mask)


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
  router: moe.RouterStats | None = None  # with router losses (cfg.router_losses)


def hidden(cfg: ModelConfig, params, rows: Rows, adapter: Adapter | None = None):
  """(final hidden states [B, T, D] of `rows`, their router statistics or None): the forward
  every scoring path runs; the statistics only where the model has router losses to train."""
  if not cfg.router_losses:
    return transformer.hidden(cfg, params, rows.inputs(), adapter), None
  h_BTD, router_LBTE = transformer.hidden_and_router(cfg, params, rows.inputs(), adapter)
  return h_BTD, moe.router_stats(router_LBTE, rows.segment_ids != 0, cfg.experts_per_token)


def score(cfg: ModelConfig, params, rows: Rows, adapter: Adapter | None = None,
          wpo: bool = False, with_logits: bool = False, temperature: float = 1.0) -> TokenStats:
  """The one scoring path (policy, reference, SFT, evaluation, precompute): forward the [B, T]
  `rows` (the base, plus `adapter`'s LoRA delta) and score each masked token; with `temperature`
  (GRPO's and RLOO's, the sampler's, as TRL scores) of the logits divided by it (the kept logits
  too)."""
  h_BTD, router = hidden(cfg, params, rows, adapter)
  logits = transformer.unembed(cfg, params, h_BTD)
  if temperature != 1.0:
    logits = logits.astype(jnp.float32) / temperature
  mask = rows.loss_mask.astype(jnp.float32)
  return TokenStats(token_logps(logits, rows.tokens) * mask, mask,
                    wpo_token_logw(logits, rows.tokens) * mask if wpo else None,
                    logits if with_logits else None, router)


def sequence_logps(cfg: ModelConfig, params, rows: Rows,
                   adapter: Adapter | None = None) -> tuple[jax.Array, jax.Array]:
  """(summed log-prob [B], scored-token count [B]) of each [B, T] sequence's masked tokens."""
  s = score(cfg, params, rows, adapter)
  return s.logps.sum(-1), s.mask.sum(-1)


class PairStats(NamedTuple):
  """Per-sequence statistics of the chosen (index 0) and rejected (index 1) completions."""
  logps: jax.Array         # [B, 2] summed log-probs, nats
  tokens: jax.Array        # [B, 2] scored-token counts
  shared_logps: jax.Array  # [B, 2] log-probs of each completion's first min(|y_w|, |y_l|) tokens
  wpo_logw: jax.Array | None  # [B, 2] mean over tokens of log p(y_t) - log sum_v p(v)^2, or None
  logits: jax.Array | None    # [B, 2, T, V] with_logits (the in-step KL measure), else None
  router: moe.RouterStats | None = None  # both sides' (cfg.router_losses)


def scored_slots(cfg: ModelConfig, params, rows: Rows, slots: int, adapter: Adapter | None = None,
                 wpo: bool = False) -> TokenStats:
  """`score` of [B, T] rows that score at most `slots` tokens each, the LM head run only there:
  the rows' scored tokens in slot order, padded with weight-0 entries to `slots`. `TokenStats`
  is then [B, slots] (`mask` the gathered loss-mask weights); the sums over a row are `score`'s.
  Callers pass a bound the rows are built to (the DPO step: --max_target_length, which every
  completion is cut to); a row that scores more gets NaN log-probs (its update is skipped and
  counted, `train.apply_update`), never a sum short of its last tokens."""
  h_BTD, router = hidden(cfg, params, rows, adapter)
  mask_BT = rows.loss_mask.astype(jnp.float32)
  # Scored slots first, in slot order (a stable sort of "not scored"), then the first `slots`.
  slot_BK = jnp.argsort(mask_BT <= 0, axis=-1, stable=True)[:, :slots]
  weight_BK = jnp.take_along_axis(mask_BT, slot_BK, axis=-1)
  target_BK = jnp.take_along_axis(rows.tokens, slot_BK, axis=-1)
  h_BKD = jnp.take_along_axis(h_BTD, jnp.maximum(slot_BK - 1, 0)[..., None], axis=1)
  lp_BK, logw_BK, _ = head_logps(cfg, params, h_BKD, target_BK, wpo)
  first = slot_BK == 0  # slot 0 has no context: it scores 0 and counts, as in `score`
  lp_BK = jnp.where(first, 0.0, lp_BK)
  logw_BK = None if logw_BK is None else jnp.where(first, 0.0, logw_BK)
  lp_BK = jnp.where((mask_BT > 0).sum(-1, keepdims=True) > slots, jnp.nan, lp_BK)
  return TokenStats(lp_BK * weight_BK, weight_BK,
                    None if logw_BK is None else logw_BK * weight_BK, None, router)


def head_slots(T: int, score_slots: int, with_logits: bool) -> int:
  """The slots a [.., T] pair row runs the LM head at in `pair_stats`: `score_slots` when that
  bound saves any (`scored_slots`) and no logits are kept, else all T."""
  return score_slots if 0 < score_slots < T - 1 and not with_logits else T


def pair_stats(cfg: ModelConfig, params, batch: PairBatch, adapter: Adapter | None = None,
               wpo: bool = False, with_logits: bool = False, score_slots: int = 0) -> PairStats:
  """`score` vmapped over the pair axis of [B, 2, T] rows, then per-pair reductions; a batch
  with shared-prefix rows goes to `shared_pair_stats` (same result, less work).

  `score_slots` > 0 bounds the tokens a row scores (the DPO step's --max_target_length): the LM
  head then runs at those slots only (`scored_slots`), not at all T, unless `with_logits`
  asks for the [B, 2, T, V] logits. Each side gets its own dropout key. The shared-length sum
  (LD-DPO) keeps completion tokens whose rank within their completion is <= min(|y_w|, |y_l|).
  """
  if batch.shared is not None:
    return shared_pair_stats(cfg, params, batch, adapter, wpo, with_logits)
  key = None if adapter is None else adapter.dropout_key
  keys = None if key is None else jax.random.split(key, 2)
  T = batch.pairs.tokens.shape[-1]
  gather = head_slots(T, score_slots, with_logits) < T

  def one(rows, key):
    side = None if adapter is None else dataclasses.replace(adapter, dropout_key=key)
    if gather:
      return scored_slots(cfg, params, rows, score_slots, side, wpo)
    return score(cfg, params, rows, side, wpo=wpo, with_logits=with_logits)

  if cfg.n_experts:  # ragged_dot has no batching rule (models/moe.py): one forward a side
    sides = [one(jax.tree.map(lambda x: x[:, i], batch.pairs), None if keys is None else keys[i])
             for i in range(2)]
    router = None if sides[0].router is None else moe.combine(*(x.router for x in sides))
    sides = [x._replace(router=None) for x in sides]
    s = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *sides)._replace(router=router)
  else:
    s = jax.vmap(one, in_axes=(1, None if keys is None else 0), out_axes=1)(batch.pairs, keys)
  tokens_B2 = s.mask.sum(-1)
  rank_B2T = jnp.cumsum(s.mask, axis=-1)
  shared_B1 = tokens_B2.min(axis=1, keepdims=True)
  shared_B2 = (s.logps * (rank_B2T <= shared_B1[..., None])).sum(-1)
  logw = None if s.wpo_logw is None else s.wpo_logw.sum(-1) / jnp.maximum(tokens_B2, 1.0)
  return PairStats(s.logps.sum(-1), tokens_B2, shared_B2, logw, s.logits, s.router)


def _head_chunks(cfg: ModelConfig, params, chunk: int, dtype) -> jax.Array:
  """The LM head as [V / chunk, D, chunk] (the tied embedding transposed), dequantized."""
  w = params["embed"] if cfg.tie_embeddings else params["lm_head"]
  if quant.is_quantized(w):
    w = quant.dequantize(w)
  w_DV = w.T if cfg.tie_embeddings else w
  D, V = w_DV.shape
  return w_DV.astype(dtype).reshape(D, V // chunk, chunk).transpose(1, 0, 2)


def head_logps(cfg: ModelConfig, params, h_BKD: jax.Array, target_BK: jax.Array, wpo: bool = False,
               with_logits: bool = False):
  """(log p(target) [B, K], WPO log-weights [B, K] or None, logits [B, K, V] or None) from final
  hidden states at the scoring slots; float32 log-softmax.

  With `cfg.logits_chunk` (a divisor of the vocabulary; not with `with_logits`) the
  log-normaliser is a running logsumexp over vocabulary chunks, each chunk's logits recomputed
  in the backward pass, so [B, K, V] never exists.
  """
  chunk = cfg.logits_chunk
  if not chunk or chunk >= cfg.vocab_size or with_logits:
    logits = transformer.unembed(cfg, params, h_BKD)
    lse = jax.nn.logsumexp(logits, axis=-1)
    lp = jnp.take_along_axis(logits, target_BK[..., None], axis=-1)[..., 0] - lse
    logw = lp - (jax.nn.logsumexp(2.0 * logits, axis=-1) - 2.0 * lse) if wpo else None
    return lp, logw, logits if with_logits else None

  @jax.checkpoint
  def body(carry, xs):
    m, s, s2, picked = carry
    w_DC, first = xs
    logits = transformer.soft_cap(
        transformer.matmul(h_BKD, w_DC, 1, cfg.explicit_backward).astype(jnp.float32),
        cfg.final_softcap)
    m_new = jnp.maximum(m, logits.max(-1))
    s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[..., None]).sum(-1)
    s2 = s2 * jnp.exp(2.0 * (m - m_new)) + jnp.exp(2.0 * (logits - m_new[..., None])).sum(-1)
    idx = target_BK - first
    hit = (idx >= 0) & (idx < chunk)
    got = jnp.take_along_axis(logits, jnp.clip(idx, 0, chunk - 1)[..., None], axis=-1)[..., 0]
    return (m_new, s, s2, picked + jnp.where(hit, got, 0.0)), None

  w_NDC = _head_chunks(cfg, params, chunk, h_BKD.dtype)
  zeros = jnp.zeros(target_BK.shape, jnp.float32)
  init = (jnp.full(target_BK.shape, jnp.finfo(jnp.float32).min), zeros, zeros, zeros)
  firsts = jnp.arange(w_NDC.shape[0], dtype=jnp.int32) * chunk
  (m, s, s2, picked), _ = jax.lax.scan(body, init, (w_NDC, firsts))
  lse = m + jnp.log(s)
  lp = picked - lse
  # log sum_v p(v)^2 = logsumexp(2 * logits) - 2 * lse, with logsumexp(2 * logits) = 2m + log s2.
  logw = lp - (2.0 * m + jnp.log(s2) - 2.0 * lse) if wpo else None
  return lp, logw, None


def shared_pair_stats(cfg: ModelConfig, params, batch: PairBatch,
                      adapter: Adapter | None = None, wpo: bool = False,
                      with_logits: bool = False) -> PairStats:
  """`pair_stats` of shared-prefix rows (dpo/packing.py): one [R, S] forward over the rows,
  hidden states gathered at the K scoring slots before the LM head, sums per pair and side.

  A shared-prefix row holds one pair (R = B). Packed rows hold up to P pairs each
  (`Packed.pair_valid` [R, P]): the sums land in [R, P, 2] by `score_pair` and each pair's are
  gathered back to its batch position by `pair_index` [B], so the result is the [B, 2] of the
  unpacked layout whatever the packing.

  One dropout key serves the whole forward, so with LoRA dropout the prompt's dropout mask is
  shared by both completions (the unshared layout draws one per side); packed rows take each
  pair's masks from its unpacked shared row (`dropout_source`), so packing does not change them.
  `PairStats.logits` (`with_logits`) is [R, K, V], the logits at the scoring slots (see
  `pair_kl`).
  """
  rows, packed = batch.shared, batch.packed
  if adapter is not None and packed is not None and packed.dropout_source is not None:
    # each packed slot takes its dropout mask from its pair's unpacked row
    adapter = dataclasses.replace(adapter, dropout_source=transformer.DropoutSource(
        packed.dropout_source, packed.pair_index.shape[0]))
  h_RSD, router = hidden(cfg, params, rows, adapter)
  h_RKD = jnp.take_along_axis(h_RSD, rows.score_from[..., None], axis=1)
  lp_RK, logw_RK, logits = head_logps(cfg, params, h_RKD, rows.score_target, wpo, with_logits)
  P = 1 if packed is None else packed.pair_valid.shape[1]
  pair_RK = jnp.zeros_like(rows.score_side) if packed is None else packed.score_pair
  # Column 2 * pair + side of each scored token, weighted: [R, K, 2P].
  col_RKC = ((2 * pair_RK + rows.score_side)[..., None] == jnp.arange(2 * P)).astype(
      jnp.float32) * rows.score_weight[..., None]
  per_pair = lambda x_RK: jnp.einsum("rk,rkc->rc", x_RK, col_RKC).reshape(-1, P, 2)
  tokens_RP2 = col_RKC.sum(1).reshape(-1, P, 2)
  shared_RK = jnp.take_along_axis(tokens_RP2.min(-1), pair_RK, axis=1)  # min(|y_w|, |y_l|)
  stats = [per_pair(lp_RK), tokens_RP2, per_pair(lp_RK * (rows.score_rank <= shared_RK)),
           None if logw_RK is None else per_pair(logw_RK) / jnp.maximum(tokens_RP2, 1.0)]
  if packed is not None:
    to_pairs = lambda x_RP2: x_RP2.reshape(-1, 2)[packed.pair_index]  # [B, 2]
  else:
    to_pairs = lambda x_RP2: x_RP2[:, 0]
  return PairStats(*(None if x is None else to_pairs(x) for x in stats), logits, router)

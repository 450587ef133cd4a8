"""Per-sequence completion log-probabilities.

`token_logps` scores token t with the logits at t - 1 (log-softmax in float32). `pair_logps`
runs the model on the chosen and rejected sequences of each pair with `jax.vmap` over the pair
axis and returns summed log-probs and token counts, prompt and padding positions masked out.
"""

from __future__ import annotations

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
                   loss_mask_BT, lora=None, lora_scale=1.0, dropout_key=None, dropout_rate=0.0,
                   with_logits=False):
  """(summed log-prob [B], scored-token count [B]) of each sequence's masked tokens, plus the
  float32 logits [B, T, V] when with_logits."""
  logits = transformer.forward(cfg, params, tokens_BT, positions_BT, segment_ids_BT, lora=lora,
                               lora_scale=lora_scale, dropout_key=dropout_key,
                               dropout_rate=dropout_rate)
  lp_BT = token_logps(logits, tokens_BT) * loss_mask_BT
  out = lp_BT.sum(-1), loss_mask_BT.sum(-1)
  return (*out, logits) if with_logits else out


def pair_logps(cfg: ModelConfig, params, batch, lora=None, lora_scale=1.0, dropout_key=None,
               dropout_rate=0.0, with_logits=False):
  """vmap of `sequence_logps` over the pair axis of [B, 2, T] arrays -> ([B, 2], [B, 2]), plus
  logits [B, 2, T, V] when with_logits."""
  keys = None if dropout_key is None else jax.random.split(dropout_key, 2)

  def one(tokens, positions, segment_ids, loss_mask, key):
    return sequence_logps(cfg, params, tokens, positions, segment_ids, loss_mask, lora,
                          lora_scale, key, dropout_rate, with_logits)

  return jax.vmap(one, in_axes=(1, 1, 1, 1, None if keys is None else 0), out_axes=1)(
      batch["tokens"], batch["positions"], batch["segment_ids"], batch["loss_mask"], keys)

"""Held-out evaluation on preference pairs: implicit-reward accuracy, margin, perplexity.

Runs the same `pair_logps` as training, without dropout, over every held-out pair (the last
partial batch is padded with copies and masked out of the averages).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import Config
from dpo import logprobs, train


def _pair_stats(cfg: Config, policy_params, lora, ref_params, batch):
  lora_scale = cfg.lora.scale if lora is not None else 1.0
  pol, counts = logprobs.pair_logps(cfg.model, policy_params, batch, lora=lora,
                                    lora_scale=lora_scale)
  ref, _ = logprobs.pair_logps(cfg.model, ref_params, batch)
  return pol, ref, counts


@functools.lru_cache(maxsize=8)
def _jitted_pair_stats(cfg: Config, mesh):
  # Outputs replicated so that every process can read them (multi-host).
  return jax.jit(train.with_mesh(mesh, functools.partial(_pair_stats, cfg)),
                 out_shardings=NamedSharding(mesh, P()))


def pair_metrics(cfg: Config, mesh, policy_params, lora, ref_params, arrays: dict,
                 batch_size: int) -> dict[str, float]:
  """Reward accuracy / margin (beta * log-ratio), chosen log-probs and chosen-token perplexity."""
  n = len(arrays["tokens"])
  pol, ref, counts = [], [], []
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size) % n
    # Every process holds all held-out pairs, so each passes the whole batch.
    batch = train.device_batch(mesh, {k: v[idx] for k, v in arrays.items()}, batch_size)
    p, r, c = jax.device_get(_jitted_pair_stats(cfg, mesh)(policy_params, lora, ref_params, batch))
    keep = slice(0, min(batch_size, n - start))
    pol.append(p[keep]); ref.append(r[keep]); counts.append(c[keep])
  pol, ref, counts = np.concatenate(pol), np.concatenate(ref), np.concatenate(counts)
  beta = cfg.train.beta
  rc, rr = beta * (pol[:, 0] - ref[:, 0]), beta * (pol[:, 1] - ref[:, 1])
  return {
      "reward_accuracy": float((rc > rr).mean()),
      "reward_margin": float((rc - rr).mean()),
      "rewards_chosen": float(rc.mean()),
      "rewards_rejected": float(rr.mean()),
      "logps_chosen": float(pol[:, 0].mean()),
      "logps_rejected": float(pol[:, 1].mean()),
      "perplexity": float(np.exp(-pol[:, 0].sum() / counts[:, 0].sum())),
      "pairs": int(n),
  }

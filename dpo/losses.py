"""Preference losses as pure functions of per-sequence log-probs.

Every loss takes a `Logps` (summed log-probs of chosen and rejected completions under the policy
and the reference, plus token counts) and returns (per-pair losses [B], extra metrics). The
trainer averages the losses; it never contains loss logic. `LOSSES` is the registry that
`--loss_type` selects from.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp


class Logps(NamedTuple):
  policy_chosen: jax.Array    # [B] summed log pi(y_w | x), nats
  policy_rejected: jax.Array  # [B] summed log pi(y_l | x)
  ref_chosen: jax.Array       # [B] summed log pi_ref(y_w | x)
  ref_rejected: jax.Array     # [B] summed log pi_ref(y_l | x)
  chosen_tokens: jax.Array    # [B] completion token counts
  rejected_tokens: jax.Array  # [B]


def sigmoid(lp: Logps, beta: float, label_smoothing: float = 0.0, **_):
  """DPO (Rafailov et al. 2023, eq. 7) with conservative label smoothing eps (Mitchell 2023):

  h = beta * [(log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))]
  loss = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)
  """
  h = beta * ((lp.policy_chosen - lp.ref_chosen) - (lp.policy_rejected - lp.ref_rejected))
  losses = -(1 - label_smoothing) * jax.nn.log_sigmoid(h) - label_smoothing * jax.nn.log_sigmoid(-h)
  return losses, {}


LOSSES: dict[str, Callable] = {"sigmoid": sigmoid}


def reward_metrics(lp: Logps, beta: float) -> dict[str, jax.Array]:
  """Implicit rewards r = beta * (log pi - log pi_ref), under the names TRL reports."""
  rc = beta * (lp.policy_chosen - lp.ref_chosen)
  rr = beta * (lp.policy_rejected - lp.ref_rejected)
  return {
      "rewards/chosen": rc.mean(),
      "rewards/rejected": rr.mean(),
      "rewards/accuracies": (rc > rr).astype(jnp.float32).mean(),
      "rewards/margins": (rc - rr).mean(),
      "logps/chosen": lp.policy_chosen.mean(),
      "logps/rejected": lp.policy_rejected.mean(),
  }

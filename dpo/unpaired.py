"""KTO's objective as pure functions: per-sequence log-probs of unpaired examples to a loss.

Kahneman-Tversky Optimization (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect
Theoretic Optimization", arXiv:2402.01306, eqs. 7-8) learns from examples labelled desirable or
undesirable, one completion each, not from pairs. With r = log pi(y|x) - log pi_ref(y|x), the
completion's log-ratio, and z0 the reference point:

    desirable     lambda_D * (1 - sigmoid(beta * (r - z0)))
    undesirable   lambda_U * (1 - sigmoid(beta * (z0 - r)))

averaged over the batch's examples. z0 estimates KL(pi || pi_ref) on the batch: the mean
log-ratio of mismatched pairs (x_i, y_j), prompt i with another example's completion, clamped
at 0 and held constant (no gradient). `apo_zero_unpaired` is APO-zero's unpaired form
(D'Oosterlinck et al. 2024, "Anchored Preference Optimization", arXiv:2408.06266, eq. 7):
1 - sigmoid(beta * r) for a desirable completion, sigmoid(beta * r) for an undesirable one, no
reference point.

The numbers are TRL 1.16's KTOTrainer's (`_compute_loss` in trl/trainer/kto_trainer.py;
tests/test_kto.py runs TRL's own code as the oracle): z0 = max(0, mean over the (micro)batch of
the mismatched pairs' log-ratios), the per-example losses weighted by `desirable_weight` and
`undesirable_weight`, then their plain mean over the examples. TRL builds the mismatched pairs
by rotating the completions of each batch by one: example i is scored with example i - 1's
completion (the first with the last); `dpo/algorithms/kto.py` does the same per microbatch.

TRL 1.16 also logs, and this module leaves out: `entropy`, `logits/chosen`, `logits/rejected`
(the policy's mean logit over the completions' tokens) and `num_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.config import FINITE_NONNEG, one_of, option, rules

LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass(frozen=True)
class KTOConfig:
  """The kto stage's hyperparameters (dpo/algorithms/kto.py), TRL 1.16 KTOConfig's defaults;
  beta is the loss section's `--beta` (TRL's default, 0.1, is ours). TRL's `loss_type` is
  `kto_loss_type` here (field names are unique across sections, and `--loss_type` is DPO's)."""
  kto_loss_type: str = option("kto", "KTO stage: the loss (TRL KTOConfig's loss_type): kto (the "
                              "KTO paper's, with the batch KL reference point) or "
                              "apo_zero_unpaired (APO-zero, unpaired; no reference point).")
  desirable_weight: float = option(1.0, "KTO stage: weight of the desirable examples' losses "
                                   "(TRL's desirable_weight, lambda_D); with unequal numbers of "
                                   "desirable and undesirable examples, lambda_D n_D / (lambda_U "
                                   "n_U) in [1, 4/3] (the KTO paper, eq. 8).")
  undesirable_weight: float = option(1.0, "KTO stage: weight of the undesirable examples' losses "
                                     "(TRL's undesirable_weight, lambda_U).")

  def __post_init__(self):
    rules(self, kto_loss_type=one_of(LOSS_TYPES), desirable_weight=FINITE_NONNEG,
          undesirable_weight=FINITE_NONNEG)

  @property
  def reference_point(self) -> bool:
    """Whether the loss reads z0, so the step scores the mismatched pairs (TRL's
    `calculate_KL`)."""
    return self.kto_loss_type == "kto"


class Objective(NamedTuple):
  """What the KTO step's loss reads (its `train.StepConfig.own`): the kto section and the loss
  section's beta."""
  config: KTOConfig
  beta: float


class UnpairedLogps(NamedTuple):
  """Per-example summed completion log-probs (nats) of a batch of B unpaired examples."""
  policy: jax.Array     # [B] log pi(y|x)
  reference: jax.Array  # [B] log pi_ref(y|x)
  desirable: jax.Array  # [B] bool, the label


def reference_point(policy_B: jax.Array, reference_B: jax.Array) -> jax.Array:
  """KTO's z0 (TRL's `kl`): max(0, mean of log pi - log pi_ref) over the mismatched pairs'
  summed log-probs, without gradient (TRL: the mean per device, gathered, its mean, clamp(min=0),
  detached)."""
  return jnp.maximum(jax.lax.stop_gradient(policy_B - reference_B).mean(), 0.0)


def kto_loss(lp: UnpairedLogps, z0: jax.Array, beta: float, cfg: KTOConfig):
  """(loss, metrics) of TRL 1.16 KTOTrainer._compute_loss on given log-probs: the weighted
  per-example losses of `cfg.kto_loss_type` (module docstring; KTO paper eq. 7) averaged over
  the B examples. Metrics under TRL's names (`rewards/*` = beta * r, `logps/*` the policy's,
  averaged over the examples of that label; `kl` = z0) as (sum, count) pairs where the count
  may be zero, which `train.accumulate` divides (0 when a batch has none), and the counts
  `count/chosen`, `count/rejected` (TRL 0.x's names)."""
  r_B = lp.policy - lp.reference
  d_B = lp.desirable
  if cfg.kto_loss_type == "kto":
    good, bad = 1.0 - jax.nn.sigmoid(beta * (r_B - z0)), 1.0 - jax.nn.sigmoid(beta * (z0 - r_B))
  else:  # apo_zero_unpaired
    good, bad = 1.0 - jax.nn.sigmoid(beta * r_B), jax.nn.sigmoid(beta * r_B)
  loss_B = jnp.where(d_B, cfg.desirable_weight * good, cfg.undesirable_weight * bad)
  reward_B = beta * jax.lax.stop_gradient(r_B)
  policy_B = jax.lax.stop_gradient(lp.policy)
  n_d = d_B.sum().astype(jnp.float32)
  n_u = (~d_B).sum().astype(jnp.float32)
  over = lambda x_B, mask_B, n: (jnp.where(mask_B, x_B, 0.0).sum(), n)
  metrics = {"rewards/chosen": over(reward_B, d_B, n_d),
             "rewards/rejected": over(reward_B, ~d_B, n_u),
             "logps/chosen": over(policy_B, d_B, n_d), "logps/rejected": over(policy_B, ~d_B, n_u),
             "kl": z0, "count/chosen": n_d, "count/rejected": n_u}
  return loss_B.mean(), metrics

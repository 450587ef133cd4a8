"""GRPO's objective as pure functions: rewards to advantages, per-token log-probs to a loss.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, eqs. 3-4)
samples G completions per prompt, scores them, and uses each completion's reward relative to
its group as the advantage of every one of its tokens, in PPO's clipped surrogate with the
importance ratio r = pi(y_t) / pi_old(y_t), plus beta times the k3 estimate of KL(pi || pi_ref)
per token. The numbers are TRL 1.16's GRPOTrainer's (`_compute_loss` and the advantage block of
`_generate_and_score_completions` in trl/trainer/grpo_trainer.py); tests/test_grpo_trl.py runs
TRL's own code as the oracle. There is no training loop here: the online stage calls these.

The aggregations of the per-token loss L[i, t] over completion i's tokens (mask m), N
completions in the batch:

  grpo     mean_i (sum_t m L / |y_i|): each completion's token mean, then the mean over completions
           (Shao et al. 2024, eq. 3; long completions' tokens weigh less).
  bnpo     sum m L / sum m: the token mean over this batch (TRL's "batch-normalized"; per
           microbatch).
  dr_grpo  sum m L / (N * max_completion_length): a constant normaliser, no length bias (Liu et
           al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO, arXiv:2503.20783).
  dapo     sum m L / num_items: the token mean over the whole accumulated batch, whatever its
           split into microbatches (Yu et al. 2025, "DAPO", arXiv:2503.14476, token-level loss).

Dr. GRPO also drops the division by the group's reward std (`scale_rewards="none"`); DAPO's
clip-higher is `grpo_epsilon_high` > `grpo_epsilon` and its overlong filtering
`mask_truncated_completions`.

TRL 1.16 also has, and this module leaves out: the loss types cispo, sapo, luspo and vespo, the
entropy bonus (`entropy_coef`, adaptive entropy), off-policy sequence masking
(`off_policy_mask_threshold`), vLLM importance-sampling correction, the MoE router loss, and
`multi_objective_aggregation="normalize_then_sum"` (here rewards are summed, then normalised:
TRL's default "sum_then_normalize").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from models.config import (FINITE_NONNEG, POS, UNIT, at_least, check, one_of, option, rules,
                           shown)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


@dataclass(frozen=True)
class GRPOConfig:
  """GRPO's hyperparameters, TRL 1.16 GRPOConfig's defaults. Field names are unique across the
  config sections (one flag each), so TRL's `beta`, `epsilon`, `epsilon_high`, `delta` and
  `loss_type` are `grpo_beta`, `grpo_epsilon`, `grpo_epsilon_high`, `grpo_delta` and
  `grpo_loss_type` here; every other field has TRL's name. TRL's None (epsilon_high, delta) is
  0 here. `grpo_loss` reads the loss fields; `weighted_rewards` and `group_advantages`
  `reward_weights` and `scale_rewards`; the online stage reads `num_generations`,
  `num_iterations` and `mask_truncated_completions` (sampling and update schedule)."""
  grpo_beta: float = option(0.0, "GRPO: weight of the k3 KL(pi || pi_ref) per token in the loss "
                            "(TRL's beta); 0 = no KL term and no reference model.")
  grpo_epsilon: float = option(0.2, "GRPO: lower clip of the importance ratio, 1 - epsilon (TRL's "
                               "epsilon).")
  grpo_epsilon_high: float = option(0.0, "GRPO: upper clip of the importance ratio, 1 + "
                                    "epsilon_high (TRL's epsilon_high; DAPO's clip-higher "
                                    "recommends 0.28); 0 = grpo_epsilon (TRL's None).")
  grpo_delta: float = option(0.0, "GRPO: two-sided clipping, the unclipped ratio capped at delta "
                             "(TRL's delta, INTELLECT-2; recommended > 1 + epsilon_high); 0 = "
                             "off (TRL's None).")
  grpo_loss_type: str = option("dapo", f"GRPO: aggregation of the per-token loss (TRL's "
                               f"loss_type), from {', '.join(LOSS_TYPES)} "
                               f"(dpo/policy_gradient.py says each).")
  scale_rewards: str = option("group", "GRPO advantages: reward minus its group's mean, divided "
                              "by the group's std (group), the batch's std (batch), or not "
                              "(none; Dr. GRPO) (TRL's scale_rewards).")
  importance_sampling_level: str = option("token", "GRPO: importance ratio per token (token) or "
                                          "one per completion, exp of the mean log-ratio "
                                          "(sequence; GSPO) (TRL's importance_sampling_level).")
  use_bias_correction_kl: bool = option(True, "GRPO: multiply the per-token KL by the importance "
                                        "ratio (TRL's use_bias_correction_kl, DeepSeek-V3.2); "
                                        "read only with grpo_beta > 0.")
  reward_weights: tuple[float, ...] = option((), "GRPO: weights of the --reward_fn functions, "
                                             "one each, their weighted sum the reward (TRL's "
                                             "reward_weights); empty = all 1.0.")
  num_generations: int = option(8, "GRPO: completions sampled per prompt, G (TRL's "
                                "num_generations).")
  num_iterations: int = option(1, "GRPO: updates per generated batch, mu (TRL's "
                               "num_iterations); above 1 the importance ratio departs from 1.")
  max_completion_length: int = option(512, "GRPO: completion tokens sampled at most (TRL's "
                                      "max_completion_length); dr_grpo's normaliser.")
  mask_truncated_completions: bool = option(False, "GRPO: leave completions that reach "
                                            "max_completion_length without EOS out of the loss "
                                            "(TRL's mask_truncated_completions; DAPO).")
  top_entropy_quantile: float = option(1.0, "GRPO: the policy term only on the tokens whose "
                                       "entropy is in this top fraction of the batch's (TRL's "
                                       "top_entropy_quantile, Wang et al. 2025 use 0.2); 1 = "
                                       "every token.")

  def __post_init__(self):
    rules(self, grpo_beta=FINITE_NONNEG, grpo_epsilon=UNIT, grpo_epsilon_high=FINITE_NONNEG,
          grpo_delta=(lambda v: v == 0 or 1 < v < math.inf, "0 (off) or a finite number > 1"),
          grpo_loss_type=one_of(LOSS_TYPES), scale_rewards=one_of(SCALE_REWARDS),
          importance_sampling_level=one_of(("token", "sequence")),
          reward_weights=(lambda v: all(math.isfinite(w) for w in v), "finite numbers"),
          num_generations=at_least(2), num_iterations=at_least(1), max_completion_length=POS,
          top_entropy_quantile=(lambda v: 0 <= v <= 1, "in [0, 1]"))
    check(self.use_bias_correction_kl or self.grpo_beta > 0,
          "--use_bias_correction_kl=False: must go with --grpo_beta > 0 (it changes only the KL "
          "term)")

  @property
  def epsilon_low(self) -> float:
    """The ratio's lower clip is 1 - epsilon_low (TRL's trainer attribute of that name)."""
    return self.grpo_epsilon

  @property
  def epsilon_high(self) -> float:
    """The ratio's upper clip is 1 + epsilon_high (0 in the field = epsilon, as TRL's None)."""
    return self.grpo_epsilon_high or self.grpo_epsilon


# --- rewards to advantages ------------------------------------------------------------------------

def weighted_rewards(rewards_BGF: jax.Array, reward_weights: tuple[float, ...] = ()) -> jax.Array:
  """[B, G] sum over the F reward functions of weight * reward, NaN (a function that returned
  None) counted as 0, as TRL's nansum; a completion every function left NaN stays NaN (TRL's
  "unscorable": left out of its group's statistics, advantage 0). Empty weights: all 1.0."""
  w_F = jnp.asarray(reward_weights or (1.0,) * rewards_BGF.shape[-1], rewards_BGF.dtype)
  check(w_F.shape == rewards_BGF.shape[-1:],
        f"--reward_weights={shown(tuple(reward_weights))}: must be one weight per reward "
        f"function ({rewards_BGF.shape[-1]})")
  total_BG = jnp.nansum(rewards_BGF * w_F, axis=-1)
  return jnp.where(jnp.isnan(rewards_BGF).all(-1), jnp.nan, total_BG)


def _nanstd(x: jax.Array, axis=None) -> jax.Array:
  """TRL's `nanstd`: Bessel-corrected (torch.std's default) over the non-NaN values; NaN for
  fewer than two."""
  count = (~jnp.isnan(x)).sum(axis, keepdims=True)
  var = jnp.nanmean((x - jnp.nanmean(x, axis, keepdims=True)) ** 2, axis, keepdims=True)
  return jnp.sqrt(jnp.where(count > 1, var * count / jnp.maximum(count - 1, 1), jnp.nan))


def reward_std(rewards_BG: jax.Array, scale_rewards: str) -> jax.Array:
  """The reward std TRL's `std_rewards` holds, broadcastable to [B, G]: the batch's with
  "batch", else each group's (with "none" TRL divides by none, and reads it only for
  `frac_reward_zero_std`); unbiased, over the scorable rewards (NaN for fewer than two); 0 for a
  single reward (one completion a group, or one in the batch), as TRL's zeros."""
  check(scale_rewards in SCALE_REWARDS,
        f"--scale_rewards={scale_rewards!r}: must be {one_of(SCALE_REWARDS)[1]}")
  B, G = rewards_BG.shape
  if scale_rewards == "batch":
    return _nanstd(rewards_BG) if B * G > 1 else jnp.zeros((1, 1), rewards_BG.dtype)
  return _nanstd(rewards_BG, axis=1) if G > 1 else jnp.zeros((B, 1), rewards_BG.dtype)


def group_advantages(rewards_BG: jax.Array, scale_rewards: str) -> jax.Array:
  """[B, G] advantages of G completions per prompt (Shao et al. 2024, §4.1.2 outcome
  supervision): reward minus its group's mean, divided by `reward_std` + 1e-4, the std (unbiased)
  of the group ("group") or of the whole batch ("batch", Lite PPO, arXiv:2508.08221), or not at
  all ("none", Dr. GRPO). NaN rewards (unscorable) are left out of means and stds and get 0, as
  does every completion of a group with one scorable member (its std is NaN in TRL too)."""
  advantages = rewards_BG - jnp.nanmean(rewards_BG, axis=1, keepdims=True)
  if scale_rewards != "none":
    advantages = advantages / (reward_std(rewards_BG, scale_rewards) + STD_EPS)
  return jnp.nan_to_num(advantages, nan=0.0)


def frac_reward_zero_std(rewards_BG: jax.Array, scale_rewards: str) -> jax.Array:
  """TRL's logged `frac_reward_zero_std`: the fraction of the completions whose `reward_std` is
  0 (torch.isclose's tolerance; a NaN std is not 0). Under "batch" that is the batch's std, so it
  is 0 or 1: one tied group among others logs 0, not its share of the groups."""
  std_BG = jnp.broadcast_to(reward_std(rewards_BG, scale_rewards), rewards_BG.shape)
  return jnp.isclose(std_BG, 0.0).mean()


# --- the loss -------------------------------------------------------------------------------------

def high_entropy_mask(entropies_NT: jax.Array, mask_NT: jax.Array, top_entropy_quantile: float):
  """[N, T] bool: the completion tokens whose entropy is at least the (1 - q) quantile (linear
  interpolation, as torch.quantile) of the batch's completion-token entropies (Wang et al. 2025,
  "Beyond the 80/20 Rule"; TRL's get_high_entropy_mask). No tokens: all False."""
  live = mask_NT > 0
  threshold = jnp.nanquantile(jnp.where(live, entropies_NT, jnp.nan), 1.0 - top_entropy_quantile)
  return live & (entropies_NT * mask_NT >= threshold)


def _mean(x_NT: jax.Array, mask_NT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum, count) of x over the completion tokens ([N, 1]: over the completions, as TRL's
  `global_masked_mean`); a ratio metric, divided after gradient accumulation (train.accumulate)."""
  if x_NT.shape[1] == 1:
    return x_NT.sum(), jnp.asarray(x_NT.shape[0], jnp.float32)
  return (x_NT * mask_NT).sum(), mask_NT.sum()


def _per_completion(x_NT: jax.Array, mask_NT: jax.Array) -> jax.Array:
  """[N] each completion's mean over its tokens, NaN for a completion without any ([N, 1]: the
  value itself), as TRL's `masked_seq_mean`."""
  if x_NT.shape[1] == 1:
    return x_NT[:, 0]
  n_N = mask_NT.sum(-1)
  return jnp.where(n_N > 0, (x_NT * mask_NT).sum(-1) / jnp.where(n_N > 0, n_N, 1.0), jnp.nan)


def grpo_loss(logps_NT: jax.Array, old_logps_NT: jax.Array | None,
              ref_logps_NT: jax.Array | None, advantages_N: jax.Array, mask_NT: jax.Array,
              cfg: GRPOConfig, *, num_items: jax.Array | float | None = None,
              entropies_NT: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """(scalar loss, metrics) of GRPO (Shao et al. 2024, eq. 3; k3 KL of eq. 4), TRL 1.16's
  `GRPOTrainer._compute_loss` for loss types grpo, bnpo, dr_grpo and dapo.

  logps_NT: per-token log-probs (nats) of the N sampled completions under the policy being
    trained; old_logps_NT under the policy that sampled them (None: `logps_NT` without its
    gradient, TRL's on-policy case); ref_logps_NT under the reference (read iff grpo_beta > 0).
  advantages_N: one advantage per completion (`group_advantages`, flattened); mask_NT: 1 on
    completion tokens. The per-token loss is -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    (r capped at grpo_delta first when set) + beta * KL_k3, aggregated as cfg.grpo_loss_type
    says (the module docstring).
  num_items (keyword, dapo only): what dapo divides the summed token loss by; None = this
    call's completion-token count. TRL divides by num_items_in_batch / num_processes *
    gradient_accumulation_steps / steps_per_generation; a step that averages K microbatches
    (train.accumulate) passes the whole batch's token count / K.
  entropies_NT (keyword): per-token entropies of the policy, read with top_entropy_quantile < 1
    (the policy term only on high-entropy tokens), and logged as "entropy" when given.

  Metrics, TRL's names: kl (with beta), entropy, clip_ratio/{low,high,region}_mean as (sum,
  count) pairs that train.accumulate divides; clip_ratio/low_min and clip_ratio/high_max (over
  completions) as values.
  """
  mask_NT = mask_NT.astype(jnp.float32)
  A_N1 = advantages_N.reshape(-1, 1)
  old_logps_NT = jax.lax.stop_gradient(logps_NT if old_logps_NT is None else old_logps_NT)
  log_ratio_NT = logps_NT - old_logps_NT
  if cfg.importance_sampling_level == "sequence":  # GSPO: exp of the mean log-ratio, [N, 1]
    log_ratio_NT = ((log_ratio_NT * mask_NT).sum(-1, keepdims=True)
                    / jnp.maximum(mask_NT.sum(-1, keepdims=True), 1.0))
  ratio = jnp.exp(log_ratio_NT)  # [N, T] or [N, 1]
  clipped = jnp.clip(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
  if cfg.grpo_delta:
    ratio_kl, ratio = ratio, jnp.minimum(ratio, cfg.grpo_delta)
  else:
    ratio_kl = ratio
  per_token = -jnp.minimum(ratio * A_N1, clipped * A_N1)
  if cfg.top_entropy_quantile < 1.0:
    check(entropies_NT is not None, f"--top_entropy_quantile={cfg.top_entropy_quantile}: "
          f"grpo_loss needs entropies_NT")
    per_token = per_token * high_entropy_mask(entropies_NT, mask_NT, cfg.top_entropy_quantile)
  per_token = jnp.broadcast_to(per_token, mask_NT.shape)

  metrics = {}
  if cfg.grpo_beta:
    check(ref_logps_NT is not None, f"--grpo_beta={cfg.grpo_beta}: grpo_loss needs ref_logps_NT")
    d_NT = ref_logps_NT - logps_NT
    kl_NT = jnp.exp(d_NT) - d_NT - 1  # k3: unbiased, >= 0 (Shao et al. 2024, eq. 4)
    if cfg.use_bias_correction_kl:
      kl_NT = kl_NT * ratio_kl
    per_token = per_token + cfg.grpo_beta * kl_NT
    metrics["kl"] = _mean(kl_NT, mask_NT)

  N = mask_NT.shape[0]
  summed = (per_token * mask_NT).sum()
  if cfg.grpo_loss_type == "grpo":
    loss = ((per_token * mask_NT).sum(-1) / jnp.maximum(mask_NT.sum(-1), 1.0)).mean()
  elif cfg.grpo_loss_type == "bnpo":
    loss = summed / jnp.maximum(mask_NT.sum(), 1.0)
  elif cfg.grpo_loss_type == "dr_grpo":
    loss = summed / (N * cfg.max_completion_length)
  elif cfg.grpo_loss_type == "dapo":
    loss = summed / (jnp.maximum(mask_NT.sum(), 1.0) if num_items is None else num_items)
  else:
    raise ValueError(f"--grpo_loss_type={cfg.grpo_loss_type!r}: must be {one_of(LOSS_TYPES)[1]}")

  if entropies_NT is not None:
    metrics["entropy"] = _mean(entropies_NT, mask_NT)
  low = ((ratio < 1 - cfg.epsilon_low) & (A_N1 < 0)).astype(jnp.float32)
  high = ((ratio > 1 + cfg.epsilon_high) & (A_N1 > 0)).astype(jnp.float32)
  metrics["clip_ratio/low_mean"] = _mean(low, mask_NT)
  metrics["clip_ratio/high_mean"] = _mean(high, mask_NT)
  metrics["clip_ratio/region_mean"] = _mean(jnp.maximum(low, high), mask_NT)
  metrics["clip_ratio/low_min"] = jnp.nanmin(_per_completion(low, mask_NT))
  metrics["clip_ratio/high_max"] = jnp.nanmax(_per_completion(high, mask_NT))
  return loss, metrics

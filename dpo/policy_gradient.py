"""GRPO's, RLOO's and PPO's objectives as pure functions: rewards to advantages, log-probs to
a loss.

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

The loss types that change the per-token loss itself (TRL 1.16's other four):

  cispo    -sg(min(r, epsilon_high)) A log pi(y_t): the importance weight clipped and detached,
           the policy gradient through the log-prob (MiniMax-M1, arXiv:2506.13585; TRL's
           epsilon_high is CISPO's eps_max, 5.0 recommended); aggregated as dapo.
  sapo     -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_temperature_pos for A > 0, else
           sapo_temperature_neg: a soft gate in place of the clip (SAPO, arXiv:2511.20347);
           aggregated as grpo.
  luspo    the clipped objective, each completion's token sum, then the mean over completions:
           GSPO scaled by length (LUSPO, arXiv:2602.05261; meant with
           importance_sampling_level="sequence").
  vespo    -sg(phi(w)) A log pi(y_t), phi(w) = exp(lam) w^k exp(-lam w) of the completion's
           importance weight w = exp(sum_t log r) (log r clamped to [-20, 20], log w to
           [log 1e-8, 20]), k, lam = vespo_k_pos, vespo_lambda_pos for A >= 0, else the _neg ones
           (VESPO, arXiv:2602.10693); aggregated as dapo.

Beside any loss type: `off_policy_mask_threshold` drops completions with a negative advantage
whose mean token KL(pi_old || pi) exceeds it (DeepSeek-V3.2, arXiv:2512.02556, eq. 9), and
`entropy_coef` subtracts coef times the mean token entropy of the policy (the tokens the policy
term acts on). Rewards of several functions are summed then normalised (TRL's default
"sum_then_normalize") or, with `multi_objective_aggregation="normalize_then_sum"`, each function
normalised within its group, the weighted sum then normalised over the batch (GDPO,
arXiv:2601.05242).

RLOO (Ahmadian et al. 2024, arXiv:2402.14740; TRL 1.16's RLOOTrainer, tests/test_rloo_trl.py) at
the end: k completions a prompt, each one's advantage its reward (less beta times its sequence
KL(pi_old || pi_ref), the summed token log-ratio) less the mean of the other k - 1, PPO's clip on
the sequence's importance ratio, the mean over completions (`RLOOConfig`, `rloo_advantages`,
`rloo_loss`).

PPO with a learned value model (Schulman et al. 2017, arXiv:1707.06347; Tunix 0.1.7's PPO
learner, tests/test_ppo_tunix.py) last: each completion token's reward is the completion's score
on its last token less ppo_beta times a token KL(pi_old || pi_ref) estimate (`token_rewards`),
the advantages are GAE's over the completion tokens, whitened over the batch, the returns the
value targets (`gae_advantages`); the policy takes the token-level clipped surrogate (dual clip
and entropy bonus optional, `ppo_policy_loss`), the value model the clipped squared error
(`ppo_value_loss`) (`PPOConfig`).

TRL 1.16 also has, and this module leaves out: adaptive entropy control (`use_adaptive_entropy`
and its entropy_coef_min/max/delta and entropy_target: a coefficient that moves between steps,
state outside the step; no flag here, so absl refuses one), vLLM importance-sampling
correction, and the MoE router loss.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from models.config import (FINITE_NONNEG, FINITE_POS, POS, UNIT, at_least, check, one_of,
                           option, rules, shown)

FINITE = (lambda v: math.isfinite(v), "a finite number")

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the clipped ratio (epsilons, delta)
SCALE_REWARDS = ("group", "batch", "none")
SCALE_SPELLINGS = {True: "group", False: "none", "True": "group", "true": "group",
                   "False": "none", "false": "none"}  # TRL's bools, as values or the flag's text
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
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
  grpo_loss_type: str = option("dapo", f"GRPO: the per-token loss and its aggregation (TRL's "
                               f"loss_type), from {', '.join(LOSS_TYPES)} "
                               f"(dpo/policy_gradient.py says each).")
  sapo_temperature_neg: float = option(1.05, "GRPO sapo: gate temperature of tokens with advantage "
                                       "<= 0 (TRL's sapo_temperature_neg).")
  sapo_temperature_pos: float = option(1.0, "GRPO sapo: gate temperature of tokens with advantage "
                                       "> 0 (TRL's sapo_temperature_pos).")
  vespo_k_pos: float = option(2.0, "GRPO vespo: power k of the gamma weight for advantage >= 0 "
                              "(TRL's vespo_k_pos); larger down-weights ratios below 1 more.")
  vespo_lambda_pos: float = option(3.0, "GRPO vespo: decay lambda of the gamma weight for "
                                   "advantage >= 0 (TRL's vespo_lambda_pos); larger down-weights "
                                   "ratios above 1 more.")
  vespo_k_neg: float = option(3.0, "GRPO vespo: power k of the gamma weight for advantage < 0 "
                              "(TRL's vespo_k_neg).")
  vespo_lambda_neg: float = option(2.0, "GRPO vespo: decay lambda of the gamma weight for "
                                   "advantage < 0 (TRL's vespo_lambda_neg).")
  entropy_coef: float = option(0.0, "GRPO: subtract this times the mean token entropy of the "
                               "policy from the loss, whatever the loss type (TRL's "
                               "entropy_coef; > 0 is a bonus for exploring); 0 = off.")
  off_policy_mask_threshold: float = option(0.0, "GRPO: leave out of the loss each completion "
                                            "with a negative advantage whose mean token "
                                            "KL(pi_old || pi) exceeds this (TRL's "
                                            "off_policy_mask_threshold, DeepSeek-V3.2's delta, "
                                            "e.g. 0.5); 0 = off (TRL's None).")
  multi_objective_aggregation: str = option("sum_then_normalize", "GRPO, several reward "
                                            "functions: sum the weighted rewards, then normalise "
                                            "as --scale_rewards says (sum_then_normalize), or "
                                            "normalise each function within its group, sum, then "
                                            "normalise over the batch (normalize_then_sum; GDPO) "
                                            "(TRL's multi_objective_aggregation).")
  scale_rewards: str = option("group", "GRPO advantages: reward minus its group's mean, divided "
                              "by the group's std (group, or True), the batch's std (batch), or "
                              "not (none, or False; Dr. GRPO) (TRL's scale_rewards).")
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
  dynamic_sampling: bool = option(False, "GRPO: DAPO's dynamic sampling (Yu et al. 2025): drop "
                                 "the groups whose rewards all agree (no signal) and sample "
                                 "groups of more prompts until the batch is full, at most "
                                 "--dynamic_sampling_max_batches generation batches a step "
                                 "(short: filled with dropped groups, counted and logged).")
  dynamic_sampling_max_batches: int = option(4, "GRPO --dynamic_sampling: generation batches a "
                                             "step draws at most, the first included (DAPO's "
                                             "max_num_gen_batches).")
  top_entropy_quantile: float = option(1.0, "GRPO: the policy term only on the tokens whose "
                                       "entropy is in this top fraction of the batch's (TRL's "
                                       "top_entropy_quantile, Wang et al. 2025 use 0.2); 1 = "
                                       "every token.")

  def __post_init__(self):
    if isinstance(self.scale_rewards, bool) or self.scale_rewards in SCALE_SPELLINGS:
      object.__setattr__(self, "scale_rewards", SCALE_SPELLINGS[self.scale_rewards])
    rules(self, grpo_beta=FINITE_NONNEG, grpo_epsilon=UNIT, grpo_epsilon_high=FINITE_NONNEG,
          grpo_delta=(lambda v: v == 0 or 1 < v < math.inf, "0 (off) or a finite number > 1"),
          grpo_loss_type=one_of(LOSS_TYPES), scale_rewards=one_of(SCALE_REWARDS),
          importance_sampling_level=one_of(("token", "sequence")),
          reward_weights=(lambda v: all(math.isfinite(w) for w in v), "finite numbers"),
          num_generations=at_least(2), num_iterations=at_least(1), max_completion_length=POS,
          dynamic_sampling_max_batches=at_least(1),
          top_entropy_quantile=(lambda v: 0 <= v <= 1, "in [0, 1]"),
          sapo_temperature_neg=FINITE_POS, sapo_temperature_pos=FINITE_POS,
          vespo_k_pos=FINITE_NONNEG, vespo_lambda_pos=FINITE_NONNEG, vespo_k_neg=FINITE_NONNEG,
          vespo_lambda_neg=FINITE_NONNEG, entropy_coef=FINITE,
          off_policy_mask_threshold=(lambda v: v == 0 or 0 < v < math.inf,
                                     "0 (off) or a finite number > 0"),
          multi_objective_aggregation=one_of(AGGREGATIONS))
    check(self.use_bias_correction_kl or self.grpo_beta > 0,
          "--use_bias_correction_kl=False: must go with --grpo_beta > 0 (it changes only the KL "
          "term)")
    # A loss type's own hyperparameters, and the clip's, are refused where nothing reads them.
    readers = {"sapo_temperature_neg": ("sapo",), "sapo_temperature_pos": ("sapo",),
               "vespo_k_pos": ("vespo",), "vespo_lambda_pos": ("vespo",),
               "vespo_k_neg": ("vespo",), "vespo_lambda_neg": ("vespo",),
               "grpo_epsilon": CLIPPED + ("cispo",), "grpo_epsilon_high": CLIPPED + ("cispo",),
               "grpo_delta": CLIPPED}
    for f in dataclasses.fields(self):
      types, value = readers.get(f.name, LOSS_TYPES), getattr(self, f.name)
      check(self.grpo_loss_type in types or value == f.default,
            f"--{f.name}={shown(value)}: must go with --grpo_loss_type={' or '.join(types)} "
            f"(read only there), not {self.grpo_loss_type}")
    check(self.dynamic_sampling or self.dynamic_sampling_max_batches == 4,
          f"--dynamic_sampling_max_batches={self.dynamic_sampling_max_batches}: must go with "
          f"--dynamic_sampling (read only there)")
    check(self.multi_objective_aggregation == "sum_then_normalize"
          or self.scale_rewards == "group",
          f"--scale_rewards={self.scale_rewards!r}: must go with --multi_objective_aggregation="
          f"sum_then_normalize (normalize_then_sum scales by each group's, then the batch's, std)")

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


def has_signal(rewards_BGF, reward_weights: tuple[float, ...] = (),
               aggregation: str = "sum_then_normalize"):
  """[B] bool: the groups whose rewards give some completion a non-zero advantage, which DAPO's
  dynamic sampling keeps: the weighted rewards (`weighted_rewards`) do not all agree, their std
  (unbiased, over the scorable ones) not 0 to torch.isclose's tolerance nor NaN; under
  normalize_then_sum (each function normalised in its group first) any one function's rewards
  do not all agree."""
  r = jnp.asarray(rewards_BGF, jnp.float32)
  live = lambda std: ~jnp.isclose(std, 0.0) & ~jnp.isnan(std)
  if aggregation == "normalize_then_sum":
    return jnp.any(live(jnp.stack([reward_std(r[..., f], "group")[:, 0]
                                   for f in range(r.shape[-1])], -1)), -1)
  return live(reward_std(weighted_rewards(r, reward_weights), "group")[:, 0])


def frac_reward_zero_std(rewards_BG: jax.Array, scale_rewards: str) -> jax.Array:
  """TRL's logged `frac_reward_zero_std`: the fraction of the completions whose `reward_std` is
  0 (torch.isclose's tolerance; a NaN std is not 0). Under "batch" that is the batch's std, so it
  is 0 or 1: one tied group among others logs 0, not its share of the groups."""
  std_BG = jnp.broadcast_to(reward_std(rewards_BG, scale_rewards), rewards_BG.shape)
  return jnp.isclose(std_BG, 0.0).mean()


def normalized_sum(rewards_BGF: jax.Array, reward_weights: tuple[float, ...] = ()) -> jax.Array:
  """[B, G] GDPO's reward (TRL's multi_objective_aggregation="normalize_then_sum"): each
  function's reward less its group's mean over its group's std + 1e-4 (unbiased; over the
  completions it scored; 0 with one completion a group), then the weighted sum as
  `weighted_rewards`: a NaN counted as 0 (a None, or a function's NaN std: a group it scored
  once), a completion no function scored NaN."""
  B, G, F = rewards_BGF.shape
  mean_B1F = jnp.nanmean(rewards_BGF, axis=1, keepdims=True)
  std_B1F = _nanstd(rewards_BGF, axis=1) if G > 1 else jnp.zeros_like(mean_B1F)
  total_BG = jnp.nan_to_num(weighted_rewards((rewards_BGF - mean_B1F) / (std_B1F + STD_EPS),
                                             reward_weights), nan=0.0)
  return jnp.where(jnp.isnan(rewards_BGF).all(-1), jnp.nan, total_BG)


def advantages(rewards_BGF: jax.Array, cfg: GRPOConfig) -> tuple[jax.Array, jax.Array]:
  """([B, G] advantages, frac_reward_zero_std) of G completions per prompt from each of the F
  reward functions' rewards (NaN: the function returned None), as cfg.multi_objective_aggregation
  says: the weighted sum's `group_advantages` (sum_then_normalize), or `normalized_sum` less the
  batch's mean over the batch's std + 1e-4 (normalize_then_sum). TRL 1.16's
  `_generate_and_score_completions`; unscorable completions get 0."""
  if cfg.multi_objective_aggregation == "normalize_then_sum":
    r_BG = normalized_sum(rewards_BGF, cfg.reward_weights)
    adv_BG = (r_BG - jnp.nanmean(r_BG)) / (reward_std(r_BG, "batch") + STD_EPS)
    return jnp.nan_to_num(adv_BG, nan=0.0), frac_reward_zero_std(r_BG, "batch")
  r_BG = weighted_rewards(rewards_BGF, cfg.reward_weights)
  return (group_advantages(r_BG, cfg.scale_rewards),
          frac_reward_zero_std(r_BG, cfg.scale_rewards))


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


def token_entropy(logits_NTV: jax.Array) -> jax.Array:
  """[N, T] entropy (nats) of the next-token distribution that scores token t (logits at t - 1,
  as logprobs.token_logps; position 0, without context, 0): TRL's `entropy_from_logits`."""
  logp = jax.nn.log_softmax(logits_NTV[:, :-1].astype(jnp.float32), axis=-1)
  return jnp.pad(-(jnp.exp(logp) * logp).sum(-1), ((0, 0), (1, 0)))


def off_policy_mask(logps_NT, old_logps_NT, advantages_N1, mask_NT, threshold: float):
  """[N, 1] 1 to keep, 0 to drop: a completion with a negative advantage whose mean token
  KL(pi_old || pi) (old log-prob less the policy's, no gradient) exceeds `threshold` is dropped
  (DeepSeek-V3.2, arXiv:2512.02556, eq. 9; TRL's get_off_policy_mask)."""
  kl_NT = jnp.nan_to_num(old_logps_NT - jax.lax.stop_gradient(logps_NT), nan=0.0)
  kl_N1 = (kl_NT * mask_NT).sum(-1, keepdims=True) / jnp.maximum(
      mask_NT.sum(-1, keepdims=True), 1.0)
  return ((advantages_N1 >= 0) | (kl_N1 <= threshold)).astype(mask_NT.dtype)


def gamma_weights(log_ratio_NT, advantages_N1, mask_NT, cfg: GRPOConfig) -> jax.Array:
  """[N, 1] VESPO's phi(w) = exp(lam + k log w - lam w) of each completion's importance weight
  w = exp(sum_t log r_t), without gradient (k, lam by the advantage's sign; NaN or inf -> 0):
  TRL's get_gamma_weights without vLLM's correction."""
  seq_N1 = (jnp.clip(log_ratio_NT, -20.0, 20.0) * mask_NT).sum(-1, keepdims=True)
  log_w = jnp.clip(jax.lax.stop_gradient(seq_N1), math.log(1e-8), 20.0)
  pos = advantages_N1 >= 0
  k = jnp.where(pos, cfg.vespo_k_pos, cfg.vespo_k_neg)
  lam = jnp.maximum(jnp.where(pos, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg), 1e-4)
  phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
  return jnp.where(jnp.isfinite(phi), phi, 0.0)


def grpo_loss(logps_NT: jax.Array, old_logps_NT: jax.Array | None,
              ref_logps_NT: jax.Array | None, advantages_N: jax.Array, mask_NT: jax.Array,
              cfg: GRPOConfig, *, num_items: jax.Array | float | None = None,
              entropies_NT: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """(scalar loss, metrics) of GRPO (Shao et al. 2024, eq. 3; k3 KL of eq. 4), TRL 1.16's
  `GRPOTrainer._compute_loss` for every loss type it has.

  logps_NT: per-token log-probs (nats) of the N sampled completions under the policy being
    trained; old_logps_NT under the policy that sampled them (None: `logps_NT` without its
    gradient, TRL's on-policy case); ref_logps_NT under the reference (read iff grpo_beta > 0).
  advantages_N: one advantage per completion (`advantages`, flattened); mask_NT: 1 on
    completion tokens. The per-token loss is cfg.grpo_loss_type's (the module docstring; the
    clipped types: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r capped at grpo_delta
    first when set), times the off-policy mask when set, plus beta * KL_k3, aggregated as the
    loss type says, less entropy_coef times the mean entropy.
  num_items (keyword; dapo, cispo and vespo): what they divide the summed token loss by; None =
    this call's completion-token count. TRL divides by num_items_in_batch / num_processes *
    gradient_accumulation_steps / steps_per_generation; a step that averages K microbatches
    (train.accumulate) passes the whole batch's token count / K.
  entropies_NT (keyword): per-token entropies of the policy (`token_entropy`), read with
    top_entropy_quantile < 1 (the policy term only on high-entropy tokens) and entropy_coef,
    and logged as "entropy" when given.

  Metrics, TRL's names: kl (with beta), entropy, clip_ratio/{low,high,region}_mean (clipped
  types), cispo_clip_ratio, vespo/phi_seq_mean as (sum, count) pairs that train.accumulate
  divides; clip_ratio/low_min and clip_ratio/high_max (over completions), and with entropy_coef
  policy_loss (the loss before the entropy term) and entropy_coef, as values.
  """
  loss_type = cfg.grpo_loss_type
  check(loss_type in LOSS_TYPES, f"--grpo_loss_type={loss_type!r}: must be "
        f"{one_of(LOSS_TYPES)[1]}")
  needs_entropy = cfg.top_entropy_quantile < 1.0 or cfg.entropy_coef != 0.0
  check(not needs_entropy or entropies_NT is not None,
        f"--{'top_entropy_quantile' if cfg.top_entropy_quantile < 1 else 'entropy_coef'}="
        f"{cfg.top_entropy_quantile if cfg.top_entropy_quantile < 1 else cfg.entropy_coef}: "
        f"grpo_loss needs entropies_NT")
  mask_NT = mask_NT.astype(jnp.float32)
  A_N1 = advantages_N.reshape(-1, 1)
  old_logps_NT = jax.lax.stop_gradient(logps_NT if old_logps_NT is None else old_logps_NT)
  if cfg.off_policy_mask_threshold:
    keep_N1 = off_policy_mask(logps_NT, old_logps_NT, A_N1, mask_NT, cfg.off_policy_mask_threshold)
  log_ratio_NT = logps_NT - old_logps_NT
  log_iw = log_ratio_NT
  if cfg.importance_sampling_level == "sequence":  # GSPO: exp of the mean log-ratio, [N, 1]
    log_iw = ((log_ratio_NT * mask_NT).sum(-1, keepdims=True)
              / jnp.maximum(mask_NT.sum(-1, keepdims=True), 1.0))
  ratio_kl = ratio = jnp.exp(log_iw)  # [N, T] or [N, 1]

  metrics = {}
  if loss_type == "cispo":
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, cfg.epsilon_high))
    per_token = -weight * A_N1 * logps_NT
  elif loss_type == "sapo":
    tau_N1 = jnp.where(A_N1 > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
    per_token = -jax.nn.sigmoid(tau_N1 * (ratio - 1)) * 4 / tau_N1 * A_N1
  elif loss_type == "vespo":
    phi_N1 = gamma_weights(log_ratio_NT, A_N1, mask_NT, cfg)
    per_token = -phi_N1 * A_N1 * logps_NT
  else:  # the clipped ratio
    clipped = jnp.clip(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    if cfg.grpo_delta:
      ratio = jnp.minimum(ratio, cfg.grpo_delta)
    per_token = -jnp.minimum(ratio * A_N1, clipped * A_N1)
  if cfg.off_policy_mask_threshold:
    per_token = per_token * keep_N1
  live_NT = mask_NT  # the tokens the policy term (and the entropy bonus) acts on
  if cfg.top_entropy_quantile < 1.0:
    high_NT = high_entropy_mask(entropies_NT, mask_NT, cfg.top_entropy_quantile)
    per_token = per_token * high_NT
    live_NT = mask_NT * high_NT
  per_token = jnp.broadcast_to(per_token, mask_NT.shape)

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
  if loss_type in ("grpo", "sapo"):
    loss = ((per_token * mask_NT).sum(-1) / jnp.maximum(mask_NT.sum(-1), 1.0)).mean()
  elif loss_type == "bnpo":
    loss = summed / jnp.maximum(mask_NT.sum(), 1.0)
  elif loss_type == "dr_grpo":
    loss = summed / (N * cfg.max_completion_length)
  elif loss_type == "luspo":
    loss = (per_token * mask_NT).sum(-1).mean()
  else:  # dapo, cispo, vespo
    loss = summed / (jnp.maximum(mask_NT.sum(), 1.0) if num_items is None else num_items)

  if cfg.entropy_coef:
    metrics["policy_loss"] = jax.lax.stop_gradient(loss)
    bonus = (entropies_NT * live_NT).sum() / jnp.maximum(live_NT.sum(), 1.0)
    loss = loss - cfg.entropy_coef * bonus
    metrics["entropy_coef"] = jnp.float32(cfg.entropy_coef)
  if entropies_NT is not None:
    metrics["entropy"] = _mean(jax.lax.stop_gradient(entropies_NT), mask_NT)
  if loss_type in CLIPPED:
    low = ((ratio < 1 - cfg.epsilon_low) & (A_N1 < 0)).astype(jnp.float32)
    high = ((ratio > 1 + cfg.epsilon_high) & (A_N1 > 0)).astype(jnp.float32)
    metrics["clip_ratio/low_mean"] = _mean(low, mask_NT)
    metrics["clip_ratio/high_mean"] = _mean(high, mask_NT)
    metrics["clip_ratio/region_mean"] = _mean(jnp.maximum(low, high), mask_NT)
    metrics["clip_ratio/low_min"] = jnp.nanmin(_per_completion(low, mask_NT))
    metrics["clip_ratio/high_max"] = jnp.nanmax(_per_completion(high, mask_NT))
  elif loss_type == "cispo":
    clip = ((ratio > cfg.epsilon_high) & (A_N1 > 0)).astype(jnp.float32)
    metrics["cispo_clip_ratio"] = _mean(clip, mask_NT)
  elif loss_type == "vespo":
    metrics["vespo/phi_seq_mean"] = _mean(phi_N1, mask_NT)
  return loss, metrics


# --- RLOO -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RLOOConfig:
  """RLOO's hyperparameters, TRL 1.16 RLOOConfig's defaults. Field names are unique across the
  config sections, so TRL's `beta`, `epsilon`, `epsilon_high`, `num_generations`,
  `num_iterations`, `max_completion_length` and `mask_truncated_completions` are prefixed
  `rloo_` here (GRPO's section has them under TRL's names); `normalize_advantages` and
  `reward_clip_range` have TRL's. TRL's None is 0 (epsilon_high) or empty (reward_clip_range).
  The reward functions' weights are GRPO's `--reward_weights` (one flag for both).
  `rloo_advantages` reads beta, `normalize_advantages` and `reward_clip_range`; `rloo_loss` the
  epsilons; the online stage (dpo/algorithms/rloo.py) the rest."""
  rloo_beta: float = option(0.05, "RLOO: weight of the sequence KL(pi_old || pi_ref) (the summed "
                            "token log-ratio) subtracted from each completion's reward (TRL's "
                            "beta); 0 = no KL and no reference model.")
  rloo_epsilon: float = option(0.2, "RLOO: lower clip of the sequence importance ratio, 1 - "
                               "epsilon (TRL's epsilon).")
  rloo_epsilon_high: float = option(0.0, "RLOO: upper clip of the sequence importance ratio, 1 + "
                                    "epsilon_high (TRL's epsilon_high); 0 = rloo_epsilon (TRL's "
                                    "None).")
  normalize_advantages: bool = option(False, "RLOO: normalise the leave-one-out advantages over "
                                      "the generation batch, less their mean over their std + "
                                      "1e-4 (TRL's normalize_advantages).")
  reward_clip_range: tuple[float, ...] = option((), "RLOO: min,max the reward is clamped to "
                                                "before the KL penalty (TRL's "
                                                "reward_clip_range); empty = none (TRL's None).")
  rloo_num_generations: int = option(2, "RLOO: completions sampled per prompt, k (TRL's "
                                     "num_generations).")
  rloo_num_iterations: int = option(1, "RLOO: updates per generated batch (TRL's "
                                    "num_iterations); above 1 the importance ratio departs from "
                                    "1.")
  rloo_max_completion_length: int = option(512, "RLOO: completion tokens sampled at most (TRL's "
                                           "max_completion_length).")
  rloo_mask_truncated_completions: bool = option(False, "RLOO: leave completions that reach "
                                                 "rloo_max_completion_length without EOS out of "
                                                 "the loss (TRL's mask_truncated_completions).")

  def __post_init__(self):
    rules(self, rloo_beta=FINITE_NONNEG, rloo_epsilon=UNIT, rloo_epsilon_high=FINITE_NONNEG,
          reward_clip_range=(lambda v: len(v) in (0, 2) and all(math.isfinite(x) for x in v)
                             and (not v or v[0] <= v[1]), "empty or min,max with min <= max"),
          rloo_num_generations=at_least(2), rloo_num_iterations=at_least(1),
          rloo_max_completion_length=POS)

  @property
  def epsilon_low(self) -> float:
    return self.rloo_epsilon

  @property
  def epsilon_high(self) -> float:
    """The ratio's upper clip is 1 + epsilon_high (0 in the field = epsilon, as TRL's None)."""
    return self.rloo_epsilon_high or self.rloo_epsilon


def sequence_kl(old_logps_NT: jax.Array, ref_logps_NT: jax.Array, mask_NT: jax.Array) -> jax.Array:
  """[N] each completion's KL penalty of RLOO (Ahmadian et al. 2024, arXiv:2402.14740, the
  KL-shaped reward; TRL's): the summed token log-ratio of the sampling policy to the reference, k1 (it can be
  negative token by token, unlike GRPO's k3)."""
  return ((old_logps_NT - ref_logps_NT) * mask_NT).sum(-1)


def rloo_advantages(rewards_BG: jax.Array, kl_BG: jax.Array | None,
                    cfg: RLOOConfig) -> tuple[jax.Array, jax.Array]:
  """([B, G] advantages, frac_reward_zero_std) of k = G completions per prompt (Ahmadian et al.
  2024, "Back to Basics", arXiv:2402.14740, RLOO; TRL 1.16's
  `RLOOTrainer._generate_and_score_completions`): the weighted reward (NaN: unscorable), clamped to `reward_clip_range`, less rloo_beta times the
  sequence KL (`sequence_kl`; None without it), less the leave-one-out baseline, the mean of the
  other scorable completions of its prompt; normalised over the batch with
  `normalize_advantages`; NaN (unscorable, or a group with one scorable completion) -> 0.
  frac_reward_zero_std: the share of groups whose penalised rewards' std is 0 (TRL's)."""
  r_BG = rewards_BG
  if cfg.reward_clip_range:
    r_BG = jnp.clip(r_BG, *cfg.reward_clip_range)
  if cfg.rloo_beta:
    check(kl_BG is not None, f"--rloo_beta={cfg.rloo_beta}: rloo_advantages needs the KL")
    r_BG = r_BG - cfg.rloo_beta * kl_BG
  count_B1 = (~jnp.isnan(r_BG)).sum(1, keepdims=True)
  baseline_BG = (jnp.nansum(r_BG, 1, keepdims=True) - r_BG) / (count_B1 - 1)
  adv_BG = r_BG - baseline_BG
  if cfg.normalize_advantages:
    adv_BG = (adv_BG - jnp.nanmean(adv_BG)) / (_nanstd(adv_BG) + STD_EPS)
  frac = jnp.isclose(_nanstd(r_BG, axis=1), 0.0).mean()
  return jnp.nan_to_num(adv_BG, nan=0.0), frac


def rloo_loss(logps_NT: jax.Array, old_logps_N: jax.Array, advantages_N: jax.Array,
              mask_NT: jax.Array, cfg: RLOOConfig, *,
              entropies_NT: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """(scalar loss, metrics) of RLOO, TRL 1.16's `RLOOTrainer._compute_loss`: PPO's clipped
  surrogate on the sequence importance ratio r = exp(log pi(y) - log pi_old(y)) (summed token
  log-probs), -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), the mean over completions; the
  KL is in the advantage (`rloo_advantages`), not here.

  logps_NT: per-token log-probs (nats) of the N completions under the policy being trained;
  old_logps_N: each completion's summed log-prob under the policy that sampled it; mask_NT: 1
  on completion tokens. Metrics, TRL's names: clip_ratio/{low,high,region}_mean (over
  completions, as (sum, count) pairs), clip_ratio/low_min and /high_max, and entropy (the
  policy's mean token entropy, `token_entropy`) when entropies_NT is given."""
  mask_NT = mask_NT.astype(jnp.float32)
  A_N = advantages_N.astype(jnp.float32)
  ratio_N = jnp.exp((logps_NT * mask_NT).sum(-1) - jax.lax.stop_gradient(old_logps_N))
  clipped_N = jnp.clip(ratio_N, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
  loss = -jnp.minimum(ratio_N * A_N, clipped_N * A_N).mean()
  low_N1 = ((ratio_N < 1 - cfg.epsilon_low) & (A_N < 0)).astype(jnp.float32)[:, None]
  high_N1 = ((ratio_N > 1 + cfg.epsilon_high) & (A_N > 0)).astype(jnp.float32)[:, None]
  metrics = {"clip_ratio/low_mean": _mean(low_N1, mask_NT),
             "clip_ratio/high_mean": _mean(high_N1, mask_NT),
             "clip_ratio/region_mean": _mean(jnp.maximum(low_N1, high_N1), mask_NT),
             "clip_ratio/low_min": low_N1.min(), "clip_ratio/high_max": high_N1.max()}
  if entropies_NT is not None:
    metrics["entropy"] = _mean(jax.lax.stop_gradient(entropies_NT), mask_NT)
  return loss, metrics


# --- PPO with a learned value model ----------------------------------------------------------

KL_METHODS = ("kl", "mse_kl", "low_var_kl")
VALUE_MODELS = ("separate", "head")
WHITEN_EPS = 1e-8  # Tunix's masked_whiten: (x - mean) * rsqrt(var + 1e-8)


@dataclass(frozen=True)
class PPOConfig:
  """PPO's hyperparameters (Schulman et al. 2017, arXiv:1707.06347; GAE, Schulman et al. 2016,
  arXiv:1506.02438), Tunix 0.1.7's `PPOConfig` defaults (tunix/rl/ppo/ppo_learner.py). Field
  names are unique across the config sections, so Tunix's `beta`, `epsilon`, `epsilon_high`,
  `epsilon_c`, `entropy_coef`, `kl_method` and `kl_clamp_value` are prefixed `ppo_` here; its
  None is 0 (epsilon_high: = epsilon; epsilon_c, entropy_coef, kl_clamp: off)."""
  ppo_beta: float = option(0.04, "PPO: weight of the token KL(pi_old || pi_ref) estimate "
                           "subtracted from each completion token's reward (Tunix's beta); 0 = "
                           "no KL and no reference model.")
  ppo_kl_method: str = option("low_var_kl", "PPO: the token KL estimate in the reward: kl (log "
                              "pi_old - log pi_ref), mse_kl (half its square), low_var_kl "
                              "(Schulman's k3) (Tunix's kl_method).")
  ppo_kl_clamp: float = option(0.0, "PPO: clip each token's KL estimate to +-this (Tunix's "
                               "kl_clamp_value); 0 = no clip.")
  gamma: float = option(1.0, "PPO: GAE's discount over completion tokens (Tunix's gamma).")
  gae_lambda: float = option(0.95, "PPO: GAE's lambda (Tunix's gae_lambda).")
  ppo_epsilon: float = option(0.2, "PPO: lower clip of the token importance ratio, 1 - epsilon "
                              "(Tunix's epsilon / epsilon_low).")
  ppo_epsilon_high: float = option(0.0, "PPO: upper clip of the token importance ratio, 1 + "
                                   "epsilon_high (Tunix's epsilon_high); 0 = ppo_epsilon.")
  ppo_epsilon_c: float = option(0.0, "PPO: dual clip: a negative-advantage token's loss is at "
                                "most -epsilon_c A (Ye et al. 2020, arXiv:1912.09729; Tunix's "
                                "epsilon_c, > 1); 0 = off.")
  ppo_entropy_coef: float = option(0.0, "PPO: weight of the policy's mean token entropy "
                                   "subtracted from the policy loss (Tunix's entropy_coef); 0 = "
                                   "off.")
  clip_range_value: float = option(0.2, "PPO: the new value is clipped to within this of the "
                                   "value at sampling, and the larger squared error kept "
                                   "(Tunix's clip_range_value).")
  ppo_steps: int = option(200, "PPO optimizer steps (stage ppo); a batch of samples, one "
                          "completion for each of --global_batch_size prompts, is drawn every "
                          "--ppo_num_iterations of them.")
  ppo_num_iterations: int = option(1, "PPO: updates per generated batch (Tunix's "
                                   "num_iterations); above 1 the importance ratio departs from 1.")
  ppo_max_completion_length: int = option(512, "PPO: completion tokens sampled at most.")
  ppo_value_model: str = option("separate", "PPO: the value model: separate (its own LoRA "
                                "factors on the frozen base, or its own copy of the weights "
                                "without LoRA, and a head; its own optimizer, as Tunix's critic) "
                                "or head (a head on the policy's final hidden states, the value "
                                "loss weighted by ppo_vf_coef in the policy's update).")
  ppo_value_learning_rate: float = option(0.0, "PPO: peak learning rate of the value model's "
                                          "AdamW (the policy's schedule); 0 = --learning_rate.")
  ppo_vf_coef: float = option(0.1, "PPO: weight of the value loss beside the policy loss with "
                              "ppo_value_model=head (a shared trunk; the PPO paper's c1); a "
                              "separate value model has its own optimizer and no weight.")

  def __post_init__(self):
    rules(self, ppo_beta=FINITE_NONNEG, ppo_kl_method=one_of(KL_METHODS),
          ppo_kl_clamp=FINITE_NONNEG, gamma=(lambda v: 0 <= v <= 1, "in [0, 1]"),
          gae_lambda=(lambda v: 0 <= v <= 1, "in [0, 1]"), ppo_epsilon=UNIT,
          ppo_epsilon_high=FINITE_NONNEG,
          ppo_epsilon_c=(lambda v: v == 0 or 1 < v < float("inf"), "0 (off) or a finite number "
                         "> 1"),
          ppo_entropy_coef=FINITE_NONNEG, clip_range_value=FINITE_POS,
          ppo_steps=at_least(0), ppo_num_iterations=at_least(1), ppo_max_completion_length=POS,
          ppo_value_model=one_of(VALUE_MODELS), ppo_value_learning_rate=FINITE_NONNEG,
          ppo_vf_coef=FINITE_POS)

  @property
  def epsilon_low(self) -> float:
    return self.ppo_epsilon

  @property
  def epsilon_high(self) -> float:
    """The ratio's upper clip is 1 + epsilon_high (0 in the field = epsilon, as Tunix's None)."""
    return self.ppo_epsilon_high or self.ppo_epsilon


def token_kl(logps_NT: jax.Array, ref_logps_NT: jax.Array, method: str,
             clamp: float = 0.0) -> jax.Array:
  """[N, T] a token KL estimate of the policy from the reference (Tunix's
  `common.compute_kl_divergence`): kl = log p - log p_ref, mse_kl = half its square, low_var_kl
  = exp(-d) + d - 1 with d = log p - log p_ref (k3, never negative); clipped to +-clamp if > 0."""
  d = logps_NT.astype(jnp.float32) - ref_logps_NT.astype(jnp.float32)
  kl = {"kl": lambda: d, "mse_kl": lambda: 0.5 * d * d,
        "low_var_kl": lambda: jnp.exp(-d) + d - 1.0}[method]()
  return jnp.clip(kl, -clamp, clamp) if clamp else kl


def token_rewards(scores_N: jax.Array, old_logps_NT: jax.Array, ref_logps_NT: jax.Array | None,
                  mask_NT: jax.Array, cfg: PPOConfig) -> tuple[jax.Array, jax.Array | None]:
  """([N, T] token rewards, [N, T] token KL or None): each completion's score on its last
  completion token, less ppo_beta times the token KL(pi_old || pi_ref) (`token_kl`) on every
  completion token (Tunix's `PPOLearner._generate_and_compute_advantage`; there the rewards array
  takes the completion ids' integer dtype, so a score's fraction is dropped before the KL is
  subtracted: here scores stay float). A completion with no token gets nothing."""
  mask_NT = mask_NT.astype(jnp.float32)
  T = mask_NT.shape[1]
  last_N = jnp.max(jnp.where(mask_NT > 0, jnp.arange(T), -1), axis=1)
  rewards_NT = jnp.where(jnp.arange(T) == last_N[:, None], scores_N[:, None].astype(jnp.float32),
                         0.0)
  kl_NT = None
  if cfg.ppo_beta:
    check(ref_logps_NT is not None, f"--ppo_beta={cfg.ppo_beta}: token_rewards needs the "
          f"reference's log-probs")
    kl_NT = token_kl(old_logps_NT, ref_logps_NT, cfg.ppo_kl_method, cfg.ppo_kl_clamp) * mask_NT
    rewards_NT = rewards_NT - cfg.ppo_beta * kl_NT
  return rewards_NT, kl_NT


def masked_whiten(x_NT: jax.Array, mask_NT: jax.Array) -> jax.Array:
  """x less its mean over the masked tokens, over their standard deviation (Bessel-corrected) +
  1e-8 under the root (Tunix's `masked_whiten`); one mean and deviation for the whole batch."""
  m = mask_NT.astype(jnp.float32)
  n = m.sum()
  mean = (x_NT * m).sum() / (n + WHITEN_EPS)
  var = (jnp.square(x_NT - mean) * m).sum() / (n + WHITEN_EPS) * n / (n - 1)
  return (x_NT - mean) * jax.lax.rsqrt(var + WHITEN_EPS)


def gae_advantages(rewards_NT: jax.Array, values_NT: jax.Array, mask_NT: jax.Array,
                   gamma: float, lam: float) -> tuple[jax.Array, jax.Array]:
  """([N, T] advantages, [N, T] returns) by generalised advantage estimation (Schulman et al.
  2016, arXiv:1506.02438, eq. 16; Tunix's `compute_gae_advantages`): backwards over the tokens,
  delta_t = r_t + gamma V_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1}, a masked token
  carrying the next token's V and A over it; returns = A + V before the advantages are whitened
  over the batch's completion tokens (`masked_whiten`). Read both at completion tokens only."""
  m = mask_NT.astype(jnp.float32)

  def back(carry, xs):
    a_next, v_next = carry
    r, v, mt = xs
    a = r + gamma * v_next - v + gamma * lam * a_next
    a = a * mt + (1 - mt) * a_next
    v_next = v * mt + (1 - mt) * v_next
    return (a, v_next), a

  N = rewards_NT.shape[0]
  zeros = jnp.zeros((N,), jnp.float32)
  _, a_TN = jax.lax.scan(back, (zeros, zeros),
                         (rewards_NT.T.astype(jnp.float32), values_NT.T.astype(jnp.float32), m.T),
                         reverse=True)
  advantages_NT = a_TN.T
  returns_NT = advantages_NT + values_NT
  return masked_whiten(advantages_NT, m), returns_NT


def ppo_policy_loss(logps_NT: jax.Array, old_logps_NT: jax.Array, advantages_NT: jax.Array,
                    mask_NT: jax.Array, cfg: PPOConfig, *, num_items: jax.Array | float,
                    entropies_NT: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """(scalar loss, metrics) of PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7;
  Tunix's `ppo_policy_loss_fn`): r = exp(log pi - log pi_old), L = max(-r A, -clip(r, 1 - eps_low,
  1 + eps_high) A), with a dual clip min(L, -epsilon_c A) where A < 0; the token mean, its sum
  over `num_items` (the whole accumulated batch's completion tokens over the microbatches, so
  the loss does not depend on the split); less ppo_entropy_coef times the mean token entropy.
  Metrics, Tunix's names: pg_clipfrac (tokens where the clipped term is larger), pg_clipfrac_lower
  (negative-advantage tokens the dual clip bounds), entropy (`entropies_NT` given)."""
  m = mask_NT.astype(jnp.float32)
  A = advantages_NT.astype(jnp.float32)
  ratio = jnp.exp(logps_NT - jax.lax.stop_gradient(old_logps_NT))
  unclipped = -ratio * A
  clipped = -jnp.clip(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * A
  per_token = jnp.maximum(unclipped, clipped)
  metrics = {"pg_clipfrac": _mean((clipped > unclipped).astype(jnp.float32), m)}
  if cfg.ppo_epsilon_c:
    dual = -cfg.ppo_epsilon_c * A
    metrics["pg_clipfrac_lower"] = _mean(((per_token > dual) & (A < 0)).astype(jnp.float32), m)
    per_token = jnp.where(A < 0, jnp.minimum(dual, per_token), per_token)
  loss = (per_token * m).sum() / num_items
  if entropies_NT is not None:
    metrics["entropy"] = _mean(jax.lax.stop_gradient(entropies_NT), m)
    if cfg.ppo_entropy_coef:
      loss = loss - cfg.ppo_entropy_coef * (entropies_NT * m).sum() / num_items
  return loss, metrics


def ppo_value_loss(values_NT: jax.Array, old_values_NT: jax.Array, returns_NT: jax.Array,
                   mask_NT: jax.Array, clip_range_value: float, *,
                   num_items: jax.Array | float) -> tuple[jax.Array, dict]:
  """(scalar loss, metrics) of PPO's clipped value loss (Tunix's `ppo_value_loss_fn`): the new
  value clipped to old +- clip_range_value, half the larger of the two squared errors to the
  return, the token mean (over `num_items`, as `ppo_policy_loss`). Metrics, Tunix's names:
  vf_loss, vpred_mean, vf_clipfrac (tokens where the clipped error is larger), return_mean."""
  m = mask_NT.astype(jnp.float32)
  clipped = jnp.clip(values_NT, old_values_NT - clip_range_value, old_values_NT + clip_range_value)
  err, err_clipped = jnp.square(values_NT - returns_NT), jnp.square(clipped - returns_NT)
  total = 0.5 * (jnp.maximum(err, err_clipped) * m).sum()
  loss = total / num_items
  metrics = {"vf_loss": (jax.lax.stop_gradient(total), m.sum()),
             "vpred_mean": _mean(jax.lax.stop_gradient(values_NT), m),
             "vf_clipfrac": _mean((err_clipped > err).astype(jnp.float32), m),
             "return_mean": _mean(returns_NT, m)}
  return loss, metrics

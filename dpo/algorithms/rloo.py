"""RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740; TRL 1.16's `RLOOTrainer`):
every `rloo_num_iterations` steps, k = --rloo_num_generations completions are sampled for each of
global_batch_size / k training prompts from the current policy, the judge (dpo/judges.py) scores
them, --rloo_beta times each completion's sequence KL(pi_old || pi_ref) (its summed token
log-ratio, k1, as TRL's) is subtracted from its reward, and its advantage is that reward less
the mean of the other k - 1 completions of its prompt (the leave-one-out baseline; over the
batch normalised with --normalize_advantages); each step then updates the policy with PPO's
clipped surrogate on the sequence importance ratio, the mean over completions
(`policy_gradient.rloo_loss`). The KL is in the reward, not in the loss.

Everything else is GRPO's stage (dpo/algorithms/grpo.py, whose `Generated` this subclasses):
online DPO's sampler on the training mesh, the samples, their old and reference log-probs
computed once per generation batch, checkpoints between generation batches (--checkpoint_every
and --rloo_steps must be multiples of --rloo_num_iterations), the sampling key of a batch
fold_in(key, its first step), so a run killed mid-generation resumes to what the uninterrupted
one drew; reward functions as GRPO's (None is NaN: left out of the baseline, advantage 0, as
TRL's; several weighted by --reward_weights).

Logged per step, TRL's names: reward, reward_std (the weighted reward, before the KL penalty),
frac_reward_zero_std (groups whose penalised rewards tie), rewards/<function>/mean and /std
(several --reward_fn functions), completions/mean_length, completions/clipped_ratio, kl (the
token mean of log pi_old - log pi_ref, with --rloo_beta > 0), entropy, clip_ratio/*, and the
time split.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpo import batches, identity, judges, logprobs, registry, train
from dpo import policy_gradient as pg
from dpo.algorithms import dpo, grpo


class RLOOBatch(NamedTuple):
  """One step's rows: prompt + completion [N, T] (the loss mask on completion tokens), each
  completion's advantage [N] and its summed log-prob [N] under the policy that sampled it."""
  rows: batches.Rows
  advantages: np.ndarray
  old_logps: np.ndarray


def rloo_step(spec: train.StepConfig, state: train.TrainState, frozen,
              batch: RLOOBatch) -> tuple[train.TrainState, dict]:
  """One RLOO update on a generation batch's rows (gradient accumulation as train.accumulate
  does: the mean over each microbatch's completions, averaged); the policy's token entropies
  from its logits, logged as TRL's."""
  def loss_fn(trainable, micro):
    params, adapter = grpo.policy_weights(spec, frozen, trainable)
    s = logprobs.score(spec.model, params, micro.rows, adapter, with_logits=True,
                       temperature=spec.temperature)
    entropies = jax.lax.stop_gradient(pg.token_entropy(s.logits))
    loss, metrics = pg.rloo_loss(s.logps, micro.old_logps, micro.advantages, s.mask, spec.own,
                                 entropies_NT=entropies)
    return train.with_router_loss(spec.model, loss, metrics, s.router)

  def grad_fn(trainable, micro, i):
    del i
    return jax.value_and_grad(loss_fn, has_aux=True)(trainable, micro)

  (loss, metrics), grads = train.accumulate(grad_fn, state.params, batch,
                                            spec.optim.gradient_accumulation_steps)
  return train.apply_update(state, *spec.optimizer(), loss, grads, metrics)


@dataclasses.dataclass
class Generated(grpo.Generated):
  """Program.stage's `online` for RLOO: GRPO's generation batches, RLOO's advantages."""
  salt = 8
  dynamic_sampling = False  # GRPO's alone

  @staticmethod
  def completion_length(cfg) -> int:
    return cfg.rloo.rloo_max_completion_length

  @property
  def generations(self) -> int:
    return self.cfg.rloo.rloo_num_generations

  @property
  def repeat(self) -> int:
    return self.cfg.rloo.rloo_num_iterations

  def generation(self, state, frozen, batch, comps, score, spec, scored=None):
    """(the RLOOBatch of a generation batch, its logged figures): rewards, rows, old and
    reference log-probs, the KL-penalised rewards' leave-one-out advantages."""
    G, c = self.generations, self.cfg
    B = len(batch["tokens"])
    rewards_NF, ended, info = scored or self.rewarded(batch, comps)
    rewards = np.asarray(pg.weighted_rewards(rewards_NF.astype(np.float32), c.grpo.reward_weights),
                         np.float64)
    rows, old, ref = self.scored_rows(state, frozen, (batch, comps, ended), score, spec,
                                      c.rloo.rloo_mask_truncated_completions,
                                      c.rloo.rloo_beta > 0)
    mask = rows.loss_mask
    to_BG = lambda x_N: jnp.asarray(x_N, jnp.float32).reshape(G, B).T  # row b: prompt b's k
    kl_BG = None
    if c.rloo.rloo_beta > 0:
      kl_BG = to_BG(pg.sequence_kl(old, ref, mask))
      info["kl"] = float(((old - ref) * mask).sum() / max(mask.sum(), 1.0))
    adv_BG, frac_zero_std = pg.rloo_advantages(to_BG(rewards), kl_BG, c.rloo)
    info = {**info, **grpo.figures(rewards, comps, ended),
            "frac_reward_zero_std": float(frac_zero_std)}
    advantages = np.asarray(adv_BG).T.reshape(-1).astype(np.float32)  # back to the rows' layout
    return RLOOBatch(rows, advantages, (old * mask).sum(-1).astype(np.float32)), info


def run(p, model: registry.Model) -> registry.Model:
  """The RLOO stage: the KL guard watches the KL the step logs with --rloo_beta > 0."""
  estimate = "kl" if p.cfg.rloo.rloo_beta > 0 else None
  online = lambda p_, judge, base: grpo.generated(p_, judge, base, Generated)
  return dpo.preference_stage(p, model, RLOO, online, estimate)


def step_config(cfg) -> train.StepConfig:
  return dataclasses.replace(train.StepConfig.dpo(cfg), total_steps=cfg.online.rloo_steps,
                             loss=None, kl=False, own=cfg.rloo,
                             temperature=grpo.temperature(cfg))


def check_config(cfg) -> None:
  """Groups and iterations; of the grpo section the stage reads only --reward_weights."""
  grpo.check_groups(cfg, RLOO.name, "rloo_", cfg.rloo, "k")
  grpo.check_weights_only(cfg, RLOO.name)


RLOO = registry.register(registry.Algorithm(
    name="rloo", step=rloo_step, batch=lambda host: host, step_config=step_config, run=run,
    hyperparameters=lambda cfg: {**identity.sections(cfg, ("lora", "optim", "reference", "online",
                                                          "rloo")),
                                 "judge": judges.fingerprint(cfg)},
    data_files=("train_data", "tokenizer"), data_seed=8, steps_flag="--rloo_steps",
    sections=(("rloo", pg.RLOOConfig),), reads=("online", "grpo"), check=check_config,
    samples=True, completion_length=Generated.completion_length, judged=True, abstain=True))

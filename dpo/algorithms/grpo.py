"""GRPO (Shao et al. 2024; TRL's `GRPOTrainer`): every `num_iterations` steps, G completions are
sampled for each of global_batch_size / G training prompts from the current policy, the judge
(dpo/judges.py) scores them, and each completion's advantage is its reward less its group's mean
(scaled as --scale_rewards says; or each reward function's normalised first,
--multi_objective_aggregation); each step then updates the policy with the objective of
dpo/policy_gradient.py (--grpo_loss_type: the clipped ratio's aggregations grpo, dr_grpo, dapo,
bnpo, luspo, and cispo, sapo, vespo; the k3 KL to the frozen reference weighted by --grpo_beta;
--entropy_coef, --off_policy_mask_threshold). A reward function may return None for a
completion (NaN: left out of its group's statistics, advantage 0 when no function scored it, as
TRL's).

Samples, their old log-probs (the policy that drew them) and the reference's are computed once
per generation batch and reused for its `num_iterations` updates, as TRL does; checkpoints fall
between generation batches (--checkpoint_every and --grpo_steps must be multiples of
--num_iterations), so no batch of samples outlives a checkpoint and a resumed run draws what the
uninterrupted one drew (the sampling key of a batch is fold_in(key, its first step)). Sampling is
online DPO's (dpo/algorithms/online_dpo.py): jitted on the training mesh, no weight copy, fixed
shapes. Every log-prob (the step's, the old policy's, the reference's) and entropy is of the logits
divided by the sampler's temperature (--online_temperature), as TRL scores its samples (RLOO
too). LoRA dropout is off in the GRPO step, so the importance ratio of the first update of a
batch is exactly 1. Several processes as online DPO: each samples, scores and judges the whole
generation batch alike (the log-probs gathered to every process) and trains on its own block.
With --dynamic_sampling (DAPO's) a generation batch keeps only groups whose rewards differ,
drawing more prompts until it is full (`Generated.dynamic`); DAPO's overlong filtering is
--mask_truncated_completions.

Logged per step, TRL's names: reward, reward_std, frac_reward_zero_std, rewards/<function>/mean
and /std (several --reward_fn functions, summed with --reward_weights), completions/mean_length,
completions/clipped_ratio, kl, entropy, clip_ratio/* (cispo_clip_ratio, vespo/phi_seq_mean
with those loss types), policy_loss and entropy_coef (with --entropy_coef), and the time split
(time/sample_s, time/judge_s, time/train_s); with --dynamic_sampling also
dynamic_sampling/generation_batches, /signal_fraction (of the groups drawn) and /unfilled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dpo import batches, identity, judges, logprobs, registry, train
from dpo import policy_gradient as pg
from dpo.algorithms import dpo, online_dpo
from models import sharding, transformer
from models.config import check, shown


class GRPOBatch(NamedTuple):
  """One step's rows: prompt + completion [N, T] (the loss mask on completion tokens), each
  completion's advantage [N], and the per-token log-probs [N, T] of the policy that sampled it
  and of the reference (None without the KL term)."""
  rows: batches.Rows
  advantages: np.ndarray
  old_logps: np.ndarray
  ref_logps: np.ndarray | None = None


def policy_weights(spec: train.StepConfig, frozen, trainable):
  """(params, adapter) of the policy: the base with the LoRA factors, or every weight."""
  if spec.lora.enabled:
    return frozen.params, transformer.Adapter(trainable, spec.lora.scale)
  return trainable, None


def grpo_step(spec: train.StepConfig, state: train.TrainState, frozen,
              batch: GRPOBatch) -> tuple[train.TrainState, dict]:
  """One GRPO update on a generation batch's rows (gradient accumulation as train.accumulate
  does: the normaliser of dapo, cispo and vespo is the whole batch's token count / K); the
  policy's token entropies from its logits, as TRL's."""
  k = spec.optim.gradient_accumulation_steps
  num_items = batch.rows.loss_mask.sum() / k

  def loss_fn(trainable, micro):
    params, adapter = policy_weights(spec, frozen, trainable)
    s = logprobs.score(spec.model, params, micro.rows, adapter, with_logits=True,
                       temperature=spec.temperature)
    entropies = pg.token_entropy(s.logits)  # TRL's: logged, and read by the entropy options
    if not spec.own.entropy_coef:
      entropies = jax.lax.stop_gradient(entropies)
    loss, metrics = pg.grpo_loss(s.logps, micro.old_logps, micro.ref_logps, micro.advantages,
                                 s.mask, spec.own, num_items=num_items, entropies_NT=entropies)
    return train.with_router_loss(spec.model, loss, metrics, s.router)

  def grad_fn(trainable, micro, i):
    del i
    return jax.value_and_grad(loss_fn, has_aux=True)(trainable, micro)

  (loss, metrics), grads = train.accumulate(grad_fn, state.params, batch, k)
  return train.apply_update(state, *spec.optimizer(), loss, grads, metrics)


def _token_logps(model, temperature, params, rows, adapter=None):
  return logprobs.score(model, params, rows, adapter, temperature=temperature).logps


def temperature(cfg) -> float:
  """The temperature GRPO's and RLOO's log-probs are taken at: the sampler's
  (--online_temperature), as TRL scores its samples; 1 for greedy samples (0)."""
  return cfg.online.online_temperature or 1.0


@dataclasses.dataclass
class Generated(online_dpo.Sampled):
  """Program.stage's `online` for GRPO: a generation batch every num_iterations steps."""
  buffer: GRPOBatch | None = None
  info: dict | None = None
  table: dict | None = None  # the prompt table (more prompts for --dynamic_sampling)
  salt = 6  # the sampling key's: fold_in(seed, salt), then the generation batch's first step

  @staticmethod
  def completion_length(cfg) -> int:
    return cfg.grpo.max_completion_length

  @property
  def generations(self) -> int:
    return self.cfg.grpo.num_generations

  @property
  def repeat(self) -> int:
    return self.cfg.grpo.num_iterations

  @property
  def dynamic_sampling(self) -> bool:
    """--dynamic_sampling: GRPO's alone (RLOO's and PPO's stages read only the section's
    reward weights)."""
    return self.cfg.grpo.dynamic_sampling

  @property
  def prompts_per_step(self) -> int:
    return self.cfg.optim.global_batch_size // self.generations

  def __call__(self, spec, update):
    key = jax.random.fold_in(jax.random.key(self.cfg.run.seed), self.salt)
    G, K = self.generations, self.repeat
    score = jax.jit(functools.partial(_token_logps, self.cfg.model, spec.temperature))

    def dispatch(state, frozen, batch):
      step = int(state.step)
      times = {"time/sample_s": 0.0, "time/judge_s": 0.0}
      if step % K == 0 or self.buffer is None:
        t0 = time.perf_counter()
        comps = self.sample(state, batch, jax.random.fold_in(key, step), G)
        t1 = time.perf_counter()
        scored, more, more_s = None, {}, 0.0  # more_s: --dynamic_sampling's further draws
        if self.dynamic_sampling:
          batch, comps, scored, more, more_s = self.dynamic(state, batch, comps,
                                                            jax.random.fold_in(key, step), step)
        self.buffer, self.info = self.generation(state, frozen, batch, comps, score, spec, scored)
        self.info = {**self.info, **more}
        times = {"time/sample_s": round(t1 - t0 + more_s, 3),
                 "time/judge_s": round(time.perf_counter() - t1 - more_s, 3)}
      t2 = time.perf_counter()
      state, metrics = update(state, frozen, train.process_block(self.mesh, self.buffer))
      jax.block_until_ready(state)
      return state, {**metrics, **self.info, **times,
                     "time/train_s": round(time.perf_counter() - t2, 3)}
    return dispatch

  def generation(self, state, frozen, batch, comps, score, spec, scored=None):
    """(the GRPOBatch of a generation batch, its logged figures): rewards (`scored`, the
    `rewarded` of these completions when already judged), advantages, rows, old and reference
    log-probs."""
    G, c = self.generations, self.cfg
    B = len(batch["tokens"])
    rewards_NF, ended, info = scored or self.rewarded(batch, comps)
    rewards = np.asarray(pg.weighted_rewards(rewards_NF.astype(np.float32), c.grpo.reward_weights),
                         np.float64)  # TRL logs the weighted sum, whatever the aggregation
    r_BGF = jnp.asarray(rewards_NF.reshape(G, B, -1).transpose(1, 0, 2), jnp.float32)
    adv_BG, frac_zero_std = pg.advantages(r_BGF, c.grpo)  # row b: prompt b's G completions
    adv_BG = np.asarray(adv_BG)
    rows, old, ref = self.scored_rows(state, frozen, (batch, comps, ended), score, spec,
                                      c.grpo.mask_truncated_completions, c.grpo.grpo_beta > 0)
    info = {**info, **figures(rewards, comps, ended),
            "frac_reward_zero_std": float(frac_zero_std)}
    flat = lambda a_BG: a_BG.T.reshape(-1)  # back to the rows' layout
    return GRPOBatch(rows, flat(adv_BG).astype(np.float32), old, ref), info

  def scored_rows(self, state, frozen, sampled, score, spec, mask_truncated: bool,
                  with_ref: bool):
    """(Rows of prompt + completion, per-token log-probs [N, T] of the policy that sampled them,
    of the reference or None) of `sampled`, (batch, completions, ended); with `mask_truncated` a
    completion that did not end leaves the loss mask."""
    batch, comps, ended = sampled
    G = len(comps) // len(batch["tokens"])
    prompts = [row[seg != 0] for row, seg in zip(batch["tokens"], batch["segment_ids"])] * G
    rows = online_dpo.data_lib.pack_rows([(list(p), list(x)) for p, x in zip(prompts, comps)],
                                          self.seq_len, self.tok.pad_id)
    if mask_truncated:
      rows["loss_mask"] = rows["loss_mask"] * ended[:, None].astype(np.float32)
    rows = batches.Rows.of(rows)
    device_rows = train.device_batch(self.mesh, rows, len(rows.tokens))  # the whole batch
    params, adapter = policy_weights(spec, frozen, state.params)
    old = sharding.to_host(score(params, device_rows, adapter))
    ref = None
    if with_ref:
      ref_params = frozen.params if frozen.ref_params is None else frozen.ref_params
      ref = sharding.to_host(score(ref_params, device_rows))
    return rows, old, ref

  def dynamic(self, state, batch, comps, key, step: int):
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, §3.2): (the batch of B
    prompts whose G completions' rewards do not all agree, their completions, their `rewarded`,
    the logged figures, the seconds its further draws sampled). The groups of `batch` with
    signal are kept; while fewer than B, B more prompts are drawn from the prompt table (the same rows on every process and on a resume: a
    generator seeded by the run's seed, the step and the draw) and sampled with
    fold_in(key, draw), at most --dynamic_sampling_max_batches generation batches in all. A
    batch still short is filled with groups without signal (advantage 0), counted in
    `dynamic_sampling/unfilled` and logged. With several processes the first one's decision of
    which groups have signal is every process's (a reward function that timed out on one alone
    must not make them draw different numbers of batches)."""
    G, c = self.generations, self.cfg.grpo
    B = len(batch["tokens"])
    groups = []  # (has signal, prompt row, its G completions, rewards [G, F], ended [G])

    def add(prompts, samples, scored):
      rewards_NF, ended, _ = scored
      n = len(prompts["tokens"])
      r_nGF = rewards_NF.reshape(G, n, -1).transpose(1, 0, 2)
      signal = np.asarray(pg.has_signal(r_nGF, c.reward_weights, c.multi_objective_aggregation))
      if jax.process_count() > 1:  # one decision for all: each draw is a collective sampling
        signal = np.asarray(multihost_utils.broadcast_one_to_all(signal))
      ended_nG = ended.reshape(G, n).T
      for i in range(n):
        groups.append((bool(signal[i]), {k: v[i] for k, v in prompts.items()},
                       [samples[g * n + i] for g in range(G)], r_nGF[i], ended_nG[i]))

    add(batch, comps, self.rewarded(batch, comps))
    draws, sample_s = 1, 0.0
    while sum(g[0] for g in groups) < B and draws < c.dynamic_sampling_max_batches:
      rng = np.random.default_rng([self.cfg.run.seed, step, draws])
      rows = rng.choice(len(self.table["tokens"]), B, replace=len(self.table["tokens"]) < B)
      more = {k: np.asarray(v)[rows] for k, v in self.table.items() if k in batch}
      t0 = time.perf_counter()
      samples = self.sample(state, more, jax.random.fold_in(key, draws), G)
      sample_s += time.perf_counter() - t0
      add(more, samples, self.rewarded(more, samples))
      draws += 1
    kept = [g for g in groups if g[0]][:B]
    unfilled = B - len(kept)
    kept += [g for g in groups if not g[0]][:unfilled]
    if unfilled:
      logging.warning("--dynamic_sampling: step %d kept %d of %d groups with signal after %d "
                      "generation batches (--dynamic_sampling_max_batches); %d filled with "
                      "groups whose rewards all agree", step, B - unfilled, B, draws, unfilled)
    chosen = {k: np.stack([g[1][k] for g in kept]) for k in batch}
    samples = [g[2][j] for j in range(G) for g in kept]  # [sample j of every prompt, ...]
    rewards_NF = np.concatenate([np.stack([g[3][j] for g in kept]) for j in range(G)])
    ended = np.concatenate([np.array([g[4][j] for g in kept]) for j in range(G)])
    figures_ = {"dynamic_sampling/generation_batches": draws,
                "dynamic_sampling/signal_fraction": sum(g[0] for g in groups) / len(groups),
                "dynamic_sampling/unfilled": unfilled}
    return (chosen, samples, (rewards_NF, ended, function_figures(self.judge, rewards_NF)),
            figures_, sample_s)

  def rewarded(self, batch, comps) -> tuple[np.ndarray, np.ndarray, dict]:
    """(each reward function's rewards of the completions [N, F] (F = 1 for one function or a
    reward model), ended, logged figures): NaN where a function returned None (TRL's: one
    function or several), and with several functions each one's rewards/<name>/mean and /std
    (TRL's)."""
    if isinstance(self.judge, judges.FunctionJudge):
      rewards, ended = self.scored(batch, comps,
                                   functools.partial(self.judge.score, allow_none=True))
      return rewards[:, None], ended, {}
    if not isinstance(self.judge, judges.RewardFunctions):
      rewards, ended = self.scored(batch, comps)
      return rewards[:, None], ended, {}
    rewards_NF, ended = self.scored(batch, comps, self.judge.each)
    return rewards_NF, ended, function_figures(self.judge, rewards_NF)


def function_figures(judge, rewards_NF: np.ndarray) -> dict:
  """Several reward functions (`judge` RewardFunctions): each one's rewards/<name>/mean and
  /std of [N, F] rewards (TRL's); else none."""
  if not isinstance(judge, judges.RewardFunctions):
    return {}
  info = {}
  for name, r_N in zip(judge.names, rewards_NF.T):
    info[f"rewards/{name}/mean"] = _nanmean(r_N)
    info[f"rewards/{name}/std"] = _nanstd(r_N)
  return info


def figures(rewards: np.ndarray, comps, ended: np.ndarray) -> dict:
  """TRL's logged reward and length figures of a generation batch: reward, reward_std (over the
  scorable completions), completions/mean_length, completions/clipped_ratio."""
  lengths = np.array([len(x) for x in comps], np.float64)
  return {"reward": _nanmean(rewards), "reward_std": _nanstd(rewards),
          "completions/mean_length": float(lengths.mean()),
          "completions/clipped_ratio": float(1.0 - ended.mean())}


def _nanstd(x: np.ndarray) -> float:
  """TRL's nanstd: Bessel-corrected over the non-NaN values; NaN for fewer than two."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    return float(np.nanstd(x, ddof=1))


def _nanmean(x: np.ndarray) -> float:
  """torch.nanmean: the mean of the non-NaN values; NaN for none."""
  return float(np.mean(x[~np.isnan(x)])) if (~np.isnan(x)).any() else float("nan")


def generated(p, judge, base, kind: type[Generated] | None = None):
  """dpo.preference_stage's `online` for GRPO (`kind` Generated) or another stage that samples
  generation batches so (RLOO's subclass)."""
  kind = kind or Generated
  table, online = online_dpo.sampled(p, judge, base)
  new = kind.completion_length(p.cfg)
  scfg = dataclasses.replace(online.scfg, max_new_tokens=new)
  seq_len = online_dpo.packing.round_up(table["tokens"].shape[1] + new, 8)
  fields = {f.name: getattr(online, f.name) for f in dataclasses.fields(online_dpo.Sampled)}
  return table, kind(**{**fields, "scfg": scfg, "seq_len": seq_len, "table": table})


def run(p, model: registry.Model) -> registry.Model:
  """The GRPO stage: the KL guard watches the k3 KL the step logs with --grpo_beta > 0."""
  estimate = "kl" if p.cfg.grpo.grpo_beta > 0 else None
  return dpo.preference_stage(p, model, GRPO, generated, estimate)


def step_config(cfg) -> train.StepConfig:
  return dataclasses.replace(train.StepConfig.dpo(cfg), total_steps=cfg.online.grpo_steps,
                             loss=None, kl=False, own=cfg.grpo, temperature=temperature(cfg))


def check_groups(cfg, stage: str, prefix: str, section, group: str) -> None:
  """A sampling stage's group size divides the batch and its iterations divide its length and
  the checkpoint cadence (checkpoints fall between generation batches)."""
  generations = getattr(section, f"{prefix}num_generations")
  iterations = getattr(section, f"{prefix}num_iterations")
  steps = getattr(cfg.online, f"{stage}_steps")
  here = stage in cfg.run.stages
  check(not here or cfg.optim.global_batch_size % generations == 0,
        f"--{prefix}num_generations={generations}: must divide --global_batch_size="
        f"{cfg.optim.global_batch_size} (a step's completions, {group} per prompt)")
  check(not here or (steps % iterations == 0 and cfg.checkpoint.checkpoint_every % iterations == 0),
        f"--{prefix}num_iterations={iterations}: must divide --{stage}_steps={steps} and "
        f"--checkpoint_every={cfg.checkpoint.checkpoint_every} (checkpoints fall between "
        f"generation batches)")


def check_weights_only(cfg, stage: str) -> None:
  """Of the grpo section, a sampling stage other than grpo reads only --reward_weights: another
  of its fields off its default without a grpo stage in the recipe is a flag nothing reads."""
  unread = [f.name for f in dataclasses.fields(cfg.grpo)
            if getattr(cfg.grpo, f.name) != f.default and f.name != "reward_weights"]
  check(stage not in cfg.run.stages or GRPO.name in cfg.run.stages or not unread,
        f"--{(unread + [''])[0]}={shown(getattr(cfg.grpo, (unread + ['grpo_beta'])[0]))}: "
        f"must go with a grpo stage (--stage={cfg.run.stage} has none; the {stage} stage reads "
        f"only --reward_weights of its section)")


def check_config(cfg) -> None:
  """Groups and iterations; --reward_weights: one weight per --reward_fn function (TRL's
  reward_weights)."""
  check_groups(cfg, GRPO.name, "", cfg.grpo, "G")
  weights, functions = cfg.grpo.reward_weights, len(judges.specs(cfg))
  check(not weights or bool(cfg.eval.reward_fn),
        f"--reward_weights={shown(weights)}: weighs the functions of --reward_fn=a:f,b:g; "
        f"give them")
  check(not weights or len(weights) == functions,
        f"--reward_weights={shown(weights)}: give one weight per --reward_fn function "
        f"({functions}: {cfg.eval.reward_fn}), not {len(weights)}")


GRPO = registry.register(registry.Algorithm(
    name="grpo", step=grpo_step, batch=lambda host: host, step_config=step_config, run=run,
    hyperparameters=lambda cfg: {**identity.sections(cfg, ("lora", "optim", "reference", "online",
                                                          "grpo")),
                                 "judge": judges.fingerprint(cfg)},
    data_files=("train_data", "tokenizer"), data_seed=5, steps_flag="--grpo_steps",
    sections=(("grpo", pg.GRPOConfig),), reads=("online",), check=check_config, samples=True,
    completion_length=Generated.completion_length, judged=True, abstain=True))

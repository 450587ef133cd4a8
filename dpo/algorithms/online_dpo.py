"""Online DPO (Guo et al. 2024, "Direct language model alignment from online AI feedback"; TRL's
`OnlineDPOTrainer`): every step samples two completions for each of a batch of training prompts
from the current policy, the judge (dpo/judges.py: a reward model or a reward function) scores
them, and the better one becomes the chosen response of a pair on which any registered
preference loss takes one step against the frozen reference.

As TRL does: completions that do not end within the token budget lose `missing_eos_penalty`
from their reward; the first sample is chosen when the rewards tie; the step logs the samples'
mean reward (`objective/scores`), the chosen-rejected gap (`objective/scores_margin`) and the
share that ended (`val/contain_eos_token`), and here also the time split between sampling,
judging and the update (`time/sample_s`, `time/judge_s`, `time/train_s`).

The sampler (models/sampler.py) runs jitted on the training mesh and reads the training weights
as they are (the base and the LoRA factors as an adapter, or the full weights): no copy. Prompts
are the distinct prompts of the training pairs, left-padded to one length, and completions are
laid out in rows of one length (prompt length + `online_max_new_tokens`, rounded up to 8), so
neither sampling nor the update recompiles as lengths vary. The sampling key of step s is
fold_in(key, s), so a resumed run draws what the uninterrupted one drew: checkpoints, resume and
the KL guard are the offline stage's (dpo/runner.py, dpo/hooks.py).

Several processes (one per host, as the offline stages): every process holds the prompt table
and draws the same prompts, passes the whole batch to the sampler on the global mesh and gets
every sample back (gathered), so each judges all of them alike (a reward function on the host,
a reward model on the mesh); each then hands the step its own block of the pairs
(`train.process_block`), as the offline stages' loader does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import time

import jax
import numpy as np

from dpo import batches, identity, judges, packing, registry, train
from dpo import data as data_lib
from dpo.algorithms import dpo
from models import sampler, sharding, transformer
from models.config import FINITE_NONNEG, NONNEG, check, option, rules, shown


@dataclass(frozen=True)
class OnlineConfig:
  """Online preference stages (dpo/algorithms/online_dpo.py): each step samples from the
  current policy and the judge (--judge / --reward_fn) labels the samples."""
  online_steps: int = option(200, "Online DPO optimizer steps (stage online_dpo); each samples two "
                             "completions for each of --global_batch_size training prompts.")
  online_temperature: float = option(0.9, "Sampling temperature of the online stages' samples "
                                     "(TRL's default 0.9).")
  online_max_new_tokens: int = option(0, "Tokens sampled per online completion (0 = "
                                      "max_target_length).")
  grpo_steps: int = option(200, "GRPO optimizer steps (stage grpo); a batch of samples is drawn "
                           "every --num_iterations of them.")
  rloo_steps: int = option(200, "RLOO optimizer steps (stage rloo); a batch of samples is drawn "
                           "every --rloo_num_iterations of them.")
  missing_eos_penalty: float = option(0.0, "Subtracted from the judge's reward of a sample that "
                                      "does not end (no EOS or end-of-turn within the token "
                                      "budget), as TRL's missing_eos_penalty; 0 = none.")

  def __post_init__(self):
    rules(self, online_steps=NONNEG, grpo_steps=NONNEG, rloo_steps=NONNEG, online_temperature=FINITE_NONNEG,
          online_max_new_tokens=NONNEG, missing_eos_penalty=FINITE_NONNEG)


def prompt_table(pairs: dict, pad_id: int) -> tuple[dict, list[int]]:
  """(arrays of the training pairs' distinct prompts, left-padded to one length: "tokens" and
  "segment_ids" [N, P] and "prompt_index" [N], the index of each prompt's first pair)."""
  rows = data_lib.distinct_prompts(pairs)
  prompts, index = [p for _, p in rows], [i for i, _ in rows]
  tokens, segments = sampler.left_pad(prompts, pad_id, multiple=8)
  return {"tokens": tokens, "segment_ids": segments,
          "prompt_index": np.asarray(index, np.int32)}, index


def pair_rows(prompts, chosen, rejected, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """[B, 2, seq_len] pair arrays (dpo/data.py's layout) of prompt + chosen / rejected ids."""
  side = lambda comps: data_lib.pack_rows([(list(p), list(c)) for p, c in zip(prompts, comps)],
                                           seq_len, pad_id)
  c, r = side(chosen), side(rejected)
  return {k: np.stack([c[k], r[k]], axis=1) for k in c}


def choose(rewards_2B: np.ndarray, ended_2B: np.ndarray, missing_eos_penalty: float):
  """(chosen is the first sample [B] bool, the rewards after the penalty [2B]): TRL's online DPO
  rule on rewards laid out [first samples of every prompt, then second samples]."""
  r = np.asarray(rewards_2B, np.float64).copy()
  if missing_eos_penalty:
    r[~ended_2B] -= missing_eos_penalty
  first, second = np.split(r, 2)
  return first >= second, r


def figures(chosen_B: np.ndarray, rewards_2B: np.ndarray, ended_2B: np.ndarray) -> dict:
  """TRL OnlineDPOTrainer's figures of labelled samples (`choose`'s layout): the samples' mean
  reward, the chosen-rejected gap and the share that ended."""
  first, second = np.split(np.asarray(rewards_2B), 2)
  picked, other = np.where(chosen_B, first, second), np.where(chosen_B, second, first)
  return {"objective/scores": float(np.mean(rewards_2B)),
          "objective/scores_margin": float((picked - other).mean()),
          "val/contain_eos_token": float(np.mean(ended_2B))}


@dataclasses.dataclass
class Sampled:
  """Program.stage's `online` for online DPO: samples, judges and updates, one step a call."""
  cfg: object
  mesh: object
  tok: object
  judge: object
  chats: list          # the judge's prompt for each row of the prompt table (text or messages)
  base: object         # the frozen base the LoRA factors apply to (LoRA on); None: full weights
  scfg: sampler.SamplingConfig
  seq_len: int
  columns: list | None = None  # each prompt row's extra data columns (reward functions read)
  whole_batch = True   # Program.stage: every process draws the whole batch of prompts

  def __call__(self, spec, update):
    key = jax.random.fold_in(jax.random.key(self.cfg.run.seed), 5)

    def dispatch(state, frozen, batch):
      t0 = time.perf_counter()
      step = int(state.step)
      comps = self.sample(state, batch, jax.random.fold_in(key, step))
      t1 = time.perf_counter()
      chosen, rewards, ended = self.judged(batch, comps)
      t2 = time.perf_counter()
      B = len(batch["tokens"])
      prompts = [row[seg != 0] for row, seg in zip(batch["tokens"], batch["segment_ids"])]
      first, second = comps[:B], comps[B:]
      rows = pair_rows(prompts, [a if c else b for a, b, c in zip(first, second, chosen)],
                       [b if c else a for a, b, c in zip(first, second, chosen)], self.seq_len,
                       self.tok.pad_id)
      own = train.process_block(self.mesh, rows)  # this process's block, as a loader's
      state, metrics = update(state, frozen, batches.PairBatch(batches.Rows.of(own)))
      jax.block_until_ready(state)
      metrics = {**metrics, **figures(chosen, rewards, ended),
                 "time/sample_s": round(t1 - t0, 3), "time/judge_s": round(t2 - t1, 3),
                 "time/train_s": round(time.perf_counter() - t2, 3)}
      return state, metrics
    return dispatch

  def sample(self, state, batch, key, n: int = 2) -> list[list[int]]:
    """n completions per prompt of `batch` from the policy `state`, laid out [sample 0 of every
    prompt, sample 1, ...], each ending with its stop token when it ended; each prompt is
    prefilled once for its n samples (sampler.generate's samples_per_prompt)."""
    tokens = np.concatenate([batch["tokens"]] * n)
    segments = np.concatenate([batch["segment_ids"]] * n)
    # Every process holds the whole batch and reads every sample back.
    prompts = train.device_batch(self.mesh, sampler.Prompts(tokens, segments), len(tokens))
    if self.base is None:
      params, adapter = state.params, None
    else:
      params, adapter = self.base, transformer.Adapter(state.params, self.cfg.lora.scale)
    samples = sampler.generate(self.cfg.model, self.scfg, params, prompts, key, adapter,
                               samples_per_prompt=n)  # each prompt prefilled once
    return sampler.completions(samples._replace(tokens=sharding.to_host(samples.tokens),
                                                lengths=sharding.to_host(samples.lengths)))

  def decoded(self, comps) -> tuple[list[str], np.ndarray]:
    """(each of `sample`'s completions as text, without its stop token; whether it ended)."""
    stops = {self.scfg.eos_id, *self.scfg.stop_ids}
    ended = np.array([bool(c) and c[-1] in stops for c in comps])
    return [self.tok.decode(c[:-1] if e else c) for c, e in zip(comps, ended)], ended

  def scored(self, batch, comps, score=None) -> tuple[np.ndarray, np.ndarray]:
    """(the judge's rewards, ended) of `sample`'s completions for `batch`: each decoded without
    its stop token and scored with its prompt as the data gave it (by `score`, a function of
    the records; None = the judge's score); reward functions also read the completions' ids
    (with the stop token, as TRL's completion_ids) and the prompts' extra columns."""
    texts, ended = self.decoded(comps)
    n = len(comps) // len(batch["prompt_index"])
    chats = [self.chats[i] for i in batch["prompt_index"]] * n
    records = [judges.records_of(p, [t])[0] for p, t in zip(chats, texts)]
    context = {}
    if isinstance(self.judge, (judges.FunctionJudge, judges.RewardFunctions)):
      context["ids"] = comps
      if self.columns is not None:
        context["columns"] = [self.columns[i] for i in batch["prompt_index"]] * n
    return (score or self.judge.score)(records, **context), ended

  def judged(self, batch, comps):
    """(first sample chosen [B], rewards after the EOS penalty [2B], ended [2B])."""
    rewards, ended = self.scored(batch, comps)
    chosen, rewards = choose(rewards, ended, self.cfg.online.missing_eos_penalty)
    return chosen, rewards, ended


def sampled(p, judge, base):
  """dpo.preference_stage's `online`: the prompt table and the dispatch factory."""
  c = p.cfg
  if judge is None:
    raise ValueError(f"--stage={c.run.stage}: online DPO needs a judge to label its samples: "
                     f"give --judge or --reward_fn")
  table, index = prompt_table(p.data.prompt_rows(), p.data.tok.pad_id)
  records = p.data.train_records
  columns = ([records[i].columns for i in index] if p.data.prompts is not None else None)
  chats = ([records[i].prompt for i in index] if records is not None else
           [p.data.tok.decode(row[seg != 0]) for row, seg in zip(table["tokens"],
                                                                 table["segment_ids"])])
  table["prompt_index"] = np.arange(len(index), dtype=np.int32)  # rows of `chats`
  new = completion_length(c)
  from dpo import evaluate
  scfg = dataclasses.replace(evaluate.sampling_config(c, p.data.tok, p.data.stop_ids),
                             max_new_tokens=new, temperature=c.online.online_temperature,
                             top_k=0, top_p=1.0)
  seq_len = packing.round_up(table["tokens"].shape[1] + new, 8)
  return table, Sampled(c, p.mesh, p.data.tok, judge, chats,
                        base if c.lora.enabled else None, scfg, seq_len, columns)


def run(p, model: registry.Model) -> registry.Model:
  return dpo.preference_stage(p, model, ONLINE_DPO, sampled)


# The stages that read each field of the online section beside --online_temperature (which
# every sampling stage reads); grpo, rloo and ppo sample their own completion lengths.
FIELD_READERS = {"online_steps": ("online_dpo",), "grpo_steps": ("grpo",), "rloo_steps": ("rloo",),
                 "online_max_new_tokens": ("online_dpo", "iterative_dpo"),
                 "missing_eos_penalty": ("online_dpo", "iterative_dpo")}


def check_config(cfg) -> None:
  """A field of the online section off its default needs a stage in the recipe that reads it:
  the section is shared, so its readers are named per field."""
  defaults = {f.name: f.default for f in dataclasses.fields(OnlineConfig)}
  for field, readers in FIELD_READERS.items():
    value = getattr(cfg.online, field)
    check(value == defaults[field] or any(r in cfg.run.stages for r in readers),
          f"--{field}={shown(value)}: read only by the {' or '.join(readers)} stage "
          f"(--stage={cfg.run.stage} has none)")


def completion_length(cfg) -> int:
  """The tokens each online sample may take: --online_max_new_tokens, else
  --max_target_length."""
  return cfg.online.online_max_new_tokens or cfg.data.max_target_length


def step_config(cfg) -> train.StepConfig:
  # A sampled row scores at most its completion budget, not --max_target_length.
  return dataclasses.replace(train.StepConfig.dpo(cfg), total_steps=cfg.online.online_steps,
                             score_slots=cfg.online.online_max_new_tokens
                             or cfg.data.max_target_length)


ONLINE_DPO = registry.register(registry.Algorithm(
    name="online_dpo", step=train.dpo_step, batch=batches.PairBatch.of, step_config=step_config,
    run=run,
    hyperparameters=lambda cfg: {**identity.sections(cfg, ("lora", "optim", "loss", "reference",
                                                          "guard", "online")),
                                 "judge": judges.fingerprint(cfg)},
    data_files=("train_data", "tokenizer"), data_seed=4, steps_flag="--online_steps",
    sections=(("online", OnlineConfig),), check=check_config, samples=True,
    completion_length=completion_length, judged=True))

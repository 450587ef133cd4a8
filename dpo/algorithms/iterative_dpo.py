"""Iterative DPO (Xu et al. 2023, "Some things are more CRINGE than others"; Yuan et al. 2024,
"Self-rewarding language models"): `--iterative_rounds` rounds, each of which samples two
completions for each of a pool of training prompts from the current policy, labels them with the
judge (dpo/judges.py) by online DPO's rule (TRL's: the higher reward is chosen, the first sample
on a tie, `--missing_eos_penalty` off a sample that did not end), writes the round's pairs as a
preference file in the project's own format (<output_dir>/iterative/round_N.jsonl: standard
{prompt, chosen, rejected} records, or conversational ones for a chat prompt, with the judge's
`score_chosen` and `score_rejected`), reads it back through the `--train_data` reader
(dpo/prepare.py: the chat template, the quality filters, counted skips) and trains
`--iterative_steps_per_round` offline DPO steps on it: the DPO step with any registered loss and
its modifiers, the DPO stage's reference, hooks, export and evaluation (`dpo.preference_stage`).
With `--iterative_ref_update` the policy at the end of a round becomes the next round's
reference (TR-DPO's hard update every round, dpo/reference.py).

A round's pool is the next `--iterative_prompts` rows (0: steps_per_round x global_batch_size)
of the stream of the distinct training prompts, epoch after epoch in a seeded shuffle
(`data.Loader`'s order), so successive rounds see fresh prompts until the table is used up, and a
prompt recurs (with fresh samples) after that. Sampling is online DPO's
(`online_dpo.Sampled`: the KV-cache sampler jitted on the training mesh, no weight copy), in
batches of --global_batch_size prompts; round r's key is fold_in(key, r). One optimizer and
learning-rate schedule run across the rounds (the stage is rounds x steps_per_round steps).

Nothing lost: a round is sampled right after the step that ends the previous one (round 0 before
the first step), so a checkpoint at a round boundary already records it; each checkpoint keeps
the sha256 and figures of the rounds sampled so far (`Rounds.state_dict`), and a resume reuses
the recorded round file (refusing one that changed) instead of sampling it again; the batch of
each step is a pure function of the round file and the step, and the moving reference travels
with the checkpoints (hooks.UpdateReference). A rollback to an earlier round samples the later
rounds again and replaces their files. Several processes as online DPO: each samples and labels
the whole pool alike; process 0 writes the round file, the others wait for it, and all read it
back (the output directory is shared, as for the checkpoints) and train on their block of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import json
import logging
import os
import time

import jax
import numpy as np

from dpo import batches, checkpoint, identity, judges, packing, prepare, registry, train
from dpo import data as data_lib
from dpo.algorithms import dpo, online_dpo
from dpo.runner import Hook
from models.config import NONNEG, at_least, check, option, rules, shown


@dataclass(frozen=True)
class IterativeConfig:
  """Iterative DPO (dpo/algorithms/iterative_dpo.py): rounds of sampling a preference file from
  the policy, labelled by the judge, and offline DPO steps on it. Sampling reads the online
  section's --online_temperature, --online_max_new_tokens and --missing_eos_penalty."""
  iterative_rounds: int = option(4, "Iterative DPO rounds (stage iterative_dpo): each samples "
                                 "a preference file from the policy and trains on it.")
  iterative_steps_per_round: int = option(50, "DPO optimizer steps of each iterative round "
                                          "(the stage's length is rounds x this).")
  iterative_prompts: int = option(0, "Training prompts sampled (two completions each) per "
                                  "iterative round: the next slice of the distinct training "
                                  "prompts, epoch after epoch in a seeded shuffle (a prompt "
                                  "recurs once the table is used up); 0 = "
                                  "--iterative_steps_per_round x --global_batch_size (each pair "
                                  "trained on once).")
  iterative_ref_update: bool = option(False, "Iterative DPO: the policy at the end of each round "
                                      "becomes the next round's reference (TR-DPO's hard "
                                      "update every --iterative_steps_per_round steps); False = "
                                      "the reference stays the model the stage started from.")

  def __post_init__(self):
    rules(self, iterative_rounds=at_least(1), iterative_steps_per_round=at_least(1),
          iterative_prompts=NONNEG)


def check_config(cfg) -> None:
  """What the iterative section asks of the batch, the reference and the loss."""
  it = cfg.iterative
  check(not it.iterative_prompts or it.iterative_prompts >= cfg.optim.global_batch_size,
        f"--iterative_prompts={it.iterative_prompts}: must be 0 or at least "
        f"--global_batch_size={cfg.optim.global_batch_size} (a round's pairs fill its batches)")
  check(not it.iterative_ref_update or cfg.reference.ref_update == "none",
        f"--iterative_ref_update=True: the policy already becomes the reference each round; "
        f"not with --ref_update={cfg.reference.ref_update!r}")
  check(not (it.iterative_ref_update and cfg.reference.ref_init_from and cfg.lora.enabled),
        f"--iterative_ref_update=True with --ref_init_from={cfg.reference.ref_init_from!r}: "
        f"must go with full fine-tuning, --lora_rank=0 (with LoRA the updated reference is the "
        f"policy's own base plus its adapter)")
  check(not (it.iterative_ref_update and cfg.loss.reference_free),
        f"--iterative_ref_update=True: must go with a loss that reads the reference, not the "
        f"reference-free --loss_type={shown(cfg.loss.loss_type)}")

_PAIR_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


def round_path(output_dir: str, r: int) -> str:
  return os.path.join(output_dir, "iterative", f"round_{r}.jsonl")


def pool_size(cfg) -> int:
  """Prompts sampled per round: --iterative_prompts, or one pair for each of the round's
  steps' batch rows."""
  it = cfg.iterative
  return it.iterative_prompts or it.iterative_steps_per_round * cfg.optim.global_batch_size


def records(chats: list, chosen_B: np.ndarray, texts_2B: list[str],
            rewards_2B: np.ndarray) -> list[dict]:
  """A round's pairs in the project's preference format: {prompt, chosen, rejected} strings for
  a text prompt, conversational messages for a chat prompt; the judge's scores beside them."""
  B, out = len(chats), []
  for b, prompt in enumerate(chats):
    c, r = (b, B + b) if chosen_B[b] else (B + b, b)
    if isinstance(prompt, str):
      side = lambda i: texts_2B[i]
    else:
      prompt = [{"role": m[0], "content": m[1]} for m in prompt]
      side = lambda i: [{"role": "assistant", "content": texts_2B[i]}]
    out.append({"prompt": prompt, "chosen": side(c), "rejected": side(r),
                "score_chosen": float(rewards_2B[c]), "score_rejected": float(rewards_2B[r])})
  return out


def write_jsonl(path: str, rows: list[dict]) -> str:
  """Writes `rows` whole or not at all (aside, synced, renamed); returns the file's sha256."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)
  return data_lib.file_sha256(path)


def padded(arrays: dict, lengths: dict, pad_id: int) -> dict:
  """Each array's last axis padded to the length of the first prefix in `lengths` that its name
  starts with, "tokens" with the pad id and the rest with zeros (segment 0, weight 0: padding)."""
  out = {}
  for k, a in arrays.items():
    n = max(next(v for prefix, v in lengths.items() if k.startswith(prefix)), a.shape[-1])
    width = [(0, 0)] * (a.ndim - 1) + [(0, n - a.shape[-1])]
    out[k] = np.pad(a, width, constant_values=pad_id if k == "tokens" else 0)
  return out


@dataclasses.dataclass
class Rounds(Hook):
  """Program.stage's `online` for iterative DPO and the stage's first hook: samples, labels and
  writes each round's file, and gives each step its batch of the round's pairs."""
  cfg: object
  sampled: online_dpo.Sampled   # sampling and labelling (online DPO's)
  table: dict                   # the prompt table (online_dpo.prompt_table; prompt_index: chats)
  how: prepare.Preparation      # how a round file is read (the --train_data reader)
  lengths: dict                 # fixed last-axis lengths of the round arrays (no recompiles)
  rounds: dict = dataclasses.field(default_factory=dict)  # "r": sha256 and figures, sampled
  current: tuple | None = None  # (round, its Loader) in memory
  whole_batch = True            # Program.stage: every process holds each step's whole batch

  @property
  def hooks(self) -> list:
    return [self]

  @property
  def steps_per_round(self) -> int:
    return self.cfg.iterative.iterative_steps_per_round

  def __call__(self, spec, update):
    def dispatch(state, frozen, batch):
      own = train.process_block(self.sampled.mesh, batch)  # the round loader gives it whole
      state, metrics = update(state, frozen, batches.PairBatch.of(own))
      r = self.current[0]
      info = {k: v for k, v in self.rounds[str(r)].items() if k != "sha256"}
      return state, {**metrics, "iterative/round": r, **info}
    return dispatch

  def before_step(self, run, batch: dict) -> dict:
    r, i = divmod(run.step, self.steps_per_round)
    self._load(run, r)
    loader = self.current[1]
    m = loader.n // loader.global_batch
    loader.restore({"epoch": i // m, "index": i % m * loader.global_batch})
    return next(loader)

  def after_step(self, run) -> None:
    if run.step % self.steps_per_round == 0 and run.step < run.steps:
      self._load(run, run.step // self.steps_per_round)  # the checkpoint here records it

  def state_dict(self) -> dict:
    return {"rounds": dict(self.rounds)}

  def load_state_dict(self, meta: dict) -> None:
    self.rounds, self.current = dict(meta.get("rounds", {})), None

  def _load(self, run, r: int) -> None:
    """Round r's pairs in memory: its recorded file, or (at its first step) sampled anew."""
    if self.current is not None and self.current[0] == r:
      return
    path = round_path(self.cfg.run.output_dir, r)
    if str(r) not in self.rounds:
      if run.step != r * self.steps_per_round:
        raise checkpoint.CheckpointError(f"{path}: round {r} is not recorded in the checkpoint "
                                         f"of step {run.step}; use a fresh --output_dir")
      self.rounds[str(r)] = self._sample(run, r, path)
    elif not os.path.exists(path) or data_lib.file_sha256(path) != self.rounds[str(r)]["sha256"]:
      raise checkpoint.CheckpointError(
          f"{path}: {'missing' if not os.path.exists(path) else 'changed'} since the checkpoint "
          f"that trained on it (sha256 {self.rounds[str(r)]['sha256'][:16]}); its pairs cannot "
          f"be sampled again mid-round: restore the file, or use a fresh --output_dir")
    else:
      logging.info("iterative_dpo: round %d: reusing %s", r, path)
    arrays, B = self._arrays(path, r), self.cfg.optim.global_batch_size
    n = len(arrays["tokens"])
    if n < B:  # the reader dropped pairs whose samples were equal or empty
      logging.warning("iterative_dpo: round %d: %d pairs left after the reader's filters, fewer "
                      "than one batch of --global_batch_size=%d; repeating them to fill it", r,
                      n, B)
      arrays = {k: v[np.resize(np.arange(n), B)] for k, v in arrays.items()}
    seed = (self.cfg.run.seed + ITERATIVE_DPO.loader_seed) * 1000 + r
    self.current = (r, data_lib.Loader(arrays, B, seed))

  def _arrays(self, path: str, r: int) -> dict:
    """The round file as the --train_data reader tokenises it (with the shared-prefix rows when
    --prefix_sharing), padded to the stage's fixed lengths."""
    pairs = prepare.prepare_pairs(path, self.how._replace(flag=f"iterative round {r}")).train
    pairs = {k: pairs[k] for k in _PAIR_KEYS}
    if self.cfg.model.prefix_sharing:
      shared, note = packing.shared_prefix(pairs)
      logging.info("iterative_dpo: round %d: %s", r, note)
      pairs = pairs if shared is None else {**pairs, **shared}
    return padded(pairs, self.lengths, self.sampled.tok.pad_id)

  def pool(self, r: int) -> np.ndarray:
    """Rows of the prompt table that round r samples: its slice of the stream of the table's
    epochs, each in the seeded order of `data.Loader` (a prompt recurs once the table is used
    up, with fresh samples)."""
    n, size = len(self.table["tokens"]), pool_size(self.cfg)
    order = data_lib.Loader(self.table, 1, self.cfg.run.seed + ITERATIVE_DPO.loader_seed)
    first, last = r * size, (r + 1) * size
    stream = np.concatenate([order.batch_rows(e).reshape(-1)
                             for e in range(first // n, (last - 1) // n + 1)])
    return stream[first - first // n * n:][:size]

  def _sample(self, run, r: int, path: str) -> dict:
    """Samples round r from the policy `run.state`, labels it, writes its file; returns its
    record (sha256, pair count, TRL's figures, the time spent sampling and judging)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.run.seed), 7), r)
    B, rows = self.cfg.optim.global_batch_size, self.pool(r)
    labels, out, t = [], [], {"sample": 0.0, "judge": 0.0}
    for c, start in enumerate(range(0, len(rows), B)):
      take = rows[start:start + B]
      full = np.concatenate([take, np.repeat(take[:1], B - len(take))])  # one sampling shape
      batch = {k: v[full] for k, v in self.table.items()}
      t0 = time.perf_counter()
      comps = self.sampled.sample(run.state, batch, jax.random.fold_in(key, c))
      t1 = time.perf_counter()
      chosen, rewards, ended = self.sampled.judged(batch, comps)
      texts, _ = self.sampled.decoded(comps)
      t["sample"], t["judge"] = t["sample"] + t1 - t0, t["judge"] + time.perf_counter() - t1
      n = len(take)
      keep = lambda a: [*a[:n], *a[B:B + n]]
      out += records([self.sampled.chats[i] for i in batch["prompt_index"][:n]], chosen[:n],
                     keep(texts), np.array(keep(rewards)))
      labels.append((chosen[:n], rewards[:n], rewards[B:B + n], ended[:n], ended[B:B + n]))
    cat = lambda j: np.concatenate([f[j] for f in labels])  # figures' [firsts, seconds] layout
    figs = online_dpo.figures(cat(0), np.concatenate([cat(1), cat(2)]),
                              np.concatenate([cat(3), cat(4)]))
    if jax.process_index() == 0:
      write_jsonl(path, out)
    checkpoint.barrier(f"iterative-round:{path}")
    sha = data_lib.file_sha256(path)
    logging.info("iterative_dpo: round %d: %d pairs -> %s (scores %.3f, margin %.3f, ended "
                 "%.2f; sample %.1fs, judge %.1fs)", r, len(out), path, figs["objective/scores"],
                 figs["objective/scores_margin"], figs["val/contain_eos_token"], t["sample"],
                 t["judge"])
    return {"sha256": sha, "iterative/pairs": len(out), **figs,
            "time/sample_s": round(t["sample"], 3), "time/judge_s": round(t["judge"], 3)}


def sampled_rounds(p, judge, base):
  """dpo.preference_stage's `online`: the prompt table and the `Rounds` that samples from it."""
  c = p.cfg
  table, sampled = online_dpo.sampled(p, judge, base)
  d = c.data
  how = prepare.Preparation(p.data.tok, template=p.data.template,
                            max_prompt_length=d.max_prompt_length,
                            max_target_length=d.max_target_length, skip_bad=True)
  # A re-read prompt is as long as the table's (the same reader made both) and a completion at
  # most --max_target_length tokens: the arrays' lengths, fixed for every round.
  P, C = table["tokens"].shape[1], d.max_target_length
  lengths = {"shared_": packing.round_up(P + 2 * C, 8), "score_": packing.round_up(2 * C, 8),
             "": packing.round_up(P + C, 8)}
  return table, Rounds(c, sampled, table, how, lengths)


def run(p, model: registry.Model) -> registry.Model:
  """The iterative stage; with --iterative_ref_update it runs as TR-DPO with a hard update at
  the end of each round (the config it runs with says so)."""
  it = p.cfg.iterative
  if it.iterative_ref_update:
    cfg = p.cfg.replace(ref_update="hard", ref_update_every=it.iterative_steps_per_round,
                        iterative_ref_update=False)
    logging.info("iterative_dpo: the policy becomes the reference after each round of %d "
                 "steps", it.iterative_steps_per_round)
    p = dataclasses.replace(p, cfg=cfg)
  return dpo.preference_stage(p, model, ITERATIVE_DPO, sampled_rounds)


def step_config(cfg) -> train.StepConfig:
  it = cfg.iterative
  return dataclasses.replace(train.StepConfig.dpo(cfg),
                             total_steps=it.iterative_rounds * it.iterative_steps_per_round)


ITERATIVE_DPO = registry.register(registry.Algorithm(
    name="iterative_dpo", step=train.dpo_step, batch=batches.PairBatch.of,
    step_config=step_config, run=run,
    hyperparameters=lambda cfg: {**identity.sections(cfg, ("lora", "optim", "loss", "reference",
                                                          "guard", "online", "iterative")),
                                 "judge": judges.fingerprint(cfg)},
    data_files=("train_data", "tokenizer"), data_seed=7, steps_flag="--iterative_rounds",
    sections=(("iterative", IterativeConfig),), reads=("online",), check=check_config,
    samples=True, completion_length=online_dpo.completion_length, judged=True))

"""The training program: data -> the recipe's stages (`--stage`, e.g. SFT then DPO) -> summary.

`run` loads the data and walks the recipe through the algorithm registry (dpo/algorithms): each
algorithm builds its stage on `Program.stage` (dpo/program.py), the stage runner (dpo/runner.py)
runs it with the hooks of dpo/hooks.py, and it hands its model to the next. Everything
resumable lives under <output_dir>/checkpoints/: step checkpoints in sft/ and dpo/, the SFT
output `sft_model` (the DPO stage's initial policy and frozen reference), `dpo_base` (the random
base of a --stage=dpo run without --init_from, written once), and the exported policy `policy`
(LoRA merged). Rerunning the same command continues where the last complete checkpoint left
off, across the SFT -> DPO boundary too. Only process 0 writes files.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import importlib.metadata as md
import json
import logging
import os
import platform
import sys
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from dpo import algorithms  # noqa: F401 (importing it registers every stage)
from dpo import autotune, chat, checkpoint, cli, curves, evaluate, formats, registry
from dpo import hub, identity, judges, packing, prepare, progress, reasoning, rewards, task
from dpo import tracking, train
from dpo import data as data_lib
from dpo import tokenizer as tokenizer_lib
from dpo.program import Program
from dpo.runner import Hook, MetricsWriter, TrainingStopped  # noqa: F401 (re-exported)
from models import sharding, transformer


def _refuse_pairless(cfg, reads, holds: str, readers, named=None) -> None:
  """--train_data that is not preference pairs (`holds` says what it is): a stage of the recipe
  that `reads` does not accept is refused in one line, naming it and, by `readers` of their
  names, the stages that read such data (`named`: which of them to name; default `reads`)."""
  pairless = [a.name for a in registry.recipe(cfg.run.stages) if not reads(a)]
  if pairless:
    names = ", ".join(a.name for a in registry.ALGORITHMS.values() if (named or reads)(a))
    raise data_lib.DataError(
        f"--train_data={cfg.data.train_data}: holds {holds}; the {', '.join(pairless)} stage "
        f"needs preference pairs (only {readers(names)})")


class Data:
  """Tokenized SFT, training and held-out arrays for one run.

  With --train_data the pairs go through dpo.prepare (any supported format, quality filters,
  chat template, held-out split, cached tokenisation); SFT then uses --sft_data (any SFT
  layout, rendered with the same template) or, failing that, the chosen rows of the training
  pairs. Unpaired --train_data ({prompt, completion, label}) is read as it is into `unpaired`
  (`pairs` is then None) for a recipe whose stages read it (Algorithm.unpaired: kto, and sft on
  its desirable completions). Prompt --train_data (TRL's prompt-only layout, GSM8K, MATH) is read
  into `prompts` for a recipe of sampling stages (sft on its worked solutions), each record's
  extra columns kept for the reward functions. A data set smaller than one global batch is a
  DataError naming the file and the flag. `inspect` writes what the model is trained on.
  """

  def __init__(self, cfg, tok=None, check_sizes: bool = True):
    d = cfg.data
    self.tok = tok or tokenizer_lib.load_tokenizer(d.tokenizer, d.bos_token, d.eos_token,
                                                   d.pad_token)
    if check_sizes and cfg.model.vocab_size < self.tok.vocab_size:
      raise ValueError(f"vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                       f"{self.tok.vocab_size} ids")
    self.embedded = not d.train_data
    self.task = task.embedded(d) if self.embedded else None  # --task
    self.template = chat.resolve_template(d.chat_template, self.tok)
    self.reports = []
    self.held_records = None  # the held-out pairs as read, one per held-out row
    self.train_records = None  # the training pairs as read (kept for an online stage's judge)
    self.cuts = None  # how each training row's prompt was fitted to --max_prompt_length
    online = bool(cfg.online_stages)
    self.unpaired = self.unpaired_held = None  # unpaired --train_data: rows and `label`
    self.prompts = self.prompts_held = None  # prompt --train_data: [N, T] prompt (+ solution) rows
    pair_flags = d.data_format != "auto" or d.chosen_field or d.rejected_field
    if not self.embedded and not pair_flags and formats.is_unpaired(self._value(cfg, "train_data")):
      self.pairs, self.held = None, self._file_unpaired(cfg)
    elif not self.embedded and not pair_flags and formats.is_prompts(
        self._value(cfg, "train_data")):
      self.pairs, self.held = None, self._file_prompts(cfg)
    else:
      self.pairs, self.held = (self._task_pairs(cfg) if self.embedded else
                               self._file_pairs(cfg, online))
    self.rm_pairs = self._split_for_rm(cfg)
    self.sft = self._sft(cfg)
    if self.pairs is not None and "margin" in self.pairs:
      read = any(a.scores for a in registry.recipe(cfg.run.stages))  # a reward model's loss
      logging.log(logging.INFO if read else logging.WARNING,
                  "%s: per-pair margins, read by a reward-model stage only%s", d.train_data,
                  "" if read else " (none in this --stage; unused)")
    if check_sizes:
      self._check_sizes(cfg)
    self._sampling_prompts(cfg)
    train = next(t for t in (self.pairs, self.unpaired, self.prompts) if t is not None)
    logging.info("data: %d SFT examples (T=%d), %d train %s (T=%d), %d held-out pairs",
                 len(self.sft["tokens"]), self.sft["tokens"].shape[-1], len(train["tokens"]),
                 "pairs" if self.pairs is not None else "unpaired examples"
                 if self.unpaired is not None else "prompts",
                 train["tokens"].shape[-1], 0 if self.held is None else len(self.held["tokens"]))

  def _value(self, cfg, flag: str) -> data_lib.DataValue:
    """--flag's value parsed into its sources (`data.data_value`), once per Data: the readers
    below hand this to prepare, data and formats, never the string."""
    values = vars(self).setdefault("_values", {})
    if flag not in values:
      values[flag] = data_lib.data_value(getattr(cfg.data, flag), flag)
    return values[flag]

  def _task_pairs(self, cfg) -> tuple[dict, dict | None]:
    """(training pairs, held-out pairs) of the embedded task (held-out: --eval_data if given)."""
    d, seed = cfg.data, cfg.run.seed
    lens = (d.max_prompt_length, d.max_target_length)
    pairs = self.task.preference_records(d.task_train_pairs, seed)
    self.train_records = list(pairs)
    held = (data_lib.load_preference_jsonl(self._value(cfg, "eval_data")) if d.eval_data else
            self.task.preference_records(d.task_eval_pairs, seed, held_out=True))
    self.held_records = list(held) or None
    return (data_lib.tokenize_pairs(pairs, self.tok, *lens, what="train pairs"),
            data_lib.tokenize_pairs(held, self.tok, *lens, what="held-out pairs") if held
            else None)

  def _file_pairs(self, cfg, train_records: bool = False) -> tuple[dict, dict | None]:
    """(training pairs, held-out pairs) of --train_data through dpo.prepare; held-out: the
    --eval_split of it, or --eval_data."""
    d = cfg.data
    if d.eval_data and d.eval_split:
      raise ValueError("give either --eval_data or --eval_split, not both")
    cache_dir = ("" if d.data_cache_dir == "none" else
                 d.data_cache_dir or os.path.join(cfg.run.output_dir, "data_cache"))
    how = prepare.Preparation(
        self.tok, formats.FormatSpec(d.data_format, d.prompt_field, d.chosen_field,
                                     d.rejected_field),
        self.template, d.max_prompt_length, d.max_target_length, d.skip_bad_records)
    prep = functools.partial(prepare.prepare_pairs, cache_dir=cache_dir)
    train_prep = prep(self._value(cfg, "train_data"), how, eval_split=d.eval_split,
                      train_records=train_records)
    self.reports.append(train_prep.report)
    self.train_records, self.cuts = train_prep.train_records, train_prep.cuts
    if not d.eval_data:
      self.held_records = train_prep.held_records
      return train_prep.train, train_prep.held
    eval_prep = prep(self._value(cfg, "eval_data"), how, eval_split=0.0, train_records=True)
    self.reports.append(eval_prep.report)
    self.held_records = eval_prep.train_records
    return train_prep.train, eval_prep.train

  def _one_side_preparation(self, cfg) -> prepare.Preparation:
    """How unpaired or prompt data is read (no pair format flags), after the one check of the
    held-out flags both make."""
    d = cfg.data
    if d.eval_data and d.eval_split:
      raise ValueError("give either --eval_data or --eval_split, not both")
    return prepare.Preparation(self.tok, template=self.template,
                               max_prompt_length=d.max_prompt_length,
                               max_target_length=d.max_target_length, skip_bad=d.skip_bad_records)

  def _file_unpaired(self, cfg) -> dict | None:
    """Unpaired --train_data ({prompt, completion, label}, dpo.prepare.prepare_unpaired) into
    self.unpaired, for the stages that read it (sft: its desirable completions; kto); returns
    the held-out pairs of --eval_data, or None. Its --eval_split examples (self.unpaired_held)
    give the evaluation's sampling prompts."""
    d = cfg.data
    _refuse_pairless(cfg, lambda a: a.unpaired, "unpaired records {prompt, completion, label}",
                     lambda names: f"{names} read unpaired ones")
    how = self._one_side_preparation(cfg)
    prep = prepare.prepare_unpaired(self._value(cfg, "train_data"), how, d.eval_split)
    self.reports.append(prep.report)
    self.unpaired, self.unpaired_held, self.cuts = prep.train, prep.held, prep.cuts
    self.held_records = prep.held_records  # their prompts are the sampling prompts' chats
    if not d.eval_data:
      return None
    cache_dir = ("" if d.data_cache_dir == "none" else
                 d.data_cache_dir or os.path.join(cfg.run.output_dir, "data_cache"))
    eval_prep = prepare.prepare_pairs(self._value(cfg, "eval_data"), how, cache_dir=cache_dir,
                                      train_records=True)
    self.reports.append(eval_prep.report)
    self.held_records = eval_prep.train_records
    return eval_prep.train

  def _file_prompts(self, cfg) -> None:
    """Prompt --train_data (TRL's prompt-only layout, GSM8K, MATH; dpo.prepare.prepare_prompts)
    into self.prompts, for a recipe of sampling stages (and sft, on the worked solutions or
    --sft_data); its --eval_split prompts (self.prompts_held), or --eval_data's prompts, give the
    evaluation's sampling prompts, their columns its reward functions'. No held-out pairs."""
    d = cfg.data
    _refuse_pairless(cfg, lambda a: a.samples or a.rows == "demonstrations",  # sft: solutions
                     "prompts without responses (TRL's prompt-only layout, GSM8K or MATH)",
                     lambda names: f"the SFT stage and the sampling stages {names} read prompts",
                     lambda a: a.samples)
    how = self._one_side_preparation(cfg)
    prep = prepare.prepare_prompts(self._value(cfg, "train_data"), how, d.eval_split)
    self.reports.append(prep.report)
    self.prompts, self.prompts_held, self.cuts = prep.train, prep.held, prep.cuts
    self.prompts_solved = prep.solved
    self.train_records, self.held_records = prep.train_records, prep.held_records
    if d.eval_data:
      eval_prep = prepare.prepare_prompts(self._value(cfg, "eval_data"), how)
      self.reports.append(eval_prep.report)
      self.prompts_held, self.held_records = eval_prep.train, eval_prep.train_records
    return None

  def prompt_rows(self) -> dict | None:
    """The training prompts as one-side pair arrays [N, 1, T] (what `data.distinct_prompts`
    and the sampling stages' prompt table read): prompt data's rows, or the pairs."""
    if self.prompts is None:
      return self.pairs
    return {k: v[:, None] for k, v in self.prompts.items()}

  def _split_for_rm(self, cfg) -> dict | None:
    """--rm_split: the rm stage's pairs (that fraction of the training prompts, by a hash of
    each prompt's token ids), which leave self.pairs; None without the flag."""
    fraction = cfg.reward.rm_split
    if not fraction:
      return None
    tokens, mask = self.pairs["tokens"][:, 0], self.pairs["loss_mask"][:, 0]
    first = np.argmax(mask > 0, axis=1)
    digest = lambda row, n: hashlib.sha256(row[:n].astype(np.int32).tobytes()).digest()[:8]
    to_rm = np.array([int.from_bytes(digest(t, n), "big") / 2.0**64 < fraction
                      for t, n in zip(tokens, first)])
    rm_pairs = {k: v[to_rm] for k, v in self.pairs.items()}
    if self.cuts is not None:
      self.cuts = [c for c, rm in zip(self.cuts, to_rm) if not rm]
    self.pairs = {k: v[~to_rm] for k, v in self.pairs.items()}
    logging.info("--rm_split=%g: %d pairs for the rm stage, %d for the others (split by prompt)",
                 fraction, int(to_rm.sum()), int((~to_rm).sum()))
    return rm_pairs

  def _sft(self, cfg) -> dict:
    """SFT rows: --sft_data (rendered with the template the preference data gets), the embedded
    task's demonstrations, or the chosen row of each training pair."""
    d = cfg.data
    lens = (d.max_prompt_length, d.max_target_length)
    if d.sft_data:
      sft, report = prepare.prepare_sft(self._value(cfg, "sft_data"), prepare.Preparation(
          self.tok, template=self.template, max_prompt_length=lens[0],
          max_target_length=lens[1], skip_bad=d.skip_bad_records))
      self.reports.append(report)
      return sft
    if self.embedded:
      return data_lib.tokenize_sft(self.task.sft_records(d.task_sft_examples, cfg.run.seed),
                                   self.tok, *lens, what="sft data")
    if self.unpaired is not None:
      keep = self.unpaired["label"]
      logging.info("sft: the %d desirable completions of %s", int(keep.sum()), d.train_data)
      return {k: v[keep] for k, v in self.unpaired.items() if k != "label"}
    if self.prompts is not None:
      keep = self.prompts_solved
      sft = [a.name for a in registry.recipe(cfg.run.stages) if a.rows == "demonstrations"]
      if not keep.any() and sft:
        raise data_lib.DataError(
            f"--train_data={d.train_data}: its prompts carry no worked solutions (TRL's "
            f"prompt-only layout); the {sft[0]} stage needs --sft_data")
      logging.info("sft: the %d worked solutions of %s", int(keep.sum()), d.train_data)
      return {k: v[keep] for k, v in self.prompts.items()}
    return {k: v[:, 0] for k, v in self.pairs.items() if k != "margin"}  # margin: [N]

  def _check_sizes(self, cfg) -> None:
    """At least one global batch for each stage that trains on it, (--packing) pairs whose rows
    share a prompt, and (a reward model) padding that is not the EOS: refused before any stage
    runs, not when the stage that needs it starts."""
    d, batch, recipe = cfg.data, cfg.optim.global_batch_size, registry.recipe(cfg.run.stages)
    rows = {a.rows: a.name for a in recipe if a.rows}  # the table each trains on
    rm_pairs = self.pairs if self.rm_pairs is None else self.rm_pairs
    for arrays, used, what in ((self.pairs, "pairs" in rows,
                                d.train_data or "the embedded task's pairs"),
                               (self.unpaired, self.unpaired is not None, d.train_data),
                               (rm_pairs, "rm_pairs" in rows,
                                f"{d.train_data or 'the embedded task'}'s pairs for the "
                                f"{rows.get('rm_pairs')} stage"),
                               (self.sft, "demonstrations" in rows,
                                d.sft_data or d.train_data or "the embedded task's SFT data")):
      if used and len(arrays["tokens"]) < batch:
        raise data_lib.DataError(
            f"{what}: {len(arrays['tokens'])} training examples after filtering and the "
            f"held-out split, fewer than one batch of --global_batch_size={batch}")
    if any(a.scores for a in recipe) and self.tok.pad_id == self.tok.eos_id:
      raise data_lib.DataError(
          f"--stage={cfg.run.stage}: this tokenizer pads with its EOS (id {self.tok.pad_id}); a "
          f"reward model reads each sequence's last token that is not padding, as transformers "
          f"does, which would then be the token before the EOS for transformers and the EOS "
          f"here; give --pad_token= a token other than the EOS")
    why = (packing.prompt_lengths(self.pairs)[1]
           if cfg.model.packing and "pairs" in rows else None)
    if why is not None:
      raise data_lib.DataError(f"--packing packs shared-prefix rows, and prefix sharing does "
                               f"not apply to {d.train_data or 'the pairs'}: {why}")

  def _sampling_prompts(self, cfg) -> None:
    """Sampling prompts: the embedded task's held-out prompts, or those of the first held-out
    pairs of real data (as the chat template rendered them). The ground-truth reward and the
    well-formedness check exist only for the embedded task; without them win rate, true
    rewards and the well-formed rate are reported as null."""
    n = cfg.data.task_eval_prompts
    self.eval_prompt_ids, self.stop_ids, self.eval_columns = None, (), None
    if self.embedded:
      self.eval_prompts = self.task.eval_prompts(n)
      self.eval_chats = list(self.eval_prompts)
    else:
      held = self.held
      one_side = self.unpaired_held if self.unpaired_held is not None else self.prompts_held
      if held is None and one_side is not None:  # unpaired or prompts: one side a row
        held = {k: one_side[k][:, None] for k in ("tokens", "loss_mask")}
      rows = data_lib.distinct_prompts(held, n)
      self.eval_prompt_ids = [ids for _, ids in rows]
      self.eval_prompts = [self.tok.decode(p) for p in self.eval_prompt_ids]
      self.eval_chats = [self.held_records[i].prompt for i, _ in rows]
      self.eval_columns = ([self.held_records[i].columns for i, _ in rows]
                           if self.prompts is not None else None)
      self.stop_ids = tuple(chat.end_of_turn_ids(self.template, self.tok))
    self.well_formed_fn = self.task.well_formed if self.embedded else None
    k = cfg.eval.eval_samples_per_prompt  # each prompt k times (pass@k, majority@k)
    self.eval_prompts, self.eval_chats = self.eval_prompts * k, self.eval_chats * k
    if self.eval_prompt_ids is not None:
      self.eval_prompt_ids = self.eval_prompt_ids * k
    if self.eval_columns is not None:
      self.eval_columns = self.eval_columns * k

  def eval_set(self, judge=None) -> evaluate.EvalSet:
    """What the DPO stage is evaluated on (dpo/evaluate.py), scored by `judge`
    (dpo/judges.py)."""
    return evaluate.EvalSet(self.tok, self.eval_prompts, self.eval_prompt_ids, self.held,
                            judge, self.well_formed_fn, self.stop_ids, self.eval_chats,
                            self.held_records if self.held is not None else None,
                            self._reasoning(), self.eval_columns)

  def _reasoning(self):
    """How reasoning is evaluated: the embedded task's own check, the `solution` column of
    prompt data (reasoning.Solutions; skipped, and logged, without math-verify), else None."""
    if self.embedded:
      return self.task.reasoning
    if not self.eval_columns or not all("solution" in c for c in self.eval_columns):
      return None
    try:
      return reasoning.Solutions(self.eval_columns)
    except rewards.RewardSpecError:
      logging.warning("the reasoning evaluation (pass@k, majority@k of the `solution` column) "
                      "is skipped: it needs math-verify: pip install 'dpo-jax[math]'")
      return None

  def preview(self, n: int) -> list[dict]:
    """The first `n` training pairs (or unpaired examples, with their label) as the model sees
    them: the text decoded from the token ids, the ids, the positions whose tokens are scored
    (loss_mask = 1) and, for a prompt over --max_prompt_length, how it was cut (`prompt_cut`:
    chat.fit_record's words)."""
    out, t, sides = [], self.pairs, ((0, "chosen"), (1, "rejected"))
    if t is None:  # unpaired rows or prompts: one side a row, the completion (and its label)
      one_side = self.unpaired if self.unpaired is not None else self.prompts
      t, sides = {k: v[:, None] for k, v in one_side.items()}, ((0, "completion"),)
    for i in range(min(n, len(t["tokens"]))):
      rec = {"index": i}
      if self.cuts is not None and self.cuts[i]:
        rec["prompt_cut"] = self.cuts[i]
      if "label" in t:
        rec["label"] = bool(t["label"][i, 0])
      for side, name in sides:
        tokens, mask = t["tokens"][i, side], t["loss_mask"][i, side]
        length = int(t["segment_ids"][i, side].sum())
        scored = [int(k) for k in np.flatnonzero(mask)]
        start = scored[0] if scored else length
        if side == 0:
          rec["prompt_ids"] = [int(x) for x in tokens[:start]]
          rec["prompt_text"] = self.tok.decode(rec["prompt_ids"])
        ids = [int(x) for x in tokens[start:length]]
        rec.update({f"{name}_text": self.tok.decode(ids), f"{name}_ids": ids,
                    f"{name}_scored_positions": scored})
      out.append(rec)
    return out

  def inspect(self, n: int, output_dir: str, show: int = 3) -> dict:
    """--inspect_data=N: <output_dir>/data_preview.jsonl and the first `show` pairs printed."""
    if n < 0:
      raise ValueError(f"--inspect_data must be >= 0 (0 = off), got {n}")
    records = self.preview(n)
    path = os.path.join(output_dir, "data_preview.jsonl")
    if jax.process_index() == 0:
      os.makedirs(output_dir, exist_ok=True)
      with open(path, "w", encoding="utf-8") as f:
        for r in records:
          f.write(json.dumps(r, ensure_ascii=False) + "\n")
      for r in records[:show]:
        names = [k.removesuffix("_scored_positions") for k in r if k.endswith("_scored_positions")]
        print(f"--- {'pair' if 'label' not in r else 'example'} {r['index']}: "
              f"{len(r['prompt_ids'])} prompt tokens, "
              f"{' / '.join(str(len(r[f'{k}_scored_positions'])) for k in names)} scored "
              f"{' / '.join(names)} tokens" + (f", label {r['label']}" if "label" in r else "")
              + (f", prompt {r['prompt_cut']}" if "prompt_cut" in r else ""))
        for k in ("prompt", *names):
          print(f"{k}_text: {r[f'{k}_text']!r}")
      for report in self.reports:  # each data file's cut prompts, counted
        cut = report.get("prompt_cuts", {})
        for part, counts in cut.items() if "train" in cut else ((report.get("role"), cut),):
          if chat.describe_cuts(counts):
            print(f"{report['path']} {part}: over --max_prompt_length, "
                  f"{chat.describe_cuts(counts)}")
      split = "" if self.rm_pairs is None else (
          f" (the policy stages'; --rm_split gives the reward model "
          f"{len(self.rm_pairs['tokens'])} others)")
      print(f"wrote {len(records)} {'pairs' if self.pairs is not None else 'examples'}{split} to "
            f"{path}; --inspect_data: not training", flush=True)
    return {"inspect_data": path, "pairs": len(records), "data": self.reports}


def initial_params(cfg, key: jax.Array, mesh) -> tuple[Any, Any]:
  """(config, params): random init, or `--init_from`: hf:DIR (its config replaces the model
  section) or a dpo-jax params checkpoint (an SFT output, an exported policy). An hf:DIR
  whose config.json names a `*ForSequenceClassification` is a reward model: its params hold
  the head `score` and no LM head, and only the rm stage starts from it."""
  src = cfg.checkpoint.init_from
  # A base that stays frozen from the start (no sft stage) is born, or read, straight into
  # --base_quant's format, one layer at a time: an 8B float32 copy would not fit one chip.
  frozen = not any(a.trains_base for a in registry.recipe(cfg.run.stages))
  if not src:
    return cfg, (transformer.init_base if frozen else transformer.init)(cfg.model, key, mesh)
  kind, _, path = src.partition(":")
  if kind == "hf":
    from models import hf  # optional-format code stays out of the default path
    reward = hf.is_reward_model(path)
    if reward and not all(a.scores for a in registry.recipe(cfg.run.stages)):
      raise ValueError(f"--init_from={src}: a *ForSequenceClassification (a reward model) has "
                       f"no LM head; only a reward-model stage starts from it (--stage="
                       f"{','.join(a.name for a in registry.ALGORITHMS.values() if a.scores)}), "
                       f"not --stage={cfg.run.stage}")
    model_cfg, params = hf.load(path, mesh, cfg.model, reward=reward,
                                quantize=cfg.model.base_quant if frozen else "none")
    if model_cfg.router_losses and not model_cfg.n_experts:
      raise ValueError(f"--router_aux_loss_coef={model_cfg.router_aux_loss_coef}, "
                       f"--router_z_loss_coef={model_cfg.router_z_loss_coef}: the {model_cfg.arch} "
                       f"model of --init_from={src} has no experts (a router's losses need them)")
    logging.info("imported %s%s (%s) from %s", model_cfg.arch, " reward model" if reward else "",
                 src, path)
    return dataclasses.replace(cfg, model=model_cfg), params
  logging.info("init: loading checkpoint %s", src)
  return cfg, checkpoint.load_params(src, cfg.model, mesh)


def log_memory_estimate(cfg, mesh) -> dict[str, int]:
  """Logs the per-device bytes of the DPO stage's weights, trainable part and optimizer state."""
  est = train.memory_estimate(train.StepConfig.dpo(cfg), mesh)
  mib = lambda n: f"{n / 2**20:.2f} MiB"
  logging.info("per-device memory estimate (DPO stage, before activations): %s weights %s, "
               "%s %s, optimizer state %s, total %s",
               "frozen base" if cfg.lora.enabled else "frozen reference", mib(est["frozen"]),
               "LoRA" if cfg.lora.enabled else "policy weights", mib(est["trainable"]),
               mib(est["optimizer"]), mib(est["total"]))
  replicated = sharding.replicated_axes(transformer.param_specs(cfg.model), mesh)
  if replicated:
    logging.warning("mesh axes that do not divide a parameter dimension leave it replicated: %s",
                    "; ".join(f"{k}: {v}" for k, v in replicated.items()))
  return est


def _check_batch(cfg, mesh) -> None:
  shards = sharding.batch_shards(mesh)
  if cfg.optim.global_batch_size % shards:
    raise ValueError(f"--global_batch_size={cfg.optim.global_batch_size} is not divisible by "
                     f"the {shards} ways the mesh {dict(mesh.shape)} splits the batch")
  k = cfg.optim.gradient_accumulation_steps
  if cfg.optim.global_batch_size % (k * shards):
    raise ValueError(f"--global_batch_size={cfg.optim.global_batch_size} is not divisible by "
                     f"--gradient_accumulation_steps={k} x the {shards} ways the mesh splits "
                     "the batch (each device's rows split evenly between microbatches)")


# Config fields that say where a run writes, not what it computes: left out of config_sha256, so
# the same run in two folders has one hash.
_WHERE = ("output_dir", "data_cache_dir", "ref_cache_dir", "wandb_project", "wandb_mode",
          "autotune_from")


def provenance(cfg, mesh) -> dict[str, Any]:
  """What a result was measured with: package versions, devices, mesh, the hash of the resolved
  config less the fields of `_WHERE`."""
  versions = {name: md.version(name) for name in ("jax", "jaxlib", "optax", "numpy")}
  versions["python"] = platform.python_version()
  defining = {s: {k: v for k, v in fields.items() if k not in _WHERE}
              for s, fields in cfg.to_dict().items()}
  config_json = json.dumps(defining, sort_keys=True, default=str)
  return {"versions": versions, "device_kind": jax.devices()[0].device_kind,
          "device_count": jax.device_count(), "process_count": jax.process_count(),
          "mesh": dict(mesh.shape),
          "config_sha256": hashlib.sha256(config_json.encode()).hexdigest()}


def _write_flags(cfg, writer: MetricsWriter) -> None:
  """Logs the settings that differ from the preset and writes them to <output_dir>/flags.txt,
  which `launch.py --flagfile=` reads back (the config as given, before an hf: import fills in
  the model section; config.json holds the resolved one). With --autotune=on the file names the
  run's autotune.json (--autotune_from), so a rerun from it, into any --output_dir, trains with
  this run's choices."""
  if cfg.run.autotune == "on" and not cfg.run.autotune_from:
    cfg = cfg.replace(autotune_from=os.path.abspath(os.path.join(cfg.run.output_dir,
                                                                 autotune.FILE)))
  lines = cli.flag_lines(cfg)
  logging.info("config %s; settings that differ from it: %s", cfg.run.config,
               " ".join(lines[1:]) or "none")
  if writer.enabled:
    with open(os.path.join(cfg.run.output_dir, "flags.txt"), "w") as f:
      f.write("\n".join(lines) + "\n")


def run(cfg, mesh=None, init_params=None,
        extra_hooks: Mapping[str, Sequence[Hook]] | None = None) -> dict[str, Any]:
  """Runs the configured stages and returns the summary (also written to summary.json).

  `init_params` replaces the starting model (e.g. one SFT model shared by several DPO runs; see
  dpo/tools/compare_losses.py); `extra_hooks` adds hooks per stage name (tests inject faults).
  """
  with progress.doing(f"the run in {cfg.run.output_dir}"):
    return _run(cfg, mesh, init_params, extra_hooks)


def _run(cfg, mesh, init_params, extra_hooks) -> dict[str, Any]:
  t_start = time.perf_counter()
  out = cfg.run.output_dir
  given, cfg = cfg, hub.resolve(cfg)  # Hub model names -> snapshot folders; flags.txt: as given
  if cfg.data.inspect_data != 0:
    return Data(cfg, check_sizes=False).inspect(cfg.data.inspect_data, out)
  missing = [m for m in cfg.run.imports if m not in sys.modules]
  if missing:
    raise ValueError(f"--imports={','.join(cfg.run.imports)}: {', '.join(missing)} was not "
                     f"imported before the config was built (launch.py imports them first; a "
                     f"script imports them before configs)")
  recipe = registry.recipe(cfg.run.stages)
  identity.check_policy(cfg.checkpoint.resume, os.path.join(out, "checkpoints"))
  changed_code = identity.check_source(os.path.join(out, "checkpoints"),
                                       cfg.checkpoint.resume_changed_code)
  # A caller's own starting model or hooks are not in the run's digest: it runs.
  finished = None if init_params is not None or extra_hooks else _finished(given, cfg)
  if finished is not None:
    return finished
  resolved = cfg
  mesh = mesh or sharding.make_mesh(cfg.mesh.mesh)
  _check_batch(cfg, mesh)
  writer = MetricsWriter(out, cfg.run.stages, registry.ALGORITHMS)
  _write_flags(given, writer)
  init = lambda c: ((c, init_params) if init_params is not None else
                    initial_params(c, jax.random.fold_in(jax.random.key(c.run.seed), 0), mesh))
  # The data is read before a random init compiles, so the reward functions are tried on it
  # first; an hf: import (no compile) comes first, as its config.json sizes the model.
  imported = cfg.checkpoint.init_from.startswith("hf:") and init_params is None
  if imported:
    cfg, params = init(cfg)
  data = Data(cfg)
  judges.rehearse(cfg, *((data.train_records, "training record") if data.train_records else
                         (data.held_records, "held-out record")), tok=data.tok)
  if not imported:
    cfg, params = init(cfg)
  if writer.enabled:
    with open(os.path.join(out, "config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=2)
  pid, nproc = sharding.process_batch_block(mesh, cfg.optim.global_batch_size)
  logging.info("model: %.2fM parameters, mesh %s, %d processes (this one loads batch block "
               "%d of %d)", transformer.num_params(params) / 1e6, dict(mesh.shape),
               jax.process_count(), pid, nproc)
  log_memory_estimate(cfg, mesh)
  summary: dict[str, Any] = provenance(cfg, mesh)
  if changed_code:
    summary["resumed_onto_changed_code"] = changed_code
  if data.reports:
    summary["data"] = data.reports
  # TensorBoard / W&B get each record of metrics.jsonl as it is written (and flushed, so a
  # crash loses nothing there).
  mirror = tracking.Mirror(cfg, writer)
  program = Program(cfg, mesh, data, writer, extra_hooks or {}, summary)
  init_from = cfg.checkpoint.init_from
  model = registry.Model(params, os.path.abspath(init_from)
                           if init_from and not init_from.startswith("hf:") else init_from)
  for algorithm in recipe:
    with progress.doing(f"the {algorithm.name} stage"):
      model = algorithm.run(program, model)
  mirror.close()  # the final evaluation's record
  summary["wall_time_s"] = round(time.perf_counter() - t_start, 1)
  try:
    summary["run_sha256"] = _run_digest(given, resolved)
  except (ValueError, OSError) as e:  # an input gone since it was read: a rerun runs again
    logging.warning("no run_sha256 in summary.json (%s): a rerun will run again", e)
  summary["saved_models"] = sorted(  # what a rerun checks before it shows this summary
      os.path.relpath(p, out) for p in glob.glob(os.path.join(out, "checkpoints", "*"))
      if checkpoint.is_complete(p))
  if writer.enabled:
    with open(os.path.join(out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    _draw_curves(out)
  logging.info("summary: %s", json.dumps(summary))
  return summary


def _defining_flags(cfg) -> list[str]:
  """The command line that rebuilds `cfg` (`cli.flag_lines`) less the fields of `_WHERE`: a run
  copied to another directory is the same run."""
  return [l for l in cli.flag_lines(cfg) if l[2:].partition("=")[0] not in _WHERE]


def _run_digest(given, cfg) -> str:
  """`identity.run_digest` of the run `given` (resolved: `cfg`), its judge's content included."""
  try:
    judge = judges.fingerprint(cfg)
  except (ValueError, OSError, ImportError):
    judge = "unreadable"  # the evaluation says why
  return identity.run_digest(cfg, _defining_flags(given), judge)


def _intact(out: str, summary: dict) -> bool:
  """Whether every model the finished run saved (summary.json's `saved_models`) is there and
  matches its manifest; a damaged or missing one makes the rerun run (its stage rebuilds it)."""
  for rel in summary.get("saved_models", ()):
    try:
      checkpoint.verify(os.path.join(out, rel))
    except (checkpoint.CheckpointError, OSError) as e:
      logging.info("%s: %s; running the finished run again", rel, e)
      return False
  return True


def _finished(given, cfg) -> dict[str, Any] | None:
  """The summary of this very run if it already finished in --output_dir (its summary.json has
  the same `identity.run_digest`: flags as `given`, data, initial models, library source), shown
  instead of evaluating it again; None otherwise, or with --resume=never. Every process must
  find it for any to skip the run."""
  path = os.path.join(cfg.run.output_dir, "summary.json")
  summary = None
  if cfg.checkpoint.resume != "never" and os.path.exists(path):
    try:
      with open(path) as f:
        summary = json.load(f)
      same = (isinstance(summary, dict) and
              summary.get("run_sha256") == _run_digest(given, cfg))
    except (OSError, ValueError, data_lib.DataError, checkpoint.CheckpointError):
      same = False  # damaged, or its inputs are gone: the run goes on and says what is wrong
    summary = summary if same and _intact(cfg.run.output_dir, summary) else None
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    if not np.all(multihost_utils.process_allgather(np.array(summary is not None))):
      summary = None
  if summary is None:
    return None
  logging.warning("%s holds this run finished (summary.json: the same flags, data, models and "
                  "library source); showing its summary instead of running it again (a fresh "
                  "--output_dir runs it anew)",
                  cfg.run.output_dir)
  if jax.process_index() == 0 and "verdicts" in summary:
    samples_path = os.path.join(cfg.run.output_dir, "samples.jsonl")
    samples = []
    if os.path.exists(samples_path):
      with open(samples_path) as f:
        samples = [json.loads(line) for line in f if line.strip()]
    print(evaluate.report(summary, samples, cfg.eval.eval_show, summary["verdicts"]), flush=True)
  logging.info("summary: %s", json.dumps(summary))
  return summary


def _draw_curves(out: str) -> None:
  """<out>/curves.png from metrics.jsonl, or one line on how to get matplotlib."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    logging.info("no curves.png (matplotlib is not installed): %s", curves.INSTALL)
    return
  logging.info("curves -> %s", curves.render_run(out))

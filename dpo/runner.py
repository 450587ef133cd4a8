"""The stage runner: take a batch, dispatch the step, hand the previous step's metrics to the hooks.

Everything else a stage does is a hook (dpo/hooks.py): logging, the KL guard, checkpoint
cadence, evaluation, TR-DPO reference updates, and the fault injection that tests install. The
runner reads step N - 1's metrics only after dispatching step N, so the host never makes the
device wait; a hook that needs the state itself at a step (a checkpoint, an evaluation) asks for
it with `wants_state`, and the runner settles that step first. Resume and rollback are one
mechanism here (`_restore`): the newest complete checkpoint, or the newest before a bad step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Callable, Collection, Sequence

import jax
import numpy as np

from dpo import checkpoint
from models import sharding


class Hook:
  """What a stage calls out to; every method is optional. `run` is the running `Stage`."""

  def start(self, run: "Stage") -> None:
    """The initial state is built or restored (run.step is where the stage starts)."""

  def before_step(self, run: "Stage", batch: dict) -> dict:
    """The host batch of step run.step + 1, about to be dispatched; returns the batch to use."""
    return batch

  def after_step(self, run: "Stage") -> None:
    """Step run.step is dispatched; run.state is its (not yet computed) output."""

  def metrics(self, run: "Stage", step: int, metrics: dict) -> None:
    """Step `step`'s metrics (device arrays), read one step late; may raise `Rollback`."""

  def wants_state(self, run: "Stage") -> bool:
    """Whether `at_state` should see the state after step run.step."""
    return False

  def at_state(self, run: "Stage") -> None:
    """run.state is settled at run.step (its metrics have been read)."""

  def state_dict(self) -> dict:
    """What this hook must carry across a checkpoint (saved in its meta.json under the hook's
    class name)."""
    return {}

  def load_state_dict(self, meta: dict) -> None:
    """Restores what `state_dict` returned (or {} when the stage starts afresh)."""

  def arrays(self, run: "Stage"):
    """Device arrays this hook must carry across a checkpoint (a pytree), or None."""
    return None

  def arrays_like(self, run: "Stage", meta: dict):
    """The template (`checkpoint.like_of`) of the `arrays` saved with a checkpoint whose
    `state_dict` for this hook was `meta`."""
    return checkpoint.like_of(self.arrays(run))

  def load_arrays(self, run: "Stage", tree) -> None:
    """Restores `arrays` (None: the stage starts afresh)."""


class Rollback(Exception):
  """Raised from `Hook.metrics`: the state measured at `step` is bad; restore the newest
  checkpoint before it and multiply the learning rate by `lr_factor`, at most `limit` times."""

  def __init__(self, step: int, reason: str, lr_factor: float, limit: int):
    super().__init__(f"step {step}: {reason}")
    self.step, self.reason, self.lr_factor, self.limit = step, reason, lr_factor, limit


class TrainingStopped(RuntimeError):
  """The run cannot continue (e.g. more KL-spike rollbacks than --max_rollbacks)."""


def sections(names: Sequence, recipe: Sequence[str], stages: Collection[str]) -> list[int]:
  """The section of metrics.jsonl that each record belongs to, from each record's "stage": the
  index in `recipe` of its stage; -1 (before the recipe's sections) for one of `stages` (every
  registered stage) outside the recipe, an earlier run's; and a record of no stage (an
  evaluation's, "eval") belongs to the stage of the next record that has one (an evaluation
  before a stage's first logged step is that stage's), or at the end of the file to the recipe's
  last stage (the final evaluation's)."""
  out, following = [], len(recipe) - 1
  for name in reversed(names):
    if name in recipe:
      following = recipe.index(name)
    out.append(-1 if name in stages and name not in recipe else following)
  return out[::-1]


class MetricsWriter:
  """One JSON object per line in <output_dir>/metrics.jsonl (process 0 only).

  The file is a log that a resume rewinds, in sections, one per stage of the recipe (`recipe`,
  the run's `--stage`, in order; `sections` says which record is whose). Each checkpoint records
  how many records its stage's own section held when it was saved (`own`), and resuming from it
  keeps those, every earlier stage's section as it is now and every later stage's (`rewind`):
  an earlier stage rebuilt with more or fewer records than the file held (its model copied in
  from another run, whose records are not here) moves nothing of the later ones. So
  records that a resumed or rolled-back run writes again replace the old ones instead of
  duplicating them, and a stage run again to rebuild its export (a damaged SFT model) writes
  into its own section, before the later stages' records, which stay. Dropped records are
  counted in a log line. A torn last line (a kill or a full disk mid-write) is dropped with a
  warning when the file is opened; a write that runs out of space truncates its partial line
  and raises DiskFull.
  """

  def __init__(self, output_dir: str, recipe: Sequence[str], stages: Collection[str] = ()):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(output_dir, "metrics.jsonl")
    self.recipe, self.stages = tuple(recipe), {*stages, *recipe}
    self.count = 0  # records through the section being written (process 0)
    self.before = 0  # records of earlier stages' sections, before it
    self.later = 0  # records of later stages' sections, after it
    self.listeners: list = []  # called with each record once it is in the file (tracking.Mirror)
    if not self.enabled:
      return
    os.makedirs(output_dir, exist_ok=True)
    self.count = len(self._read())

  def _read(self) -> list[bytes]:
    """The file's complete records (lines); a torn or unparsable last line is dropped."""
    if not os.path.exists(self.path):
      return []
    with open(self.path, "rb") as f:
      data = f.read()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    for i, line in enumerate(lines):
      try:
        json.loads(line)
      except ValueError:
        if i < len(lines) - 1:
          raise checkpoint.CheckpointError(
              f"{self.path}:{i + 1}: not a JSON record (the file was edited or damaged; only a "
              f"torn last line is repaired)") from None
        tail, lines = line + b"\n" + tail, lines[:-1]
    if tail:
      logging.warning("%s: dropping a torn last line (%d bytes, from an interrupted write): %r",
                      self.path, len(tail), tail[:80])
      self._replace(lines)
    return lines

  def _replace(self, lines: list) -> None:
    tmp = self.path + ".tmp"
    try:
      with open(tmp, "wb") as f:
        f.writelines(l + b"\n" for l in lines)
        f.flush()
        os.fsync(f.fileno())
    except OSError as e:
      if os.path.exists(tmp):
        os.remove(tmp)
      if checkpoint.is_no_space(e):
        raise checkpoint.DiskFull(f"{self.path}: out of disk space rewriting the metrics "
                                  f"({sum(len(l) + 1 for l in lines):,} bytes needed)") from None
      raise
    os.replace(tmp, self.path)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    line = (json.dumps(record) + "\n").encode()
    if self.later:  # the end of this stage's section is before the later stages' records
      lines = self._read()
      self._replace(lines[:self.count] + [line.rstrip(b"\n")] + lines[self.count:])
    else:
      self._append(line)
    self.count += 1
    for listener in self.listeners:  # the TensorBoard / W&B mirror, on the same disk
      try:
        listener(record)
      except OSError as e:
        if not checkpoint.is_no_space(e):
          raise
        where = os.fsdecode(e.filename) if e.filename else os.path.dirname(self.path)
        raise checkpoint.DiskFull(f"{where}: out of disk "
                                  f"space mirroring a metrics record ({len(line):,} bytes in "
                                  f"metrics.jsonl); free space and rerun to resume") from None

  def _append(self, line: bytes) -> None:
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      start = os.fstat(fd).st_size
      try:
        view = memoryview(line)
        while view:
          view = view[os.write(fd, view):]
      except OSError as e:
        os.ftruncate(fd, start)  # no torn line left behind
        if checkpoint.is_no_space(e):
          raise checkpoint.DiskFull(f"{self.path}: out of disk space writing a metrics record "
                                    f"({len(line):,} bytes needed); free space and rerun to "
                                    f"resume") from None
        raise
    finally:
      os.close(fd)

  def _sections(self, stage: str) -> tuple[list[bytes], ...]:
    """The file's records and, of them, the sections before `stage`'s, its own, the later ones."""
    lines, rank = self._read(), self.recipe.index(stage)
    owners = sections([json.loads(l).get("stage") for l in lines], self.recipe, self.stages)
    part = lambda keep: [l for l, o in zip(lines, owners) if keep(o - rank)]
    return lines, part(lambda d: d < 0), part(lambda d: d == 0), part(lambda d: d > 0)

  def _keep(self, lines: list[bytes], through: list[bytes], later: list[bytes], stage: str,
            why: str) -> None:
    """The file becomes `through` + `later`, and writing goes on at the end of `through`."""
    if through + later != lines:
      self._replace(through + later)
    dropped = len(lines) - len(through) - len(later)
    if dropped:
      logging.info("%s: dropped %d record%s of stage %s %s", self.path, dropped,
                   "s" * (dropped != 1), stage, why)
    self.count, self.later = len(through), len(later)

  @property
  def own(self) -> int:
    """Records of the section being written (a checkpoint records it: `rewind`'s `own`)."""
    return self.count - self.before

  def rewind(self, own: int, what: str, stage: str) -> None:
    """Keeps the first `own` records of `stage`'s section (its section as it was when `what`, a
    checkpoint of `stage`, was saved), every earlier stage's section and every later one's (an
    SFT stage run again to rebuild its export leaves the DPO stage's records to it)."""
    if not self.enabled:
      return
    lines, before, mine, later = self._sections(stage)
    if len(mine) < own:
      logging.warning("%s has %d records of stage %s but %s was saved after %d; the missing "
                      "ones are not rewritten", self.path, len(mine), stage, what, own)
    self._keep(lines, before + mine[:own], later, stage,
               f"written after {what} (its later steps run again)")
    self.before = len(before)

  def rewind_stage(self, stage: str) -> None:
    """Drops `stage`'s section (a stage that starts afresh); the others stay."""
    if not self.enabled:
      return
    lines, before, _, later = self._sections(stage)
    self._keep(lines, before, later, stage, "(the stage starts afresh)")
    self.before = len(before)


@dataclasses.dataclass
class Stage:
  """One stage of a run (an algorithm's, dpo/algorithms). `step_fn(state, frozen, host_batch)
  -> (state, metrics)` dispatches the jitted step; `fresh()` builds the initial state (also the
  rollback target before the first checkpoint); `loader` yields host batches with state() /
  restore(); `step` counts the steps taken, `steps` is the stage's length (`steps_flag`)."""
  name: str
  steps: int
  step_fn: Callable
  fresh: Callable[[], Any]
  frozen: Any
  loader: Any
  ckpts: checkpoint.Manager
  writer: MetricsWriter
  hooks: Sequence[Hook] = ()
  steps_flag: str = "--steps"  # the flag that sets `steps`, for the messages about its length
  blocks: int = 1  # the processes' blocks a host batch is one of (1: each holds the whole batch)
  policy_path: str = ""  # where the policy sits in state.params (registry.Algorithm.policy_path)
  # Live values the hooks read (and some write, e.g. TR-DPO's frozen, the tokens count).
  state: Any = None
  step: int = 0          # steps taken by run.state
  rollbacks: int = 0
  tokens: int = 0        # non-padding tokens up to the step being read, all processes
  _dispatched: int = 0   # the same, up to the last dispatched step
  _frozen0: Any = None     # the frozen part at the stage's fresh start (TR-DPO moves it)

  def run(self):
    self.state, self._frozen0 = self.fresh(), self.frozen
    self._log_state_bytes()
    self._restore(resumed=True)
    pending = None
    while self.step < self.steps or pending is not None:
      try:
        previous, pending = pending, (self._dispatch() if self.step < self.steps else None)
        self._read(previous)
        due = [h for h in self.hooks if h.wants_state(self)] if pending else []
        if due:
          self._read(pending)
          pending = None
          for h in due:
            h.at_state(self)
      except Rollback as rb:
        pending = None
        self._rollback(rb)
    return self.state

  def _dispatch(self) -> tuple[int, dict]:
    batch = next(self.loader)
    for h in self.hooks:
      batch = h.before_step(self, batch)
    self._dispatched += int(batch["segment_ids"].astype(bool).sum()) * self.blocks
    self.state, metrics = self.step_fn(self.state, self.frozen, batch)
    self.step += 1
    for h in self.hooks:
      h.after_step(self)
    return self.step, metrics, self._dispatched

  def _read(self, pending) -> None:
    if pending is not None:
      step, metrics, self.tokens = pending
      for h in self.hooks:
        h.metrics(self, step, metrics)

  def snapshot(self) -> dict:
    """The checkpoint meta of the current position (the state is saved beside it)."""
    meta = {"stage": self.name, "loader": self.loader.state(), "rollbacks": self.rollbacks,
            "steps": self.steps, "metrics_records": self.writer.count,
            "metrics_stage_records": self.writer.own}
    states = {}
    for h in self.hooks:
      state = h.state_dict()
      if state and states.setdefault(type(h).__name__, state) is not state:
        raise ValueError(f"{self.name}: two {type(h).__name__} hooks carry state; a "
                         f"checkpoint keys each hook's state by its class")
    meta["hook_states"] = states
    return meta

  @staticmethod
  def hook_meta(meta: dict, h: Hook) -> dict:
    """Hook `h`'s own state in a checkpoint's meta (`Hook.state_dict`, under its class name;
    checkpoints written before that kept every hook's keys at the top level)."""
    if "hook_states" not in meta:
      return meta
    return meta["hook_states"].get(type(h).__name__, {})

  def _carriers(self) -> list[Hook]:
    return [h for h in self.hooks if h.arrays(self) is not None]

  def save(self) -> None:
    """A checkpoint of the state (and the hooks' arrays beside it: {"state", "hooks"})."""
    carriers, meta = self._carriers(), self.snapshot()
    tree, prefix = self.state, ".params"
    if carriers:
      tree = {"state": self.state, "hooks": {type(h).__name__: h.arrays(self) for h in carriers}}
      prefix = "['state'].params"
    prefix += self.policy_path  # the policy's weights, not a model trained beside them
    if prefix != ".params":
      meta["params_prefix"] = prefix
    path = self.ckpts.save(self.step, tree, meta)
    logging.info("%s: checkpoint step %d -> %s", self.name, self.step, path)

  def _like(self, meta: dict):
    like, carriers = checkpoint.like_of(self.state), self._carriers()
    if not carriers:
      return like
    return {"state": like, "hooks": {type(h).__name__: h.arrays_like(self, self.hook_meta(meta, h))
                                     for h in carriers}}

  def _log_state_bytes(self):
    """One line: the bytes a device holds of the stage's arrays, measured on them (the loop's
    estimate before the run is the DPO stage's; a part trained beside the policy, PPO's value
    model, and its optimizer moments are counted here)."""
    def size(tree):
      n = sharding.placed_bytes(tree)
      return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
    params = self.state.params
    beside = (" (" + ", ".join(f"{k} {size(v)}" for k, v in params.items()) + ")"
              if self.policy_path else "")  # {"policy": ..., "beside": ...}
    logging.info("%s: per-device arrays: frozen %s, trained %s%s, optimizer state %s", self.name,
                 size(self.frozen), size(params), beside, size(self.state.opt_state))

  def _restore(self, before: int | None = None, resumed: bool = False) -> None:
    """Loads the newest intact checkpoint (below `before`) with the loader, hook states and
    metrics position, or the fresh state when there is none."""
    carriers = self._carriers()
    step, state, meta = self.ckpts.restore_latest(self._like, before)
    if step is None:
      self.state = self.state if resumed else self.fresh()
      self.frozen = self._frozen0
      for h in carriers:
        h.load_arrays(self, None)
      meta = {"loader": {"epoch": 0, "index": 0}}
      if resumed:
        self.writer.rewind_stage(self.name)
      else:
        self.writer.rewind(0, f"the start of stage {self.name}", self.name)
    else:
      self.state = state["state"] if carriers else state
      for h in carriers:
        h.load_arrays(self, state["hooks"][type(h).__name__])
      self.writer.rewind(self._own_records(meta), self.ckpts.path(step), self.name)
    self.loader.restore(meta["loader"])
    for h in self.hooks:
      h.load_state_dict(self.hook_meta(meta, h))
    self.step = int(self.state.step)
    if resumed:
      self.rollbacks = meta.get("rollbacks", 0)
      if step is not None:
        self._check_length(step, meta)
        logging.info("%s: resumed from %s (step %d of %d)", self.name, self.ckpts.path(step),
                     step, self.steps)
      for h in self.hooks:
        h.start(self)

  def _own_records(self, meta: dict) -> int:
    """The records of this stage's section when the checkpoint `meta` was saved; a checkpoint
    written before it recorded them holds the count through its section, less the earlier
    sections as they are now (right unless an earlier stage was rebuilt since)."""
    if "metrics_stage_records" in meta:
      return meta["metrics_stage_records"]
    if not self.writer.enabled:
      return 0
    _, before, _, _ = self.writer._sections(self.name)
    return max(meta["metrics_records"] - len(before), 0)

  def _check_length(self, step: int, meta: dict) -> None:
    """--steps below a checkpoint is refused; above the run's earlier --steps, logged."""
    if step > self.steps:
      raise checkpoint.CheckpointError(
          f"{self.steps_flag}={self.steps} is below the checkpoint {self.ckpts.path(step)} "
          f"(step {step}); give {self.steps_flag} >= {step}, or a fresh --output_dir")
    if meta.get("steps", self.steps) != self.steps:
      logging.warning("%s: %s extended from %d to %d; the learning-rate schedule after step %d "
                      "follows the new length", self.name, self.steps_flag, meta["steps"],
                      self.steps, step)

  def _rollback(self, rb: Rollback) -> None:
    """The state measured at rb.step (params after update rb.step - 1) is bad."""
    if self.rollbacks >= rb.limit:
      raise TrainingStopped(
          f"{self.name}: KL spike at step {rb.step} ({rb.reason}) after {self.rollbacks} "
          f"rollbacks already (--max_rollbacks={rb.limit}); stopping. Lower the learning rate, "
          f"or raise --kl_max / --kl_spike_factor if this KL is expected.")
    rollbacks = self.rollbacks + 1
    lr_scale = float(self.state.lr_scale) * rb.lr_factor
    dropped = self.ckpts.delete_from(rb.step - 1)
    self._restore(before=rb.step - 1)  # also rewinds metrics.jsonl to that checkpoint
    self.rollbacks = rollbacks
    self.state = self.state._replace(lr_scale=jax.device_put(
        np.float32(lr_scale), self.state.lr_scale.sharding))
    logging.warning("%s: KL SPIKE at step %d: %s. ROLLBACK %d/%d to step %d%s; learning-rate "
                    "scale now %.3g", self.name, rb.step, rb.reason, self.rollbacks, rb.limit,
                    self.step, f" (dropped checkpoints {dropped})" if dropped else "", lr_scale)
    self.writer.write({"stage": self.name, "step": rb.step, "event": "rollback",
                       "reason": rb.reason, "to_step": self.step, "lr_scale": lr_scale,
                       "rollbacks": self.rollbacks})
    self.save()  # the lowered rate survives a crash before the next regular checkpoint

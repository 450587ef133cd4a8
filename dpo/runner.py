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
from typing import Any, Callable, Sequence

import jax
import numpy as np

from dpo import checkpoint


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
    """What this hook must carry across a checkpoint (saved in its meta.json)."""
    return {}

  def load_state_dict(self, meta: dict) -> None:
    """Restores from a checkpoint's meta (or {} when the stage starts afresh)."""


class Rollback(Exception):
  """Raised from `Hook.metrics`: the state measured at `step` is bad; restore the newest
  checkpoint before it and multiply the learning rate by `lr_factor`, at most `limit` times."""

  def __init__(self, step: int, reason: str, lr_factor: float, limit: int):
    super().__init__(f"step {step}: {reason}")
    self.step, self.reason, self.lr_factor, self.limit = step, reason, lr_factor, limit


class TrainingStopped(RuntimeError):
  """The run cannot continue (e.g. more KL-spike rollbacks than --max_rollbacks)."""


class MetricsWriter:
  """Appends one JSON object per record to <output_dir>/metrics.jsonl (process 0 only)."""

  def __init__(self, output_dir: str):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(output_dir, "metrics.jsonl")
    if self.enabled:
      os.makedirs(output_dir, exist_ok=True)

  def write(self, record: dict) -> None:
    if self.enabled:
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")

  def truncate_after(self, stage: str, step: int) -> None:
    """Drops the records a resumed run will write again: this stage's after `step`, other
    records of the same or a later stage at or after `step`, all records of later stages."""
    if not (self.enabled and os.path.exists(self.path)):
      return
    order = lambda name: 0 if name == "sft" else 1  # sft, then dpo and its evaluations
    cur = order(stage)
    with open(self.path) as f:
      records = [json.loads(line) for line in f if line.strip()]
    keep = [r for r in records
            if order(r.get("stage")) < cur or (order(r.get("stage")) == cur and (
                r["step"] <= step if r.get("stage") == stage else r["step"] < step))]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, self.path)


@dataclasses.dataclass
class Stage:
  """One stage (sft or dpo) of a run. `step(state, frozen, host_batch) -> (state, metrics)`
  dispatches the jitted step; `fresh()` builds the initial state (also the rollback target
  before the first checkpoint); `loader` yields host batches with state() / restore()."""
  name: str
  steps: int
  step: Callable
  fresh: Callable[[], Any]
  frozen: Any
  loader: Any
  ckpts: checkpoint.Manager
  writer: MetricsWriter
  hooks: Sequence[Hook] = ()
  # Live values the hooks read (and some write, e.g. TR-DPO's frozen, the tokens count).
  state: Any = None
  at: int = 0            # steps taken by run.state
  rollbacks: int = 0
  tokens: int = 0        # non-padding tokens up to the step being read, all processes
  _dispatched: int = 0   # the same, up to the last dispatched step

  def run(self):
    self.state = self.fresh()
    self._restore(self.ckpts.latest(), resumed=True)
    pending = None
    while self.at < self.steps or pending is not None:
      try:
        previous, pending = pending, (self._dispatch() if self.at < self.steps else None)
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
    self._dispatched += int(batch["segment_ids"].astype(bool).sum()) * jax.process_count()
    self.state, metrics = self.step(self.state, self.frozen, batch)
    self.at += 1
    for h in self.hooks:
      h.after_step(self)
    return self.at, metrics, self._dispatched

  def _read(self, pending) -> None:
    if pending is not None:
      step, metrics, self.tokens = pending
      for h in self.hooks:
        h.metrics(self, step, metrics)

  def snapshot(self) -> dict:
    """The checkpoint meta of the current position (the state is saved beside it)."""
    meta = {"stage": self.name, "loader": self.loader.state(), "rollbacks": self.rollbacks}
    for h in self.hooks:
      meta.update(h.state_dict())
    return meta

  def save(self) -> None:
    path = self.ckpts.save(self.at, self.state, self.snapshot())
    logging.info("%s: checkpoint step %d -> %s", self.name, self.at, path)

  def _restore(self, step: int | None, resumed: bool = False) -> None:
    """Loads checkpoint `step` (None: the fresh state) with the loader and hook states."""
    meta: dict = {"loader": {"epoch": 0, "index": 0}}
    if step is None:
      self.state = self.state if resumed else self.fresh()
    else:
      self.state, meta = self.ckpts.restore(step, checkpoint.like_of(self.state))
    self.loader.restore(meta["loader"])
    for h in self.hooks:
      h.load_state_dict(meta)
    self.at = int(self.state.step)
    if resumed:
      self.rollbacks = meta.get("rollbacks", 0)
      if step is not None:
        self.writer.truncate_after(self.name, step)
        logging.info("%s: resumed from %s (step %d of %d)", self.name, self.ckpts.path(step),
                     step, self.steps)
      for h in self.hooks:
        h.start(self)

  def _rollback(self, rb: Rollback) -> None:
    """The state measured at rb.step (params after update rb.step - 1) is bad."""
    if self.rollbacks >= rb.limit:
      raise TrainingStopped(
          f"{self.name}: KL spike at step {rb.step} ({rb.reason}) after {self.rollbacks} "
          f"rollbacks already (--max_rollbacks={rb.limit}); stopping. Lower the learning rate, "
          f"or raise --kl_max / --kl_spike_factor if this KL is expected.")
    self.rollbacks += 1
    lr_scale = float(self.state.lr_scale) * rb.lr_factor
    dropped = self.ckpts.delete_from(rb.step - 1)
    self._restore(self.ckpts.latest(before=rb.step - 1))
    self.state = self.state._replace(lr_scale=jax.device_put(
        np.float32(lr_scale), self.state.lr_scale.sharding))
    logging.warning("%s: KL SPIKE at step %d: %s. ROLLBACK %d/%d to step %d%s; learning-rate "
                    "scale now %.3g", self.name, rb.step, rb.reason, self.rollbacks, rb.limit,
                    self.at, f" (dropped checkpoints {dropped})" if dropped else "", lr_scale)
    self.writer.write({"stage": self.name, "step": rb.step, "event": "rollback",
                       "reason": rb.reason, "to_step": self.at, "lr_scale": lr_scale,
                       "rollbacks": self.rollbacks})
    self.save()  # the lowered rate survives a crash before the next regular checkpoint

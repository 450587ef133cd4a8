"""Fault injection for tests: stage-runner hooks (dpo/runner.py) and a checkpoint-commit kill.

Installed with `loop.run(cfg, extra_hooks={"dpo": [NanLoss(2)]})`; none of this is reachable
from the user's config or flags.
"""

import logging
import os
import signal

import jax
import numpy as np

from dpo import checkpoint
from dpo.runner import Hook


class SimulatedCrash(RuntimeError):
  """Raised by `Crash`: the process dies after a given step (tests resume)."""


class NanLoss(Hook):
  """Makes step `step`'s loss NaN through a NaN loss mask (the in-step guard must skip it)."""

  def __init__(self, step: int):
    self.step = step

  def before_step(self, run, batch):
    if run.at + 1 != self.step:
      return batch
    logging.warning("fault: NaN loss mask at %s step %d", run.name, self.step)
    return {**batch, "loss_mask": batch["loss_mask"] * np.float32("nan")}


class LrSpike(Hook):
  """Multiplies the learning rate by `factor` for step `step` only, and only before any
  rollback (so the rollback's retry of that step runs at the cut rate)."""

  def __init__(self, step: int, factor: float = 1000.0):
    self.step, self.factor, self.saved = step, factor, None

  def before_step(self, run, batch):
    if run.at + 1 == self.step and run.rollbacks == 0:
      logging.warning("fault: learning rate x%g at %s step %d", self.factor, run.name, self.step)
      self.saved = run.state.lr_scale
      run.state = run.state._replace(lr_scale=jax.device_put(self.saved * self.factor,
                                                             self.saved.sharding))
    return batch

  def after_step(self, run):
    if self.saved is not None:
      run.state, self.saved = run.state._replace(lr_scale=self.saved), None


class Crash(Hook):
  """Raises SimulatedCrash right after step `step` (and its checkpoint, if it has one)."""

  def __init__(self, step: int):
    self.step = step

  def wants_state(self, run):
    return run.at == self.step

  def at_state(self, run):
    raise SimulatedCrash(f"fault: simulated crash after {run.name} step {run.at}")


def kill_during_commit(step: int) -> None:
  """SIGKILL this process when a step-`step` checkpoint is about to commit (its arrays are
  written, its meta.json is not), as a preemption would."""
  commit = checkpoint._commit

  def killing_commit(path, *args):
    if os.path.basename(path) == f"step_{step:08d}":
      logging.warning("fault: SIGKILL during the save of %s", path)
      os.kill(os.getpid(), signal.SIGKILL)
    commit(path, *args)

  checkpoint._commit = killing_commit

"""Fault injection for tests: stage-runner hooks (dpo/runner.py), kills at each phase of a
checkpoint write (real SIGKILL or simulated), a full disk, and a wrong packing layout.

Installed with `loop.run(cfg, extra_hooks={"dpo": [NanLoss(2)]})`; none of this is reachable
from the user's config or flags.
"""

import errno
import logging
import os
import shutil
import signal

import jax
import numpy as np

from dpo import checkpoint, packing
from dpo.runner import Hook


class SimulatedCrash(RuntimeError):
  """Raised by `Crash`: the process dies after a given step (tests resume)."""


class NanLoss(Hook):
  """Makes step `step`'s loss NaN through NaN loss masks (the in-step guard must skip it): the
  pair rows' `loss_mask` and, with prefix sharing, the shared rows' `score_weight`."""

  def __init__(self, step: int):
    self.step = step

  def before_step(self, run, batch):
    if run.step + 1 != self.step:
      return batch
    logging.warning("fault: NaN loss mask at %s step %d", run.name, self.step)
    return {**batch, **{k: batch[k] * np.float32("nan") for k in ("loss_mask", "score_weight")
                        if k in batch}}


class LrSpike(Hook):
  """Multiplies the learning rate by `factor` for step `step` only, and only before any
  rollback (so the rollback's retry of that step runs at the cut rate)."""

  def __init__(self, step: int, factor: float = 1000.0):
    self.step, self.factor, self.saved = step, factor, None

  def before_step(self, run, batch):
    if run.step + 1 == self.step and run.rollbacks == 0:
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
    return run.step == self.step

  def at_state(self, run):
    raise SimulatedCrash(f"fault: simulated crash after {run.name} step {run.step}")


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


def kill_after_checkpoint(step: int) -> None:
  """SIGKILL this process right after a step-`step` checkpoint of its stage is committed (every
  process has passed the save's last barrier), as a host lost between two checkpoints."""
  save = checkpoint.Manager.save

  def killing_save(self, at, *args, **kwargs):
    out = save(self, at, *args, **kwargs)
    if at == step:
      logging.warning("fault: SIGKILL after the checkpoint %s", out)
      os.kill(os.getpid(), signal.SIGKILL)
    return out

  checkpoint.Manager.save = killing_save


def pack_block_zero() -> None:
  """Every process packs process 0's block of each batch (dpo/packing.py Packer.pack), the
  mistake per-process packing must not make: the other processes train on copies of process 0's
  pairs instead of their own."""
  pack = packing.Packer.pack
  logging.warning("fault: every process packs block 0 of the batch")
  packing.Packer.pack = lambda self, batch, block=0: pack(self, batch, 0)


class Killed(BaseException):
  """A simulated SIGKILL: a BaseException, so no `except Exception` cleanup runs; what it leaves
  on disk is what a kill at that instant leaves."""


def kill_at(monkeypatch, phase: str, name: str) -> None:
  """Makes the checkpoint write of directory basename `name` die at `phase`:

  arrays    the arrays are written, nothing else
  meta      meta.json is written, the manifest is not
  manifest  the manifest is written, the directory is not flipped into place
  flip      a replaced step is renamed to .old, the new copy is still .tmp
  cleanup   the new copy is in place, the .old one not yet removed
  delete    a deleted step is renamed to .deleted, not yet removed
  """
  def mine(path):
    return os.path.basename(str(path).rstrip("/")).split(".")[0] == name

  def wrap(owner, attr, before=None, after=None):
    fn = getattr(owner, attr)

    def wrapped(*args, **kwargs):
      for when, test in (("before", before), ("after", after)):
        if when == "after":
          out = fn(*args, **kwargs)
        if test is not None and test(*args):
          logging.warning("fault: simulated kill (%s) %s %s%s", phase, when, attr, args[:2])
          raise Killed(f"killed at {phase} of {name}")
      return out
    monkeypatch.setattr(owner, attr, wrapped)

  suffix = {"cleanup": ".old", "delete": ".deleted"}.get(phase)
  kills = {
      "arrays": lambda: wrap(checkpoint, "_serialize", after=lambda leaves, specs: any(
          mine(os.path.dirname(os.path.dirname(s["kvstore"]["path"]))) for s in specs)),
      "meta": lambda: wrap(checkpoint, "_write_json", before=lambda path, obj: (
          os.path.basename(path) == checkpoint.MANIFEST and mine(os.path.dirname(path)))),
      "manifest": lambda: wrap(checkpoint, "_flip", before=lambda tmp, path: mine(path)),
      "flip": lambda: wrap(checkpoint.os, "rename", after=lambda src, dst: (
          str(dst).endswith(".old") and mine(src))),
      "cleanup": lambda: wrap(checkpoint.shutil, "rmtree", before=lambda path, *a: (
          str(path).endswith(suffix) and mine(path))),
  }
  kills["delete"] = kills["cleanup"]
  if phase not in kills:
    raise ValueError(f"unknown phase {phase!r}")
  kills[phase]()


def no_space(monkeypatch, where: str, after: int = 0) -> None:
  """ENOSPC from the next `where` write ("metrics": a metrics.jsonl append, after `after` good
  records, part of the line written first; "tensorboard": the mirror's event-file append after
  `after` good ones; "checkpoint": tensorstore's array write)."""
  if where == "metrics":
    write, calls = os.write, [0]

    def full_write(fd, data):
      if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == "metrics.jsonl":
        calls[0] += 1
        if calls[0] > after:
          write(fd, bytes(data[:7]))  # a torn start of the line, as a filling disk leaves
          raise OSError(errno.ENOSPC, "No space left on device")
      return write(fd, data)
    monkeypatch.setattr(os, "write", full_write)
  elif where == "checkpoint":
    from jax.experimental.array_serialization import serialization

    async def full_serialize(arr, spec, *a, **kw):
      f = f"{spec['kvstore']['path']}/0"  # tensorstore's words on a full tmpfs
      raise ValueError(f'RESOURCE_EXHAUSTED: Error writing local file "{f}": Failed writing: '
                       f'"{f}.__lock": Failed to write 893728 bytes to file 7: No space left on '
                       f"device [os_error_code='28']")
    monkeypatch.setattr(serialization, "async_serialize", full_serialize)
  elif where == "tensorboard":  # the event file's append in tensorboard's writer thread
    from tensorboard.compat.tensorflow_stub.io import gfile
    real, calls = gfile.io, [0]

    class FullIO:
      def __getattr__(self, name):
        return getattr(real, name)

      def open(self, path, mode="r", *args, **kwargs):
        if "tfevents" in str(path) and "a" in mode:
          calls[0] += 1
          if calls[0] > after:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real.open(path, mode, *args, **kwargs)
    monkeypatch.setattr(gfile, "io", FullIO())
  else:
    raise ValueError(f"unknown place {where!r}")


class Recorder(Hook):
  """Keeps every (step, metrics) the stage reads, as Python floats, including steps that a
  rollback later replays (metrics.jsonl keeps only the replayed ones)."""

  def __init__(self):
    self.seen = []

  def metrics(self, run, step, metrics):
    self.seen.append((step, {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()
                             if np.ndim(v) == 0}))

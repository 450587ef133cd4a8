"""Where a run's records go besides metrics.jsonl: TensorBoard event files and Weights & Biases.

metrics.jsonl (dpo/runner.MetricsWriter) stays the source of truth. `Mirror` listens to its
writer and forwards every record once it is in the file, whichever part of the program wrote it
(the log line's training metrics, evaluations, rollback events), to the sinks: TensorBoard under
<output_dir>/tb/ whenever the tensorboard package is installed (its own summary writer, no
TensorFlow), W&B with --wandb_project. Tags are "<stage>/<metric>" ("sft/loss", "dpo/kl") and
the evaluation's own "eval/<metric>"; a rollback's numbers are "<stage>/rollback/<field>".
Only process 0 writes. With the extras absent the run says once how to get them.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Iterator

import jax


INSTALL = "pip install 'dpo-jax[{}]'"


class MissingExtra(ValueError):
  """A flag asks for an optional package that is not installed (a user error: one line)."""


def scalars(record: dict) -> Iterator[tuple[str, float]]:
  """(tag, value) for each number of a metrics.jsonl record ("step" is the x axis)."""
  stage, event = record.get("stage", "run"), record.get("event")
  prefix = f"{stage}/{event}" if event else stage
  for key, value in record.items():
    if key in ("stage", "step", "event") or isinstance(value, bool):
      continue
    if isinstance(value, (int, float)):
      yield (key if key.startswith(f"{stage}/") else f"{prefix}/{key}"), float(value)


def _quiet_writer_thread(default):
  """A threading.excepthook that leaves tensorboard's event-writer thread's full-disk error to
  the main thread (its flush re-raises it; the metrics writer reports one DiskFull line)."""
  from dpo import checkpoint

  def hook(args):
    if not (type(args.thread).__name__ == "_AsyncWriterThread" and
            checkpoint.is_no_space(args.exc_value)):
      default(args)
  hook.quiet_writer_thread = True
  return hook


class TensorBoard:
  def __init__(self, logdir: str):
    from tensorboard.summary import Writer
    if not getattr(threading.excepthook, "quiet_writer_thread", False):
      threading.excepthook = _quiet_writer_thread(threading.excepthook)
    self.writer = Writer(logdir)

  def write(self, record: dict) -> None:
    for tag, value in scalars(record):
      self.writer.add_scalar(tag, value, record["step"])
    self.writer.flush()  # records come once per log line: `tensorboard --logdir` sees them live

  def close(self) -> None:
    self.writer.close()


class WandB:
  """One W&B run; each stage's metrics are plotted against that stage's step."""

  def __init__(self, cfg):
    import wandb
    self.run = wandb.init(project=cfg.run.wandb_project, mode=cfg.run.wandb_mode,
                          dir=cfg.run.output_dir, config=cfg.to_dict(),
                          name=os.path.basename(os.path.normpath(cfg.run.output_dir)))
    self.stages: set[str] = set()

  def write(self, record: dict) -> None:
    stage = record.get("stage", "run")
    if stage not in self.stages:
      self.stages.add(stage)
      self.run.define_metric(f"{stage}/step")
      self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
    self.run.log({**dict(scalars(record)), f"{stage}/step": record["step"]})

  def close(self) -> None:
    self.run.finish()


def sinks(cfg) -> list:
  """The sinks this run writes to (none on processes other than 0)."""
  if jax.process_index() != 0:
    return []
  out = []
  try:
    out.append(TensorBoard(os.path.join(cfg.run.output_dir, "tb")))
  except ImportError:
    logging.info("TensorBoard logs off (tensorboard is not installed): %s",
                 INSTALL.format("tensorboard"))
  if cfg.run.wandb_project:
    try:
      out.append(WandB(cfg))
    except ImportError:
      raise MissingExtra(f"--wandb_project={cfg.run.wandb_project} needs the wandb package: "
                         f"{INSTALL.format('wandb')}") from None
  return out


class Mirror:
  """Forwards each record the MetricsWriter appends to metrics.jsonl to the sinks. A resume or
  rollback rewinds the file and writes the replayed steps again: the sinks get them again (a
  rollback's event record marks where)."""

  def __init__(self, cfg, writer):
    self.sinks = sinks(cfg) if writer.enabled else []
    writer.listeners.append(self.write)

  def write(self, record: dict) -> None:
    for sink in self.sinks:
      sink.write(record)

  def close(self) -> None:
    for sink in self.sinks:
      sink.close()
    self.sinks = []

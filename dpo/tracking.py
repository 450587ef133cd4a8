"""Where a run's records go besides metrics.jsonl: TensorBoard event files and Weights & Biases.

metrics.jsonl (dpo/runner.MetricsWriter) stays the source of truth. `Mirror` is a stage hook
that forwards every record appended to it, whichever part of the program wrote it (the log
line's training metrics, evaluations, rollback events), to the sinks: TensorBoard under
<output_dir>/tb/ whenever the tensorboard package is installed (its own summary writer, no
TensorFlow), W&B with --wandb_project. Tags are "<stage>/<metric>" ("sft/loss", "dpo/kl") and
the evaluation's own "eval/<metric>"; a rollback's numbers are "<stage>/rollback/<field>".
Only process 0 writes. With the extras absent the run says once how to get them.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Iterator

import jax

from dpo.runner import Hook, Stage

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


class TensorBoard:
  def __init__(self, logdir: str):
    from tensorboard.summary import Writer
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


class Mirror(Hook):
  """Forwards the records appended to metrics.jsonl to the sinks, at each step's metrics (after
  the hooks before it in the list wrote theirs) and at `close`. On a resume the file was
  truncated to the checkpoint; reading goes on from its new end."""

  def __init__(self, cfg, path: str):
    self.sinks, self.path = sinks(cfg), path
    self.offset = os.path.getsize(path) if os.path.exists(path) else 0

  def _forward(self) -> None:
    if not (self.sinks and os.path.exists(self.path)):
      return
    with open(self.path) as f:
      f.seek(self.offset)
      lines = f.readlines()
      self.offset = f.tell()
    for line in lines:
      if line.strip():
        record = json.loads(line)
        for sink in self.sinks:
          sink.write(record)

  def start(self, run: Stage) -> None:
    self._forward()
    self.offset = min(self.offset, os.path.getsize(self.path) if os.path.exists(self.path) else 0)

  def metrics(self, run: Stage, step: int, metrics: dict) -> None:
    self._forward()

  def close(self) -> None:
    self._forward()
    for sink in self.sinks:
      sink.close()
    self.sinks = []

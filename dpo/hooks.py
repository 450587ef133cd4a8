"""The stage runner's hooks (dpo/runner.py): each side concern of a stage in one small class.

A stage's hooks run in list order; `loop.py` builds the list: the KL guard first (a spike stops
the step's metrics before they are logged), then logging, checkpoint cadence, evaluation and
TR-DPO reference updates. Tests add fault-injection hooks of their own (tests/faults.py).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import jax
import numpy as np

from dpo import checkpoint, guards, reference, registry
from dpo.runner import Hook, Rollback, Stage


def to_python(metrics: dict) -> dict:
  """Device metrics -> JSON-ready floats and lists."""
  host = jax.device_get(metrics)
  return {k: (float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()) for k, v in host.items()}


class LogMetrics(Hook):
  """One log line and one metrics.jsonl record every `every` steps and at the last step, with
  tokens/s over the interval and an ETA (time spent in evaluation is left out of both)."""

  def __init__(self, every: int):
    self.every = every
    self.paused = 0.0  # seconds the Evaluate hook spent since the last log line

  def start(self, run: Stage) -> None:
    self.t0 = self.t_last = time.perf_counter()
    self.first, self.tokens_last = run.step, run.tokens

  def metrics(self, run: Stage, step: int, metrics: dict) -> None:
    if step % self.every and step != run.steps:
      return
    now = time.perf_counter()
    tps = (run.tokens - self.tokens_last) / max(now - self.t_last - self.paused, 1e-9)
    self.t0 += self.paused
    self.t_last, self.tokens_last, self.paused = now, run.tokens, 0.0
    eta = (now - self.t0) / max(step - self.first, 1) * (run.steps - step)
    m = to_python(metrics)
    # The algorithm's columns (registry.Algorithm.columns); one the step did not compute (the
    # exact token KL without --log_kl) is left out, never printed as NaN.
    algorithm = registry.ALGORITHMS.get(run.name)
    columns = algorithm.columns if algorithm is not None else registry.COLUMNS
    shown = "  ".join(f"{label} {'%' + fmt}" % m[key] for label, key, fmt in columns if key in m)
    logging.info("%s %5d/%d  %s  %.0f tok/s  eta %.0fs", run.name, step, run.steps, shown, tps,
                 eta)
    run.writer.write({"stage": run.name, "step": step, **m, "tokens_per_sec": tps})


class KLGuard(Hook):
  """Reads each step's KL (or its estimate); a spike (dpo/guards.py) raises a rollback with the
  learning-rate cut. Its history travels with the checkpoints so a resumed run judges as an
  uninterrupted one.

  What it watches (`Config.kl_estimate`), in nats per completion token:
    kl         the exact token KL(pi || pi_ref) the step computes (--log_kl or --kl_max);
    logratio   otherwise: |log pi/pi_ref| of the batch's chosen and rejected completions (from
               the implicit rewards, divided by beta and the data's mean completion length),
               free in every step, with the reference in the step or precomputed;
    nll_drift  reference-free losses: how far the chosen completions' NLL has moved from the
               stage's first step (the policy's drift from where it started).
  """

  ESTIMATES = {"kl": "the exact token KL(pi||ref) of each step",
               "logratio": "|log pi/pi_ref| per token of the batch's pairs",
               "nll_drift": "the drift of the chosen NLL per token from the first step "
                            "(reference-free loss)"}

  def __init__(self, cfg, estimate: str = "kl", beta: float = 1.0,
               tokens_per_sequence: float = 1.0):  # a GuardConfig
    if estimate not in self.ESTIMATES:
      raise ValueError(f"unknown KL estimate {estimate!r}; one of {sorted(self.ESTIMATES)}")
    self.cfg, self.estimate = cfg, estimate
    self.beta, self.tokens = beta, max(tokens_per_sequence, 1e-9)
    self.guard = guards.SpikeDetector(cfg.kl_max, cfg.kl_spike_factor, cfg.kl_window,
                                      cfg.kl_spike_min)
    self.first_nll = None

  def start(self, run: Stage) -> None:
    logging.info("KL guard: roll back when %s exceeds %s", self.ESTIMATES[self.estimate], " or ".join(
        ([f"{self.cfg.kl_max:g}"] if self.cfg.kl_max else []) +
        ([f"{self.cfg.kl_spike_factor:g} x its largest value over the last {self.cfg.kl_window} "
          f"steps (once above "
          f"{self.cfg.kl_spike_min:g})"] if self.cfg.kl_spike_factor else [])))

  def value(self, metrics: dict) -> float:
    if self.estimate == "kl":
      return float(metrics["kl"])
    if self.estimate == "logratio":
      r = abs(float(metrics["rewards/chosen"])) + abs(float(metrics["rewards/rejected"]))
      return r / (2 * self.beta * self.tokens)
    nll = -float(metrics["logps/chosen"]) / self.tokens
    if self.first_nll is None and math.isfinite(nll):
      self.first_nll = nll
    return abs(nll - self.first_nll) if self.first_nll is not None else float("nan")

  def metrics(self, run: Stage, step: int, metrics: dict) -> None:
    reason = self.guard.check(self.value(metrics))
    if reason is not None:
      raise Rollback(step, f"{self.estimate} {reason.removeprefix('kl ')}",
                     self.cfg.rollback_lr_factor, self.cfg.max_rollbacks)

  def state_dict(self) -> dict:
    return {"kl_history": list(self.guard.history), "kl_first_nll": self.first_nll}

  def load_state_dict(self, meta: dict) -> None:
    self.guard.history = list(meta.get("kl_history", ()))
    self.first_nll = meta.get("kl_first_nll")


class SaveCheckpoints(Hook):
  """A checkpoint every `every` steps (0: none) and at the last step."""

  def __init__(self, every: int):
    self.every = every

  def wants_state(self, run: Stage) -> bool:
    return (self.every and run.step % self.every == 0) or run.step == run.steps

  def at_state(self, run: Stage) -> None:
    run.save()


class Evaluate(Hook):
  """`evaluate(step, state)` every `every` steps before the last (the program evaluates the
  final state itself)."""

  def __init__(self, every: int, evaluate: Callable, log: LogMetrics):
    self.every, self.evaluate, self.log = every, evaluate, log

  def wants_state(self, run: Stage) -> bool:
    return bool(self.every) and run.step % self.every == 0 and run.step < run.steps

  def at_state(self, run: Stage) -> None:
    t = time.perf_counter()
    self.evaluate(run.step, run.state)
    self.log.paused += time.perf_counter() - t


class UpdateReference(Hook):
  """TR-DPO: after each step, possibly mix the policy into the frozen reference. The moving
  reference (the adapter, or the full copy without LoRA) travels with the checkpoints, so a
  resume or a rollback continues against the reference of that step, not the initial one."""

  def __init__(self, cfg):  # a ReferenceConfig
    self.cfg = cfg
    self.rank = None  # the reference adapter's rank (LoRA: soft updates stack adapters)

  def after_step(self, run: Stage) -> None:
    run.frozen = reference.maybe_update(self.cfg, run.step, run.state, run.frozen)
    self._track(run)

  def arrays(self, run: Stage):
    return run.frozen.params if run.frozen.ref_lora is None else run.frozen.ref_lora

  def state_dict(self) -> dict:
    return {"ref_rank": self.rank} if self.rank is not None else {}

  def arrays_like(self, run: Stage, meta: dict):
    like = checkpoint.like_of(self.arrays(run))
    if run.frozen.ref_lora is None or "ref_rank" not in meta:
      return like
    r = meta["ref_rank"]  # the stacked adapter's rank at that checkpoint (soft updates grow it)
    return {g: {t: {"a": _with_rank(f["a"], -1, r), "b": _with_rank(f["b"], 1, r)}
                for t, f in targets.items()} for g, targets in like.items()}

  def load_arrays(self, run: Stage, tree) -> None:
    if tree is not None:
      run.frozen = (run.frozen._replace(params=tree) if run.frozen.ref_lora is None else
                    run.frozen._replace(ref_lora=tree))
    self._track(run)

  def _track(self, run: Stage) -> None:
    lora = run.frozen.ref_lora
    self.rank = None if lora is None else jax.tree.leaves(lora)[0].shape[-1]


def _with_rank(like: jax.ShapeDtypeStruct, axis: int, rank: int) -> jax.ShapeDtypeStruct:
  shape = list(like.shape)
  shape[axis] = rank
  return jax.ShapeDtypeStruct(tuple(shape), like.dtype, sharding=like.sharding)

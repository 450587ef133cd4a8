"""What the stages of one run share (`Program`) and how any algorithm's stage is built on it."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax

from dpo import autotune, checkpoint, identity, packing, train
from dpo import data as data_lib
from dpo.runner import Hook, MetricsWriter, Stage
from models import sharding

# Packing chooses its row-count buckets on at most this many of the first epoch's batches.
_FIT_BATCHES = 1000
# --autotune times each candidate's step this many times (after its compiling call).
_AUTOTUNE_ROUNDS = 3


class Start(NamedTuple):
  """What a stage starts from: `fresh()` builds its initial train state (called only when no
  checkpoint resumes it), `frozen` is what its step reads and never trains (None for none),
  `initial` the content digest of the model it starts from (`identity.model_digest`), and
  `info` what is recorded beside each checkpoint."""
  fresh: Callable[[], Any]
  frozen: Any
  initial: str
  info: dict


@dataclasses.dataclass
class Program:
  """What the stages of one run share: the config, the mesh, the data (`loop.Data`), the
  metrics file, the hooks tests add per stage name, and the summary the stages fill in."""
  cfg: Any
  mesh: Any
  data: Any
  writer: MetricsWriter
  extra_hooks: Mapping[str, Sequence[Hook]]
  summary: dict = dataclasses.field(default_factory=dict)

  def stage(self, algorithm, start: Start, arrays, hooks: list,
            to_pack: dict | None = None, online: Callable | None = None) -> Stage:
    """The stage of `algorithm` (dpo/algorithms) over `arrays` from `start`, resuming from
    <output_dir>/checkpoints/<name>; the stage's fingerprint is what a checkpoint must match to
    be resumed. `to_pack` (every pair's shared-prefix rows) packs each batch's rows from them
    (--packing). `online(spec, update)` builds the dispatch of a stage whose host batch is not
    the rows it trains on (an online stage samples them first), from `update(state, frozen,
    typed batch)`, the jitted step on the mesh; with `online.whole_batch` every process holds the
    whole host batch and hands `update` its own block of the rows (`train.process_block`)."""
    c, o, name = self.cfg, self.cfg.optim, algorithm.name
    pid, nproc = sharding.process_batch_block(self.mesh, o.global_batch_size)
    rows = getattr(online, "prompts_per_step", o.global_batch_size)  # GRPO: prompts, not rows
    # `online.whole_batch`: every process draws the whole batch (they sample it together).
    block = (0, 1) if getattr(online, "whole_batch", False) else (pid, nproc)
    loader = data_lib.Loader(arrays, rows, c.run.seed + algorithm.loader_seed, block)
    if to_pack is not None:
      k = o.gradient_accumulation_steps
      packer = packing.Packer(to_pack, o.global_batch_size, nproc, k,
                              sharding.batch_shards(self.mesh) * k)
      logging.info("%s", packer.fit(loader.batch_rows(0)[:_FIT_BATCHES]))
      loader.pack = packer.pack
    if online is None:
      c = self._autotune(algorithm, start, loader)
    elif c.run.autotune == "on":
      logging.info("autotune %s: not tuned (its batches are sampled as it trains); the config's "
                   "settings", name)
    spec = algorithm.step_config(c)

    def update(state, frozen, typed):  # jit_step is cached: one compile per stage
      step = train.jit_step(algorithm.step, spec, self.mesh, state, frozen)
      return step(state, frozen, train.device_batch(self.mesh, typed, o.global_batch_size))

    dispatch = (online(spec, update) if online is not None else
                lambda state, frozen, batch: update(state, frozen, algorithm.batch(batch)))

    if getattr(online, "repeat", 1) > 1:
      loader = data_lib.Repeat(loader, online.repeat)
    ckpts = checkpoint.Manager(os.path.join(c.run.output_dir, "checkpoints", name),
                               c.checkpoint.keep_checkpoints,
                               {"fingerprint": self.fingerprint(algorithm, arrays, start.initial,
                                                                c)},
                               start.info)
    return Stage(name, spec.total_steps, dispatch, start.fresh, start.frozen, loader, ckpts,
                 self.writer,
                 [*hooks, *self.extra_hooks.get(name, ())], algorithm.steps_flag,
                 blocks=block[1], policy_path=algorithm.policy_path)

  def fingerprint(self, algorithm, arrays, initial: str, cfg=None) -> dict:
    """The fingerprint of `algorithm`'s stage over `arrays` from the model `initial`, run with
    `cfg` (a stage's own after --autotune; default the program's with the stage's recorded
    --autotune choice, which its checkpoints and saved model were written with)."""
    cfg = cfg or autotune.recorded(self.cfg, algorithm.name, self.cfg.run.output_dir)
    return identity.fingerprint(cfg, algorithm.hyperparameters(cfg), algorithm.data_files,
                                arrays, initial)

  def _autotune(self, algorithm, start: Start, loader):
    """The program's config with the stage's --autotune choice (dpo/autotune.py), timed on the
    stage's first batch from a fresh state; the config itself with --autotune=off."""
    c = self.cfg
    if c.run.autotune == "off":
      return c
    if jax.process_count() > 1:  # each process would time, and choose, on its own
      raise ValueError(f"--autotune=on: single-process runs only ({jax.process_count()} "
                       f"processes); give the settings as flags, or --autotune=off")
    position = loader.state()
    host = algorithm.batch(next(loader))
    loader.restore(position)
    batch = train.device_batch(self.mesh, host, c.optim.global_batch_size)

    timer = None

    def time_steps(settings: list[dict]) -> list[float]:
      nonlocal timer
      if timer is None:  # built only where no record or cache answers, once for both passes
        state = start.fresh()
        state_sh, frozen_sh = train.shardings(state), train.shardings(start.frozen)  # live

        def step_of(setting: dict):
          spec = algorithm.step_config(c.replace(**setting))
          return train.jit_step_with_shardings(algorithm.step, spec, self.mesh, state_sh,
                                               frozen_sh)

        # The run builds its own state after measuring: this one is donated, not copied.
        timer = autotune.interleaved(step_of, state, start.frozen, batch,
                                     _AUTOTUNE_ROUNDS)
      return timer(settings)
    shapes = {jax.tree_util.keystr(k): tuple(v.shape)
              for k, v in jax.tree_util.tree_leaves_with_path(host)}
    slots = max(v.shape[-1] for v in jax.tree.leaves(host))
    return autotune.tuned(c, autotune.Trial(algorithm.name, shapes, slots, time_steps,
                                            c.run.output_dir))

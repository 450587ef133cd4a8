"""What the stages of one run share (`Program`) and how any algorithm's stage is built on it."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from dpo import checkpoint, identity, packing, train
from dpo import data as data_lib
from dpo.runner import Hook, MetricsWriter, Stage
from models import sharding

# Packing chooses its row-count buckets on at most this many of the first epoch's batches.
_FIT_BATCHES = 1000


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
    typed batch)`, the jitted step on the mesh."""
    c, o, name = self.cfg, self.cfg.optim, algorithm.name
    spec = algorithm.step_config(c)
    pid, nproc = sharding.process_batch_block(self.mesh, o.global_batch_size)

    def update(state, frozen, typed):  # jit_step is cached: one compile per stage
      step = train.jit_step(algorithm.step, spec, self.mesh, state, frozen)
      return step(state, frozen, train.device_batch(self.mesh, typed, o.global_batch_size))

    dispatch = (online(spec, update) if online is not None else
                lambda state, frozen, batch: update(state, frozen, algorithm.batch(batch)))

    rows = getattr(online, "prompts_per_step", o.global_batch_size)  # GRPO: prompts, not rows
    loader = data_lib.Loader(arrays, rows, c.run.seed + algorithm.data_seed, (pid, nproc))
    if to_pack is not None:
      k = o.gradient_accumulation_steps
      packer = packing.Packer(to_pack, o.global_batch_size, nproc, k,
                              sharding.batch_shards(self.mesh) * k)
      logging.info("%s", packer.fit(loader.batch_rows(0)[:_FIT_BATCHES]))
      loader.pack = packer.pack
    if getattr(online, "repeat", 1) > 1:
      loader = data_lib.Repeat(loader, online.repeat)
    ckpts = checkpoint.Manager(os.path.join(c.run.output_dir, "checkpoints", name),
                               c.checkpoint.keep_checkpoints,
                               {"fingerprint": self.fingerprint(algorithm, arrays, start.initial)},
                               start.info)
    return Stage(name, spec.total_steps, dispatch, start.fresh, start.frozen, loader, ckpts,
                 self.writer,
                 [*hooks, *self.extra_hooks.get(name, ())], algorithm.steps_flag)

  def fingerprint(self, algorithm, arrays, initial: str) -> dict:
    """The fingerprint of `algorithm`'s stage over `arrays` from the model `initial`."""
    return identity.fingerprint(self.cfg, algorithm.hyperparameters(self.cfg),
                                algorithm.data_files, arrays, initial)

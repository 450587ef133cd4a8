"""DPO step time with the reference forward in the step vs precomputed reference log-probs.

    python -m dpo.tools.bench_precompute_ref [--config=default] [--timed_steps=30] [--lora_rank=16]

Both variants run the step a run jits (`train.jit_step`: sharded over --mesh, state donated and
threaded through) on the same batches; the precomputed one gets ref_logps / ref_shared_logps
with each batch (`reference.cached`, as --precompute_ref does) and skips the reference forward.
Each variant threads its own state, from the same initial state, through the same batches, so
their last losses, printed side by side, agree up to float rounding unless the precomputed
statistics are wrong. Timing
alternates blocks of 5 steps between the two variants so machine load affects both alike, and
reports the median wall and process-CPU seconds per step (compile excluded); on a shared,
overloaded machine the CPU figure is the meaningful one.

Every config flag applies and is checked as for a run with --precompute_ref; --timed_steps is
the tool's own. With --log_kl (on in the default preset) the in-step variant also computes the
token KL, which needs the reference logits, as a run does; the precomputed variant cannot. The
reference statistics are cached under --ref_cache_dir, or in a temporary directory removed once
they are read.
"""

from __future__ import annotations

import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from dpo import cli, loop, reference, train
from dpo.batches import PairBatch
from models import sharding, transformer

FLAGS = flags.FLAGS
VARIANTS = ("in_step", "precomputed")
BLOCK = 5  # steps per variant before switching to the other


def main(argv) -> None:
  del argv
  cfg = cli.from_flags().replace(precompute_ref=True)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  data = loop.Data(cfg)
  key = jax.random.key(cfg.run.seed)
  base = transformer.init(cfg.model, jax.random.fold_in(key, 0), mesh)
  spec = train.StepConfig.dpo(cfg)
  opt, _ = spec.optimizer()
  frozen = train.initial_frozen(base)
  bs = cfg.optim.global_batch_size
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    ref_arrays, info = reference.cached(
        spec, mesh, frozen, data.pairs,
        reference.Cache(cfg.reference.ref_cache_dir or tmp, data.tok), bs)
  print(f"precompute: {len(data.pairs['tokens'])} pairs in {time.perf_counter() - t0:.1f}s "
        f"(cache {'hit' if info['hit'] else 'miss'})", flush=True)
  n = len(data.pairs["tokens"])
  batches = []
  for i in range(FLAGS.timed_steps):
    rows = np.arange(i * bs, (i + 1) * bs) % n
    plain = {k: v[rows] for k, v in data.pairs.items()}
    with_ref = {**plain, **{k: v[rows] for k, v in ref_arrays.items()}}
    batches.append({"in_step": train.device_batch(mesh, PairBatch.of(plain)),
                    "precomputed": train.device_batch(mesh, PairBatch.of(with_ref))})

  def fresh():
    trainable = train.initial_trainable(cfg.model, cfg.lora, base, jax.random.fold_in(key, 1),
                                        mesh)
    return train.init_state(trainable, opt, cfg.run.seed, mesh)

  states = {v: fresh() for v in VARIANTS}
  step = train.jit_step(train.dpo_step, spec, mesh, states["in_step"], frozen)
  last_loss = {}
  for v in VARIANTS:  # compiles each variant
    states[v], _ = step(states[v], frozen, batches[0][v])
  wall = {v: [] for v in VARIANTS}
  cpu = {v: [] for v in VARIANTS}
  for start in range(0, FLAGS.timed_steps, BLOCK):
    for v in VARIANTS:
      for i in range(start, min(start + BLOCK, FLAGS.timed_steps)):
        t, c = time.perf_counter(), time.process_time()
        states[v], m = step(states[v], frozen, batches[i][v])
        jax.block_until_ready((states[v], m))
        wall[v].append(time.perf_counter() - t)
        cpu[v].append(time.process_time() - c)
      last_loss[v] = float(m["loss"])
  print(f"config={FLAGS.config} lora_rank={cfg.lora.lora_rank} batch={bs} "
        f"T={data.pairs['tokens'].shape[-1]} steps={FLAGS.timed_steps} kl={spec.kl} "
        f"mesh={dict(mesh.shape)} device={jax.devices()[0].platform}")
  print(f"last loss:           in-step {last_loss['in_step']:.6f}, "
        f"precomputed {last_loss['precomputed']:.6f}")
  (a, b), (ca, cb) = ([np.median(d[v]) for v in VARIANTS] for d in (wall, cpu))
  print(f"in-step reference:   {a * 1e3:.1f} ms/step wall, {ca * 1e3:.1f} ms/step CPU (medians)")
  print(f"precomputed:         {b * 1e3:.1f} ms/step wall, {cb * 1e3:.1f} ms/step CPU (medians)")
  print(f"saving:              {(1 - b / a) * 100:.1f}% wall, {(1 - cb / ca) * 100:.1f}% CPU")


if __name__ == "__main__":
  cli.define_flags()
  flags.DEFINE_integer("timed_steps", 30, "Timed steps per variant.", lower_bound=1)
  app.run(main)

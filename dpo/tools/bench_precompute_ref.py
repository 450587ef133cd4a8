"""DPO step time with the reference forward in the step vs precomputed reference log-probs.

    python -m dpo.bench_precompute_ref [--config=default] [--steps=30] [--lora_rank=16]

Both variants run the same jitted `dpo_step` on the same batches from the same state; the
precomputed one gets ref_logps / ref_shared_logps with each batch (dpo/reference.py) and skips
the reference forward. Timing alternates blocks of 5 steps between the two variants so machine
load affects both alike, and reports the median wall and process-CPU seconds per step (compile
excluded); on a shared, overloaded machine the CPU figure is the meaningful one.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import numpy as np

import configs
from dpo import loop, reference, train
from models import lora as lora_lib
from models import sharding, transformer


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="default")
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--lora_rank", type=int, default=None)
  args = ap.parse_args()
  cfg = configs.get_config(args.config)
  if args.lora_rank is not None:
    cfg = cfg.replace(lora_rank=args.lora_rank)
  cfg = cfg.replace(ref_cache_dir="/tmp/bench_ref_cache", task_train_pairs=512)
  mesh = sharding.make_mesh(cfg.train.mesh)
  data = loop.Data(cfg)
  key = jax.random.key(0)
  params = transformer.init(cfg.model, jax.random.fold_in(key, 0), mesh)
  if cfg.lora.enabled:
    trainable = lora_lib.init(cfg.model, cfg.lora, jax.random.fold_in(key, 1), mesh)
  else:
    trainable = jax.tree.map(lambda x: x.copy(), params)
  frozen = train.Frozen(params)
  t0 = time.perf_counter()
  ref_arrays, info = reference.cached(cfg, mesh, frozen, data.pairs, data.tok)
  print(f"precompute: {len(data.pairs['tokens'])} pairs in {time.perf_counter() - t0:.1f}s "
        f"(cache {'hit' if info['hit'] else 'miss'})", flush=True)
  opt, sched = train.optimizer(cfg, cfg.train.learning_rate, 1000)
  step = jax.jit(functools.partial(train.dpo_step, cfg, opt, sched))
  bs = cfg.train.global_batch_size
  batches = []
  for i in range(args.steps):
    rows = np.arange(i * bs, (i + 1) * bs) % len(data.pairs["tokens"])
    plain = {k: v[rows] for k, v in data.pairs.items()}
    batches.append((train.device_batch(mesh, plain),
                    train.device_batch(mesh, {**plain, **{k: v[rows] for k, v in ref_arrays.items()}})))
  state = train.init_state(trainable, opt, 0, mesh)
  times = {"in_step": [], "precomputed": []}
  cpu = {"in_step": [], "precomputed": []}
  for variant, idx in (("in_step", 0), ("precomputed", 1)):  # compile both
    jax.block_until_ready(step(state, frozen, batches[0][idx]))
  for start in range(0, args.steps, 5):
    for variant, idx in (("in_step", 0), ("precomputed", 1)):
      for i in range(start, min(start + 5, args.steps)):
        t, c = time.perf_counter(), time.process_time()
        out = step(state, frozen, batches[i][idx])
        jax.block_until_ready(out)
        times[variant].append(time.perf_counter() - t)
        cpu[variant].append(time.process_time() - c)
  a, b = np.median(times["in_step"]), np.median(times["precomputed"])
  print(f"config={args.config} lora_rank={cfg.lora.lora_rank} batch={bs} "
        f"T={data.pairs['tokens'].shape[-1]} steps={args.steps} device={jax.devices()[0].platform}")
  ca, cb = np.median(cpu["in_step"]), np.median(cpu["precomputed"])
  print(f"in-step reference:   {a * 1e3:.1f} ms/step wall, {ca * 1e3:.1f} ms/step CPU (medians)")
  print(f"precomputed:         {b * 1e3:.1f} ms/step wall, {cb * 1e3:.1f} ms/step CPU (medians)")
  print(f"saving:              {(1 - b / a) * 100:.1f}% wall, {(1 - cb / ca) * 100:.1f}% CPU")


if __name__ == "__main__":
  main()

"""Benchmark the jitted DPO step: pairs/s, tokens/s and model-FLOP utilisation.

    python -m dpo.tools.bench                # bench-small with LoRA, then with full fine-tuning
    python -m dpo.tools.bench --config=bench-small --nofull_ft --timed_steps=10 --rounds=3

Every config flag applies (--config defaults to bench-small here); the tool's own flags are
--full_ft, --timed_steps, --warmup_steps, --rounds and --matmul_size. The step is the one a run
jits (`train.jit_step`: sharded over --mesh, state donated), built from the run's initial trees
(`train.initial_trainable` / `initial_frozen`, the base quantized with --base_quant).

Utilisation is achieved model FLOP/s over the float32 matmul peak measured in the same process
(a jitted --matmul_size^3 matmul, 2048 by default). The model FLOPs per step use the formula of
shared/BENCHMARKS.md so figures compare across systems:

    FLOPs = 6 * N * T + 12 * n_layers * seq_len^2 * d_model * sequences

with N the layer matrices plus the LM head (embedding excluded), T the tokens per step (chosen +
rejected), and `sequences` = 2 * pairs. This is the nominal training cost of the policy; the
reference forward, LoRA's smaller backward and masked attention are not counted separately, as
in the peers' figures.
"""

from __future__ import annotations

import math
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import configs
from dpo import train
from models import quant, sharding, transformer

FLAGS = flags.FLAGS


def matmul_peak(n: int, reps: int = 20) -> float:
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  best = math.inf
  for _ in range(3):
    t = time.perf_counter()
    for _ in range(reps):
      out = f(a, a)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - t) / reps)
  return 2 * n ** 3 / best


def model_flops(cfg, pairs: int, seq_len: int) -> float:
  m = cfg.model
  per_layer = (m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
               + 3 * m.d_model * m.mlp_dim)
  n = m.n_layers * per_layer + m.d_model * m.vocab_size
  tokens = 2 * pairs * seq_len
  return 6 * n * tokens + 12 * m.n_layers * seq_len ** 2 * m.d_model * 2 * pairs


def synthetic_batch(cfg, pairs: int, rng):
  P, C = cfg.data.max_prompt_length, cfg.data.max_target_length
  T = P + C
  tokens = rng.integers(0, cfg.model.vocab_size, (pairs, 2, T)).astype(np.int32)
  tokens[:, 1, :P] = tokens[:, 0, :P]  # shared prompt
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (pairs, 2, T)).copy()
  loss_mask = np.zeros((pairs, 2, T), np.float32)
  loss_mask[:, :, P:] = 1.0
  return {"tokens": tokens, "positions": positions,
          "segment_ids": np.ones((pairs, 2, T), np.int32), "loss_mask": loss_mask}


def time_config(cfg) -> dict:
  """Median step time of the jitted, sharded DPO step a run uses, from the run's initial trees."""
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  pairs = cfg.optim.global_batch_size
  key = jax.random.key(cfg.run.seed)
  base = quant.quantize_params(transformer.param_specs(cfg.model), cfg.model.base_quant,
                               transformer.init(cfg.model, jax.random.fold_in(key, 0), mesh), mesh)
  spec = train.StepConfig.dpo(cfg)
  opt, _ = spec.optimizer()
  trainable = train.initial_trainable(cfg.model, cfg.lora, base, jax.random.fold_in(key, 1), mesh)
  frozen = train.initial_frozen(base)
  state = train.init_state(trainable, opt, cfg.run.seed, mesh)
  step = train.jit_step(train.dpo_step, spec, mesh, state, frozen)
  batch = train.device_batch(mesh, synthetic_batch(cfg, pairs, np.random.default_rng(0)))
  rounds = []
  first_loss = None
  for _ in range(FLAGS.rounds):
    for _ in range(FLAGS.warmup_steps):
      state, m = step(state, frozen, batch)
      if first_loss is None:
        first_loss = float(m["loss"])
    jax.block_until_ready(state)
    times = []
    for _ in range(FLAGS.timed_steps):
      t = time.perf_counter()
      state, m = step(state, frozen, batch)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t)
    rounds.append(statistics.median(times))
  step_time = statistics.median(rounds)
  seq_len = cfg.data.max_prompt_length + cfg.data.max_target_length
  return {"lora": cfg.lora.enabled, "step_time": step_time,
          "pairs_per_s": pairs / step_time, "tokens_per_s": 2 * pairs * seq_len / step_time,
          "flops": model_flops(cfg, pairs, seq_len), "first_loss": first_loss}


def main(argv):
  del argv
  cfg = configs.from_flags()
  variants = [cfg]
  if FLAGS.full_ft and cfg.lora.enabled:
    if cfg.model.base_quant == "none":
      variants.append(cfg.replace(lora_rank=0))
    else:
      print(f"no full fine-tuning variant: --base_quant={cfg.model.base_quant} needs LoRA")
  peak = matmul_peak(FLAGS.matmul_size)
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; float32 "
        f"{FLAGS.matmul_size}^3 matmul peak {peak / 1e9:.1f} GFLOP/s")
  print(f"{'preset':<18} {'variant':<8} {'step s':>8} {'pairs/s':>8} {'tokens/s':>9} "
        f"{'GFLOP':>7} {'util':>7} {'loss@1':>9}")
  for variant in variants:
    r = time_config(variant)
    util = r["flops"] / r["step_time"] / peak
    print(f"{FLAGS.config:<18} {'LoRA' if r['lora'] else 'full FT':<8} {r['step_time']:8.3f} "
          f"{r['pairs_per_s']:8.3f} {r['tokens_per_s']:9.0f} {r['flops'] / 1e9:7.1f} "
          f"{100 * util:6.1f}% {r['first_loss']:9.6f}")
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f"peak RSS of this process (all variants): {rss:.0f} MiB")


if __name__ == "__main__":
  configs.define_flags()
  FLAGS.set_default("config", "bench-small")
  flags.DEFINE_bool("full_ft", True, "With a LoRA config, also time it with lora_rank=0 (every "
                    "weight trains, frozen reference copy).")
  flags.DEFINE_integer("timed_steps", 10, "Timed steps per round (after the warm-up steps).",
                       lower_bound=1)
  flags.DEFINE_integer("warmup_steps", 3, "Untimed steps per round (the first gives loss@1).",
                       lower_bound=1)
  flags.DEFINE_integer("rounds", 3, "Rounds; the median round is reported.", lower_bound=1)
  flags.DEFINE_integer("matmul_size", 2048, "n of the n x n x n float32 matmul timed as the peak.",
                       lower_bound=1)
  app.run(main)

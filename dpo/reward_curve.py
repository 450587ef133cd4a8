"""Held-out reward accuracy during DPO, measured every --curve_every steps.

    python -m dpo.reward_curve --config=hh-rlhf-gpt2 --curve_every=50

Runs the same stages as launch.py (SFT, then DPO against the SFT model) with the library's own
step loop, pausing the DPO stage every --curve_every steps to score the held-out pairs. Prints
one line per point and writes <output_dir>/reward_curve.json.
"""

from __future__ import annotations

import json
import os

from absl import app, flags, logging

import launch  # defines the config flags

flags.DEFINE_integer("curve_every", 50, "DPO steps between held-out evaluations.")
FLAGS = flags.FLAGS


def main(argv) -> None:
  del argv
  logging.set_verbosity(logging.INFO)
  import jax
  from dpo import data as data_lib, evaluate, loop, train
  from models import lora as lora_lib, sharding

  cfg = launch.config_from_flags()
  mesh = sharding.make_mesh(cfg.train.mesh)
  writer = loop.MetricsWriter(cfg.train.output_dir)
  key = jax.random.key(cfg.train.seed)
  cfg, params = loop.initial_params(cfg, jax.random.fold_in(key, 0), mesh)
  data = loop.Data(cfg)
  if data.held is None:
    raise app.UsageError("needs held-out pairs: pass --eval_split or --eval_data")
  batch = cfg.train.global_batch_size
  if cfg.train.stage in ("sft", "all") and cfg.train.sft_steps:
    opt, sched = train.optimizer(cfg, cfg.train.sft_learning_rate, cfg.train.sft_steps)
    state = train.init_state(params, opt, cfg.train.seed, mesh)
    loader = data_lib.Loader(data.sft, batch, cfg.train.seed + 1)
    params = loop._stage("sft", cfg, mesh, train.sft_step, state, None, loader,
                         cfg.train.sft_steps, (opt, sched), writer, pairs=False).params
  opt, sched = train.optimizer(cfg, cfg.train.learning_rate, cfg.train.steps)
  if cfg.lora.enabled:
    frozen = params
    trainable = lora_lib.init(cfg.model, cfg.lora, jax.random.fold_in(key, 1), mesh)
  else:
    frozen, trainable = params, jax.tree.map(lambda x: x.copy(), params)
  state = train.init_state(trainable, opt, cfg.train.seed, mesh)
  loader = data_lib.Loader(data.pairs, batch, cfg.train.seed + 2)
  curve = []
  step = 0
  while True:
    policy, lora = (frozen, state.params) if cfg.lora.enabled else (state.params, None)
    m = evaluate.pair_metrics(cfg, mesh, policy, lora, frozen, data.held, batch)
    curve.append({"step": step, **m})
    print(f"curve step {step:5d}  held-out reward_accuracy {m['reward_accuracy']:.3f}  "
          f"margin {m['reward_margin']:+.4f}  chosen ppl {m['perplexity']:.1f}  "
          f"pairs {m['pairs']}", flush=True)
    if step >= cfg.train.steps:
      break
    step = min(step + FLAGS.curve_every, cfg.train.steps)
    state = loop._stage("dpo", cfg, mesh, train.dpo_step, state, frozen, loader, step,
                        (opt, sched), writer, pairs=True)
  if writer.enabled:
    with open(os.path.join(cfg.train.output_dir, "reward_curve.json"), "w") as f:
      json.dump(curve, f, indent=2)


if __name__ == "__main__":
  app.run(main)

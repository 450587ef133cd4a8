"""Held-out reward accuracy of every loss type on the embedded default task.

    python -m dpo.compare_losses --steps=40 --sft_steps=300 --out=runs/compare_losses

One SFT stage (the default preset's) is trained once and shared; then each loss type runs the
DPO stage from it with everything else at the preset's values, and the held-out metrics are
printed one line per loss and written to <out>/results.jsonl. Held-out reward accuracy is
measured against the SFT model with the implicit reward beta * log(pi / pi_sft).
"""

from __future__ import annotations

import argparse
import json
import os
import time


import configs
from dpo import checkpoint, loop
from models import sharding


def sft_model(cfg: configs.Config, mesh):
  """Runs (or resumes) the SFT stage once under cfg's output_dir and returns its model."""
  loop.run(cfg.replace(stage="sft"), mesh=mesh)
  return checkpoint.load_params(os.path.join(cfg.train.output_dir, "checkpoints", "sft_model"),
                                cfg.model, mesh)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=configs.DEFAULT.train.steps)
  ap.add_argument("--sft_steps", type=int, default=configs.DEFAULT.train.sft_steps)
  ap.add_argument("--losses", default=",".join(configs.LOSS_TYPES))
  ap.add_argument("--out", default="runs/compare_losses")
  args = ap.parse_args()
  base = configs.DEFAULT.replace(steps=args.steps, sft_steps=args.sft_steps,
                                output_dir=os.path.join(args.out, "sft"))
  mesh = sharding.make_mesh(base.train.mesh)
  t0 = time.perf_counter()
  params = sft_model(base, mesh)
  print(f"SFT: {base.train.sft_steps} steps in {time.perf_counter() - t0:.0f}s", flush=True)
  for loss in args.losses.split(","):
    cfg = base.replace(stage="dpo", loss_type=(loss,), output_dir=os.path.join(args.out, loss))
    s = loop.run(cfg, mesh, init_params=params)
    row = {"loss_type": loss, "sft_steps": args.sft_steps, "steps": args.steps, **{k: s[k] for k in (
        "reward_accuracy", "reward_margin", "perplexity", "reference_perplexity",
        "skipped_steps", "dpo_time_s")}}
    print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "results.jsonl"), "a") as f:
      f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()

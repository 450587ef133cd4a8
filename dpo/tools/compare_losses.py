"""Held-out reward accuracy of every loss type on the embedded default task.

    python -m dpo.tools.compare_losses --steps=40 --sft_steps=300 --output_dir=runs/compare_losses

One SFT stage (the preset's) is trained once under <output_dir>/sft and shared; then each loss
in --losses runs the DPO stage from it under <output_dir>/<loss> with everything else at the
config's values, and the held-out metrics are printed one line per loss and appended to
<output_dir>/results.jsonl. Held-out reward accuracy is measured against the SFT model with the
implicit reward beta * log(pi / pi_sft).

Every config flag applies (--output_dir defaults to runs/compare_losses here) except
--loss_type, --loss_weights and --stage, which this tool sets per run; --losses is its own flag.
A loss hyperparameter flag (e.g. --label_smoothing) must be read by every compared loss; all
runs' configs are checked before the SFT stage starts.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

import configs
from dpo import checkpoint, cli, loop, losses
from models import sharding

FLAGS = flags.FLAGS
REPORTED = ("reward_accuracy", "reward_margin", "perplexity", "reference_perplexity",
            "skipped_steps", "dpo_time_s")


def sft_model(cfg: configs.Config, mesh):
  """Runs (or resumes) the SFT stage once under cfg's output_dir and returns its model."""
  loop.run(cfg.replace(stage="sft"), mesh=mesh)
  return checkpoint.load_params(os.path.join(cfg.run.output_dir, "checkpoints", "sft_model"),
                                cfg.model, mesh)


def main(argv) -> None:
  del argv
  for name in ("loss_type", "loss_weights", "stage"):
    if FLAGS[name].present:
      raise app.UsageError(f"--{name} is set per run by compare_losses; use --losses")
  FLAGS.loss_type = FLAGS.losses  # loss hyperparameter flags are checked against these losses
  cfg = cli.from_flags()
  out = cfg.run.output_dir
  runs = {loss: cfg.replace(stage="dpo", loss_type=(loss,), output_dir=os.path.join(out, loss))
          for loss in FLAGS.losses}
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  t0 = time.perf_counter()
  params = sft_model(cfg.replace(output_dir=os.path.join(out, "sft")), mesh)
  print(f"SFT: {cfg.optim.sft_steps} steps in {time.perf_counter() - t0:.0f}s", flush=True)
  for loss, run_cfg in runs.items():
    s = loop.run(run_cfg, mesh, init_params=params)
    row = {"loss_type": loss, "sft_steps": cfg.optim.sft_steps, "steps": cfg.optim.steps,
           **{k: s.get(k) for k in REPORTED}}
    print(json.dumps(row), flush=True)
    with open(os.path.join(out, "results.jsonl"), "a") as f:
      f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  cli.define_flags()
  FLAGS.set_default("output_dir", "runs/compare_losses")
  flags.DEFINE_list("losses", list(losses.LOSSES), "Loss types to compare, one DPO run each.")
  flags.register_validator("losses", lambda names: names and set(names) <= set(losses.LOSSES),
                           f"--losses must name losses from {', '.join(losses.LOSSES)}")
  app.run(main)

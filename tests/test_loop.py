"""End to end: a short default-task run lifts held-out reward accuracy clearly above chance."""

import json
import os

import jax

import configs
from dpo import loop
from models import sharding


def test_short_run_learns_preferences(tmp_path):
  out = tmp_path / "run"
  cfg = configs.DEFAULT.replace(sft_steps=150, steps=60, log_every=30, output_dir=str(out),
                                task_train_pairs=1024, task_sft_examples=1024,
                                task_eval_pairs=128)
  summary = loop.run(cfg, mesh=sharding.make_mesh("data:2", jax.devices()[:2]))
  assert summary["reward_accuracy"] > 0.75, summary
  assert summary["reward_margin"] > 0
  assert sorted(os.listdir(out)) == ["config.json", "metrics.jsonl", "summary.json"]
  records = [json.loads(l) for l in open(out / "metrics.jsonl")]
  dpo = [r for r in records if r["stage"] == "dpo"]
  assert [r["step"] for r in dpo] == [30, 60]
  for key in ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen",
              "rewards/rejected", "logps/chosen", "logps/rejected", "grad_norm", "learning_rate"):
    assert key in dpo[0]
  assert json.load(open(out / "summary.json")) == summary

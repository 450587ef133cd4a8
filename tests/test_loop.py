"""End to end: a short default-task run lifts held-out reward accuracy clearly above chance."""

import json
import os

import jax

import configs
from dpo import loop
from models import sharding


def test_short_run_learns_preferences(tmp_path):
  out = tmp_path / "run"
  # 60 DPO steps: a higher peak lr than the preset's (tuned for 200 steps); few, short samples.
  cfg = configs.DEFAULT.replace(sft_steps=150, steps=60, log_every=30, output_dir=str(out),
                                task_train_pairs=1024, task_sft_examples=1024,
                                task_eval_pairs=128, learning_rate=1e-3, eval_every=30,
                                task_eval_prompts=16, eval_max_new_tokens=24)
  summary = loop.run(cfg, mesh=sharding.make_mesh("data:2", jax.devices()[:2]))
  assert summary["reward_accuracy"] > 0.75, summary
  assert summary["reward_margin"] > 0
  assert sorted(os.listdir(out)) == ["config.json", "metrics.jsonl", "summary.json"]
  records = [json.loads(l) for l in open(out / "metrics.jsonl")]
  dpo = [r for r in records if r["stage"] == "dpo"]
  assert [r["step"] for r in dpo] == [30, 60]
  evals = [r for r in records if r["stage"] == "eval"]
  assert [r["step"] for r in evals] == [30, 60]
  for key in ("win_rate", "kl_per_sequence", "kl_per_token", "reward_accuracy", "perplexity",
              "policy_true_reward", "reference_true_reward", "policy_distinct_2"):
    assert f"eval/{key}" in evals[-1] and summary[key] is not None, key
  for key in ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen",
              "rewards/rejected", "logps/chosen", "logps/rejected", "grad_norm", "learning_rate"):
    assert key in dpo[0]
  assert json.load(open(out / "summary.json")) == summary

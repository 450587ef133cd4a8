"""A few-step run of the whole program (dpo.loop.run, and once launch.py) for every loss type."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import configs
from dpo import loop, losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_FLAGS = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
                  lora_rank=4, lora_alpha=8.0, max_prompt_length=24, max_target_length=24,
                  task_train_pairs=32, task_sft_examples=32, task_eval_pairs=8,
                  task_eval_prompts=4, global_batch_size=8, log_every=1)


WITH_REF = tuple(n for n, l in losses.LOSSES.items() if l.reference)
REFERENCE_FREE = tuple(n for n, l in losses.LOSSES.items() if not l.reference)


# Every loss type goes through the real program path: alone for the default, and combined (one
# compile per group, so the test stays fast) for the rest; the reference-free group exercises
# the path that runs no reference forward. Per-loss launch.py runs are in WORKSPACE.md.
@pytest.mark.parametrize("losses", [("sigmoid",), WITH_REF, REFERENCE_FREE],
                         ids=["sigmoid", "all-with-reference", "all-reference-free"])
@pytest.mark.slow
def test_every_loss_type_runs(losses, tmp_path):
  # Each loss alone, without the default preset's RPO term (the modifiers' run is below).
  cfg = configs.DEFAULT.replace(**TINY_FLAGS, stage="dpo", steps=2, loss_type=losses,
                                rpo_alpha=0.0, output_dir=str(tmp_path))
  assert cfg.loss.reference_free == (losses == REFERENCE_FREE)
  summary = loop.run(cfg)
  assert summary["skipped_steps"] == 0
  assert 0.0 <= summary["reward_accuracy"] <= 1.0
  with open(tmp_path / "metrics.jsonl") as f:
    dpo = [json.loads(l) for l in f if '"dpo"' in l]
  assert [r["step"] for r in dpo] == [1, 2]
  assert all(np.isfinite(r["loss"]) for r in dpo)
  if len(losses) > 1:
    parts = [dpo[0][f"loss/{t}"] for t in losses]
    assert all(np.isfinite(parts))
    np.testing.assert_allclose(sum(parts), dpo[0]["loss"], rtol=1e-5)


@pytest.mark.slow
def test_launch_command_line_with_modifiers(tmp_path):
  flags = [f"--{k}={v}" for k, v in TINY_FLAGS.items()]
  cmd = [sys.executable, "launch.py", *flags, "--sft_steps=2", "--steps=2",
         "--loss_type=sigmoid,orpo", "--loss_weights=1,0.5", "--rpo_alpha=1.0", "--wpo",
         "--ld_alpha=0.5", "--f_divergence=js_divergence", "--precompute_ref",
         f"--output_dir={tmp_path}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["ref_cache"]["hit"] is False and summary["skipped_steps"] == 0
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["loss"]["loss_weights"] == [1.0, 0.5]
  with open(tmp_path / "metrics.jsonl") as f:
    dpo = [json.loads(l) for l in f if '"dpo"' in l]
  assert {"loss/sigmoid", "loss/orpo", "wpo/weight", "rpo/nll", "orpo/log_odds_ratio"} <= set(dpo[-1])

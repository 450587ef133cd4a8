"""The reward-KL frontier tool: the area under a curve, and a tiny sweep end to end."""

import json
import os
import subprocess
import sys

import pytest

from dpo.tools import frontier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pts(*kr):
  return [{"kl_per_sequence": k, "reward": r} for k, r in kr]


def test_area_is_the_mean_of_the_upper_envelope():
  # A step from 0 to 1 at KL 2, over [0, 4]: half the budget at reward 1.
  assert frontier.area(_pts((0.0, 0.0), (2.0, 1.0)), 4.0) == pytest.approx(0.5, abs=1e-2)
  # A later point below the envelope does not lower it.
  assert frontier.area(_pts((0.0, 0.0), (2.0, 1.0), (3.0, 0.2)), 4.0) == pytest.approx(0.5, abs=1e-2)
  # A curve that reaches the same reward at lower KL has the larger area.
  assert frontier.area(_pts((0.0, 0.0), (1.0, 1.0)), 4.0) > frontier.area(
      _pts((0.0, 0.0), (2.0, 1.0)), 4.0)


@pytest.mark.slow
def test_tiny_sweep_writes_table_points_and_plot(tmp_path):
  out = tmp_path / "frontier"
  cmd = [sys.executable, "-m", "dpo.tools.frontier", f"--output_dir={out}", "--sft_steps=4",
         "--steps=4", "--eval_every=2", "--betas=0.5", "--best_of=1,2,4", "--best_of_max=4",
         "--task_train_pairs=16", "--task_sft_examples=16", "--task_eval_pairs=8",
         "--task_eval_prompts=8", "--eval_max_new_tokens=8", "--global_batch_size=8",
         "--log_every=2", "--mesh=data:1", "--online_methods=online_dpo", "--online_methods=grpo",
         "--online_methods=iterative_dpo", "--online_methods=rloo", "--online_methods=ppo"]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  points = [json.loads(l) for l in open(out / "frontier.jsonl")]
  methods = {p["method"] for p in points}
  assert methods == {"best-of-N", "DPO beta=0.5", "Preferred-FT", "online DPO", "GRPO",
                     "iterative DPO", "RLOO", "PPO"}
  assert [p["step"] for p in points if p["method"] == "GRPO"] == [0, 2, 4]
  assert [p["step"] for p in points if p["method"] == "RLOO"] == [0, 2, 4]
  assert [p["step"] for p in points if p["method"] == "PPO"] == [0, 2, 4]
  assert [p["step"] for p in points if p["method"] == "iterative DPO"] == [0, 2, 4]
  assert len(os.listdir(out / "iterative_dpo" / "iterative")) == 4  # 4 rounds of 1 step
  # Per run: the SFT origin and one point per evaluation (steps 2 and 4).
  assert [p["step"] for p in points if p["method"] == "Preferred-FT"] == [0, 2, 4]
  assert [p["kl_per_sequence"] for p in points if p["method"] == "best-of-N"] == pytest.approx(
      [0.0, 0.6931 - 0.5, 1.3863 - 0.75], abs=1e-3)
  table = (out / "frontier.md").read_text()
  for method in ("| DPO |", "| Preferred-FT |", "| best-of-N |", "| online DPO |", "| GRPO |",
                 "| iterative DPO |", "| RLOO |", "| PPO |"):
    assert method in table
  assert (out / "frontier.png").stat().st_size > 10_000
  # --init_from reuses that SFT model instead of training one: the same points, no SFT stage.
  # The offline methods only (each online method starts from the same SFT model as DPO does).
  again = tmp_path / "again"
  # The SFT flags are dropped: with --init_from nothing reads them, and the tool refuses them.
  rerun = [c.replace(f"--output_dir={out}", f"--output_dir={again}") for c in cmd
           if not c.startswith(("--sft_steps=", "--online_methods="))]
  res = subprocess.run(rerun + [f"--init_from={out}/sft/checkpoints/sft_model"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "SFT model: " in res.stdout and not (again / "sft").exists()
  reused = [json.loads(l) for l in open(again / "frontier.jsonl")]
  offline = [p for p in points if p["method"] in {"best-of-N", "DPO beta=0.5", "Preferred-FT"}]
  assert {p["method"] for p in reused} == {p["method"] for p in offline}
  assert [p.pop("kl_per_sequence") for p in reused] == pytest.approx(
      [p.pop("kl_per_sequence") for p in offline], abs=1e-5)
  assert [p.pop("reward") for p in reused] == pytest.approx(
      [p.pop("reward") for p in offline], abs=1e-6)
  assert reused == offline


@pytest.mark.slow
def test_the_frontier_refuses_flags_it_sets_per_run(tmp_path):
  res = subprocess.run([sys.executable, "-m", "dpo.tools.frontier", "--rpo_alpha=1",
                        f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert res.returncode != 0 and "--rpo_alpha is set per run" in res.stderr
  res = subprocess.run([sys.executable, "-m", "dpo.tools.frontier", "--init_from=some/sft_model",
                        "--sft_steps=10", f"--output_dir={tmp_path}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode != 0 and "--sft_steps is read by nothing with --init_from" in res.stderr
  # An online method's steps that the DPO runs' cannot match: refused before anything runs (the
  # SFT model named here does not exist; nothing reads it).
  res = subprocess.run([sys.executable, "-m", "dpo.tools.frontier", "--init_from=some/sft_model",
                        "--online_methods=iterative_dpo", "--steps=150", "--iterative_rounds=4",
                        f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert res.returncode != 0 and "--steps=150 must divide by --iterative_rounds=4" in res.stderr
  assert "some/sft_model" not in res.stderr and not os.listdir(tmp_path)


def vowel_reward(prompt, completion):
  """A rule-based judge for the user-data frontier test: the share of vowels."""
  letters = [c for c in completion.lower() if c.isalpha()]
  return sum(c in "aeiou" for c in letters) / max(len(letters), 1)


@pytest.mark.slow
def test_frontier_on_user_data_ranks_best_of_n_by_the_judge(tmp_path):
  """On a preference file the frontier needs a judge; with --reward_fn best-of-N is ranked by
  it, so its reward does not fall as N grows, and best-of-1 is the SFT samples' mean."""
  rows = [{"prompt": f"Q{i}: name a fruit or a colour.", "chosen": f" apple {i}",
           "rejected": f" grey {i}"} for i in range(48)]
  data = tmp_path / "pairs.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  base = [sys.executable, "-m", "dpo.tools.frontier", f"--train_data={data}", "--eval_split=0.25",
          "--sft_steps=4", "--steps=2", "--eval_every=2", "--betas=0.5", "--best_of=1,2,4",
          "--best_of_max=4", "--task_eval_prompts=8", "--eval_max_new_tokens=8",
          "--global_batch_size=8", "--log_every=2", "--mesh=data:1"]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  res = subprocess.run(base + [f"--output_dir={tmp_path / 'none'}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode != 0 and "needs a judge: give --judge" in res.stderr
  out = tmp_path / "judged"
  res = subprocess.run(base + [f"--output_dir={out}", "--reward_fn=tests.test_frontier:vowel_reward"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  points = [json.loads(l) for l in open(out / "frontier.jsonl")]
  best = [p["reward"] for p in points if p["method"] == "best-of-N"]
  assert len(best) == 3 and best[0] <= best[1] <= best[2]
  assert all(p["wellformed_rate"] is None for p in points)
  assert "| best-of-N |" in (out / "frontier.md").read_text()

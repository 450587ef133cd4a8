"""dpo/reasoning.py: the embedded arithmetic task (problems, worked solutions, held-out split,
the verifiable reward, TRL's think format as the format check) and the reasoning evaluation
(pass@k, majority@k, answers.jsonl), down to a tiny --task=arithmetic run."""

import itertools
import json
import re

import numpy as np
import pytest

import configs
from dpo import loop, reasoning, task

D = 4  # --task_difficulty of these tests


def _python_value(problem: reasoning.Problem) -> int:
  """The oracle: Python's own left-to-right evaluation of the expression."""
  return eval(problem.text)  # noqa: S307 (digits, + and - only: checked below)


def test_problems_answers_and_worked_solutions():
  recs = reasoning.sft_records(2000, 0, D)
  wrong_steps = steps = 0
  for r in recs:
    p = reasoning.parse(r.prompt)
    assert re.fullmatch(r"[0-9+\-]+", p.text) and 1 <= p.difficulty <= D
    assert p.answer == _python_value(p) >= 0
    assert all(s[3] >= 0 for s in p.steps())  # never below zero on the way
    assert reasoning.well_formed(r.prompt, r.completion)
    work = re.match(r"<think>(.*)</think> (\d+)$", r.completion)
    lines = work.group(1).split(", ")
    assert len(lines) == p.difficulty
    for (a, op, b, _), line in zip(p.steps(), lines):  # each step's left side is the chain's
      left, result = line.split("=")
      steps += 1
      x, y = map(int, re.split(r"[+\-]", left))
      wrong_steps += int(result) != (x + y if "+" in left else x - y)
    # A demonstration's answer is its own chain's last result: right exactly when no step slipped.
    assert int(work.group(2)) == int(lines[-1].split("=")[1])
  # Each step slips with probability SLIP: within 5 standard errors over ~5000 steps.
  se = np.sqrt(reasoning.SLIP * (1 - reasoning.SLIP) / steps)
  assert abs(wrong_steps / steps - reasoning.SLIP) < 5 * se


def test_pairs_held_out_split_and_evaluation_problems():
  pairs = reasoning.preference_records(300, 0, D)
  held = reasoning.preference_records(300, 0, D, held_out=True)
  for r in pairs + held:
    p = reasoning.parse(r.prompt)
    assert reasoning.reward(r.prompt, r.chosen) == 1.0 and reasoning.reward(r.prompt, r.rejected) == 0
  train = {r.prompt for r in reasoning.sft_records(4000, 0, D)} | {r.prompt for r in pairs}
  evaluated = reasoning.eval_prompts(512, D)
  assert not train & ({r.prompt for r in held} | set(evaluated))  # never trained on
  problems = reasoning.eval_problems(D)
  assert len({p.text for p in problems}) == reasoning.EVAL_PROBLEMS
  counts = np.bincount([p.difficulty for p in problems])[1:]
  assert len(counts) == D and counts.min() > 0 and counts[1:].max() - counts[1:].min() <= 1
  # Cycled to 512: each problem sampled 4 times (the k of pass@4); the same set for any seed.
  assert all(n == 4 for n in np.unique(evaluated, return_counts=True)[1])
  assert evaluated == reasoning.eval_prompts(512, D)


def test_reward_extraction_and_the_format_against_trl():
  """The format check is TRL's think_format_reward (one reasoning block, first) with an integer
  answer after it; the reward reads only the answer after the block."""
  rewards = pytest.importorskip("trl.rewards")
  prompt = "Solve 7+5-3:"
  cases = {
      "<think>7+5=12, 12-3=9</think> 9": (True, 9, 1.0),
      "<think>7+5=12, 12-3=8</think> 8": (True, 8, 0.0),  # a slip: formatted, wrong
      "<think>7+5=12</think>9": (True, 9, 1.0),
      "<think>\n7+5=12\n12-3=9\n</think>\n9": (True, 9, 1.0),
      "<think>7+5=12, 12-3=9</think> the answer is nine": (False, None, 0.0),
      "9": (False, None, 0.0),
      "<think>7+5=12, 12-3=9 9": (False, None, 0.0),  # the block never closes
      " <think>7+5=12</think> 9": (True, 9, 1.0),  # leading space: stripped, as TRL's strip
      "<think>a</think> <think>b</think> 9": (False, 9, 1.0),  # two blocks: TRL's format fails
      "<think>9</think> 9 10": (False, None, 0.0),
      "<think>x</think> -3": (True, -3, 0.0),
  }
  trl = rewards.think_format_reward([[{"content": t.strip()}] for t in cases])
  for (text, (formed, answer, reward)), theirs in zip(cases.items(), trl):
    assert reasoning.well_formed(prompt, text) is formed, text
    assert reasoning.extract(text) == answer, text
    assert reasoning.reward(prompt, text) == reward, text
    if formed:  # ours is TRL's format and more (an integer answer), never less
      assert theirs == 1.0, text
  with pytest.raises(ValueError, match="not an arithmetic task prompt"):
    reasoning.reward("Review the cafe in Oslo:", "<think></think> 1")


def test_pass_at_k_is_the_chance_that_k_of_the_samples_hold_a_correct_one():
  """The estimator against enumeration of every k-subset of n samples."""
  for n in range(1, 7):
    for c in range(n + 1):
      for k in range(1, n + 1):
        subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
        exact = np.mean([any(s) for s in subsets])
        assert reasoning.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_majority_and_metrics_of_grouped_samples():
  assert reasoning.majority([3, None, 4, 4, 3]) == 3  # a tie: the answer seen first
  assert reasoning.majority([None, None]) is None
  right = lambda p: reasoning.solution(reasoning.parse(p))
  wrong = lambda p: reasoning.solution(reasoning.parse(p), [1] + [0] * 9)
  prompts = ["Solve 1+2:", "Solve 9-4+1:"] * 3
  texts = [right(prompts[0]), "garbage", wrong(prompts[0]), wrong(prompts[1]),
           wrong(prompts[0]), right(prompts[1])]
  m, rows = reasoning.metrics(prompts, texts, "x_")
  assert [r["problem"] for r in rows] == ["1+2", "9-4+1"]
  assert rows[0]["answers"] == [3, 4, 4] and rows[0]["correct"] == [True, False, False]
  assert rows[1]["answers"] == [None, 7, 6] and rows[1]["majority"] == 7
  assert m["x_pass@1"] == pytest.approx((1 / 3 + 1 / 3) / 2)
  assert m["x_pass@3"] == 1.0 and m["x_maj@3"] == 0.0
  assert m["x_extraction_failure_rate"] == pytest.approx(1 / 6)
  assert m["x_format_rate"] == pytest.approx(5 / 6)
  assert m["x_pass@1/difficulty_1"] == pytest.approx(1 / 3)


def test_the_task_flags():
  cfg = configs.DEFAULT.replace(task="arithmetic", task_difficulty=2)
  t = task.embedded(cfg.data)
  assert t.reward_fn == "dpo.reasoning:reward" and t.reasoning is reasoning
  assert max(reasoning.parse(r.prompt).difficulty for r in t.sft_records(200, 0)) == 2
  assert task.embedded(configs.DEFAULT.data).reward_fn == "dpo.task:reward"
  with pytest.raises(ValueError, match=r"--task_difficulty=2: must go with --task=arithmetic"):
    configs.DEFAULT.replace(task_difficulty=2)
  with pytest.raises(ValueError, match=r"--task=arithmetic: an embedded task, read only without "
                                       r"--train_data"):
    configs.DEFAULT.replace(task="arithmetic", train_data="pairs.jsonl")
  with pytest.raises(ValueError, match="task"):
    configs.DEFAULT.replace(task="chess")


@pytest.mark.slow
@pytest.mark.usefixtures("compile_cache")
def test_a_tiny_reasoning_run_writes_answers_and_its_verdict(tmp_path):
  """--task=arithmetic, SFT then GRPO on a tiny model: the eval record has the reasoning
  figures, answers.jsonl one record a problem that agrees with samples.jsonl, and the verdict
  asks for the pass@1 gain instead of the win rate."""
  out = tmp_path / "run"
  cfg = configs.get_config("reasoning").replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
      task_sft_examples=64, task_train_pairs=64, task_eval_pairs=16, task_eval_prompts=128,
      eval_samples_per_prompt=2,
      sft_steps=8, grpo_steps=2, num_generations=4, global_batch_size=8, eval_batch_size=64,
      checkpoint_every=2, log_every=1, output_dir=str(out))
  summary = loop.run(cfg)
  samples = [json.loads(l) for l in open(out / "samples.jsonl")]
  answers = [json.loads(l) for l in open(out / "answers.jsonl")]
  assert len(samples) == 256 and len(answers) == reasoning.EVAL_PROBLEMS
  by_problem = {}
  for s in samples:
    by_problem.setdefault(reasoning.parse(s["prompt"]).text, []).append(s)
  for a in answers:
    mine = by_problem[a["problem"]]
    assert a["answers"] == [reasoning.extract(s["policy"]) for s in mine]
    assert a["reference_answers"] == [reasoning.extract(s["reference"]) for s in mine]
    assert a["correct"] == [s["policy_reward"] == 1.0 for s in mine]
    assert a["answer"] == _python_value(reasoning.parse(f"Solve {a['problem']}:"))
  assert summary["pass@1"] == pytest.approx(np.mean([s["policy_reward"] for s in samples]))
  assert summary["reference_pass@1"] == pytest.approx(
      np.mean([s["reference_reward"] for s in samples]))
  assert summary["pass@1_gain"] == pytest.approx(summary["pass@1"] - summary["reference_pass@1"])
  assert {"pass@2", "maj@2", "format_rate", "reference_format_rate",
          "extraction_failure_rate"} <= set(summary)
  assert [v["target"] for v in summary["verdicts"]][0] == "pass@1 gain"
  assert summary["judge"] == "reward function dpo.reasoning:reward"

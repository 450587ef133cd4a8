"""Several reward functions with weights (--reward_fn=a:f,b:g --reward_weights; dpo/judges.py's
RewardFunctions, logged by the GRPO stage): TRL GRPOTrainer's own `_calculate_rewards` scores
the same completions, its weighted nansum combines them, a tiny sft,grpo run logs each
function's rewards, and the flags refuse what cannot work."""

import json
import math
import types

import numpy as np
import pytest

import configs
from dpo import judges, loop
from dpo.algorithms import grpo

torch = pytest.importorskip("torch")
trl_grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
from trl.trainer.utils import nanstd  # noqa: E402

PROMPTS = ["a b", "c", "d e f", "g"]
COMPLETIONS = ["x y z", "", "yes", "no no"]


def length_reward(prompt, completion):
  return float(len(completion))


def yes_reward(prompt, completion):
  """1 for a completion with "yes", None (does not apply) for an empty one, else 0."""
  return None if not completion else float("yes" in completion)


def only_yes(prompt, completion):
  """None except for "yes": with yes_reward, the empty completion is unscorable."""
  return 2.0 if completion == "yes" else None


def _trl(funcs, weights):
  """(rewards_per_func [N, F], weighted rewards [N]) of TRL's GRPOTrainer: its
  `_calculate_rewards` on a stub trainer, then _generate_and_score_completions' combination
  (rewards_per_func * reward_weights).nansum(dim=1), unscorable rows (every function None) NaN."""
  t = object.__new__(trl_grpo_trainer.GRPOTrainer)
  batch = [lambda prompts, completions, f=f, **kw: [f(p, c) for p, c in zip(prompts, completions)]
           for f in funcs]
  for b, f in zip(batch, funcs):
    b.__name__ = f.__name__
  t.__dict__.update(
      accelerator=types.SimpleNamespace(device="cpu", is_main_process=True),
      state=types.SimpleNamespace(global_step=0), args=types.SimpleNamespace(report_to=[]),
      reward_funcs=batch, reward_processing_classes=[None] * len(funcs),
      reward_func_names=[f.__name__ for f in funcs], environments=None,
      _log_completion_extra=lambda *a, **k: None, _log_metric=lambda *a, **k: None)
  inputs = [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, COMPLETIONS)]
  per_func = t._calculate_rewards(inputs, PROMPTS, COMPLETIONS, [[0]] * len(PROMPTS))
  rewards = (per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
  rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
  return per_func, rewards


@pytest.mark.parametrize("funcs,weights", [(("length_reward", "yes_reward"), (0.5, 2.0)),
                                           (("yes_reward", "only_yes"), (1.0, -3.0))])
def test_weighted_rewards_and_per_function_metrics_match_trl(funcs, weights):
  specs = [f"tests.test_reward_funcs:{f}" for f in funcs]
  judge = judges.RewardFunctions(specs, weights)
  per_func, rewards = _trl([globals()[f] for f in funcs], weights)
  records = [judges.records_of(p, [c])[0] for p, c in zip(PROMPTS, COMPLETIONS)]
  np.testing.assert_allclose(judge.each(records), per_func.numpy(), rtol=1e-6, equal_nan=True)
  fake = types.SimpleNamespace(judge=judge, scored=lambda batch, comps, score: (
      score(records), np.ones(len(records), bool)))
  each, _, info = grpo.Generated.rewarded(fake, None, None)
  np.testing.assert_allclose(each, per_func.numpy(), rtol=1e-6, equal_nan=True)
  total = judge.combined(each)
  np.testing.assert_allclose(total, rewards.numpy(), rtol=1e-6, equal_nan=True)
  for i, name in enumerate(funcs):  # TRL: nanmean and nanstd of each function's column
    assert info[f"rewards/{name}/mean"] == pytest.approx(torch.nanmean(per_func[:, i]).item(), nan_ok=True)
    assert info[f"rewards/{name}/std"] == pytest.approx(nanstd(per_func[:, i]).item(), nan_ok=True)
  if np.isnan(total).any():  # the win rate and online DPO need a number for every record
    with pytest.raises(judges.JudgeError, match="every function returned None for record 1"):
      judge.score(records)


@pytest.mark.parametrize("kw,match", [
    (dict(reward_weights=(1.0,)), "--reward_weights=1.0: weighs the functions of --reward_fn"),
    (dict(reward_weights=(1.0,), reward_fn="dpo.task:reward,tests.test_reward_funcs:yes_reward"),
     r"--reward_weights=1.0: give one weight per --reward_fn function \(2"),
])
def test_refused_in_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as e:
    configs.DEFAULT.replace(stage="sft,grpo", **kw)
  assert "\n" not in str(e.value)


def test_an_unimportable_function_among_several_is_refused_before_work():
  cfg = configs.DEFAULT.replace(reward_fn="dpo.task:reward,tests.test_reward_funcs:nope")
  with pytest.raises(judges.JudgeError, match="tests.test_reward_funcs:nope: module .* has no "):
    judges.check(cfg)


def test_a_function_named_twice_is_refused_before_work():
  cfg = configs.DEFAULT.replace(reward_fn="dpo.task:reward, dpo.task:reward")
  with pytest.raises(judges.JudgeError, match=r"--reward_fn=dpo.task:reward,dpo.task:reward: "
                     r"dpo.task:reward named more than once") as e:
    judges.check(cfg)
  assert "\n" not in str(e.value)


@pytest.mark.slow
def test_sft_grpo_run_logs_each_function(tmp_path):
  out = tmp_path / "run"
  loop.run(configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
      task_train_pairs=64, task_sft_examples=32, task_eval_pairs=8, task_eval_prompts=4,
      global_batch_size=8, num_generations=4, sft_steps=4, grpo_steps=2, num_iterations=1,
      max_completion_length=6, log_every=1, eval_every=0, checkpoint_every=2,
      eval_max_new_tokens=6, stage="sft,grpo", output_dir=str(out),
      reward_fn="dpo.task:reward,tests.test_reward_funcs:length_reward",
      reward_weights=(1.0, 0.1)))
  with open(out / "metrics.jsonl") as f:
    steps = [json.loads(l) for l in f if '"stage": "grpo"' in l]
  assert len(steps) == 2
  for r in steps:
    for key in ("rewards/reward/mean", "rewards/reward/std", "rewards/length_reward/mean",
                "rewards/length_reward/std"):
      assert math.isfinite(r[key]), key
    assert r["reward"] == pytest.approx(
        r["rewards/reward/mean"] + 0.1 * r["rewards/length_reward/mean"], rel=1e-5)

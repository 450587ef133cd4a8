"""The RLOO stage (dpo/algorithms/rloo.py; its loss and advantages are checked against TRL in
tests/test_rloo_trl.py): generation batches reused for rloo_num_iterations updates,
leave-one-out advantages of the KL-penalised rewards, a bitwise resume after a kill during
generation, and the settings it refuses."""

import json

import jax
import numpy as np
import pytest

import configs
import records
from dpo import checkpoint, data, judges, loop
from dpo.algorithms import rloo
from faults import Killed
from models import sharding


def _cfg(out, **kw):
  return configs.DEFAULT.replace(**{
      **dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
             task_train_pairs=128, task_sft_examples=64, task_eval_pairs=16, task_eval_prompts=8,
             global_batch_size=16, rloo_num_generations=4, sft_steps=20, rloo_steps=6,
             rloo_num_iterations=2, sft_learning_rate=3e-3, learning_rate=1e-3,
             rloo_max_completion_length=8, log_every=1, eval_every=0, checkpoint_every=2,
             eval_max_new_tokens=8, stage="sft,rloo", output_dir=str(out),
             reward_fn="tests.test_grpo:length_reward"), **kw})


def _records(out):
  with open(out / "metrics.jsonl") as f:
    return [json.loads(l) for l in f if '"stage": "rloo"' in l]


@pytest.mark.slow
def test_rloo_trains_and_resumes_bitwise_after_a_kill_during_generation(tmp_path, monkeypatch):
  """Samples are drawn at steps 1, 3, 5 (rloo_num_iterations 2) for 16 / 4 prompts, 4 each; each
  prompt's leave-one-out advantages sum to 0; the first update of a batch is on-policy (no
  clipping), the KL is logged and the policy moves. A run killed during its second generation
  (sampled, not yet judged) and run again logs the same records and ends with the same weights,
  bit for bit."""
  batches, kill = [], {"at": 0}
  generation, sample = rloo.Generated.generation, rloo.Generated.sample

  def recording(self, *args):
    out = generation(self, *args)
    batches.append(out[0])
    return out

  def killing(self, *args):
    out = sample(self, *args)
    kill["at"] -= 1
    if kill["at"] == 0:
      raise Killed("killed during generation")
    return out

  monkeypatch.setattr(rloo.Generated, "generation", recording)
  monkeypatch.setattr(rloo.Generated, "sample", killing)
  whole, cut = tmp_path / "whole", tmp_path / "cut"
  loop.run(_cfg(whole))
  assert len(batches) == 3
  for b in batches:
    assert b.rows.tokens.shape[0] == 16 and b.old_logps.shape == (16,)
    np.testing.assert_allclose(b.advantages.reshape(4, 4).sum(0), 0.0, atol=1e-4)
    assert np.abs(b.advantages).max() > 0
  steps = _records(whole)
  assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
  assert [r["time/sample_s"] > 0 for r in steps] == [True, False] * 3
  assert all(r["clip_ratio/region_mean"] == 0.0 for r in steps[::2])
  assert any(r["grad_norm"] > 0 for r in steps)
  assert {"reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
          "completions/clipped_ratio", "kl", "entropy", "loss", "clip_ratio/low_min",
          "time/train_s"} <= set(steps[0])

  kill["at"] = 2  # the second generation batch, at step 3 (the last checkpoint: step 2)
  with pytest.raises(Killed):
    loop.run(_cfg(cut))
  assert [r["step"] for r in _records(cut)] == [1, 2]
  loop.run(_cfg(cut))
  assert records.timeless(_records(cut)) == records.timeless(steps)
  cfg = _cfg(whole)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  a = checkpoint.load_params(str(cut / "checkpoints" / "policy"), cfg.model, mesh)
  b = checkpoint.load_params(str(whole / "checkpoints" / "policy"), cfg.model, mesh)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_settings_rloo_cannot_honour_are_one_line_errors(tmp_path):
  with pytest.raises(ValueError, match="^--rloo_num_generations=3: must divide "
                                       "--global_batch_size=16"):
    _cfg(tmp_path, rloo_num_generations=3)
  with pytest.raises(ValueError, match="^--rloo_num_iterations=4: must divide --rloo_steps=6"):
    _cfg(tmp_path, rloo_num_iterations=4)
  with pytest.raises(ValueError, match="checkpoints fall between generation batches"):
    _cfg(tmp_path, checkpoint_every=3)
  # Flags nothing would read: RLOO's without an rloo stage, GRPO's (but --reward_weights) with
  # one; --reward_weights weighs the functions for either.
  with pytest.raises(ValueError, match=r"^--rloo_beta=0.1: must go with a rloo stage \(--stage="
                                       r"sft,dpo has none\)$"):
    configs.DEFAULT.replace(rloo_beta=0.1)
  with pytest.raises(ValueError, match=r"^--num_generations=4: must go with a grpo stage"):
    _cfg(tmp_path, num_generations=4)
  with pytest.raises(ValueError, match=r"^--grpo_beta=0.04: must go with a grpo stage"):
    _cfg(tmp_path, grpo_beta=0.04)
  cfg = _cfg(tmp_path, reward_fn="dpo.task:reward,tests.test_grpo:length_reward",
             reward_weights=(1.0, 0.1))
  assert cfg.grpo.reward_weights == (1.0, 0.1)
  with pytest.raises(ValueError, match=r"^--reward_weights=1.0,2.0: give one weight per "):
    _cfg(tmp_path, reward_weights=(1.0, 2.0))


def test_a_reward_function_may_return_none_when_rloo_is_the_only_sampler():
  """The rehearsal before training lets a single function's None through when RLOO is the stage
  that samples (TRL scores it NaN: left out of the baseline, advantage 0, tests/test_rloo_trl.py)."""
  pairs = [data.PreferenceRecord("p", "ab", "abc")]
  judges.rehearse(configs.DEFAULT.replace(stage="sft,rloo",
                                          reward_fn="tests.test_grpo:none_for_odd"), pairs)
  with pytest.raises(judges.JudgeError, match="returned None"):
    judges.rehearse(configs.DEFAULT.replace(stage="sft,online_dpo",
                                            reward_fn="tests.test_grpo:none_for_odd"), pairs)

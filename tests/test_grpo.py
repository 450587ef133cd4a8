"""The GRPO stage (dpo/algorithms/grpo.py; its loss is checked against TRL in
tests/test_grpo_trl.py): generation batches reused for num_iterations updates, group advantages
from the judge's rewards, a bitwise resume after a crash, and the settings it refuses."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import records
from dpo import checkpoint, data, judges, loop
from dpo import policy_gradient as pg
from dpo.algorithms import grpo
from faults import Crash, SimulatedCrash
from models import sharding


def length_reward(prompt, completion):
  return float(len(completion))


def _cfg(out, **kw):
  return configs.DEFAULT.replace(**{
      **dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
             task_train_pairs=128, task_sft_examples=64, task_eval_pairs=16, task_eval_prompts=8,
             global_batch_size=16, num_generations=4, sft_steps=20, grpo_steps=6,
             num_iterations=2, grpo_beta=0.04, sft_learning_rate=3e-3, learning_rate=1e-3,
             max_completion_length=8, log_every=1, eval_every=0, checkpoint_every=2,
             eval_max_new_tokens=8, stage="sft,grpo", output_dir=str(out),
             reward_fn="tests.test_grpo:length_reward"), **kw})


def _records(out, stage="grpo"):
  with open(out / "metrics.jsonl") as f:
    return [json.loads(l) for l in f if f'"stage": "{stage}"' in l]


@pytest.mark.slow
def test_generation_batches_are_reused_for_num_iterations_updates(tmp_path, monkeypatch):
  """Samples are drawn at steps 1, 3, 5 (num_iterations 2) for 16 / 4 prompts, 4 each; each
  batch's advantages are its rewards less their group's mean over the batch's std
  (--scale_rewards=batch), and its frac_reward_zero_std reads that std, as TRL's (tied groups
  among untied ones log 0); the first update of a batch is on-policy (no clipping), and the
  policy moves."""
  batches, rewards = [], []
  generation, rewarded = grpo.Generated.generation, grpo.Generated.rewarded

  def recording(self, *args):
    out = generation(self, *args)
    batches.append(out[0])
    return out

  def recording_rewards(self, *args):
    out = rewarded(self, *args)
    rewards.append(out[0].reshape(4, 4).T)  # [prompt, sample] (one function)
    return out

  monkeypatch.setattr(grpo.Generated, "generation", recording)
  monkeypatch.setattr(grpo.Generated, "rewarded", recording_rewards)
  loop.run(_cfg(tmp_path / "run", scale_rewards="batch"))
  assert len(batches) == 3
  for b in batches:
    assert b.rows.tokens.shape[0] == 16 and b.ref_logps is not None
    adv = b.advantages.reshape(4, 4).T  # rows are [sample 0 of every prompt, sample 1, ...]
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-4)
  steps = _records(tmp_path / "run")
  assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
  assert [r["time/sample_s"] > 0 for r in steps] == [True, False] * 3
  assert all(r["clip_ratio/region_mean"] == 0.0 for r in steps[::2])
  assert any(r["grad_norm"] > 0 for r in steps)
  assert {"reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
          "completions/clipped_ratio", "kl", "entropy", "loss", "time/train_s"} <= set(steps[0])
  assert all(r["entropy"] > 0 for r in steps)
  # Each generation batch's frac_reward_zero_std, at its first step, as TRL's
  # (tests/test_grpo_trl.py); some group is tied, so each group's std would log more than 0.
  frac = lambda r_BG: float(pg.frac_reward_zero_std(jnp.asarray(r_BG, jnp.float32), "batch"))
  assert [r["frac_reward_zero_std"] for r in steps[::2]] == [frac(r_BG) for r_BG in rewards]
  assert any((r_BG == r_BG[:, :1]).all(1).any() for r_BG in rewards)


@pytest.mark.slow
def test_grpo_resumes_bitwise_after_a_crash(tmp_path):
  whole, cut = tmp_path / "whole", tmp_path / "cut"
  loop.run(_cfg(whole))
  with pytest.raises(SimulatedCrash):
    loop.run(_cfg(cut), extra_hooks={"grpo": [Crash(3)]})  # last checkpoint: step 2
  loop.run(_cfg(cut))
  assert records.timeless(_records(cut)) == records.timeless(_records(whole))
  cfg = _cfg(whole)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  a = checkpoint.load_params(str(cut / "checkpoints" / "policy"), cfg.model, mesh)
  b = checkpoint.load_params(str(whole / "checkpoints" / "policy"), cfg.model, mesh)
  import jax
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def none_for_odd(prompt, completion):
  """A reward function that abstains (None, TRL's "does not apply") on odd-length completions;
  the others score their distinct characters."""
  return None if len(completion) % 2 else float(len(set(completion)))


def test_a_single_reward_function_may_return_none():
  """One --reward_fn returning None: GRPO scores it NaN (its advantage 0, pg.advantages, checked
  against TRL in tests/test_grpo_trl.py) and the rehearsal before training lets it through when
  GRPO is the only stage that samples; online DPO and the win rate still need a number."""
  spec = "tests.test_grpo:none_for_odd"
  judge = judges.FunctionJudge(spec)
  comps = ["ab", "abc", "", "x", "abcd", "xyz", "pq", "q"]
  records = [judges.records_of("p", [c])[0] for c in comps]
  fake = types.SimpleNamespace(judge=judge, scored=lambda batch, comps_, score=None: (
      (score or judge.score)(records), np.ones(len(records), bool)))
  rewards_NF, _, info = grpo.Generated.rewarded(fake, None, None)
  want = [np.nan if len(c) % 2 else float(len(set(c))) for c in comps]
  np.testing.assert_array_equal(rewards_NF[:, 0], want)
  assert rewards_NF.shape == (8, 1) and info == {}
  adv, _ = pg.advantages(jnp.asarray(rewards_NF.reshape(2, 4, 1).transpose(1, 0, 2),
                                     jnp.float32), pg.GRPOConfig())
  assert (np.asarray(adv).T.reshape(-1)[np.isnan(want)] == 0).all()
  with pytest.raises(judges.JudgeError, match="returned None .* a reward function returns a "
                                              "finite number$"):
    judge.score(records)
  pairs = [data.PreferenceRecord("p", "ab", "abc")]
  judges.rehearse(configs.DEFAULT.replace(stage="sft,grpo", reward_fn=spec), pairs)
  with pytest.raises(judges.JudgeError, match="returned None"):
    judges.rehearse(configs.DEFAULT.replace(stage="sft,online_dpo", reward_fn=spec), pairs)


@pytest.mark.slow
def test_trl_newer_settings_train_together(tmp_path):
  """A small sft,grpo run with TRL 1.16's newer settings at once: the sapo loss, the entropy bonus
  on the top half of the tokens by entropy, the off-policy mask, normalize_then_sum, --scale_rewards
  as TRL's True, and a single reward function that abstains (None) on odd-length completions:
  it trains (the policy moves, no step skipped) and logs TRL's metrics for those settings."""
  out = tmp_path / "run"
  loop.run(_cfg(out, grpo_loss_type="sapo", entropy_coef=0.01, top_entropy_quantile=0.5,
                off_policy_mask_threshold=0.5, multi_objective_aggregation="normalize_then_sum",
                scale_rewards="True", reward_fn="tests.test_grpo:none_for_odd",
                task_eval_prompts=0, grpo_steps=4))
  steps = _records(out)
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  assert all(r["entropy"] > 0 and r["entropy_coef"] == pytest.approx(0.01)
             and np.isfinite(r["policy_loss"]) and np.isfinite(r["reward"])
             and r["skipped_steps"] == 0 for r in steps)
  assert any(r["policy_loss"] != 0 for r in steps) and any(r["grad_norm"] > 0 for r in steps)
  assert not any(k.startswith("clip_ratio/") for k in steps[0])  # sapo has no clip


def test_settings_grpo_cannot_honour_are_one_line_errors(tmp_path):
  with pytest.raises(ValueError, match="--num_generations=3: must divide --global_batch_size"):
    _cfg(tmp_path, num_generations=3)
  with pytest.raises(ValueError, match="--num_iterations=4: must divide --grpo_steps=6"):
    _cfg(tmp_path, num_iterations=4)
  with pytest.raises(ValueError, match="checkpoints fall between generation batches"):
    _cfg(tmp_path, checkpoint_every=3)
  # Flags that nothing would read: GRPO's without a grpo stage, the online section's without an
  # online stage, reward weights not one per reward function.
  with pytest.raises(ValueError, match=r"^--num_generations=4: must go with a grpo stage"):
    configs.DEFAULT.replace(num_generations=4)
  with pytest.raises(ValueError, match=r"^--online_temperature=0.5: must go with an online stage"):
    configs.DEFAULT.replace(online_temperature=0.5)
  with pytest.raises(ValueError, match=r"^--reward_weights=1.0,2.0: give one weight per "):
    _cfg(tmp_path, reward_weights=(1.0, 2.0))


# --- DAPO's dynamic sampling ----------------------------------------------------------------------

class _Fake:
  """A GRPO generation batch's sampler and judge without a model: prompt p's sample j is the
  token ids [p, j]; an even prompt's samples all score 1 (no signal), an odd one's score j."""

  @staticmethod
  def generated(max_batches=4, table_rows=8):
    import types
    from dpo import judges
    cfg = configs.DEFAULT.replace(stage="sft,grpo", num_generations=3, global_batch_size=12,
                                  dynamic_sampling=True,
                                  dynamic_sampling_max_batches=max_batches)
    tok = types.SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))
    judge = judges.FunctionJudge.wrap(
        lambda prompt, text: 1.0 if int(text.split()[0]) % 2 == 0 else float(text.split()[1]))
    table = {"tokens": np.arange(table_rows)[:, None], "segment_ids": np.ones((table_rows, 1)),
             "prompt_index": np.arange(table_rows)}

    class Fake(grpo.Generated):
      def sample(self, state, batch, key, n=2):
        return [[int(p), j] for j in range(n) for p in batch["prompt_index"]]

    return Fake(cfg, None, tok, judge, [f"p{i}" for i in range(table_rows)], None,
                types.SimpleNamespace(eos_id=99, stop_ids=()), 8, table=table)


def test_dynamic_sampling_keeps_groups_with_signal_and_draws_more_prompts():
  """A batch of prompts 0-3 has two groups with signal (1, 3); more prompts are drawn from the
  table until four groups with signal fill it; the rows keep the layout [sample j of every
  prompt], their rewards and ended flags follow them, and the draws are the same again."""
  g = _Fake.generated()
  batch = {k: v[:4] for k, v in g.table.items()}
  comps = g.sample(None, batch, None, 3)
  chosen, samples, (rewards, ended, _), figures, _ = g.dynamic(None, batch, comps,
                                                              jax.random.key(0), 10)
  kept = chosen["prompt_index"].tolist()
  assert len(kept) == 4 and all(p % 2 == 1 for p in kept) and kept[:2] == [1, 3]
  assert samples == [[p, j] for j in range(3) for p in kept]
  assert rewards[:, 0].tolist() == [float(j) for j in range(3) for _ in kept]
  assert figures["dynamic_sampling/unfilled"] == 0
  assert figures["dynamic_sampling/generation_batches"] >= 2
  again = g.dynamic(None, batch, comps, jax.random.key(0), 10)
  assert again[0]["prompt_index"].tolist() == kept  # the same draws on a resume


def test_dynamic_sampling_caps_its_draws_and_counts_what_it_could_not_fill(caplog):
  """With one generation batch at most, the two groups without signal fill the batch, counted
  and logged in one line."""
  g = _Fake.generated(max_batches=1)
  batch = {k: v[:4] for k, v in g.table.items()}
  comps = g.sample(None, batch, None, 3)
  chosen, _, (rewards, _, _), figures, _ = g.dynamic(None, batch, comps, jax.random.key(0), 3)
  assert chosen["prompt_index"].tolist() == [1, 3, 0, 2]
  assert figures == {"dynamic_sampling/generation_batches": 1,
                     "dynamic_sampling/signal_fraction": 0.5, "dynamic_sampling/unfilled": 2}
  assert "--dynamic_sampling: step 3 kept 2 of 4 groups with signal after 1 generation " \
         "batches" in caplog.text


@pytest.mark.slow
def test_a_run_with_dynamic_sampling_trains_on_groups_with_signal(tmp_path):
  """sft,grpo with --dynamic_sampling: each generation batch logs its draws, and a batch it
  filled with groups whose rewards differ has no group of ties (frac_reward_zero_std 0)."""
  out = tmp_path / "run"
  loop.run(_cfg(out, dynamic_sampling=True, dynamic_sampling_max_batches=3, num_iterations=1,
                grpo_steps=4, task_eval_prompts=0))
  steps = _records(out)
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  for r in steps:
    assert 1 <= r["dynamic_sampling/generation_batches"] <= 3
    assert 0 <= r["dynamic_sampling/unfilled"] <= 4
    if r["dynamic_sampling/unfilled"] == 0:
      assert r["frac_reward_zero_std"] == 0.0
  assert any(r["grad_norm"] > 0 for r in steps)


def test_signal_of_several_functions_follows_the_aggregation():
  """Weights (1, 2), rewards f1 = [2, 0], f2 = [0, 1]: the weighted sums tie (no signal when the
  sum is normalised), each function's rewards differ (signal when each is normalised first)."""
  r = np.array([[[2.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]]])  # [B=2, G=2, F=2]
  assert pg.has_signal(r, (1.0, 2.0)).tolist() == [False, False]
  assert pg.has_signal(r, (1.0, 2.0), "normalize_then_sum").tolist() == [True, False]
  nan = np.array([[[1.0], [np.nan]]])  # one scorable reward: no std, no signal
  assert pg.has_signal(nan).tolist() == [False]


def test_only_grpo_samples_dynamically_in_a_recipe_with_rloo_or_ppo():
  """--dynamic_sampling is GRPO's: in sft,grpo,rloo the RLOO stage's generation batches are its
  own (its Generated reads none of the grpo section but the weights)."""
  from dpo.algorithms import ppo, rloo
  cfg = configs.DEFAULT.replace(stage="sft,grpo,rloo", dynamic_sampling=True)
  g = _Fake.generated()
  assert g.dynamic_sampling
  for kind in (rloo.Generated, ppo.Generated):
    other = kind(cfg, None, None, None, [], None, None, 8)
    assert other.dynamic_sampling is False


def test_dynamic_sampling_flags_are_refused_where_nothing_reads_them():
  with pytest.raises(ValueError, match=r"^--dynamic_sampling_max_batches=2: must go with "
                     r"--dynamic_sampling"):
    configs.DEFAULT.replace(stage="sft,grpo", dynamic_sampling_max_batches=2)
  with pytest.raises(ValueError, match=r"^--dynamic_sampling=True: must go with a grpo stage"):
    configs.DEFAULT.replace(stage="sft,rloo", dynamic_sampling=True)

"""Online DPO (dpo/algorithms/online_dpo.py): which sample becomes chosen (TRL's rule), the pairs
it trains on are the judge's ordering of the policy's own samples, a run resumes bitwise after a
crash, and settings it cannot honour are one-line errors."""

import json
import os

import numpy as np
import pytest

import configs
from dpo import checkpoint, judges, loop
from dpo.algorithms import online_dpo
from models import sharding
from faults import Crash, SimulatedCrash


def assert_tree_bitwise(a, b):
  import jax
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_choose_is_trls_rule():
  """TRL 1.16 OnlineDPOTrainer.training_step: rewards laid out [first samples, second samples],
  a missing EOS costs missing_eos_penalty, and the first is chosen when first >= second."""
  rewards = np.array([1.0, 0.5, 2.0, 0.0, 0.5, 0.7, 1.0, 0.0])  # B = 4
  ended = np.array([True, True, False, True, True, True, True, True])
  first_chosen, r = online_dpo.choose(rewards, ended, 0.0)
  assert first_chosen.tolist() == [True, False, True, True]  # ties (0.0, 0.0) keep the first
  first_chosen, r = online_dpo.choose(rewards, ended, 1.5)
  assert r.tolist() == [1.0, 0.5, 0.5, 0.0, 0.5, 0.7, 1.0, 0.0]
  assert first_chosen.tolist() == [True, False, False, True]


def test_prompt_table_holds_each_distinct_prompt_once_left_padded():
  pairs = {"tokens": np.array([[[5, 6, 7, 0], [5, 6, 8, 0]], [[5, 6, 9, 1], [5, 6, 2, 0]],
                               [[3, 4, 4, 0], [3, 4, 5, 0]]], np.int32)}
  pairs["loss_mask"] = np.zeros(pairs["tokens"].shape, np.float32)
  pairs["loss_mask"][:, :, 2:] = 1
  table, index = online_dpo.prompt_table(pairs, pad_id=0)
  assert index == [0, 2]
  assert table["tokens"].shape == (2, 8) and table["tokens"][:, -2:].tolist() == [[5, 6], [3, 4]]
  assert table["segment_ids"].sum(axis=1).tolist() == [2, 2]


def _cfg(out, **kw):
  return configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
      task_train_pairs=128, task_sft_examples=64, task_eval_pairs=16, task_eval_prompts=8,
      global_batch_size=8, sft_steps=20, online_steps=6, sft_learning_rate=3e-3,
      learning_rate=1e-3, log_every=1, eval_every=0, checkpoint_every=2, eval_max_new_tokens=8,
      online_max_new_tokens=8, stage="sft,online_dpo", output_dir=str(out), **kw)


def length_reward(prompt, completion):
  return float(len(completion))


@pytest.mark.slow
def test_online_pairs_are_the_judges_ordering_of_the_policys_samples(tmp_path, monkeypatch):
  """With a judge that prefers longer text, every pair trained on has the longer (or, on a tie,
  the first) of the two samples as chosen; the logged scores are the judge's."""
  seen = []
  pair_rows = online_dpo.pair_rows

  def recording(prompts, chosen, rejected, seq_len, pad_id):
    seen.append((chosen, rejected))
    return pair_rows(prompts, chosen, rejected, seq_len, pad_id)

  monkeypatch.setattr(online_dpo, "pair_rows", recording)
  out = tmp_path / "run"
  summary = loop.run(_cfg(out, reward_fn="tests.test_online_dpo:length_reward"))
  assert len(seen) == 6 and all(len(c) == 8 for c, _ in seen)
  data = loop.Data(_cfg(out))
  stops = {data.tok.eos_id}
  text = lambda ids: data.tok.decode(ids[:-1] if ids and ids[-1] in stops else ids)
  for chosen, rejected in seen:
    assert all(len(text(c)) >= len(text(r)) for c, r in zip(chosen, rejected))
  with open(out / "metrics.jsonl") as f:
    steps = [json.loads(l) for l in f if '"stage": "online_dpo"' in l]
  assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
  for r in steps:
    assert r["objective/scores_margin"] >= 0 and r["objective/scores"] > 0
    assert {"time/sample_s", "time/judge_s", "time/train_s", "val/contain_eos_token",
            "rewards/margins", "loss"} <= set(r)
  assert summary["judge"] == "reward function tests.test_online_dpo:length_reward"
  assert os.path.isdir(out / "checkpoints" / "policy")


@pytest.mark.slow
def test_online_dpo_resumes_bitwise_after_a_crash(tmp_path):
  """A crash after online step 3 (last checkpoint: step 2): the rerun samples and trains what
  the uninterrupted run did, record for record and weight for weight."""
  whole, cut = tmp_path / "whole", tmp_path / "cut"
  loop.run(_cfg(whole))
  with pytest.raises(SimulatedCrash):
    loop.run(_cfg(cut), extra_hooks={"online_dpo": [Crash(3)]})
  loop.run(_cfg(cut))
  strip = lambda d: [{k: v for k, v in json.loads(l).items()
                      if not k.startswith("time/") and k not in ("tokens_per_sec",
                                                                 "eval/eval_time_s")}
                     for l in open(d / "metrics.jsonl")]
  assert strip(cut) == strip(whole)
  cfg = _cfg(whole)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  assert_tree_bitwise(checkpoint.load_params(str(cut / "checkpoints" / "policy"), cfg.model, mesh),
                      checkpoint.load_params(str(whole / "checkpoints" / "policy"), cfg.model,
                                             mesh))


def test_settings_an_online_stage_cannot_honour_are_one_line_errors():
  base = configs.DEFAULT.replace(stage="sft,online_dpo")
  with pytest.raises(ValueError, match="--precompute_ref=True: the online stage online_dpo"):
    base.replace(precompute_ref=True)
  with pytest.raises(ValueError, match="--packing=True: the online stage"):
    base.replace(packing=True)
  with pytest.raises(ValueError, match="an online stage needs a judge"):
    base.replace(train_data="pairs.jsonl")
  with pytest.raises(ValueError, match="--judge=rm: must go with an rm stage before"):
    base.replace(judge="rm")
  assert judges.source(base) == "reward_fn:dpo.task:reward"

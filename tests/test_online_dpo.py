"""Online DPO (dpo/algorithms/online_dpo.py): which sample becomes chosen (TRL's rule), the pairs
it trains on are the judge's ordering of the policy's own samples, a run resumes bitwise after a
crash, and settings it cannot honour are one-line errors."""

import json
import os

import numpy as np
import pytest

import configs
import records
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
  assert records.metrics(cut) == records.metrics(whole)
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


def _trl_online_dpo(rewards, ended, logps, ref_logps, mask, beta, penalty):
  """(loss, stats) of TRL 1.16 OnlineDPOTrainer.training_step on 2B given completions (laid out
  [first samples, second samples]): generation, the forward passes and the reward functions
  replaced by the given tensors, so TRL's own code picks chosen and rejected and computes the
  loss."""
  import collections
  import types
  torch = pytest.importorskip("torch")
  trl_online = pytest.importorskip("trl.experimental.online_dpo.online_dpo_trainer")
  EOS, PAD = 2, 0
  n, L = mask.shape
  completion_ids = np.where(mask > 0, 7, PAD)
  last = mask.sum(axis=1).astype(int) - 1
  completion_ids[np.arange(n)[ended], last[ended]] = EOS
  t = object.__new__(trl_online.OnlineDPOTrainer)
  t.args = types.SimpleNamespace(use_vllm=False, missing_eos_penalty=penalty or None,
                                 loss_type="sigmoid", n_gpu=1, optim="adamw_torch",
                                 gradient_accumulation_steps=1, torch_empty_cache_steps=None)
  t.accelerator = types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x,
                                        backward=lambda loss, **kw: None)
  t.eos_token_ids, t._beta, t.reward_funcs = [EOS], beta, [object()]
  t.ref_model = object()
  t.stats = collections.defaultdict(list)
  t.state = types.SimpleNamespace(global_step=1)
  t.processing_class = types.SimpleNamespace(
      batch_decode=lambda ids, skip_special_tokens=True: ["c"] * len(ids))
  prompt = torch.ones((n, 3), dtype=torch.long)
  t._generate = lambda model, prompts, images: (
      prompt, torch.ones_like(prompt), torch.tensor(completion_ids), torch.tensor(mask), None)
  t._forward = lambda model, *args: torch.tensor(ref_logps if model is t.ref_model else logps)
  t._calculate_rewards_from_functions = lambda **kw: torch.tensor(rewards, dtype=torch.float32)
  loss = t.training_step(types.SimpleNamespace(train=lambda: None), {"prompt": ["p"] * (n // 2)})
  return float(loss), {k: v[-1] for k, v in t.stats.items()}


@pytest.mark.parametrize("penalty", [0.0, 1.0])
def test_chosen_pairs_and_loss_equal_trls_online_dpo(penalty):
  """TRL's OnlineDPOTrainer (its own training_step) and ours pick the same chosen samples and
  give the same sigmoid loss and score margin on the same rewards and log-probs, ties and a
  missing EOS included."""
  import jax.numpy as jnp
  from dpo import losses
  rng = np.random.default_rng(0)
  B, L = 6, 5
  rewards = np.array([1.0, 0.2, 0.5, 0.3, 2.0, 0.0, 0.5, 0.9, 0.5, 0.3, 1.5, 0.4], np.float32)
  ended = np.array([True, False, True, True, True, True, True, True, True, False, True, True])
  mask = (np.arange(L)[None] < rng.integers(2, L + 1, 2 * B)[:, None]).astype(np.float32)
  logps = (rng.normal(-1.0, 0.5, (2 * B, L)) * mask).astype(np.float32)
  ref = (rng.normal(-1.0, 0.5, (2 * B, L)) * mask).astype(np.float32)
  beta = 0.1
  trl_loss, stats = _trl_online_dpo(rewards, ended, logps, ref, mask, beta, penalty)
  first, r = online_dpo.choose(rewards, ended, penalty)
  pick = lambda a: np.where(first, a[:B], a[B:])
  other = lambda a: np.where(first, a[B:], a[:B])
  s, sr = (logps * mask).sum(1), (ref * mask).sum(1)
  lp = losses.Logps(jnp.asarray(pick(s)), jnp.asarray(other(s)), jnp.asarray(pick(sr)),
                    jnp.asarray(other(sr)), jnp.asarray(pick(mask.sum(1))),
                    jnp.asarray(other(mask.sum(1))))
  d = configs.DEFAULT.loss
  ours, _ = losses.sigmoid(lp, beta, 0.0, d.f_divergence, d.f_alpha)
  assert float(ours.mean()) == pytest.approx(trl_loss, rel=1e-5)
  assert stats["objective/scores_margin"] == pytest.approx(float((pick(r) - other(r)).mean()),
                                                           rel=1e-5)
  assert stats["val/contain_eos_token"] == pytest.approx(float(ended.mean()))


# --- the judge: what it is, and its failures before any work ------------------------------------

def raising_reward(prompt, completion):
  raise RuntimeError("judge crashed")


def string_reward(prompt, completion):
  return "high"


def nan_reward(prompt, completion):
  return float("nan")


@pytest.mark.parametrize("fn,says", [
    ("raising_reward", "raised RuntimeError: judge crashed on training record 0, tried before "
                       "training: response 0 (prompt "),
    ("string_reward", "returned 'high' (str) for training record 0, tried before training: "
                      "response 0 (prompt "),
    ("nan_reward", "returned nan (float) for training record 0, tried before training: "
                   "response 0 (prompt "),
])
def test_a_failing_reward_function_is_refused_before_any_compile(tmp_path, monkeypatch, fn, says):
  """Tried on the data's first records before the model is built (nothing compiled or sampled):
  one line naming the function, the record, its prompt and the value."""
  def built(*_):
    raise AssertionError("the model was built before the reward function was tried")
  monkeypatch.setattr(loop, "initial_params", built)
  with pytest.raises(judges.JudgeError) as e:
    loop.run(_cfg(tmp_path / "run", reward_fn=f"tests.test_online_dpo:{fn}"))
  message = str(e.value)
  assert message.startswith(f"--reward_fn=tests.test_online_dpo:{fn}: {says}"), message
  assert "\n" not in message and len(message) < 300
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_launch_says_a_raising_reward_function_in_one_line(tmp_path):
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  (tmp_path / "crashing_judge.py").write_text(
      "def reward(prompt, completion):\n  raise RuntimeError('judge crashed')\n")
  cmd = [sys.executable, "launch.py", "--stage=sft,online_dpo",
         "--reward_fn=crashing_judge:reward", f"--output_dir={tmp_path / 'run'}"]
  r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300,
                     env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(tmp_path)})
  assert r.returncode == 2, r.stderr[-2000:]
  errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
  assert len(errors) == 1 and "raised RuntimeError: judge crashed on training record 0" in \
      errors[0], r.stderr[-2000:]
  assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_resume_onto_a_changed_reward_function_is_refused(tmp_path, monkeypatch):
  """Killed after online step 3; the --reward_fn module's source edited; the same command is
  refused in one line naming the flag, the checkpoint left as it was; restored, it resumes."""
  module = tmp_path / "judge_module_resume.py"
  source = "def reward(prompt, completion):\n  return float(len(completion))\n"
  module.write_text(source)
  monkeypatch.syspath_prepend(str(tmp_path))
  cfg = _cfg(tmp_path / "run", reward_fn="judge_module_resume:reward")
  with pytest.raises(SimulatedCrash):
    loop.run(cfg, extra_hooks={"online_dpo": [Crash(3)]})
  module.write_text(source.replace("len(completion)", "-len(completion)"))
  with pytest.raises(checkpoint.CheckpointError) as e:
    loop.run(cfg)
  message = str(e.value)
  assert "\n" not in message and "refusing to resume it" in message
  assert "judge: '--reward_fn=judge_module_resume:reward: source sha256 " in message
  assert "use a fresh --output_dir" in message
  module.write_text(source)
  loop.run(cfg)
  assert os.path.isdir(tmp_path / "run" / "checkpoints" / "policy")

"""The PPO stage (dpo/algorithms/ppo.py; its objective is checked against Tunix in
tests/test_ppo_tunix.py): generation batches of one completion a prompt reused for
ppo_num_iterations updates, the value model trained beside the policy (separate, or a head on
the policy's trunk), a bitwise resume after a kill during generation, during an update and
during a checkpoint, and the settings it refuses."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import records
from dpo import checkpoint, data, judges, loop, registry, train
from dpo.algorithms import ppo
from faults import Killed, kill_at
from models import sharding, transformer


def _cfg(out, **kw):
  return configs.DEFAULT.replace(**{
      **dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
             task_train_pairs=128, task_sft_examples=64, task_eval_pairs=16, task_eval_prompts=8,
             global_batch_size=16, sft_steps=20, ppo_steps=6, ppo_num_iterations=2,
             sft_learning_rate=3e-3, learning_rate=1e-3, ppo_value_learning_rate=1e-2,
             ppo_max_completion_length=8, log_every=1, eval_every=0, checkpoint_every=2,
             eval_max_new_tokens=8, stage="sft,ppo", output_dir=str(out),
             reward_fn="tests.test_grpo:length_reward"), **kw})


def _records(out):
  with open(out / "metrics.jsonl") as f:
    return [json.loads(l) for l in f if '"stage": "ppo"' in l]


def _strip(rows):
  return records.timeless(rows)


def _policy(out):
  cfg = _cfg(out)
  return checkpoint.load_params(str(out / "checkpoints" / "policy"), cfg.model,
                                sharding.make_mesh(cfg.mesh.mesh))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
  """An uninterrupted run and the generation batches it drew."""
  out = tmp_path_factory.mktemp("whole")
  batches = []
  generation = ppo.Generated.generation

  def recording(self, *args):
    result = generation(self, *args)
    batches.append(result[0])
    return result

  ppo.Generated.generation = recording
  try:
    loop.run(_cfg(out))
  finally:
    ppo.Generated.generation = generation
  return out, batches


@pytest.mark.slow
def test_ppo_trains_the_policy_and_its_value_model(whole):
  """Samples at steps 1, 3, 5 (ppo_num_iterations 2), one completion for each of 16 prompts;
  advantages whitened over the completion tokens; the value model's predictions move toward
  the returns; the first update of a batch is on-policy (no clipping); the policy moves."""
  out, batches = whole
  assert len(batches) == 3
  for b in batches:
    mask = b.rows.loss_mask > 0
    assert b.rows.tokens.shape[0] == 16 and b.advantages.shape == b.rows.tokens.shape
    assert abs(b.advantages[mask].mean()) < 1e-4 and abs(b.advantages[mask].std(ddof=1) - 1) < 1e-3
    assert (b.returns[mask] != 0).any() and (b.old_values[mask] != 0).any()
  steps = _records(out)
  assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
  assert [r["time/sample_s"] > 0 for r in steps] == [True, False] * 3
  # A batch's first update is on-policy: ratio 1, so the token mean of -A (whitened) is 0; the
  # second (after an update; step 1's learning rate is warmup's 0) is not.
  assert all(abs(r["policy_loss"]) < 1e-5 and r["pg_clipfrac"] == 0.0 for r in steps[::2])
  assert abs(steps[3]["policy_loss"]) > 1e-4 and abs(steps[5]["policy_loss"]) > 1e-4
  assert {"reward", "kl", "entropy", "policy_loss", "vf_loss", "vpred_mean", "vf_clipfrac",
          "return_mean", "loss", "grad_norm"} <= set(steps[0])
  assert steps[-1]["vf_loss"] < steps[0]["vf_loss"]
  # The exported policy holds no value model: the SFT model's tree, not the state's.
  sft = checkpoint.load_params(str(out / "checkpoints" / "sft_model"), _cfg(out).model,
                               sharding.make_mesh(_cfg(out).mesh.mesh))
  policy = _policy(out)
  assert jax.tree.structure(policy) == jax.tree.structure(sft)
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(policy), jax.tree.leaves(sft)))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["generation", "update", "checkpoint"])
def test_a_killed_ppo_run_resumes_bitwise(whole, tmp_path, monkeypatch, where):
  """Killed while sampling its second generation batch (step 3), during the update of step 4
  (the value model's and the policy's, one jitted step), or while writing the step-4 checkpoint,
  then run again: the same records and the same policy, bit for bit."""
  if where == "generation":
    sample, calls = ppo.Generated.sample, {"n": 0}

    def killing(self, *args):
      calls["n"] += 1
      if calls["n"] == 2:
        raise Killed("killed during generation")
      return sample(self, *args)
    monkeypatch.setattr(ppo.Generated, "sample", killing)
  elif where == "update":
    call = ppo.Generated.__call__

    def wrapped(self, spec, update):
      def killing_update(state, frozen, batch):
        if int(state.step) == 3:
          raise Killed("killed during the update")
        return update(state, frozen, batch)
      return call(self, spec, killing_update)
    monkeypatch.setattr(ppo.Generated, "__call__", wrapped)
  else:
    kill_at(monkeypatch, "manifest", "step_00000004")
  cut = tmp_path / "cut"
  with pytest.raises(Killed):
    loop.run(_cfg(cut))
  monkeypatch.undo()
  loop.run(_cfg(cut))
  assert _strip(_records(cut))[-6:] == _strip(_records(whole[0]))
  for a, b in zip(jax.tree.leaves(_policy(cut)), jax.tree.leaves(_policy(whole[0]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize("value_model,lora_rank", [("head", 4), ("separate", 0)])
def test_the_value_model_kinds(tmp_path, caplog, value_model, lora_rank):
  """A head on the policy's trunk (with LoRA), and a separate copy of every weight (full
  fine-tune): each trains, with its own part of the state, which the stage's memory line
  counts."""
  with caplog.at_level("INFO"):
    loop.run(_cfg(tmp_path, ppo_value_model=value_model, lora_rank=lora_rank, ppo_steps=4))
  [line] = [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("ppo: per-device arrays: ")]
  kib = {k: float(v) * (1024 if unit == "MiB" else 1)
         for k, v, unit in re.findall(r"(\w+(?: state)?) (\d+\.\d+) (MiB|KiB)", line)}
  assert set(kib) == {"frozen", "trained", "policy", "beside", "optimizer state"}, line
  assert abs(kib["trained"] - kib["policy"] - kib["beside"]) <= 0.2, line
  assert kib["optimizer state"] >= 2 * kib["trained"], line  # AdamW's two moments of both parts
  if value_model == "separate":  # a copy of every weight beside the policy, which the
    assert kib["beside"] > kib["policy"] == kib["frozen"], line  # reference equals in size
  else:  # a head on the policy's trunk: a vector beside the LoRA factors
    assert 0 < kib["beside"] < kib["policy"] < kib["frozen"], line
  steps = _records(tmp_path)
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  assert steps[-1]["vf_loss"] < steps[0]["vf_loss"]
  assert steps[-1]["vpred_mean"] != steps[0]["vpred_mean"]
  # A step checkpoint of the two-part state reads back as the policy's weights (--init_from).
  cfg = _cfg(tmp_path, lora_rank=lora_rank)
  if not lora_rank:
    step4 = checkpoint.load_params(str(tmp_path / "checkpoints" / "ppo" / "step_00000004"),
                                   cfg.model, sharding.make_mesh(cfg.mesh.mesh))
    for a, b in zip(jax.tree.leaves(step4), jax.tree.leaves(_policy(tmp_path))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_values_are_read_where_the_log_probs_are(tmp_path):
  """The value of token t is the head at slot t - 1 (whose logits score token t), 0 off the
  mask; the value model's initial weights take the kind's shape, the same head either way."""
  h = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
  score = jnp.asarray([[1.0], [0.0], [0.0]])
  mask = jnp.asarray([[0, 1, 1, 0], [0, 0, 1, 1]], jnp.float32)
  v = ppo._token_values(h, score, mask)
  np.testing.assert_array_equal(v, [[0, 0, 3, 0], [0, 0, 15, 18]])
  key = jax.random.key(0)
  made = {}
  for kind, rank in (("separate", 4), ("separate", 0), ("head", 4), ("head", 0)):
    cfg = _cfg(tmp_path, ppo_value_model=kind, lora_rank=rank)
    mesh = sharding.make_mesh(cfg.mesh.mesh)
    base = transformer.init(cfg.model, jax.random.key(1), mesh)
    made[kind, rank] = ppo.value_model(cfg, mesh, base, key)
  assert set(made["separate", 4]) == {"body", "score"} and set(made["head", 4]) == {"score"}
  assert jax.tree.structure(made["separate", 0]["body"]) == jax.tree.structure(base)
  for kind, rank in made:
    assert made[kind, rank]["score"].shape == (32, 1)
    np.testing.assert_array_equal(made[kind, rank]["score"], made["separate", 4]["score"])


def test_settings_ppo_cannot_honour_are_one_line_errors(tmp_path):
  with pytest.raises(ValueError, match=r"^--ppo_num_iterations=4: must divide --ppo_steps=6"):
    _cfg(tmp_path, ppo_num_iterations=4)
  with pytest.raises(ValueError, match="checkpoints fall between generation batches"):
    _cfg(tmp_path, checkpoint_every=3)
  with pytest.raises(ValueError, match=r"^--ppo_vf_coef=0.5: weighs the value loss on the "
                                       r"policy's trunk"):
    _cfg(tmp_path, ppo_vf_coef=0.5)
  assert _cfg(tmp_path, ppo_vf_coef=0.5, ppo_value_model="head").ppo.ppo_vf_coef == 0.5
  with pytest.raises(ValueError, match=r"^--ref_update=soft: the ppo stage keeps its reference"):
    _cfg(tmp_path, ref_update="soft")
  with pytest.raises(ValueError, match=r"^--num_generations=4: must go with a grpo stage"):
    _cfg(tmp_path, num_generations=4)
  with pytest.raises(ValueError, match=r"^--ppo_beta=0.1: must go with a ppo stage"):
    configs.DEFAULT.replace(ppo_beta=0.1)
  # The shared online section, per field: what only another stage reads is refused.
  with pytest.raises(ValueError, match=r"^--grpo_steps=50: read only by the grpo stage "
                                       r"\(--stage=sft,ppo has none\)$"):
    _cfg(tmp_path, grpo_steps=50)
  with pytest.raises(ValueError, match=r"^--online_max_new_tokens=8: read only by the "
                                       r"online_dpo or iterative_dpo stage"):
    _cfg(tmp_path, online_max_new_tokens=8)
  assert _cfg(tmp_path, online_temperature=0.7).online.online_temperature == 0.7
  with pytest.raises(ValueError, match="ppo_value_model"):
    _cfg(tmp_path, ppo_value_model="shared")
  # A reward function's None: refused before training (PPO's rewards need every score).
  with pytest.raises(judges.JudgeError, match="returned None"):
    judges.rehearse(configs.DEFAULT.replace(stage="sft,ppo",
                                            reward_fn="tests.test_grpo:none_for_odd"),
                    [data.PreferenceRecord("p", "ab", "abc")])
  assert registry.ALGORITHMS["ppo"].policy_part({"policy": 1, "beside": 2}) == 1
  assert isinstance(ppo.optimizer(ppo.step_config(_cfg(tmp_path)))[0], train.PerPart)

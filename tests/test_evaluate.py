"""Evaluation: win rate, distinct-n, on-policy KL, and the Evaluator's self-comparison limits."""

import zlib

import jax
import numpy as np
import pytest

from configs import Config, DataConfig, LoraConfig, ModelConfig
from dpo import data as data_lib
from dpo import evaluate, judges, task
from dpo.tokenizer import ByteTokenizer
from models import lora as lora_lib
from models import sampler as sampler_lib
from models import sharding, transformer

TOK = ByteTokenizer()
CFG = Config(
    model=ModelConfig(vocab_size=264, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      mlp_dim=64, init_std=0.1),
    lora=LoraConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0),
    data=DataConfig(max_prompt_length=32, max_target_length=12)).replace(
        global_batch_size=8, eval_batch_size=64, eval_temperature=1.0)
PROMPTS = task.eval_prompts(128)


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh("data:-1")


@pytest.fixture(scope="module")
def params(mesh):
  return transformer.init(CFG.model, jax.random.key(0), mesh)


@pytest.fixture(scope="module")
def lora(mesh):
  fresh = lora_lib.init(CFG.model, CFG.lora, jax.random.key(1), mesh)
  return jax.tree.map(lambda x: x + 0.5 * jax.random.normal(jax.random.key(2), x.shape), fresh)


def _hash_reward(text: str) -> float:
  """A reward with (almost) no ties that does not favour either side."""
  return zlib.crc32(text.encode()) / 2**32


_HASH_JUDGE = judges.FunctionJudge.wrap(lambda prompt, text: _hash_reward(text), "hash")


def test_win_rate_counts_ties_half():
  assert evaluate.win_rate([1.0, 0.0, 0.5, -1.0], [0.0, 0.0, 1.0, -1.0]) == pytest.approx(0.5)
  assert evaluate.win_rate([1.0, 1.0, 1.0], [0.0, 1.0, 2.0]) == pytest.approx(0.5)
  assert evaluate.win_rate([0.3, 0.2], [0.1, 0.1]) == 1.0
  with pytest.raises(ValueError):
    evaluate.win_rate([1.0], [1.0, 2.0])


@pytest.mark.slow
def test_completion_logps_match_numpy(params, lora, mesh):
  scfg = evaluate.sampling_config(CFG, TOK)
  stats = data_lib.TruncationStats()
  prompts = [data_lib.encode_prompt(TOK, p, 32, stats) for p in PROMPTS[:16]]
  comps = evaluate.sample(CFG, mesh, scfg, evaluate.Weights(params, lora), prompts,
                          jax.random.key(3))
  pol, ref, counts = evaluate.completion_logps(CFG, mesh, evaluate.Weights(params, lora), params,
                                               list(zip(prompts, comps)), TOK.pad_id)
  merged = lora_lib.merge(params, lora, CFG.lora)

  def numpy_logp(p, prompt, comp):
    seq = np.array(prompt + comp, np.int32)[None]
    pos = np.arange(seq.shape[1], dtype=np.int32)[None]
    logits = np.asarray(transformer.forward(CFG.model, p, transformer.Inputs(seq, pos,
        np.ones_like(seq))), np.float64)
    z = logits[0] - logits[0].max(-1, keepdims=True)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return sum(logsm[len(prompt) + i - 1, t] for i, t in enumerate(comp))

  for i in range(0, 16, 5):
    np.testing.assert_allclose(pol[i], numpy_logp(merged, prompts[i], comps[i]), rtol=1e-4,
                               atol=1e-3)
    np.testing.assert_allclose(ref[i], numpy_logp(params, prompts[i], comps[i]), rtol=1e-4,
                               atol=1e-3)
    assert counts[i] == len(comps[i])


def test_sampling_compiles_once_whatever_each_batchs_longest_prompt(params, lora, mesh):
  # Three batches of 4, 4 and 2 prompts whose longest prompts pad to 8, 16 and 24 tokens: one
  # shape, so one compile of the sampler for these weights (each batch's own width took three).
  cfg = CFG.replace(eval_batch_size=4, eval_max_new_tokens=3)
  scfg = evaluate.sampling_config(cfg, TOK)
  prompts = [[257] + [65] * n for n in (3, 4, 5, 6, 10, 12, 14, 4, 20, 3)]
  weights = evaluate.Weights(params, lora)
  before = sampler_lib.generate._cache_size()
  comps = evaluate.sample(cfg, mesh, scfg, weights, prompts, jax.random.key(5))
  assert sampler_lib.generate._cache_size() == before + 1
  assert len(comps) == len(prompts) and all(1 <= len(c) <= 3 for c in comps)


@pytest.mark.slow
def test_kl_of_policy_against_itself_is_zero(params, mesh):
  zero_delta = lora_lib.init(CFG.model, CFG.lora, jax.random.key(4), mesh)  # B = 0
  ev = evaluate.Evaluator(CFG, mesh, evaluate.EvalSet(TOK, PROMPTS[:32],
      judge=judges.FunctionJudge("dpo.task:reward")), params)
  for lora in (None, zero_delta):
    m, _ = ev(evaluate.Weights(params, lora))
    assert m["kl_per_sequence"] == 0.0 and m["kl_per_token"] == 0.0


@pytest.mark.slow
def test_kl_positive_for_a_different_policy(params, lora, mesh):
  ev = evaluate.Evaluator(CFG, mesh, evaluate.EvalSet(TOK, PROMPTS, judge=judges.FunctionJudge("dpo.task:reward")),
      params)
  m, _ = ev(evaluate.Weights(params, lora))
  assert m["kl_per_sequence"] > 0.1 and m["kl_per_token"] > 0.0


def test_self_win_rate_is_half(params, mesh):
  # Greedy: identical samples, every prompt a tie -> exactly 0.5.
  greedy = CFG.replace(eval_temperature=0.0)
  m, ex = evaluate.Evaluator(greedy, mesh, evaluate.EvalSet(TOK, PROMPTS[:32],
      judge=_HASH_JUDGE), params)(
      evaluate.Weights(params))
  assert m["win_rate"] == 0.5 and all(s["policy"] == s["reference"] for s in ex)
  # Sampled: independent draws from the same model; 0.5 in expectation (sd ~0.03 for 256).
  ev = evaluate.Evaluator(CFG, mesh, evaluate.EvalSet(TOK, task.eval_prompts(256),
      judge=_HASH_JUDGE), params)
  m, ex = ev(evaluate.Weights(params))
  assert sum(s["policy"] != s["reference"] for s in ex) > 200
  assert abs(m["win_rate"] - 0.5) < 0.12
  assert m["policy_reward"] != m["reference_reward"]


def test_no_ground_truth_reward_reports_na(params, lora, mesh):
  ev = evaluate.Evaluator(CFG, mesh, evaluate.EvalSet(TOK, PROMPTS[:16], judge=None), params)
  m, ex = ev(evaluate.Weights(params, lora))
  for k in ("win_rate", "policy_reward", "reference_reward", "reward_accuracy",
            "reward_margin", "perplexity", "policy_wellformed_rate", "reference_wellformed_rate"):
    assert m[k] is None, k
  assert ex[0]["policy_reward"] is None and ex[0]["policy_well_formed"] is None
  assert m["kl_per_sequence"] is not None and len(ex) == 16
  table = evaluate.report(m, ex, show=2)
  assert "n/a" in table and PROMPTS[0] in table


@pytest.mark.slow
def test_pair_metrics_match_numpy(params, lora, mesh):
  recs = task.preference_records(12, seed=0, held_out=True)
  arrays = data_lib.tokenize_pairs(recs, TOK, 32, 40)
  m = evaluate.pair_metrics(CFG, mesh, evaluate.Weights(params, lora), params, arrays,
                           batch_size=8)
  stats = data_lib.TruncationStats()
  prompts = [data_lib.encode_prompt(TOK, r.prompt, 32, stats) for r in recs]
  comps = {w: [data_lib.encode_completion(TOK, getattr(r, w), 40, stats) for r in recs]
           for w in ("chosen", "rejected")}
  lp = {w: evaluate.completion_logps(CFG, mesh, evaluate.Weights(params, lora), params,
                                     list(zip(prompts, comps[w])), TOK.pad_id) for w in comps}
  beta = CFG.loss.beta
  rc = beta * (lp["chosen"][0] - lp["chosen"][1])
  rr = beta * (lp["rejected"][0] - lp["rejected"][1])
  assert m["reward_accuracy"] == pytest.approx(np.mean(rc > rr))
  assert m["reward_margin"] == pytest.approx(np.mean(rc - rr), rel=1e-4, abs=1e-4)
  ppl = np.exp(-lp["chosen"][0].sum() / lp["chosen"][2].sum())
  assert m["perplexity"] == pytest.approx(ppl, rel=1e-4)


def test_samples_carry_rewards_and_well_formedness(params, lora, mesh):
  ev = evaluate.Evaluator(CFG, mesh, evaluate.EvalSet(TOK, PROMPTS[:16], judge=judges.FunctionJudge("dpo.task:reward"),
                          well_formed_fn=task.well_formed), params)
  m, samples = ev(evaluate.Weights(params, lora))
  assert [s["prompt"] for s in samples] == PROMPTS[:16]
  for s in samples:
    assert s["policy_reward"] == task.true_reward(s["policy"])
    assert s["reference_well_formed"] == task.well_formed(s["prompt"], s["reference"])
  assert m["policy_wellformed_rate"] == np.mean([s["policy_well_formed"] for s in samples])


def test_verdicts_pass_fail_and_unmeasured():
  good = {"win_rate": 0.85, "kl_per_token": 0.05, "perplexity": 1.4,
          "policy_wellformed_rate": 0.97, "reference_wellformed_rate": 0.99}
  rows = evaluate.verdicts(good, reference_perplexity=1.35)
  assert [r["verdict"] for r in rows] == ["PASS"] * 5
  bad = {**good, "kl_per_token": 0.3, "policy_wellformed_rate": 0.48}
  rows = {r["target"]: r for r in evaluate.verdicts(bad, reference_perplexity=1.35)}
  assert rows["KL per token (nats)"]["verdict"] == "FAIL"
  assert rows["well-formed: policy"] == {"target": "well-formed: policy", "want": ">= 0.95",
                                         "value": 0.48, "verdict": "FAIL"}
  none = evaluate.verdicts({"win_rate": None, "kl_per_token": 0.05}, reference_perplexity=None)
  assert [r["verdict"] for r in none] == ["n/a", "PASS", "n/a", "n/a", "n/a"]
  table = evaluate.report(bad, [], 0, evaluate.verdicts(bad, 1.35))
  assert "2 target(s) failed" in table and "FAIL  KL per token" in table

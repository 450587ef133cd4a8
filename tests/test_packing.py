"""Shared-prefix rows: the layout, and log-probs, KL and whole DPO steps equal to the unshared
layout's (the pair rows of data.tokenize_pairs, scored by the vmapped per-side path)."""

import dataclasses

import jax
import numpy as np
import pytest

import configs
from dpo import data, logprobs, packing, task, train
from dpo.tokenizer import ByteTokenizer
from models import lora as lora_lib
from models import sharding, transformer

CFG = configs.DEFAULT.replace(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                              mlp_dim=48, init_std=0.2, global_batch_size=6, lora_dropout=0.0,
                              learning_rate=1e-2, steps=4)

RECORDS = [data.PreferenceRecord("Review: fine", " good, I liked it", " bad"),
           data.PreferenceRecord("A longer prompt here", " x", " a much longer rejected answer"),
           data.PreferenceRecord("Q", " same start one", " same start two"),
           data.PreferenceRecord("Tell me", "", " nothing"),
           *task.preference_records(2, 0)]


@pytest.fixture(scope="module")
def setup():
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  pairs = data.tokenize_pairs(RECORDS, ByteTokenizer(), 40, 48)
  shared, summary = packing.shared_prefix(pairs)
  base = transformer.init(CFG.model, jax.random.key(0), mesh)
  # B != 0, so the adapted policy differs from the base.
  lora = jax.tree.map(lambda x: x + 0.05, lora_lib.init(CFG.model, CFG.lora, jax.random.key(1), mesh))
  return mesh, pairs, shared, summary, base, lora


def test_layout_copies_each_token_once(setup):
  _, pairs, shared, summary, _, _ = setup
  assert "prefix sharing: 6 pairs" in summary
  prompt, why = packing.prompt_lengths(pairs)
  assert why is None
  for i in range(len(RECORDS)):
    n_w, n_l = pairs["segment_ids"][i].sum(-1)
    p = prompt[i]
    row = shared["shared_tokens"][i]
    want = np.concatenate([pairs["tokens"][i, 0, :n_w], pairs["tokens"][i, 1, p:n_l]])
    np.testing.assert_array_equal(row[:len(want)], want)
    assert shared["shared_segment_ids"][i].sum() == len(want)
    np.testing.assert_array_equal(shared["shared_positions"][i, n_w:len(want)], np.arange(p, n_l))
    np.testing.assert_array_equal(shared["shared_branch"][i, :len(want)],
                                  [0] * p + [1] * (n_w - p) + [2] * (n_l - p))
    assert shared["score_weight"][i].sum() == pairs["loss_mask"][i].sum()


def _stats(params, batch, **kw):
  fn = jax.jit(lambda p, b: logprobs.pair_stats(CFG.model, p, b, wpo=True, **kw))
  return fn(params, batch)


@pytest.mark.parametrize("adapter", [False, True])
def test_shared_pair_stats_equal_unshared(setup, adapter):
  _, pairs, shared, _, base, lora = setup
  kw = {"lora": lora, "lora_scale": CFG.lora.scale} if adapter else {}
  want = _stats(base, pairs, **kw)
  got = _stats(base, {**pairs, **shared}, **kw)
  for name in ("logps", "tokens", "shared_logps", "wpo_logw"):
    np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                               rtol=1e-5, atol=1e-5, err_msg=name)


def test_chunked_head_equals_whole_vocabulary_with_gradients(setup):
  _, pairs, shared, _, base, lora = setup
  batch = {**pairs, **shared}
  chunked = dataclasses.replace(CFG.model, logits_chunk=CFG.model.vocab_size // 8)

  def total(cfg):
    def f(lp):
      s = logprobs.pair_stats(cfg, base, batch, wpo=True, lora=lp, lora_scale=CFG.lora.scale)
      return s.logps.sum() + s.wpo_logw.sum(), s
    return jax.jit(jax.value_and_grad(f, has_aux=True))(lora)

  (v1, s1), g1 = total(CFG.model)
  (v2, s2), g2 = total(chunked)
  np.testing.assert_allclose(np.asarray(s2.logps), np.asarray(s1.logps), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(s2.wpo_logw), np.asarray(s1.wpo_logw), rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


def test_pair_kl_equal_unshared(setup):
  _, pairs, shared, _, base, lora = setup
  kw = {"lora": lora, "lora_scale": CFG.lora.scale}
  kl = lambda b: jax.jit(lambda: logprobs.pair_kl(
      _stats(base, b, with_logits=True, **kw).logits, _stats(base, b, with_logits=True).logits,
      b).sum())()
  want = float(kl(pairs))
  assert want > 1e-3
  np.testing.assert_allclose(float(kl({**pairs, **shared})), want, rtol=1e-5)


@pytest.mark.parametrize("full_ft", [False, True])
def test_dpo_steps_equal_unshared(setup, full_ft):
  """Three DPO steps (sigmoid + WPO, with the token KL) give the same metrics and parameters."""
  mesh, pairs, shared, _, base, _ = setup
  cfg = CFG.replace(wpo=True, log_kl=True, **({"lora_rank": 0, "learning_rate": 1e-3}
                                                if full_ft else {}))
  spec = train.StepConfig.dpo(cfg)
  runs = []
  for arrays in (pairs, {**pairs, **shared}):
    trainable = train.initial_trainable(cfg.model, cfg.lora, base, jax.random.key(1), mesh)
    state = train.init_state(trainable, spec.optimizer()[0], 0, mesh)
    frozen = train.initial_frozen(base)
    step = train.jit_step(train.dpo_step, spec, mesh, state, frozen)
    batch = train.device_batch(mesh, arrays)
    for _ in range(3):
      state, m = step(state, frozen, batch)
    runs.append((jax.tree.map(np.asarray, state.params), jax.tree.map(float, m)))
  (p1, m1), (p2, m2) = runs
  assert m1["kl"] > 0 and m1["loss"] < 0.69
  for k in m1:
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-4, atol=1e-6, err_msg=k)
  # Adam's first updates are nearly lr * sign(g): a 1e-7 difference in a near-zero gradient
  # moves a weight by up to lr, so parameters are compared to a small fraction of lr.
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=0.05 * cfg.optim.learning_rate)


def test_not_applicable_is_reported():
  pairs = data.tokenize_pairs(RECORDS[:2], ByteTokenizer(), 40, 48)
  other = {k: v.copy() for k, v in pairs.items()}
  other["tokens"][0, 1, 0] += 1  # the rejected row's prompt differs from its first token
  out, why = packing.shared_prefix(other)
  assert out is None and "pair 0 has no shared unscored prefix" in why
  other = {k: v.copy() for k, v in pairs.items()}
  other["segment_ids"][1, 0, 2] = 2
  out, why = packing.shared_prefix(other)
  assert out is None and "one segment" in why

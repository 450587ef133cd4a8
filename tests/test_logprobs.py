"""Log-probs against plain numpy, and the vmapped pair axis against separate calls."""

import jax
import numpy as np
import pytest

from configs import ModelConfig
from dpo import logprobs
from dpo.batches import PairBatch, Rows
from models import sharding, transformer

CFG = ModelConfig(vocab_size=48, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                  mlp_dim=32, init_std=0.3)


def test_token_logps_match_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 7, 11)).astype(np.float32) * 3
  tokens = rng.integers(0, 11, (3, 7)).astype(np.int32)
  got = np.asarray(logprobs.token_logps(logits, tokens))
  want = np.zeros((3, 7))
  for b in range(3):
    for t in range(1, 7):
      z = logits[b, t - 1].astype(np.float64)
      want[b, t] = z[tokens[b, t]] - np.log(np.exp(z - z.max()).sum()) - z.max()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _pair_batch(rng, B=3, T=12):
  tokens = rng.integers(0, CFG.vocab_size, (B, 2, T)).astype(np.int32)
  lengths = rng.integers(6, T + 1, (B, 2))
  prompt = rng.integers(2, 5, (B,))
  idx = np.arange(T)
  segment_ids = (idx < lengths[..., None]).astype(np.int32)
  positions = np.where(segment_ids, idx, 0).astype(np.int32)
  loss_mask = ((idx >= prompt[:, None, None]) & segment_ids.astype(bool)).astype(np.float32)
  return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids,
          "loss_mask": loss_mask}


def _pair_logps(params, batch):
  s = logprobs.pair_stats(CFG, params, PairBatch.of(batch))
  return s.logps, s.tokens


@pytest.mark.slow
def test_pair_logps_masked_sums_match_numpy():
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  params = transformer.init(CFG, jax.random.key(0), mesh)
  batch = _pair_batch(np.random.default_rng(1))
  logps, counts = jax.jit(_pair_logps)(params, batch)
  assert logps.shape == (3, 2) and counts.shape == (3, 2)
  np.testing.assert_array_equal(np.asarray(counts), batch["loss_mask"].sum(-1))
  for j in range(2):
    logits = np.asarray(transformer.forward(CFG, params, transformer.Inputs(batch["tokens"][:, j],
        batch["positions"][:, j], batch["segment_ids"][:, j])),
        np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    tok = batch["tokens"][:, j]
    per = np.take_along_axis(logits[:, :-1], tok[:, 1:, None], -1)[..., 0] - lse[:, :-1]
    want = (per * batch["loss_mask"][:, j, 1:]).sum(-1)
    np.testing.assert_allclose(np.asarray(logps[:, j]), want, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_padding_and_prompt_tokens_do_not_count():
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  params = transformer.init(CFG, jax.random.key(0), mesh)
  batch = _pair_batch(np.random.default_rng(2))
  base, _ = _pair_logps(params, batch)
  changed = {k: v.copy() for k, v in batch.items()}
  pad = changed["segment_ids"] == 0
  changed["tokens"][pad] = 7  # different padding content
  again, _ = _pair_logps(params, changed)
  np.testing.assert_allclose(np.asarray(base), np.asarray(again), atol=1e-5)


@pytest.mark.slow
def test_pair_stats_shared_length_and_wpo_match_numpy():
  """pair_stats: sums equal per-side sequence_logps (the same scoring path); the LD-DPO
  shared-length split and WPO log-weights match numpy computed from the logits."""
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  params = transformer.init(CFG, jax.random.key(0), mesh)
  batch = _pair_batch(np.random.default_rng(3), B=4)
  st = jax.jit(lambda p, b: logprobs.pair_stats(CFG, p, b, wpo=True))(params,
                                                                      PairBatch.of(batch))
  for j in range(2):
    logps, counts = logprobs.sequence_logps(CFG, params,
                                             Rows.of({k: v[:, j] for k, v in batch.items()}))
    np.testing.assert_allclose(np.asarray(st.logps[:, j]), np.asarray(logps), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(st.tokens[:, j]), np.asarray(counts))
  mask = batch["loss_mask"]
  shared_len = mask.sum(-1).min(-1)
  for j in range(2):
    logits = np.asarray(transformer.forward(CFG, params, transformer.Inputs(batch["tokens"][:, j],
        batch["positions"][:, j], batch["segment_ids"][:, j])),
        np.float64)[:, :-1]
    logp = logits - (np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
                     + logits.max(-1, keepdims=True))
    tok = batch["tokens"][:, j, 1:]
    per = np.take_along_axis(logp, tok[..., None], -1)[..., 0]
    logw_t = per - np.log((np.exp(logp) ** 2).sum(-1))
    m = mask[:, j, 1:]
    for b in range(4):
      scored = np.flatnonzero(m[b])[:int(shared_len[b])]  # the first shared_len completion tokens
      np.testing.assert_allclose(float(st.shared_logps[b, j]), per[b, scored].sum(), rtol=1e-5,
                                 atol=1e-4)
      np.testing.assert_allclose(float(st.wpo_logw[b, j]), (logw_t[b] * m[b]).sum() / m[b].sum(),
                                 rtol=1e-5, atol=1e-4)
  assert logprobs.pair_stats(CFG, params, PairBatch.of(batch)).wpo_logw is None


@pytest.mark.slow
def test_head_at_scored_slots_equals_every_slot():
  """pair_stats with score_slots (the LM head only at each row's scored slots, as the DPO step
  runs it) gives the every-slot path's sums, shared-length sums, counts and WPO weights, with
  LoRA dropout drawn alike; a row scoring more than score_slots tokens gets NaN, not a short sum."""
  from configs import LoraConfig
  from models import lora as lora_lib
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  params = transformer.init(CFG, jax.random.key(0), mesh)
  lc = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.3, lora_targets=("q", "v"))
  lora = jax.tree.map(lambda x: x + 0.1, lora_lib.init(CFG, lc, jax.random.key(1), mesh))
  adapter = transformer.Adapter(lora, lc.scale, jax.random.key(2), lc.lora_dropout)
  batch = _pair_batch(np.random.default_rng(4), B=4, T=16)
  batch["loss_mask"][0, 1, -3] = 0.0  # a hole inside a completion
  batch["loss_mask"][1, 0] *= 0.5     # weighted tokens
  batch["loss_mask"][2, 0, 0] = 1.0    # slot 0 scored (no prompt, no BOS): scores 0, counts
  bound = int((batch["loss_mask"] > 0).sum(-1).max())
  stats = jax.jit(lambda b, k: logprobs.pair_stats(CFG, params, PairBatch.of(b), adapter,
                                                   wpo=True, score_slots=k), static_argnums=1)
  full, gathered = stats(batch, 0), stats(batch, bound)
  for name in ("logps", "tokens", "shared_logps", "wpo_logw"):
    np.testing.assert_allclose(np.asarray(getattr(gathered, name)),
                               np.asarray(getattr(full, name)), rtol=2e-5, atol=2e-5,
                               err_msg=name)
  short = np.asarray(stats(batch, bound - 1).logps)
  over = (batch["loss_mask"] > 0).sum(-1) > bound - 1
  assert over.any() and np.isnan(short[over]).all() and np.isfinite(short[~over]).all()

"""SFT packing (--sft_packing, dpo/packing.py `pack_sequences`): whole examples one after another
in a row, apart by segment id, positions restarting. Per-example log-probs and the SFT loss's
gradient equal the unpacked rows', and transformers' padding-free forward (position_ids that
restart at each example, as TRL's SFT packing feeds it) gives the same per-example log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import numerics
from dpo import logprobs, packing, train
from dpo.batches import Rows
from models import hf, sharding

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, T, SLOTS = 128, 16, 40
LENGTHS = (16, 5, 9, 12, 7, 16, 6, 11, 8, 13)


def _examples():
  """[N, T] rows as data.py builds them: one segment then padding, a 1-4 token unscored prompt."""
  rng = np.random.default_rng(0)
  n = len(LENGTHS)
  length = np.array(LENGTHS)[:, None]
  seg = (np.arange(T)[None] < length).astype(np.int32)
  prompt = rng.integers(1, 5, (n, 1))
  return {"tokens": (rng.integers(1, V, (n, T)) * seg).astype(np.int32),
          "positions": (np.arange(T)[None] * seg).astype(np.int32), "segment_ids": seg,
          "loss_mask": (seg * (np.arange(T)[None] >= prompt)).astype(np.float32)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  """A random Llama in transformers, and the same weights loaded here (models/hf.py)."""
  config = transformers.LlamaConfig(
      vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
      rms_norm_eps=1e-5, tie_word_embeddings=False)
  torch.manual_seed(0)
  hf_model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
  hf_model = hf_model.float().eval()
  with torch.no_grad():
    for p in hf_model.parameters():
      p.add_(0.15 * torch.randn_like(p))
  path = tmp_path_factory.mktemp("llama")
  hf_model.save_pretrained(path)
  cfg, params = hf.load(str(path), sharding.make_mesh("data:1", jax.devices()[:1]))
  return hf_model, cfg, params


def _per_example(token_logps, packed, bins, n):
  """[N] sums of the packed rows' [R, S] per-token log-probs by example (`bins`: the rows'
  examples in slot order, segment id = slot + 1)."""
  out = np.zeros(n)
  for r, items in enumerate(bins):
    for j, i in enumerate(items):
      out[i] = np.asarray(token_logps)[r][packed["segment_ids"][r] == j + 1].sum()
  return out


def _ours(cfg, params, arrays):
  """(per-row per-token log-probs, gradient of the token-mean NLL), as train.sft_step takes it."""
  def nll(p):
    lp, n = logprobs.sequence_logps(cfg, p, Rows.of(arrays))
    return -lp.sum() / n.sum()
  token = jax.jit(lambda p: logprobs.score(cfg, p, Rows.of(arrays)).logps)(params)
  return np.asarray(token), jax.tree.map(np.asarray, jax.jit(jax.grad(nll))(params))


def _leaking(packed):
  """The packing mistake: one segment a row, so each example attends to the ones before it."""
  return {**packed, "segment_ids": (packed["segment_ids"] != 0).astype(np.int32)}


def test_without_an_sft_stage_is_refused():
  with pytest.raises(ValueError, match=r"--sft_packing=200: packs the sft stage's rows; "
                     r"--stage=dpo has none"):
    configs.DEFAULT.replace(sft_packing=200, stage="dpo")


def test_rows_hold_each_example_once():
  ex = _examples()
  packed, summary = packing.pack_sequences(ex, SLOTS)
  bins = packing.best_fit_decreasing((ex["segment_ids"] != 0).sum(1), SLOTS)
  assert sorted(i for b in bins for i in b) == list(range(len(LENGTHS)))
  assert len(bins) == -(-sum(LENGTHS) // SLOTS)  # these lengths pack with no extra row
  fill = sum(LENGTHS) / (len(bins) * SLOTS)
  assert f"{len(LENGTHS)} SFT examples in {len(bins)} rows of {SLOTS} slots" in summary
  assert f"fill rate {fill:.0%}" in summary
  for r, items in enumerate(bins):
    o = 0
    for j, i in enumerate(items):
      m = LENGTHS[i]
      for k in ("tokens", "positions", "loss_mask"):
        np.testing.assert_array_equal(packed[k][r, o:o + m], ex[k][i, :m])
      assert (packed["segment_ids"][r, o:o + m] == j + 1).all()
      o += m
    assert (packed["segment_ids"][r, o:] == 0).all()
  with pytest.raises(ValueError, match=r"--sft_packing=12: shorter than the longest of the SFT "
                     r"examples \(16 tokens\)"):
    packing.pack_sequences(ex, 12)
  scored = {**ex, "loss_mask": ex["loss_mask"].copy()}
  scored["loss_mask"][3, 0] = 1.0
  with pytest.raises(ValueError, match=r"SFT examples row 3 scores its first token"):
    packing.pack_sequences(scored, SLOTS)


@pytest.mark.slow
def test_packed_logps_and_gradient_equal_unpacked_and_transformers(model):
  """Per-example log-probs and the gradient of the token-mean NLL: packed = unpacked, within the
  reordering bounds of tests/numerics.py; the per-example log-probs = transformers'
  padding-free forward of the same packed rows; train.sft_step on the packed rows logs the
  unpacked rows' loss and token count, and the fill rate. Attention leaking across the examples of a row
  misses both by orders of magnitude. (Positions that continue instead of restarting would not
  show: RoPE scores depend on position differences only, and no example sees another.)"""
  hf_model, cfg, params = model
  ex = _examples()
  n = len(LENGTHS)
  packed, _ = packing.pack_sequences(ex, SLOTS)
  bins = packing.best_fit_decreasing((ex["segment_ids"] != 0).sum(1), SLOTS)
  want_tok, want_grad = _ours(cfg, params, ex)
  want = want_tok.sum(-1)
  got_tok, got_grad = _ours(cfg, params, packed)
  bad_tok, bad_grad = _ours(cfg, params, _leaking(packed))
  fwd = numerics.reorder_tol(max(SLOTS, cfg.mlp_dim, V), numerics.backprop_depth(2) // 2)
  grad_tol = numerics.reorder_tol(int(ex["segment_ids"].sum()), numerics.backprop_depth(2))
  checks = lambda lp, grad: {"per-example logps": (_per_example(lp, packed, bins, n), want, fwd),
                             "gradient": (grad, want_grad, grad_tol)}
  numerics.assert_close(checks(got_tok, got_grad))
  numerics.assert_mistake_caught(checks(bad_tok, bad_grad), "attention across packed examples")

  # transformers, padding-free: no attention mask, no cache, position_ids restarting at each
  # example (its masking finds the sequences from them), token t scored by the logits at t - 1.
  with torch.no_grad():
    logits = hf_model(input_ids=torch.tensor(packed["tokens"], dtype=torch.long),
                      position_ids=torch.tensor(packed["positions"], dtype=torch.long),
                      use_cache=False).logits
  lp = torch.log_softmax(logits[:, :-1].double(), -1)
  picked = lp.gather(-1, torch.tensor(packed["tokens"][:, 1:], dtype=torch.long)[..., None])
  hf_tok = np.pad(picked[..., 0].numpy() * packed["loss_mask"][:, 1:], ((0, 0), (1, 0)))
  oracle = _per_example(hf_tok, packed, bins, n)
  numerics.assert_close({"vs transformers": (_per_example(got_tok, packed, bins, n), oracle, fwd)})
  numerics.assert_mistake_caught({"vs transformers": (_per_example(bad_tok, packed, bins, n),
                                                      oracle, fwd)},
                                 "attention across packed examples")

  run = configs.DEFAULT.replace(global_batch_size=len(packed["tokens"]), sft_packing=SLOTS)
  spec = train.StepConfig.sft(dataclasses.replace(run, model=cfg))
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  state = train.init_state(jax.tree.map(jnp.copy, params), spec.optimizer()[0], 0, mesh)
  step = train.jit_step(train.sft_step, spec, mesh, state, None)
  m = jax.tree.map(float, step(state, None, train.device_batch(mesh, Rows.of(packed)))[1])
  assert m["fill_rate"] == pytest.approx(sum(LENGTHS) / packed["tokens"].size)
  assert m["tokens"] == ex["loss_mask"].sum()
  np.testing.assert_allclose(m["loss"], -want.sum() / m["tokens"], rtol=1e-5)


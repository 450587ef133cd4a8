"""Shared-prefix rows and packed rows: the layouts, and log-probs, KL and whole DPO steps equal
to the unshared layout's (the pair rows of data.tokenize_pairs, scored by the vmapped per-side
path)."""

import dataclasses
import itertools
import json
import os
import re

import jax
import numpy as np
import pytest

import configs
import numerics
from conftest import SHARED_DATA
from dpo import data, logprobs, loop, packing, task, train
from dpo.batches import PairBatch
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
  lora = jax.tree.map(lambda x: x + 0.05, lora_lib.init(CFG.model, CFG.lora, jax.random.key(1),
      mesh))
  return mesh, pairs, shared, summary, base, lora


@pytest.mark.slow
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


def _stats(params, arrays, lora=None, with_logits=False):
  adapter = None if lora is None else transformer.Adapter(lora, CFG.lora.scale)
  fn = jax.jit(lambda p, b: logprobs.pair_stats(CFG.model, p, b, adapter, wpo=True,
                                                with_logits=with_logits))
  return fn(params, PairBatch.of(arrays))


@pytest.mark.parametrize("adapter", [False, True])
def test_shared_pair_stats_equal_unshared(setup, adapter):
  _, pairs, shared, _, base, lora = setup
  kw = {"lora": lora} if adapter else {}
  want = _stats(base, pairs, **kw)
  got = _stats(base, {**pairs, **shared}, **kw)
  for name in ("logps", "tokens", "shared_logps", "wpo_logw"):
    np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                               rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_chunked_head_equals_whole_vocabulary_with_gradients(setup, monkeypatch):
  _, pairs, shared, _, base, lora = setup
  batch = PairBatch.of({**pairs, **shared})
  chunked = dataclasses.replace(CFG.model, logits_chunk=CFG.model.vocab_size // 8)

  def total(cfg):  # gradients for the adapters and every base weight (the LM head's chunks too)
    def f(lp, bp):
      s = logprobs.pair_stats(cfg, bp, batch, transformer.Adapter(lp, CFG.lora.scale), wpo=True)
      return s.logps.sum() + s.wpo_logw.sum(), s
    (_, s), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(lora, base)
    return {"logps": s.logps, "wpo_logw": s.wpo_logw}, g

  # The longest sums are the weight gradients' over the scored slots, through every layer's
  # contractions forward and back.
  tol = numerics.reorder_tol(int(shared["shared_segment_ids"].astype(bool).sum()),
                             numerics.backprop_depth(CFG.model.n_layers))
  s1, g1 = total(CFG.model)
  # The explicit matmul backward (--matmul_backward) gives the same values and gradients.
  for cfg in (chunked, dataclasses.replace(chunked, matmul_backward="explicit")):
    s2, g2 = total(cfg)
    numerics.assert_close({"stats": (s2, s1, tol), "gradients": (g2, g1, tol)})
  # Negative control: a head scan that drops the last vocabulary chunk (from the normaliser)
  # misses the same bound by orders of magnitude.
  head_chunks = logprobs._head_chunks
  monkeypatch.setattr(logprobs, "_head_chunks", lambda *a: head_chunks(*a)[:-1])
  s3, g3 = total(chunked)
  numerics.assert_mistake_caught({"stats": (s3, s1, tol), "gradients": (g3, g1, tol)},
                                 "a dropped vocabulary chunk")


def test_pair_kl_equal_unshared(setup):
  _, pairs, shared, _, base, lora = setup
  kw = {"lora": lora}
  kl = lambda b: jax.jit(lambda: logprobs.pair_kl(
      _stats(base, b, with_logits=True, **kw).logits, _stats(base, b, with_logits=True).logits,
      PairBatch.of(b)).sum())()
  want = float(kl(pairs))
  assert want > 1e-3
  np.testing.assert_allclose(float(kl({**pairs, **shared})), want, rtol=1e-5)


def _three_steps(cfg, mesh, base, arrays):
  """(numerics.Steps, last metrics) of three DPO steps on `arrays` from fresh trainable weights."""
  spec = train.StepConfig.dpo(cfg)
  trainable = train.initial_trainable(cfg.model, cfg.lora, base, jax.random.key(1), mesh)
  start = jax.tree.map(np.asarray, trainable)
  state = train.init_state(trainable, spec.optimizer()[0], 0, mesh)
  frozen = train.initial_frozen(base)
  step = train.jit_step(train.dpo_step, spec, mesh, state, frozen)
  batch = train.device_batch(mesh, PairBatch.of(arrays))
  for _ in range(3):
    state, m = step(state, frozen, batch)
  return numerics.Steps.of(start, state), jax.tree.map(float, m)


def _tau(cfg, pairs):
  """The gradients' reordering bound (tests/numerics.py): the longest sums are the weight
  gradients' over the tokens of the unshared rows (padding adds exact zeros), through all the
  layers and back."""
  return numerics.reorder_tol(int(np.count_nonzero(pairs["segment_ids"])),
                              numerics.backprop_depth(cfg.model.n_layers))


def _assert_same_steps(cfg, pairs, want, got, wrong=None):
  """Same metrics and the same AdamW moments and displacements (within tests/numerics.py's
  bounds); `wrong`, steps on a deliberately broken layout, misses those bounds by orders of
  magnitude."""
  (s1, m1), (s2, m2) = want, got
  # The steps learned: the DPO part of the loss (less the preset's RPO term) fell below ln 2.
  assert m1["kl"] > 0 and m1["loss"] - cfg.loss.rpo_alpha * m1.get("rpo/nll", 0.0) < 0.69
  assert m1.keys() == m2.keys()
  for k in m1:
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-4, atol=1e-6, err_msg=k)
  tau = _tau(cfg, pairs)
  numerics.assert_close(numerics.step_checks(s2, s1, tau))
  if wrong is not None:
    numerics.assert_mistake_caught(numerics.step_checks(wrong[0], s1, tau),
                                   "rejected positions continuing after the chosen branch")


def _rejected_positions_continue(shared):
  """Shared-prefix rows with the classic prefix-sharing mistake: the rejected branch's
  positions continue after the chosen branch instead of restarting after the prompt."""
  out = dict(shared)
  slot = np.broadcast_to(np.arange(shared["shared_positions"].shape[-1]),
                         shared["shared_positions"].shape)
  out["shared_positions"] = np.where(shared["shared_branch"] == 2, slot,
                                     shared["shared_positions"]).astype(np.int32)
  return out


@pytest.mark.parametrize("full_ft", [False, True])
@pytest.mark.slow
def test_dpo_steps_equal_unshared(setup, full_ft):
  """Three DPO steps (sigmoid + WPO, with the token KL) give the same metrics and parameters."""
  mesh, pairs, shared, _, base, _ = setup
  cfg = CFG.replace(wpo=True, log_kl=True, **({"lora_rank": 0, "learning_rate": 1e-3}
                                                if full_ft else {}))
  wrong = {**pairs, **_rejected_positions_continue(shared)}
  _assert_same_steps(cfg, pairs, _three_steps(cfg, mesh, base, pairs),
                     _three_steps(cfg, mesh, base, {**pairs, **shared}),
                     _three_steps(cfg, mesh, base, wrong))


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


# --- packing: several pairs' shared rows a row ----------------------------------------------------

PACK_RECORDS = RECORDS + task.preference_records(2, 1)  # 8 pairs of very different lengths


@pytest.fixture(scope="module")
def packed_setup(setup):
  mesh, _, _, _, base, lora = setup
  pairs = data.tokenize_pairs(PACK_RECORDS, ByteTokenizer(), 40, 48)
  shared, _ = packing.shared_prefix(pairs)
  return pairs, shared, base, lora


def _pack(shared, rows, blocks=1, microbatches=1, multiple=1):
  """The global batch `rows` packed as `blocks` processes would, their blocks concatenated."""
  packer = packing.Packer(shared, len(rows), blocks, microbatches, multiple)
  summary = packer.fit(rows[None])
  parts = [packer.pack(rows, b) for b in range(blocks)]
  return packer, summary, {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def test_packed_rows_hold_each_pairs_shared_row_once(packed_setup):
  pairs, shared, _, _ = packed_setup
  rows = np.arange(len(PACK_RECORDS))
  packer, summary, out = _pack(shared, rows)
  R, L = out["shared_tokens"].shape
  P = out["pair_valid"].shape[1]
  assert R < len(rows) and P > 1 and L == shared["shared_tokens"].shape[1]
  assert out["pair_valid"].sum() == len(rows)
  length = (shared["shared_segment_ids"] != 0).sum(1)
  fill = length.sum() / (R * L)
  assert f"fill rate {fill:.0%}" in summary and f"{{{R}, {len(rows)}}} rows" in summary
  for b in rows:
    r, j = divmod(int(out["pair_index"][b]), P)
    slots = np.flatnonzero(out["shared_segment_ids"][r] == j + 1)
    assert len(slots) == length[b] and np.all(np.diff(slots) == 1)  # contiguous, once
    for k in ("shared_tokens", "shared_positions", "shared_branch"):
      np.testing.assert_array_equal(out[k][r, slots], shared[k][b, :length[b]], err_msg=k)
    scored = out["score_pair"][r] == j
    scored &= out["score_weight"][r] != 0
    n = int((shared["score_weight"][b] != 0).sum())
    assert scored.sum() == n
    np.testing.assert_array_equal(out["score_from"][r, scored],
                                  shared["score_from"][b, :n] + slots[0])
    for k in ("score_target", "score_side", "score_rank", "score_weight"):
      np.testing.assert_array_equal(out[k][r, scored], shared[k][b, :n], err_msg=k)


def test_buckets_minimise_rows_like_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(20):
    needs = rng.integers(1, 9, rng.integers(1, 30)) * 2
    got = packing.choose_buckets(needs, 16)
    rows = lambda buckets: sum(min(b for b in buckets if b >= n) for n in needs)
    best = min(rows((*c, 16)) for r in range(4) for c in itertools.combinations(range(2, 17, 2), r))
    assert got[-1] == 16 and len(got) <= 4 and rows(got) == best


@pytest.mark.parametrize("adapter", [False, True])
def test_packed_pair_stats_equal_unshared(packed_setup, adapter):
  pairs, shared, base, lora = packed_setup
  kw = {"lora": lora} if adapter else {}
  _, _, out = _pack(shared, np.arange(len(PACK_RECORDS)))
  want = _stats(base, pairs, **kw)
  got = _stats(base, {**pairs, **out}, **kw)
  for name in ("logps", "tokens", "shared_logps", "wpo_logw"):
    np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                               rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("full_ft,devices,blocks,microbatches", [
    (False, 1, 1, 1), (False, 2, 2, 2), (True, 1, 1, 1)])
@pytest.mark.slow
def test_packed_dpo_steps_equal_unshared(packed_setup, full_ft, devices, blocks, microbatches):
  """Three DPO steps (sigmoid + WPO, the token KL, dropout off) on packed rows give the metrics
  and parameters of the unpacked pair rows; with two process blocks on two devices and two
  microbatches each block and microbatch packs its own pairs."""
  pairs, shared, _, _ = packed_setup
  mesh = sharding.make_mesh(f"data:{devices}", jax.devices()[:devices])
  base = transformer.init(CFG.model, jax.random.key(0), mesh)
  cfg = CFG.replace(wpo=True, log_kl=True, global_batch_size=len(PACK_RECORDS),
                    gradient_accumulation_steps=microbatches,
                    **({"lora_rank": 0, "learning_rate": 1e-3} if full_ft else {}))
  rows = np.arange(len(PACK_RECORDS))
  pack = lambda rows_of: _pack(rows_of, rows, blocks, microbatches, devices * microbatches)[2]
  out = pack(shared)
  assert out["pair_valid"].shape[1] > 1
  want = _three_steps(cfg, mesh, base, pairs)
  got = _three_steps(cfg, mesh, base, {**pairs, **out})
  fill = (out["shared_segment_ids"] != 0).mean()
  assert got[1].pop("fill_rate") == pytest.approx(fill) and fill > 0.5
  wrong = _three_steps(cfg, mesh, base, {**pairs, **pack(_rejected_positions_continue(shared))})
  _assert_same_steps(cfg, pairs, want, got, wrong)


@pytest.mark.parametrize("devices,blocks,microbatches,rng", [(1, 1, 1, "threefry"),
                                                             (2, 2, 2, "threefry"),
                                                             (2, 2, 2, "rbg")])
@pytest.mark.slow
def test_packed_dropout_masks_are_the_unpacked_rows(packed_setup, devices, blocks, microbatches,
                                                    rng):
  """With LoRA dropout on, three DPO steps on packed rows equal three on the unpacked
  shared-prefix rows: each packed slot takes the dropout mask of its pair's own row, so packing
  (and the mesh, which sets it) does not change the masks, with either mask generator."""
  pairs, shared, _, _ = packed_setup
  mesh = sharding.make_mesh(f"data:{devices}", jax.devices()[:devices])
  base = transformer.init(CFG.model, jax.random.key(0), mesh)
  cfg = CFG.replace(lora_dropout=0.3, global_batch_size=len(PACK_RECORDS),
                    gradient_accumulation_steps=microbatches, lora_dropout_rng=rng)
  rows = np.arange(len(PACK_RECORDS))
  _, _, out = _pack(shared, rows, blocks, microbatches, devices * microbatches)
  assert out["pair_valid"].shape[1] > 1
  want = _three_steps(cfg, mesh, base, {**pairs, **shared})
  got = _three_steps(cfg, mesh, base, {**pairs, **out})
  got[1].pop("fill_rate")
  _assert_same_steps(cfg, pairs, want, got)
  # The masks matter: the same packed rows without their sources (each packed row drawing its
  # own masks) miss the same bounds by orders of magnitude.
  del out["dropout_source"]
  other = _three_steps(cfg, mesh, base, {**pairs, **out})
  numerics.assert_mistake_caught(numerics.step_checks(other[0], want[0], _tau(cfg, pairs)),
                                 "packed rows drawing their own dropout masks")


def test_loader_packs_only_this_process_block():
  pairs = data.tokenize_pairs(PACK_RECORDS * 2, ByteTokenizer(), 40, 48)
  shared, _ = packing.shared_prefix(pairs)
  seen = []  # the global batches' rows, as the loader hands them to `pack`
  whole = data.Loader(pairs, 8, seed=0, pack=lambda rows, block: seen.append(rows) or {})
  packer = packing.Packer(shared, 8, blocks=2, multiple=2)
  packer.fit(whole.batch_rows(0))
  loaders = [data.Loader(pairs, 8, 0, (b, 2), pack=packer.pack) for b in range(2)]
  for _ in range(3):  # into the second epoch
    want = next(whole)
    rows = seen[-1]
    got = [next(l) for l in loaders]
    for k in pairs:
      np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), want[k])
    R = sum(len(g["shared_tokens"]) for g in got)
    P = got[0]["pair_valid"].shape[1]
    for b, g in enumerate(got):
      # Each block's pairs sit in its own rows, and those rows hold nothing else.
      assert set(g["pair_index"] // P) <= set(range(b * R // 2, (b + 1) * R // 2))
      assert g["pair_valid"].sum() == 4
      np.testing.assert_array_equal(g["score_weight"].sum(),
                                    pairs["loss_mask"][rows[4 * b:4 * b + 4]].sum())


@pytest.mark.slow
def test_packing_run_logs_the_fill_rate_and_the_unpacked_losses(tmp_path, caplog, varied_pairs):
  """A --packing run (two devices, dropout off) logs the same losses as without packing, the
  fill rate at start and as a metric; --packing without prefix sharing is refused."""
  with pytest.raises(ValueError, match=r"--packing=True: must go with --prefix_sharing=True"):
    configs.DEFAULT.replace(packing=True, prefix_sharing=False)
  records = {}
  for packed in (False, True):
    out = tmp_path / f"packing_{packed}"
    cfg = configs.DEFAULT.replace(
        stage="dpo", steps=3, log_every=1, eval_every=0, checkpoint_every=0, output_dir=str(out),
        train_data=str(varied_pairs), eval_split=0.2, task_eval_prompts=2, eval_max_new_tokens=4,
        max_prompt_length=24, max_target_length=40, lora_dropout=0.0, global_batch_size=8,
        d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
        packing=packed)
    with caplog.at_level("INFO"):
      loop.run(cfg, mesh=sharding.make_mesh("data:2", jax.devices()[:2]))
    records[packed] = [json.loads(l) for l in open(out / "metrics.jsonl")
                       if json.loads(l)["stage"] == "dpo"]
  assert "packing: 8 pairs a step into rows of" in caplog.text
  packed_fill, one_a_row = re.search(r"fill rate (\d+)% of the slots \((\d+)% at one pair a row",
                                     caplog.text).groups()
  assert int(packed_fill) > int(one_a_row)
  assert all(0.5 < r["fill_rate"] <= 1 for r in records[True])
  assert "fill_rate" not in records[False][0]
  for a, b in zip(records[False], records[True]):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-4)


def test_packing_without_a_shared_prompt_is_refused_before_sft(tmp_path, varied_pairs):
  """A pair with no shared prompt token (an empty prompt, --bos_token=none) cannot be packed:
  the run stops at start, naming the file, before the SFT stage trains or saves anything."""
  gpt2 = os.path.join(SHARED_DATA, "tokenizers", "gpt2", "tokenizer.json")
  if not os.path.exists(gpt2):
    pytest.skip("../shared/data is absent")
  bad = tmp_path / "no_prompt.jsonl"
  bad.write_text(varied_pairs.read_text() + json.dumps({"prompt": "", "chosen": " a",
                                                        "rejected": " b"}) + "\n")
  cfg = configs.DEFAULT.replace(
      stage="sft,dpo", sft_steps=5, steps=3, train_data=str(bad), tokenizer=gpt2, bos_token="none",
      vocab_size=50304,
      packing=True, global_batch_size=8, output_dir=str(tmp_path / "out"))
  with pytest.raises(data.DataError, match=r"--packing packs shared-prefix rows, and prefix "
                     r"sharing does not apply to .*no_prompt.jsonl: pair \d+ has no shared"):
    loop.run(cfg, mesh=sharding.make_mesh("data:1", jax.devices()[:1]))
  assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize("layout,window", [("unshared", 0), ("shared", 0), ("packed", 0),
                                           ("shared", 5)])
@pytest.mark.slow
def test_blockwise_attention_equals_one_block(packed_setup, layout, window):
  """Query blocks that skip the keys above the causal diagonal give the log-probs and LoRA
  gradients of whole-row attention, on every row layout, with sliding-window layers too."""
  pairs, shared, base, lora = packed_setup
  batch = {"unshared": pairs, "shared": {**pairs, **shared},
           "packed": {**pairs, **_pack(shared, np.arange(len(PACK_RECORDS)))[2]}}[layout]
  slots = batch.get("shared_tokens", batch["tokens"]).shape[-1]
  dense = dataclasses.replace(CFG.model, sliding_window=window, sliding_pattern=2)
  blocked = dataclasses.replace(dense, attention_block=20)
  assert slots % 20 and slots > 40  # several blocks and a short last one

  def total(cfg, batch):  # ({log-probs, WPO weights}, LoRA gradients)
    def f(lp):
      s = logprobs.pair_stats(cfg, base, PairBatch.of(batch),
                              transformer.Adapter(lp, CFG.lora.scale), wpo=True)
      return s.logps.sum() + s.wpo_logw.sum(), {"logps": s.logps, "shared_logps": s.shared_logps,
                                                "wpo_logw": s.wpo_logw}
    (_, stats), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(lora)
    return {"stats": stats, "gradients": grads}

  # Summation order differs (softmax over fewer keys): the bound of tests/numerics.py.
  tol = _tau(CFG, pairs)
  want = total(dense, batch)
  checks = lambda got: {k: (got[k], want[k], tol) for k in want}
  numerics.assert_close(checks(total(blocked, batch)))
  # Negative control: the same blocks on rows with a position mistake (the rejected branch
  # continuing after the chosen one; in unshared rows, where an offset of a whole row does not
  # change rotary attention, the scored tokens one slot late).
  if layout == "unshared":
    wrong = {**pairs, "loss_mask": np.roll(pairs["loss_mask"], 1, axis=-1)}
  else:
    wrong = {**batch, **_rejected_positions_continue(
        {k: batch[k] for k in ("shared_positions", "shared_branch")})}
  numerics.assert_mistake_caught(checks(total(blocked, wrong)), "a position mistake")


@pytest.mark.slow
def test_blockwise_attention_dpo_steps_equal_one_block(setup):
  """Three LoRA DPO steps on shared rows with query blocks of 16 equal the steps of whole-row
  attention on the same rows."""
  mesh, pairs, shared, _, base, _ = setup
  cfg = CFG.replace(wpo=True, log_kl=True)
  blocked = cfg.replace(attention_block=16)
  batch = {**pairs, **shared}
  wrong = {**pairs, **_rejected_positions_continue(shared)}
  _assert_same_steps(cfg, pairs, _three_steps(cfg, mesh, base, batch),
                     _three_steps(blocked, mesh, base, batch),
                     _three_steps(blocked, mesh, base, wrong))

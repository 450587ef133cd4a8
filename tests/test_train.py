"""The jitted steps: ln 2 at the start, only LoRA trains, NaN skip, SFT learns, shardings."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import numerics
from dpo import data, task, train
from dpo.batches import PairBatch, Rows
from dpo.tokenizer import ByteTokenizer
from models import lora as lora_lib
from models import sharding, transformer

# The DPO step alone (the default preset's RPO term off): its first loss is ln 2.
CFG = configs.DEFAULT.replace(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                              mlp_dim=64, global_batch_size=8, learning_rate=1e-2,
                              lora_dropout=0.0, steps=5, rpo_alpha=0.0)


@pytest.fixture(scope="module")
def setup():
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  pairs = data.tokenize_pairs(task.preference_records(16, 0), ByteTokenizer(), 40, 56)
  base = transformer.init(CFG.model, jax.random.key(0), mesh)
  return mesh, pairs, base


def _dpo(cfg, mesh, base):
  spec = train.StepConfig.dpo(cfg)
  lora = lora_lib.init(cfg.model, cfg.lora, jax.random.key(1), mesh)
  state = train.init_state(lora, spec.optimizer()[0], 0, mesh)
  frozen = train.initial_frozen(base)
  step = train.jit_step(train.dpo_step, spec, mesh, state, frozen)
  return state, lambda st, _, b: step(st, frozen, b)


@pytest.mark.slow
def test_first_loss_is_ln2_and_only_lora_changes(setup):
  mesh, pairs, base = setup
  base_before = jax.tree.map(np.asarray, base)
  state, step = _dpo(CFG, mesh, base)
  lora_before = jax.tree.map(np.asarray, state.params)
  batch = train.device_batch(mesh, PairBatch.of({k: v[:8] for k, v in pairs.items()}))
  state, m = step(state, base, batch)
  # Policy == reference at B = 0, the two forwards compiled apart: the margins are rounding
  # noise (tests/numerics.py), and the loss -log sigmoid(margin) is ln 2 within half of it.
  noise = numerics.implicit_reward_noise(
      CFG.loss.beta, numerics.forward_tol(CFG.model, pairs["tokens"].shape[-1]),
      float(m["logps/chosen"]), float(m["logps/rejected"]))
  assert abs(float(m["rewards/margins"])) <= noise
  assert abs(float(m["loss"]) - math.log(2)) <= noise / 2 + numerics.U
  state, m = step(state, base, batch)
  assert float(m["loss"]) < math.log(2)
  for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(base)):
    np.testing.assert_array_equal(a, np.asarray(b))  # frozen base untouched (and not donated)
  moved = [not np.array_equal(a, np.asarray(b))
           for a, b in zip(jax.tree.leaves(lora_before), jax.tree.leaves(state.params))]
  assert all(moved)
  assert set(m) >= {"loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected",
                    "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"}


def test_full_finetune_reference_is_frozen_copy(setup):
  mesh, pairs, base = setup
  cfg = CFG.replace(lora_rank=0, learning_rate=1e-3)
  spec = train.StepConfig.dpo(cfg)
  trainable = train.initial_trainable(cfg.model, cfg.lora, base, jax.random.key(1), mesh)
  state = train.init_state(trainable, spec.optimizer()[0], 0, mesh)
  frozen = train.initial_frozen(base)
  step = train.jit_step(train.dpo_step, spec, mesh, state, frozen)
  batch = train.device_batch(mesh, PairBatch.of({k: v[:8] for k, v in pairs.items()}))
  state, m = step(state, frozen, batch)
  assert abs(float(m["loss"]) - math.log(2)) < 1e-6
  state, m = step(state, frozen, batch)
  assert float(m["loss"]) < math.log(2)
  assert not np.array_equal(np.asarray(state.params["embed"]), np.asarray(base["embed"]))


def test_non_finite_gradient_skips_update(setup):
  mesh, pairs, base = setup
  state, step = _dpo(CFG, mesh, base)
  before = jax.tree.map(np.asarray, state.params)
  local = {k: v[:8].copy() for k, v in pairs.items()}
  local["loss_mask"][0, 0, 5] = np.nan  # poisons the loss and every gradient
  state, m = step(state, base, train.device_batch(mesh, PairBatch.of(local)))
  assert not np.isfinite(float(m["loss"]))
  assert int(state.skipped) == 1 and int(state.step) == 1
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_schedule_warmup_then_cosine():
  sched = train.schedule(1.0, 100, 0.1)
  assert float(sched(0)) == 0.0 and abs(float(sched(10)) - 1.0) < 1e-6
  assert abs(float(sched(55)) - 0.5) < 1e-2 and float(sched(100)) < 1e-6


def test_sft_step_lowers_loss(setup):
  mesh, _, base = setup
  cfg = CFG.replace(sft_learning_rate=3e-3, sft_steps=20)
  sft = data.tokenize_sft(task.sft_records(8, 0), ByteTokenizer(), 40, 56)
  spec = train.StepConfig.sft(cfg)
  state = train.init_state(jax.tree.map(jnp.copy, base), spec.optimizer()[0], 0, mesh)
  step = train.jit_step(train.sft_step, spec, mesh, state, None)
  batch = train.device_batch(mesh, Rows.of(sft))
  losses = []
  for _ in range(12):
    state, m = step(state, None, batch)
    losses.append(float(m["loss"]))
  assert losses[0] > math.log(200) * 0.8  # near-uniform over the byte vocabulary at init
  assert losses[-1] < losses[0] - 0.5


def _tau(rows):
  """The gradients' reordering bound (tests/numerics.py): the longest sums are the weight
  gradients' over the rows' tokens (padding adds exact zeros), through both layers and back."""
  return numerics.reorder_tol(int(np.count_nonzero(rows["segment_ids"])),
                              numerics.backprop_depth(CFG.model.n_layers))


def _misread(rows):
  """The rows as a device or microbatch that reads another's rows would see them: the last
  row a copy of the first (a negative control for the equalities below)."""
  return {k: np.concatenate([v[:-1], v[:1]]) for k, v in rows.items()}


@pytest.mark.slow
def test_step_on_eight_devices_matches_one(setup):
  _, pairs, _ = setup
  rows = {k: v[:8] for k, v in pairs.items()}
  results = []
  for spec, devices, arrays in (("data:1", jax.devices()[:1], rows),
                                ("data:2,fsdp:2,tensor:2", jax.devices()[:8], rows),
                                ("data:2,fsdp:2,tensor:2", jax.devices()[:8], _misread(rows))):
    mesh = sharding.make_mesh(spec, devices)
    base = transformer.init(CFG.model, jax.random.key(0), mesh)
    state, step = _dpo(CFG, mesh, base)
    start = jax.device_get(state.params)
    batch = train.device_batch(mesh, PairBatch.of(arrays))
    for _ in range(2):
      state, m = step(state, base, batch)
    results.append((float(m["loss"]), numerics.Steps.of(start, state)))
  (loss1, one), (loss8, eight), (_, wrong) = results
  assert abs(loss1 - loss8) < 1e-5
  numerics.assert_close(numerics.step_checks(eight, one, _tau(rows)))
  numerics.assert_mistake_caught(numerics.step_checks(wrong, one, _tau(rows)),
                                 "a device reading another's rows")


@pytest.mark.slow
def test_unrelated_fields_do_not_recompile_the_step(setup):
  """The step's static argument is a StepConfig: output paths, cadences and evaluation settings
  give the same jitted function, and its second call compiles nothing."""
  mesh, pairs, base = setup
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, _, **kw: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
  batch = train.device_batch(mesh, PairBatch.of({k: v[:8] for k, v in pairs.items()}))
  steps = []
  first = CFG.replace(steps=7)  # a step no other test compiled
  for cfg in (first, first.replace(output_dir="/elsewhere", eval_every=7, log_every=3,
                                   checkpoint_every=1, eval_temperature=0.5, seed=3)):
    state, step = _dpo(cfg, mesh, base)
    steps.append(train.jit_step(train.dpo_step, train.StepConfig.dpo(cfg), mesh, state,
                                train.initial_frozen(base)))
    before = len(compiles)
    step(state, None, batch)
    steps.append(len(compiles) - before)
  assert steps[0] is steps[2]
  assert steps[1] >= 1 and steps[3] == 0  # compiled once, for the first config only
  changed = train.StepConfig.dpo(CFG.replace(beta=0.2))
  assert changed != train.StepConfig.dpo(CFG)  # a field the loss reads does change the key


@pytest.mark.slow
def test_step_without_kl_holds_no_reference_logits(setup):
  """With the KL metric off (guard off, --log_kl off) the compiled step keeps no [B, 2, T, V]
  reference logits: its temporaries shrink by at least that array, and no "kl" is reported."""
  mesh, pairs, base = setup
  batch = train.device_batch(mesh, PairBatch.of({k: v[:8] for k, v in pairs.items()}))
  temps, keys = {}, {}
  for log_kl in (True, False):
    cfg = CFG.replace(log_kl=log_kl, vocab_size=1024)
    base_v = transformer.init(cfg.model, jax.random.key(0), mesh)
    spec = train.StepConfig.dpo(cfg)
    assert spec.kl == log_kl
    lora = lora_lib.init(cfg.model, cfg.lora, jax.random.key(1), mesh)
    state = train.init_state(lora, spec.optimizer()[0], 0, mesh)
    frozen = train.initial_frozen(base_v)
    step = train.jit_step(train.dpo_step, spec, mesh, state, frozen)
    temps[log_kl] = step.lower(state, frozen, batch).compile().memory_analysis().temp_size_in_bytes
    keys[log_kl] = set(step(state, frozen, batch)[1])
  B, _, T = pairs["tokens"][:8].shape
  assert temps[True] - temps[False] >= B * 2 * T * 1024 * 4
  assert "kl" in keys[True] and "kl" not in keys[False]


def _one_step(cfg, mesh, base, batch, step_fn=train.dpo_step, stage="dpo"):
  spec = train.StepConfig.dpo(cfg) if stage == "dpo" else train.StepConfig.sft(cfg)
  if stage == "dpo":
    trainable = train.initial_trainable(cfg.model, cfg.lora, base, jax.random.key(1), mesh)
    frozen = train.initial_frozen(base)
  else:
    trainable, frozen = jax.tree.map(jnp.copy, base), None
  state = train.init_state(trainable, spec.optimizer()[0], 0, mesh)
  step = train.jit_step(step_fn, spec, mesh, state, frozen)
  temp = step.lower(state, frozen, batch).compile().memory_analysis().temp_size_in_bytes
  start = jax.device_get(state.params)
  for _ in range(2):  # the second step's loss and metrics follow a non-zero first update
    state, m = step(state, frozen, batch)
  return jax.device_get(m), numerics.Steps.of(start, state), temp


@pytest.mark.parametrize("lora_rank", [16, 0])
@pytest.mark.slow
def test_gradient_accumulation_equals_the_full_batch_step(setup, lora_rank):
  """K = 4 microbatches scanned in the step: loss, every metric (the token KL included) and the
  update equal the one-batch step's on the same global batch; the step's temporaries shrink."""
  _, pairs, _ = setup
  mesh = sharding.make_mesh("data:2", jax.devices()[:2])
  base = transformer.init(CFG.model, jax.random.key(0), mesh)
  rows = {k: v[:8] for k, v in pairs.items()}
  batch = train.device_batch(mesh, PairBatch.of(rows))
  cfg = CFG.replace(lora_rank=lora_rank, learning_rate=1e-3)
  assert cfg.step_kl
  m1, p1, t1 = _one_step(cfg, mesh, base, batch)
  accumulated = cfg.replace(gradient_accumulation_steps=4)
  m4, p4, t4 = _one_step(accumulated, mesh, base, batch)
  assert set(m1) == set(m4) and "kl" in m1
  for k in m1:
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, atol=1e-5, err_msg=k)
  numerics.assert_close(numerics.step_checks(p4, p1, _tau(rows)))
  wrong = _one_step(accumulated, mesh, base, train.device_batch(mesh,
      PairBatch.of(_misread(rows))))[1]
  numerics.assert_mistake_caught(numerics.step_checks(wrong, p1, _tau(rows)),
                                 "a microbatch reading another's rows")
  assert t4 < t1


@pytest.mark.slow
def test_gradient_accumulation_sft_is_the_token_mean_of_the_batch(setup):
  mesh = sharding.make_mesh("data:2", jax.devices()[:2])
  base = transformer.init(CFG.model, jax.random.key(0), mesh)
  sft = data.tokenize_sft(task.sft_records(8, 0), ByteTokenizer(), 40, 56)
  assert len(set(sft["loss_mask"].sum(1))) > 1  # unequal lengths: a mean of means would differ
  cfg = CFG.replace(sft_learning_rate=1e-3)
  run = lambda cfg, rows: _one_step(cfg, mesh, base, train.device_batch(mesh, Rows.of(rows)),
                                    train.sft_step, "sft")
  m1, p1, _ = run(cfg, sft)
  accumulated = cfg.replace(gradient_accumulation_steps=4)
  m4, p4, _ = run(accumulated, sft)
  for k in m1:
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, atol=1e-5, err_msg=k)
  numerics.assert_close(numerics.step_checks(p4, p1, _tau(sft)))
  numerics.assert_mistake_caught(numerics.step_checks(run(accumulated, _misread(sft))[1], p1,
                                                      _tau(sft)),
                                 "a microbatch reading another's rows")


def test_microbatches_keep_each_devices_rows():
  """Microbatch i holds rows i, i + K, ...: a device's rows split evenly between microbatches."""
  x = np.arange(8)
  np.testing.assert_array_equal(train.microbatches({"x": x}, 4)["x"],
                                [[0, 4], [1, 5], [2, 6], [3, 7]])

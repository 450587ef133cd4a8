"""The jitted steps: ln 2 at the start, only LoRA trains, NaN skip, SFT learns, shardings."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from dpo import data, task, train
from dpo.tokenizer import ByteTokenizer
from models import lora as lora_lib
from models import sharding, transformer

CFG = configs.DEFAULT.replace(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                              mlp_dim=64, global_batch_size=8, learning_rate=1e-2,
                              lora_dropout=0.0, steps=5)


@pytest.fixture(scope="module")
def setup():
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  pairs = data.tokenize_pairs(task.preference_records(16, 0), ByteTokenizer(), 40, 56)
  base = transformer.init(CFG.model, jax.random.key(0), mesh)
  return mesh, pairs, base


def _dpo(cfg, mesh, base):
  opt, sched = train.optimizer(cfg, cfg.train.learning_rate, cfg.train.steps)
  lora = lora_lib.init(cfg.model, cfg.lora, jax.random.key(1), mesh)
  state = train.init_state(lora, opt, 0, mesh)
  step = train.jit_step(train.dpo_step, cfg, opt, sched, mesh, state, base)
  return state, step


def test_first_loss_is_ln2_and_only_lora_changes(setup):
  mesh, pairs, base = setup
  base_before = jax.tree.map(np.asarray, base)
  state, step = _dpo(CFG, mesh, base)
  lora_before = jax.tree.map(np.asarray, state.params)
  batch = train.device_batch(mesh, {k: v[:8] for k, v in pairs.items()})
  state, m = step(state, base, batch)
  assert abs(float(m["loss"]) - math.log(2)) < 1e-6  # policy == reference at B = 0
  assert float(m["rewards/margins"]) == 0.0
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
  cfg = CFG.replace(lora_rank=0)
  opt, sched = train.optimizer(cfg, 1e-3, 5)
  trainable = jax.tree.map(jnp.copy, base)
  state = train.init_state(trainable, opt, 0, mesh)
  step = train.jit_step(train.dpo_step, cfg, opt, sched, mesh, state, base)
  batch = train.device_batch(mesh, {k: v[:8] for k, v in pairs.items()})
  state, m = step(state, base, batch)
  assert abs(float(m["loss"]) - math.log(2)) < 1e-6
  state, m = step(state, base, batch)
  assert float(m["loss"]) < math.log(2)
  assert not np.array_equal(np.asarray(state.params["embed"]), np.asarray(base["embed"]))


def test_non_finite_gradient_skips_update(setup):
  mesh, pairs, base = setup
  state, step = _dpo(CFG, mesh, base)
  before = jax.tree.map(np.asarray, state.params)
  local = {k: v[:8].copy() for k, v in pairs.items()}
  local["loss_mask"][0, 0, 5] = np.nan  # poisons the loss and every gradient
  state, m = step(state, base, train.device_batch(mesh, local))
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
  cfg = CFG.replace(sft_learning_rate=3e-3)
  sft = data.tokenize_sft(task.sft_records(8, 0), ByteTokenizer(), 40, 56)
  opt, sched = train.optimizer(cfg, 3e-3, 20)
  state = train.init_state(jax.tree.map(jnp.copy, base), opt, 0, mesh)
  step = train.jit_step(train.sft_step, cfg, opt, sched, mesh, state, None)
  batch = train.device_batch(mesh, sft)
  losses = []
  for _ in range(12):
    state, m = step(state, None, batch)
    losses.append(float(m["loss"]))
  assert losses[0] > math.log(200) * 0.8  # near-uniform over the byte vocabulary at init
  assert losses[-1] < losses[0] - 0.5


def test_step_on_eight_devices_matches_one(setup):
  _, pairs, _ = setup
  results = []
  for spec, devices in (("data:1", jax.devices()[:1]), ("data:2,fsdp:2,tensor:2", jax.devices()[:8])):
    mesh = sharding.make_mesh(spec, devices)
    base = transformer.init(CFG.model, jax.random.key(0), mesh)
    state, step = _dpo(CFG, mesh, base)
    batch = train.device_batch(mesh, {k: v[:8] for k, v in pairs.items()})
    for _ in range(2):
      state, m = step(state, base, batch)
    results.append((float(m["loss"]), jax.tree.map(np.asarray, state.params)))
  assert abs(results[0][0] - results[1][0]) < 1e-5
  for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1])):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)

"""Mesh parsing, the rules table, and sharded == unsharded numerics of the DPO step.

Runs on the 8 fake CPU devices that conftest.py forces.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import configs
import numerics
from dpo import train
from dpo.batches import PairBatch
from models import lora as lora_lib
from models import sharding, transformer


# --- mesh flag -------------------------------------------------------------------------------------

def test_parse_mesh_spec_fills_rest_and_defaults_to_one():
  assert sharding.parse_mesh_spec("data:2,fsdp:2,tensor:2", 8) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert sharding.parse_mesh_spec("fsdp:-1,tensor:2", 8) == {"data": 1, "fsdp": 4, "tensor": 2}
  assert sharding.parse_mesh_spec("tensor:8", 8) == {"data": 1, "fsdp": 1, "tensor": 8}


@pytest.mark.parametrize("spec, match", [
    ("data:3", "needs 3 devices but 8 are available"),
    ("data:2,fsdp:2", "needs 4 devices"),
    ("data:3,fsdp:-1", "do not divide the 8"),
    ("data:-1,fsdp:-1", "at most one -1"),
    ("data:0,fsdp:-1", "positive"),
    ("pipeline:8", "bad --mesh entry 'pipeline:8'"),
    ("data:2,data:4", "each at most once"),
    ("data", "expected AXIS:SIZE"),
    ("data:two", "bad --mesh size 'two'"),
    ("", "empty"),
])
def test_parse_mesh_spec_errors_name_the_problem(spec, match):
  with pytest.raises(ValueError, match=match):
    sharding.parse_mesh_spec(spec, 8)


def test_make_mesh_axes_and_order():
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in jax.devices())


# --- rules table -----------------------------------------------------------------------------------

def test_logical_to_spec_applies_rules_and_drops_non_dividing_axes():
  mesh = sharding.make_mesh("fsdp:4,tensor:2")
  assert sharding.logical_to_spec(("layers", "embed", "heads", "head_dim")) == P(
      None, "fsdp", "tensor", None)
  assert sharding.logical_to_spec(("batch", "seq", "act_embed")) == P(("data", "fsdp"), None, None)
  # 3 heads cannot be split 2 ways: that dimension stays replicated, the embed split remains.
  assert sharding.logical_to_spec(("embed", "heads"), (8, 3), mesh) == P("fsdp", None)
  # batch 2 is divisible by data (1) but not by data x fsdp (4): keeps only what divides.
  assert sharding.logical_to_spec(("batch",), (2,), mesh) == P("data")
  with pytest.raises(ValueError, match="used twice"):
    sharding.logical_to_spec(("batch", "embed"))


def test_replicated_axes_reports_what_the_mesh_cannot_split():
  mesh = sharding.make_mesh("fsdp:2,tensor:4")
  cfg = configs.ModelConfig(n_heads=4, n_kv_heads=2)  # kv_heads 2 not divisible by tensor 4
  dropped = sharding.replicated_axes(transformer.param_specs(cfg), mesh)
  assert set(dropped) == {"['layers']['k']", "['layers']['v']"}
  assert dropped["['layers']['k']"] == "kv_heads->tensor"


def test_shard_bytes_matches_addressable_shards():
  """The estimate from abstract shapes (shard_bytes) is what the placed arrays hold a device
  (placed_bytes: the runner's line at a stage's start)."""
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  cfg = configs.ModelConfig(n_heads=4, n_kv_heads=2)
  params = transformer.init(cfg, jax.random.key(0), mesh)
  specs = transformer.param_specs(cfg)
  expected = sharding.placed_bytes(params)
  got = sharding.shard_bytes(transformer.abstract(specs), transformer.shardings(specs, mesh))
  assert got == expected
  total = sum(x.nbytes for x in jax.tree.leaves(params))
  assert total / 4 < got < total  # every matrix split 4 ways (fsdp x tensor), norms replicated


@pytest.mark.parametrize("spec, ways", [("data:8", 8), ("fsdp:8", 8), ("tensor:8", 1),
                                        ("data:2,fsdp:2,tensor:2", 4), ("fsdp:4,tensor:2", 4)])
def test_batch_shards_counts_distinct_batch_blocks(spec, ways):
  mesh = sharding.make_mesh(spec)
  assert sharding.batch_shards(mesh) == ways
  # The same number, read off the sharding the rules give a batch-major array.
  rows = sharding.named(mesh, ("batch",), (64,)).devices_indices_map((64,)).values()
  assert len({r[0].indices(64) for r in rows}) == ways


def test_to_host_gathers_a_sharded_array():
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  want = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
  x = jax.device_put(want, sharding.named(mesh, ("batch", "act_mlp"), want.shape))
  assert len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
  got = sharding.to_host(x)
  assert type(got) is np.ndarray
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(sharding.to_host(want[0]), want[0])  # numpy passes through


def test_process_batch_block_single_process():
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  assert sharding.process_batch_block(mesh, 8) == (0, 1)


# --- LoRA and optimizer state follow the parameters --------------------------------------------------

def test_lora_factors_follow_base_weight_shardings():
  mesh = sharding.make_mesh("fsdp:4,tensor:2")
  cfg = configs.ModelConfig(n_heads=4, n_kv_heads=2)
  lcfg = configs.LoraConfig(lora_targets=("q", "o", "down"))
  base = transformer.shardings(transformer.param_specs(cfg), mesh)["layers"]
  lora = lora_lib.init(cfg, lcfg, jax.random.key(1), mesh)["layers"]
  for name in lcfg.lora_targets:
    w, a, b = base[name].spec, lora[name]["a"].sharding.spec, lora[name]["b"].sharding.spec
    n_in = transformer.param_specs(cfg)["layers"][name].fan_in
    # A: [L, *in, R] is split like W's input rows; B: [L, R, *out] like W's output columns.
    assert tuple(a) == (*tuple(w)[:1 + n_in], None), name
    assert tuple(b) == (None, None, *tuple(w)[1 + n_in:]), name
  assert lora["q"]["a"].sharding.spec == P(None, "fsdp", None)
  assert lora["q"]["b"].sharding.spec == P(None, None, "tensor", None)


def test_optimizer_state_inherits_param_shardings():
  mesh = sharding.make_mesh("fsdp:4,tensor:2")
  cfg = configs.Config(model=configs.ModelConfig(n_heads=4, n_kv_heads=2))
  params = transformer.init(cfg.model, jax.random.key(0), mesh)
  opt, _ = train.optimizer(cfg.optim, 1e-3, 10)
  state = train.init_state(params, opt, 0, mesh)
  adam = state.opt_state[1][0]
  for moments in (adam.mu, adam.nu):
    got = jax.tree.map(lambda x: x.sharding.spec, moments)
    want = jax.tree.map(lambda x: x.sharding.spec, params)
    assert got == want
  for scalar in (state.step, state.rng, state.lr_scale, adam.count):
    assert scalar.sharding.is_fully_replicated and len(scalar.sharding.device_set) == 8


# --- numerics: one-device mesh == 8 fake devices in several layouts ------------------------------

MODEL = configs.ModelConfig(vocab_size=264, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8,
                            head_dim=8, mlp_dim=128)


def _batch(rng, B=8, T=24):
  """Random preference pairs [B, 2, T]: prompt of 8, completions of varying length, padding."""
  tokens = rng.integers(0, 259, (B, 2, T)).astype(np.int32)
  lengths = rng.integers(12, T + 1, (B, 2))
  idx = np.arange(T)
  segment_ids = (idx < lengths[..., None]).astype(np.int32)
  positions = np.where(segment_ids, idx, 0).astype(np.int32)
  loss_mask = ((idx >= 8) & (idx < lengths[..., None])).astype(np.float32)
  return {"tokens": tokens * segment_ids, "positions": positions, "segment_ids": segment_ids,
          "loss_mask": loss_mask}


def _run_dpo(cfg, mesh, batches):
  """Two DPO steps from the same seeds on `mesh`: (each step's metrics, numerics.Steps)."""
  key = jax.random.key(0)
  params = transformer.init(cfg.model, jax.random.fold_in(key, 0), mesh)
  spec = train.StepConfig.dpo(cfg)
  trainable = train.initial_trainable(cfg.model, cfg.lora, params, jax.random.fold_in(key, 1), mesh)
  start = jax.device_get(trainable)
  frozen = train.initial_frozen(params)
  state = train.init_state(trainable, spec.optimizer()[0], 0, mesh)
  step = train.jit_step(train.dpo_step, spec, mesh, state, frozen)
  metrics = []
  for b in batches:
    state, m = step(state, frozen, train.device_batch(mesh, PairBatch.of(b), len(b["tokens"])))
    metrics.append(jax.device_get(m))
  return metrics, numerics.Steps.of(start, state)


@pytest.fixture(scope="module")
def batches():
  rng = np.random.default_rng(0)
  return [_batch(rng), _batch(rng)]


def _cfg(lora_rank):
  return configs.Config(
      model=MODEL, lora=configs.LoraConfig(lora_rank=lora_rank, lora_dropout=0.1,
                                           lora_targets=("q", "v", "o", "down"))).replace(
          learning_rate=1e-2, warmup_ratio=0.0, beta=0.5, steps=10)


@pytest.fixture(scope="module")
def reference_lora(batches):
  mesh = sharding.make_mesh("data:1", devices=jax.devices()[:1])
  return _run_dpo(_cfg(4), mesh, batches)


def _tau(batches):
  """The gradients' reordering bound (tests/numerics.py): the longest sums are the weight
  gradients' over a batch's tokens (padding adds exact zeros), through both layers and back."""
  tokens = max(int(np.count_nonzero(b["segment_ids"])) for b in batches)
  return numerics.reorder_tol(tokens, numerics.backprop_depth(MODEL.n_layers))


def _assert_same(got, want, batches):
  """The two steps' metrics and the AdamW state after them equal within tests/numerics.py's
  bounds. Step 1 scores the policy against the reference it equals (LoRA's B is zero; full
  fine-tuning starts at the reference), so its implicit rewards are rounding noise around 0:
  each within 2 beta tau of the log-probs' magnitude (a reward is beta times a difference of
  two log-probs, each within tau of its own), and their accuracy (which side's noise is larger)
  is left out; every other figure is one function of the same weights, its sums in another
  order: within tau. Step 2 follows an AdamW step, after which the weights' displacements differ
  by up to adam_tol(tau): every figure within that, the accuracy within one pair of the batch."""
  (m_got, s_got), (m_want, s_want) = got, want
  tau, beta = _tau(batches), _cfg(0).loss.beta
  first, second = m_want
  assert [a.keys() for a in m_got] == [b.keys() for b in m_want]
  noise = numerics.implicit_reward_noise(beta, tau, first["logps/chosen"], first["logps/rejected"])
  rewards = [k for k in first if k.startswith("rewards/")]
  for k in rewards:
    assert abs(m_got[0][k] - first[k]) <= noise, (k, m_got[0][k], first[k], noise)
  pairs = len(batches[1]["tokens"])
  assert abs(m_got[1]["rewards/accuracies"] - second["rewards/accuracies"]) <= 1 / pairs
  plain = lambda m, keys: {k: np.float64(m[k]) for k in keys}
  numerics.assert_close({
      "step 1": (plain(m_got[0], first.keys() - rewards), plain(first, first.keys() - rewards),
                 tau),
      "step 2": (plain(m_got[1], second.keys() - {"rewards/accuracies"}),
                 plain(second, second.keys() - {"rewards/accuracies"}), numerics.adam_tol(tau)),
      **numerics.step_checks(s_got, s_want, tau)})


def _one_device_misreads(batches):
  """The batches as a mesh whose last batch block reads the first block's rows (a process or
  device that loads the wrong shard) would see them: the last row a copy of the first."""
  return [{k: np.concatenate([v[:-1], v[:1]]) for k, v in b.items()} for b in batches]


@pytest.mark.parametrize("spec", ["data:8", "fsdp:8", "tensor:8", "data:2,fsdp:2,tensor:2"])
@pytest.mark.slow
def test_dpo_step_sharded_matches_one_device_lora(spec, batches, reference_lora):
  mesh = sharding.make_mesh(spec)
  # The model is sized so that every rule applies in full on each of these layouts.
  assert not sharding.replicated_axes(transformer.param_specs(MODEL), mesh)
  got = _run_dpo(_cfg(4), mesh, batches)
  assert got[0][1]["loss"] != got[0][0]["loss"]  # the first step changed the adapters
  _assert_same(got, reference_lora, batches)
  # Negative control: the same mesh where one batch block holds another's rows misses the same
  # bounds by orders of magnitude.
  wrong = _run_dpo(_cfg(4), mesh, _one_device_misreads(batches))
  numerics.assert_mistake_caught(numerics.step_checks(wrong[1], reference_lora[1], _tau(batches)),
                                 "a batch block reading another's rows")


@pytest.mark.slow
def test_dpo_step_sharded_matches_one_device_full_finetune(batches):
  one = _run_dpo(_cfg(0), sharding.make_mesh("data:1", devices=jax.devices()[:1]), batches)
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  eight = _run_dpo(_cfg(0), mesh, batches)
  _assert_same(eight, one, batches)
  wrong = _run_dpo(_cfg(0), mesh, _one_device_misreads(batches))
  numerics.assert_mistake_caught(numerics.step_checks(wrong[1], one[1], _tau(batches)),
                                 "a batch block reading another's rows")

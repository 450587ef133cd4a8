"""Checkpoints: atomic commit, restore across meshes, bitwise resume, SIGKILL mid-save."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import configs
from dpo import checkpoint, loop, train
from faults import Crash, SimulatedCrash
from models import lora as lora_lib
from models import sharding, transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny model and task so every run compiles and trains in seconds; eval pairs off (no eval).
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
            max_prompt_length=16, max_target_length=16, task_train_pairs=64,
            task_sft_examples=64, task_eval_pairs=0, task_eval_prompts=0, global_batch_size=8,
            log_every=1, sft_steps=4, steps=6, checkpoint_every=2, keep_checkpoints=2)


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
  """These tests rerun the same tiny programs many times; a persistent compilation cache makes
  every compile after the first a disk read (the executables are identical, so results are too)."""
  path = str(tmp_path_factory.mktemp("jax_cache"))
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = {n: getattr(jax.config, n) for n in names}
  for n, v in zip(names, (path, 0, 0)):
    jax.config.update(n, v)
  yield path
  for n, v in old.items():
    jax.config.update(n, v)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
  """One uninterrupted SFT -> DPO run of the tiny config."""
  out = tmp_path_factory.mktemp("uninterrupted")
  loop.run(tiny_cfg(out))
  return out


def tiny_cfg(out, **kw):
  return configs.DEFAULT.replace(**{**TINY, "output_dir": str(out), **kw})


def records(out):
  """metrics.jsonl keyed by (stage, step), wall-clock fields dropped."""
  with open(os.path.join(out, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in r.items() if k != "tokens_per_sec"} for r in rows]


def assert_tree_bitwise(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_is_atomic_and_pruned(tmp_path):
  cfg = tiny_cfg(tmp_path)
  mesh = sharding.make_mesh("data:-1")
  params = transformer.init(cfg.model, jax.random.key(0), mesh)
  mgr = checkpoint.Manager(tmp_path / "ck", keep=2)
  for step in (1, 2, 3):
    mgr.save(step, params, {"loader": {"epoch": 0, "index": step}})
  assert mgr.steps() == [2, 3]
  # A leftover .tmp directory (a killed save) is invisible and replaced by the next save of it.
  os.makedirs(mgr.path(4) + ".tmp/arrays/junk")
  assert mgr.latest() == 3
  assert not checkpoint.is_complete(mgr.path(4) + ".tmp")
  mgr.save(4, params, {})
  assert mgr.steps() == [3, 4] and not os.path.exists(mgr.path(4) + ".tmp")
  with pytest.raises(checkpoint.CheckpointError, match="not a complete checkpoint"):
    checkpoint.read_meta(str(tmp_path / "ck" / "nope"))
  # Wrong structure names the leaf.
  with pytest.raises(checkpoint.CheckpointError, match="pytree mismatch"):
    checkpoint.load(mgr.path(4), checkpoint.like_of({"x": params["embed"]}))


def test_restore_across_meshes(tmp_path):
  cfg = tiny_cfg(tmp_path, lora_rank=4, lora_targets=("q", "v", "up"))
  one = sharding.make_mesh("data:1", jax.devices()[:1])
  eight = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  opt, _ = train.optimizer(cfg.optim, 1e-3, 10)
  base1 = transformer.init(cfg.model, jax.random.key(0), one)
  state1 = train.init_state(lora_lib.init(cfg.model, cfg.lora, jax.random.key(1), one), opt, 0, one)
  # Non-trivial optimizer moments, so the test would notice them being dropped or mixed up.
  state1 = state1._replace(opt_state=jax.tree.map(
      lambda x: x + (0.5 if x.dtype == np.float32 else 3), state1.opt_state))
  checkpoint.save_params(str(tmp_path / "base"), base1, cfg.model)
  checkpoint.Manager(tmp_path / "s", 1).save(3, state1, {})

  # one device -> eight (fsdp x tensor sharded)
  base8 = checkpoint.load_params(str(tmp_path / "base"), cfg.model, eight)
  assert base8["layers"]["q"].sharding.mesh.shape == eight.shape
  q1, q8 = base1["layers"]["q"], base8["layers"]["q"]
  assert q8.sharding.shard_shape(q8.shape) != q1.sharding.shard_shape(q1.shape)  # really split
  assert_tree_bitwise(base8, base1)
  like8 = train.init_state(lora_lib.init(cfg.model, cfg.lora, jax.random.key(9), eight), opt, 0, eight)
  state8, _ = checkpoint.Manager(tmp_path / "s", 1).restore(3, checkpoint.like_of(like8))
  assert jax.tree.map(lambda x: x.sharding, state8) == jax.tree.map(lambda x: x.sharding, like8)
  assert_tree_bitwise(state8, state1)

  # eight -> one, through a save made on the eight-device mesh
  checkpoint.Manager(tmp_path / "s8", 1).save(5, state8, {})
  back, _ = checkpoint.Manager(tmp_path / "s8", 1).restore(5, checkpoint.like_of(state1))
  assert_tree_bitwise(back, state1)
  assert jax.tree.map(lambda x: x.sharding, back) == jax.tree.map(lambda x: x.sharding, state1)

  # A params export of a different model shape is refused by name.
  with pytest.raises(checkpoint.CheckpointError, match="d_model"):
    checkpoint.load_params(str(tmp_path / "base"), cfg.model.__class__(d_model=64), one)


def test_resume_is_bitwise_across_interruptions(tmp_path, reference_run):
  """Crash in SFT, then in DPO, resume each time: same metrics and final params as one run."""
  ref_dir, cut_dir = reference_run, tmp_path / "interrupted"
  with pytest.raises(SimulatedCrash):
    loop.run(tiny_cfg(cut_dir), extra_hooks={"sft": [Crash(3)]})  # last checkpoint: sft step 2
  with pytest.raises(SimulatedCrash):  # resumes sft@2; dies after dpo 5 (checkpoint 4)
    loop.run(tiny_cfg(cut_dir), extra_hooks={"dpo": [Crash(5)]})
  assert checkpoint.Manager(cut_dir / "checkpoints" / "dpo", 2).steps() == [2, 4]
  loop.run(tiny_cfg(cut_dir))  # resumes dpo@4

  assert records(cut_dir) == records(ref_dir)
  cfg = tiny_cfg(ref_dir)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  for name in ("sft_model", "policy"):
    assert_tree_bitwise(
        checkpoint.load_params(str(cut_dir / "checkpoints" / name), cfg.model, mesh),
        checkpoint.load_params(str(ref_dir / "checkpoints" / name), cfg.model, mesh))
  for d in (ref_dir, cut_dir):
    meta = checkpoint.read_meta(str(d / "checkpoints" / "dpo" / "step_00000006"))
    assert meta["lora"] and meta["reference"] == str(d / "checkpoints" / "sft_model")
    # LoRA checkpoints hold adapters and their moments, not the frozen base.
    assert not any("embed" in e["path"] for e in meta["leaves"])

  # A finished run rerun does no training and changes nothing.
  loop.run(tiny_cfg(cut_dir))
  assert records(cut_dir) == records(ref_dir)


def test_stage_handoff_and_export(tmp_path, reference_run):
  """--stage=dpo --init_from=<the SFT output> equals the DPO half of --stage=all; the exported
  policy is base + merged LoRA and loads as --init_from of a later run."""
  all_dir, dpo_dir = reference_run, tmp_path / "dpo"
  sft_model = str(all_dir / "checkpoints" / "sft_model")
  loop.run(tiny_cfg(dpo_dir, stage="dpo", init_from=sft_model))
  dpo_rows = lambda d: [r for r in records(d) if r["stage"] == "dpo"]
  assert dpo_rows(dpo_dir) == dpo_rows(all_dir)

  cfg = tiny_cfg(all_dir)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  policy = checkpoint.load_params(str(dpo_dir / "checkpoints" / "policy"), cfg.model, mesh)
  base = checkpoint.load_params(sft_model, cfg.model, mesh)
  adapters = checkpoint.Manager(dpo_dir / "checkpoints" / "dpo", 2)
  lora_like = lora_lib.init(cfg.model, cfg.lora, jax.random.key(0), mesh)
  lora, _ = checkpoint.load(adapters.path(6), checkpoint.like_of(lora_like), prefix=".params")
  s = cfg.lora.scale
  for name in ("q", "v"):
    a, b = np.asarray(lora["layers"][name]["a"]), np.asarray(lora["layers"][name]["b"])
    L, R = a.shape[0], a.shape[-1]
    want = np.asarray(base["layers"][name]) + s * np.einsum(
        "lir,lro->lio", a.reshape(L, -1, R), b.reshape(L, R, -1)).reshape(a.shape[:-1] + b.shape[2:])
    np.testing.assert_allclose(np.asarray(policy["layers"][name]), want, rtol=1e-5, atol=1e-6)
    assert np.abs(want - np.asarray(base["layers"][name])).max() > 0  # the delta is not zero
  np.testing.assert_array_equal(np.asarray(policy["embed"]), np.asarray(base["embed"]))
  # The export starts a later run.
  summary = loop.run(tiny_cfg(tmp_path / "next", stage="dpo", steps=1,
                              init_from=str(dpo_dir / "checkpoints" / "policy")))
  assert summary["skipped_steps"] == 0


def test_sigkill_mid_save_keeps_last_checkpoint(tmp_path, compile_cache):
  out = tmp_path / "run"
  flags = [f"--{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in TINY.items()]
  cmd = [sys.executable, os.path.join(ROOT, "launch.py"), *flags, "--stage=dpo",
         f"--output_dir={out}"]
  killing = [sys.executable, os.path.join(ROOT, "tests", "launch_with_kill.py"), "4", *cmd[2:]]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_COMPILATION_CACHE_DIR": compile_cache,
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  killed = subprocess.run(killing, env=env, capture_output=True,
                          text=True, timeout=300)
  assert killed.returncode == -9, killed.stderr[-3000:]
  mgr = checkpoint.Manager(out / "checkpoints" / "dpo", 2)
  assert os.path.isdir(mgr.path(4) + ".tmp")  # the arrays were written, the commit never happened
  assert mgr.steps() == [2]
  resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "dpo: resumed from" in resumed.stderr and "(step 2 of 6)" in resumed.stderr
  assert mgr.steps() == [4, 6] and not os.path.exists(mgr.path(4) + ".tmp")
  steps = [r["step"] for r in records(out) if r["stage"] == "dpo"]
  assert steps == [1, 2, 3, 4, 5, 6]

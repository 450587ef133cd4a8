"""Checkpoints: atomic commit, restore across meshes, bitwise resume, SIGKILL mid-save, a kill at
each phase of save / replace / delete / export, every kind of damage, a full disk."""

import json
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import configs
import faults
from records import metrics as timeless_records
from dpo import checkpoint, loop, runner, train
from faults import Crash, SimulatedCrash
from models import lora as lora_lib
from models import sharding, transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny model and task so every run compiles and trains in seconds; eval pairs off (no eval).
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
            max_prompt_length=16, max_target_length=16, task_train_pairs=64,
            task_sft_examples=64, task_eval_pairs=0, task_eval_prompts=0, global_batch_size=8,
            log_every=1, sft_steps=4, steps=6, checkpoint_every=2, keep_checkpoints=2)


# A persistent compilation cache for the tiny programs these tests rerun (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("compile_cache")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
  """One uninterrupted SFT -> DPO run of the tiny config."""
  out = tmp_path_factory.mktemp("uninterrupted")
  loop.run(tiny_cfg(out))
  return out


def tiny_cfg(out, **kw):
  return configs.DEFAULT.replace(**{**TINY, "output_dir": str(out), **kw})


def records(out):
  """metrics.jsonl's records, wall-clock fields dropped (tests/records.py)."""
  return timeless_records(out)


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_stage_handoff_and_export(tmp_path, reference_run):
  """--stage=dpo --init_from=<the SFT output> equals the DPO half of --stage=sft,dpo; the exported
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


def _launch_cmd(out, fault=()):
  """launch.py on the tiny DPO config, or with `fault` = (WHEN, STEP) tests/launch_with_kill.py."""
  flags = [f"--{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in TINY.items()]
  script = [os.path.join(ROOT, "tests", "launch_with_kill.py"), *fault] if fault else [
      os.path.join(ROOT, "launch.py")]
  return [sys.executable, *script, *flags, "--stage=dpo", f"--output_dir={out}"]


def _launch_env(compile_cache):
  return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
          "JAX_COMPILATION_CACHE_DIR": compile_cache,
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


@pytest.mark.slow
def test_sigkill_mid_save_keeps_last_checkpoint(tmp_path, compile_cache):
  out = tmp_path / "run"
  cmd, env = _launch_cmd(out), _launch_env(compile_cache)
  killed = subprocess.run(_launch_cmd(out, ("commit", "4")), env=env, capture_output=True,
                          text=True, timeout=300)
  assert killed.returncode == -9, killed.stderr[-3000:]
  dpo_dir = out / "checkpoints" / "dpo"
  assert sorted(os.listdir(dpo_dir)) == ["step_00000002", "step_00000004.tmp"]  # arrays only
  assert not os.path.exists(dpo_dir / "step_00000004.tmp" / "manifest.json")
  mgr = checkpoint.Manager(dpo_dir, 2)  # removes the .tmp: it was never committed
  assert mgr.steps() == [2] and not os.path.exists(dpo_dir / "step_00000004.tmp")
  resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "dpo: resumed from" in resumed.stderr and "(step 2 of 6)" in resumed.stderr
  assert mgr.steps() == [4, 6] and not os.path.exists(mgr.path(4) + ".tmp")
  steps = [r["step"] for r in records(out) if r["stage"] == "dpo"]
  assert steps == [1, 2, 3, 4, 5, 6]


# --- damage: verified, never zeros, the newest intact step instead -------------------------------

def _tree(mesh, k):
  """A small pytree with several chunk files (one per shard of w)."""
  w = np.arange(64, dtype=np.float32).reshape(8, 8) * (k + 1)
  return {"w": jax.device_put(w, NamedSharding(mesh, P("data", "tensor"))),
          "b": jax.device_put(np.full(3, k, np.int32), NamedSharding(mesh, P()))}


def _chunk(path, leaf_part="['"):
  """A data chunk file of the first leaf whose name contains `leaf_part`."""
  leaf = next(l for l in checkpoint.read_meta(str(path))["leaves"] if leaf_part in l["path"])
  return os.path.join(path, next(f for f in leaf["files"] if not f.endswith(".zarray")))


def _edit(path, text: str, at: int | None = None):
  """Overwrites `path` with `text`, or (at=i) flips the bits of byte i in place."""
  if at is None:
    with open(path, "w") as f:
      f.write(text)
    return
  with open(path, "r+b") as f:
    f.seek(at)
    byte = f.read(1)[0]
    f.seek(at)
    f.write(bytes([byte ^ 0xFF]))


def _truncate(path, size):
  with open(path, "r+b") as f:
    f.truncate(size)


DAMAGE = {
    "chunk deleted": lambda p: os.remove(_chunk(p)),
    "chunk truncated": lambda p: _truncate(_chunk(p), 5),
    "chunk bit flipped": lambda p: _edit(_chunk(p), "", at=3),
    "chunk unreadable": lambda p: (os.remove(_chunk(p)), os.mkdir(_chunk(p))),
    ".zarray deleted": lambda p: os.remove(os.path.join(p, "arrays", "00001", ".zarray")),
    "meta.json garbled": lambda p: _edit(os.path.join(p, "meta.json"), "{no"),
    "meta.json changed": lambda p: _edit(os.path.join(p, "meta.json"),
                                         json.dumps({"kind": "state", "step": 7})),
    "meta.json deleted": lambda p: os.remove(os.path.join(p, "meta.json")),
    "manifest deleted": lambda p: os.remove(os.path.join(p, "manifest.json")),
    "manifest garbled": lambda p: _edit(os.path.join(p, "manifest.json"), "[1, 2"),
}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.slow
def test_damaged_step_falls_back_to_the_newest_intact_one(tmp_path, damage, caplog):
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  mgr = checkpoint.Manager(tmp_path / "ck", keep=3)
  for step in (1, 2):
    mgr.save(step, _tree(mesh, step), {"loader": {"epoch": 0, "index": step}})
  DAMAGE[damage](mgr.path(2))
  like = checkpoint.like_of(_tree(mesh, 0))
  with caplog.at_level(logging.WARNING):
    step, state, meta = checkpoint.Manager(tmp_path / "ck", keep=3).restore_latest(like)
  assert step == 1 and meta["loader"]["index"] == 1
  assert_tree_bitwise(state, _tree(mesh, 1))
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "step_00000002 is damaged" in warnings[0], warnings
  assert "falling back to step 1" in warnings[0]
  assert mgr.steps() == [1] and os.path.isdir(mgr.path(2) + ".damaged")
  # Nothing intact left: the stage's fresh start, never a half-read state.
  DAMAGE[damage](mgr.path(1))
  assert checkpoint.Manager(tmp_path / "ck", keep=3).restore_latest(like)[0] is None
  # A damaged export is an error naming it (loop.py rebuilds its own exports, see below).
  cfg = tiny_cfg(tmp_path)
  params = transformer.init(cfg.model, jax.random.key(0), mesh)
  checkpoint.save_params(str(tmp_path / "export"), params, cfg.model)
  DAMAGE[damage](str(tmp_path / "export"))
  with pytest.raises(checkpoint.Damaged, match="export"):
    checkpoint.load_params(str(tmp_path / "export"), cfg.model, mesh)


def test_missing_chunk_reads_as_an_error_not_zeros(tmp_path, monkeypatch):
  """Even past the manifest (a chunk lost after verification), tensorstore fills nothing in."""
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  path = checkpoint.save(str(tmp_path / "ck"), _tree(mesh, 1), {})
  monkeypatch.setattr(checkpoint, "verify", checkpoint.read_meta)
  os.remove(_chunk(path))
  with pytest.raises(checkpoint.Damaged, match="unreadable"):
    checkpoint.load(path, checkpoint.like_of(_tree(mesh, 0)))


def test_stray_files_named_like_a_checkpoint_are_removed_with_a_warning(tmp_path, caplog):
  """A file (not a directory) named like an interrupted save, a replaced or deleted copy, or a
  step: the rerun removes the first three with a warning naming each, moves the step aside as
  damaged, and resumes from the newest intact step."""
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  mgr = checkpoint.Manager(tmp_path / "ck", keep=3)
  for step in (1, 2):
    mgr.save(step, _tree(mesh, step), {})
  stray = [mgr.path(3) + ".tmp", mgr.path(2) + ".old", mgr.path(1) + ".deleted", mgr.path(4)]
  for f in stray:
    _edit(f, "not a checkpoint")
  with caplog.at_level(logging.WARNING):
    rerun = checkpoint.Manager(tmp_path / "ck", keep=3)
    step, state, _ = rerun.restore_latest(checkpoint.like_of(_tree(mesh, 0)))
  assert step == 2
  assert_tree_bitwise(state, _tree(mesh, 2))
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  for f in stray[:3]:
    assert not os.path.lexists(f)
    assert any(f in w and "a file where" in w for w in warnings), warnings
  assert any("step_00000004 is damaged (a file, not a checkpoint directory)" in w
             for w in warnings), warnings
  assert os.path.isfile(mgr.path(4) + ".damaged")
  _edit(mgr.path(3) + ".tmp", "again")  # the save of step 3 clears its own stray file too
  rerun.save(3, _tree(mesh, 3), {})
  assert rerun.steps() == [1, 2, 3]


def _deny(monkeypatch, root):
  """Reads of anything inside `root` fail as they do for another user's chmod 000 directory
  (so the test runs as root too, whom permissions do not stop)."""
  import builtins

  def guard(real, root_too=False):  # `root` itself can be stat'ed (its parent is readable)
    def call(path, *args, **kwargs):
      p = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
      if p.startswith(os.path.join(str(root), "")) or (root_too and p == str(root)):
        raise PermissionError(13, "Permission denied", p)
      return real(path, *args, **kwargs)
    return call
  monkeypatch.setattr(os, "stat", guard(os.stat))
  monkeypatch.setattr(os, "listdir", guard(os.listdir, root_too=True))
  monkeypatch.setattr(builtins, "open", guard(builtins.open))


def _unreadable_step_is_an_error_left_in_place(tmp_path, deny):
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  mgr = checkpoint.Manager(tmp_path / "ck", keep=3)
  for step in (1, 2):
    mgr.save(step, _tree(mesh, step), {})
  checkpoint._VERIFIED.clear()
  with deny(mgr.path(2)):
    with pytest.raises(checkpoint.CheckpointError) as e:
      checkpoint.Manager(tmp_path / "ck", keep=3).restore_latest(
          checkpoint.like_of(_tree(mesh, 0)))
  message = str(e.value)
  assert "\n" not in message and message.startswith(mgr.path(2) + ": permission denied")
  assert "left in place" in message and "not a complete checkpoint" not in message
  assert sorted(os.listdir(tmp_path / "ck")) == ["step_00000001", "step_00000002"]
  assert checkpoint.Manager(tmp_path / "ck", keep=3).restore_latest(
      checkpoint.like_of(_tree(mesh, 0)))[0] == 2  # readable again: resumed, nothing lost
  with deny(tmp_path / "ck"):  # the stage's directory itself
    with pytest.raises(checkpoint.CheckpointError, match=r"ck: permission denied reading the "
                                                         r"directory .*left in place"):
      checkpoint.Manager(tmp_path / "ck", keep=3)
  # An unreadable SFT model export stops the run the same way instead of being rebuilt.
  from dpo import identity
  export = checkpoint.save(str(tmp_path / "sft_model"), _tree(mesh, 1), {"kind": "params"})
  with deny(export):
    with pytest.raises(checkpoint.CheckpointError, match="sft_model: permission denied"):
      identity.reusable(export, {})
  assert os.path.isdir(export) and not os.path.exists(export + ".damaged")


def test_unreadable_checkpoint_is_an_error_left_in_place(tmp_path, monkeypatch):
  import contextlib

  @contextlib.contextmanager
  def deny(path):
    with monkeypatch.context() as m:
      _deny(m, path)
      yield
  _unreadable_step_is_an_error_left_in_place(tmp_path, deny)


def _permissions_bind() -> bool:
  """Whether a chmod 000 stops this process (root with CAP_DAC_OVERRIDE reads through it)."""
  import tempfile
  with tempfile.TemporaryDirectory() as d:
    os.chmod(d, 0)
    try:
      os.listdir(d)
      return False
    except PermissionError:
      return True
    finally:
      os.chmod(d, 0o700)


def permission_cases():
  """A test's two cases of a denied read: simulated (runs as root too) and a real chmod 000
  (skipped where it does not bind)."""
  return [pytest.param(False, id="simulated"),
          pytest.param(True, id="chmod 000", marks=pytest.mark.skipif(
              not _permissions_bind(), reason=f"uid {os.geteuid()} (root) reads a chmod 000 "
                                              f"file; the simulated case runs instead"))]


def deny_each(real_chmod: bool):
  """A context manager that makes a folder unreadable and unwritable: a real chmod 000, or
  (where permissions do not bind, as for root) the denial simulated (`_deny`)."""
  import contextlib

  @contextlib.contextmanager
  def deny(path, monkeypatch):
    if real_chmod:
      os.chmod(path, 0)
      try:
        yield
      finally:
        os.chmod(path, 0o755)
    else:
      with monkeypatch.context() as m:
        _deny(m, path)
        yield
  return deny


@pytest.mark.skipif(not _permissions_bind(), reason=f"uid {os.geteuid()} (root) reads a chmod "
                    f"000 directory; test_unreadable_checkpoint_is_an_error_left_in_place "
                    f"simulates the denial instead")
def test_chmod_000_checkpoint_is_an_error_left_in_place(tmp_path):
  import contextlib

  @contextlib.contextmanager
  def deny(path):
    os.chmod(path, 0)
    try:
      yield
    finally:
      os.chmod(path, 0o755)
  _unreadable_step_is_an_error_left_in_place(tmp_path, deny)


def test_a_leftover_old_copy_is_removed_with_a_warning_or_refused_when_unremovable(
    tmp_path, monkeypatch, caplog):
  """A replace killed after its flip leaves `<dir>.old`: the next save removes it, naming it in
  a warning. One this process may not remove (chmod 000, simulated so root sees it too) stops
  the save in one line naming it, and nothing is renamed or removed."""
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  path = checkpoint.save(str(tmp_path / "export"), _tree(mesh, 1), {"kind": "params"})
  old = path + ".old"
  os.makedirs(os.path.join(old, "arrays"))
  with caplog.at_level(logging.WARNING):
    checkpoint.save(path, _tree(mesh, 2), {"kind": "params"})
  assert not os.path.exists(old)
  assert any(old in r.getMessage() and "interrupted replace" in r.getMessage()
             for r in caplog.records if r.levelno == logging.WARNING), caplog.text
  os.makedirs(os.path.join(old, "arrays"))
  before = checkpoint.digest(path)
  with monkeypatch.context() as m:
    _deny(m, old)
    with pytest.raises(checkpoint.Unreadable) as e:
      checkpoint.save(path, _tree(mesh, 3), {"kind": "params"})
  assert str(e.value).startswith(old + ": permission denied") and "\n" not in str(e.value)
  assert "left in place" in str(e.value)
  assert os.path.isdir(os.path.join(old, "arrays")) and checkpoint.digest(path) == before
  with monkeypatch.context() as m:  # the checkpoint itself: not replaced, not renamed
    _deny(m, path)
    with pytest.raises(checkpoint.Unreadable, match="export: permission denied"):
      checkpoint.save(path, _tree(mesh, 3), {"kind": "params"})
  # (the removable leftover went first, with its warning)
  assert checkpoint.digest(path) == before and sorted(os.listdir(tmp_path)) == ["export"]


def test_free_space_check_counts_the_kept_checkpoints(tmp_path, monkeypatch):
  """With --keep_checkpoints=3 a stage's directory grows to 3 checkpoints and writes a 4th
  before pruning: the first save needs room for 4, a save beside 3 kept ones for 1."""
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  size = checkpoint.nbytes(_tree(mesh, 0)) + 2**20  # what save() counts per checkpoint
  usage = checkpoint.shutil.disk_usage
  free = lambda n: monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                                       lambda p: usage(p)._replace(free=n))
  mgr = checkpoint.Manager(tmp_path / "ck", keep=3)
  free(3 * size)
  with pytest.raises(checkpoint.DiskFull) as e:
    mgr.save(1, _tree(mesh, 1), {})
  message = str(e.value)
  assert "\n" not in message and f"it needs {4 * size:,} bytes (4 x {size:,} bytes" in message
  assert "--keep_checkpoints=3" in message and f"{3 * size:,} free" in message
  assert os.listdir(tmp_path / "ck") == []
  free(4 * size)
  for step in (1, 2, 3):
    mgr.save(step, _tree(mesh, step), {})
  free(size)
  mgr.save(4, _tree(mesh, 4), {})  # beside 3 kept ones: the new one, then the oldest goes
  assert mgr.steps() == [2, 3, 4]


# --- a kill at each phase -------------------------------------------------------------------------

# (operation, phase) -> the step and tree version a rerun resumes: old (the state before the
# operation) or new (after it). "replace" rewrites step 2 (a rollback's re-save), "new" saves
# step 3, "delete" removes step 2 (delete_from after a spike).
KILLS = {("new", "arrays"): (2, 2), ("new", "meta"): (2, 2), ("new", "manifest"): (3, 3),
         ("replace", "arrays"): (2, 2), ("replace", "meta"): (2, 2),
         ("replace", "manifest"): (2, 2), ("replace", "flip"): (2, 20),
         ("replace", "cleanup"): (2, 20), ("delete", "delete"): (1, 1)}


@pytest.mark.parametrize("operation,phase", KILLS)
def test_kill_at_each_phase_leaves_a_resumable_directory(tmp_path, monkeypatch, operation, phase):
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  mgr = checkpoint.Manager(tmp_path / "ck", keep=3)
  for step in (1, 2):
    mgr.save(step, _tree(mesh, step), {})
  with monkeypatch.context() as m:
    target = {"new": 3, "replace": 2, "delete": 2}[operation]
    faults.kill_at(m, phase, f"step_{target:08d}")
    with pytest.raises(faults.Killed):
      if operation == "delete":
        mgr.delete_from(2)
      else:
        mgr.save(target, _tree(mesh, 20 if operation == "replace" else 3), {})
  rerun = checkpoint.Manager(tmp_path / "ck", keep=3)  # what a rerun constructs first
  step, state, _ = rerun.restore_latest(checkpoint.like_of(_tree(mesh, 0)))
  want_step, version = KILLS[operation, phase]
  assert step == want_step
  assert_tree_bitwise(state, _tree(mesh, version))
  leftovers = [n for n in os.listdir(tmp_path / "ck") if not n.startswith("step_") or "." in n]
  assert leftovers == [], leftovers


def _loop_outputs(out):
  cfg = tiny_cfg(out)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  return {name: checkpoint.load_params(str(out / "checkpoints" / name), cfg.model, mesh)
          for name in ("sft_model", "policy")}


@pytest.mark.parametrize("phase,name", [("meta", "step_00000002"), ("flip", "policy"),
                                        ("manifest", "sft_model")])
@pytest.mark.slow
def test_killed_run_resumes_bitwise_without_duplicate_records(tmp_path, reference_run,
                                                              monkeypatch, phase, name):
  """A kill in the DPO stage's first checkpoint, in the export of the policy over an earlier
  one, in the SFT model's export: the rerun's records and models equal the uninterrupted run's."""
  out = tmp_path / "run"
  if name == "policy":  # a run whose rerun re-exports the policy over the old copy: finished,
    loop.run(tiny_cfg(out))  # less its summary (a finished run's rerun would only show that)
    os.remove(out / "summary.json")
  with monkeypatch.context() as m:
    faults.kill_at(m, phase, name)
    hooks = {"dpo": [Crash(2)]} if name.startswith("step") else {}
    with pytest.raises(faults.Killed):
      loop.run(tiny_cfg(out), extra_hooks=hooks)
  loop.run(tiny_cfg(out))
  assert records(out) == records(reference_run)
  for k, v in _loop_outputs(out).items():
    assert_tree_bitwise(v, _loop_outputs(reference_run)[k])


def _folder(root):
  """{relative path: content} of a folder: a safetensors file as its header metadata and
  tensors (read by the safetensors library; its header's key order varies from write to
  write), any other file as bytes with the folder's own path written ROOT (the adapter names
  its base by absolute path)."""
  from safetensors import safe_open
  out = {}
  for d, _, files in os.walk(root):
    for f in files:
      path = os.path.join(d, f)
      if f.endswith(".safetensors"):
        with safe_open(path, framework="numpy") as st:
          out[os.path.relpath(path, root)] = (st.metadata(), {
              k: (st.get_tensor(k).dtype, st.get_tensor(k).tobytes()) for k in st.keys()})
        continue
      with open(path, "rb") as fh:
        out[os.path.relpath(path, root)] = fh.read().replace(str(root).encode(), b"ROOT")
  return out


@pytest.mark.slow
def test_kill_during_the_hf_export_and_the_rerun_rewrites_it(tmp_path, monkeypatch):
  """--export_hf is written in place: a kill after its first safetensors file leaves a partial
  folder; the rerun (the training is done) exports again, equal file for file."""
  cfg = lambda out: tiny_cfg(out, stage="dpo", export_hf=str(out / "hf"))
  loop.run(cfg(tmp_path / "whole"))
  from models import hf
  write, calls = hf.write_safetensors, []

  def killing_write(*args, **kwargs):
    write(*args, **kwargs)
    calls.append(args[0])
    raise faults.Killed(f"killed after writing {args[0]}")
  out = tmp_path / "killed"
  with monkeypatch.context() as m:
    m.setattr(hf, "write_safetensors", killing_write)
    with pytest.raises(faults.Killed):
      loop.run(cfg(out))
  assert calls == [str(out / "hf" / "model.safetensors")]
  assert not (out / "hf" / "config.json").exists()  # partial: no config.json yet
  loop.run(cfg(out))
  whole = _folder(tmp_path / "whole" / "hf")
  assert {"config.json", "model.safetensors", "adapter/adapter_config.json"} <= set(whole)
  assert _folder(out / "hf") == whole
  assert records(out) == records(tmp_path / "whole")


@pytest.mark.slow
def test_damaged_sft_model_and_step_are_rebuilt(tmp_path, reference_run, caplog):
  """A zeroed-out (deleted) chunk in the SFT model and in the newest DPO step: the rerun warns,
  rebuilds the SFT model from its last step checkpoint and resumes DPO from the older step."""
  out = tmp_path / "run"
  with pytest.raises(SimulatedCrash):
    loop.run(tiny_cfg(out), extra_hooks={"dpo": [Crash(5)]})
  os.remove(_chunk(out / "checkpoints" / "sft_model", "embed"))
  os.remove(_chunk(out / "checkpoints" / "dpo" / "step_00000004", "['a']"))
  with caplog.at_level(logging.WARNING):
    loop.run(tiny_cfg(out))
  text = caplog.text
  assert "sft_model is damaged" in text and "step_00000004 is damaged" in text
  assert "falling back to step 2" in text
  assert records(out) == records(reference_run)
  for k, v in _loop_outputs(out).items():
    assert_tree_bitwise(v, _loop_outputs(reference_run)[k])


@pytest.mark.parametrize("sft_steps_lost", ["the last", "all"])
@pytest.mark.slow
def test_rebuilt_sft_model_keeps_the_metrics_history(tmp_path, reference_run, caplog,
                                                     sft_steps_lost):
  """A finished run whose SFT model is damaged, with its last SFT step checkpoint (the SFT stage
  runs again from step 2) or all of them (from the start): the rebuilt stage writes its records
  again into the SFT section, before the DPO stage's, which stay; the DPO stage resumes from its
  last checkpoint. The records equal the uninterrupted run's, none lost or out of order."""
  out = tmp_path / "run"
  loop.run(tiny_cfg(out))
  os.remove(_chunk(out / "checkpoints" / "sft_model", "embed"))
  sft_dir = out / "checkpoints" / "sft"
  if sft_steps_lost == "all":
    checkpoint.shutil.rmtree(sft_dir)
  else:
    os.remove(_chunk(sft_dir / "step_00000004", "embed"))
  with caplog.at_level(logging.INFO):
    loop.run(tiny_cfg(out))
  assert "sft_model is damaged" in caplog.text
  assert records(out) == records(reference_run)
  # What the resumes dropped is counted: SFT steps after its checkpoint, the final evaluation.
  assert "dropped 1 record of stage dpo written after" in caplog.text
  dropped_sft = 4 if sft_steps_lost == "all" else 2
  assert f"dropped {dropped_sft} records of stage sft" in caplog.text


@pytest.mark.slow
def test_a_copied_in_sft_model_rebuilt_keeps_every_later_record(tmp_path, reference_run,
                                                                caplog):
  """An SFT model copied in from another run (as docs/online.md does; its SFT records are not
  in this folder), DPO run on it, then the SFT model damaged: the rerun rebuilds it, writing
  the SFT records into their section, and keeps every DPO record: the file ends as the
  uninterrupted run's, nothing lost or duplicated."""
  import shutil
  out = tmp_path / "run"
  os.makedirs(out / "checkpoints")
  shutil.copytree(reference_run / "checkpoints" / "sft_model", out / "checkpoints" / "sft_model")
  loop.run(tiny_cfg(out))
  first = records(out)
  assert first and not any(r["stage"] == "sft" for r in first)
  os.remove(_chunk(out / "checkpoints" / "sft_model", "embed"))
  checkpoint._VERIFIED.clear()  # the rerun is a new process: nothing verified yet
  with caplog.at_level(logging.INFO):
    loop.run(tiny_cfg(out))
  assert "sft_model is damaged" in caplog.text
  assert records(out) == records(reference_run)
  assert [r for r in records(out) if r["stage"] != "sft"] == first


def test_metrics_sections_follow_the_recipe(tmp_path, caplog):
  """The stage order is the recipe's, whatever its stages are named: a first stage run again
  writes into its own section, before the second's records, which a rewind of the first keeps;
  an evaluation record belongs to the stage whose records follow it, or at the end to the last;
  records of a registered stage outside the recipe (an earlier run's) stay in front."""
  from dpo.runner import MetricsWriter
  rec = lambda stage, step: {"stage": stage, "step": step}
  names = lambda: [(r["stage"], r["step"])
                   for r in map(json.loads, open(tmp_path / "metrics.jsonl"))]
  w = MetricsWriter(str(tmp_path), ("warmup", "align"))
  for r in [rec("warmup", 1), rec("warmup", 2), rec("eval", 0), rec("align", 1), rec("eval", 1)]:
    w.write(r)
  with caplog.at_level(logging.INFO):
    w.rewind(1, "warmup step 1", "warmup")  # the first stage is rebuilt from its step 1
  assert names() == [("warmup", 1), ("eval", 0), ("align", 1), ("eval", 1)]
  assert "dropped 1 record of stage warmup written after warmup step 1" in caplog.text
  w.write(rec("warmup", 2))
  assert names() == [("warmup", 1), ("warmup", 2), ("eval", 0), ("align", 1), ("eval", 1)]
  assert w.count == 2
  w.rewind(2, "align step 1", "align")  # the second resumes: its final evaluation runs again
  assert names() == [("warmup", 1), ("warmup", 2), ("eval", 0), ("align", 1)]
  w.rewind_stage("warmup")  # the first starts afresh; the second's records stay
  assert names() == [("eval", 0), ("align", 1)] and (w.count, w.later) == (0, 2)
  # Another recipe over the same file: "warmup" is a registered stage outside it.
  (tmp_path / "metrics.jsonl").write_text(json.dumps(rec("warmup", 1)) + "\n" +
                                          json.dumps(rec("align", 1)) + "\n")
  w = MetricsWriter(str(tmp_path), ("align",), ("warmup", "align"))
  w.rewind_stage("align")
  assert names() == [("warmup", 1)]


# --- metrics.jsonl and a full disk ----------------------------------------------------------------

@pytest.mark.slow
def test_torn_metrics_line_is_dropped_on_resume(tmp_path, reference_run, caplog):
  out = tmp_path / "run"
  with pytest.raises(SimulatedCrash):
    loop.run(tiny_cfg(out), extra_hooks={"dpo": [Crash(5)]})
  with open(out / "metrics.jsonl", "a") as f:
    f.write('{"stage": "dpo", "step": 6, "lo')  # a kill mid-write
  with caplog.at_level(logging.WARNING):
    loop.run(tiny_cfg(out))
  assert "dropping a torn last line" in caplog.text
  assert records(out) == records(reference_run)


@pytest.mark.parametrize("where", ["checkpoint", "metrics", "tensorboard"])
@pytest.mark.slow
def test_full_disk_through_launch_is_one_line_and_exit_2(tmp_path, compile_cache, where):
  """What the user sees: one `error:` line naming the path and the bytes, status 2; no
  traceback, no "Event loop is closed" from tensorstore's writes dying with the loop, none from
  tensorboard's writer thread."""
  out = tmp_path / "run"
  r = subprocess.run(_launch_cmd(out, (f"full-{where}", "3")), env=_launch_env(compile_cache),
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 2, r.stderr[-3000:]
  errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
  assert len(errors) == 1 and "bytes" in errors[0], r.stderr[-3000:]
  assert str(out / {"metrics": "metrics.jsonl", "tensorboard": "tb"}.get(where, "checkpoints")
             ) in errors[0]
  for noise in ("Traceback", "Event loop is closed", "Exception ignored", "Task exception",
                "Exception in thread"):
    assert noise not in r.stderr, r.stderr[-3000:]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("where", ["metrics", "tensorboard", "checkpoint", "free space"])
@pytest.mark.slow
def test_full_disk_is_one_message_and_the_rerun_resumes(tmp_path, reference_run, monkeypatch,
                                                        where):
  out = tmp_path / "run"
  loop.run(tiny_cfg(out, stage="sft"))  # the SFT stage completes; the disk fills during DPO
  dpo_dir = out / "checkpoints" / "dpo"
  with monkeypatch.context() as m:
    if where == "free space":
      usage = checkpoint.shutil.disk_usage
      m.setattr(checkpoint.shutil, "disk_usage",
                lambda p: usage(p)._replace(free=1000) if "dpo" in str(p) else usage(p))
    else:
      faults.no_space(m, where, after=3)
    with pytest.raises(checkpoint.DiskFull) as e:
      loop.run(tiny_cfg(out))
  message = str(e.value)
  assert "\n" not in message and "bytes" in message
  assert str(out / {"metrics": "metrics.jsonl", "tensorboard": "tb"}.get(where, dpo_dir)) in message
  if where == "free space":
    assert "1,000 free" in message
  with open(out / "metrics.jsonl", "rb") as f:
    assert f.read().endswith(b"\n")  # no torn line
  assert not [n for n in (os.listdir(dpo_dir) if dpo_dir.exists() else []) if "." in n]
  loop.run(tiny_cfg(out))
  assert records(out) == records(reference_run)
  for k, v in _loop_outputs(out).items():
    assert_tree_bitwise(v, _loop_outputs(reference_run)[k])


@pytest.mark.slow
def test_a_kill_after_a_checkpoint_keeps_that_steps_evaluation(tmp_path, monkeypatch):
  """A step's evaluation runs before its checkpoint: a run killed once DPO's step-2 checkpoint is
  written resumes from it with step 2's evaluation on record, as the uninterrupted run has it."""
  kw = dict(eval_every=2, task_eval_pairs=8, task_eval_prompts=8, eval_max_new_tokens=4)
  loop.run(tiny_cfg(tmp_path / "ref", **kw))
  save = runner.Stage.save

  def save_then_die(self):
    save(self)
    if self.name == "dpo" and self.step == 2:
      raise SimulatedCrash("fault: killed after the dpo step-2 checkpoint")

  with monkeypatch.context() as m:
    m.setattr(runner.Stage, "save", save_then_die)
    with pytest.raises(SimulatedCrash):
      loop.run(tiny_cfg(tmp_path / "cut", **kw))
  loop.run(tiny_cfg(tmp_path / "cut", **kw))
  assert records(tmp_path / "cut") == records(tmp_path / "ref")
  assert [r["step"] for r in records(tmp_path / "ref") if r["stage"] == "eval"] == [2, 4, 6]

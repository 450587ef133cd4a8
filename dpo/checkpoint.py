"""Tensorstore checkpoints: atomic, sharded, restorable onto any mesh.

A checkpoint is a directory

    <dir>/meta.json          step, kind, data-loader position, guard state, leaf table
    <dir>/arrays/<i>/        one zarr3 array per pytree leaf (tensorstore, file kvstore)

Every process writes the shards it holds (replica 0 of each shard only, so replicated arrays are
written once), with chunks equal to the shard shape so no two processes touch the same file.
The directory is first written as `<dir>.tmp`; after all processes finish (a barrier), process 0
writes meta.json last and renames `<dir>.tmp` to `<dir>`. A rename within one filesystem is atomic,
so a checkpoint is either complete or invisible; a save killed half-way leaves only a `.tmp`
directory, which readers ignore and the next save of that step deletes.

Restoring reads each leaf straight into the shardings of a template pytree, so a checkpoint saved
on one mesh restores onto any other (tensorstore reads each device's slice).

Two kinds share the format: "state" (a TrainState, plus loader position) under
<output_dir>/checkpoints/<stage>/step_<N>, and "params" (a plain model pytree; the SFT output, the
exported policy) that `--init_from` and the sampler load with `load_params`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.experimental.array_serialization import serialization

META = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
  """A checkpoint is missing, incomplete, or does not match what the run expects."""


def _leaves(tree) -> tuple[list[str], list[Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat]


def _spec(directory: str, i: int) -> dict:
  return serialization.get_tensorstore_spec(os.path.join(os.path.abspath(directory), "arrays",
                                                         f"{i:05d}"), ocdbt=False)


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def is_complete(path: str) -> bool:
  return os.path.isfile(os.path.join(path, META)) and not path.rstrip("/").endswith(".tmp")


def read_meta(path: str) -> dict:
  if not is_complete(path):
    raise CheckpointError(f"{path}: not a complete checkpoint (no {META}; an interrupted save "
                          f"leaves only a .tmp directory)")
  with open(os.path.join(path, META)) as f:
    return json.load(f)


def save(path: str, tree, meta: dict) -> str:
  """Writes `tree` (a pytree of jax.Arrays) and `meta` to `path`, atomically. Collective."""
  path = os.path.abspath(path)
  tmp = path + ".tmp"
  if jax.process_index() == 0:
    if os.path.exists(tmp):
      shutil.rmtree(tmp)  # left by a save that was killed before it committed
    os.makedirs(os.path.join(tmp, "arrays"))
  _barrier(f"ckpt-mkdir:{path}")
  names, leaves = _leaves(tree)
  serialization.run_serialization(leaves, [_spec(tmp, i) for i in range(len(leaves))])
  _barrier(f"ckpt-written:{path}")
  _commit(path, names, leaves, meta)
  return path


def _commit(path: str, names: list[str], leaves: list, meta: dict) -> None:
  """meta.json last, then the rename that makes `<path>.tmp` visible as `path`."""
  tmp = path + ".tmp"
  if jax.process_index() == 0:
    table = [{"path": n, "shape": list(x.shape), "dtype": str(x.dtype)}
             for n, x in zip(names, leaves)]
    with open(os.path.join(tmp, META), "w") as f:
      json.dump({**meta, "leaves": table}, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    if os.path.exists(path):
      shutil.rmtree(path)  # rewriting a step (e.g. after a rollback): replace it whole
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
  _barrier(f"ckpt-committed:{path}")


def load(path: str, like, prefix: str = "") -> tuple[Any, dict]:
  """Reads a checkpoint into the structure and shardings of `like` (arrays or
  ShapeDtypeStructs with .sharding). With `prefix`, the checkpoint's leaves whose path starts with
  it are matched against `like` (e.g. prefix=".params" reads a TrainState's params alone)."""
  meta = read_meta(path)
  stored = {e["path"][len(prefix):]: (i, e) for i, e in enumerate(meta["leaves"])
            if e["path"].startswith(prefix)}
  names, templates = _leaves(like)
  missing = [n for n in names if n not in stored]
  if missing or len(stored) != len(names):
    extra = sorted(set(stored) - set(names))
    raise CheckpointError(f"{path}: pytree mismatch; missing leaves {missing[:5]}, unexpected "
                          f"leaves {extra[:5]} ({len(names)} expected, {len(stored)} stored)")
  specs, shardings, shapes, dtypes = [], [], [], []
  for n, t in zip(names, templates):
    i, e = stored[n]
    if tuple(e["shape"]) != tuple(t.shape) or e["dtype"] != str(t.dtype):
      raise CheckpointError(f"{path}: leaf {n} is {e['dtype']}{e['shape']} in the checkpoint but "
                            f"the run expects {t.dtype}{list(t.shape)}")
    specs.append(_spec(path, i))
    shardings.append(t.sharding)
    shapes.append(tuple(t.shape))
    dtypes.append(t.dtype)
  arrays = serialization.run_deserialization(shardings, specs, shapes, dtypes)
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), arrays), meta


# --- model exports --------------------------------------------------------------------------------

def save_params(path: str, params, model_cfg, **meta) -> str:
  """A plain model pytree (no optimizer state) that `load_params` and `--init_from` read."""
  return save(path, params, {"kind": "params", "model": dataclasses.asdict(model_cfg), **meta})


def load_params(path: str, model_cfg, mesh) -> Any:
  """Model params from a params export or from a full-weight (LoRA-off) state checkpoint,
  sharded for `mesh` by the model's logical axes."""
  from models import transformer
  meta = read_meta(path)
  saved = meta.get("model")
  if saved is not None:
    want = dataclasses.asdict(model_cfg)
    diff = {k: (saved.get(k), v) for k, v in want.items()
            if k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "mlp_dim", "tie_embeddings") and saved.get(k) != v}
    if diff:
      raise CheckpointError(f"{path}: model shape differs from the run's config "
                            f"(field: (checkpoint, run)): {diff}")
  specs = transformer.param_specs(model_cfg)
  like = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      transformer.abstract(specs), transformer.shardings(specs, mesh))
  if meta.get("kind") == "params":
    return load(path, like)[0]
  if meta.get("kind") == "state" and not meta.get("lora"):
    return load(path, like, prefix=".params")[0]
  raise CheckpointError(f"{path}: kind {meta.get('kind')!r} (lora={meta.get('lora')}) holds no "
                        f"full model weights; export one with the final policy or an SFT run")


# --- a directory of step checkpoints --------------------------------------------------------------

class Manager:
  """Step checkpoints of one stage under `directory`, newest `keep` retained.

  `identity` ({meta key: value}, e.g. the reference model's path) is written into every
  checkpoint and checked on restore: a rerun with other settings is refused, never resumed.
  """

  def __init__(self, directory: str, keep: int, identity: dict | None = None):
    if keep < 1:
      raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
    self.directory, self.keep = os.path.abspath(directory), keep
    self.identity = dict(identity or {})

  def path(self, step: int) -> str:
    return os.path.join(self.directory, f"step_{step:08d}")

  def steps(self) -> list[int]:
    if not os.path.isdir(self.directory):
      return []
    found = []
    for name in os.listdir(self.directory):
      m = _STEP_DIR.match(name)
      if m and is_complete(os.path.join(self.directory, name)):
        found.append(int(m.group(1)))
    return sorted(found)

  def latest(self, before: int | None = None) -> int | None:
    """Newest complete step (strictly below `before` if given)."""
    s = [x for x in self.steps() if before is None or x < before]
    return s[-1] if s else None

  def save(self, step: int, state, meta: dict) -> str:
    if jax.process_index() == 0:
      os.makedirs(self.directory, exist_ok=True)
    out = save(self.path(step), state, {"kind": "state", "step": step, **meta, **self.identity})
    if jax.process_index() == 0:
      for old in self.steps()[:-self.keep]:
        shutil.rmtree(self.path(old))
    _barrier(f"ckpt-pruned:{out}")
    return out

  def restore(self, step: int, like) -> tuple[Any, dict]:
    path = self.path(step)
    meta = read_meta(path)
    for k, v in self.identity.items():
      if meta.get(k) != v:
        raise CheckpointError(f"{path}: {k} is {meta.get(k)!r} but this run has {v!r}; use a "
                              f"fresh --output_dir or the original settings")
    return load(path, like)

  def delete_from(self, step: int) -> list[int]:
    """Removes checkpoints at `step` and later (states after a KL spike); returns their steps."""
    gone = [s for s in self.steps() if s >= step]
    if jax.process_index() == 0:
      for s in gone:
        shutil.rmtree(self.path(s))
    _barrier(f"ckpt-deleted:{self.directory}:{step}")
    return gone


def like_of(tree) -> Any:
  """ShapeDtypeStruct template (with shardings) of a live pytree of arrays."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


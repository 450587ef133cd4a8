"""Tensorstore checkpoints that know they are whole: atomic, checksummed, restorable onto any mesh.

A checkpoint is a directory

    <dir>/arrays/<i>/        one zarr3 array per pytree leaf (tensorstore, file kvstore)
    <dir>/meta.json          step, kind, data-loader position, hook states, the run's identity
    <dir>/manifest.json      written last: each leaf's name, shape, dtype and every file of its
                             array with size and sha256, and the sha256 of meta.json

Every process writes the shards it holds (replica 0 of each shard only, so replicated arrays are
written once), with chunks equal to the shard shape so no two processes touch the same file.
A save writes `<dir>.tmp`; after all processes finish (a barrier) process 0 writes meta.json,
then the manifest, then flips the directory into place: a new step is one rename; replacing a
step (the re-save after a rollback, a re-export) renames the old copy to `<dir>.old` first and
removes it after the flip; deleting renames to `<dir>.deleted` before removing. So at any
instant of a save, replace or delete the directory holds either the old checkpoint or the new
one whole (a kill between the two renames of a replace leaves a complete `.tmp`, which the next
`Manager` rolls forward). Names other than `<dir>` are never read as checkpoints.

Restoring verifies the manifest first (every file present, sizes and checksums equal, meta.json
unchanged), then reads with missing chunks as errors, never as zeros. A `Manager` that finds its
newest step damaged warns once, naming it and the damage, moves it to `<dir>.damaged`, and falls
back to the newest intact step (or the fresh start when none is left). A checkpoint this process
may not read is not damaged: `Unreadable` names the path and leaves it where it is; so is one a
save must replace or a cleanup remove that this process may not (checked before anything is
renamed or removed). A leftover `.tmp`, `.old` or `.deleted` is removed with a warning naming it.

Before writing, the free space of the filesystem is checked against the arrays' size; running
out anyway (another writer) removes the half-written `.tmp` and raises `DiskFull`, one line naming
the path and the bytes the checkpoint needed.

Two kinds share the format: "state" (a TrainState, plus loader position) under
<output_dir>/checkpoints/<stage>/step_<N>, and "params" (a plain model pytree; the SFT output, the
exported policy) that `--init_from` and the sampler load with `load_params`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.experimental.array_serialization import serialization

META = "meta.json"
MANIFEST = "manifest.json"
FORMAT = 2  # manifest format; 1 was meta.json alone, without checksums
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_ASIDE = (".tmp", ".old", ".deleted", ".damaged")  # names beside a checkpoint, never read as one
# The identity field of the library's source files (dpo/identity.py): logged when it differs.
SOURCE = "code"


class CheckpointError(ValueError):
  """A checkpoint is missing, incomplete, or does not match what the run expects."""


class Damaged(CheckpointError):
  """A checkpoint's files do not match its manifest (or it has none)."""


class DiskFull(CheckpointError):
  """A write ran out of space (its half-written files are removed)."""


class Unreadable(CheckpointError):
  """This process may not read a checkpoint's files (permissions): never taken for damage."""


def _unreadable(path: str, e: OSError) -> Unreadable:
  what = e.filename if e.filename and os.fspath(e.filename) != path else "the directory"
  return Unreadable(f"{path}: permission denied reading {os.fspath(what)} (as uid {os.geteuid()}); "
                    f"left in place: give this user read access (chmod -R u+rX) and rerun")


def _unremovable(path: str, e: OSError) -> Unreadable:
  what = e.filename if e.filename and os.fspath(e.filename) != path else "the directory"
  return Unreadable(f"{path}: permission denied on {os.fspath(what)} (as uid {os.geteuid()}), "
                    f"which this save must replace or remove; left in place: give this user "
                    f"access (chmod -R u+rwX) and rerun")


def _check_removable(path: str, overwrite: bool = False) -> None:
  """Raises `Unreadable` naming `path` when this process could not remove it whole (a directory
  it may not list or change, as after chmod 000) or, with `overwrite` (a folder written in
  place, through a link too), rewrite each of its files; checked before a replace, delete or
  cleanup renames or removes anything, so a denial leaves every copy where it was."""
  if not os.path.isdir(path) or (os.path.islink(path) and not overwrite):
    return
  stack = [path]
  try:
    while stack:
      d = stack.pop()
      names = [os.path.join(d, n) for n in os.listdir(d)]
      if not os.access(d, os.W_OK | os.X_OK):
        raise PermissionError(13, "Permission denied", d)
      locked = [f for f in names if overwrite and os.path.isfile(f) and not os.access(f, os.W_OK)]
      if locked:
        raise PermissionError(13, "Permission denied", locked[0])
      stack += [f for f in names if os.path.isdir(f) and not os.path.islink(f)]
  except PermissionError as e:
    raise _unremovable(path, e) from None


def check_writable(path: str) -> None:
  """Raises `Unreadable` naming `path` when this process could not write a folder there in
  place (an export: its files rewritten, none removed): a directory in it that it may not list
  or change, a file it may not rewrite, or, where there is no folder yet, the nearest existing
  parent it may not create one in. Called before anything is written, so a denial leaves the
  folder as it was."""
  path = os.path.abspath(path)
  parent = path
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if parent == path:
    _check_removable(path, overwrite=True)
  elif os.path.isdir(parent) and not os.access(parent, os.W_OK | os.X_OK):
    raise _unremovable(path, PermissionError(13, "Permission denied", parent))


def listdir(directory: str) -> list[str]:
  """os.listdir of a stage's checkpoint directory (or a Hugging Face folder); a permission error
  raises `Unreadable` naming it."""
  try:
    return os.listdir(directory)
  except PermissionError as e:
    raise _unreadable(directory, e) from None


def is_file(path: str, folder: str) -> bool:
  """os.path.isfile, except that a permission error raises `Unreadable` naming `folder` instead
  of reading as absence (an intact checkpoint behind chmod 000 must not be moved aside as
  damaged, nor a Hugging Face folder called empty)."""
  try:
    return stat.S_ISREG(os.stat(path).st_mode)
  except PermissionError as e:
    raise _unreadable(folder, e) from None
  except (FileNotFoundError, NotADirectoryError):
    return False


def _leaves(tree) -> tuple[list[str], list[Any]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat]


def _spec(directory: str, i: int, read: bool = False) -> dict:
  spec = serialization.get_tensorstore_spec(os.path.join(os.path.abspath(directory), "arrays",
                                                         f"{i:05d}"), ocdbt=False)
  if read:
    spec["fill_missing_data_reads"] = False  # a missing chunk is an error, never zeros
  return spec


def barrier(name: str) -> None:
  """Every process waits here for the others (a no-op in one process): what process 0 wrote
  before it is there for all."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _write_json(path: str, obj) -> None:
  """`obj` to `path` through a temporary file, fsynced and renamed: never a torn file."""
  tmp = path + ".part"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def is_no_space(e: BaseException) -> bool:
  """Whether `e` (an OSError, or tensorstore's error text) reports a full disk or quota."""
  if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
    return True
  return any(s in str(e) for s in ("No space left on device", "Disk quota exceeded", "ENOSPC"))


def _discard(path: str) -> None:
  """Removes `path`, a directory or a file (a stray file named like a checkpoint's temporary
  copy must not stop the run)."""
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  elif os.path.lexists(path):
    os.remove(path)


def _remove(path: str) -> None:
  """Deletes a directory so that a kill leaves it whole or invisible: rename aside, then remove."""
  if not os.path.exists(path):
    return
  gone = path + ".deleted"
  _check_removable(path)
  _check_removable(gone)
  _discard(gone)
  os.rename(path, gone)
  _fsync_dir(os.path.dirname(path))
  _discard(gone)


def _flip(tmp: str, path: str) -> None:
  """Makes the complete `tmp` visible as `path`, replacing an existing `path` (rename it to
  `<path>.old`, rename `tmp`, remove the old copy): `path` is at every instant absent, the old
  checkpoint or the new one, and while it is absent `tmp` is complete (`recover` rolls forward)."""
  old = path + ".old"
  _check_removable(path)
  _check_removable(old)
  _discard(old)
  if os.path.exists(path):
    os.rename(path, old)
  os.rename(tmp, path)
  _fsync_dir(os.path.dirname(path))
  _discard(old)


# What each leftover beside a checkpoint is, for the warning that removes it.
_LEFTOVERS = {".tmp": "the partial copy of an interrupted save",
              ".old": "the old copy an interrupted replace left (the new one is whole)",
              ".deleted": "the rest of an interrupted delete"}


def recover(path: str) -> None:
  """Finishes an interrupted save or replace of `path` (process 0, while nothing writes it): a
  complete `<path>.tmp` with no `path` is flipped in; leftovers of finished or abandoned
  operations (an incomplete .tmp, .old, .deleted) are removed with a warning naming each (a
  file under one of those names, which no save writes, too); one this process may not remove
  is `Unreadable`, and nothing is removed."""
  tmp = path + ".tmp"
  if not os.path.exists(path) and os.path.isfile(os.path.join(tmp, MANIFEST)):
    logging.warning("checkpoint: completing the interrupted save of %s", path)
    _flip(tmp, path)
  leftovers = [path + suffix for suffix in _LEFTOVERS if os.path.lexists(path + suffix)]
  for leftover in leftovers:
    _check_removable(leftover)
  for leftover in leftovers:
    if not os.path.isdir(leftover):
      logging.warning("checkpoint: removing %s, a file where only a checkpoint's temporary "
                      "directory belongs (%d bytes)", leftover, os.lstat(leftover).st_size)
    else:
      logging.warning("checkpoint: removing %s, %s", leftover,
                      _LEFTOVERS[leftover[len(path):]])
    _discard(leftover)


def is_complete(path: str) -> bool:
  """Whether `path` is a committed checkpoint (its manifest exists; `verify` checks the rest)."""
  return (os.path.isfile(os.path.join(path, MANIFEST)) and
          not path.rstrip("/").endswith(_ASIDE))


def _read_json(path: str, name: str) -> dict:
  try:
    with open(os.path.join(path, name)) as f:
      obj = json.load(f)
  except PermissionError as e:
    raise _unreadable(path, e) from None
  except (OSError, ValueError) as e:
    raise Damaged(f"{path}: {name} unreadable ({type(e).__name__}: {e})") from None
  if not isinstance(obj, dict):
    raise Damaged(f"{path}: {name} is not a JSON object")
  return obj


def read_meta(path: str) -> dict:
  """meta.json, checked against the manifest's checksum, with the manifest's leaf table as
  meta["leaves"]. Raises CheckpointError (Damaged when the files disagree, Unreadable when this
  process may not read them)."""
  if not os.path.isdir(path):
    if os.path.lexists(path):
      raise Damaged(f"{path}: a file, not a checkpoint directory")
    raise CheckpointError(f"{path}: not a complete checkpoint (no such directory)")
  if not is_file(os.path.join(path, MANIFEST), path):
    what = ("an interrupted save leaves only a .tmp directory" if path.endswith(".tmp") else
            "a save writes it last; this one was interrupted, damaged, or predates checksums")
    raise Damaged(f"{path}: not a complete checkpoint (no {MANIFEST}; {what})")
  manifest = _read_json(path, MANIFEST)
  if manifest.get("format") != FORMAT or not isinstance(manifest.get("leaves"), list):
    raise Damaged(f"{path}: {MANIFEST} has format {manifest.get('format')!r}, expected {FORMAT}")
  if not is_file(os.path.join(path, META), path):
    raise Damaged(f"{path}: {META} is missing")
  try:
    meta_sha = _sha256(os.path.join(path, META))
  except PermissionError as e:
    raise _unreadable(path, e) from None
  except OSError as e:
    raise Damaged(f"{path}: {META} unreadable ({e})") from None
  if meta_sha != manifest.get("meta_sha256"):
    raise Damaged(f"{path}: {META} differs from the one its manifest recorded")
  return {**_read_json(path, META), "leaves": manifest["leaves"]}


_VERIFIED: dict[str, tuple] = {}  # path -> manifest stat: each checkpoint is hashed once per process


def verify(path: str) -> dict:
  """read_meta, plus every array file present with the size and sha256 its manifest recorded.
  Returns the meta; raises Damaged naming the first file that differs."""
  meta = read_meta(path)
  st = os.stat(os.path.join(path, MANIFEST))
  key = (st.st_ino, st.st_mtime_ns)
  if _VERIFIED.get(path) == key:
    return meta
  for leaf in meta["leaves"]:
    for rel, (size, digest) in leaf["files"].items():
      f, what = os.path.join(path, rel), f"{rel} (of leaf {leaf['path']})"
      if not is_file(f, path):
        raise Damaged(f"{path}: {what} is missing")
      if os.path.getsize(f) != size:
        raise Damaged(f"{path}: {what} has {os.path.getsize(f)} bytes, the manifest recorded "
                      f"{size}")
      try:
        ok = _sha256(f) == digest
      except PermissionError as e:
        raise _unreadable(path, e) from None
      except OSError as e:
        raise Damaged(f"{path}: {what} unreadable ({e})") from None
      if not ok:
        raise Damaged(f"{path}: {what} fails its checksum")
  _VERIFIED[path] = key
  return meta


def digest(path: str) -> str:
  """A content fingerprint of a checkpoint's arrays (from its manifest; no file is reread)."""
  meta = read_meta(path)
  h = hashlib.sha256()
  for leaf in meta["leaves"]:
    h.update(f"{leaf['path']}:{leaf['dtype']}:{leaf['shape']}".encode())
    for rel in sorted(leaf["files"]):
      h.update(f"{rel}:{leaf['files'][rel][1]}".encode())
  return h.hexdigest()


def nbytes(tree) -> int:
  """Bytes of a pytree's arrays (global shapes): what a checkpoint of it writes, uncompressed."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _check_space(path: str, size: int, keep: int, kept: int) -> None:
  """Refuses a save that the filesystem cannot hold. A stage's directory (`keep` > 0) grows to
  `keep` checkpoints, and each save writes the new one before it removes the oldest: with `kept`
  saved, it still needs keep + 1 - kept copies (one, once it holds `keep`); an export, one."""
  copies = max(keep + 1 - kept, 1)
  need, free = size * copies, shutil.disk_usage(os.path.dirname(path)).free
  if free >= need:
    return
  count = (f"{copies} x {size:,} bytes: the stage keeps --keep_checkpoints={keep}, has {kept}, "
           f"and writes each new one before removing the oldest" if keep else
           f"{size:,} bytes")
  advice = "free space, lower --keep_checkpoints," if keep else "free space"
  raise DiskFull(f"{path}: no space for the checkpoint: it needs {need:,} bytes ({count}), the "
                 f"filesystem has {free:,} free; {advice} or point --output_dir elsewhere")


def _serialize(leaves: list, specs: list[dict]) -> None:
  """Writes every leaf, waiting for all writes to end (failed or not) before the event loop
  closes, so a failure raises once instead of leaving writes to die with the loop."""
  async def write_all():
    return await asyncio.gather(*[serialization.async_serialize(x, s)
                                  for x, s in zip(leaves, specs)], return_exceptions=True)
  errors = [r for r in asyncio.run(write_all()) if isinstance(r, BaseException)]
  if errors:
    raise errors[0]


def save(path: str, tree, meta: dict, keep: int = 0, kept: int = 0) -> str:
  """Writes `tree` (a pytree of jax.Arrays) and `meta` to `path`, atomically. Collective.
  `keep` and `kept`: the step checkpoints its directory retains and holds (the space check)."""
  path = os.path.abspath(path)
  tmp = path + ".tmp"
  names, leaves = _leaves(tree)
  need = nbytes(tree) + 2**20  # arrays plus headroom for zarr metadata, meta and manifest
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    recover(path)
    _check_removable(path)  # a copy it may not replace stops the save before any work
    _discard(tmp)  # left by a save that was killed before it committed
    _check_space(path, need, keep, kept)
    os.makedirs(os.path.join(tmp, "arrays"))
  barrier(f"ckpt-mkdir:{path}")
  try:
    _serialize(leaves, [_spec(tmp, i) for i in range(len(leaves))])
    barrier(f"ckpt-written:{path}")
    _commit(path, names, leaves, meta)
  except Exception as e:
    if not is_no_space(e):
      raise
    if jax.process_index() == 0:
      shutil.rmtree(tmp, ignore_errors=True)
    raise DiskFull(f"{path}: out of disk space while writing the checkpoint ({need:,} bytes "
                   f"needed; removed the partial {os.path.basename(tmp)}); free space and "
                   f"rerun to resume") from None
  return path


def _commit(path: str, names: list[str], leaves: list, meta: dict) -> None:
  """meta.json, then the manifest (each array's files with checksums), then the flip."""
  tmp = path + ".tmp"
  if jax.process_index() == 0:
    meta_path = os.path.join(tmp, META)
    _write_json(meta_path, meta)
    table = []
    for i, (n, x) in enumerate(zip(names, leaves)):
      root = os.path.join(tmp, "arrays", f"{i:05d}")
      files = {}
      for d, _, fs in os.walk(root):
        for name in fs:
          f = os.path.join(d, name)
          files[os.path.relpath(f, tmp)] = [os.path.getsize(f), _sha256(f)]
      table.append({"path": n, "shape": list(x.shape), "dtype": str(x.dtype),
                    "files": dict(sorted(files.items()))})
    _write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT, "meta_sha256": _sha256(meta_path),
                                              "leaves": table})
    _fsync_dir(tmp)
    _flip(tmp, path)
  barrier(f"ckpt-committed:{path}")


def load(path: str, like, prefix: str = "") -> tuple[Any, dict]:
  """Reads a checkpoint into the structure and shardings of `like` (arrays or
  ShapeDtypeStructs with .sharding), after `verify`. With `prefix`, the checkpoint's leaves whose
  path starts with it are matched against `like` (e.g. prefix=".params" reads a TrainState's
  params alone)."""
  meta = verify(path)
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
    specs.append(_spec(path, i, read=True))
    shardings.append(t.sharding)
    shapes.append(tuple(t.shape))
    dtypes.append(t.dtype)
  try:
    arrays = serialization.run_deserialization(shardings, specs, shapes, dtypes)
  except Exception as e:  # verified files that still fail to read: damaged all the same
    raise Damaged(f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0]})") from None
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
                     "mlp_dim", "tie_embeddings", "n_experts", "experts_per_token",
                     "router_norm_topk", "qk_norm", "qk_norm_full") and saved.get(k, v) != v}
    if diff:
      raise CheckpointError(f"{path}: model shape differs from the run's config "
                            f"(field: (checkpoint, run)): {diff}")
  specs = transformer.param_specs(model_cfg)
  like = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      transformer.abstract(specs), transformer.shardings(specs, mesh))
  if meta.get("kind") == "params":
    return load(path, like)[0]
  if _full_weights(meta):
    return load(path, like, prefix=meta.get("params_prefix", ".params"))[0]
  raise CheckpointError(f"{path}: {_no_weights(meta)}")


def _full_weights(meta: dict) -> bool:
  """Whether a checkpoint holds a whole model: a params export, or a LoRA-off training state."""
  return meta.get("kind") == "params" or (meta.get("kind") == "state" and not meta.get("lora"))


def _no_weights(meta: dict) -> str:
  return (f"kind {meta.get('kind')!r} (lora={meta.get('lora')}) holds no full model weights; "
          f"give the exported policy (checkpoints/policy) or the SFT model "
          f"(checkpoints/sft_model)")


def check_model_source(flag: str, source: str) -> None:
  """Refuses, before any work, a model source (`--init_from`) that cannot give full weights: a
  missing path, a checkpoint without them (a LoRA training state), a Hugging Face folder (`hf:`)
  without config.json or that this process may not read (`Unreadable`). One CheckpointError
  line naming `--flag=source` and the file."""
  kind, _, folder = source.partition(":")
  if kind == "hf":
    config = os.path.join(folder, "config.json")
    try:
      has_config = is_file(config, folder)
    except Unreadable as e:
      raise Unreadable(f"--{flag}={source}: {str(e).removeprefix(folder + ': ')}") from None
    if not os.path.isdir(folder):
      why = f"{folder} is not a folder" if os.path.lexists(folder) else f"no such folder {folder}"
    elif not has_config:
      why = f"{config} is missing (a Hugging Face model folder holds config.json and *.safetensors)"
    else:
      return
  else:
    try:
      meta = read_meta(source)
    except CheckpointError as e:
      raise CheckpointError(f"--{flag}={source}: {str(e).removeprefix(source + ': ')}") from None
    if _full_weights(meta):
      return
    why = _no_weights(meta)
  raise CheckpointError(f"--{flag}={source}: {why}")


# --- a directory of step checkpoints --------------------------------------------------------------

def source_change(old, new: dict) -> str:
  """How the library source `new` ({file: digest}) differs from `old`, the one a checkpoint
  recorded: "changed a.py; added b.py; removed c.py", or "" when they are the same."""
  if old == new:
    return ""
  if not isinstance(old, dict):  # written before the source was hashed file by file
    return "files not recorded"
  changed = sorted(f for f in set(old) & set(new) if old[f] != new[f])
  return "; ".join(f"{what} {', '.join(files)}" for what, files in (
      ("changed", changed), ("added", sorted(set(new) - set(old))),
      ("removed", sorted(set(old) - set(new)))) if files)



class Manager:
  """Step checkpoints of one stage under `directory`, newest `keep` retained.

  `identity` ({meta key: value}: the run's fingerprint) is written into every checkpoint and
  checked on restore: a rerun with other settings is refused, naming each value that differs,
  never resumed. `info` is written too but not compared (e.g. the reference's path: the content
  is in the fingerprint, and a moved output directory still resumes). Collective (every process
  constructs it).
  """

  def __init__(self, directory: str, keep: int, identity: dict | None = None,
               info: dict | None = None):
    if keep < 1:
      raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
    self.directory, self.keep = os.path.abspath(directory), keep
    self.identity = json.loads(json.dumps(identity or {}))  # as meta.json reads back
    self.info = dict(info or {})
    if jax.process_index() == 0 and os.path.isdir(self.directory):
      for name in listdir(self.directory):
        m = re.match(r"^(step_\d{8})(\.tmp|\.old|\.deleted)?$", name)
        if m:
          recover(os.path.join(self.directory, m.group(1)))
    barrier(f"ckpt-recovered:{self.directory}")

  def path(self, step: int) -> str:
    return os.path.join(self.directory, f"step_{step:08d}")

  def _dirs(self) -> list[int]:
    """Steps with a step_N directory, complete or not."""
    if not os.path.isdir(self.directory):
      return []
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, listdir(self.directory)) if m)

  def steps(self) -> list[int]:
    """Committed steps (manifest present; `restore_latest` verifies their contents)."""
    return [s for s in self._dirs() if is_complete(self.path(s))]

  def latest(self, before: int | None = None) -> int | None:
    """Newest committed step (strictly below `before` if given)."""
    s = [x for x in self.steps() if before is None or x < before]
    return s[-1] if s else None

  def save(self, step: int, state, meta: dict) -> str:
    out = save(self.path(step), state, {"kind": "state", "step": step, **meta, **self.info,
                                        **self.identity}, self.keep, len(self.steps()))
    if jax.process_index() == 0:
      for old in self.steps()[:-self.keep]:
        _remove(self.path(old))
    barrier(f"ckpt-pruned:{out}")
    return out

  @staticmethod
  def check_identity_of(path: str, meta: dict, identity: dict) -> None:
    """Raises CheckpointError naming every value of `identity` (nested one level, as the
    fingerprint is) that differs in `meta`, with the checkpoint's and this run's value. The
    library's source (`SOURCE`) is not compared here: `identity.check_source` refuses (or, with
    --resume_changed_code, logs) a change there once for the run, before any work."""
    pairs = []  # (field, checkpoint's value, this run's value)
    for k, v in identity.items():
      old = meta.get(k)
      if isinstance(v, dict) and isinstance(old, dict):
        pairs += [(f, old.get(f, "(absent)"), v.get(f, "(absent)"))
                  for f in sorted(set(v) | set(old))]
      else:
        pairs.append((k, old, v))
    diff = []
    for field, old, new in pairs:
      if field != SOURCE and old != new:
        diff.append(f"{field}: {old!r} -> {new!r}")
    if diff:
      raise CheckpointError(f"{path} was written by a different run, refusing to resume it "
                            f"(checkpoint -> this run: {'; '.join(diff)}); rerun with the "
                            f"original settings or use a fresh --output_dir")

  def check_identity(self, path: str, meta: dict) -> None:
    self.check_identity_of(path, meta, self.identity)

  def restore(self, step: int, like) -> tuple[Any, dict]:
    path = self.path(step)
    self.check_identity(path, read_meta(path))
    return load(path, like)

  def restore_latest(self, like, before: int | None = None) -> tuple[int | None, Any, dict]:
    """(step, state, meta) of the newest intact step (below `before`), or (None, None, {}).
    `like` is the template, or a function of the checkpoint's meta that returns it.

    A damaged step (files that fail the manifest, a directory without one) is moved aside to
    `<dir>.damaged` with one warning naming it and the damage; the next older step is tried.
    A step of another run (identity) is refused, not skipped; so is one this process may not
    read (`Unreadable`, left in place).
    """
    for step in reversed(self._dirs()):
      if before is not None and step >= before:
        continue
      path = self.path(step)
      try:
        meta = verify(path)
        self.check_identity(path, meta)
        state, meta = load(path, like(meta) if callable(like) else like)
        return step, state, meta
      except Damaged as e:
        older = [s for s in self.steps() if s < step]
        logging.warning("checkpoint %s is damaged (%s); moved to %s.damaged and falling back "
                        "to %s", path, str(e).removeprefix(path + ": "), os.path.basename(path),
                        f"step {older[-1]}" if older else "the stage's fresh start")
        move_aside(path)
    return None, None, {}

  def delete_from(self, step: int) -> list[int]:
    """Removes checkpoints at `step` and later (states after a KL spike), newest first; returns
    their steps."""
    gone = [s for s in self._dirs() if s >= step]
    if jax.process_index() == 0:
      for s in reversed(gone):
        _remove(self.path(s))
    barrier(f"ckpt-deleted:{self.directory}:{step}")
    return gone


def move_aside(path: str) -> None:
  """Renames a damaged checkpoint to `<path>.damaged` (kept for inspection, never read). Collective."""
  barrier(f"ckpt-damaged:{path}")
  if jax.process_index() == 0:
    aside = path + ".damaged"
    _check_removable(aside)
    _discard(aside)
    os.rename(path, aside)
    _fsync_dir(os.path.dirname(path))
  barrier(f"ckpt-moved:{path}")


def like_of(tree) -> Any:
  """ShapeDtypeStruct template (with shardings) of a live pytree of arrays."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

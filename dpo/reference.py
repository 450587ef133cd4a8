"""Reference-model handling: a separate reference model, precomputed reference log-probs and
TR-DPO reference updates.

A separate reference (`--ref_init_from`, as TRL's `ref_model`): `load` reads hf:DIR or a dpo-jax
params checkpoint into the policy's shardings; it must have the policy's architecture (the step
runs one model config). The DPO stage quantizes it with `--base_quant` like the base.

Precomputation (`--precompute_ref`): the reference never changes during plain DPO, so its
log-probs of every training pair are computed once, stored under a key that fingerprints the
pair arrays, the tokenizer, the model config and the reference weights, and fed to `dpo_step`
with each batch (which then runs no reference forward). A cache whose key does not match is
never read: the key is the file name and is checked again inside the file.

TR-DPO (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment", sec. 3):
every k steps the reference becomes alpha * policy + (1 - alpha) * reference (soft) or the policy
(hard), a mix of the weights. With LoRA the reference is base + a frozen adapter and the mix is
of the adapter products, kept exactly by stacking: alpha * A_p B_p + (1 - alpha) * A_r B_r =
[A_p, A_r] [alpha B_p; (1 - alpha) B_r], so each soft update adds the policy's rank to the
reference adapter (a hard update resets it to the policy's). The reference is checkpointed
(hooks.UpdateReference), so resume and rollback restore it exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding, PartitionSpec as P

from dpo import checkpoint, train
from dpo.batches import PairBatch, Rows
from models import sharding

CACHE_VERSION = 1
_REF_KEYS = ("ref_logps", "ref_shared_logps")


def fingerprint(spec: train.StepConfig, arrays: dict, tok, frozen: train.Frozen) -> str:
  """sha256 over the pair arrays, the tokenizer, the model config and the reference weights."""
  h = hashlib.sha256()
  h.update(f"v{CACHE_VERSION}".encode())
  for k in sorted(arrays):
    if k in _REF_KEYS:
      continue
    a = np.ascontiguousarray(arrays[k])
    h.update(f"{k}:{a.dtype}:{a.shape}".encode())
    h.update(a.tobytes())
  h.update(f"tokenizer:{type(tok).__module__}.{type(tok).__name__}:{tok.vocab_size}".encode())
  for attr in ("pad_id", "bos_id", "eos_id"):
    h.update(f"{attr}={getattr(tok, attr, None)}".encode())
  h.update(repr(spec.model).encode())
  h.update(f"lora_scale={spec.lora.scale if frozen.ref_lora is not None else 1.0}".encode())
  ref = ((frozen.params, frozen.ref_lora) if frozen.ref_params is None
         else (frozen.ref_params, None))  # only the reference's weights decide its log-probs
  for path, leaf in jax.tree_util.tree_leaves_with_path(ref):
    a = sharding.to_host(leaf)
    h.update(f"{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape}".encode())
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _jitted_reference(spec: train.StepConfig, mesh):
  """The reference half of the DPO step (`train.reference_stats`), on the step's mesh; outputs
  replicated so that every process reads all rows."""
  def ref(frozen, batch):
    stats = train.reference_stats(spec, frozen, batch)
    return stats.logps, stats.shared_logps
  return jax.jit(train.with_mesh(mesh, ref), out_shardings=NamedSharding(mesh, P()))


def compute(spec: train.StepConfig, mesh, frozen: train.Frozen, arrays: dict,
            batch_size: int) -> dict[str, np.ndarray]:
  """{ref_logps, ref_shared_logps}: [N, 2] float32 reference statistics of every pair."""
  n = len(arrays["tokens"])
  rows = Rows.of(arrays)
  fn = _jitted_reference(spec, mesh)
  out = {k: [] for k in _REF_KEYS}
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size) % n  # the last batch wraps; extra rows dropped
    batch = train.device_batch(mesh, PairBatch(jax.tree.map(lambda v: v[idx], rows)), batch_size)
    lps, shared = jax.device_get(fn(frozen, batch))
    keep = min(batch_size, n - start)
    out["ref_logps"].append(lps[:keep])
    out["ref_shared_logps"].append(shared[:keep])
  return {k: np.concatenate(v).astype(np.float32) for k, v in out.items()}


class Cache(NamedTuple):
  """Where precomputed reference statistics are stored (`directory`), and the tokenizer their
  key fingerprints beside the pairs, the model config and the reference weights."""
  directory: str
  tok: Any


def cached(spec: train.StepConfig, mesh, frozen: train.Frozen, arrays: dict, cache: Cache,
           batch_size: int) -> tuple[dict[str, np.ndarray], dict]:
  """Loads the reference statistics for `arrays` from the cache, or computes and stores them.

  Returns (arrays {ref_logps, ref_shared_logps}, info {path, hit, fingerprint, seconds}).
  """
  t0 = time.perf_counter()
  key = fingerprint(spec, arrays, cache.tok, frozen)
  cache_dir = cache.directory
  path = os.path.join(cache_dir, f"ref_logps-{key[:32]}.npz")
  n = len(arrays["tokens"])
  if os.path.exists(path):
    with np.load(path) as f:
      stored_key = str(f["fingerprint"])
      if stored_key != key:
        raise ValueError(f"{path}: fingerprint field {stored_key[:16]}... does not match the "
                         f"data/tokenizer/reference ({key[:16]}...); delete the file")
      result = {k: f[k] for k in _REF_KEYS}
    if result["ref_logps"].shape != (n, 2):
      raise ValueError(f"{path}: field ref_logps has shape {result['ref_logps'].shape}, "
                       f"expected ({n}, 2)")
    hit = True
  else:
    result = compute(spec, mesh, frozen, arrays, batch_size)
    hit = False
    if jax.process_index() == 0:
      os.makedirs(cache_dir, exist_ok=True)
      tmp = path + ".tmp.npz"
      np.savez(tmp, fingerprint=np.asarray(key), **result)
      os.replace(tmp, path)  # write, then rename: a reader never sees a partial cache
  info = {"path": path, "hit": hit, "fingerprint": key,
          "seconds": round(time.perf_counter() - t0, 2)}
  logging.info("reference log-probs: %s %s (%.1fs)", "loaded" if hit else "computed", path,
               info["seconds"])
  return result, info


def load(cfg, mesh):
  """The --ref_init_from model's params, each array born in the policy's sharding."""
  src = cfg.reference.ref_init_from
  kind, _, path = src.partition(":")
  if kind != "hf":
    logging.info("reference: loading checkpoint %s", src)
    return checkpoint.load_params(src, cfg.model, mesh)
  from models import hf  # optional-format code stays out of the default path
  model_cfg, params = hf.load(path, mesh, cfg.model)
  diff = {f.name: (getattr(model_cfg, f.name), getattr(cfg.model, f.name))
          for f in dataclasses.fields(model_cfg)
          if getattr(model_cfg, f.name) != getattr(cfg.model, f.name)}
  if diff:
    raise checkpoint.CheckpointError(
        f"--ref_init_from={src}: its config.json describes another architecture than the "
        f"policy's (field: (reference, policy)): {diff}; the reference must share the policy's "
        "architecture and vocabulary")
  logging.info("reference: imported %s (%s)", model_cfg.arch, src)
  return params


# --- TR-DPO ---------------------------------------------------------------------------------------

@jax.jit
def _mix(alpha, new, old):
  # alpha is traced, so alpha = 1 (hard update) still yields fresh buffers, never aliases of the
  # policy's (which the next step donates).
  return jax.tree.map(lambda n, o: (alpha * n + (1 - alpha) * o).astype(o.dtype), new, old)


@jax.jit
def _stack(alpha, new, old):
  """LoRA adapters whose product is alpha * new's + (1 - alpha) * old's: A [L, *in, R] side by
  side, B [L, R, *out] stacked and weighted (the rank axis is A's last and B's second)."""
  def one(n, o):
    return {"a": jnp.concatenate([n["a"], o["a"]], axis=-1),
            "b": jnp.concatenate([alpha * n["b"], (1 - alpha) * o["b"]], axis=1).astype(o["b"].dtype)}
  return jax.tree.map(one, new, old, is_leaf=lambda x: isinstance(x, dict) and "a" in x)


def maybe_update(cfg, step: int, state: train.TrainState, frozen: train.Frozen) -> train.Frozen:
  """TR-DPO: after every ref_update_every-th step, mix the policy into the reference.
  `cfg` is the ReferenceConfig; with LoRA (frozen.ref_lora set) the adapter products are mixed."""
  if cfg.ref_update == "none" or step % cfg.ref_update_every:
    return frozen
  hard = cfg.ref_update == "hard"
  alpha = jnp.float32(1.0 if hard else cfg.ref_update_alpha)
  if frozen.ref_lora is not None:
    if hard:  # a copy of the policy's factors (alpha = 1 in _mix: fresh buffers, not aliases)
      return frozen._replace(ref_lora=_mix(alpha, state.params, state.params))
    return frozen._replace(ref_lora=_stack(alpha, state.params, frozen.ref_lora))
  return frozen._replace(params=_mix(alpha, state.params, frozen.params))

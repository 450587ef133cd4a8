"""Mesh construction and the one logical-axis -> mesh-axis rules table.

Model code names array axes logically ("embed", "heads", "batch", ...). `RULES` maps each
logical axis to the mesh axes it is split over. Changing the parallelism strategy is changing
this table. A mesh axis is used at most once per array (checked), and an array dimension that
a mesh axis does not divide stays replicated on that axis rather than failing at run time.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (tuple, possibly empty).
#   data:   pure data parallelism. Weights replicated; the batch is split; gradients all-reduced.
#   fsdp:   data parallelism that also splits every weight (and its optimizer moments and LoRA
#           factors) along the embed dimension; XLA all-gathers a layer's weights just before use
#           and reduce-scatters its gradients.
#   tensor: Megatron-style tensor parallelism. Heads, kv heads, the MLP hidden dimension and the
#           vocabulary are split, so q/k/v/gate/up are column-parallel and o/down row-parallel.
# Weight axes and activation axes have separate names ("embed" vs "act_embed") because the two
# are split differently: weights split their embed dimension over fsdp, while activations are
# already split over fsdp along the batch and keep the residual stream whole on each device.
RULES: dict[str, tuple[str, ...]] = {
    # weights
    "layers": (),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": (),  # a mixture's experts (models/moe.py): whole on every device
    "lora_rank": (),
    "norm": (),
    "qblocks": ("fsdp",),  # NF4 blocks of a quantized matrix (models/quant.py)
    # activations and inputs
    "batch": ("data", "fsdp"),
    "pair": (),
    "seq": (),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
}


def parse_mesh_spec(spec: str, n_devices: int) -> dict[str, int]:
  """Parses 'data:2,fsdp:2,tensor:2' (one size may be -1) into sizes for all MESH_AXES.

  Axes left out have size 1. The product of the sizes must equal `n_devices`.
  """
  sizes = {a: 1 for a in MESH_AXES}
  seen = set()
  if not spec.strip():
    raise ValueError(f"--mesh is empty; give e.g. data:-1 or data:2,fsdp:2,tensor:2")
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, sep, value = part.partition(":")
    if not sep or name not in MESH_AXES or name in seen:
      raise ValueError(f"bad --mesh entry {part!r} in {spec!r}: expected AXIS:SIZE with AXIS in "
                       f"{MESH_AXES}, each at most once")
    seen.add(name)
    try:
      sizes[name] = int(value)
    except ValueError:
      raise ValueError(f"bad --mesh size {value!r} for axis {name!r}") from None
  wild = [a for a, s in sizes.items() if s == -1]
  if len(wild) > 1 or any(s == 0 or s < -1 for s in sizes.values()):
    raise ValueError(f"--mesh={spec!r}: sizes must be positive, with at most one -1")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if wild:
    if n_devices % fixed:
      raise ValueError(f"--mesh={spec!r}: fixed sizes (product {fixed}) do not divide the "
                       f"{n_devices} available devices")
    sizes[wild[0]] = n_devices // fixed
  if math.prod(sizes.values()) != n_devices:
    raise ValueError(f"--mesh={spec!r} needs {math.prod(sizes.values())} devices but "
                     f"{n_devices} are available")
  return sizes


def make_mesh(spec: str = "data:-1", devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over all devices of all processes (or the given ones).

  Devices are ordered by (process, id), so `tensor` (the innermost axis) stays inside a host
  where it can, and the batch axes (data, fsdp) run across hosts: each process then holds a
  contiguous block of the global batch (see `process_batch_block`).
  """
  devices = sorted(jax.devices() if devices is None else devices,
                   key=lambda d: (d.process_index, d.id))
  sizes = parse_mesh_spec(spec, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None, rules: dict = RULES) -> P:
  """PartitionSpec for an array with the given logical axes.

  With `shape` and `mesh`, mesh axes that do not divide the dimension are dropped, so a model
  whose head count is not a multiple of the tensor axis still runs (replicated on that axis).
  """
  used: set[str] = set()
  out = []
  for i, name in enumerate(axes):
    mesh_axes = [] if name is None else list(rules[name])
    kept = []
    for m in mesh_axes:
      if m in used:
        raise ValueError(f"mesh axis {m!r} used twice in logical axes {tuple(axes)}")
      size = 1 if mesh is None else mesh.shape[m]
      if shape is not None and mesh is not None:
        current = math.prod(mesh.shape[k] for k in kept)
        if shape[i] % (current * size):
          continue
      kept.append(m)
      used.add(m)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*out)


def named(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Activation sharding constraint by logical axes.

  Takes effect while tracing under `jax.set_mesh(mesh)` (the jitted steps in dpo/train.py and
  dpo/evaluate.py trace that way); outside a mesh context it is the identity, so the model also
  runs unsharded (tests, single-device scripts).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))


def ways(logical: str) -> int:
  """How many ways the current mesh (`jax.set_mesh`) splits a dimension of logical axis
  `logical`; 1 outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return 1
  return math.prod(mesh.shape[m] for m in RULES[logical] if m in mesh.shape)


def placed_bytes(tree) -> int:
  """Bytes one device holds of a pytree of placed arrays: each array's first addressable shard
  (with this module's shardings every device holds equally sized shards)."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def shard_bytes(abstract_tree, sharding_tree) -> int:
  """Bytes one device holds of a pytree of arrays / ShapeDtypeStructs under the given shardings.

  With the shardings of this module every device holds equally sized shards, so this is the
  per-device figure (not an average).
  """
  leaves = jax.tree.leaves(abstract_tree)
  shards = jax.tree.leaves(sharding_tree, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
  if len(leaves) != len(shards):
    raise ValueError(f"{len(leaves)} arrays but {len(shards)} shardings")
  return sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
             for x, s in zip(leaves, shards))


def batch_shards(mesh: Mesh) -> int:
  """How many ways the batch is split: the product of the mesh sizes "batch" maps to."""
  return math.prod(mesh.shape[m] for m in RULES["batch"])


def to_host(x) -> np.ndarray:
  """A global array's value as numpy on this host (gathered across processes when it is not
  fully addressable, which every process must then call together)."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def process_batch_block(mesh: Mesh, global_batch: int) -> tuple[int, int]:
  """(block index, block count): which contiguous block of the global batch this process loads.

  The batch is split over (data, fsdp). A process loads exactly the rows its own devices hold;
  processes whose devices hold the same rows (e.g. when `tensor` spans hosts) load the same block.
  """
  sh = NamedSharding(mesh, P(RULES["batch"]))
  rows: set[int] = set()
  for d, index in sh.devices_indices_map((global_batch,)).items():
    if d.process_index == jax.process_index():
      rows.update(range(*index[0].indices(global_batch)))
  start, size = min(rows), len(rows)
  if rows != set(range(start, start + size)) or start % size or global_batch % size:
    raise ValueError(f"mesh {dict(mesh.shape)} gives process {jax.process_index()} batch rows "
                     f"{sorted(rows)}, not one aligned contiguous block; put the axes that span "
                     "hosts first (data, fsdp)")
  return start // size, global_batch // size


def replicated_axes(specs, mesh: Mesh) -> dict[str, str]:
  """{param path: 'logical->mesh axes dropped'} for rules the mesh cannot apply (size mismatch).

  `specs` is a pytree of objects with `.shape` and `.axes` (models/transformer.ParamSpec).
  """
  out = {}
  leaves = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda s: hasattr(s, "axes"))
  for path, s in leaves:
    full = logical_to_spec(s.axes)
    kept = logical_to_spec(s.axes, s.shape, mesh)
    dropped = []
    for name, want, got in zip(s.axes, full, kept):
      want = () if want is None else (want,) if isinstance(want, str) else want
      got = () if got is None else (got,) if isinstance(got, str) else got
      lost = [m for m in want if m not in got and mesh.shape[m] > 1]
      if lost:
        dropped.append(f"{name}->{'+'.join(lost)}")
    if dropped:
      out[jax.tree_util.keystr(path)] = ",".join(dropped)
  return out

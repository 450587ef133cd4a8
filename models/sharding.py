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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (tuple, possibly empty). FSDP shards the embed dimension of every
# weight; tensor parallelism shards heads, kv heads, the MLP hidden dimension and the vocabulary.
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "pair": (),
    "seq": (),
    "layers": (),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "lora_rank": (),
    "norm": (),
    "qblocks": ("fsdp",),  # NF4 blocks of a quantized matrix (models/quant.py)
}


def parse_mesh_spec(spec: str, n_devices: int) -> dict[str, int]:
  """Parses 'data:2,fsdp:2,tensor:2' (one size may be -1) into sizes for all MESH_AXES."""
  sizes = {a: 1 for a in MESH_AXES}
  seen = set()
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
  devices = list(jax.devices() if devices is None else devices)
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
  """Activation sharding constraint by logical axes; a no-op outside a mesh context."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))

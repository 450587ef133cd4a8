"""Multi-process start-up on JAX's own distributed runtime (no launcher protocol of our own).

One process runs per host (per GPU node, per TPU VM). Every process runs the same program: the
same jitted calls in the same order, each feeding only its block of the global batch.
`initialize` must run before anything touches a JAX device.

Failure handling is JAX's coordination service: each process sends heartbeats to the
coordinator (process 0); when one stops (crash, kill, lost host), the survivors are shut down
with an error naming the missing task instead of hanging in the next collective. How fast that
happens is `heartbeat_timeout_seconds`.
"""

from __future__ import annotations

import logging
import os

import jax

MODES = ("off", "auto", "explicit")


def initialize(mode: str, coordinator_address: str = "", num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_seconds: int = 100,
               initialization_timeout: int = 300) -> None:
  """Starts the JAX distributed runtime.

  mode "off": single process (the explicit flags must then be unset).
  mode "auto": `jax.distributed.initialize()` detects the cluster (TPU pod slice, SLURM, Open MPI,
    Kubernetes jobs that set the JAX environment).
  mode "explicit": coordinator address, process count and this process's id are all given.
  On CPU, cross-process collectives go through gloo.
  """
  if mode not in MODES:
    raise ValueError(f"--distributed must be one of {MODES}, got {mode!r}")
  explicit = [coordinator_address, num_processes, process_id]
  if mode == "off":
    if any(v not in (None, "") for v in explicit):
      raise ValueError("--coordinator_address/--num_processes/--process_id given but "
                       "--distributed=off; use --distributed=explicit")
    return
  if mode == "explicit":
    if not coordinator_address or num_processes is None or process_id is None:
      raise ValueError("--distributed=explicit needs --coordinator_address=HOST:PORT, "
                       "--num_processes and --process_id")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id={process_id} must be in [0, --num_processes="
                       f"{num_processes})")
  # gloo is the CPU collectives backend; the setting is ignored by GPU and TPU clients.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = dict(initialization_timeout=initialization_timeout,
                heartbeat_timeout_seconds=heartbeat_timeout_seconds)
  if mode == "explicit":
    kwargs.update(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id)
  jax.distributed.initialize(**kwargs)
  logging.info("distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())

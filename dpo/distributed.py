"""Multi-process start-up on JAX's own distributed runtime (no launcher protocol of our own).

One process runs per host (per GPU node, per TPU VM). Every process runs the same program: the
same jitted calls in the same order, each feeding only its block of the global batch.
`initialize` must run before anything touches a JAX device.

Failure handling is JAX's coordination service: each process sends heartbeats to the
coordinator (process 0); when one stops (crash, kill, lost host), the coordination service
tells the survivors within `heartbeat_timeout_seconds`. JAX's default answer is to abort the
process (SIGABRT, a C++ stack dump); here each survivor instead prints one line naming what
was lost and exits with status `PEER_LOST_EXIT` (no checkpoint is half-committed by it: a
checkpoint becomes visible only by its final rename). A collective that fails first (gloo sees
the closed connection) is answered the same way (`exit_if_peer_lost`). Rerunning every process
resumes from the newest checkpoint.
"""

from __future__ import annotations

import logging
import os
import sys

import jax

MODES = ("off", "auto", "explicit")
PEER_LOST_EXIT = 4  # the exit status of a process whose peer died


def _peer_lost(*status) -> None:
  """Called by the coordination client (on its own thread) when a peer or the coordinator stops
  answering: one line, then exit at once (the main thread may be blocked in a collective)."""
  why = " ".join(str(s) for s in status).strip().splitlines()
  print(f"error: process {jax.process_index()}: lost contact with the other processes "
        f"({why[0] if why else 'missed heartbeats'}); exiting with status {PEER_LOST_EXIT}. "
        f"Rerun every process to resume from the newest checkpoint.", file=sys.stderr, flush=True)
  os._exit(PEER_LOST_EXIT)


def exit_if_peer_lost(error: BaseException) -> None:
  """A failed collective in a multi-process run (a peer died mid-step): exit as `_peer_lost`."""
  if jax.process_count() > 1 and type(error).__name__ in ("XlaRuntimeError", "JaxRuntimeError"):
    _peer_lost(str(error))


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
  from jax._src import distributed as jax_distributed  # to pass the client a failure callback
  client = jax_distributed._jax.get_distributed_runtime_client

  def client_with_callback(*args, **kw):
    return client(*args, missed_heartbeat_callback=_peer_lost, **kw)

  jax_distributed._jax.get_distributed_runtime_client = client_with_callback
  try:
    jax.distributed.initialize(**kwargs)
  finally:
    jax_distributed._jax.get_distributed_runtime_client = client
  logging.info("distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())

"""Multi-process start-up on JAX's own distributed runtime (no launcher protocol of our own).

One process runs per host (per GPU node, per TPU VM). Every process runs the same program: the
same jitted calls in the same order, each feeding only its block of the global batch.
`initialize` must run before anything touches a JAX device.

Failure handling is JAX's coordination service: each process sends heartbeats to the
coordinator (process 0); one that stops (crash, kill, hung or lost host) is declared dead after
`heartbeat_timeout_seconds`, and JAX's answer is to abort every other process (SIGABRT, a C++
stack dump). Before that happens, a watchdog thread of ours (a beat counter per process in the
coordination service's key-value store) notices a peer silent for half the timeout, or a
coordinator that no longer answers, and each survivor prints one line naming what was lost and
exits with status `PEER_LOST_EXIT`. A collective that fails first (gloo sees the closed
connection of a killed peer) is answered the same way (`exit_if_peer_lost`, from launch.py).
No checkpoint is half-committed by such an exit (one becomes visible only by its final rename),
so rerunning every process resumes from the newest checkpoint.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import jax

MODES = ("off", "auto", "explicit")
PEER_LOST_EXIT = 4  # the exit status of a process whose peer died


def _peer_lost(why: str) -> None:
  """One line, then exit at once (the main thread may be blocked in a collective)."""
  why = why.strip().splitlines()
  print(f"error: process {jax.process_index()}: lost contact with the other processes "
        f"({why[0] if why else 'missed heartbeats'}); exiting with status {PEER_LOST_EXIT}. "
        f"Rerun every process to resume from the newest checkpoint.", file=sys.stderr, flush=True)
  os._exit(PEER_LOST_EXIT)


_FINISHED = threading.Event()


def _start_watchdog(timeout_s: float) -> None:
  """A daemon thread that keeps a beat counter of this process in the coordination service's
  key-value store and reads everyone's: a peer whose counter has not moved for half the
  heartbeat timeout (before JAX's own detector would abort this process), or a coordinator
  that no longer answers, ends this process with `_peer_lost`. Peers that finished (`finished`)
  are left alone."""
  from jax._src import distributed as jax_distributed
  client, me, n = jax_distributed.global_state.client, jax.process_index(), jax.process_count()
  every, stale = max(timeout_s / 8, 0.25), timeout_s / 2

  def watch():
    beat, seen = 0, {p: (None, time.monotonic()) for p in range(n) if p != me}
    while not _FINISHED.wait(every):
      beat += 1
      try:
        client.key_value_set(f"dpo_alive/{me}", str(beat), allow_overwrite=True)
        alive = dict(client.key_value_dir_get("dpo_alive/"))
        done = {k.rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get("dpo_done/")}
      except Exception as e:  # the coordinator (process 0) is gone
        if _FINISHED.is_set():
          return
        _peer_lost(f"the coordinator does not answer: {str(e).splitlines()[0] if str(e) else e}")
      now = time.monotonic()
      for p, (value, since) in list(seen.items()):
        if str(p) in done:
          del seen[p]
          continue
        current = alive.get(f"dpo_alive/{p}", alive.get(f"/dpo_alive/{p}"))
        if current != value:
          seen[p] = (current, now)
        elif now - since > stale:
          _peer_lost(f"process {p} has not been heard from for {now - since:.0f} s")

  threading.Thread(target=watch, name="peer-watchdog", daemon=True).start()


def finished() -> None:
  """This process ended its run: peers stop watching it, and it stops watching them."""
  if jax.process_count() > 1 and not _FINISHED.is_set():
    from jax._src import distributed as jax_distributed
    jax_distributed.global_state.client.key_value_set(f"dpo_done/{jax.process_index()}", "1",
                                                      allow_overwrite=True)
    _FINISHED.set()


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
  jax.distributed.initialize(**kwargs)
  _start_watchdog(heartbeat_timeout_seconds)
  logging.info("distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())

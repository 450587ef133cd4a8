"""Multi-process start-up on JAX's own distributed runtime; what a survivor does when a peer dies.

One process runs per host (per GPU node, per TPU VM). Every process runs the same program: the
same jitted calls in the same order, each feeding only its block of the global batch.
`initialize` must run before anything touches a JAX device.

JAX's coordination service (in process 0) declares a process dead after
`heartbeat_timeout_seconds` without heartbeats, and its answer, like its client's answer to a
coordinator that is gone, is to abort every other process (SIGABRT, a C++ stack dump). Ours comes
first, in one line naming what was lost and exit status `PEER_LOST_EXIT`, from whichever of these
sees the loss first:
  * a link: one TCP connection between process 0 and each other process, read at both ends; a
    killed process's sockets are closed by the kernel, so a close without the peer's goodbye
    (`finished`) is its death, seen at once (`_link`);
  * a relay: processes other than 0 reach the coordination service through a local port of
    their own (`_relay`), so when process 0 dies the relay sees the closed connection and this
    process exits before JAX's client could see it and abort;
  * a watchdog: a beat counter per process in the service's key-value store; a peer silent for
    half the heartbeat timeout (a hung host, whose sockets stay open), or a coordinator that no
    longer answers (`_start_watchdog`);
  * a collective that fails (gloo sees the closed connection of a killed peer), from launch.py
    (`exit_if_peer_lost`).
No checkpoint is half-committed by such an exit (one becomes visible only by its final rename),
so rerunning every process resumes from the newest checkpoint.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time

import jax

MODES = ("off", "auto", "explicit")
PEER_LOST_EXIT = 4  # the exit status of a process whose peer died


_LOST = threading.Lock()  # the first thread to see a loss says so; any other waits for the exit


def _peer_lost(why: str) -> None:
  """One line, then exit at once (the main thread may be blocked in a collective)."""
  if not _LOST.acquire(blocking=False):
    threading.Event().wait()
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


_PORT_KEY = "dpo_watch/port"  # process 0's link port, in the key-value store
_GOODBYE = b"done\n"
_FAILED = b"failed\n"  # the peer is exiting on an error of its own (its log says which)
# A peer that stops on an error may be one of several stopping on the same error (a bad flag is
# every process's): it waits this long for its own exit before it says the peer stopped.
_OWN_EXIT_GRACE_S = 5.0
_LINKS: list[socket.socket] = []  # this process's links
_JOINED = threading.Event()  # every process is up: from now on a closed connection is a loss
_DONE: set[str] = set()  # peers that said goodbye (finished their run)
_STOPPED: set[str] = set()  # peers that said they stop on an error of their own
_READERS: list[threading.Thread] = []  # one per link; each ends when its peer is done or gone
_COORDINATOR = "process 0 (the coordinator)"


def _watch_link(conn: socket.socket, who: str) -> None:
  """A daemon thread reading `conn` until the peer says goodbye (it finished its run); a close
  without one is its death (the kernel closes a killed process's sockets): `_peer_lost` at once,
  without waiting for a heartbeat to go stale."""
  _LINKS.append(conn)

  def read():
    heard = b""
    try:
      while _GOODBYE not in heard and _FAILED not in heard:
        chunk = conn.recv(64)
        if not chunk:
          break
        heard += chunk
    except OSError:
      pass
    if _GOODBYE in heard:
      _DONE.add(who)
    elif _FAILED in heard:
      _STOPPED.add(who)
      if not _FINISHED.wait(_OWN_EXIT_GRACE_S):
        _peer_lost(f"{who} stopped with an error; its log says which")
    elif not _FINISHED.is_set():
      _peer_lost(f"{who} closed its connection: it exited or was killed")

  reader = threading.Thread(target=read, name=f"peer-link-{who}", daemon=True)
  _READERS.append(reader)
  reader.start()


def _link(client, coordinator_host: str, timeout_s: float) -> None:
  """One TCP connection between process 0 and each other process, watched at both ends
  (`_watch_link`). Process 0 listens on a free port, publishes it in the key-value store and
  waits for every peer; the others connect to it at the coordinator's host."""
  me, n = jax.process_index(), jax.process_count()
  if me == 0:
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    with socket.create_server(("", 0), family=family,
                              dualstack_ipv6=family == socket.AF_INET6) as server:
      client.key_value_set(_PORT_KEY, str(server.getsockname()[1]))
      server.settimeout(timeout_s)
      for _ in range(n - 1):
        conn, _ = server.accept()
        conn.settimeout(timeout_s)
        peer = b""
        while not peer.endswith(b"\n") and len(peer) < 32:  # the peer's id, one line
          peer += conn.recv(32 - len(peer)) or b"\n"
        conn.settimeout(None)
        _watch_link(conn, f"process {peer.decode().strip()}")
    return
  port = int(client.blocking_key_value_get(_PORT_KEY, int(timeout_s * 1000)))
  conn = socket.create_connection((coordinator_host, port), timeout=timeout_s)
  conn.sendall(f"{me}\n".encode())
  conn.settimeout(None)
  _watch_link(conn, _COORDINATOR)


def _pump(src: socket.socket, dst: socket.socket, from_service: bool,
          client_closed: threading.Event) -> None:
  """Copies `src` to `dst` until `src` closes. The service's side closing first while the run
  goes on is process 0's death: `_peer_lost` before the close reaches JAX's client. A close of
  this process's own client (its exit) is marked first, so it is never taken for one."""
  try:
    while data := src.recv(1 << 16):
      dst.sendall(data)
  except OSError:
    pass
  if not from_service:
    client_closed.set()
  elif (_JOINED.is_set() and not _FINISHED.is_set() and not client_closed.is_set()
        and _COORDINATOR not in _DONE):
    _peer_lost(f"{_COORDINATOR} stopped with an error; its log says which"
               if _COORDINATOR in _STOPPED else
               f"{_COORDINATOR} closed the coordination service's connection: it exited or "
               f"was killed")
  for sock in (src, dst):
    try:
      sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
  src.close()  # each pump closes the socket it reads; the other pump closes the other


def _relay(service: tuple[str, int]) -> str:
  """A local port (returned as HOST:PORT) that relays each connection made to it to the
  coordination service at `service`, for this process's JAX client (`_pump`). Until the service
  is up a connection is closed at once, and the client retries."""
  server = socket.create_server(("127.0.0.1", 0))

  def serve():
    while True:
      try:
        client, _ = server.accept()
      except OSError:  # a failed accept (e.g. out of file descriptors) ends no run: go on
        time.sleep(0.1)
        continue
      try:
        upstream = socket.create_connection(service, timeout=10)
        upstream.settimeout(None)
      except OSError:
        client.close()
        continue
      for sock in (client, upstream):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small RPCs, no batching
      closed = threading.Event()
      for src, dst, from_service in ((client, upstream, False), (upstream, client, True)):
        threading.Thread(target=_pump, args=(src, dst, from_service, closed),
                         name="service-relay", daemon=True).start()

  threading.Thread(target=serve, name="service-relay", daemon=True).start()
  return f"127.0.0.1:{server.getsockname()[1]}"


def _split_address(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def _cluster(initialization_timeout: int) -> dict:
  """--distributed=auto: the coordinator address, process count and id that
  `jax.distributed.initialize()` would detect (TPU pod slice, SLURM, Open MPI, ...), so that
  this process can reach the service through `_relay`; {} where nothing is detected (JAX's own
  initialize then says why)."""
  from jax._src import clusters
  address, n, pid, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
      os.environ.get("JAX_COORDINATOR_ADDRESS"), None, None, None, None, initialization_timeout)
  if None in (address, n, pid):
    return {}
  return dict(coordinator_address=address, num_processes=n, process_id=pid,
              local_device_ids=local)


def finished() -> None:
  """This process ended its run: peers stop watching it, and it stops watching them."""
  if jax.process_count() > 1 and not _FINISHED.is_set():
    from jax._src import distributed as jax_distributed
    jax_distributed.global_state.client.key_value_set(f"dpo_done/{jax.process_index()}", "1",
                                                      allow_overwrite=True)
    _tell_peers(_GOODBYE)


def _failed() -> None:
  """At exit without `finished` (an error of this process): peers stop watching it and are told
  it stopped on an error, so they neither take its exit for a death nor wait on it in a
  collective (`_watch_link`)."""
  if not _FINISHED.is_set():
    _tell_peers(_FAILED)


def _tell_peers(message: bytes) -> None:
  """This process stops watching its peers, and says why on each link."""
  _FINISHED.set()
  for conn in _LINKS:
    try:
      conn.sendall(message)
    except OSError:  # the peer has ended already
      pass


def exit_on_error(status: int) -> None:
  """Exit with `status` after an error of this process (its line is printed). With other
  processes: tell them (`_failed`), give those that stop on the same error the time to exit
  with their own status (this process keeps the coordination service up meanwhile), and exit
  without JAX's shutdown barrier, which would wait for processes that run on."""
  if not _JOINED.is_set():  # a single process (or none joined yet)
    raise SystemExit(status)
  _failed()
  deadline = time.monotonic() + _OWN_EXIT_GRACE_S + 5.0
  for reader in _READERS:
    reader.join(max(0.0, deadline - time.monotonic()))
  for stream in (sys.stdout, sys.stderr, *(h.stream for h in logging.getLogger().handlers
                                           if hasattr(h, "stream"))):
    stream.flush()
  os._exit(status)


def exit_if_peer_lost(error: BaseException) -> None:
  """A failed collective in a multi-process run (a peer died mid-step): exit as `_peer_lost`."""
  if jax.process_count() > 1 and type(error).__name__ in ("XlaRuntimeError", "JaxRuntimeError"):
    _peer_lost(str(error))


def initialize(mode: str, coordinator_address: str = "", num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_seconds: int = 100,
               initialization_timeout: int = 300) -> None:
  """Starts the JAX distributed runtime, and what watches the other processes (the module's
  docstring): the relay before, the watchdog and the links after every process has joined.

  mode "off": single process (the explicit flags must then be unset).
  mode "auto": the cluster is detected as `jax.distributed.initialize()` detects it (TPU pod
    slice, SLURM, Open MPI, Kubernetes jobs that set the JAX environment).
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
  else:
    kwargs.update(_cluster(initialization_timeout))
  service = kwargs.get("coordinator_address")
  if service and kwargs.get("process_id"):  # process 0 holds the service itself
    kwargs["coordinator_address"] = _relay(_split_address(service))
  jax.distributed.initialize(**kwargs)
  atexit.register(_failed)  # runs before JAX's own exit handler, registered earlier
  _JOINED.set()
  _start_watchdog(heartbeat_timeout_seconds)
  from jax._src import distributed as jax_distributed
  state = jax_distributed.global_state
  host = _split_address(service or state.coordinator_address)[0]
  try:
    _link(state.client, host, initialization_timeout)
  except OSError as e:
    raise ValueError(f"process {jax.process_index()} could not make its link with process 0 at "
                     f"{host} ({e}): every process must reach process 0's ports (WORKSPACE.md, "
                     f"Multi-host)") from None
  logging.info("distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())

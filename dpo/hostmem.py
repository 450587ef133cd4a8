"""Host memory: how the process's C heap serves XLA:CPU's buffers.

Two glibc behaviours cost a CPU step memory and time; this module changes both for our
processes (launch.py, the bench's workers):

* **The compiler's freed heap stays resident.** XLA compiles on several threads, and what it
  frees stays in glibc's heap; a freshly compiled step then runs with that garbage under its
  own buffers, and the process's peak RSS counts both. `trim_after_compiles` asks glibc to
  return free memory (`malloc_trim`) at the end of every backend compile (a `jax.monitoring`
  listener): about 250 MiB off bench-small's peak RSS.
* **Each step's temporaries are faulted in afresh, 4 KiB at a time.** XLA:CPU allocates a
  step's temporary buffers (hundreds of MiB) when the step runs and frees them when it ends;
  glibc serves allocations that large by mmap and unmaps them on free, so every step
  page-faults its temporaries in again (bench-small's LoRA step: 165k faults, 0.3 s of system
  time a step). With glibc's `glibc.malloc.hugetlb=1` tunable those mappings are madvised as
  transparent huge pages, 2 MiB a fault. A tunable is read when the process starts, so
  `reexec_with_huge_pages` starts the process again (same PID, same arguments) with it in
  `GLIBC_TUNABLES`, and `environment` gives a child process's environment with it. Keeping the
  freed memory mapped instead (glibc's `M_MMAP_MAX` 0) is faster still but fragments the heap:
  peak RSS grew by up to 1.9 GiB on bench-small (docs/benchmarks.md).
  One cost stays: a step touches each page of its temporaries first somewhere inside the step,
  and on a virtual machine whose kernel reports free memory to its host (virtio balloon free
  page reporting, in 2 MiB blocks), a huge page that sat freed for about a second or more comes
  back from the host, far slower than a 4 KiB fault (`python -m dpo.tools.refault`). On
  bench-small's 0.7 s steps huge pages still gain; a step that touches much of its temporaries
  late loses some of it (its full fine-tune on unshared rows, 2 s: 4% slower than 4 KiB pages),
  and now and then a whole process runs slow (docs/benchmarks.md).

Values are untouched. Where the C library is not glibc (macOS, musl), nothing changes and the
log says so; the tunable acts where the kernel's transparent huge pages are on `madvise` and
glibc is 2.35 or later (with `always` every mapping already has them; elsewhere it is inert).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

# The event jax records when a backend compile (or a persistent-cache load) finishes.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
HUGE_PAGES = "glibc.malloc.hugetlb=1"
_REEXEC_MARK = "DPO_JAX_REEXEC"  # set across the one re-exec, so it never loops
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"

_libc = None       # glibc's handle, once trimming
trims = 0          # compiles followed by a trim in this process (tests read it)


def _glibc():
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    return libc
  except (OSError, AttributeError):
    return None


def thp_mode() -> str | None:
  """The kernel's transparent huge page mode (always, madvise or never); None where it has none
  (not Linux, or a kernel without them)."""
  try:
    with open(THP_MODE) as f:
      return f.read().split("[")[1].split("]")[0]
  except (OSError, IndexError):
    return None


def _on_event(event: str, duration: float, **kwargs) -> None:
  del duration, kwargs
  global trims
  if event == COMPILE_EVENT:
    _libc.malloc_trim(0)
    trims += 1


def trim_after_compiles() -> bool:
  """Trim the C heap after every compile from now on, once per process. False (and a log line)
  where the C library is not glibc."""
  global _libc
  if _libc is not None:
    return True
  libc = _glibc()
  if libc is None:
    logging.info("hostmem: the C library is not glibc; the compiler's freed heap stays resident")
    return False
  import jax
  _libc = libc
  jax.monitoring.register_event_duration_secs_listener(_on_event)
  return True


def environment(env=None) -> dict[str, str]:
  """`env` (default os.environ) with `HUGE_PAGES` added to its GLIBC_TUNABLES, for a child."""
  env = dict(os.environ if env is None else env)
  tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
  if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
    env["GLIBC_TUNABLES"] = ":".join(tunables + [HUGE_PAGES])
  return env


def reexec_with_huge_pages() -> None:
  """Start this process again, with the command line it was started with, with `HUGE_PAGES` in
  GLIBC_TUNABLES, unless it is there (or the user set glibc.malloc.hugetlb otherwise), the C
  library is not glibc, or this process is the re-exec. Call it first thing in a `__main__`,
  before anything worth keeping is built."""
  if environment() == dict(os.environ) or os.environ.get(_REEXEC_MARK) or _glibc() is None:
    return
  env = {**environment(), _REEXEC_MARK: "1"}
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, env)

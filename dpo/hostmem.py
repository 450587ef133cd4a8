"""Host memory: hand the heap that XLA's compiler frees back to the operating system.

XLA:CPU compiles a step on several threads, and glibc keeps what each thread's malloc arena
frees for reuse instead of returning it. Without a trim, a freshly compiled step runs with that
freed-but-resident heap (about 200 MiB for bench-small's DPO step) under the temporaries its
first execution allocates, and the process's peak RSS counts both. `trim_after_compiles` asks
glibc to return it (`malloc_trim`) at the end of every backend compile, before the compiled
executable first runs. Values and speed are untouched; measurements in docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import jax

# The event jax records when a backend compile (or a persistent-cache load) finishes.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_trim = None       # libc's malloc_trim, once installed
trims = 0          # compiles followed by a trim in this process (tests read it)


def _on_event(event: str, duration: float, **kwargs) -> None:
  del duration, kwargs
  global trims
  if event == COMPILE_EVENT:
    _trim(0)
    trims += 1


def trim_after_compiles() -> bool:
  """Trim the C heap after every compile from now on, once per process. False (and a log line)
  where the C library has no `malloc_trim` (not glibc: macOS, musl), where nothing is trimmed."""
  global _trim
  if _trim is not None:
    return True
  try:
    trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
  except (OSError, AttributeError):
    logging.info("hostmem: this C library has no malloc_trim; the compiler's freed heap stays "
                 "resident")
    return False
  trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
  _trim = trim
  jax.monitoring.register_event_duration_secs_listener(_on_event)
  return True

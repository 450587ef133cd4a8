"""dpo/hostmem.py: the heap trimmed after each compile; a step's temporaries on huge pages
through glibc's tunable, set by re-executing the process. Each case runs in a process of its
own, since the heap settings are the whole process's."""

import json
import os
import subprocess
import sys

import pytest

from dpo import hostmem

_STEP = """
import json, os, resource, sys
from dpo import hostmem
hostmem.reexec_with_huge_pages() if sys.argv[1] == "reexec" else None
hostmem.trim_after_compiles()
import jax, jax.numpy as jnp, numpy as np
x = jax.device_put(np.ones((4096, 4096), np.float32))  # 64 MiB
f = jax.jit(lambda x: (jnp.sin(x) @ jnp.cos(x[:, :16])).sum())  # 64 MiB of temporaries
trims = hostmem.trims
f(x).block_until_ready()
compile_trims = hostmem.trims - trims
for _ in range(2):
  f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
  f(x).block_until_ready()
print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES", ""), "pid": os.getpid(),
                  "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4,
                  "compile_trims": compile_trims, "cached_trims": hostmem.trims - trims - compile_trims}))
"""


def _run(mode: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "DPO_JAX_REEXEC")}
  out = subprocess.run([sys.executable, "-c", _STEP, mode], capture_output=True, text=True,
                       check=True, env=env)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _tunable_decides() -> bool:
  """Whether glibc's tunable decides huge pages here: transparent huge pages on `madvise` (with
  `always` every mapping has them, with `never` none), glibc 2.35 or later (earlier ignores it)."""
  libc = hostmem._glibc()
  version = libc and tuple(int(x) for x in libc.gnu_get_libc_version().decode().split(".")[:2])
  return hostmem.thp_mode() == "madvise" and bool(version) and version >= (2, 35)


def test_tunable_joins_the_ones_given():
  assert hostmem.environment({})["GLIBC_TUNABLES"] == hostmem.HUGE_PAGES
  env = hostmem.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
  assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{hostmem.HUGE_PAGES}", "X": "1"}
  mine = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # the user's own choice stays
  assert hostmem.environment(mine) == mine


@pytest.mark.skipif(not _tunable_decides(), reason="glibc's huge-page tunable decides nothing "
                    "here (transparent huge pages not on madvise, or glibc before 2.35)")
def test_reexec_puts_the_step_on_huge_pages_and_compiles_are_trimmed():
  plain, again = _run("plain"), _run("reexec")
  assert plain["tunables"] == "" and again["tunables"] == hostmem.HUGE_PAGES
  # glibc's default maps the 64 MiB of temporaries afresh each call, 4 KiB a fault.
  assert plain["faults"] > 16_000, plain
  assert again["faults"] < plain["faults"] / 20, (again, plain)
  for r in (plain, again):
    assert r["compile_trims"] == 1 and r["cached_trims"] == 0, r  # one compile, one trim

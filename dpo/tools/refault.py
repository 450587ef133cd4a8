"""How fast this machine faults in memory that sat freed for a while, with huge pages and without.

    python -m dpo.tools.refault                    # 512 MiB, gaps of 0, 0.2, 1, 3 and 6 s
    python -m dpo.tools.refault --mib=64 --gaps=0,1 --repeats=2

XLA:CPU maps a step's temporary buffers when the step starts and unmaps them when it ends, and
the step touches each page first somewhere inside the step (dpo/hostmem.py). So every page of
a step's temporaries is faulted in again each step, from memory the kernel got back at most a
step earlier. On a virtual machine whose kernel hands free memory back to its host (virtio
balloon free page reporting: `/sys/module/page_reporting`, which reports free blocks of
2^page_reporting_order pages, 2 MiB at order 9), a block reported while it sat free must be
backed by the host again when next touched, far slower than a page the guest still holds.

This measures that directly: map `--mib` MiB of anonymous memory (madvised as transparent huge
pages, or not), touch every 4 KiB page, unmap it, wait the gap, and again, `--repeats` times
for each gap; it prints each touch's milliseconds and, where the kernel counts it
(`reported_kib`), how much memory it reported to the host meanwhile. Times that grow with the gap
on the huge-page rows, and not on the 4 KiB rows, are the host taking back freed huge pages:
steps that last longer than the gap lose time to it (docs/benchmarks.md).
"""

from __future__ import annotations

import mmap
import time

from absl import app, flags

MADV_HUGEPAGE = 14  # Linux's madvise advice
REPORTED = "/sys/module/page_reporting/parameters/reported_kib"
FLAGS = flags.FLAGS


def reported_kib() -> int | None:
  """KiB this kernel has reported free to its host so far; None where it does not count them."""
  try:
    with open(REPORTED) as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def touch_fresh(nbytes: int, huge: bool) -> float:
  """Seconds to first-touch every 4 KiB page of a fresh anonymous mapping of `nbytes`."""
  m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  try:
    if huge:
      m.madvise(MADV_HUGEPAGE)
    start = time.perf_counter()
    for offset in range(0, nbytes, 4096):
      m[offset] = 1
    return time.perf_counter() - start
  finally:
    m.close()


def _seconds(text: str) -> bool:
  try:
    return float(text) >= 0
  except ValueError:
    return False


def main(argv):
  del argv
  nbytes = FLAGS.mib << 20
  thp = "?"
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      thp = f.read().strip()
  except OSError:
    pass
  print(f"transparent huge pages: {thp}; free page reporting: "
        f"{'counted' if reported_kib() is not None else 'not counted (no ' + REPORTED + ')'}")
  gaps = [float(g) for g in FLAGS.gaps]
  for huge in (True, False):
    for gap in gaps:
      before, times = reported_kib(), []
      try:
        for _ in range(FLAGS.repeats):
          times.append(touch_fresh(nbytes, huge))
          time.sleep(gap)
      except OSError as e:  # madvise(MADV_HUGEPAGE) where the kernel has no such advice
        print(f"huge pages: not available here ({e})")
        break
      after = reported_kib()
      moved = "-" if before is None or after is None else f"{(after - before) / 1024:.0f} MiB"
      print(f"{'huge pages' if huge else '4 KiB pages':<11} gap {gap:4.1f} s: touch {FLAGS.mib} "
            f"MiB in {', '.join(f'{1e3 * t:.0f}' for t in times)} ms; reported meanwhile {moved}")


if __name__ == "__main__":
  flags.DEFINE_integer("mib", 512, "MiB mapped and touched each time.", lower_bound=1)
  flags.DEFINE_list("gaps", ["0", "0.2", "1", "3", "6"], "Seconds the memory sits freed "
                    "between touches.")
  flags.DEFINE_integer("repeats", 4, "Touches per gap.", lower_bound=1)
  flags.register_validator("gaps", lambda v: all(_seconds(x) for x in v),
                           "--gaps: seconds, each a number >= 0")
  app.run(main)

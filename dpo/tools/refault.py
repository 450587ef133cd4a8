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
pages, or as not), touch every 4 KiB page, unmap it; then, `--repeats` times for each gap, wait
the gap and touch a fresh mapping again, timed. It prints each timed touch's milliseconds and
page faults (about 1 per 2 MiB on huge pages, 1 per 4 KiB without: the check that the pages
were what the row says) and, where the kernel counts it (`reported_kib`), how much memory it
reported to the host meanwhile. Times that grow with the gap on the huge-page rows, and not on
the 4 KiB rows, are the host taking back freed huge pages: steps that last longer than the gap
lose time to it (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import mmap
import resource
import time

from absl import app, flags

from dpo import hostmem

MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)  # Linux's advice numbers
MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)
REPORTED = "/sys/module/page_reporting/parameters/reported_kib"
FLAGS = flags.FLAGS


def reported_kib() -> int | None:
  """KiB this kernel has reported free to its host so far; None where it does not count them."""
  try:
    with open(REPORTED) as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def touch_fresh(nbytes: int, huge: bool) -> tuple[float, int]:
  """(seconds, page faults) to first-touch every 4 KiB page of a fresh anonymous mapping of
  `nbytes`, madvised as huge pages or as not (OSError where the kernel refuses the advice)."""
  m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  try:
    m.madvise(MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for offset in range(0, nbytes, 4096):
      m[offset] = 1
    return (time.perf_counter() - start,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
  finally:
    m.close()


def _is_seconds(text: str) -> bool:
  """Whether a --gaps entry is a finite number of seconds >= 0."""
  try:
    return math.isfinite(float(text)) and float(text) >= 0
  except ValueError:
    return False


def main(argv):
  del argv
  nbytes = FLAGS.mib << 20
  mode = hostmem.thp_mode()
  print(f"transparent huge pages: {mode or 'absent'}; free page reporting: "
        f"{'counted' if reported_kib() is not None else 'not counted (no ' + REPORTED + ')'}")
  gaps = [float(g) for g in FLAGS.gaps]
  for huge in (True, False):
    label = "huge pages" if huge else "4 KiB pages"
    if huge and mode in (None, "never"):
      print(f"{label}: none on this kernel (transparent huge pages {mode or 'absent'})")
      continue
    try:
      touch_fresh(nbytes, huge)  # so every timed touch follows a freed mapping and its gap
    except OSError as e:  # madvise refused: a kernel without this advice
      print(f"{label}: madvise refused here ({e})")
      continue
    for gap in gaps:
      before, touches = reported_kib(), []
      for _ in range(FLAGS.repeats):
        time.sleep(gap)
        touches.append(touch_fresh(nbytes, huge))
      after = reported_kib()
      moved = "-" if before is None or after is None else f"{(after - before) / 1024:.0f} MiB"
      print(f"{label:<11} gap {gap:4.1f} s: touch {FLAGS.mib} MiB in "
            f"{', '.join(f'{1e3 * t:.0f}' for t, _ in touches)} ms "
            f"({', '.join(str(n) for _, n in touches)} page faults); reported meanwhile {moved}")


if __name__ == "__main__":
  flags.DEFINE_integer("mib", 512, "MiB mapped and touched each time.", lower_bound=1)
  flags.DEFINE_list("gaps", ["0", "0.2", "1", "3", "6"], "Seconds the memory sits freed "
                    "before each timed touch.")
  flags.DEFINE_integer("repeats", 4, "Timed touches per gap.", lower_bound=1)
  flags.register_validator("gaps", lambda v: bool(v) and all(_is_seconds(x) for x in v),
                           "--gaps: one or more seconds, each a finite number >= 0")
  app.run(main)

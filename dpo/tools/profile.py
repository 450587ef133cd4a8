"""Where a jitted step spends its device time: trace a few steps, sum the XLA ops.

    python -m dpo.tools.bench --config=llama3.2-1b ... --worker_json=w.json --profile_dir=prof
    python -m dpo.tools.profile prof            # the table again, from the saved trace

`dpo.tools.bench --profile_dir=DIR` traces `--profile_steps` steps of the timed step after its
timing (so the trace never changes the figures), writes the compiled HLO beside the trace
(`step.hlo.txt`, to read what a fusion computes) and prints this table: each XLA op's device
time summed over the traced steps, its share, and its HLO category where the trace has one. On
an accelerator the ops are the device plane's "XLA Ops" line; on a CPU, the host threads' events
that name an HLO op. The trace itself opens in TensorBoard's or XProf's profile viewer.
"""

from __future__ import annotations

import collections
import glob
import os
import re
from typing import Callable

import jax
from absl import app

HEADER = "op | ms | share | count | category"


def trace(run: Callable[[], None], steps: int, out_dir: str) -> str:
  """Run `run` (one step, blocking) `steps` times under the profiler; the xplane file written."""
  os.makedirs(out_dir, exist_ok=True)
  before = set(glob.glob(os.path.join(out_dir, "**", "*.xplane.pb"), recursive=True))
  with jax.profiler.trace(out_dir):
    for _ in range(steps):
      run()
  made = sorted(set(glob.glob(os.path.join(out_dir, "**", "*.xplane.pb"), recursive=True)) - before)
  if not made:
    raise RuntimeError(f"{out_dir}: the profiler wrote no .xplane.pb file")
  return made[-1]


def _stat(event, name: str):
  for k, v in event.stats:
    if k == name:
      return v
  return None


def _short(name: str) -> str:
  """`fusion.12 bf16[16,1536,8192]` from a TPU op's whole HLO text (`%fusion.12 = bf16[...]{...}
  fusion(...), ...`); other names as they are."""
  m = re.match(r"%?(\S+) = \(?([a-z0-9]+\[[0-9,]*\])?", name)
  return name if m is None else " ".join(g for g in m.groups() if g)


def _self_times(events) -> list[tuple[str, float, object]]:
  """(name, own time in ns, event) of one line's events: a loop or call op that encloses other
  ops (a `while`, a remat `checkpoint`) keeps only the time none of them ran."""
  events = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
  own = [e.duration_ns for e in events]
  stack: list[int] = []
  for i, e in enumerate(events):
    while stack and events[stack[-1]].start_ns + events[stack[-1]].duration_ns <= e.start_ns:
      stack.pop()
    if stack:
      own[stack[-1]] -= e.duration_ns
    stack.append(i)
  return [(e.name, t, e) for e, t in zip(events, own)]


def op_times(xplane: str) -> list[dict]:
  """Each XLA op's summed own device time (ns), largest first, from one xplane file."""
  from jax.profiler import ProfileData
  data = ProfileData.from_file(xplane)
  device = [line for plane in data.planes if plane.name.startswith("/device:")
            for line in plane.lines if line.name == "XLA Ops"]
  if device:
    timed = [t for line in device for t in _self_times(line.events)]
  else:  # a CPU: the host threads' events that carry the op they ran
    timed = [t for plane in data.planes for line in plane.lines
             for t in _self_times([e for e in line.events if _stat(e, "hlo_op") is not None])]
  total, count, category = collections.Counter(), collections.Counter(), {}
  for name, ns, e in timed:
    name = _short(name)
    total[name] += ns
    count[name] += 1
    cat = _stat(e, "hlo_category")
    if cat is not None:
      category[name] = cat
  return [{"op": op, "ns": ns, "count": count[op], "category": category.get(op, "")}
          for op, ns in total.most_common()]


def table(ops: list[dict], top: int = 40) -> list[str]:
  """The `top` ops as table lines (ms summed over the trace, share of all ops' time)."""
  whole = sum(o["ns"] for o in ops) or 1
  lines = [HEADER, f"(all ops) | {whole / 1e6:.2f} | 100.0% | {sum(o['count'] for o in ops)} |"]
  for o in ops[:top]:
    lines.append(f"{o['op']} | {o['ns'] / 1e6:.2f} | {100 * o['ns'] / whole:.1f}% | "
                 f"{o['count']} | {o['category']}")
  return lines


def newest(trace_dir: str) -> str:
  found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                 key=os.path.getmtime)
  if not found:
    raise SystemExit(f"{trace_dir}: no .xplane.pb file under it (write one with "
                     "dpo.tools.bench --profile_dir)")
  return found[-1]


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python -m dpo.tools.profile TRACE_DIR")
  print("\n".join(table(op_times(newest(argv[1])))))


if __name__ == "__main__":
  app.run(main)

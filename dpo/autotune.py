"""`--autotune=on`: the layer scan's unroll, the matmul backward and the query block, measured.

These three model fields (`scan_unroll`, `matmul_backward`, `attention_block`) change how XLA
lays out and schedules the same sums, never the sums, and which setting is fastest depends on
the CPU: on the Intel Xeon of docs/benchmarks.md the unrolled layers with the explicit backward
were the slowest full fine-tune on shared rows (issue 30), on the AMD EPYC the fastest. So a stage
with `--autotune=on` times a few candidates on its own jitted step, shapes and first batch
(`choose`), and trains with the fastest.

The choice changes float rounding, so a run must keep it. It is recorded per stage in
`<output_dir>/autotune.json`: a resume reads it back before anything is timed, so the stage's
fingerprint (which holds the model fields) is the one its checkpoints and its saved model
(checkpoints/sft_model: `recorded`) were written with; the run's flags.txt names the record
(--autotune_from), so a rerun from that file trains with the same choices in any --output_dir.
It is also cached across runs in `$DPO_JAX_CACHE/autotune.json` (default `~/.cache/dpo-jax`),
keyed by the CPU model, the device count, the step, the config fields that shape it, the batch
shapes and the candidate set; each table is updated under a lock on `<file>.lock`, so runs
measuring at once keep both entries. One log line per timing gives its median step time. The
winner can depend on the machine's load as well as its CPU (docs/benchmarks.md), so the entry
records the load average (and the time) it was measured under; delete the cache file to measure
again.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable, NamedTuple

import jax

# The model fields the autotune sets; every other field is part of the key.
FIELDS = ("scan_unroll", "matmul_backward", "attention_block")
QUERY_BLOCK = 64  # the query block tried on rows of at least twice as many slots
FILE = "autotune.json"


def cpu_model() -> str:
  """`lscpu`'s Model name (the name docs/ give with each figure), else /proc/cpuinfo's, else the
  platform's processor string."""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    names = [line.split(":", 1)[1].strip() for line in out.splitlines()
             if line.startswith("Model name")]
    if names:
      return names[0]
  except (OSError, subprocess.CalledProcessError):
    pass
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def cache_path() -> str:
  root = os.environ.get("DPO_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "dpo-jax")
  return os.path.join(root, FILE)


def candidates(model) -> list[dict]:
  """The settings tried, the config's own first: the layer scan rolled or fully unrolled, each
  with JAX's and the written-out matmul backward, at the config's query block; then (`choose`)
  the winner beside itself with the other query block where the rows are long enough to skip
  any. Unrolled layers are left out with --remat (it needs the rolled scan)."""
  own = {f: getattr(model, f) for f in FIELDS}
  unrolls = [1] if model.remat or model.n_layers == 1 else [1, model.n_layers]
  grid = [{"scan_unroll": u, "matmul_backward": b, "attention_block": own["attention_block"]}
          for u in unrolls for b in ("autodiff", "explicit")]
  own["scan_unroll"] = min(own["scan_unroll"], model.n_layers)
  return [own] + [c for c in grid if c != own]


def other_block(model, slots: int) -> int | None:
  """The query block to try against the config's: 64 where rows hold at least 128 slots and the
  config attends whole rows, whole rows where it uses blocks; None where blocks skip nothing."""
  if model.attention_block:
    return 0
  return QUERY_BLOCK if slots >= 2 * QUERY_BLOCK else None


def key(cfg, step_name: str, batch_shapes: Any, options: list[dict], blocks: bool) -> str:
  """What the measurement depends on: the CPU, the devices, the step, the config fields that
  shape it (all but the tuned ones), the batch shapes and the candidates."""
  # Every section a step reads (optimizer, loss, reference, guards, ...), less where the run
  # writes, what it evaluates and the tuned fields themselves.
  sections = {name: value for name, value in dataclasses.asdict(cfg).items()
              if name not in ("run", "checkpoint", "eval")}
  sections["model"] = {k: v for k, v in sections["model"].items() if k not in FIELDS}
  parts = {"cpu": cpu_model(), "devices": [jax.device_count(), jax.devices()[0].platform],
           "cores": len(os.sched_getaffinity(0)), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "jax": jax.__version__, "step": step_name, "config": sections,
           "batch": sorted(batch_shapes.items()), "candidates": options, "blocks": blocks}
  text = json.dumps(parts, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read(path: str, required: bool = False) -> dict:
  """The table at `path` ({} where there is none). An unreadable run record (`required`) is an
  error naming it; an unreadable cache is logged and measured anew."""
  if not os.path.exists(path):
    return {}
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    if required:
      raise ValueError(f"--autotune=on: {path} cannot be read ({e}); it records the settings "
                       f"this run trained with: restore it, or start in a new --output_dir")
    logging.warning("autotune: cache %s cannot be read (%s); measuring anew", path, e)
    return {}


def _write(path: str, table: dict) -> None:
  """Fsynced and renamed, so a reader never sees half a file; the temporary name is the
  process's own, as several runs share one cache (checkpoint._write_json's is fixed)."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _merge(path: str, name: str, entry: dict, required: bool = False) -> None:
  """`entry` added under `name` to the table at `path`, read again and written under an
  exclusive lock on `<path>.lock`: the rename keeps the file whole, the lock keeps both of two
  runs' entries (each would otherwise write the table it read, less the other's)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(f"{path}.lock", "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
    _write(path, {**_read(path, required), name: entry})


def choose(model, slots: int, time_steps: Callable[[list[dict]], list[float]], label: str,
           blocks: bool = True) -> tuple[dict, dict]:
  """The fastest candidate by `time_steps(settings) -> seconds per step of each`, and what was
  measured: {"seconds": {candidate as text: seconds}}, and with `blocks` where the rows are long
  enough, "query_block": the winner timed again beside itself with the other query block, in one
  call (round-robin, so load falls on both alike), the faster of the two chosen. One log line
  per timing."""
  def timed(settings: list[dict], note: str) -> dict:
    seconds = dict(zip(map(describe, settings), time_steps(settings)))
    for setting, t in seconds.items():
      logging.info("autotune %s: %s %.4f s per step%s", label, setting, t, note)
    return seconds

  options = candidates(model)
  times = {"seconds": timed(options, "")}
  best = min(options, key=lambda s: times["seconds"][describe(s)])  # ties: the config's own
  block = other_block(model, slots) if blocks else None
  if block is not None:
    pair = [best, {**best, "attention_block": block}]
    times["query_block"] = timed(pair, " (the winner beside its other query block)")
    best = min(pair, key=lambda s: times["query_block"][describe(s)])
  return best, times


def describe(setting: dict) -> str:
  return " ".join(f"--{k}={setting[k]}" for k in FIELDS)


class Trial(NamedTuple):
  """What one tuning measures: the step `name` on batches of `shapes` ({name: shape}) and rows
  of `slots` slots, timed by `time_steps(settings) -> seconds of each`; `record_dir` holds the
  run's autotune.json (None: no run record); `blocks=False` keeps the config's query block."""
  name: str
  shapes: dict
  slots: int
  time_steps: Callable[[list[dict]], list[float]]
  record_dir: str | None = None
  blocks: bool = True


def tuned(cfg, trial: Trial):
  """`cfg` with the fastest setting of FIELDS (`measured`'s choice); `cfg` itself with
  --autotune=off."""
  if cfg.run.autotune == "off":
    return cfg
  return cfg.replace(**measured(cfg, trial)["choice"])


def recorded(cfg, name: str, record_dir: str):
  """`cfg` with the choice recorded for stage `name` in `record_dir`'s autotune.json, as the
  stage trained with it: what a finished stage's saved model is checked against before the
  stage is built (and tuned) again; `cfg` itself with --autotune=off or no choice recorded."""
  if cfg.run.autotune == "off":
    return cfg
  entry = _read(os.path.join(record_dir, FILE), required=True).get(name)
  return cfg.replace(**entry["choice"]) if entry else cfg


def _repeated(cfg, record_path: str | None) -> tuple[str | None, dict]:
  """(path, table) of --autotune_from, the record of the run this one repeats; (None, {})
  where none is given or it names this run's own record. One error line where it cannot be
  read."""
  path = cfg.run.autotune_from
  if not path or (record_path and os.path.abspath(path) == os.path.abspath(record_path)):
    return None, {}
  try:
    with open(path) as f:
      return path, json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"--autotune_from={path}: cannot be read ({e}); give the autotune.json of "
                     f"the run to repeat, or leave it empty to measure") from None


def measured(cfg, trial: Trial) -> dict:
  """{"key", "choice", "seconds"[, "query_block"], "cpu", "load", "when"} and "from", the file it
  was read from (None: measured now, by `choose`): the fastest setting of FIELDS for `trial`'s
  step: the one recorded for this step in its `record_dir`'s autotune.json (a resumed run), else
  in --autotune_from's (a repeated run), else the cached one, else measured with its
  `time_steps`; the choice is written to the run's record, a measured one to the cache too."""
  step_name, record_dir = trial.name, trial.record_dir
  options = candidates(cfg.model)
  k = key(cfg, step_name, trial.shapes, options, trial.blocks)
  record_path = os.path.join(record_dir, FILE) if record_dir else None
  record = _read(record_path, required=True) if record_path else {}
  cache = _read(cache_path())
  source, repeated = ((record_path, record) if step_name in record else
                      _repeated(cfg, record_path))
  if step_name in repeated:  # a run trained with this: kept, even on another machine
    entry = repeated[step_name]
    if entry.get("key") != k:
      logging.warning("autotune %s: %s was measured under another key (CPU, devices, JAX or "
                      "config); this run trains with its recorded choice", step_name, source)
  else:
    if source:  # the repeated run stopped before this stage was tuned
      logging.info("autotune %s: --autotune_from=%s records no choice for it", step_name, source)
    if k in cache:
      entry, source = cache[k], cache_path()
    else:
      choice, times = choose(cfg.model, trial.slots, trial.time_steps, step_name, trial.blocks)
      # A neighbour's jobs can change which setting wins: the entry says under what load.
      entry = {"key": k, "choice": choice, **times, "cpu": cpu_model(),
               "load": round(os.getloadavg()[0], 2),
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
      source = None
      _merge(cache_path(), k, entry)
  if record_path and step_name not in record:
    _merge(record_path, step_name, entry, required=True)
  logging.info("autotune %s: %s%s", step_name, describe(entry["choice"]),
               f" (from {source})" if source else " (fastest measured)")
  return {**entry, "from": source}


def interleaved(step_of: Callable[[dict], Callable], state, frozen, batch,
                rounds: int) -> Callable[[list[dict]], list[float]]:
  """`choose`'s `time_steps` for jitted steps: `step_of(setting)` is the step of a setting; all
  take `state` in turn (the steps donate it, so it is not the caller's after the first call, and
  train it, which leaves each step's cost as it is), each first called once to compile, then
  once per round, round-robin, so a neighbour's load falls on every candidate alike. Each
  setting's median. The caller builds `state` to be measured (a run's or the bench's fresh
  state) and builds its own again after: a copy would double the state's memory, and with it
  the peak RSS the bench reports."""
  def time_steps(settings: list[dict]) -> list[float]:
    nonlocal state
    steps = [step_of(s) for s in settings]
    for step in steps:
      state, m = step(state, frozen, batch)
      jax.block_until_ready(m)
    times = [[] for _ in steps]
    for _ in range(rounds):
      for step, ts in zip(steps, times):
        t = time.perf_counter()
        state, m = step(state, frozen, batch)
        jax.block_until_ready(m)
        ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]
  return time_steps

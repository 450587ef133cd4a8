"""A run's records for comparing two runs: every wall-clock figure left out by one rule.

Two runs of the same command (a resumed run and an uninterrupted one, two processes and one)
write the same figures, but not the same times: a busy machine makes any timing differ. The
library names each figure it takes from a clock so that one rule finds it: `tokens_per_sec`,
a `time/` key (`time/sample_s`), a key ending `_time_s` (`eval/eval_time_s`, `dpo_time_s`,
`wall_time_s`) or `seconds` (the reference cache's build). Every test that compares records or
summaries between runs reads them through `timeless`.
"""

import json
import os


def wall_clock(key: str) -> bool:
  """Whether a metrics or summary key names a wall-clock figure (the module doc's rule)."""
  last = key.rsplit("/", 1)[-1]
  return key.startswith("time/") or last.endswith("_time_s") or last in ("tokens_per_sec",
                                                                         "seconds")


def timeless(value):
  """`value` (a record, a summary, or a list of them) without its wall-clock keys, at any
  depth."""
  if isinstance(value, dict):
    return {k: timeless(v) for k, v in value.items() if not wall_clock(k)}
  if isinstance(value, list):
    return [timeless(v) for v in value]
  return value


def metrics(out_dir) -> list[dict]:
  """`out_dir`/metrics.jsonl's records without their wall-clock keys."""
  with open(os.path.join(out_dir, "metrics.jsonl")) as f:
    return [timeless(json.loads(line)) for line in f]

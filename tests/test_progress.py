"""dpo/progress.py: a line at least every INTERVAL seconds of silence, naming the innermost
activity and the last line before the silence (never its own), and none while other lines keep
coming."""

import logging as std_logging
import time

from absl import logging
import pytest

from dpo import progress


class _Lines(std_logging.Handler):
  def __init__(self):
    super().__init__(level=std_logging.INFO)
    self.lines = []

  def emit(self, record):
    self.lines.append((time.monotonic(), record.getMessage()))


@pytest.fixture
def lines():
  """Every log line at INFO and above, with the time it came."""
  lines = _Lines()
  root = std_logging.getLogger()
  root.addHandler(lines)
  old_level = logging.get_verbosity()
  logging.set_verbosity(logging.INFO)
  yield lines
  root.removeHandler(lines)
  logging.set_verbosity(old_level)


def test_a_line_every_interval_of_silence_and_none_while_lines_come(monkeypatch, lines):
  monkeypatch.setattr(progress, "INTERVAL", 0.3)
  with progress.doing("the outer job"):
    logging.info("exported the adapter")
    with progress.doing("an evaluation"):
      time.sleep(1.6)  # silent: about five lines
    busy_from = time.monotonic()
    while time.monotonic() - busy_from < 1.2:  # a line every 0.05 s: the watcher stays quiet
      logging.info("step")
      time.sleep(0.05)
  time.sleep(0.8)  # outside every block: nothing
  still = [(t, m) for t, m in lines.lines if m.startswith("still working: ")]
  assert 3 <= len([1 for t, _ in still if t < busy_from]) <= 6, still
  first = still[0][1]
  assert first.startswith("still working: an evaluation, ") and "(exported the adapter)" in first
  # Each names the last line before the silence, not an earlier heartbeat, and how long ago.
  silent = [m for t, m in still if t < busy_from]
  assert all(m.count("still working") == 1 and m.endswith("(exported the adapter)")
             for m in silent), silent
  ago = [float(m.split("; ")[1].split(" s since")[0]) for m in silent]
  assert ago == sorted(ago) and ago[-1] >= 1.0, silent
  assert not [m for t, m in still if t > busy_from + 0.35], still
  gaps = [b[0] - a[0] for a, b in zip(lines.lines, lines.lines[1:]) if b[0] < busy_from]
  assert max(gaps) < 0.3 + 0.5  # the interval, and the watcher's polling and a loaded machine


def test_an_evaluation_names_itself_while_it_is_silent(monkeypatch, lines):
  """The DPO stages' evaluations (every --eval_every and the final one) are their own activity:
  a silent one is named, not the stage around it and the last line before it."""
  from dpo.algorithms import dpo
  monkeypatch.setattr(progress, "INTERVAL", 0.2)

  def evaluator(policy):
    time.sleep(0.9)  # silent: a compile, the reference's samples
    return {"win_rate": 0.5}, []

  class Writer:
    records = []
    write = records.append

  with progress.doing("the dpo stage"):
    metrics, _ = dpo._evaluate(evaluator, None, 7, Writer())
  still = [m for _, m in lines.lines if m.startswith("still working: ")]
  assert still and all(m.startswith("still working: the evaluation at step 7, ") for m in still)
  assert metrics["win_rate"] == 0.5 and Writer.records[0]["step"] == 7

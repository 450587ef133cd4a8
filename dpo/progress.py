"""A log line at least every `INTERVAL` seconds while a run works.

A compile, an evaluation, an export or a conversion can each run for minutes without a line of
their own. Inside `doing(what)`, a watcher thread logs `still working: <what>` whenever nothing
at all was logged for `INTERVAL` seconds, with the time spent on `what` and the last line
logged before the silence and how long ago (so the line says where the run is; its own earlier
lines are not quoted), and says nothing while other lines keep coming. `doing` blocks nest: the
line names the innermost.

    with progress.doing("the dpo stage"):
      ...
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import threading
import time

from absl import logging

INTERVAL = 30.0  # seconds of silence before a line

_lock = threading.Lock()
_activities: list[tuple[str, float]] = []  # (what, since), innermost last
_last = {"time": time.monotonic(), "message": "", "message_time": time.monotonic()}
_watcher: threading.Thread | None = None
_wake = threading.Event()


class _Seen(std_logging.Handler):
  """Notes when the last record (any logger's, this module's own included) was emitted, and the
  last one that is not this module's own."""

  def emit(self, record):
    now = time.monotonic()
    _last["time"] = now
    if record.threadName == _THREAD:
      return
    try:
      message = record.getMessage()
    except Exception:  # a record that cannot format still counts as a line
      message = str(record.msg)
    _last["message"], _last["message_time"] = message, now


_THREAD = "progress"
_seen = _Seen(level=std_logging.INFO)


def _watch() -> None:
  while True:
    _wake.wait(min(1.0, INTERVAL / 4))
    _wake.clear()
    with _lock:
      if not _activities:
        continue
      what, since = _activities[-1]
      now = time.monotonic()
      quiet = now - max(_last["time"], since)  # silence within this activity
      last, ago = _last["message"], now - _last["message_time"]
    if quiet >= INTERVAL:
      logging.info("still working: %s, %.0f s in it; %.0f s since the last line (%s)", what,
                   now - since, ago, (last[:120] + "...") if len(last) > 120 else last)


@contextlib.contextmanager
def doing(what: str):
  """Within this block, a line at least every INTERVAL seconds naming `what`."""
  global _watcher
  with _lock:
    if _seen not in std_logging.getLogger().handlers:
      std_logging.getLogger().addHandler(_seen)
    if _watcher is None or not _watcher.is_alive():
      _watcher = threading.Thread(target=_watch, name=_THREAD, daemon=True)
      _watcher.start()
    _activities.append((what, time.monotonic()))
  _wake.set()
  try:
    yield
  finally:
    with _lock:
      _activities.remove(next(a for a in reversed(_activities) if a[0] == what))

"""`python tests/launch_with_kill.py WHEN STEP launch-flags...`: launch.py SIGKILLed at its
step-STEP checkpoint: WHEN is `commit` (its arrays written, not committed; tests/test_checkpoint.py)
or `after` (committed, every process past it; tests/test_multihost.py kills one peer so)."""

import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]

import faults  # noqa: E402
import launch  # noqa: E402

if __name__ == "__main__":
  when, step = sys.argv.pop(1), int(sys.argv.pop(1))
  {"commit": faults.kill_during_commit, "after": faults.kill_after_checkpoint}[when](step)
  launch.app.run(launch.main)

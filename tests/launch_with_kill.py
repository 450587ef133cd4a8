"""`python tests/launch_with_kill.py WHEN STEP launch-flags...`: launch.py with a fault.

WHEN is `commit` (SIGKILL at the step-STEP checkpoint's commit: its arrays written, nothing
committed; tests/test_checkpoint.py), `after` (SIGKILL once the step-STEP checkpoint is
committed and every process is past it; tests/test_multihost.py kills one peer so), or
`full-checkpoint` / `full-metrics` (the disk fills at the next checkpoint write, or at the
metrics.jsonl write after STEP good records; tests/test_checkpoint.py).
`python tests/launch_with_kill.py pack-block-0 launch-flags...`: every process packs process 0's
block of the batch (tests/test_multihost.py's wrong layout).
"""

import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]

import pytest  # noqa: E402

import faults  # noqa: E402
import launch  # noqa: E402

if __name__ == "__main__":
  when = sys.argv.pop(1)
  step = 0 if when == "pack-block-0" else int(sys.argv.pop(1))
  if when == "pack-block-0":
    faults.pack_block_zero()
  elif when.startswith("full-"):
    faults.no_space(pytest.MonkeyPatch(), when.removeprefix("full-"), after=step)
  else:
    {"commit": faults.kill_during_commit, "after": faults.kill_after_checkpoint}[when](step)
  launch.app.run(launch.main)

"""`python tests/launch_with_kill.py STEP launch-flags...`: launch.py whose step-STEP checkpoint
commit is killed (tests/test_checkpoint.py runs it in a subprocess)."""

import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]

import faults  # noqa: E402
import launch  # noqa: E402

if __name__ == "__main__":
  faults.kill_during_commit(int(sys.argv.pop(1)))
  launch.app.run(launch.main)

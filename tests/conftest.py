"""Tests run on 8 fake CPU devices so sharded code paths are exercised; set before JAX starts.

Under pytest-xdist (`python -m pytest -n 2 tests`) each module runs whole on one worker
(`--dist loadfile`, pyproject.toml), so its module- and session-scoped fixtures (a finished run,
a converted model, every tool's output) and its compiled programs are built once, as serially.

Under CI=true a test that would skip because a test dependency does not import
(`pytest.importorskip`, in a test or at module level) fails instead: a broken torch or
transformers install must not turn the oracle tests into a green run.
"""

import atexit
import collections
import os
import shutil
import sys
import tempfile

import pytest

if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
  # (pytest-xdist's workers inherit the controller's environment, flag included)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole session, inherited by every subprocess (launch,
# tools, multi-host): many tests compile the same tiny programs, and a hit skips XLA's compile.
# The executables are the same as a fresh compile's, so results are too; the cache is new each
# session and removed at exit. Under pytest-xdist (`-n 2`) the controller makes it and its
# workers inherit it, so a program one worker compiled is a hit in the other (JAX writes an entry
# only if absent, and an entry it cannot read is a warning and a compile, not an error).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="dpo-jax-test-cache-")
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHARED_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                           "shared", "data")


@pytest.fixture(scope="module")
def compile_cache():
  """The session's persistent compilation cache directory (for subprocesses' environment)."""
  return os.environ["JAX_COMPILATION_CACHE_DIR"]


@pytest.fixture
def varied_pairs(tmp_path):
  """A JSONL file of 80 preference pairs whose prompts and responses run from 1 to 11 words, so
  their shared-prefix rows differ in length and several fit in one row (--packing)."""
  import json
  import numpy as np
  rng = np.random.default_rng(0)
  words = lambda: " ".join(rng.choice(["good", "bad", "fine", "a", "plot"], rng.integers(1, 12)))
  path = tmp_path / "varied_pairs.jsonl"
  path.write_text("".join(json.dumps({"prompt": words(), "chosen": words(), "rejected": words()})
                          + "\n" for _ in range(80)))
  return path


def _ci() -> bool:
  return os.environ.get("CI", "").lower() in ("true", "1")


def _missing_dependency(report) -> str | None:
  """The skip message of `pytest.importorskip`, or None for any other outcome."""
  if not report.skipped or not isinstance(report.longrepr, tuple):
    return None
  message = str(report.longrepr[2])
  return message if "could not import" in message else None


def _fail_in_ci(report, what: str) -> None:
  message = _missing_dependency(report) if _ci() else None
  if message is not None:
    report.outcome = "failed"
    report.longrepr = (f"CI=true: {what} would be skipped for a missing test dependency "
                       f"({message}); install the test extra")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  _fail_in_ci(outcome.get_result(), item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
  outcome = yield
  _fail_in_ci(outcome.get_result(), collector.nodeid)


def pytest_collection_modifyitems(items):
  """Under pytest-xdist the modules go to the workers in collection order (pyproject.toml:
  --dist loadfile --no-loadscope-reorder); the modules with the most slow tests go first, so the
  last ones handed out, which decide how long one worker waits for the other, are quick."""
  if os.environ.get("PYTEST_XDIST_WORKER"):
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: a module's own order is kept

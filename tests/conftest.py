"""Tests run on 8 fake CPU devices so sharded code paths are exercised; set before JAX starts.

Under CI=true a test that would skip because a test dependency does not import
(`pytest.importorskip`, in a test or at module level) fails instead: a broken torch or
transformers install must not turn the oracle tests into a green run.
"""

import os
import sys

import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHARED_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                           "shared", "data")


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
  """A persistent compilation cache for one test module: tests that rerun the same tiny
  programs (resume, faults) read every compile after the first from disk; the executables are
  identical, so results are too. Yields the cache directory (for subprocesses)."""
  import jax
  path = str(tmp_path_factory.mktemp("jax_cache"))
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = {n: getattr(jax.config, n) for n in names}
  for n, v in zip(names, (path, 0, 0)):
    jax.config.update(n, v)
  yield path
  for n, v in old.items():
    jax.config.update(n, v)


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

"""tests/conftest.py: under CI=true a skip for a missing test dependency is a failure."""

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

PROBE = '''
import pytest

def test_needs_a_missing_module():
  pytest.importorskip("no_such_module_for_the_probe")

def test_skips_for_another_reason():
  pytest.skip("not a dependency")
'''


def _run(tmp_path, ci: str):
  shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
  (tmp_path / "test_probe.py").write_text(PROBE)
  (tmp_path / "test_probe_module.py").write_text(
      'import pytest\npytest.importorskip("no_such_module_either")\n\ndef test_x():\n  pass\n')
  env = {k: v for k, v in os.environ.items() if k != "CI"}
  env["CI"] = ci
  return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-o", "addopts=", "--continue-on-collection-errors", str(tmp_path)], capture_output=True, text=True,
                        cwd=tmp_path, env=env, timeout=120)


def test_missing_dependency_fails_under_ci(tmp_path):
  r = _run(tmp_path, "true")
  assert r.returncode != 0
  assert "FAILED test_probe.py::test_needs_a_missing_module" in r.stdout, r.stdout
  assert "ERROR test_probe_module.py" in r.stdout, r.stdout
  assert "would be skipped for a missing test dependency" in r.stdout


def test_missing_dependency_skips_outside_ci(tmp_path):
  r = _run(tmp_path, "")
  assert r.returncode == 0 and "3 skipped" in r.stdout, r.stdout

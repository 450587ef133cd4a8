"""WORKSPACE.md is the map of the tree: every module has its line, and no line names a file
that is gone."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules():
  out = {"launch.py", "configs.py"}
  for package in ("dpo", "models"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
      rel = os.path.relpath(dirpath, ROOT)
      out |= {os.path.join(rel, f) for f in files if f.endswith(".py") and f != "__init__.py"}
  return out


def test_layout_lists_every_module_and_only_existing_ones():
  with open(os.path.join(ROOT, "WORKSPACE.md")) as f:
    text = f.read()
  layout = text[text.index("## Layout"):text.index("\n## ", text.index("## Layout") + 1)]
  listed = set(re.findall(r"^\| `([\w/.]+\.py)` \|", layout, flags=re.M))
  assert _modules() - listed == set(), "modules missing from WORKSPACE.md's layout"
  assert listed - _modules() == set(), "WORKSPACE.md lists files that do not exist"

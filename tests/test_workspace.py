"""WORKSPACE.md is the map of the tree: every module has its line, and no line names a file
that is gone; its tables of what a run writes (files, metrics.jsonl keys) are what a run writes."""

import json
import os
import re

import pytest

from dpo.runner import Hook, Rollback

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


# --- what a run writes ---------------------------------------------------------------------------

def _section(title: str) -> str:
  with open(os.path.join(ROOT, "WORKSPACE.md")) as f:
    text = f.read()
  start = text.index(f"## {title}")
  end = text.find("\n## ", start + 1)
  return text[start:] if end < 0 else text[start:end]


def _rows(section: str, first: str) -> dict[str, list[str]]:
  """{first cell without backticks: [the backticked names of each later cell]} of the table
  whose header's first cell is `first`."""
  table = section[section.index(f"| {first} |"):].split("\n\n")[0].splitlines()[2:]
  out = {}
  for line in table:
    cells = [c.strip() for c in line.strip("|").split("|")]
    out[cells[0].replace("`", "")] = [re.findall(r"`([^`]+)`", c) for c in cells[1:]]
  return out


def _documented_paths():
  """{path pattern: written always?} of the run-directory table."""
  rows = _rows(_section("What a run directory holds"), "path")
  return {path: _cell(path, "written") == "always" for path in rows}


def _cell(path: str, column: str) -> str:
  section = _section("What a run directory holds")
  header = [c.strip() for c in section[section.index("| path |"):].splitlines()[0].strip("|")
            .split("|")]
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if cells and cells[0].replace("`", "") == path:
      return cells[header.index(column)]
  raise KeyError(path)


def _written(out: str) -> set[str]:
  """The run directory's entries as the table names them: top-level files and folders, and
  checkpoints/<name>/ with step numbers as <N> and stage names as <stage>."""
  found = set()
  for name in os.listdir(out):
    if name != "checkpoints":
      found.add(name + ("/" if os.path.isdir(os.path.join(out, name)) else ""))
  for name in os.listdir(os.path.join(out, "checkpoints")):
    inner = os.listdir(os.path.join(out, "checkpoints", name))
    if any(re.fullmatch(r"step_\d{8}", i) for i in inner):
      found.add("checkpoints/<stage>/step_<N>/")
    else:
      found.add(f"checkpoints/{name}/")
  return found


def _metric_keys(records: list[dict], stage: str) -> set[str]:
  keys = set()
  for r in records:
    if r.get("stage") == stage and "event" not in r:
      keys |= set(r) - {"stage", "step"}
  return keys


class _Rollback(Hook):
  """Rolls the DPO stage back once, at its second step."""

  def __init__(self):
    self.done = False

  def metrics(self, run, step, metrics):
    if step == 2 and not self.done:
      self.done = True
      raise Rollback(step, "a test rollback", 0.5, 1)


@pytest.mark.slow
def test_the_tables_of_what_a_run_writes_are_what_a_run_writes(tmp_path):
  """A small sft,dpo run (precomputed reference, the token KL, one rollback): every file and
  metrics.jsonl key it writes is in WORKSPACE.md's tables, and each entry written always is
  there."""
  import configs
  from dpo import loop
  out = str(tmp_path / "run")
  cfg = configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, task_train_pairs=32,
      task_sft_examples=32, task_eval_pairs=8, task_eval_prompts=4, eval_max_new_tokens=4,
      global_batch_size=8, sft_steps=2, steps=3, log_every=1, eval_every=2, checkpoint_every=1,
      precompute_ref=True, output_dir=out)
  loop.run(cfg, extra_hooks={"dpo": [_Rollback()]})
  paths = _documented_paths()
  written = _written(out)
  assert written - set(paths) == set(), "written but not in WORKSPACE.md's table"
  assert {p for p, always in paths.items() if always} - written == set()

  with open(os.path.join(out, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  rows = _rows(_section("What a run directory holds"), "record")
  for stage in ("sft", "dpo", "eval"):
    always, conditional = rows[stage]
    got = _metric_keys(records, stage)
    assert set(always) - got == set(), f"{stage}: documented as always written, not written"
    assert got - set(always) - set(conditional) == set(), f"{stage}: written, not documented"
  rollback = [r for r in records if r.get("event") == "rollback"]
  assert rollback and set(rollback[0]) - {"stage", "step"} == set(rows["a rollback (dpo)"][0])


@pytest.mark.slow
def test_the_dpo_step_metrics_are_the_documented_ones():
  """The DPO step's metric names, traced (jax.eval_shape) for every registered loss, a loss
  combination, RPO, WPO, the token KL and packed rows: the always-written ones in each, and
  their union exactly WORKSPACE.md's dpo row (BCO's shift adds its own)."""
  import configs
  import jax
  import jax.numpy as jnp
  from dpo import batches, losses, train
  from models import sharding, transformer
  always, conditional = _rows(_section("What a run directory holds"), "record")["dpo"]
  documented = set(always) | {k for k in conditional if "<" not in k and not k.startswith("--")}
  base = configs.DEFAULT.replace(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                                 mlp_dim=16, global_batch_size=2, log_kl=False, rpo_alpha=0.0)
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  B, T, R, K, P = 2, 8, 1, 8, 2
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  rows = batches.Rows(i32(B, 2, T), i32(B, 2, T), i32(B, 2, T), f32(B, 2, T))
  shared = batches.SharedRows(i32(R, T), i32(R, T), i32(R, T), i32(R, T), i32(R, K), i32(R, K),
                              i32(R, K), f32(R, K), f32(R, K))
  packed = batches.PairBatch(rows, shared, batches.Packed(i32(R, K), f32(R, P), i32(B), i32(R, T)))

  def names(cfg, batch=batches.PairBatch(rows)):
    spec = train.StepConfig.dpo(cfg)
    params = transformer.abstract(transformer.param_specs(cfg.model))
    trainable = transformer.abstract(train.trainable_specs(cfg.model, cfg.lora))
    opt, _ = spec.optimizer()
    scalar = lambda d: jax.ShapeDtypeStruct((), d)
    state = train.TrainState(scalar(jnp.int32), trainable, jax.eval_shape(opt.init, trainable),
                             jax.ShapeDtypeStruct((2,), jnp.uint32), scalar(jnp.float32),
                             scalar(jnp.int32))
    step = train.with_mesh(mesh, lambda s, f, b: train.dpo_step(spec, s, f, b))
    _, metrics = jax.eval_shape(step, state, train.initial_frozen(params), batch)
    return set(metrics) | {"tokens_per_sec"}  # the rate LogMetrics adds to each record

  seen = set()
  for name in losses.LOSSES:
    got = names(base.replace(loss_type=(name,)))
    assert set(always) - got == set(), name
    seen |= got
  seen |= names(base.replace(loss_type=("sigmoid", "ipo"), rpo_alpha=1.0, wpo=True, log_kl=True))
  seen |= names(base.replace(packing=True), packed)
  seen |= names(base.replace(loss_type=("bco_pair",), bco_shift=True))
  combined = {k for k in seen if k.startswith("loss/")}
  assert combined == {"loss/sigmoid", "loss/ipo"} and "loss/<name>" in conditional
  assert seen - combined == documented, (seen - combined ^ documented)


@pytest.mark.slow
def test_the_tables_cover_a_reward_model_run(tmp_path):
  """A small --stage=rm run (every weight trains): every file it writes is in WORKSPACE.md's
  table, and its rm records' keys are the rm row's (with held-out pairs, the end-of-stage
  record's eval_ keys too)."""
  import configs
  from dpo import loop
  out = str(tmp_path / "run")
  cfg = configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, task_train_pairs=16,
      task_sft_examples=8, task_eval_pairs=8, task_eval_prompts=4, global_batch_size=8,
      rm_steps=2, lora_rank=0, log_every=1, checkpoint_every=1, stage="rm", output_dir=out)
  loop.run(cfg)
  assert _written(out) - set(_documented_paths()) == set(), "written but not in the table"
  assert "checkpoints/rm_model/" in _written(out)
  with open(os.path.join(out, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  always, conditional = _rows(_section("What a run directory holds"), "record")["rm"]
  assert _metric_keys(records, "rm") == set(always) | set(conditional)
  assert set(conditional) == {f"eval_{k}" for k in ("loss", "accuracy", "margin", "min_reward",
                                                     "mean_reward", "max_reward", "pairs")}


# --- reading the DPO step -------------------------------------------------------------------------

# Entries of "Reading the DPO step" that run before or beside the loss, not under it.
_NOT_UNDER_THE_LOSS = {"dpo.cli.from_flags", "dpo.program.Program.stage",
                       "dpo.train.StepConfig.dpo", "dpo.logprobs.pair_stats",
                       "dpo.train.apply_update"}


def _reading_list() -> list[str]:
  return re.findall(r"^\d+\. `([\w.]+)`", _section("Reading the DPO step"), flags=re.M)


def _resolve(name: str):
  import importlib
  parts = name.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ModuleNotFoundError:
      continue
    for attr in parts[i:]:
      obj = getattr(obj, attr)
    return obj
  raise ImportError(name)


def test_reading_the_dpo_step_names_real_functions_in_call_order(tmp_path, monkeypatch):
  """Each name of WORKSPACE's reading list is a function of the tree, and those under the loss
  are on the call stack, in the listed order, when a DPO step's loss is traced."""
  import inspect

  import configs
  from dpo import losses, loop
  names = _reading_list()
  assert len(names) >= 12 and len(set(names)) == len(names)
  for name in names:
    assert callable(_resolve(name)), name
  stacks = []
  original = losses._smoothed_logistic

  def traced(z, label_smoothing):
    callers = reversed(inspect.stack()[1:])  # this stand-in is the traced function itself
    stacks.append([f"{f.frame.f_globals.get('__name__')}.{f.frame.f_code.co_qualname}"
                   for f in callers] + ["dpo.losses._smoothed_logistic"])
    return original(z, label_smoothing)

  monkeypatch.setattr(losses, "_smoothed_logistic", traced)
  loop.run(configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
      max_prompt_length=16, max_target_length=16, task_train_pairs=16, task_sft_examples=16,
      task_eval_pairs=0, task_eval_prompts=0, global_batch_size=8, stage="dpo", steps=1,
      beta=0.1234, checkpoint_every=0, output_dir=str(tmp_path)))  # a beta no other test traces
  assert stacks, "the DPO step's loss was never traced"
  stack = stacks[0]
  expected = [n for n in names if n not in _NOT_UNDER_THE_LOSS]
  at = [stack.index(n) if n in stack else -1 for n in expected]
  assert -1 not in at, [n for n, i in zip(expected, at) if i < 0]
  assert at == sorted(at), [n for _, n in sorted(zip(at, expected))]


# --- lists the registries keep -------------------------------------------------------------------

def test_every_preset_and_stage_is_named_where_a_reader_looks():
  """A new preset or stage joins configs.PRESETS or the algorithm registry; these tests name the
  doc each one must be added to."""
  import configs
  from dpo import registry
  presets = set(re.findall(r"`([\w.-]+)`", _section("Presets")))
  missing = sorted(set(configs.PRESETS) - presets)
  assert not missing, f"add {missing} to WORKSPACE.md's Presets section"
  with open(os.path.join(ROOT, "docs", "flags.md")) as f:
    row = next(line for line in f if line.startswith("| `--stage` |"))
  missing = sorted(set(registry.ALGORITHMS) - set(re.findall(r"`(\w+)`", row)))
  assert not missing, f"add {missing} to the --stage row of docs/flags.md"

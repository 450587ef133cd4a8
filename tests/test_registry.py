"""The algorithm seam (dpo/registry.py): a new stage is one file, and nothing outside an
algorithm's module names it."""

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

import configs
from dpo import curves, registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A forker's new stage: DPO with beta scaled by a hyperparameter of its own. Its config section,
# flag, rule, step and log line come from this file alone.
NEW_STAGE = '''"""DPO whose beta is scaled by --beta_scale: a stage from one file."""

import dataclasses
from dataclasses import dataclass

from dpo import identity, registry, train
from dpo.algorithms import dpo
from models.config import FINITE_POS, option, rules


@dataclass(frozen=True)
class ScaledConfig:
  beta_scale: float = option(1.0, "dpo2 stage: multiplies --beta.")

  def __post_init__(self):
    rules(self, beta_scale=FINITE_POS)


def step_config(cfg) -> train.StepConfig:
  spec = train.StepConfig.dpo(cfg)
  beta = spec.loss.beta * cfg.scaled.beta_scale
  return dataclasses.replace(spec, loss=dataclasses.replace(spec.loss, beta=beta))


DPO2 = registry.register(dataclasses.replace(
    dpo.DPO, name="dpo2", step_config=step_config, data_seed=None,
    run=lambda p, model: dpo.preference_stage(p, model, DPO2),
    hyperparameters=lambda cfg: {**dpo.DPO.hyperparameters(cfg),
                                 **identity.sections(cfg, ("scaled",))},
    sections=(("scaled", ScaledConfig),)))
'''

TINY = ["--d_model=32", "--n_layers=1", "--n_heads=2", "--n_kv_heads=1", "--head_dim=16",
        "--mlp_dim=64", "--max_prompt_length=16", "--max_target_length=16",
        "--task_train_pairs=64", "--task_sft_examples=64", "--task_eval_pairs=16",
        "--task_eval_prompts=4", "--eval_max_new_tokens=8", "--global_batch_size=8",
        "--log_every=1", "--sft_steps=2", "--rm_steps=2", "--steps=2", "--checkpoint_every=0"]


@pytest.mark.slow
def test_a_new_stage_with_a_hyperparameter_is_one_file_and_one_import_line(tmp_path,
                                                                             compile_cache):
  """In a scratch copy of the project: the new module and one import line in
  dpo/algorithms/__init__.py; `--stage=sft,rm,dpo2 --judge=rm --beta_scale=2` runs, and the new
  flag without its stage is a one-line error naming both."""
  scratch = tmp_path / "scratch"
  files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
  for f in files:
    if f.endswith(".py") and os.path.exists(os.path.join(ROOT, f)):
      os.makedirs(scratch / os.path.dirname(f), exist_ok=True)
      shutil.copy(os.path.join(ROOT, f), scratch / f)
  (scratch / "dpo" / "algorithms" / "dpo2.py").write_text(NEW_STAGE)
  with open(scratch / "dpo" / "algorithms" / "__init__.py", "a") as f:
    f.write("from dpo.algorithms import dpo2  # noqa: E402,F401\n")
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
         "PYTHONPATH": str(scratch)}
  launch = lambda *args: subprocess.run([sys.executable, "launch.py", *args], cwd=scratch,
                                        env=env, capture_output=True, text=True, timeout=600)
  out = tmp_path / "run"
  done = launch(*TINY, "--stage=sft,rm,dpo2", "--judge=rm", "--rm_split=0.5", "--beta_scale=2",
                f"--output_dir={out}")
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.load(open(out / "summary.json"))
  assert "dpo2_time_s" in summary and summary["win_rate"] is not None
  records = [json.loads(line) for line in open(out / "metrics.jsonl")]
  assert [r["step"] for r in records if r["stage"] == "dpo2"] == [1, 2]
  assert "dpo2     2/2  loss" in done.stderr  # its log line: the DPO columns it took over
  assert (out / "checkpoints" / "dpo2").is_dir() and (out / "checkpoints" / "rm_model").is_dir()
  assert "--beta_scale=2.0" in open(out / "flags.txt").read()
  refused = launch(*[f for f in TINY if not f.startswith("--rm_steps")], "--stage=sft,dpo",
                   "--beta_scale=2", f"--output_dir={tmp_path / 'x'}")
  assert refused.returncode == 2 and "Traceback" not in refused.stderr
  assert "--beta_scale=2.0: must go with a dpo2 stage (--stage=sft,dpo has none)" in refused.stderr


FORK_LOSS = '''"""A fork's own loss in its own module: DPO with its margin scaled by my_gamma."""
from dpo import losses

MY_GAMMA = losses.Hyperparameter("my_gamma", 1.0, "Scales the DPO margin.", lambda v: v > 0, "> 0")


@losses.register("scaled_sigmoid", losses.BETA, MY_GAMMA)
def scaled_sigmoid(lp, beta, my_gamma):
  """DPO with its margin scaled by my_gamma (a fork's ablation)."""
  return losses.sigmoid(lp, beta * my_gamma, 0.0, "reverse_kl", 0.5)
'''


@pytest.mark.slow
def test_a_loss_in_a_forks_own_module_is_one_flag(tmp_path, compile_cache):
  """`--imports=MODULE` imports a fork's module before the config is built: its loss and
  hyperparameter get their flags, help and checks; the run records the flag, and the module is
  part of the source a resume must match."""
  fork = tmp_path / "fork"
  fork.mkdir()
  (fork / "fork_loss.py").write_text(FORK_LOSS)
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
         "PYTHONPATH": str(fork)}
  launch = lambda *args: subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, env=env,
                                        capture_output=True, text=True, timeout=600)
  out = tmp_path / "run"
  tiny = [f for f in TINY if not f.startswith(("--rm_steps", "--checkpoint_every"))]
  args = [*tiny, "--stage=dpo", "--imports=fork_loss", "--loss_type=scaled_sigmoid",
          "--my_gamma=2", "--checkpoint_every=1", f"--output_dir={out}"]
  done = launch(*args)
  assert done.returncode == 0, done.stderr[-3000:]
  flags_txt = open(out / "flags.txt").read()
  assert "--imports=fork_loss" in flags_txt and "--my_gamma=2.0" in flags_txt
  helped = launch("--imports=fork_loss", "--helpfull")
  assert "--my_gamma" in helped.stdout and "Scales the DPO margin." in helped.stdout
  bad = launch("--imports=fork_loss", "--loss_type=scaled_sigmoid", "--my_gamma=-1",
               f"--output_dir={tmp_path / 'bad'}")
  assert bad.returncode == 2 and "--my_gamma=-1.0: must be > 0" in bad.stderr, bad.stderr
  (fork / "fork_loss.py").write_text(FORK_LOSS.replace("beta * my_gamma", "beta / my_gamma"))
  changed = launch(*args)
  assert changed.returncode == 2 and "Traceback" not in changed.stderr
  assert "(changed fork_loss (--imports)); refusing" in changed.stderr, changed.stderr
  assert "refusing to resume it onto this code" in changed.stderr
  missing = launch("--imports=no_such_fork", f"--output_dir={tmp_path / 'x'}")
  assert missing.returncode == 2
  assert "error: --imports=no_such_fork: no module named 'no_such_fork'" in missing.stderr
  (fork / "broken_fork.py").write_text("import no_such_dependency\n")
  broken = launch("--imports=broken_fork", f"--output_dir={tmp_path / 'x'}")
  assert broken.returncode == 2 and "Traceback" not in broken.stderr
  assert ("error: --imports=broken_fork: importing it failed: ModuleNotFoundError: No module "
          "named 'no_such_dependency'") in broken.stderr
  twice = launch("--imports=fork_loss", "--imports=broken_fork", f"--output_dir={tmp_path / 'x'}")
  assert twice.returncode == 2
  assert "error: --imports: give it once, its modules comma-separated" in twice.stderr


# The modules the seam says never name a stage: they ask the registry.
SEAM_USERS = ("configs.py", "dpo/loop.py", "dpo/hooks.py", "dpo/curves.py", "dpo/runner.py",
              "dpo/program.py", "dpo/identity.py", "dpo/judges.py", "dpo/reward_model.py",
              "dpo/evaluate.py")


def test_no_stage_name_outside_its_algorithm_module():
  """No string constant in the runner, configs, loop, hooks, curves or judges equals a registered
  stage's name (the presets' --stage and --judge values and help text aside)."""
  names = set(registry.ALGORITHMS)
  found = []
  for path in SEAM_USERS:
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    presets = set()
    if path == "configs.py":  # a preset's stage="sft,rm,dpo" is data, not a branch on it
      presets = {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call)
                 for kw in call.keywords if kw.arg in ("stage", "judge")
                 for n in ast.walk(kw.value)}
    found += [f"{path}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
              if isinstance(node, ast.Constant) and node.value in names
              and id(node) not in presets]
  assert not found, found


def test_every_section_belongs_to_the_core_or_one_algorithm():
  owned = [n for a in registry.ALGORITHMS.values() for n, _ in a.sections]
  assert len(owned) == len(set(owned))
  assert set(configs.SECTIONS) == set(owned) | {
      "model", "lora", "data", "optim", "loss", "reference", "guard", "eval", "checkpoint",
      "mesh", "run"}
  for name in owned:
    assert registry.readers(name), name
  with pytest.raises(ValueError, match="register after configs.Config was built"):
    registry.register(registry.Algorithm(
        name="late", step=None, batch=None, step_config=None, run=None, hyperparameters=None,
        data_files=(), data_seed=0, steps_flag="--steps", sections=(("late", object),)))
  assert "late" not in registry.ALGORITHMS


def test_a_stage_needs_no_hand_picked_data_seed():
  """Each registered stage's loader draws its own order: a data_seed left out is derived from
  the stage's name, and one another stage has is refused, naming it."""
  seeds = [a.loader_seed for a in registry.ALGORITHMS.values()]
  assert len(seeds) == len(set(seeds))
  derived = dataclasses.replace(registry.ALGORITHMS["dpo"], name="my_stage", data_seed=None)
  assert derived.loader_seed not in seeds
  assert derived.loader_seed == dataclasses.replace(derived, data_seed=None).loader_seed
  taken = dataclasses.replace(registry.ALGORITHMS["dpo"], name="my_stage")  # dpo's seed copied
  with pytest.raises(ValueError, match=r"^algorithm my_stage: data_seed 2 is dpo's too .*leave "
                                       r"data_seed out"):
    registry.register(taken)
  assert "my_stage" not in registry.ALGORITHMS


def test_curves_panels_come_from_the_registry():
  titles = [t for t, _ in curves.panels()]
  assert titles[:2] == ["SFT loss (NLL per token)", "gradient norm"]
  lines = dict(curves.panels())
  assert ("dpo", "kl", "in step") in lines["KL(pi || ref) per token"]
  assert ("eval", "eval/kl_per_token", "on-policy samples") in lines["KL(pi || ref) per token"]
  assert lines["reward model accuracy"] == [("rm", "accuracy", "rm")]

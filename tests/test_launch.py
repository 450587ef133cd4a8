"""Flags come from the config dataclasses; the launcher runs end to end in a subprocess."""

import json
import os
import subprocess
import sys

import pytest

import configs
import records
from dpo import cli, registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_config_field_is_a_flag():
  import launch
  names = {name for name, *_ in cli.flag_fields()}
  assert {"beta", "learning_rate", "steps", "global_batch_size", "lora_rank", "lora_alpha",
          "lora_dropout", "lora_targets", "max_prompt_length", "max_target_length", "seed",
          "train_data", "output_dir"} <= names
  for name in names:
    assert name in launch.FLAGS


def test_replace_routes_fields_and_validates():
  cfg = configs.DEFAULT.replace(beta=0.5, lora_rank=8, d_model=64)
  assert (cfg.loss.beta, cfg.lora.lora_rank, cfg.model.d_model) == (0.5, 8, 64)
  try:
    configs.DEFAULT.replace(label_smoothing=0.7)
  except ValueError as e:
    assert "label_smoothing" in str(e)
  else:
    raise AssertionError("invalid label_smoothing accepted")


def _launch(*args, timeout=600):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  return subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_launch_cli_writes_its_logs_and_its_flag_file_repeats_it(tmp_path):
  """The default job as a user runs it (tiny): the log line, the evaluation table, config.json,
  flags.txt, TensorBoard events (TensorBoard's reader finds every metric of metrics.jsonl),
  an offline W&B run, curves.png; `--flagfile=<out>/flags.txt` repeats the run to the same
  summary.json figures."""
  from test_tracking import assert_mirrored
  out = tmp_path / "cli"
  proc = _launch("--beta=0.2", "--sft_steps=4", "--steps=4", "--log_every=2", "--eval_every=2",
                 "--task_train_pairs=64", "--task_sft_examples=64", "--task_eval_pairs=16",
                 "--lora_targets=q,v,o", "--task_eval_prompts=8", "--eval_max_new_tokens=8",
                 "--gradient_accumulation_steps=2", "--wandb_project=cli", "--wandb_mode=offline",
                 f"--output_dir={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "dpo     4/4" in proc.stderr
  assert "win rate (policy vs reference)" in proc.stdout  # the end-of-run evaluation table
  assert "config default; settings that differ from it: --lora_targets=q,v,o" in proc.stderr
  cfg = json.load(open(out / "config.json"))
  assert cfg["loss"]["beta"] == 0.2 and cfg["lora"]["lora_targets"] == ["q", "v", "o"]
  assert cfg["optim"]["learning_rate"] == configs.DEFAULT.optim.learning_rate  # preset kept
  lines = open(out / "flags.txt").read().split()
  assert lines[0] == "--config=default" and "--beta=0.2" in lines
  assert not [l for l in lines if l.startswith("--learning_rate")]  # only what differs
  rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
  assert {r["stage"] for r in rows} == {"sft", "dpo", "eval"}
  tb = assert_mirrored(rows, out)
  assert {"sft/loss", "dpo/loss", "dpo/kl", "eval/win_rate", "eval/perplexity"} <= set(tb)
  import matplotlib.image
  assert matplotlib.image.imread(out / "curves.png").ndim == 3
  again = tmp_path / "again"
  proc = _launch(f"--flagfile={out / 'flags.txt'}", f"--output_dir={again}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The figures: every number but timings (tests/records.py), and the config hash, which leaves
  # out the output directory (the same run in another folder).
  figures = lambda d: {k: v for k, v in
                       records.timeless(json.load(open(d / "summary.json"))).items()
                       if isinstance(v, (int, float))}
  assert len(figures(out)) > 20 and figures(again) == figures(out)
  sha = lambda d: json.load(open(d / "summary.json"))["config_sha256"]
  assert sha(again) == sha(out)


@pytest.mark.slow
def test_help_shows_the_presets_values():
  proc = _launch("--config=bench-small", "--help", timeout=300)
  assert proc.returncode == 0 and "Traceback" not in proc.stderr
  assert "--global_batch_size=4" in proc.stdout and "--config=bench-small" in proc.stdout
  assert "--vocab_size" not in proc.stdout  # --help is the common flags only
  full = _launch("--config=bench-small", "--lora_rank=4", "--helpfull", timeout=300).stdout
  names = [name for name, *_ in cli.flag_fields()]
  assert all(f"  --{n}=" in full for n in names)
  sections = [full.index(f"[{s}]") for s in configs.SECTIONS]
  assert sections == sorted(sections)  # grouped by section, in order
  assert "--vocab_size=8192" in full and "--lora_rank=4" in full  # preset, then flags given
  assert "--distributed=off" in full


@pytest.mark.slow
def test_invalid_flag_value_is_one_line_naming_flag_value_and_type():
  proc = _launch("--steps=abc", timeout=300)
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1
  assert "--steps=abc" in proc.stderr and "takes an integer" in proc.stderr
  proc = _launch("--wandb_mode=sometimes", "--traceback", timeout=300)
  assert proc.returncode == 1 and "Traceback" in proc.stderr  # --traceback shows the stack
  assert "--wandb_mode='sometimes': must be online or offline" in proc.stderr


def test_bad_flag_value_is_a_clear_error(tmp_path):
  proc = subprocess.run([sys.executable, "launch.py", "--lora_targets=q,qkv",
                         f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 2 and "--lora_targets=q,qkv: must be names from q, k, v" in proc.stderr
  assert "Traceback" not in proc.stderr  # a user error is one line, not a stack


def test_flag_nothing_reads_is_refused(tmp_path):
  proc = subprocess.run([sys.executable, "launch.py", "--loss_type=ipo", "--label_smoothing=0.1",
                         f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert "--label_smoothing=0.1: must go with a loss that reads it" in proc.stderr
  assert "none of --loss_type=ipo does" in proc.stderr


def test_sections_and_help_derive_from_the_dataclasses():
  cfg = configs.DEFAULT
  # The core sections, then each algorithm's own, in the order dpo/algorithms imports them
  # (a new stage's sections join at its place in the registry; nothing here lists them).
  owned = tuple(n for a in registry.ALGORITHMS.values() for n, _ in a.sections)
  assert configs.SECTIONS == ("model", "lora", "data", "optim", "loss", "reference", "guard",
                              "eval", "checkpoint", "mesh", "run") + owned
  assert {"reward": "rm", "grpo": "grpo", "kto": "kto"}.items() <= {
      n: a.name for a in registry.ALGORITHMS.values() for n, _ in a.sections}.items()
  sections = {name: section for name, *_, section in cli.flag_fields()}
  assert (sections["beta"], sections["label_smoothing"], sections["learning_rate"],
          sections["kl_max"], sections["eval_every"], sections["output_dir"],
          sections["num_generations"], sections["judge"], sections["rloo_beta"]) == (
              "loss", "loss", "optim", "guard", "eval", "run", "grpo", "eval", "rloo")
  assert cfg.replace(output_dir="x").loss is cfg.loss  # untouched sections are shared
  import launch
  assert launch.FLAGS["simpo_gamma"].help.startswith("[loss] SimPO / AlphaPO target reward margin")
  assert not [n for n in launch.FLAGS if n.startswith("debug_")]  # fault injection is test-only


def test_flag_lines_parse_back_to_the_same_config_for_every_preset():
  """cli.flag_lines -> absl's parser -> cli.from_flags gives the config back exactly:
  floats by repr, lists comma-joined, booleans both ways, paths with spaces."""
  import launch
  try:
    for name, preset in configs.PRESETS.items():
      targets = ("q", "k") if preset.model.n_experts else ("q", "k", "down")  # experts: none
      cfg = preset.replace(learning_rate=1.2345678901234e-5, lora_targets=targets,
                           log_kl=not preset.guard.log_kl, output_dir="/tmp/a b/c", seed=7,
                           loss_type=("sigmoid", "ipo"), loss_weights=(0.25, 0.75),
                           gradient_accumulation_steps=2, eval_split=0.1 / 3)
      lines = cli.flag_lines(cfg)
      assert lines[0] == f"--config={name}" and len(lines) == 1 + len(cli.overrides(cfg))
      launch.FLAGS.unparse_flags()
      launch.FLAGS(["launch.py", *lines])
      assert cli.from_flags() == cfg, name
  finally:
    launch.FLAGS.unparse_flags()


def test_a_presets_export_moves_with_output_dir_unless_given():
  """A preset's paths under its output_dir (smollm2-hh's export) go under --output_dir, so a run
  into another directory leaves the preset's own export alone; --export_hf given wins; the flag
  lines of each parse back to it."""
  preset = configs.get_config("smollm2-hh")
  assert preset.checkpoint.export_hf == os.path.join(preset.run.output_dir, "export")
  for argv, want in (([], preset.checkpoint.export_hf),
                     (["--output_dir=/tmp/mine"], "/tmp/mine/export"),
                     (["--output_dir=/tmp/mine", "--export_hf=/tmp/elsewhere"], "/tmp/elsewhere"),
                     (["--output_dir=/tmp/mine", "--export_hf="], "")):
    assert _parsed_and_back(["--config=smollm2-hh", *argv]).checkpoint.export_hf == want, argv
  # a preset with nothing under its output_dir: --output_dir moves nothing else
  assert cli._under_output_dir(configs.DEFAULT) == {}


def test_a_loss_on_the_command_line_runs_without_the_presets_rpo_term():
  """The default preset adds RPO's NLL (rpo_alpha) to its sigmoid loss; --loss_type=X runs X
  alone (a reference-free loss too, which RPO would not apply to), unless --rpo_alpha is given;
  the flag lines of either config parse back to it."""
  assert configs.DEFAULT.loss.rpo_alpha > 0
  for argv, want in ((["--loss_type=simpo"], 0.0), (["--loss_type=ipo"], 0.0),
                     (["--loss_type=ipo", "--rpo_alpha=0.5"], 0.5), ([], configs.DEFAULT.loss.rpo_alpha),
                     (["--loss_type=" + ",".join(configs.DEFAULT.loss.loss_type)],
                      configs.DEFAULT.loss.rpo_alpha)):
    assert _parsed_and_back(argv).loss.rpo_alpha == want, argv


def _parsed_and_back(argv: list[str]) -> configs.Config:
  """The config of a command line (cli.from_flags), checked to come back from its flag lines."""
  import launch
  try:
    launch.FLAGS.unparse_flags()
    launch.FLAGS(["launch.py", *argv])
    cfg = cli.from_flags()
    launch.FLAGS.unparse_flags()
    launch.FLAGS(["launch.py", *cli.flag_lines(cfg)])
    assert cli.from_flags() == cfg, argv
    return cfg
  finally:
    launch.FLAGS.unparse_flags()

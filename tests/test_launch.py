"""Flags come from the config dataclasses; the launcher runs end to end in a subprocess."""

import json
import os
import subprocess
import sys

import configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_config_field_is_a_flag():
  import launch
  names = {name for name, *_ in configs.flag_fields()}
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


def test_launch_cli(tmp_path):
  out = tmp_path / "cli"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  proc = subprocess.run(
      [sys.executable, "launch.py", "--beta=0.2", "--sft_steps=4", "--steps=4", "--log_every=2",
       "--task_train_pairs=64", "--task_sft_examples=64", "--task_eval_pairs=16",
       "--lora_targets=q,v,o", "--task_eval_prompts=8", "--eval_max_new_tokens=8",
       f"--output_dir={out}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "dpo     4/4" in proc.stderr
  assert "true-reward win rate" in proc.stdout  # the end-of-run evaluation table
  cfg = json.load(open(out / "config.json"))
  assert cfg["loss"]["beta"] == 0.2 and cfg["lora"]["lora_targets"] == ["q", "v", "o"]
  assert cfg["optim"]["learning_rate"] == configs.DEFAULT.optim.learning_rate  # preset kept


def test_bad_flag_value_is_a_clear_error(tmp_path):
  proc = subprocess.run([sys.executable, "launch.py", "--lora_targets=q,qkv",
                         f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 2 and "unknown lora_targets" in proc.stderr
  assert "Traceback" not in proc.stderr  # a user error is one line, not a stack


def test_flag_nothing_reads_is_refused(tmp_path):
  proc = subprocess.run([sys.executable, "launch.py", "--loss_type=ipo", "--label_smoothing=0.1",
                         f"--output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert "--label_smoothing=0.1 is read by none of --loss_type=ipo" in proc.stderr


def test_sections_and_help_derive_from_the_dataclasses():
  cfg = configs.DEFAULT
  assert configs.SECTIONS == ("model", "lora", "data", "optim", "loss", "reference", "guard",
                              "eval", "checkpoint", "mesh", "run")
  sections = {name: section for name, *_, section in configs.flag_fields()}
  assert (sections["beta"], sections["label_smoothing"], sections["learning_rate"],
          sections["kl_max"], sections["eval_every"], sections["output_dir"]) == (
              "loss", "loss", "optim", "guard", "eval", "run")
  assert cfg.replace(output_dir="x").loss is cfg.loss  # untouched sections are shared
  import launch
  assert launch.FLAGS["simpo_gamma"].help.startswith("[loss] SimPO / AlphaPO target reward margin")
  assert not [n for n in launch.FLAGS if n.startswith("debug_")]  # fault injection is test-only

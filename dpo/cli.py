"""The command line of a config: one absl flag per config field, the flag-file lines that rebuild
a config, and the help text.

Every field of every section of `configs.Config` is a flag of the same name (`define_flags`);
`from_flags` is the preset named by --config with the flags given applied. `flag_lines` is the
inverse: the lines of a flag file (`--config=PRESET` and each field that differs from it) that
rebuild a config, which a run writes to <output_dir>/flags.txt; `help_text` is what
`launch.py --help` prints. configs.py does not import this module.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
import typing
from typing import Any

from absl import flags, logging

import configs
from configs import Config


def flag_fields():
  """Yields (name, type, default, help, section) for every config field."""
  sections = typing.get_type_hints(Config)
  for section in configs.SECTIONS:
    cls = sections[section]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      yield f.name, hints[f.name], f.default, f.metadata["help"], section


def define_flags() -> None:
  """Defines one absl flag per config field (unset = the preset's value); --config (the run
  section's `config` field) picks the preset."""
  define = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
            str: flags.DEFINE_string}
  for name, ftype, default, help_text, section in flag_fields():
    if name == "config":
      flags.DEFINE_string("config", default,
                          f"[{section}] {help_text} One of {sorted(configs.PRESETS)}.")
      continue
    help_text = f"[{section}] {help_text} (preset value if unset; base default {default!r})"
    if typing.get_origin(ftype) is tuple:
      flags.DEFINE_list(name, None, help_text)
    elif ftype in define:
      define[ftype](name, None, help_text)
    else:
      raise TypeError(f"no flag type for config field {name}: {ftype}")


def from_flags() -> Config:
  """The preset named by --config with every flag given on the command line applied."""
  values = flags.FLAGS
  overrides = {}
  for name, ftype, *_ in flag_fields():
    value = values[name].value
    if value is not None and name != "config":
      if isinstance(value, list):  # list flags arrive as strings; convert to the element type
        elem = typing.get_args(ftype)[0]
        try:
          value = tuple(elem(v) for v in value)
        except ValueError:
          raise ValueError(f"--{name}={','.join(value)}: each item must be "
                           f"{elem.__name__}") from None
      overrides[name] = value
  preset = configs.get_config(values.config)
  if _drops_preset_rpo(preset, overrides.get("loss_type", preset.loss.loss_type)) and (
      "rpo_alpha" not in overrides):
    logging.info("--loss_type=%s: without the preset's RPO term (--rpo_alpha=%g goes with its "
                 "loss %s); give --rpo_alpha to add it", ",".join(overrides["loss_type"]),
                 preset.loss.rpo_alpha, ",".join(preset.loss.loss_type))
    overrides["rpo_alpha"] = 0.0
  if "output_dir" in overrides:  # the preset's paths under its output_dir move with it
    for name, rest in _under_output_dir(preset).items():
      overrides.setdefault(name, os.path.join(overrides["output_dir"], rest))
  return preset.replace(**overrides)


def _under_output_dir(preset: Config) -> dict[str, str]:
  """{field: its path below the preset's output_dir} for the preset's other paths under it (a
  preset's export, say): with --output_dir they go under that, unless given themselves, so a
  second run of a preset into another directory does not write over the first's."""
  root = os.path.join(preset.run.output_dir, "")
  return {name: value[len(root):] for name, value in flat(preset).items()
          if name != "output_dir" and isinstance(value, str) and value.startswith(root)}


def _drops_preset_rpo(preset: Config, loss_type: tuple[str, ...]) -> bool:
  """Whether `loss_type` runs without the preset's RPO term unless --rpo_alpha is given: the
  term is part of the preset's own loss recipe, so --loss_type=ipo runs IPO as its paper
  defines it, and a reference-free loss (which RPO does not apply to) runs."""
  return bool(preset.loss.rpo_alpha) and loss_type != preset.loss.loss_type


def flat(cfg: Config) -> dict[str, Any]:
  """{field name: value} over every section."""
  return {name: getattr(getattr(cfg, section), name) for name, *_, section in flag_fields()}


def overrides(cfg: Config) -> dict[str, Any]:
  """The fields whose value differs from the preset the config names (cfg.run.config)."""
  preset = configs.get_config(cfg.run.config)
  base = flat(preset)
  out = {k: v for k, v in flat(cfg).items() if v != base[k]}
  if _drops_preset_rpo(preset, cfg.loss.loss_type):  # from_flags would drop it; keep it explicit
    out.setdefault("rpo_alpha", cfg.loss.rpo_alpha)
  if "output_dir" in out:  # from_flags would move them under it; keep them explicit
    for name in _under_output_dir(preset):
      out.setdefault(name, base[name])
  return out


def flag_value(value: Any) -> str:
  """A field value as its flag parses it back: exact float repr, comma-joined tuples."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, tuple):
    return ",".join(flag_value(v) for v in value)
  return repr(value) if isinstance(value, float) else str(value)


def flag_lines(cfg: Config) -> list[str]:
  """The command line that rebuilds `cfg`: --config=PRESET and each field that differs from it
  (`python launch.py --flagfile=FILE` with these lines, one per line, repeats the run)."""
  lines = [f"--config={cfg.run.config}"]
  for name, value in overrides(cfg).items():
    if isinstance(value, str) and "\n" in value:
      raise ValueError(f"--{name}: a value with a newline cannot be written to a flag file")
    lines.append(f"--{name}={flag_value(value)}")
  return lines


# The flags `--help` lists (the table of docs/flags.md); `--helpfull` lists every field by section.
COMMON_FLAGS = (
    "config", "stage", "steps", "sft_steps", "global_batch_size", "gradient_accumulation_steps",
    "learning_rate", "sft_learning_rate", "loss_type", "beta", "lora_rank", "lora_targets",
    "train_data", "eval_data", "tokenizer", "chat_template", "max_prompt_length",
    "max_target_length", "init_from", "ref_init_from", "precompute_ref", "base_quant",
    "eval_every", "log_kl", "checkpoint_every", "export_hf", "mesh", "wandb_project", "seed",
    "output_dir")


def flag_help(name: str, value: Any, help_text: str, width: int = 100) -> list[str]:
  head = f"  --{name}={flag_value(value)}"
  return [head, *textwrap.wrap(help_text, width, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)]


def help_text(cfg: Config, full: bool) -> str:
  """Flag help with the values of `cfg` (the chosen preset and the flags given): the common
  flags, or (full) every field grouped by section, marking values that differ from the base."""
  fields = {name: (help_text, section) for name, _, _, help_text, section in flag_fields()}
  values, base = flat(cfg), flat(Config())
  note = lambda n: (f" (base default {flag_value(base[n])})"
                    if values[n] != base[n] and n != "config" else "")
  out = [f"Values below are those of --config={cfg.run.config} with the flags given."]
  if not full:
    out.append("Common flags:")
    for name in COMMON_FLAGS:
      out += flag_help(name, values[name], fields[name][0] + note(name))
    out.append("All flags by section: --helpfull. Every flag may also go in a file read with "
               "--flagfile=FILE (a run writes <output_dir>/flags.txt).")
    return "\n".join(out)
  for section in configs.SECTIONS:
    out.append(f"\n[{section}]")
    for name, (h, s) in fields.items():
      if s == section:
        out += flag_help(name, values[name], h + note(name))
  return "\n".join(out)

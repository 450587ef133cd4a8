"""Launch a run: `python launch.py --beta=0.1` (SFT, then DPO, on the embedded default task).

Flags are generated from the config dataclasses in configs.py: every field is a flag of the same
name. `--config` picks a preset; a flag given on the command line overrides the preset's value.
"""

from __future__ import annotations

import typing

from absl import app, flags, logging

import configs

flags.DEFINE_string("config", "default", f"Preset from configs.py: {sorted(configs.PRESETS)}.")


def _define_config_flags() -> None:
  for name, ftype, default, help_text, _ in configs.flag_fields():
    help_text = f"{help_text} [preset value if unset; base default {default!r}]"
    t = ftype
    if t is bool:
      flags.DEFINE_bool(name, None, help_text)
    elif t is int:
      flags.DEFINE_integer(name, None, help_text)
    elif t is float:
      flags.DEFINE_float(name, None, help_text)
    elif t is str:
      flags.DEFINE_string(name, None, help_text)
    elif typing.get_origin(t) is tuple:
      flags.DEFINE_list(name, None, help_text)
    else:
      raise TypeError(f"no flag type for config field {name}: {ftype}")


_define_config_flags()
FLAGS = flags.FLAGS


def config_from_flags() -> configs.Config:
  cfg = configs.get_config(FLAGS.config)
  overrides = {}
  for name, ftype, *_ in configs.flag_fields():
    value = FLAGS[name].value
    if value is not None:
      if isinstance(value, list):  # list flags arrive as strings; convert to the element type
        value = tuple(typing.get_args(ftype)[0](v) for v in value)
      overrides[name] = value
  return cfg.replace(**overrides)


def main(argv) -> None:
  del argv
  logging.set_verbosity(logging.INFO)
  from dpo import loop  # imported after flag parsing so JAX starts with the final environment
  cfg = config_from_flags()
  loop.run(cfg)


if __name__ == "__main__":
  app.run(main)

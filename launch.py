"""Launch a run: `python launch.py --beta=0.1` (SFT, then DPO, on the embedded default task).

Flags are generated from the config dataclasses in configs.py: every field is a flag of the same
name. `--config` picks a preset; a flag given on the command line overrides the preset's value.
Multi-host: one process per host with `--distributed=auto` (TPU pods, SLURM) or
`--distributed=explicit --coordinator_address=HOST:PORT --num_processes=N --process_id=i`;
see WORKSPACE.md, "Sharding and multi-host".
"""

from __future__ import annotations

import typing

from absl import app, flags, logging

import configs

flags.DEFINE_string("config", "default", f"Preset from configs.py: {sorted(configs.PRESETS)}.")
# Per-process settings, not part of the experiment's config (they differ between processes).
flags.DEFINE_enum("distributed", "off", ["off", "auto", "explicit"],
                  "Multi-process mode: off; auto = jax.distributed.initialize() detects the "
                  "cluster (TPU pod, SLURM, ...); explicit = the three flags below.")
flags.DEFINE_string("coordinator_address", "", "HOST:PORT of process 0 (--distributed=explicit).")
flags.DEFINE_integer("num_processes", None, "Total processes, one per host (explicit mode).")
flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
flags.DEFINE_integer("heartbeat_timeout_seconds", 100,
                     "A process silent this long is declared dead and the others exit.")
flags.DEFINE_integer("initialization_timeout", 300,
                     "Seconds to wait for all processes to join before failing.")


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
  for name, *_ in configs.flag_fields():
    value = FLAGS[name].value
    if value is not None:
      overrides[name] = tuple(value) if isinstance(value, list) else value
  return cfg.replace(**overrides)


def main(argv) -> None:
  del argv
  logging.set_verbosity(logging.INFO)
  cfg = config_from_flags()
  from dpo import distributed  # imported after flag parsing so JAX starts with the final environment
  distributed.initialize(FLAGS.distributed, FLAGS.coordinator_address, FLAGS.num_processes,
                         FLAGS.process_id, FLAGS.heartbeat_timeout_seconds,
                         FLAGS.initialization_timeout)
  import jax
  if jax.process_index() != 0:
    logging.set_verbosity(logging.WARNING)  # only process 0 logs progress
  from dpo import loop
  loop.run(cfg)


if __name__ == "__main__":
  app.run(main)

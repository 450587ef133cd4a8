"""Launch a run: `python launch.py --beta=0.1` (SFT, then DPO, on the embedded default task).

Flags are generated from the config dataclasses (configs.define_flags): every field is a flag of
the same name. `--config` picks a preset; a flag given on the command line overrides the preset's
value. Multi-host: one process per host with `--distributed=auto` (TPU pods, SLURM) or
`--distributed=explicit --coordinator_address=HOST:PORT --num_processes=N --process_id=i`;
see WORKSPACE.md, "Multi-host".
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

import configs

configs.define_flags()
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
FLAGS = flags.FLAGS


def _user_error(e: Exception) -> None:
  """A bad flag, file or checkpoint: one line naming it, no traceback, exit status 2."""
  print(f"error: {e}", file=sys.stderr)
  raise SystemExit(2) from None


def main(argv) -> None:
  del argv
  logging.set_verbosity(logging.INFO)
  try:
    cfg = configs.from_flags()
  except ValueError as e:
    _user_error(e)
  from dpo import distributed  # imported after flag parsing so JAX starts with the final environment
  distributed.initialize(FLAGS.distributed, FLAGS.coordinator_address, FLAGS.num_processes,
                         FLAGS.process_id, FLAGS.heartbeat_timeout_seconds,
                         FLAGS.initialization_timeout)
  import jax
  if jax.process_index() != 0:
    logging.set_verbosity(logging.WARNING)  # only process 0 logs progress
  from dpo import checkpoint, data, loop
  try:
    loop.run(cfg)
    distributed.finished()
  except (data.DataError, checkpoint.CheckpointError) as e:
    _user_error(e)
  except loop.TrainingStopped as e:
    logging.error("training stopped: %s", e)
    raise SystemExit(3) from None
  except Exception as e:  # a collective that failed because a peer died: one line, exit 4
    distributed.exit_if_peer_lost(e)
    raise


if __name__ == "__main__":
  app.run(main)

"""Launch a run: `python launch.py --beta=0.1` (SFT, then DPO, on the embedded default task).

Flags are generated from the config dataclasses (dpo.cli.define_flags): every field is a flag
of the same name. `--config` picks a preset; a flag given on the command line overrides the
preset's value. `--help` lists the common flags and `--helpfull` every flag by section, both
with the values of the chosen preset; a run writes <output_dir>/flags.txt, and
`python launch.py --flagfile=<output_dir>/flags.txt` repeats it. Multi-host: one process per
host with `--distributed=auto` (TPU pods, SLURM) or
`--distributed=explicit --coordinator_address=HOST:PORT --num_processes=N --process_id=i`;
see WORKSPACE.md, "Multi-host".
"""

from __future__ import annotations

import re
import sys
import traceback

if __name__ == "__main__":  # first, before imports a re-exec would repeat (dpo/hostmem.py)
  from dpo import hostmem
  hostmem.reexec_with_huge_pages()  # a step's temporaries on transparent huge pages

from absl import app, flags, logging  # noqa: E402


def _imports(argv: list[str]) -> list[list[str]]:
  """The values of --imports in `argv` and in the files of its --flagfile flags, in order, each
  as its list of modules."""
  found = []
  for i, arg in enumerate(argv):
    name, eq, value = arg.partition("=")
    if not eq and i + 1 < len(argv) and name in ("--imports", "--flagfile"):
      value = argv[i + 1]
    if name == "--imports":
      found.append([m.strip() for m in value.split(",") if m.strip()])
    elif name == "--flagfile" and value:
      try:
        with open(value) as f:
          found += _imports([line.strip() for line in f if line.strip()])
      except OSError:
        pass  # absl names the file
  return found


def _import_forks(argv: list[str]) -> None:
  """--imports=MODULE,...: a fork's own losses and stages, imported before dpo.cli builds the
  config and its flags from the registries, so they register as the built-in ones do. A module
  that is not there or fails to import is one line (--traceback: the traceback)."""
  import importlib
  given = _imports(argv)
  if len(given) > 1:  # absl would keep the last alone, and flags.txt with it
    print("error: --imports: give it once, its modules comma-separated", file=sys.stderr)
    raise SystemExit(2)
  for module in given[0] if given else ():
    try:
      importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 (the user's module: any failure is its one line)
      if "--traceback" in argv:
        raise
      if isinstance(e, ModuleNotFoundError) and e.name in (module, module.split(".")[0]):
        why = (f"no module named {module!r} on the path (launch.py's folder, PYTHONPATH)")
      else:
        why = f"importing it failed: {type(e).__name__}: {e}"
      print(f"error: --imports={module}: {why}", file=sys.stderr)
      raise SystemExit(2) from None


if __name__ == "__main__":
  _import_forks(sys.argv[1:])

from dpo import cli  # noqa: E402

cli.define_flags()
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
flags.DEFINE_bool("fail_on_verdict", False, "Exit with status 5 when a recipe target of the "
                  "final verdict (win rate, KL band, perplexity, well-formed samples) FAILs.")
flags.DEFINE_bool("traceback", False, "Show the Python traceback of a user error (a bad flag "
                  "value, file or checkpoint) instead of the one-line message.")
FLAGS = flags.FLAGS
_PROCESS_FLAGS = ("distributed", "coordinator_address", "num_processes", "process_id",
                  "heartbeat_timeout_seconds", "initialization_timeout", "traceback",
                  "fail_on_verdict")
_HELP = {"--help": False, "-h": False, "--helpshort": False, "-?": False, "--helpfull": True}


def _user_error(e: Exception) -> None:
  """A bad flag, file or checkpoint: one line naming it, no traceback, exit status 2."""
  if "--traceback" in sys.argv or (FLAGS.is_parsed() and FLAGS.traceback):
    raise e
  print(f"error: {e}", file=sys.stderr)
  _exit(2)


def _exit(status: int) -> None:
  """Exit with `status`; in a multi-process run its peers are told (dpo/distributed.py)."""
  if "dpo.distributed" in sys.modules:
    sys.modules["dpo.distributed"].exit_on_error(status)
  raise SystemExit(status) from None


def _parse(argv: list[str]) -> list[str]:
  """absl's parse with `--help` / `--helpfull` showing the chosen preset's values and a bad
  flag value as one line."""
  full = [_HELP[a] for a in argv if a in _HELP]
  try:
    rest = FLAGS([a for a in argv if a not in _HELP])
    cfg = cli.from_flags() if full else None
  except flags.IllegalFlagValueError as e:
    name = re.match(r"flag --(\w+)=", str(e))
    kinds = {"int": "an integer", "float": "a number", "bool": "true or false"}
    kind = name and name[1] in FLAGS and kinds.get(FLAGS[name[1]].flag_type())
    _user_error(ValueError(f"{e}; --{name[1]} takes {kind}") if kind else e)
  except (flags.Error, ValueError) as e:
    _user_error(e)
  if full:
    print((__doc__.split("\n\n")[0] + "\n\n" + cli.help_text(cfg, any(full))))
    if any(full):
      print("\n[launcher: per-process settings]")
      for name in _PROCESS_FLAGS:
        print("\n".join(cli.flag_help(name, FLAGS[name].value, FLAGS[name].help)))
    raise SystemExit(0)
  return rest


def _check_inputs(cfg) -> None:
  """One line naming the flag and the file for an input that cannot be read: data that does
  not exist (a glob that matches nothing, a folder save_to_disk did not write, Parquet without
  pyarrow, a Hub name that does not resolve: dpo/data.py, dpo/hub.py), an --init_from that
  holds no full model (dpo/checkpoint.py), a judge that cannot be built (dpo/judges.py)."""
  from dpo import checkpoint, data, hub  # after distributed start-up, as main's imports
  cfg = hub.resolve(cfg)  # Hub model names -> their snapshot folders (loop.run does it again)
  for flag in data.DATA_FLAGS:
    data.check_sources(flag, getattr(cfg.data, flag))
  if cfg.checkpoint.init_from:
    checkpoint.check_model_source("init_from", cfg.checkpoint.init_from)
  from dpo import judges
  judges.check(cfg)


def _prepare_inputs(cfg) -> None:
  """A preset whose inputs a tool builds (configs.PREPARE: SmolLM2's folder from its GGUF, say)
  builds them on first use, in a single-process run; a multi-process run needs them on every
  host already, so it is left to `_check_inputs` to name what is missing."""
  import importlib

  import jax

  import configs
  target = configs.PREPARE.get(cfg.run.config)
  if target and jax.process_count() == 1:
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(cfg)


def main(argv) -> None:
  del argv
  logging.set_verbosity(logging.INFO)
  try:
    cfg = cli.from_flags()
  except ValueError as e:
    _user_error(e)
  from dpo import hostmem
  hostmem.trim_after_compiles()  # the compiler's freed heap is not resident under a step's run
  from dpo import distributed  # imported after flag parsing so JAX starts with the final environment
  try:
    distributed.initialize(FLAGS.distributed, FLAGS.coordinator_address, FLAGS.num_processes,
                           FLAGS.process_id, FLAGS.heartbeat_timeout_seconds,
                           FLAGS.initialization_timeout)
  except ValueError as e:
    _user_error(e)
  import jax
  if jax.process_index() != 0:
    logging.set_verbosity(logging.WARNING)  # only process 0 logs progress
  from dpo import checkpoint, data, loop, tracking
  try:
    _prepare_inputs(cfg)
    _check_inputs(cfg)
    summary = loop.run(cfg)
    distributed.finished()
  except (ValueError, data.DataError, checkpoint.CheckpointError, tracking.MissingExtra) as e:
    _user_error(e)
  except loop.TrainingStopped as e:
    logging.error("training stopped: %s", e)
    _exit(3)
  except Exception as e:  # a collective that failed because a peer died: one line, exit 4
    distributed.exit_if_peer_lost(e)
    if jax.process_count() > 1:  # the traceback, then the peers are told
      traceback.print_exc()
      _exit(1)
    raise
  failed = [v["target"] for v in summary.get("verdicts", ()) if v["verdict"] == "FAIL"]
  if failed and FLAGS.fail_on_verdict:
    print(f"error: --fail_on_verdict: recipe targets failed: {', '.join(failed)}", file=sys.stderr)
    raise SystemExit(5)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse)

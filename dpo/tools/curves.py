"""Draws a run directory's metrics.jsonl as one PNG page (dpo/curves.py; needs matplotlib).

    python -m dpo.tools.curves --run_dir=runs/default [--out=curves.png]

Loss, reward accuracy and margin, chosen / rejected rewards, KL, gradient norm, learning rate,
evaluation win rate and perplexity over steps, rollbacks marked. The default job writes
<output_dir>/curves.png itself; this redraws any run, also one still in progress.
"""

from absl import app, flags

from dpo import algorithms  # noqa: F401 (importing it registers every stage and its curves)
from dpo import curves

FLAGS = flags.FLAGS


def main(argv) -> None:
  del argv
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    raise SystemExit(f"error: the curves need matplotlib: {curves.INSTALL}") from None
  print(curves.render_run(FLAGS.run_dir, FLAGS.out))


if __name__ == "__main__":
  flags.DEFINE_string("run_dir", None, "A run's output directory (holding metrics.jsonl).")
  flags.DEFINE_string("out", "", "The PNG written; empty = <run_dir>/curves.png.")
  flags.mark_flag_as_required("run_dir")
  app.run(main)

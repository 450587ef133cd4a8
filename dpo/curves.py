"""A run's metrics.jsonl drawn as one PNG page (matplotlib, the `matplotlib` extra).

Panels over steps: SFT and DPO loss, reward accuracy and margin (training, and held-out at each
evaluation), chosen / rejected rewards, token KL (the step's, and the evaluation's on-policy KL
per token), gradient norm, learning rate, evaluation win rate and chosen perplexity. KL-spike
rollbacks are dashed red lines on every DPO panel. `python -m dpo.tools.curves --run_dir=DIR`
draws any run; the default job writes <output_dir>/curves.png itself.
"""

from __future__ import annotations

import json
import os

INSTALL = "pip install 'dpo-jax[matplotlib]'"

# (title, [(stage, key, label)]); stage "eval" series are the evaluation records.
PANELS = (
    ("SFT loss (NLL per token)", [("sft", "loss", "sft")]),
    ("DPO loss", [("dpo", "loss", "train")]),
    ("reward accuracy", [("dpo", "rewards/accuracies", "train"),
                         ("eval", "eval/reward_accuracy", "held-out")]),
    ("reward margin", [("dpo", "rewards/margins", "train"),
                       ("eval", "eval/reward_margin", "held-out")]),
    ("implicit rewards", [("dpo", "rewards/chosen", "chosen"),
                          ("dpo", "rewards/rejected", "rejected")]),
    ("KL(pi || ref) per token", [("dpo", "kl", "in step"),
                                 ("eval", "eval/kl_per_token", "on-policy samples")]),
    ("gradient norm", [("dpo", "grad_norm", "dpo"), ("sft", "grad_norm", "sft")]),
    ("learning rate", [("dpo", "learning_rate", "dpo"), ("sft", "learning_rate", "sft")]),
    ("evaluation win rate (judge)", [("eval", "eval/win_rate", "policy vs reference"),
                                     ("eval", "eval/lc_win_rate", "length-controlled")]),
    ("held-out chosen perplexity", [("eval", "eval/perplexity", "policy")]),
)


def read(path: str) -> list[dict]:
  """The records of a metrics.jsonl (errors name the file and line)."""
  records = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if line.strip():
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{n}: not a JSON record ({e.msg})") from None
  return records


def series(records: list[dict], stage: str, key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of `key` in the records of `stage` (events and nulls left out)."""
  pts = [(r["step"], r[key]) for r in records
         if r.get("stage") == stage and "event" not in r and isinstance(r.get(key), (int, float))]
  return [p[0] for p in pts], [p[1] for p in pts]


def render(records: list[dict], out: str, title: str = "") -> str:
  """Draws PANELS from `records` into the PNG `out`; returns `out`."""
  from matplotlib.figure import Figure  # the object API: no pyplot, no global backend
  rollbacks = [r["step"] for r in records if r.get("event") == "rollback"]
  fig = Figure(figsize=(22, 8.5), layout="constrained")
  axes = fig.subplots(2, 5).ravel()
  for ax, (name, lines) in zip(axes, PANELS):
    drawn, marked = 0, False
    for stage, key, label in lines:
      x, y = series(records, stage, key)
      if x:
        ax.plot(x, y, marker="o" if stage == "eval" or len(x) < 3 else None, ms=3, label=label)
        drawn += 1
    if not drawn:
      ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes,
              color="gray")
    if rollbacks and any(stage in ("dpo", "eval") for stage, *_ in lines):
      marked = True
      for n, step in enumerate(rollbacks):
        ax.axvline(step, color="red", ls="--", lw=1, label=None if n else "rollback")
    if name == "learning rate":
      ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.grid(alpha=0.3)
    if drawn > 1 or marked:
      ax.legend(fontsize=7)
  if title:
    fig.suptitle(title)
  fig.savefig(out, dpi=80)
  return out


def render_run(run_dir: str, out: str = "") -> str:
  """<run_dir>/metrics.jsonl -> `out` (default <run_dir>/curves.png)."""
  out = out or os.path.join(run_dir, "curves.png")
  return render(read(os.path.join(run_dir, "metrics.jsonl")), out, title=run_dir)

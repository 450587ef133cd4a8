"""A run's metrics.jsonl drawn as one PNG page (matplotlib, the `matplotlib` extra).

Panels over steps: each registered algorithm's lines (registry.Algorithm.curves: SFT and DPO
loss, reward accuracy and margin, chosen / rejected rewards, token KL, gradient norm, learning
rate, ...) with the evaluation's beside them (held-out accuracy and margin, on-policy KL per
token, win rate, chosen perplexity), and a mixture of experts' router figures (`ROUTER`) when the
run logs them. KL-spike rollbacks are dashed red lines on every panel of
a judged stage or the evaluation. `python -m dpo.tools.curves --run_dir=DIR`
draws any run; the default job writes <output_dir>/curves.png itself.
"""

from __future__ import annotations

import json
import math
import os

from dpo import registry

INSTALL = "pip install 'dpo-jax[matplotlib]'"

# The evaluation's lines, (title, key, label), joining an algorithm's panel of the same title.
EVAL = (("reward accuracy", "eval/reward_accuracy", "held-out"),
        ("reward margin", "eval/reward_margin", "held-out"),
        ("KL(pi || ref) per token", "eval/kl_per_token", "on-policy samples"),
        ("evaluation win rate (judge)", "eval/win_rate", "policy vs reference"),
        ("evaluation win rate (judge)", "eval/lc_win_rate", "length-controlled"),
        ("held-out chosen perplexity", "eval/perplexity", "policy"))

# A mixture of experts' router figures (models/moe.py), one line per stage that logs them; drawn
# only for a run that has them.
ROUTER = (("router load-balancing loss", "router_aux_loss"),
          ("busiest expert's load x E (1: balanced)", "expert_load_max"))


def panels() -> list[tuple[str, list[tuple[str, str, str]]]]:
  """[(title, [(stage, key, label)])]: the registered algorithms' lines in registration order,
  then the evaluation's ("eval" records); a title names one panel."""
  out: dict[str, list] = {}
  for algorithm in registry.ALGORITHMS.values():
    for title, key, label in algorithm.curves:
      out.setdefault(title, []).append((algorithm.name, key, label))
  for title, key, label in EVAL:
    out.setdefault(title, []).append(("eval", key, label))
  return list(out.items())


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


def layout(records: list[dict]) -> list[tuple[str, list[tuple[str, str, str]]]]:
  """The panels drawn for `records`: those of `panels()` with a stage the run had (all of them
  for a run with none), then the router's (`ROUTER`) where stages logged them."""
  present = {r.get("stage") for r in records}  # a stage the run did not have gets no panel
  every = panels()
  shown = [p for p in every if any(stage in present for stage, *_ in p[1])] or every
  for name, key in ROUTER:
    stages = sorted({r["stage"] for r in records if key in r and "stage" in r})
    if stages:
      shown.append((name, [(stage, key, stage) for stage in stages]))
  return shown


def render(records: list[dict], out: str, title: str = "") -> str:
  """Draws `layout(records)` from `records` into the PNG `out`; returns `out`."""
  from matplotlib.figure import Figure  # the object API: no pyplot, no global backend
  rollbacks = [r["step"] for r in records if r.get("event") == "rollback"]
  guarded = {"eval", *(a.name for a in registry.ALGORITHMS.values() if a.judged)}
  shown = layout(records)
  rows = math.ceil(len(shown) / 5)
  fig = Figure(figsize=(22, 4.25 * rows), layout="constrained")
  axes = fig.subplots(rows, 5).ravel()
  for ax in axes[len(shown):]:
    ax.set_axis_off()
  for ax, (name, lines) in zip(axes, shown):
    drawn, marked = 0, False
    for stage, key, label in lines:
      x, y = series(records, stage, key)
      if x:
        ax.plot(x, y, marker="o" if stage == "eval" or len(x) < 3 else None, ms=3, label=label)
        drawn += 1
    if not drawn:
      ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes,
              color="gray")
    if rollbacks and any(stage in guarded for stage, *_ in lines):
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

"""The reward-KL frontier (the DPO paper's Figure 2, Rafailov et al. 2023), on the embedded task
under its true reward, or on your data under a judge (dpo/judges.py).

    python -m dpo.tools.frontier --output_dir=runs/frontier
    python -m dpo.tools.frontier --train_data=pairs.jsonl --eval_split=0.1 \
        --judge=runs/rm/checkpoints/rm_model --init_from=runs/rm/checkpoints/sft_model

One SFT model is the reference and the starting point of every method: the preset's SFT stage,
trained once under <output_dir>/sft, or with --init_from an SFT model already trained (the
default job's runs/default/checkpoints/sft_model, so the sweep does not train it again):
  * DPO (sigmoid loss, without the preset's RPO term: the paper's method) at each beta of
    --betas, one run each;
  * Preferred-FT: supervised fine-tuning on the chosen responses of the same pairs (the `sft`
    loss of dpo/losses.py: the chosen NLL, no reference), with the same LoRA and schedule;
  * with --online_methods=online_dpo --online_methods=iterative_dpo --online_methods=grpo
    --online_methods=rloo --online_methods=ppo, online DPO, iterative DPO, GRPO, RLOO and PPO
    (dpo/algorithms/), the same
    number of DPO steps from the same SFT model (iterative DPO: --iterative_rounds rounds of
    --steps / rounds steps), their samples labelled by the judge;
  * best-of-N from the SFT model, N in --best_of: --best_of_max samples per prompt drawn once,
    the first N of them ranked by the judge. Its KL is the analytic log N - (N - 1) / N
    (Stiennon et al. 2020, app. G.3; an upper bound, Beirami et al. 2024).
Each DPO and Preferred-FT run is evaluated every --eval_every steps, so a run contributes one
point per evaluation: the judge's mean reward of the policy's samples against KL(policy || SFT) per
sequence (nats), both from dpo/evaluate.py on the held-out prompts. The tool writes
<output_dir>/frontier.jsonl (one record per point), frontier.md (the table and the area under
each method's curve) and, with matplotlib installed, frontier.png.

The area under a curve is the trapezoid integral of its upper envelope (best reward reached at
KL <= k) over [0, --kl_range] nats, divided by --kl_range: a mean reward over that KL budget,
comparable between methods.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import app, flags

from dpo import cli, evaluate, judges, loop
from dpo.tools import compare_losses
from models import sharding

FLAGS = flags.FLAGS


def run_points(cfg, mesh, params, method: str, value: float) -> list[dict]:
  """One DPO-stage run from the SFT model; a point per evaluation in its metrics.jsonl."""
  t = time.perf_counter()
  loop.run(cfg, mesh, init_params=params)
  points = []
  with open(os.path.join(cfg.run.output_dir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if r["stage"] == "eval":
        if not points:  # every run starts at the SFT model: KL 0, its samples' mean reward
          points.append({"method": method, "param": value, "step": 0, "kl_per_sequence": 0.0,
                         "reward": r["eval/reference_reward"],
                         "wellformed_rate": r["eval/reference_wellformed_rate"]})
        points.append({"method": method, "param": value, "step": r["step"],
                       "kl_per_sequence": r["eval/kl_per_sequence"],
                       "reward": r["eval/policy_reward"],
                       "wellformed_rate": r["eval/policy_wellformed_rate"]})
  print(f"{method} {value}: {len(points)} points in {time.perf_counter() - t:.0f}s", flush=True)
  return points


ONLINE = {"online_dpo": "online DPO", "iterative_dpo": "iterative DPO", "grpo": "GRPO",
          "rloo": "RLOO", "ppo": "PPO"}


def online_config(cfg, method: str, output_dir: str):
  """An online method's run from the SFT model for as many steps as each DPO run, on the same
  prompts: online DPO and iterative DPO (--iterative_rounds rounds of --steps / rounds steps,
  each round's pool one pair per prompt of its steps' batches) with the sigmoid loss at
  --online_beta, GRPO with the k3 KL weighted by it, RLOO with the sequence KL in the reward
  weighted by it and as many completions a prompt as GRPO (--num_generations' default), PPO with
  the token KL in the rewards weighted by it (one completion a prompt, its separate value
  model); completions as long as the evaluation's."""
  new = cfg.eval.eval_max_new_tokens or cfg.data.max_target_length
  if method == "iterative_dpo":
    rounds = cfg.iterative.iterative_rounds
    if cfg.optim.steps % rounds:
      raise app.UsageError(f"--online_methods=iterative_dpo: --steps={cfg.optim.steps} must "
                           f"divide by --iterative_rounds={rounds} (as many DPO steps as the "
                           f"other methods)")
    return cfg.replace(stage=method, output_dir=output_dir, online_max_new_tokens=new,
                       iterative_steps_per_round=cfg.optim.steps // rounds,
                       loss_type=("sigmoid",), beta=float(FLAGS.online_beta))
  if method == "grpo":
    return cfg.replace(stage=method, output_dir=output_dir, grpo_steps=cfg.optim.steps,
                       max_completion_length=new, grpo_beta=float(FLAGS.online_beta),
                       num_iterations=1)
  if method == "rloo":
    return cfg.replace(stage=method, output_dir=output_dir, rloo_steps=cfg.optim.steps,
                       rloo_max_completion_length=new, rloo_beta=float(FLAGS.online_beta),
                       rloo_num_generations=cfg.grpo.num_generations, rloo_num_iterations=1)
  if method == "ppo":
    return cfg.replace(stage=method, output_dir=output_dir, ppo_steps=cfg.optim.steps,
                       ppo_max_completion_length=new, ppo_beta=float(FLAGS.online_beta),
                       ppo_num_iterations=1)
  return cfg.replace(stage=method, output_dir=output_dir, online_steps=cfg.optim.steps,
                     online_max_new_tokens=new, loss_type=("sigmoid",),
                     beta=float(FLAGS.online_beta))


def best_of_n(cfg, mesh, params, ns: list[int], n_max: int) -> list[dict]:
  """Mean reward of the best of the first N SFT samples per prompt, for each N, ranked and
  scored by the run's judge (dpo/judges.py: the true reward, a reward model or a function)."""
  data = loop.Data(cfg)
  judge = judges.load(cfg, mesh, data.tok, data.template)
  ev = evaluate.Evaluator(cfg, mesh, data.eval_set(judge), params)
  key = jax.random.fold_in(jax.random.key(cfg.run.seed), 11)
  rewards, formed = [], []
  for i in range(n_max):
    comps = evaluate.sample(cfg, mesh, ev.scfg, evaluate.Weights(params), ev.prompt_ids,
                            jax.random.fold_in(key, i))
    _, r, w = ev.judge(comps)
    rewards.append(r)
    formed.append(w)
  r = np.array(rewards)  # [n_max, prompts]
  w = None if formed[0] is None else np.array(formed)
  points = []
  for n in ns:
    best = np.argmax(r[:n], axis=0)  # first maximum: ties keep the earlier sample
    cols = np.arange(r.shape[1])
    points.append({"method": "best-of-N", "param": n, "step": 0,
                   "kl_per_sequence": float(np.log(n) - (n - 1) / n),
                   "reward": float(r[best, cols].mean()),
                   "wellformed_rate": None if w is None else float(w[best, cols].mean())})
  return points


def area(points: list[dict], kl_range: float) -> float:
  """Mean over k in [0, kl_range] of the best reward reached at KL <= k (trapezoid rule); the
  reward below the first point's KL is that point's (every run's first point is the SFT model
  at KL 0)."""
  pts = sorted((p["kl_per_sequence"], p["reward"]) for p in points)
  grid = np.linspace(0.0, kl_range, 513)
  kl = np.array([max(k, 0.0) for k, _ in pts])
  envelope = np.maximum.accumulate(np.array([r for _, r in pts]))
  idx = np.searchsorted(kl, grid, side="right") - 1
  values = np.where(idx >= 0, envelope[np.maximum(idx, 0)], envelope[0])
  return float(np.trapezoid(values, grid) / kl_range)


def table(points: list[dict], kl_range: float) -> str:
  shown = lambda v: "n/a" if v is None else f"{v:.3f}"
  lines = ["| method | parameter | step | KL per sequence (nats) | mean reward | well-formed |",
           "|---|---|---|---|---|---|"]
  for p in sorted(points, key=lambda p: (p["method"], p["param"], p["step"])):
    lines.append(f"| {p['method']} | {p['param']:g} | {p['step']} | {p['kl_per_sequence']:.3f} | "
                 f"{p['reward']:.3f} | {shown(p['wellformed_rate'])} |")
  lines += ["", f"Area under the curve (mean best reward over KL in [0, {kl_range:g}] nats):", "",
            "| method | area |", "|---|---|"]
  for method in sorted({p["method"] for p in points}):
    lines.append(f"| {method} | {area([p for p in points if p['method'] == method], kl_range):.3f} |")
  return "\n".join(lines)


def plot(points: list[dict], path: str, judge: str) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("frontier.png skipped: pip install matplotlib (the `plot` extra) to draw it")
    return False
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for method in sorted({p["method"] for p in points}):
    pts = sorted((p["kl_per_sequence"], p["reward"]) for p in points if p["method"] == method)
    ax.plot(*zip(*pts), "o" if method.startswith("DPO") else "s-", label=method, ms=4)
  ax.set_xlabel("KL(policy || SFT) per sequence (nats)")
  ax.set_ylabel(f"mean reward ({judge})")
  ax.set_title("Reward-KL frontier")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def main(argv) -> None:
  del argv
  for name in ("loss_type", "loss_weights", "stage", "beta", "rpo_alpha"):
    if FLAGS[name].present:
      raise app.UsageError(f"--{name} is set per run by the frontier tool")
  cfg = cli.from_flags().replace(rpo_alpha=0.0)
  if max(int(n) for n in FLAGS.best_of) > FLAGS.best_of_max:
    raise app.UsageError("--best_of_max must be at least the largest --best_of")
  if cfg.data.train_data and not (cfg.eval.judge or cfg.eval.reward_fn):
    raise app.UsageError("the frontier on --train_data needs a judge: give --judge=DIR|hf:DIR "
                         "(a reward model) or --reward_fn=module:function")
  if cfg.eval.judge == "rm":
    raise app.UsageError("--judge=rm names a run's own rm stage; the frontier runs none: give "
                         "the reward model's directory")
  out = cfg.run.output_dir
  for method in FLAGS.online_methods:  # refused now, not after the SFT model and the sweep
    online_config(cfg, method, os.path.join(out, method))
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  t0 = time.perf_counter()
  if cfg.checkpoint.init_from:
    for name in ("sft_steps", "sft_learning_rate", "sft_data"):
      if FLAGS[name].present:
        raise app.UsageError(f"--{name} is read by nothing with --init_from (the SFT model is "
                             "given, not trained)")
    cfg, params = loop.initial_params(cfg, jax.random.key(cfg.run.seed), mesh)
    print(f"SFT model: {cfg.checkpoint.init_from}", flush=True)
    cfg = cfg.replace(init_from="")  # every run starts from `params`
  else:
    params = compare_losses.sft_model(cfg.replace(output_dir=os.path.join(out, "sft")), mesh)
    print(f"SFT: {time.perf_counter() - t0:.0f}s", flush=True)
  points = best_of_n(cfg, mesh, params, [int(n) for n in FLAGS.best_of], FLAGS.best_of_max)
  for beta in FLAGS.betas:
    points += run_points(cfg.replace(stage="dpo", loss_type=("sigmoid",), beta=float(beta),
                                     output_dir=os.path.join(out, f"dpo_beta{beta}")),
                         mesh, params, f"DPO beta={beta}", float(beta))
  points += run_points(cfg.replace(stage="dpo", loss_type=("sft",),
                                   output_dir=os.path.join(out, "preferred_ft")),
                       mesh, params, "Preferred-FT", 0.0)
  for method in FLAGS.online_methods:  # the same steps, prompts and reference as DPO
    points += run_points(online_config(cfg, method, os.path.join(out, method)), mesh, params,
                         ONLINE[method], float(FLAGS.online_beta))
  # One DPO curve over all betas (the paper's frontier), beside the per-beta points.
  dpo = [{**p, "method": "DPO"} for p in points if p["method"].startswith("DPO beta")]
  curves = [p for p in points if not p["method"].startswith("DPO beta")] + dpo
  with open(os.path.join(out, "frontier.jsonl"), "w") as f:
    f.writelines(json.dumps(p) + "\n" for p in points)
  text = table(curves, FLAGS.kl_range)
  with open(os.path.join(out, "frontier.md"), "w") as f:
    f.write(text + "\n")
  print(text)
  if plot(points, os.path.join(out, "frontier.png"), judges.source(cfg) or "judge"):
    print(f"plot: {os.path.join(out, 'frontier.png')}")
  print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
  cli.define_flags()
  FLAGS.set_default("output_dir", "runs/frontier")
  FLAGS.set_default("eval_every", 50)
  flags.DEFINE_list("betas", ["0.02", "0.05", "0.1", "0.3", "1.0"], "DPO betas, one run each.")
  flags.DEFINE_list("best_of", ["1", "2", "4", "8", "16"], "N values of the best-of-N baseline.")
  flags.DEFINE_integer("best_of_max", 16, "Samples per prompt drawn for best-of-N (>= max N).")
  flags.DEFINE_float("kl_range", 8.0, "KL budget (nats per sequence) of the area under a curve.")
  flags.DEFINE_multi_enum("online_methods", [], list(ONLINE),
                          "Online methods added to the frontier (dpo/algorithms): online DPO, "
                          "iterative DPO, GRPO, RLOO and PPO, each as many DPO steps as a DPO "
                          "run, labelled by the same judge.")
  flags.DEFINE_float("online_beta", 0.1, "beta of online and iterative DPO's sigmoid loss, "
                     "GRPO's KL weight, RLOO's KL penalty weight and PPO's token KL weight.")
  flags.register_validator("best_of_max", lambda n: n >= 1, "--best_of_max must be >= 1")
  app.run(main)

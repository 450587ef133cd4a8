"""The training program: data -> SFT stage -> DPO stage -> evaluation -> summary.

Everything with Python side effects (logging, metrics files, timing) lives here, outside the
jitted steps. The loop dispatches step N before it reads step N-1's metrics, so the host never
makes the device wait. Only process 0 writes files.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import jax
import numpy as np

from configs import Config
from dpo import data as data_lib
from dpo import evaluate, task, train
from dpo.tokenizer import ByteTokenizer
from models import lora as lora_lib
from models import sharding, transformer


class MetricsWriter:
  """Appends one JSON object per logged step to <output_dir>/metrics.jsonl (process 0 only)."""

  def __init__(self, output_dir: str):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(output_dir, "metrics.jsonl")
    if self.enabled:
      os.makedirs(output_dir, exist_ok=True)

  def write(self, record: dict) -> None:
    if self.enabled:
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _to_py(tree) -> dict:
  return {k: (float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()) for k, v in tree.items()}


class Data:
  """Tokenized SFT, training and held-out arrays for one run."""

  def __init__(self, cfg: Config, tok=None):
    d, seed = cfg.data, cfg.train.seed
    self.tok = tok or ByteTokenizer()
    if cfg.model.vocab_size < self.tok.vocab_size:
      raise ValueError(f"vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                       f"{self.tok.vocab_size} ids")
    self.embedded = not d.train_data
    sft = data_lib.load_sft_jsonl(d.sft_data) if d.sft_data else task.sft_records(
        d.task_sft_examples, seed)
    pairs = data_lib.load_preference_jsonl(d.train_data) if d.train_data else (
        task.preference_records(d.task_train_pairs, seed))
    if d.eval_data:
      held = data_lib.load_preference_jsonl(d.eval_data)
    elif self.embedded:
      held = task.preference_records(d.task_eval_pairs, seed, held_out=True)
    else:
      held = []
    lens = (d.max_prompt_length, d.max_target_length)
    self.sft = data_lib.tokenize_sft(sft, self.tok, *lens, what="sft data")
    self.pairs = data_lib.tokenize_pairs(pairs, self.tok, *lens, what="train pairs")
    self.held = data_lib.tokenize_pairs(held, self.tok, *lens, what="held-out pairs") if held else None
    if self.embedded:
      self.eval_prompts = task.eval_prompts(d.task_eval_prompts)
    else:  # sample on the held-out pairs' prompts (first task_eval_prompts distinct ones)
      self.eval_prompts = list(dict.fromkeys(r.prompt for r in held))[:d.task_eval_prompts]
    # The ground-truth reward exists only for the embedded task; otherwise win rate is n/a.
    self.reward_fn = task.true_reward if self.embedded else None
    logging.info("data: %d SFT examples (T=%d), %d train pairs (T=%d), %d held-out pairs",
                 len(sft), self.sft["tokens"].shape[-1], len(pairs),
                 self.pairs["tokens"].shape[-1], len(held))


def _check_batch(cfg: Config, mesh) -> None:
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if cfg.train.global_batch_size % shards:
    raise ValueError(f"global_batch_size={cfg.train.global_batch_size} is not divisible by the "
                     f"data x fsdp mesh size {shards}")


def _stage(name: str, cfg: Config, mesh, step_fn, state, frozen, loader, steps: int, sched,
           writer: MetricsWriter, pairs: bool, eval_fn=None) -> train.TrainState:
  """Runs `steps` updates, logging every log_every steps; returns the final state.

  `eval_fn(step, state)`, if given, runs after every eval_every-th step except the last (the
  caller evaluates the final state itself).
  """
  if steps == 0:
    return state
  batch_ndim = 3 if pairs else 2
  step = train.jit_step(step_fn, cfg, *sched, mesh, state, frozen, batch_ndim)
  log_every = max(cfg.train.log_every, 1)
  pending = None
  t0 = time.perf_counter()
  tokens_since, t_last = 0, t0
  first_step = int(state.step)
  for i in range(first_step, steps):
    local = next(loader)
    tokens_since += int(local["segment_ids"].astype(bool).sum()) * jax.process_count()
    state, metrics = step(state, frozen, train.device_batch(mesh, local))
    if pending is not None:
      _log(name, *pending, cfg, writer, steps, t0, first_step)
      pending = None
    if (i + 1) % log_every == 0 or i + 1 == steps:
      now = time.perf_counter()
      pending = (i + 1, metrics, tokens_since / max(now - t_last, 1e-9))
      tokens_since, t_last = 0, now
    every = cfg.train.eval_every
    if eval_fn is not None and every and (i + 1) % every == 0 and i + 1 < steps:
      if pending is not None:
        _log(name, *pending, cfg, writer, steps, t0, first_step)
        pending = None
      t_eval = time.perf_counter()
      eval_fn(i + 1, state)
      t0 += time.perf_counter() - t_eval  # keep evaluation time out of the step-rate ETA
      t_last += time.perf_counter() - t_eval
  if pending is not None:
    _log(name, *pending, cfg, writer, steps, t0, first_step)
  return state


def _log(stage, step, metrics, tok_per_s, cfg, writer, steps, t0, first_step):
  m = _to_py(jax.device_get(metrics))
  elapsed = time.perf_counter() - t0
  eta = elapsed / max(step - first_step, 1) * (steps - step)
  if stage == "dpo":
    logging.info("dpo %5d/%d  loss %.4f  acc %.3f  margin %+.4f  |g| %.3f  lr %.2e  "
                 "%.0f tok/s  eta %.0fs", step, steps, m["loss"], m["rewards/accuracies"],
                 m["rewards/margins"], m["grad_norm"], m["learning_rate"], tok_per_s, eta)
  else:
    logging.info("sft %5d/%d  loss %.4f  |g| %.3f  lr %.2e  %.0f tok/s  eta %.0fs", step, steps,
                 m["loss"], m["grad_norm"], m["learning_rate"], tok_per_s, eta)
  writer.write({"stage": stage, "step": step, **m, "tokens_per_sec": tok_per_s})


def _evaluate(evaluator: evaluate.Evaluator, policy, lora, step: int, writer: MetricsWriter):
  t = time.perf_counter()
  metrics, examples = evaluator(policy, lora)
  metrics["eval_time_s"] = round(time.perf_counter() - t, 2)
  writer.write({"stage": "eval", "step": step, **{f"eval/{k}": v for k, v in metrics.items()}})
  f = lambda k: "n/a" if metrics.get(k) is None else f"{metrics[k]:.3f}"
  logging.info("eval  %5d  win %s  reward %s vs %s  KL/seq %s  KL/tok %s  acc %s  margin %s  "
               "ppl %s  (%.1fs)", step, f("win_rate"), f("policy_true_reward"),
               f("reference_true_reward"), f("kl_per_sequence"), f("kl_per_token"),
               f("reward_accuracy"), f("reward_margin"), f("perplexity"), metrics["eval_time_s"])
  return metrics, examples


def run(cfg: Config, mesh=None) -> dict[str, Any]:
  """Runs the configured stages and returns the summary (also written to summary.json)."""
  t_start = time.perf_counter()
  out = cfg.train.output_dir
  mesh = mesh or sharding.make_mesh(cfg.train.mesh)
  _check_batch(cfg, mesh)
  writer = MetricsWriter(out)
  if writer.enabled:
    with open(os.path.join(out, "config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=2)
  data = Data(cfg)
  pid, nproc = jax.process_index(), jax.process_count()
  key = jax.random.key(cfg.train.seed)
  params = transformer.init(cfg.model, jax.random.fold_in(key, 0), mesh)
  logging.info("model: %.2fM parameters, mesh %s", transformer.num_params(params) / 1e6,
               dict(mesh.shape))
  summary: dict[str, Any] = {}

  if cfg.train.stage in ("sft", "all"):
    opt, sched = train.optimizer(cfg, cfg.train.sft_learning_rate, cfg.train.sft_steps)
    state = train.init_state(params, opt, cfg.train.seed, mesh)
    loader = data_lib.Loader(data.sft, cfg.train.global_batch_size, cfg.train.seed + 1, pid, nproc)
    state = _stage("sft", cfg, mesh, train.sft_step, state, None, loader, cfg.train.sft_steps,
                   (opt, sched), writer, pairs=False)
    params = state.params

  if cfg.train.stage in ("dpo", "all"):
    if data.held is not None:
      before = evaluate.pair_metrics(cfg, mesh, params, None, params, data.held,
                                     cfg.train.global_batch_size)
      summary["reference_perplexity"] = before["perplexity"]
    opt, sched = train.optimizer(cfg, cfg.train.learning_rate, cfg.train.steps)
    if cfg.lora.enabled:
      frozen = params
      trainable = lora_lib.init(cfg.model, cfg.lora, jax.random.fold_in(key, 1), mesh)
      logging.info("LoRA: rank %d on %s, %.3fM trainable parameters", cfg.lora.lora_rank,
                   ",".join(cfg.lora.lora_targets), transformer.num_params(trainable) / 1e6)
    else:
      frozen, trainable = params, jax.tree.map(lambda x: x.copy(), params)
    state = train.init_state(trainable, opt, cfg.train.seed, mesh)
    loader = data_lib.Loader(data.pairs, cfg.train.global_batch_size, cfg.train.seed + 2, pid, nproc)
    evaluator = evaluate.Evaluator(cfg, mesh, data.tok, data.eval_prompts, frozen, data.held,
                                   data.reward_fn)
    split = lambda p: (frozen, p) if cfg.lora.enabled else (p, None)

    def eval_fn(step, st):
      return _evaluate(evaluator, *split(st.params), step, writer)

    state = _stage("dpo", cfg, mesh, train.dpo_step, state, frozen, loader, cfg.train.steps,
                   (opt, sched), writer, pairs=True, eval_fn=eval_fn)
    final, examples = eval_fn(cfg.train.steps, state)
    summary.update(final)
    summary["skipped_steps"] = int(state.skipped)
    if writer.enabled:
      print(evaluate.report(final, examples, cfg.train.eval_show), flush=True)

  summary["wall_time_s"] = round(time.perf_counter() - t_start, 1)
  if writer.enabled:
    with open(os.path.join(out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  logging.info("summary: %s", json.dumps(summary))
  return summary

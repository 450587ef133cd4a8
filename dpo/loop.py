"""The training program: data -> SFT stage -> DPO stage -> evaluation -> summary.

Everything with Python side effects (logging, metrics files, timing) lives here, outside the
jitted steps. The loop dispatches step N before it reads step N-1's metrics, so the host never
makes the device wait. Only process 0 writes files.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any

import jax
import numpy as np

from configs import Config
from dpo import data as data_lib
from dpo import evaluate, formats, prepare, task, train
from dpo import tokenizer as tokenizer_lib
from models import lora as lora_lib
from models import quant, sharding, transformer


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
  """Tokenized SFT, training and held-out arrays for one run.

  With --train_data the pairs go through dpo.prepare (any supported format, quality filters,
  chat template, held-out split, cached tokenisation); SFT then uses --sft_data or, failing
  that, the chosen rows of the training pairs.
  """

  def __init__(self, cfg: Config, tok=None):
    d, seed = cfg.data, cfg.train.seed
    self.tok = tok or tokenizer_lib.load_tokenizer(d.tokenizer, d.bos_token, d.eos_token,
                                                   d.pad_token)
    if cfg.model.vocab_size < self.tok.vocab_size:
      raise ValueError(f"vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                       f"{self.tok.vocab_size} ids")
    self.embedded = not d.train_data
    lens = (d.max_prompt_length, d.max_target_length)
    self.reports = []
    if self.embedded:
      pairs = task.preference_records(d.task_train_pairs, seed)
      self.pairs = data_lib.tokenize_pairs(pairs, self.tok, *lens, what="train pairs")
      held = (data_lib.load_preference_jsonl(d.eval_data) if d.eval_data else
              task.preference_records(d.task_eval_pairs, seed, held_out=True))
      self.held = data_lib.tokenize_pairs(held, self.tok, *lens, what="held-out pairs")
    else:
      spec = formats.FormatSpec(d.data_format, d.prompt_field, d.chosen_field, d.rejected_field)
      cache_dir = ("" if d.data_cache_dir == "none" else
                   d.data_cache_dir or os.path.join(cfg.train.output_dir, "data_cache"))
      prep = functools.partial(prepare.prepare_pairs, tok=self.tok, spec=spec,
                               template=d.chat_template, max_prompt_length=lens[0],
                               max_target_length=lens[1], cache_dir=cache_dir)
      train_prep = prep(d.train_data, eval_split=d.eval_split)
      self.reports.append(train_prep.report)
      self.pairs, self.held = train_prep.train, train_prep.held
      if d.eval_data:
        if d.eval_split:
          raise ValueError("give either --eval_data or --eval_split, not both")
        eval_prep = prep(d.eval_data, eval_split=0.0)
        self.reports.append(eval_prep.report)
        self.held = eval_prep.train
    if d.sft_data:
      self.sft = data_lib.tokenize_sft(data_lib.load_sft_jsonl(d.sft_data), self.tok, *lens,
                                       what="sft data")
    elif self.embedded:
      self.sft = data_lib.tokenize_sft(task.sft_records(d.task_sft_examples, seed), self.tok,
                                       *lens, what="sft data")
    else:  # the chosen row of each training pair is a (prompt, completion) SFT example
      self.sft = {k: v[:, 0] for k, v in self.pairs.items()}
    # Sampling prompts and the ground-truth reward exist only for the embedded task; without
    # them the generation metrics (win rate, true rewards, KL, lengths) are reported as null.
    self.eval_prompts = task.eval_prompts(d.task_eval_prompts) if self.embedded else []
    self.reward_fn = task.true_reward if self.embedded else None
    logging.info("data: %d SFT examples (T=%d), %d train pairs (T=%d), %d held-out pairs",
                 len(self.sft["tokens"]), self.sft["tokens"].shape[-1],
                 len(self.pairs["tokens"]), self.pairs["tokens"].shape[-1],
                 0 if self.held is None else len(self.held["tokens"]))


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
    state, metrics = step(state, frozen,
                          train.device_batch(mesh, local, cfg.train.global_batch_size))
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


def initial_params(cfg: Config, key: jax.Array, mesh) -> tuple[Config, Any]:
  """(config, params): random init, or `--init_from` (hf:DIR replaces the model section)."""
  src = cfg.train.init_from
  if not src:
    return cfg, transformer.init(cfg.model, key, mesh)
  kind, _, path = src.partition(":")
  if kind == "hf":
    from models import hf  # optional-format code stays out of the default path
    model_cfg, params = hf.load(path, mesh, cfg.model)
    logging.info("imported %s (%s) from %s", model_cfg.arch, src, path)
    return dataclasses.replace(cfg, model=model_cfg), params
  raise ValueError(f"--init_from={src!r}: unknown source kind {kind!r} (expected hf:DIR)")
def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB"


def log_memory_estimate(cfg: Config, mesh) -> dict[str, int]:
  """Logs the per-device bytes of the DPO stage's weights, trainable part and optimizer state."""
  opt, _ = train.optimizer(cfg, cfg.train.learning_rate, max(cfg.train.steps, 1))
  est = train.memory_estimate(cfg, mesh, opt)
  logging.info("per-device memory estimate (DPO stage, before activations): %s weights %s, "
               "%s %s, optimizer state %s, total %s",
               "frozen base" if cfg.lora.enabled else "frozen reference", _mib(est["frozen"]),
               "LoRA" if cfg.lora.enabled else "policy weights", _mib(est["trainable"]),
               _mib(est["optimizer"]), _mib(est["total"]))
  replicated = sharding.replicated_axes(transformer.param_specs(cfg.model), mesh)
  if replicated:
    logging.warning("mesh axes that do not divide a parameter dimension leave it replicated: %s",
                    "; ".join(f"{k}: {v}" for k, v in replicated.items()))
  return est


def run(cfg: Config, mesh=None) -> dict[str, Any]:
  """Runs the configured stages and returns the summary (also written to summary.json)."""
  t_start = time.perf_counter()
  out = cfg.train.output_dir
  mesh = mesh or sharding.make_mesh(cfg.train.mesh)
  _check_batch(cfg, mesh)
  writer = MetricsWriter(out)
  if cfg.model.base_quant != "none" and not cfg.lora.enabled:
    raise ValueError(f"base_quant={cfg.model.base_quant} needs LoRA (lora_rank > 0): a "
                     "quantized base is frozen")
  key = jax.random.key(cfg.train.seed)
  cfg, params = initial_params(cfg, jax.random.fold_in(key, 0), mesh)
  if writer.enabled:
    with open(os.path.join(out, "config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=2)
  data = Data(cfg)
  # Each process loads only the block of the global batch that its own devices hold.
  pid, nproc = sharding.process_batch_block(mesh, cfg.train.global_batch_size)
  logging.info("model: %.2fM parameters, mesh %s, %d processes (this one loads batch block "
               "%d of %d)", transformer.num_params(params) / 1e6, dict(mesh.shape),
               jax.process_count(), pid, nproc)
  log_memory_estimate(cfg, mesh)
  summary: dict[str, Any] = {"data": data.reports} if data.reports else {}

  if cfg.train.stage in ("sft", "all"):
    opt, sched = train.optimizer(cfg, cfg.train.sft_learning_rate, cfg.train.sft_steps)
    state = train.init_state(params, opt, cfg.train.seed, mesh)
    loader = data_lib.Loader(data.sft, cfg.train.global_batch_size, cfg.train.seed + 1, pid, nproc)
    state = _stage("sft", cfg, mesh, train.sft_step, state, None, loader, cfg.train.sft_steps,
                   (opt, sched), writer, pairs=False)
    params = state.params

  if cfg.train.stage in ("dpo", "all"):
    if cfg.model.base_quant != "none":
      before_bytes = transformer.nbytes(params)
      params = quant.quantize_params(cfg.model, params, mesh)
      after_bytes = transformer.nbytes(params)
      logging.info("base_quant=%s: frozen base %.1f MiB -> %.1f MiB (saved %.1f MiB, %.0f%%)",
                   cfg.model.base_quant, before_bytes / 2**20, after_bytes / 2**20,
                   (before_bytes - after_bytes) / 2**20, 100 * (1 - after_bytes / before_bytes))
      summary["base_bytes"] = {"float32": before_bytes, cfg.model.base_quant: after_bytes}
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
    policy, lora = split(state.params)
    final, examples = eval_fn(cfg.train.steps, state)
    summary.update(final)
    summary["skipped_steps"] = int(state.skipped)
    if writer.enabled:
      print(evaluate.report(final, examples, cfg.train.eval_show), flush=True)
    if cfg.train.export_hf:
      from models import hf
      out_hf = cfg.train.export_hf
      hf.save(out_hf, cfg.model, policy, lora, cfg.lora, source=hf.source_config(cfg.train.init_from))
      if lora is not None:
        hf.save_peft(os.path.join(out_hf, "adapter"), cfg.model, lora, cfg.lora,
                     base_model=cfg.train.init_from.removeprefix("hf:"))
      logging.info("exported the policy (LoRA merged) to %s", out_hf)

  summary["wall_time_s"] = round(time.perf_counter() - t_start, 1)
  if writer.enabled:
    with open(os.path.join(out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  logging.info("summary: %s", json.dumps(summary))
  return summary

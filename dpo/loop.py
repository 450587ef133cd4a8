"""The training program: data -> SFT stage -> DPO stage -> evaluation -> summary.

Everything with Python side effects (logging, metrics files, timing) lives here, outside the
jitted steps. The loop dispatches step N before it reads step N-1's metrics, so the host never
makes the device wait. Only process 0 writes files.
"""

from __future__ import annotations

import dataclasses
import functools
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
from dpo import checkpoint, evaluate, formats, guards, prepare, reference, task, train
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

  def truncate_after(self, stage: str, step: int) -> None:
    """Drops the records a resumed run will write again: this stage's after `step`, other
    records of the same or a later stage at or after `step`, all records of later stages."""
    if not (self.enabled and os.path.exists(self.path)):
      return
    order = lambda name: 0 if name == "sft" else 1  # sft, then dpo and its evaluations
    cur = order(stage)
    with open(self.path) as f:
      records = [json.loads(line) for line in f if line.strip()]
    keep = [r for r in records
            if order(r.get("stage")) < cur or (order(r.get("stage")) == cur and (
                r["step"] <= step if r.get("stage") == stage else r["step"] < step))]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, self.path)


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
      self.held = (data_lib.tokenize_pairs(held, self.tok, *lens, what="held-out pairs")
                   if held else None)
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


class SimulatedCrash(RuntimeError):
  """Raised by --debug_crash_at: the process dies after a given step (tests resume)."""


class TrainingStopped(RuntimeError):
  """The run cannot continue (e.g. more KL-spike rollbacks than --max_rollbacks)."""


def _debug_step(value: str, stage: str) -> int:
  """'dpo:30' -> 30 for stage dpo, 0 otherwise (flag format checked in TrainConfig)."""
  name, _, step = value.partition(":")
  return int(step) if value and name == stage else 0


def _stage(name: str, cfg: Config, mesh, step_fn, fresh, frozen, loader, steps: int, sched,
           writer: MetricsWriter, ckpts: checkpoint.Manager,
           meta_extra: dict | None = None, update_frozen=None, eval_fn=None) -> train.TrainState:
  """Runs the stage's updates up to `steps` and returns the final state.

  Resumes from the newest complete checkpoint in `ckpts`; saves every checkpoint_every steps and
  at the end. `fresh()` builds the stage's initial state (also the rollback target before the
  first checkpoint). Metrics are read one step late (step i+1 is dispatched before step i's
  metrics are fetched), for logging and, in DPO, for the KL guard. A checkpoint first settles
  the pending step, so the guard's history it records is the same whether the run continues or
  is resumed from it, which keeps interrupted and uninterrupted runs bitwise identical.
  update_frozen(step, state, frozen) -> frozen runs after each step (TR-DPO reference updates).
  eval_fn(step, state), if given, runs after every eval_every-th step except the last (the
  caller evaluates the final state itself).
  """
  t = cfg.train
  meta_extra = meta_extra or {}
  state = fresh()
  like = checkpoint.like_of(state)
  guard = (guards.KLGuard(t.kl_max, t.kl_spike_factor, t.kl_window, t.kl_spike_min)
           if name == "dpo" else None)
  guarded = guard is not None and guard.enabled
  rollbacks = 0
  start = ckpts.latest()
  if start is not None:
    state, meta = ckpts.restore(start, like)
    for k, v in meta_extra.items():
      if meta.get(k) != v:
        raise checkpoint.CheckpointError(
            f"{ckpts.path(start)}: {k} is {meta.get(k)!r} but this run has {v!r}; use a fresh "
            f"--output_dir or the original settings")
    loader.restore(meta["loader"])
    rollbacks = meta["rollbacks"]
    if guard is not None:
      guard.history = list(meta["kl_history"])
    writer.truncate_after(name, start)
    logging.info("%s: resumed from %s (step %d of %d)", name, ckpts.path(start), start, steps)
  i = int(state.step)
  if i >= steps:
    return state
  step = train.jit_step(step_fn, cfg, *sched, mesh, state, frozen)
  log_every = max(t.log_every, 1)
  crash_at, kill_at = _debug_step(t.debug_crash_at, name), _debug_step(t.debug_kill_in_save, name)
  t0 = time.perf_counter()
  tokens_since, t_last = 0, t0
  first_step = i
  pending = None  # (step, metrics, tokens/s or None): the dispatched step not yet read

  def settle():
    """Reads the pending step: KL guard first, then the log line. Returns a spike reason."""
    nonlocal pending
    if pending is None:
      return None
    j, metrics, tps = pending
    pending = None
    reason = guard.check(float(metrics["kl"])) if guarded and "kl" in metrics else None
    if reason is None and tps is not None:
      _log(name, j, metrics, tps, cfg, writer, steps, t0, first_step)
    return reason and (j, reason)

  def save(n):
    meta = {"stage": name, "loader": loader.state(), "rollbacks": rollbacks,
            "kl_history": guard.history if guard is not None else [],
            "lora": bool(cfg.lora.enabled and name == "dpo"), **meta_extra}
    path = ckpts.save(n, state, meta, kill_mid_write=bool(kill_at) and n == kill_at)
    logging.info("%s: checkpoint step %d -> %s", name, n, path)

  def rollback(j, reason):
    """The state measured at step j (params after update j - 1) spiked: restore the newest
    checkpoint before it, cut the learning rate, and continue."""
    nonlocal state, rollbacks, i
    if rollbacks >= t.max_rollbacks:
      raise TrainingStopped(
          f"{name}: KL spike at step {j} ({reason}) after {rollbacks} rollbacks already "
          f"(--max_rollbacks={t.max_rollbacks}); stopping. Lower the learning rate, or raise "
          f"--kl_max / --kl_spike_factor if this KL is expected.")
    rollbacks += 1
    lr_scale = float(state.lr_scale) * t.rollback_lr_factor
    dropped = ckpts.delete_from(j - 1)
    target = ckpts.latest(before=j - 1)
    if target is None:
      state, meta = fresh(), {"loader": {"epoch": 0, "index": 0}, "kl_history": []}
    else:
      state, meta = ckpts.restore(target, like)
    loader.restore(meta["loader"])
    guard.history = list(meta["kl_history"])
    state = state._replace(lr_scale=jax.device_put(np.float32(lr_scale), like.lr_scale.sharding))
    i = int(state.step)
    logging.warning("%s: KL SPIKE at step %d: %s. ROLLBACK %d/%d to step %d%s; learning-rate "
                    "scale now %.3g", name, j, reason, rollbacks, t.max_rollbacks, i,
                    f" (dropped checkpoints {dropped})" if dropped else "", lr_scale)
    writer.write({"stage": name, "step": j, "event": "rollback", "reason": reason, "to_step": i,
                  "lr_scale": lr_scale, "rollbacks": rollbacks})
    save(i)  # the lowered rate survives a crash before the next regular checkpoint

  while True:
    if i >= steps:
      spike = settle()
      if spike:
        rollback(*spike)
        continue
      break
    local = next(loader)
    if name == "dpo" and t.debug_nan_step == i + 1:
      logging.warning("debug: NaN loss mask at %s step %d", name, i + 1)
      local = {**local, "loss_mask": local["loss_mask"] * np.float32("nan")}
    lr_scale = None
    if name == "dpo" and t.debug_lr_spike_step == i + 1 and rollbacks == 0:
      logging.warning("debug: learning rate x%g at %s step %d", t.debug_lr_spike_factor, name, i + 1)
      lr_scale = state.lr_scale
      state = state._replace(lr_scale=jax.device_put(lr_scale * t.debug_lr_spike_factor,
                                                     lr_scale.sharding))
    tokens_since += int(local["segment_ids"].astype(bool).sum()) * jax.process_count()
    state, metrics = step(state, frozen, train.device_batch(mesh, local, cfg.train.global_batch_size))
    if lr_scale is not None:
      state = state._replace(lr_scale=lr_scale)
    i += 1
    if update_frozen is not None:
      frozen = update_frozen(i, state, frozen)
    spike = settle()
    tps = None
    if i % log_every == 0 or i == steps:
      now = time.perf_counter()
      tps, tokens_since, t_last = tokens_since / max(now - t_last, 1e-9), 0, now
    pending = (i, metrics, tps)
    if spike:
      rollback(*spike)
      pending = None
      continue
    if (t.checkpoint_every and i % t.checkpoint_every == 0) or i == steps:
      spike = settle()
      if spike:
        rollback(*spike)
        continue
      save(i)
    if crash_at and i == crash_at:
      raise SimulatedCrash(f"debug: simulated crash after {name} step {i}")
    if eval_fn is not None and t.eval_every and i % t.eval_every == 0 and i < steps:
      spike = settle()  # the log line and the guard come before the evaluation
      if spike:
        rollback(*spike)
        continue
      t_eval = time.perf_counter()
      eval_fn(i, state)
      t0 += time.perf_counter() - t_eval  # keep evaluation time out of the step-rate ETA
      t_last += time.perf_counter() - t_eval
  return state


def _log(stage, step, metrics, tok_per_s, cfg, writer, steps, t0, first_step):
  m = _to_py(jax.device_get(metrics))
  elapsed = time.perf_counter() - t0
  eta = elapsed / max(step - first_step, 1) * (steps - step)
  if stage == "dpo":
    logging.info("dpo %5d/%d  loss %.4f  acc %.3f  margin %+.4f  kl %.4f  |g| %.3f  lr %.2e  "
                 "skipped %d  %.0f tok/s  eta %.0fs", step, steps, m["loss"],
                 m["rewards/accuracies"], m["rewards/margins"], m.get("kl", float("nan")), m["grad_norm"],
                 m["learning_rate"], m["skipped_steps"], tok_per_s, eta)
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
  """(config, params): random init, or `--init_from`: hf:DIR (its config replaces the model
  section) or a dpo-jax params checkpoint (an SFT output, an exported policy)."""
  src = cfg.train.init_from
  if not src:
    return cfg, transformer.init(cfg.model, key, mesh)
  kind, _, path = src.partition(":")
  if kind == "hf":
    from models import hf  # optional-format code stays out of the default path
    model_cfg, params = hf.load(path, mesh, cfg.model)
    logging.info("imported %s (%s) from %s", model_cfg.arch, src, path)
    return dataclasses.replace(cfg, model=model_cfg), params
  logging.info("init: loading checkpoint %s", src)
  return cfg, checkpoint.load_params(src, cfg.model, mesh)


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


def run(cfg: Config, mesh=None, init_params=None) -> dict[str, Any]:
  """Runs the configured stages and returns the summary (also written to summary.json).

  Everything resumable lives under <output_dir>/checkpoints/: step checkpoints in sft/ and dpo/,
  the SFT output `sft_model` (the DPO stage's initial policy and frozen reference), `dpo_base`
  (the random base of a --stage=dpo run without --init_from, written once), and the exported
  policy `policy` (LoRA merged). Rerunning the same command continues where the last complete
  checkpoint left off, across the SFT -> DPO boundary too. `init_params` replaces the starting
  model (e.g. one SFT model shared by several DPO runs; see dpo/compare_losses.py).
  """
  t_start = time.perf_counter()
  out = cfg.train.output_dir
  ckroot = os.path.join(out, "checkpoints")
  mesh = mesh or sharding.make_mesh(cfg.train.mesh)
  _check_batch(cfg, mesh)
  writer = MetricsWriter(out)
  if cfg.model.base_quant != "none" and not cfg.lora.enabled:
    raise ValueError(f"base_quant={cfg.model.base_quant} needs LoRA (lora_rank > 0): a "
                     "quantized base is frozen")
  key = jax.random.key(cfg.train.seed)
  cfg, params = ((cfg, init_params) if init_params is not None
                 else initial_params(cfg, jax.random.fold_in(key, 0), mesh))
  t = cfg.train
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
  sft_out = os.path.join(ckroot, "sft_model")
  reference_path = os.path.abspath(t.init_from) if t.init_from and not t.init_from.startswith(
      "hf:") else t.init_from

  if t.stage in ("sft", "all"):
    reference_path = os.path.abspath(sft_out)
    if checkpoint.is_complete(sft_out):
      logging.info("sft: %s exists; stage done", sft_out)
      params = checkpoint.load_params(sft_out, cfg.model, mesh)
    else:
      opt, sched = train.optimizer(cfg, t.sft_learning_rate, t.sft_steps)
      loader = data_lib.Loader(data.sft, t.global_batch_size, t.seed + 1, pid, nproc)
      init = params
      state = _stage("sft", cfg, mesh, train.sft_step,
                     lambda: train.init_state(jax.tree.map(lambda x: x.copy(), init), opt, t.seed,
                                              mesh), None, loader,
                     t.sft_steps, (opt, sched), writer,
                     ckpts=checkpoint.Manager(os.path.join(ckroot, "sft"), t.keep_checkpoints),
                     meta_extra={"init_from": t.init_from})
      params = state.params
      checkpoint.save_params(sft_out, params, cfg.model, stage="sft", step=int(state.step))
      logging.info("sft: model -> %s", sft_out)

  if t.stage in ("dpo", "all"):
    if not reference_path:
      reference_path = os.path.abspath(os.path.join(ckroot, "dpo_base"))
      if not checkpoint.is_complete(reference_path):
        checkpoint.save_params(reference_path, params, cfg.model, stage="init")
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
                                     t.global_batch_size)
      summary["reference_perplexity"] = before["perplexity"]
    opt, sched = train.optimizer(cfg, t.learning_rate, t.steps)
    if cfg.lora.enabled:
      specs = lora_lib.lora_specs(cfg.model, cfg.lora)
      logging.info("LoRA: rank %d on %s, %.3fM trainable parameters", cfg.lora.lora_rank,
                   ",".join(cfg.lora.lora_targets),
                   transformer.num_params(transformer.abstract(specs)) / 1e6)

    def fresh_trainable():
      if cfg.lora.enabled:
        return lora_lib.init(cfg.model, cfg.lora, jax.random.fold_in(key, 1), mesh)
      return jax.tree.map(lambda x: x.copy(), params)

    def fresh():
      return train.init_state(fresh_trainable(), opt, t.seed, mesh)

    tr_dpo_lora = cfg.lora.enabled and cfg.loss.ref_update != "none"
    frozen = reference.initial_frozen(cfg, params, fresh_trainable() if tr_dpo_lora else None)
    pairs = data.pairs
    if cfg.loss.precompute_ref:
      ref_arrays, summary["ref_cache"] = reference.cached(cfg, mesh, frozen, pairs, data.tok)
      pairs = {**pairs, **ref_arrays}
    loader = data_lib.Loader(pairs, t.global_batch_size, t.seed + 2, pid, nproc)
    # Evaluation (held-out pairs, samples, KL, win rate) is against the SFT model (`params`) for
    # every loss and reference scheme, so runs stay comparable (TR-DPO moves the training
    # reference).
    evaluator = evaluate.Evaluator(cfg, mesh, data.tok, data.eval_prompts, params, data.held,
                                   data.reward_fn)
    split = lambda p: (params, p) if cfg.lora.enabled else (p, None)

    def eval_fn(step, st):
      return _evaluate(evaluator, *split(st.params), step, writer)

    t_dpo = time.perf_counter()
    state = _stage("dpo", cfg, mesh, train.dpo_step, fresh, frozen, loader, t.steps,
                   (opt, sched), writer,
                   ckpts=checkpoint.Manager(os.path.join(ckroot, "dpo"), t.keep_checkpoints),
                   meta_extra={"reference": reference_path},
                   update_frozen=functools.partial(reference.maybe_update, cfg), eval_fn=eval_fn)
    summary["dpo_time_s"] = round(time.perf_counter() - t_dpo, 1)
    policy, lora = split(state.params)
    policy_out = os.path.join(ckroot, "policy")
    if cfg.model.base_quant == "none":
      merged = lora_lib.merge(params, lora, cfg.lora) if lora is not None else policy
      checkpoint.save_params(policy_out, merged, cfg.model, stage="dpo", step=int(state.step),
                             reference=reference_path)
      logging.info("dpo: policy (LoRA merged) -> %s", policy_out)
    else:
      logging.info("dpo: base_quant=%s; no merged policy export (the adapters are in %s)",
                   cfg.model.base_quant, os.path.join(ckroot, "dpo"))
    final, examples = eval_fn(t.steps, state)
    summary.update(final)
    summary["skipped_steps"] = int(state.skipped)
    summary["lr_scale"] = float(state.lr_scale)
    if writer.enabled:
      print(evaluate.report(final, examples, t.eval_show), flush=True)
    if t.export_hf:
      from models import hf
      out_hf = t.export_hf
      hf.save(out_hf, cfg.model, policy, lora, cfg.lora, source=hf.source_config(t.init_from))
      if lora is not None:
        hf.save_peft(os.path.join(out_hf, "adapter"), cfg.model, lora, cfg.lora,
                     base_model=t.init_from.removeprefix("hf:"))
      logging.info("exported the policy (LoRA merged) to %s", out_hf)

  summary["wall_time_s"] = round(time.perf_counter() - t_start, 1)
  if writer.enabled:
    with open(os.path.join(out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  logging.info("summary: %s", json.dumps(summary))
  return summary

"""The training program: data -> SFT stage -> DPO stage -> evaluation -> summary.

`run` builds each stage (its initial state, jitted step, data loader and hooks) and hands it to
the stage runner (dpo/runner.py); the side concerns of a stage are the hooks of dpo/hooks.py.
Everything resumable lives under <output_dir>/checkpoints/: step checkpoints in sft/ and dpo/,
the SFT output `sft_model` (the DPO stage's initial policy and frozen reference), `dpo_base`
(the random base of a --stage=dpo run without --init_from, written once), and the exported
policy `policy` (LoRA merged). Rerunning the same command continues where the last complete
checkpoint left off, across the SFT -> DPO boundary too. Only process 0 writes files.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any, Mapping, Sequence

import jax

from dpo import checkpoint, evaluate, formats, hooks, identity, prepare, reference, task, train
from dpo import data as data_lib
from dpo import tokenizer as tokenizer_lib
from dpo.runner import Hook, MetricsWriter, Stage, TrainingStopped  # noqa: F401 (re-exported)
from models import lora as lora_lib
from models import quant, sharding, transformer




class Data:
  """Tokenized SFT, training and held-out arrays for one run.

  With --train_data the pairs go through dpo.prepare (any supported format, quality filters,
  chat template, held-out split, cached tokenisation); SFT then uses --sft_data or, failing
  that, the chosen rows of the training pairs.
  """

  def __init__(self, cfg, tok=None):
    d, seed = cfg.data, cfg.run.seed
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
                   d.data_cache_dir or os.path.join(cfg.run.output_dir, "data_cache"))
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


def initial_params(cfg, key: jax.Array, mesh) -> tuple[Any, Any]:
  """(config, params): random init, or `--init_from`: hf:DIR (its config replaces the model
  section) or a dpo-jax params checkpoint (an SFT output, an exported policy)."""
  src = cfg.checkpoint.init_from
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


def log_memory_estimate(cfg, mesh) -> dict[str, int]:
  """Logs the per-device bytes of the DPO stage's weights, trainable part and optimizer state."""
  est = train.memory_estimate(train.StepConfig.dpo(cfg), mesh)
  mib = lambda n: f"{n / 2**20:.2f} MiB"
  logging.info("per-device memory estimate (DPO stage, before activations): %s weights %s, "
               "%s %s, optimizer state %s, total %s",
               "frozen base" if cfg.lora.enabled else "frozen reference", mib(est["frozen"]),
               "LoRA" if cfg.lora.enabled else "policy weights", mib(est["trainable"]),
               mib(est["optimizer"]), mib(est["total"]))
  replicated = sharding.replicated_axes(transformer.param_specs(cfg.model), mesh)
  if replicated:
    logging.warning("mesh axes that do not divide a parameter dimension leave it replicated: %s",
                    "; ".join(f"{k}: {v}" for k, v in replicated.items()))
  return est


_STEPS = {"sft": (train.sft_step, train.StepConfig.sft), "dpo": (train.dpo_step, train.StepConfig.dpo)}


@dataclasses.dataclass
class Program:
  """What the stages of one run share."""
  cfg: Any
  mesh: Any
  data: Data
  writer: MetricsWriter
  extra_hooks: Mapping[str, Sequence[Hook]]

  def stage(self, name: str, fresh, frozen, arrays, hooks: list, info: dict,
            initial: str) -> Stage:
    """Stage `name` (sft or dpo) over `arrays` from the model with digest `initial`, resuming
    from <output_dir>/checkpoints/<name>; the stage's fingerprint is what a checkpoint must
    match to be resumed, `info` is recorded beside it."""
    c, o = self.cfg, self.cfg.optim
    step_fn, spec = _STEPS[name][0], _STEPS[name][1](c)
    pid, nproc = sharding.process_batch_block(self.mesh, o.global_batch_size)

    def dispatch(state, frozen, batch):  # jit_step is cached: one compile per stage
      step = train.jit_step(step_fn, spec, self.mesh, state, frozen)
      return step(state, frozen, train.device_batch(self.mesh, batch, o.global_batch_size))

    loader = data_lib.Loader(arrays, o.global_batch_size,
                             c.run.seed + (1 if name == "sft" else 2), pid, nproc)
    ckpts = checkpoint.Manager(os.path.join(c.run.output_dir, "checkpoints", name),
                               c.checkpoint.keep_checkpoints,
                               {"fingerprint": identity.fingerprint(c, name, arrays, initial)}, info)
    return Stage(name, spec.total_steps, dispatch, fresh, frozen, loader, ckpts, self.writer,
                 [*hooks, *self.extra_hooks.get(name, ())])


def _check_batch(cfg, mesh) -> None:
  shards = sharding.batch_shards(mesh)
  if cfg.optim.global_batch_size % shards:
    raise ValueError(f"--global_batch_size={cfg.optim.global_batch_size} is not divisible by "
                     f"the {shards} ways the mesh {dict(mesh.shape)} splits the batch")


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


def _sft(p: Program, params, sft_out: str):
  """The SFT stage (all weights train); returns the SFT model, also saved to `sft_out`."""
  c = p.cfg
  initial = identity.model_digest(c.checkpoint.init_from)
  want = {"fingerprint": identity.fingerprint(c, "sft", p.data.sft, initial)}
  if identity.reusable(sft_out, want, c.optim.sft_steps, "--sft_steps"):
    logging.info("sft: %s exists; stage done", sft_out)
    return checkpoint.load_params(sft_out, c.model, p.mesh)
  spec = train.StepConfig.sft(c)
  opt, _ = spec.optimizer()
  fresh = lambda: train.init_state(jax.tree.map(lambda x: x.copy(), params), opt, c.run.seed,
                                   p.mesh)
  stage_hooks = [hooks.LogMetrics(c.run.log_every),
                 hooks.SaveCheckpoints(c.checkpoint.checkpoint_every)]
  state = p.stage("sft", fresh, None, p.data.sft, stage_hooks,
                  {"init_from": c.checkpoint.init_from, "lora": False}, initial).run()
  checkpoint.save_params(sft_out, state.params, c.model, stage="sft", step=int(state.step),
                         metrics_records=p.writer.count, **want)
  logging.info("sft: model -> %s", sft_out)
  return state.params


def _dpo(p: Program, params, reference_path: str) -> dict:
  """The DPO stage against the frozen `params`, then export and the final evaluation."""
  c, mesh, summary = p.cfg, p.mesh, {}
  if c.model.base_quant != "none":
    before = transformer.nbytes(params)
    params = quant.quantize_params(transformer.param_specs(c.model), c.model.base_quant, params,
                                   mesh)
    after = transformer.nbytes(params)
    logging.info("base_quant=%s: frozen base %.1f MiB -> %.1f MiB (saved %.1f MiB, %.0f%%)",
                 c.model.base_quant, before / 2**20, after / 2**20, (before - after) / 2**20,
                 100 * (1 - after / before))
    summary["base_bytes"] = {"float32": before, c.model.base_quant: after}
  if p.data.held is not None:
    summary["reference_perplexity"] = evaluate.pair_metrics(
        c, mesh, params, None, params, p.data.held, c.optim.global_batch_size)["perplexity"]
  spec = train.StepConfig.dpo(c)
  opt, _ = spec.optimizer()
  if c.guard.log_kl and not spec.kl:
    logging.warning("--log_kl: no reference forward runs in the step (precompute_ref or a "
                    "reference-free loss), so the step logs no token KL; the evaluation's "
                    "on-policy KL is still reported")
  if c.lora.enabled:
    logging.info("LoRA: rank %d on %s, %.3fM trainable parameters", c.lora.lora_rank,
                 ",".join(c.lora.lora_targets), transformer.num_params(transformer.abstract(
                     train.trainable_specs(c.model, c.lora))) / 1e6)
  key = jax.random.fold_in(jax.random.key(c.run.seed), 1)
  trainable = lambda: train.initial_trainable(c.model, c.lora, params, key, mesh)
  fresh = lambda: train.init_state(trainable(), opt, c.run.seed, mesh)
  tr_dpo = c.reference.ref_update != "none"
  frozen = train.initial_frozen(params, trainable() if tr_dpo and c.lora.enabled else None)
  pairs = p.data.pairs
  if c.reference.precompute_ref:
    cache_dir = c.reference.ref_cache_dir or os.path.join(c.run.output_dir, "ref_cache")
    ref_arrays, summary["ref_cache"] = reference.cached(spec, mesh, frozen, pairs, p.data.tok,
                                                        cache_dir, c.optim.global_batch_size)
    pairs = {**pairs, **ref_arrays}
  # Evaluation (held-out pairs, samples, KL, win rate) is against the SFT model (`params`) for
  # every loss and reference scheme, so runs stay comparable (TR-DPO moves the training
  # reference).
  evaluator = evaluate.Evaluator(c, mesh, p.data.tok, p.data.eval_prompts, params, p.data.held,
                                 p.data.reward_fn)
  split = lambda t: (params, t) if c.lora.enabled else (t, None)
  evaluate_state = lambda step, st: _evaluate(evaluator, *split(st.params), step, p.writer)
  log = hooks.LogMetrics(c.run.log_every)
  mask = p.data.pairs["loss_mask"]  # the estimates' per-token unit: mean completion length
  guard = hooks.KLGuard(c.guard, c.kl_estimate, c.loss.beta, float(mask.sum() / max(
      mask.shape[0] * mask.shape[1], 1)))
  stage_hooks = [*([guard] if c.guard.enabled else []), log,
                 hooks.SaveCheckpoints(c.checkpoint.checkpoint_every),
                 hooks.Evaluate(c.eval.eval_every, evaluate_state, log),
                 *([hooks.UpdateReference(c.reference)] if tr_dpo else [])]
  t_dpo = time.perf_counter()
  state = p.stage("dpo", fresh, frozen, pairs, stage_hooks,
                  {"reference": reference_path, "lora": c.lora.enabled},
                  identity.model_digest(reference_path)).run()
  summary["dpo_time_s"] = round(time.perf_counter() - t_dpo, 1)
  policy, lora = split(state.params)
  _export(c, params, policy, lora, int(state.step), reference_path)
  final, examples = evaluate_state(c.optim.steps, state)
  summary.update(final)
  summary["skipped_steps"] = int(state.skipped)
  summary["lr_scale"] = float(state.lr_scale)
  if p.writer.enabled:
    print(evaluate.report(final, examples, c.eval.eval_show), flush=True)
  return summary


def _export(c, base, policy, lora, step: int, reference_path: str) -> None:
  """The policy (LoRA merged) as a dpo-jax params checkpoint, and with --export_hf for
  transformers (plus the adapter alone for PEFT)."""
  policy_out = os.path.join(c.run.output_dir, "checkpoints", "policy")
  if c.model.base_quant == "none":
    merged = lora_lib.merge(base, lora, c.lora) if lora is not None else policy
    checkpoint.save_params(policy_out, merged, c.model, stage="dpo", step=step,
                           reference=reference_path)
    logging.info("dpo: policy (LoRA merged) -> %s", policy_out)
  else:
    logging.info("dpo: base_quant=%s; no merged policy export (the adapters are in %s)",
                 c.model.base_quant, os.path.join(c.run.output_dir, "checkpoints", "dpo"))
  out_hf, init_from = c.checkpoint.export_hf, c.checkpoint.init_from
  if out_hf:
    from models import hf
    hf.save(out_hf, c.model, policy, lora, c.lora, source=hf.source_config(init_from))
    if lora is not None:
      hf.save_peft(os.path.join(out_hf, "adapter"), c.model, lora, c.lora,
                   base_model=init_from.removeprefix("hf:"))
    logging.info("exported the policy (LoRA merged) to %s", out_hf)


def run(cfg, mesh=None, init_params=None,
        extra_hooks: Mapping[str, Sequence[Hook]] | None = None) -> dict[str, Any]:
  """Runs the configured stages and returns the summary (also written to summary.json).

  `init_params` replaces the starting model (e.g. one SFT model shared by several DPO runs; see
  dpo/tools/compare_losses.py); `extra_hooks` adds hooks per stage name (tests inject faults).
  """
  t_start = time.perf_counter()
  out = cfg.run.output_dir
  identity.check_policy(cfg.checkpoint.resume, os.path.join(out, "checkpoints"))
  mesh = mesh or sharding.make_mesh(cfg.mesh.mesh)
  _check_batch(cfg, mesh)
  writer = MetricsWriter(out)
  cfg, params = ((cfg, init_params) if init_params is not None
                 else initial_params(cfg, jax.random.fold_in(jax.random.key(cfg.run.seed), 0), mesh))
  if writer.enabled:
    with open(os.path.join(out, "config.json"), "w") as f:
      json.dump(cfg.to_dict(), f, indent=2)
  data = Data(cfg)
  pid, nproc = sharding.process_batch_block(mesh, cfg.optim.global_batch_size)
  logging.info("model: %.2fM parameters, mesh %s, %d processes (this one loads batch block "
               "%d of %d)", transformer.num_params(params) / 1e6, dict(mesh.shape),
               jax.process_count(), pid, nproc)
  log_memory_estimate(cfg, mesh)
  summary: dict[str, Any] = {"data": data.reports} if data.reports else {}
  program = Program(cfg, mesh, data, writer, extra_hooks or {})
  ckroot = os.path.join(out, "checkpoints")
  init_from = cfg.checkpoint.init_from
  reference_path = (os.path.abspath(init_from) if init_from and not init_from.startswith("hf:")
                    else init_from)
  if cfg.run.stage in ("sft", "all"):
    sft_out = os.path.join(ckroot, "sft_model")
    reference_path = os.path.abspath(sft_out)
    params = _sft(program, params, sft_out)
  if cfg.run.stage in ("dpo", "all"):
    if not reference_path:
      reference_path = os.path.abspath(os.path.join(ckroot, "dpo_base"))
      want = {"fingerprint": identity.fingerprint(cfg, "init", {}, "random")}
      if not identity.reusable(reference_path, want):
        checkpoint.save_params(reference_path, params, cfg.model, stage="init", **want)
    summary.update(_dpo(program, params, reference_path))
  summary["wall_time_s"] = round(time.perf_counter() - t_start, 1)
  if writer.enabled:
    with open(os.path.join(out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  logging.info("summary: %s", json.dumps(summary))
  return summary

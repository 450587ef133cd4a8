"""Direct preference optimisation and its family: the policy (LoRA on a frozen base, or every
weight) against a frozen reference, with any registered loss (dpo/losses.py), then export and
the final evaluation."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Sequence

import jax

from dpo import batches, chat, checkpoint, evaluate, hooks, identity, packing, registry
from dpo import judges, progress, reference
from dpo import tokenizer as tokenizer_lib
from dpo import train
from dpo.program import Start
from dpo.runner import MetricsWriter
from models import lora as lora_lib
from models import quant, transformer


def _evaluate(evaluator: evaluate.Evaluator, policy: evaluate.Weights, step: int,
              writer: MetricsWriter):
  t = time.perf_counter()
  with progress.doing(f"the evaluation at step {step}"):
    metrics, examples = evaluator(policy)
  metrics["eval_time_s"] = round(time.perf_counter() - t, 2)
  writer.write({"stage": "eval", "step": step, **{f"eval/{k}": v for k, v in metrics.items()}})
  f = lambda k: "n/a" if metrics.get(k) is None else f"{metrics[k]:.3f}"
  logging.info("eval  %5d  win %s  lc-win %s  reward %s vs %s  KL/seq %s  KL/tok %s  acc %s  "
               "margin %s  ppl %s  (%.1fs)", step, f("win_rate"), f("lc_win_rate"),
               f("policy_reward"), f("reference_reward"), f("kl_per_sequence"), f("kl_per_token"),
               f("reward_accuracy"), f("reward_margin"), f("perplexity"), metrics["eval_time_s"])
  return metrics, examples


def run(p, model: registry.Model) -> registry.Model:
  """The DPO stage from `model` (the policy's start and, unless --ref_init_from names another,
  the frozen reference), then export and the final evaluation (into the run's summary); hands
  on the policy (LoRA merged) and where it is saved."""
  return preference_stage(p, model, DPO)


def preference_stage(p, model: registry.Model, algorithm: registry.Algorithm,
                     online=None, kl_estimate: str | None = "") -> registry.Model:
  """A preference stage of `algorithm` from `model`: the DPO stage on the training pairs, or
  with `online(p, judge, base) -> (prompt arrays, Program.stage's online)` a stage that samples
  its pairs as it trains (dpo/algorithms/online_dpo.py; the online object's `hooks`, if it has
  any, go first in the stage's hooks); the same reference, loss, hooks, export and evaluation
  either way. `kl_estimate` is what the KL guard watches ("" = the DPO
  step's, `Config.kl_estimate`; None = nothing the stage logs, the guard off)."""
  c, mesh, summary = p.cfg, p.mesh, p.summary
  reference_path = _reference_path(c, model)
  params = _quantized_base(c, mesh, model.params, summary)
  ref = reference.load(c, mesh) if c.reference.ref_init_from else None
  if ref is not None and c.model.base_quant != "none":
    ref = quant.quantize_params(transformer.param_specs(c.model), c.model.base_quant, ref, mesh)
  ref_model = params if ref is None else ref  # what the step and the evaluation compare against
  if p.data.held is not None:
    summary["reference_perplexity"] = evaluate.pair_metrics(
        c, mesh, evaluate.Weights(ref_model), ref_model, p.data.held,
        c.optim.global_batch_size)["perplexity"]
  spec = algorithm.step_config(c)
  opt, _ = (algorithm.optimizer or train.StepConfig.optimizer)(spec)
  if c.guard.log_kl and not spec.kl:
    logging.warning("--log_kl: the %s step computes no token KL (its reference is precomputed "
                    "or not read, or the stage logs its own KL estimate); the evaluation's "
                    "on-policy KL is still reported", algorithm.name)
  if c.lora.enabled:
    logging.info("LoRA: rank %d on %s, %.3fM trainable parameters", c.lora.lora_rank,
                 ",".join(c.lora.lora_targets), transformer.num_params(transformer.abstract(
                     train.trainable_specs(c.model, c.lora))) / 1e6)
  key = jax.random.fold_in(jax.random.key(c.run.seed), 1)
  trainable = lambda: train.initial_trainable(c.model, c.lora, params, key, mesh)

  def fresh():
    state_params = trainable()
    if algorithm.beside is not None:
      state_params = {"policy": state_params,
                      "beside": algorithm.beside(c, mesh, params, jax.random.fold_in(key, 1))}
    return train.init_state(state_params, opt, c.run.seed, mesh)

  tr_dpo = c.reference.ref_update != "none"
  frozen = train.initial_frozen(params, trainable() if tr_dpo and c.lora.enabled else None, ref,
                                c.lora.enabled)
  # Evaluation (held-out pairs, samples, KL, win rate) is against the SFT model (`params`), or
  # the --ref_init_from model, for every loss and reference scheme, so runs stay comparable
  # (TR-DPO moves the training reference).
  judge = judges.load(c, mesh, p.data.tok, p.data.template)
  logging.info("evaluation judge: %s", judges.describe(judge))
  evaluator = evaluate.Evaluator(c, mesh, p.data.eval_set(judge), ref_model)
  if online is None:
    (pairs, packed), sampled = _training_rows(p, spec, frozen), None
  else:
    pairs, sampled = online(p, judge, params)
    packed = None
  policy_of = lambda st: algorithm.policy_part(st.params)
  weights = lambda st: (evaluate.Weights(params, policy_of(st)) if c.lora.enabled
                        else evaluate.Weights(policy_of(st)))
  evaluate_state = lambda step, st: _evaluate(evaluator, weights(st), step, p.writer)
  t_dpo = time.perf_counter()
  start = Start(fresh, frozen, identity.model_digest(reference_path),
                {"reference": reference_path, "lora": c.lora.enabled})
  estimate = c.kl_estimate if kl_estimate == "" else kl_estimate
  hooks = [*getattr(sampled, "hooks", ()), *_hooks(c, p.data, evaluate_state, estimate)]
  state = p.stage(algorithm, start, pairs, hooks, packed, sampled).run()
  summary[f"{algorithm.name}_time_s"] = round(time.perf_counter() - t_dpo, 1)
  policy = weights(state)
  handed_on = _save_policy(c, policy, int(state.step), reference_path, algorithm.name)
  if c.checkpoint.export_hf:
    with progress.doing(f"the export to {c.checkpoint.export_hf}"):
      _export_hf(c, policy, int(state.step), p.data, model.path)
  final, samples = evaluate_state(spec.total_steps, state)
  summary.update(final)
  summary["skipped_steps"] = int(state.skipped)
  summary["lr_scale"] = float(state.lr_scale)
  summary["verdicts"] = evaluate.verdicts(final, summary.get("reference_perplexity"))
  if p.writer.enabled:
    if samples:
      _write_jsonl(os.path.join(c.run.output_dir, "samples.jsonl"), samples)
    if evaluator.answers:  # a reasoning task: one record a held-out problem
      _write_jsonl(os.path.join(c.run.output_dir, "answers.jsonl"), evaluator.answers)
    print(evaluate.report(final, samples, c.eval.eval_show, summary["verdicts"]), flush=True)
  return handed_on


def _reference_path(c, model: registry.Model) -> str:
  """Where the reference is saved, which a resume must find unchanged: --ref_init_from, the
  model the stage starts from, or (a random base) checkpoints/dpo_base, saved here once so
  the reference has a content digest."""
  if c.reference.ref_init_from:
    ref_from = c.reference.ref_init_from
    return ref_from if ref_from.startswith("hf:") else os.path.abspath(ref_from)
  if model.path:
    return model.path
  path = os.path.abspath(os.path.join(c.run.output_dir, "checkpoints", "dpo_base"))
  want = {"fingerprint": identity.fingerprint(c)}
  if not identity.reusable(path, want):
    checkpoint.save_params(path, model.params, c.model, stage="init", **want)
  return path


def _quantized_base(c, mesh, params, summary: dict):
  """The frozen base as the policy computes with it: --base_quant's format (converted here,
  or already imported so: loop.initial_params), or as given."""
  if c.model.base_quant == "none":
    return params
  specs = transformer.param_specs(c.model)
  before = transformer.nbytes(transformer.abstract(specs))  # its float32 bytes
  if not any(quant.in_format(w, c.model.base_quant) for w in params["layers"].values()):
    params = quant.quantize_params(specs, c.model.base_quant, params, mesh)
  after = transformer.nbytes(params)
  logging.info("base_quant=%s: frozen base %.1f MiB -> %.1f MiB (saved %.1f MiB, %.0f%%)",
               c.model.base_quant, before / 2**20, after / 2**20, (before - after) / 2**20,
               100 * (1 - after / before))
  summary["base_bytes"] = {"float32": before, c.model.base_quant: after}
  return params


def _training_rows(p, spec: train.StepConfig, frozen: train.Frozen):
  """(the pair arrays the stage's loader indexes, the shared-prefix rows each batch's packed
  rows are built from (`Program.stage`'s `to_pack`) or None): the tokenized pairs, with the precomputed reference
  statistics (--precompute_ref) and the shared-prefix rows (--prefix_sharing) beside them."""
  c, pairs = p.cfg, p.data.pairs
  if c.reference.precompute_ref:
    cache_dir = c.reference.ref_cache_dir or os.path.join(c.run.output_dir, "ref_cache")
    ref_arrays, p.summary["ref_cache"] = reference.cached(
        spec, p.mesh, frozen, pairs, reference.Cache(cache_dir, p.data.tok),
        c.optim.global_batch_size)
    pairs = {**pairs, **ref_arrays}
  if not c.model.prefix_sharing:
    return pairs, None
  shared, note = packing.shared_prefix(pairs)
  logging.info("%s", note)
  if c.model.packing:
    if shared is None:
      raise ValueError(f"--packing packs shared-prefix rows, and {note}")
    return pairs, shared  # each batch's rows are packed from these (Program.stage)
  return (pairs, None) if shared is None else ({**pairs, **shared}, None)


def _hooks(c, data, evaluate_state, estimate: str | None) -> list:
  """The DPO stage's hooks: the KL guard (when on, watching `estimate`), logging, checkpoints,
  evaluation and the TR-DPO reference update (when on)."""
  log = hooks.LogMetrics(c.run.log_every)
  # the estimates' per-token unit: mean completion length (of the pairs, unpaired rows or
  # prompts' worked solutions)
  mask = next(t for t in (data.pairs, data.unpaired, data.prompts) if t is not None)["loss_mask"]
  guarded = c.guard.enabled and estimate is not None
  if c.guard.enabled and not guarded:
    logging.warning("KL guard off: this stage logs no KL to watch (GRPO logs it with "
                    "--grpo_beta > 0)")
  guard = hooks.KLGuard(c.guard, estimate or "kl", c.loss.beta, float(mask.sum() / max(
      mask[..., 0].size, 1)))
  return [*([guard] if guarded else []), log,
          # evaluation first: a checkpoint then implies its step's evaluation is on record
          hooks.Evaluate(c.eval.eval_every, evaluate_state, log),
          hooks.SaveCheckpoints(c.checkpoint.checkpoint_every),
          *([hooks.UpdateReference(c.reference)] if c.reference.ref_update != "none" else [])]


def _write_jsonl(path: str, records: Sequence[dict]) -> None:
  """All records, replacing the file whole (written aside, then renamed)."""
  with open(path + ".tmp", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  os.replace(path + ".tmp", path)


def _save_policy(c, weights: evaluate.Weights, step: int, reference_path: str,
                 stage: str = "dpo") -> registry.Model:
  """The policy (LoRA merged) as a dpo-jax params checkpoint, checkpoints/policy. With a
  quantized base there is no float policy to save (the adapters are in the step checkpoints):
  what is handed on is Model(None, "")."""
  params, lora = weights  # with LoRA, params is the frozen base
  policy_out = os.path.join(c.run.output_dir, "checkpoints", "policy")
  if c.model.base_quant != "none":
    logging.info("%s: base_quant=%s; no dpo-jax policy checkpoint (the adapters are in %s)",
                 stage, c.model.base_quant, os.path.join(c.run.output_dir, "checkpoints", stage))
    return registry.Model(None, "")
  merged = lora_lib.merge(params, lora, c.lora) if lora is not None else params
  checkpoint.save_params(policy_out, merged, c.model, stage=stage, step=step,
                         reference=reference_path)
  logging.info("%s: policy (LoRA merged) -> %s", stage, policy_out)
  return registry.Model(merged, os.path.abspath(policy_out))


def _export_hf(c, weights: evaluate.Weights, step: int, data, started_from: str) -> None:
  """--export_hf: a folder transformers loads as it is: the policy (`weights`: all its params,
  or with LoRA the frozen base and the factors, merged) with the tokenizer (and the chat
  template the data was rendered with) and generation_config.json (stopping at every
  end-of-turn id). With LoRA, `adapter/` holds the PEFT adapter; its base is the `hf:` folder
  the DPO stage started from (`started_from`, its Model.path), else the DPO stage's base (the
  SFT model, a random base, or a quantized base dequantized), exported as `base/` beside it.
  A folder this process may not write stops the run before anything is written
  (`checkpoint.Unreadable`, one line naming it)."""
  params, lora = weights
  quantized = c.model.base_quant != "none"
  out_hf, init_from = c.checkpoint.export_hf, c.checkpoint.init_from
  if jax.process_index() == 0:  # the process that writes it
    checkpoint.check_writable(out_hf)
  from models import hf
  tok, template = data.tok, data.template
  info = {"step": str(step), "stage": c.run.stage, "init_from": init_from,
          "base_quant": c.model.base_quant}
  if quantized:
    info["note"] = (f"the merged weights are the {c.model.base_quant}-dequantized base plus "
                    f"the LoRA delta (the model the policy computed), not the float base's")

  def extras(directory: str) -> None:
    if isinstance(tok, tokenizer_lib.HFTokenizer):
      source = (template.source if isinstance(template, chat.JinjaTemplate) else
                template.jinja)  # a hand-written template's Jinja form
      hf.save_tokenizer(directory, tok, source)
    hf.save_generation_config(directory, tok.bos_id, chat.end_of_turn_ids(template, tok),
                              tok.pad_id)

  source = hf.source_config(init_from)
  hf.save(out_hf, c.model, params, None if lora is None else hf.Lora(lora, c.lora),
          hf.SaveOptions(source, metadata={f"dpo_jax_{k}": v for k, v in info.items()}))
  extras(out_hf)
  if not isinstance(tok, tokenizer_lib.HFTokenizer):
    logging.warning("--export_hf: the byte tokenizer has no Hugging Face form; %s has no "
                    "tokenizer files (ids 0-255 are UTF-8 bytes, 256 PAD, 257 BOS, 258 EOS)",
                    out_hf)
  what = "LoRA merged" if lora is not None else "all weights"
  if quantized:
    what += f", over the {c.model.base_quant}-dequantized base"
  logging.info("exported the policy (%s) to %s", what, out_hf)
  if lora is not None:
    if started_from.startswith("hf:") and not quantized:
      adapter_base = os.path.abspath(started_from[3:])
    else:
      adapter_base = os.path.abspath(os.path.join(out_hf, "base"))
      hf.save(adapter_base, c.model, params, options=hf.SaveOptions(source, metadata={
          f"dpo_jax_{k}": v for k, v in {**info, "role": "adapter base"}.items()}))
      extras(adapter_base)
      logging.info("exported the adapter's base (%s) to %s", f"{c.model.base_quant}-dequantized"
                   if quantized else f"the DPO stage's start, {started_from or 'a random init'}",
                   adapter_base)
    adapter_dir = os.path.join(out_hf, "adapter")
    hf.save_peft(adapter_dir, c.model, lora, c.lora, base_model=adapter_base,
                 metadata={f"dpo_jax_{k}": v for k, v in info.items()})
    logging.info("exported the PEFT adapter to %s (base: %s)", adapter_dir, adapter_base)
  if jax.process_index() == 0:
    with open(os.path.join(out_hf, "dpo_jax_export.json"), "w") as f:
      json.dump({**info, "adapter_base": adapter_base if lora is not None else None,
                 "chat_template": template.name, "tokenizer": tok.name}, f, indent=2)


DPO = registry.register(registry.Algorithm(
    name="dpo", step=train.dpo_step, batch=batches.PairBatch.of,
    step_config=train.StepConfig.dpo, run=run,
    hyperparameters=lambda cfg: identity.sections(cfg, ("lora", "optim", "loss", "reference",
                                                         "guard")),
    data_files=("train_data", "tokenizer"), data_seed=2,
    steps_flag="--steps", rows="pairs", judged=True,
    columns=(("loss", "loss", ".4f"), ("acc", "rewards/accuracies", ".3f"),
             ("margin", "rewards/margins", "+.4f"), ("kl", "kl", ".4f"),
             ("|g|", "grad_norm", ".3f"), ("lr", "learning_rate", ".2e"),
             ("skipped", "skipped_steps", "d")),
    curves=(("DPO loss", "loss", "train"), ("reward accuracy", "rewards/accuracies", "train"),
            ("reward margin", "rewards/margins", "train"),
            ("implicit rewards", "rewards/chosen", "chosen"),
            ("implicit rewards", "rewards/rejected", "rejected"),
            ("KL(pi || ref) per token", "kl", "in step"), ("gradient norm", "grad_norm", "dpo"),
            ("learning rate", "learning_rate", "dpo"))))

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
import hashlib
import importlib.metadata as md
import json
import logging
import os
import platform
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

import configs
from dpo import chat, checkpoint, curves, evaluate, formats, hooks, identity, packing, prepare
from dpo import reference, task, tracking, train
from dpo import data as data_lib
from dpo import tokenizer as tokenizer_lib
from dpo.runner import Hook, MetricsWriter, Stage, TrainingStopped  # noqa: F401 (re-exported)
from models import lora as lora_lib
from models import quant, sharding, transformer




class Data:
  """Tokenized SFT, training and held-out arrays for one run.

  With --train_data the pairs go through dpo.prepare (any supported format, quality filters,
  chat template, held-out split, cached tokenisation); SFT then uses --sft_data (any SFT
  layout, rendered with the same template) or, failing that, the chosen rows of the training
  pairs. A data set smaller than one global batch is a DataError naming the file and the flag.
  `inspect` writes what the model is trained on.
  """

  def __init__(self, cfg, tok=None, check_sizes: bool = True):
    d, seed = cfg.data, cfg.run.seed
    self.tok = tok or tokenizer_lib.load_tokenizer(d.tokenizer, d.bos_token, d.eos_token,
                                                   d.pad_token)
    if check_sizes and cfg.model.vocab_size < self.tok.vocab_size:
      raise ValueError(f"vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                       f"{self.tok.vocab_size} ids")
    self.embedded = not d.train_data
    self.template = chat.resolve_template(d.chat_template, self.tok)
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
      if d.eval_data and d.eval_split:
        raise ValueError("give either --eval_data or --eval_split, not both")
      spec = formats.FormatSpec(d.data_format, d.prompt_field, d.chosen_field, d.rejected_field)
      cache_dir = ("" if d.data_cache_dir == "none" else
                   d.data_cache_dir or os.path.join(cfg.run.output_dir, "data_cache"))
      prep = functools.partial(prepare.prepare_pairs, tok=self.tok, spec=spec,
                               template=self.template, max_prompt_length=lens[0],
                               max_target_length=lens[1], cache_dir=cache_dir,
                               skip_bad=d.skip_bad_records)
      train_prep = prep(d.train_data, eval_split=d.eval_split)
      self.reports.append(train_prep.report)
      self.pairs, self.held = train_prep.train, train_prep.held
      if d.eval_data:
        eval_prep = prep(d.eval_data, eval_split=0.0)
        self.reports.append(eval_prep.report)
        self.held = eval_prep.train
    if d.sft_data:  # rendered with the template the preference data gets
      self.sft, report = prepare.prepare_sft(d.sft_data, self.tok, self.template, *lens,
                                             skip_bad=d.skip_bad_records)
      self.reports.append(report)
    elif self.embedded:
      self.sft = data_lib.tokenize_sft(task.sft_records(d.task_sft_examples, seed), self.tok,
                                       *lens, what="sft data")
    else:  # the chosen row of each training pair is a (prompt, completion) SFT example
      self.sft = {k: v[:, 0] for k, v in self.pairs.items()}
    if check_sizes:
      batch, stage = cfg.optim.global_batch_size, cfg.run.stage
      for arrays, used, what in ((self.pairs, stage in ("dpo", "all"),
                                  d.train_data or "the embedded task's pairs"),
                                 (self.sft, stage in ("sft", "all"),
                                  d.sft_data or d.train_data or "the embedded task's SFT data")):
        if used and len(arrays["tokens"]) < batch:
          raise data_lib.DataError(
              f"{what}: {len(arrays['tokens'])} training examples after filtering and the "
              f"held-out split, fewer than one batch of --global_batch_size={batch}")
      # Refused before any stage runs, not when the DPO stage starts after SFT.
      packs = cfg.model.packing and stage in ("dpo", "all")
      why = packing.prompt_lengths(self.pairs)[1] if packs else None
      if why is not None:
        raise data_lib.DataError(f"--packing packs shared-prefix rows, and prefix sharing does "
                                 f"not apply to {d.train_data or 'the pairs'}: {why}")
    # Sampling prompts: the embedded task's held-out prompts, or those of the first held-out
    # pairs of real data (as the chat template rendered them). The ground-truth reward and the
    # well-formedness check exist only for the embedded task; without them win rate, true
    # rewards and the well-formed rate are reported as null.
    self.eval_prompt_ids, self.stop_ids = None, ()
    if self.embedded:
      self.eval_prompts = task.eval_prompts(d.task_eval_prompts)
    else:
      self.eval_prompt_ids = held_prompts(self.held, d.task_eval_prompts)
      self.eval_prompts = [self.tok.decode(p) for p in self.eval_prompt_ids]
      self.stop_ids = tuple(chat.end_of_turn_ids(self.template, self.tok))
    self.reward_fn = task.true_reward if self.embedded else None
    self.well_formed_fn = task.well_formed if self.embedded else None
    logging.info("data: %d SFT examples (T=%d), %d train pairs (T=%d), %d held-out pairs",
                 len(self.sft["tokens"]), self.sft["tokens"].shape[-1],
                 len(self.pairs["tokens"]), self.pairs["tokens"].shape[-1],
                 0 if self.held is None else len(self.held["tokens"]))

  def preview(self, n: int) -> list[dict]:
    """The first `n` training pairs as the model sees them: the text decoded from the token
    ids, the ids, and the positions whose tokens are scored (loss_mask = 1)."""
    out, t = [], self.pairs
    for i in range(min(n, len(t["tokens"]))):
      rec = {"index": i}
      for side, name in ((0, "chosen"), (1, "rejected")):
        tokens, mask = t["tokens"][i, side], t["loss_mask"][i, side]
        length = int(t["segment_ids"][i, side].sum())
        scored = [int(k) for k in np.flatnonzero(mask)]
        start = scored[0] if scored else length
        if side == 0:
          rec["prompt_ids"] = [int(x) for x in tokens[:start]]
          rec["prompt_text"] = self.tok.decode(rec["prompt_ids"])
        ids = [int(x) for x in tokens[start:length]]
        rec.update({f"{name}_text": self.tok.decode(ids), f"{name}_ids": ids,
                    f"{name}_scored_positions": scored})
      out.append(rec)
    return out

  def inspect(self, n: int, output_dir: str, show: int = 3) -> dict:
    """--inspect_data=N: <output_dir>/data_preview.jsonl and the first `show` pairs printed."""
    if n < 0:
      raise ValueError(f"--inspect_data must be >= 0 (0 = off), got {n}")
    records = self.preview(n)
    path = os.path.join(output_dir, "data_preview.jsonl")
    if jax.process_index() == 0:
      os.makedirs(output_dir, exist_ok=True)
      with open(path, "w", encoding="utf-8") as f:
        for r in records:
          f.write(json.dumps(r, ensure_ascii=False) + "\n")
      for r in records[:show]:
        print(f"--- pair {r['index']}: {len(r['prompt_ids'])} prompt tokens, "
              f"{len(r['chosen_scored_positions'])} / {len(r['rejected_scored_positions'])} "
              f"scored chosen / rejected tokens")
        for k in ("prompt_text", "chosen_text", "rejected_text"):
          print(f"{k}: {r[k]!r}")
      print(f"wrote {len(records)} pairs to {path}; --inspect_data: not training", flush=True)
    return {"inspect_data": path, "pairs": len(records), "data": self.reports}


def held_prompts(held: dict | None, n: int) -> list[list[int]]:
  """The distinct prompts (token ids before the first scored token) of the held-out pairs, in
  order, at most n."""
  out: dict[tuple[int, ...], None] = {}
  for tokens, mask in zip(held["tokens"][:, 0], held["loss_mask"][:, 0]) if held else ():
    if len(out) == n:
      break
    scored = np.flatnonzero(mask)
    out.setdefault(tuple(int(t) for t in tokens[:scored[0] if len(scored) else 0]))
  return [list(p) for p in out if p]


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


# Packing chooses its row-count buckets on at most this many of the first epoch's batches.
_FIT_BATCHES = 1000

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
            initial: str, packed: dict | None = None) -> Stage:
    """Stage `name` (sft or dpo) over `arrays` from the model with digest `initial`, resuming
    from <output_dir>/checkpoints/<name>; the stage's fingerprint is what a checkpoint must
    match to be resumed, `info` is recorded beside it. `packed` (every pair's shared-prefix
    rows) packs each batch's rows (--packing)."""
    c, o = self.cfg, self.cfg.optim
    step_fn, spec = _STEPS[name][0], _STEPS[name][1](c)
    pid, nproc = sharding.process_batch_block(self.mesh, o.global_batch_size)

    def dispatch(state, frozen, batch):  # jit_step is cached: one compile per stage
      step = train.jit_step(step_fn, spec, self.mesh, state, frozen)
      return step(state, frozen, train.device_batch(self.mesh, batch, o.global_batch_size))

    loader = data_lib.Loader(arrays, o.global_batch_size,
                             c.run.seed + (1 if name == "sft" else 2), pid, nproc)
    if packed is not None:
      k = o.gradient_accumulation_steps
      packer = packing.Packer(packed, o.global_batch_size, nproc, k,
                              sharding.batch_shards(self.mesh) * k)
      logging.info("%s", packer.fit(loader.batch_rows(0)[:_FIT_BATCHES]))
      loader.pack = packer.pack
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
  k = cfg.optim.gradient_accumulation_steps
  if cfg.optim.global_batch_size % (k * shards):
    raise ValueError(f"--global_batch_size={cfg.optim.global_batch_size} is not divisible by "
                     f"--gradient_accumulation_steps={k} x the {shards} ways the mesh splits "
                     "the batch (each device's rows split evenly between microbatches)")


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
  if identity.reusable(sft_out, want, c.optim.sft_steps, "--sft_steps",
                       downstream=os.path.join(os.path.dirname(sft_out), "dpo")):
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
  ref = reference.load(c, mesh) if c.reference.ref_init_from else None
  if ref is not None and c.model.base_quant != "none":
    ref = quant.quantize_params(transformer.param_specs(c.model), c.model.base_quant, ref, mesh)
  ref_model = params if ref is None else ref  # what the step and the evaluation compare against
  if p.data.held is not None:
    summary["reference_perplexity"] = evaluate.pair_metrics(
        c, mesh, ref_model, None, ref_model, p.data.held, c.optim.global_batch_size)["perplexity"]
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
  frozen = train.initial_frozen(params, trainable() if tr_dpo and c.lora.enabled else None, ref,
                                c.lora.enabled)
  pairs = p.data.pairs
  if c.reference.precompute_ref:
    cache_dir = c.reference.ref_cache_dir or os.path.join(c.run.output_dir, "ref_cache")
    ref_arrays, summary["ref_cache"] = reference.cached(spec, mesh, frozen, pairs, p.data.tok,
                                                        cache_dir, c.optim.global_batch_size)
    pairs = {**pairs, **ref_arrays}
  packed = None
  if c.model.prefix_sharing:
    shared, note = packing.shared_prefix(pairs)
    logging.info("%s", note)
    if c.model.packing:
      if shared is None:
        raise ValueError(f"--packing packs shared-prefix rows, and {note}")
      packed = shared  # each batch's rows are packed from these (Program.stage)
    elif shared is not None:
      pairs = {**pairs, **shared}
  # Evaluation (held-out pairs, samples, KL, win rate) is against the SFT model (`params`), or
  # the --ref_init_from model, for every loss and reference scheme, so runs stay comparable
  # (TR-DPO moves the training reference).
  evaluator = evaluate.Evaluator(c, mesh, p.data.tok, p.data.eval_prompts, ref_model,
                                 p.data.held, p.data.reward_fn, p.data.well_formed_fn,
                                 prompt_ids=p.data.eval_prompt_ids, stop_ids=p.data.stop_ids)
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
                  identity.model_digest(reference_path), packed).run()
  summary["dpo_time_s"] = round(time.perf_counter() - t_dpo, 1)
  policy, lora = split(state.params)
  _export(c, params, policy, lora, int(state.step), reference_path, p.data)
  final, samples = evaluate_state(c.optim.steps, state)
  summary.update(final)
  summary["skipped_steps"] = int(state.skipped)
  summary["lr_scale"] = float(state.lr_scale)
  summary["verdicts"] = evaluate.verdicts(final, summary.get("reference_perplexity"))
  if p.writer.enabled:
    if samples:
      _write_jsonl(os.path.join(c.run.output_dir, "samples.jsonl"), samples)
    print(evaluate.report(final, samples, c.eval.eval_show, summary["verdicts"]), flush=True)
  return summary


def _write_jsonl(path: str, records: Sequence[dict]) -> None:
  """All records, replacing the file whole (written aside, then renamed)."""
  with open(path + ".tmp", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  os.replace(path + ".tmp", path)


def provenance(cfg, mesh) -> dict[str, Any]:
  """What a result was measured with: package versions, devices, mesh, the resolved config's
  hash."""
  versions = {name: md.version(name) for name in ("jax", "jaxlib", "optax", "numpy")}
  versions["python"] = platform.python_version()
  config_json = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
  return {"versions": versions, "device_kind": jax.devices()[0].device_kind,
          "device_count": jax.device_count(), "process_count": jax.process_count(),
          "mesh": dict(mesh.shape),
          "config_sha256": hashlib.sha256(config_json.encode()).hexdigest()}


def _export(c, base, policy, lora, step: int, reference_path: str, data: Data) -> None:
  """The policy (LoRA merged) as a dpo-jax params checkpoint, and with --export_hf a folder
  transformers loads as it is: the merged policy with the tokenizer (and the chat template the
  data was rendered with) and generation_config.json (stopping at every end-of-turn id). With
  LoRA, `adapter/` holds the PEFT adapter; its base is the `--init_from=hf:` folder when the
  DPO stage started from exactly that model, else the DPO stage's base (the SFT model, a random
  base, or a quantized base dequantized), exported as `base/` beside it."""
  policy_out = os.path.join(c.run.output_dir, "checkpoints", "policy")
  quantized = c.model.base_quant != "none"
  if not quantized:
    merged = lora_lib.merge(base, lora, c.lora) if lora is not None else policy
    checkpoint.save_params(policy_out, merged, c.model, stage="dpo", step=step,
                           reference=reference_path)
    logging.info("dpo: policy (LoRA merged) -> %s", policy_out)
  else:
    logging.info("dpo: base_quant=%s; no dpo-jax policy checkpoint (the adapters are in %s)",
                 c.model.base_quant, os.path.join(c.run.output_dir, "checkpoints", "dpo"))
  out_hf, init_from = c.checkpoint.export_hf, c.checkpoint.init_from
  if not out_hf:
    return
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

  hf.save(out_hf, c.model, policy, lora, c.lora, source=hf.source_config(init_from),
          metadata={f"dpo_jax_{k}": v for k, v in info.items()})
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
    if c.run.stage == "dpo" and init_from.startswith("hf:") and not quantized:
      adapter_base = os.path.abspath(init_from[3:])
    else:
      adapter_base = os.path.abspath(os.path.join(out_hf, "base"))
      hf.save(adapter_base, c.model, base, source=hf.source_config(init_from),
              metadata={f"dpo_jax_{k}": v for k, v in {**info, "role": "adapter base"}.items()})
      extras(adapter_base)
      logging.info("exported the adapter's base (%s) to %s", "the SFT model" if c.run.stage ==
                   "all" else f"{c.model.base_quant}-dequantized" if quantized else
                   "the DPO base", adapter_base)
    adapter_dir = os.path.join(out_hf, "adapter")
    hf.save_peft(adapter_dir, c.model, lora, c.lora, base_model=adapter_base,
                 metadata={f"dpo_jax_{k}": v for k, v in info.items()})
    logging.info("exported the PEFT adapter to %s (base: %s)", adapter_dir, adapter_base)
  if jax.process_index() == 0:
    with open(os.path.join(out_hf, "dpo_jax_export.json"), "w") as f:
      json.dump({**info, "adapter_base": adapter_base if lora is not None else None,
                 "chat_template": template.name, "tokenizer": tok.name}, f, indent=2)


def _write_flags(cfg, writer: MetricsWriter) -> None:
  """Logs the settings that differ from the preset and writes them to <output_dir>/flags.txt,
  which `launch.py --flagfile=` reads back (the config as given, before an hf: import fills in
  the model section; config.json holds the resolved one)."""
  lines = configs.flag_lines(cfg)
  logging.info("config %s; settings that differ from it: %s", cfg.run.config,
               " ".join(lines[1:]) or "none")
  if writer.enabled:
    with open(os.path.join(cfg.run.output_dir, "flags.txt"), "w") as f:
      f.write("\n".join(lines) + "\n")


def run(cfg, mesh=None, init_params=None,
        extra_hooks: Mapping[str, Sequence[Hook]] | None = None) -> dict[str, Any]:
  """Runs the configured stages and returns the summary (also written to summary.json).

  `init_params` replaces the starting model (e.g. one SFT model shared by several DPO runs; see
  dpo/tools/compare_losses.py); `extra_hooks` adds hooks per stage name (tests inject faults).
  """
  t_start = time.perf_counter()
  out = cfg.run.output_dir
  if cfg.data.inspect_data != 0:
    return Data(cfg, check_sizes=False).inspect(cfg.data.inspect_data, out)
  identity.check_policy(cfg.checkpoint.resume, os.path.join(out, "checkpoints"))
  mesh = mesh or sharding.make_mesh(cfg.mesh.mesh)
  _check_batch(cfg, mesh)
  writer = MetricsWriter(out)
  _write_flags(cfg, writer)
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
  summary: dict[str, Any] = provenance(cfg, mesh)
  if data.reports:
    summary["data"] = data.reports
  # TensorBoard / W&B get each record of metrics.jsonl as it is written (and flushed, so a
  # crash loses nothing there).
  mirror = tracking.Mirror(cfg, writer)
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
    if cfg.reference.ref_init_from:  # a resume must find the same reference
      ref_from = cfg.reference.ref_init_from
      reference_path = ref_from if ref_from.startswith("hf:") else os.path.abspath(ref_from)
    if not reference_path:
      reference_path = os.path.abspath(os.path.join(ckroot, "dpo_base"))
      want = {"fingerprint": identity.fingerprint(cfg, "init", {}, "random")}
      if not identity.reusable(reference_path, want):
        checkpoint.save_params(reference_path, params, cfg.model, stage="init", **want)
    summary.update(_dpo(program, params, reference_path))
  mirror.close()  # the final evaluation's record
  summary["wall_time_s"] = round(time.perf_counter() - t_start, 1)
  if writer.enabled:
    with open(os.path.join(out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    _draw_curves(out)
  logging.info("summary: %s", json.dumps(summary))
  return summary


def _draw_curves(out: str) -> None:
  """<out>/curves.png from metrics.jsonl, or one line on how to get matplotlib."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    logging.info("no curves.png (matplotlib is not installed): %s", curves.INSTALL)
    return
  logging.info("curves -> %s", curves.render_run(out))

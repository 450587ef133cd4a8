"""Reward-model training: a scalar head on the transformer, trained on the preference pairs with
the Bradley-Terry objective of TRL's `RewardTrainer` (Ouyang et al. 2022, eq. 1;
`-log sigmoid(r_chosen - r_rejected - margin)`), with LoRA (the head trains too, as PEFT's
`modules_to_save` keeps `score` trainable) or every weight.

The reward of a sequence is the final hidden state (after the final norm) at its last scored
token times the head `score` [D, 1] (dpo/reward_model.py, which the judges score with too).

The stage's trainable tree is {"body": the LoRA factors or every weight, "score": [D, 1]}; with
LoRA the frozen part is the base (`train.Frozen`), else None.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from dpo import batches, chat, checkpoint, hooks, identity, packing, progress, registry, train
from dpo import reward_model as reward_lib
from dpo import tokenizer as tokenizer_lib
from dpo.batches import PairBatch
from dpo.program import Start
from models import lora as lora_lib
from models import transformer
from models.config import (FINITE_NONNEG, FINITE_POS, LORA_TARGETS, NONNEG, check, each_of,
                           option, rules)


@dataclass(frozen=True)
class RewardConfig:
  """The reward-model stage (--stage=rm, dpo/algorithms/rm.py): TRL RewardTrainer's
  Bradley-Terry objective on the preference pairs, with LoRA (head trainable) or full weights
  as the lora section says."""
  rm_steps: int = option(1000, "Reward-model optimizer steps (stage rm).")
  rm_learning_rate: float = option(1e-5, "Peak reward-model learning rate (AdamW).")
  center_rewards_coefficient: float = option(
      0.0, "Adds coef * mean((r_chosen + r_rejected)^2) to the reward loss, pulling rewards "
      "towards zero mean (TRL's center_rewards_coefficient, Eisenstein et al. 2023); 0 = none.")
  rm_split: float = option(0.0, "With an rm stage and other stages in --stage: the fraction of the "
                           "training prompts (by a hash of each prompt) the rm stage trains on; "
                           "the other stages train on the rest, so a judge (--judge=rm) does not "
                           "score the policy on the prompts it learnt from. 0 = every stage "
                           "trains on every pair.")
  export_rm_hf: str = option("", "Also export the trained reward model to this directory as a "
                             "transformers *ForSequenceClassification folder (one label, "
                             "score.weight) with the tokenizer; empty = none.")
  rm_lora_targets: tuple[str, ...] = option((), "The reward model's LoRA projections, from "
                                            f"{LORA_TARGETS} (its own PEFT config, as TRL's "
                                            "RewardTrainer takes one); rank, alpha and dropout "
                                            "are the lora section's; empty = --lora_targets.")

  def __post_init__(self):
    rules(self, rm_steps=NONNEG, rm_learning_rate=FINITE_POS,
          center_rewards_coefficient=FINITE_NONNEG, rm_split=(lambda v: 0.0 <= v < 1.0,
                                                              "in [0, 1)"),
          rm_lora_targets=each_of(LORA_TARGETS))


def check_config(cfg) -> None:
  """What an rm stage, or the flags of one, ask of the rest of the config."""
  here = RM.name in cfg.run.stages
  check(not here or cfg.reward.rm_steps >= 1,
        f"--rm_steps={cfg.reward.rm_steps}: must be >= 1 with --stage={cfg.run.stage}")
  check(not here or not cfg.model.packing,
        f"--packing=True: the rm stage reads one pair a row; not with --stage={cfg.run.stage}")
  check(not here or cfg.model.base_quant == "none",
        f"--base_quant={cfg.model.base_quant!r}: the rm stage trains on a float base; not "
        f"with --stage={cfg.run.stage}")
  targets = ",".join(cfg.reward.rm_lora_targets)
  check(not targets or cfg.lora.enabled, f"--rm_lora_targets={targets}: the reward model has no "
        "LoRA with --lora_rank=0 (every weight trains)")
  check(not cfg.reward.rm_split or (here and len(cfg.run.stages) > 1),
        f"--rm_split={cfg.reward.rm_split}: must go with an rm stage and another stage to "
        f"split the prompts with (--stage={cfg.run.stage})")


def lora_config(cfg):
  """The reward model's LoRA: the lora section's, on --rm_lora_targets when they are given."""
  targets = cfg.reward.rm_lora_targets
  return dataclasses.replace(cfg.lora, lora_targets=targets) if targets else cfg.lora


def trainable_specs(model, lora) -> dict:
  """ParamSpecs of what the reward stage trains: {"body": LoRA factors or every weight,
  "score": the head}; init, shardings and the optimizer's state all derive from these."""
  return {"body": train.trainable_specs(model, lora), "score": transformer.score_spec(model)}


def initial_trainable(model, lora, base, key: jax.Array, mesh, head=None):
  """Fresh LoRA factors (or a copy of `base`) and a copy of `head` (an imported reward model's)
  or a fresh one ~ N(0, init_std^2), born sharded."""
  k_body, k_head = jax.random.split(key)
  spec = transformer.score_spec(model)
  head = head.copy() if head is not None else jax.jit(
      lambda k: transformer.init_from_specs(spec, k, model.init_std),
      out_shardings=transformer.shardings(spec, mesh))(k_head)
  return {"body": train.initial_trainable(model, lora, base, k_body, mesh), "score": head}


def bradley_terry(r_B2: jax.Array, margin_B: jax.Array | None, center_coef: float):
  """(loss, metrics) of TRL 1.16 RewardTrainer.compute_loss: the mean over pairs of
  -log sigmoid(r_c - r_r - margin), plus center_coef * mean((r_c + r_r)^2) when center_coef > 0;
  metrics under TRL's names (accuracy counts strict r_c > r_r, as TRL does)."""
  r_c, r_r = r_B2[:, 0], r_B2[:, 1]
  diff_B = r_c - r_r
  loss = -jax.nn.log_sigmoid(diff_B - (0.0 if margin_B is None else margin_B)).mean()
  if center_coef:
    loss = loss + center_coef * jnp.mean((r_c + r_r) ** 2)
  r_g = jax.lax.stop_gradient(r_B2)
  metrics = {"accuracy": (r_g[:, 0] > r_g[:, 1]).astype(jnp.float32).mean(),
             "margin": (r_g[:, 0] - r_g[:, 1]).mean(), "min_reward": r_g.min(),
             "mean_reward": r_g.mean(), "max_reward": r_g.max()}
  return loss, metrics


def microbatch_loss(spec: train.StepConfig, frozen, trainable, batch: PairBatch, dropout_key):
  """(loss, metrics) of one (micro)batch of pairs under the reward model `trainable` (with LoRA
  on the frozen base `frozen.params`)."""
  params, adapter = trainable["body"], None
  if spec.lora.enabled:
    params, adapter = frozen.params, transformer.Adapter.training(
        trainable["body"], spec.lora, dropout_key)
  r_B2 = reward_lib.rewards(spec.model, params, trainable["score"], batch, adapter)
  return bradley_terry(r_B2, batch.margin, spec.own.center_rewards_coefficient)


def rm_step(spec: train.StepConfig, state: train.TrainState, frozen,
            batch: PairBatch) -> tuple[train.TrainState, dict]:
  """One reward-model update on a batch of pairs; with gradient_accumulation_steps = K the
  loss, gradient and metrics are the means over K microbatches (min/max rewards too, as TRL
  averages them over its logging window)."""
  (loss, metrics), grads = train.accumulated_grads(microbatch_loss, spec, state, frozen, batch)
  return train.apply_update(state, *spec.optimizer(), loss, grads, metrics)


def step_config(cfg) -> train.StepConfig:
  """The reward step's static argument: model, optimizer, LoRA and the reward section."""
  r = cfg.reward
  return train.StepConfig(cfg.model, cfg.optim, r.rm_learning_rate, r.rm_steps, lora_config(cfg),
                          own=r)


def reward_model(c, params, trainable) -> dict:
  """The reward model's params: the transformer's (LoRA merged) and the head `score`."""
  lora = lora_config(c)
  body = lora_lib.merge(params, trainable["body"], lora) if lora.enabled else trainable["body"]
  return {**body, "score": trainable["score"]}


def held_out_metrics(c, mesh, params, arrays: dict) -> dict[str, float]:
  """The reward model `params` (transformer and `score`) over every pair of `arrays`: TRL's
  evaluation loss and metrics (accuracy, margin, min/mean/max reward) and the pair count."""
  replicated = NamedSharding(mesh, P())
  fn = jax.jit(lambda p, b: reward_lib.rewards(c.model, p, p["score"], b),
               out_shardings=replicated)
  rows = PairBatch(batches.Rows.of(arrays), margin=arrays.get("margin"))
  (r_B2,) = train.in_batches(mesh, lambda b: fn(params, b), rows, c.optim.global_batch_size)
  margin = arrays.get("margin")
  loss, metrics = bradley_terry(jnp.asarray(r_B2), None if margin is None else
                                jnp.asarray(margin), c.reward.center_rewards_coefficient)
  return {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}, "pairs": len(r_B2)}


def run(p, model: registry.Model) -> registry.Model:
  """The reward stage from `model` (the transformer the head is put on); saves the reward model
  to checkpoints/rm_model and hands on `model` unchanged (a reward model is not a policy)."""
  c, mesh = p.cfg, p.mesh  # configs.Config refuses --packing and --base_quant with an rm stage
  opt, _ = step_config(c).optimizer()
  key = jax.random.fold_in(jax.random.key(c.run.seed), 3)
  # An imported reward model (--init_from=hf:DIR of a *ForSequenceClassification) brings its head.
  base = {k: v for k, v in model.params.items() if k != "score"}
  trainable = lambda: initial_trainable(c.model, lora_config(c), base, key, mesh,
                                        model.params.get("score"))
  fresh = lambda: train.init_state(trainable(), opt, c.run.seed, mesh)
  frozen = train.Frozen(base) if c.lora.enabled else None
  start = Start(fresh, frozen, identity.model_digest(model.path),
                {"init_from": model.path, "lora": c.lora.enabled})
  stage_hooks = [hooks.LogMetrics(c.run.log_every),
                 hooks.SaveCheckpoints(c.checkpoint.checkpoint_every)]
  t_rm = time.perf_counter()
  pairs = p.data.pairs if p.data.rm_pairs is None else p.data.rm_pairs  # --rm_split
  state = p.stage(RM, start, _rows(c, pairs), stage_hooks).run()
  out = os.path.join(c.run.output_dir, "checkpoints", f"{RM.name}_model")
  made = reward_model(c, base, state.params)
  # What a judge built from this checkpoint must read text with (dpo/judges.py).
  reads = {"tokenizer": p.data.tok.fingerprint(),
           "chat_template": chat.template_fingerprint(p.data.template)}
  checkpoint.save_params(out, made, c.model, stage="rm", step=int(state.step), base=model.path,
                         reads=reads)
  p.summary["rm_model"] = os.path.abspath(out)
  if p.data.held is not None:  # TRL's eval_* metrics, on the held-out pairs
    with progress.doing(f"the reward model on {len(p.data.held['tokens'])} held-out pairs"):
      held = held_out_metrics(c, mesh, made, p.data.held)
    p.summary.update({f"rm_eval_{k}": v for k, v in held.items()})
    p.writer.write({"stage": "rm", "step": int(state.step),
                    **{f"eval_{k}": v for k, v in held.items()}})
    logging.info("rm: held-out accuracy %.3f, margin %+.4f, loss %.4f over %d pairs",
                 held["accuracy"], held["margin"], held["loss"], held["pairs"])
  if c.reward.export_rm_hf:
    with progress.doing(f"the reward model's export to {c.reward.export_rm_hf}"):
      _export_hf(c, made, p.data, model.path)
      if c.lora.enabled:
        _export_adapter(c, base, state.params, p.data.tok.pad_id)
  p.summary["rm_time_s"] = round(time.perf_counter() - t_rm, 1)
  logging.info("rm: reward model -> %s", out)
  return model


def _export_hf(c, params, data, started_from: str) -> None:
  """--export_rm_hf: the reward model as a transformers *ForSequenceClassification folder, with
  the tokenizer and the chat template the pairs were rendered with (a Hugging Face tokenizer;
  the byte tokenizer has no such form, which is logged). A folder this process may not write
  (its adapter/ and base/ too) stops the run before anything is written (`checkpoint.Unreadable`,
  one line naming it)."""
  from models import hf
  out, tok, template = c.reward.export_rm_hf, data.tok, data.template
  if jax.process_index() == 0:  # the process that writes it
    checkpoint.check_writable(out)
  hf.save_reward_model(out, c.model, params, tok.pad_id,
                       hf.SaveOptions(hf.source_config(started_from)))
  if isinstance(tok, tokenizer_lib.HFTokenizer):
    hf.save_tokenizer(out, tok, template.source if isinstance(template, chat.JinjaTemplate)
                      else template.jinja)
  else:
    logging.warning("--export_rm_hf: the byte tokenizer has no Hugging Face form; %s has no "
                    "tokenizer files (ids 0-255 are UTF-8 bytes, 256 PAD, 257 BOS, 258 EOS)", out)
  logging.info("rm: exported the reward model (LoRA merged) to %s", out)


def _export_adapter(c, base, trainable, pad_id: int) -> None:
  """With LoRA, --export_rm_hf/adapter: the PEFT adapter (the factors, the head as
  modules_to_save) over --export_rm_hf/base, the reward model without the LoRA delta."""
  from models import hf
  out = c.reward.export_rm_hf
  base_dir = os.path.abspath(os.path.join(out, "base"))
  hf.save_reward_model(base_dir, c.model, {**base, "score": trainable["score"]},
                       pad_id)
  hf.save_peft_reward(os.path.join(out, "adapter"), c.model, trainable["body"], lora_config(c),
                      trainable["score"], base_dir)
  logging.info("rm: exported the PEFT adapter (head as modules_to_save) to %s/adapter", out)


def _rows(c, pairs: dict) -> dict:
  """The pairs, with their shared-prefix rows beside them under --prefix_sharing when it
  applies (the forward then runs on those)."""
  if not c.model.prefix_sharing:
    return pairs
  shared, note = packing.shared_prefix(pairs)
  logging.info("%s", note)
  return pairs if shared is None else {**pairs, **shared}


RM = registry.register(registry.Algorithm(
    name="rm", step=rm_step, batch=batches.PairBatch.of, step_config=step_config, run=run,
    hyperparameters=lambda cfg: {k: v for k, v in identity.sections(
        cfg, ("lora", "optim", "reward")).items() if k != "learning_rate"},  # DPO's, not read
    data_files=("train_data", "tokenizer"), data_seed=3, steps_flag="--rm_steps",
    sections=(("reward", RewardConfig),), check=check_config, rows="rm_pairs", scores=True,
    router_losses=False,
    columns=(("loss", "loss", ".4f"), ("acc", "accuracy", ".3f"), ("margin", "margin", "+.4f"),
             ("reward", "mean_reward", "+.3f"), ("|g|", "grad_norm", ".3f"),
             ("lr", "learning_rate", ".2e")),
    curves=(("reward model accuracy", "accuracy", "rm"),)))

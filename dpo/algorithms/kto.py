"""KTO (`--stage=sft,kto`; Ethayarajh et al. 2024; TRL's `KTOTrainer`): the policy (LoRA on a
frozen base, or every weight) against a frozen reference on unpaired examples, each a prompt,
a completion and a label (desirable or not), with the objective of dpo/unpaired.py.

The stage trains on --train_data's unpaired records ({prompt, completion, label}) as they are,
or on preference pairs (--train_data's, or the embedded task's) converted as TRL's
`unpair_preference_dataset` converts them (`data.unpair_rows`, logged): each pair gives its
chosen completion as a desirable example and its rejected one as an undesirable example.

KTO's reference point z0 is estimated on mismatched pairs: at dispatch each microbatch's
prompts (of this process's rows) are joined to its completions rotated by one (TRL rotates each
per-device batch of its sequential sampler the same way: example i with example i - 1's
completion, the first with the last), built on the host from the batch's own rows
(`mismatched_rows`), so a resumed run builds what the uninterrupted one did. The step scores
them with the policy (no LoRA dropout) and the reference, both without gradient, as TRL does;
apo_zero_unpaired reads no z0 and scores none. LoRA dropout stays on in the policy's forward on
the examples, as in the DPO stage (TRL's `disable_dropout` defaults to on: --lora_dropout=0
matches it).

Everything else is the DPO stage's (`dpo.preference_stage`): the reference (the model the stage
starts from, --ref_init_from, TR-DPO's updates), --base_quant, the hooks (the KL guard watches
the log-ratio per token of the rewards the step logs), checkpoints and resume, the merged
policy in checkpoints/policy, --export_hf and the final evaluation against the reference.
Logged per step, TRL's names: rewards/chosen, rewards/rejected, rewards/margins, logps/chosen,
logps/rejected, kl (z0), and count/chosen, count/rejected.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import jax
import numpy as np

from dpo import batches, identity, logprobs, packing, registry, train
from dpo import data as data_lib
from dpo import unpaired
from dpo.algorithms import dpo
from models import transformer
from models.config import check


class KTOBatch(NamedTuple):
  """One step's unpaired examples: their rows [B, T] (prompt + completion, the loss mask on the
  completion), their labels [B] (True: desirable) and the mismatched rows [B, T'] that z0 is
  estimated on (None when the loss reads no z0)."""
  rows: batches.Rows
  desirable: np.ndarray
  mismatched: batches.Rows | None = None


def _lengths(rows: dict) -> tuple[np.ndarray, np.ndarray]:
  """(prompt length [N], completion length [N]) of right-padded prompt + completion rows."""
  scored = rows["loss_mask"] > 0
  tokens = (rows["segment_ids"] != 0).sum(1)
  completion = scored.sum(1)
  return np.where(scored.any(1), scored.argmax(1), tokens), completion


def mismatched_width(rows: dict) -> int:
  """The slots a mismatched row needs: the longest prompt plus the longest completion of the
  stage's rows, rounded up to 8 (one width for the stage: one compile)."""
  prompt, completion = _lengths(rows)
  return packing.round_up(int(prompt.max() + completion.max()), 8)


def mismatched_rows(rows: dict, shift: int, width: int, pad_id: int) -> dict:
  """[B, width] rows of each example's prompt with the completion of example (i - shift) mod B
  of the same batch rows (shift = the number of microbatches K: microbatch m holds rows m, m + K,
  ..., so each microbatch's completions rotate by one within it, as TRL's
  `add_kl_completion_ids` rotates each batch's)."""
  prompt, completion = _lengths(rows)
  tokens = rows["tokens"]
  source = (np.arange(len(tokens)) - shift) % len(tokens)
  joined = [(list(tokens[i, :prompt[i]]), list(tokens[j, prompt[j]:prompt[j] + completion[j]]))
            for i, j in enumerate(source)]
  return data_lib.pack_rows(joined, width, pad_id)


@dataclasses.dataclass
class Unpaired:
  """Program.stage's `online` for the kto stage: its host batches are unpaired rows, which
  become a `KTOBatch` with the mismatched rows beside them."""
  shift: int              # --gradient_accumulation_steps (`mismatched_rows`)
  width: int              # `mismatched_width` of the stage's rows
  pad_id: int
  reference_point: bool   # KTOConfig.reference_point: build the mismatched rows

  def batch(self, host: dict) -> KTOBatch:
    rows = {k: host[k] for k in batches.Rows._fields}
    mismatched = (batches.Rows.of(mismatched_rows(rows, self.shift, self.width, self.pad_id))
                  if self.reference_point else None)
    return KTOBatch(batches.Rows.of(rows), host["label"], mismatched)

  def __call__(self, spec, update):
    del spec  # the step's, which `update` jits
    return lambda state, frozen, host: update(state, frozen, self.batch(host))


def _reference(spec: train.StepConfig, frozen: train.Frozen):
  """(params, adapter) of the frozen reference, as `train.reference_stats` reads it."""
  params = frozen.params if frozen.ref_params is None else frozen.ref_params
  adapter = None if frozen.ref_lora is None else transformer.Adapter(frozen.ref_lora,
                                                                     spec.lora.scale)
  return params, adapter


def microbatch_loss(spec: train.StepConfig, frozen: train.Frozen, trainable, batch: KTOBatch,
                    dropout_key):
  """(loss, metrics) of one (micro)batch of unpaired examples: the policy's and the reference's
  summed completion log-probs, z0 from the mismatched rows (both models, no gradient), the
  objective of `spec.own`."""
  ref_params, ref_adapter = _reference(spec, frozen)
  policy_params, adapter, plain = trainable, None, None
  if spec.lora.enabled:
    policy_params = frozen.params
    adapter = transformer.Adapter.training(trainable, spec.lora, dropout_key)
    plain = transformer.Adapter(trainable, spec.lora.scale)  # no dropout: the z0 estimate
  seq = lambda params, rows, a: logprobs.sequence_logps(spec.model, params, rows, a)[0]
  stopped = lambda params, rows, a: jax.lax.stop_gradient(seq(params, rows, a))
  policy = logprobs.score(spec.model, policy_params, batch.rows, adapter)
  policy_B = policy.logps.sum(-1)
  reference_B = stopped(ref_params, batch.rows, ref_adapter)
  z0 = 0.0
  if batch.mismatched is not None:
    z0 = unpaired.reference_point(stopped(policy_params, batch.mismatched, plain),
                                  stopped(ref_params, batch.mismatched, ref_adapter))
  lp = unpaired.UnpairedLogps(policy_B, reference_B, batch.desirable)
  loss, metrics = unpaired.kto_loss(lp, z0, spec.own.beta, spec.own.config)
  return train.with_router_loss(spec.model, loss, metrics, policy.router)


def kto_step(spec: train.StepConfig, state: train.TrainState, frozen: train.Frozen,
             batch: KTOBatch) -> tuple[train.TrainState, dict]:
  """One KTO update; with gradient_accumulation_steps = K the loss, gradient and metrics are
  the means over K microbatches (z0 one per microbatch, as TRL's per forward), the counts the
  whole batch's."""
  k = spec.optim.gradient_accumulation_steps
  (loss, metrics), grads = train.accumulated_grads(microbatch_loss, spec, state, frozen, batch)
  metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
  metrics["count/chosen"], metrics["count/rejected"] = (
      metrics["count/chosen"] * k, metrics["count/rejected"] * k)
  return train.apply_update(state, *spec.optimizer(), loss, grads, metrics)


def step_config(cfg) -> train.StepConfig:
  """The DPO stage's static argument (model, optim, --learning_rate, --steps, lora) with the
  objective (the kto section, the loss section's beta) in place of the loss section."""
  return dataclasses.replace(train.StepConfig.dpo(cfg), loss=None, kl=False,
                             own=unpaired.Objective(cfg.kto, cfg.loss.beta))


def _weights_advice(c, desirable: np.ndarray) -> None:
  """TRL's warning when the desirable and undesirable weights are outside the range the KTO
  paper recommends for the data's balance (eq. 8: lambda_D n_D / (lambda_U n_U) in [1, 4/3])."""
  n_d = max(int(desirable.sum()), 1)
  n_u = max(len(desirable) - n_d, 1)
  k = c.kto
  if n_d == n_u:
    return
  d_lo, d_hi = (round(n_u * k.undesirable_weight / n_d * f, 2) for f in (1, 1.33))
  u_lo, u_hi = (round(n_d * k.desirable_weight / n_u / f, 2) for f in (1.33, 1))
  if not (d_lo <= k.desirable_weight <= d_hi or u_lo <= k.undesirable_weight <= u_hi):
    logging.warning("kto: %d desirable and %d undesirable examples; the KTO paper recommends "
                    "EITHER --desirable_weight in [%g, %g] OR --undesirable_weight in [%g, %g] "
                    "(not both; TRL's advice)", n_d, n_u, d_lo, d_hi, u_lo, u_hi)


def training_rows(p, judge, base):
  """dpo.preference_stage's `online` for KTO: (the stage's unpaired rows, `Unpaired`): the
  unpaired --train_data as read, or the preference pairs converted (logged)."""
  del judge, base
  c, data = p.cfg, p.data
  if data.unpaired is not None:
    table = data.unpaired
  else:
    table = data_lib.unpair_rows(data.pairs)
    logging.info("kto: %d preference pairs of %s -> %d unpaired examples (each pair's chosen "
                 "completion desirable, its rejected one undesirable; TRL's "
                 "unpair_preference_dataset)", len(data.pairs["tokens"]),
                 c.data.train_data or "the embedded task", len(table["tokens"]))
  _weights_advice(c, table["label"])
  k, nproc = c.optim.gradient_accumulation_steps, jax.process_count()
  if c.kto.reference_point and c.optim.global_batch_size // (k * nproc) < 2:
    raise ValueError(f"--kto_loss_type=kto: a microbatch of "
                     f"{c.optim.global_batch_size // (k * nproc)} example per process has no "
                     f"other completion to estimate z0 with; raise --global_batch_size or lower "
                     f"--gradient_accumulation_steps (TRL needs per_device_train_batch_size > 1)")
  return table, Unpaired(k, mismatched_width(table), data.tok.pad_id, c.kto.reference_point)


def run(p, model: registry.Model) -> registry.Model:
  """The KTO stage: the DPO stage's reference, hooks, export and evaluation on unpaired rows."""
  return dpo.preference_stage(p, model, KTO, training_rows, "logratio")


def check_config(cfg) -> None:
  """A kto stage computes the reference in its step, one example a row."""
  here = KTO.name in cfg.run.stages
  check(not here or not cfg.reference.precompute_ref,
        f"--precompute_ref=True: the kto stage computes the reference in its step; not with "
        f"--stage={cfg.run.stage}")
  check(not here or not cfg.model.packing,
        f"--packing=True: the kto stage reads one example a row; not with "
        f"--stage={cfg.run.stage}")


KTO = registry.register(registry.Algorithm(
    name="kto", step=kto_step, batch=lambda host: host, step_config=step_config, run=run,
    hyperparameters=lambda cfg: {**identity.sections(cfg, ("lora", "optim", "reference", "guard",
                                                          "kto")), "beta": cfg.loss.beta},
    data_files=("train_data", "tokenizer"), data_seed=6, steps_flag="--steps",
    unpaired=True, sections=(("kto", unpaired.KTOConfig),), check=check_config, judged=True))

"""Supervised fine-tuning: every weight trains on the NLL of the completions (the article's
first stage; the DPO stage starts from and is anchored to its model). With --sft_packing=N the
stage trains on rows of N slots that each hold several whole examples (dpo/packing.py
`pack_sequences`), packed once, before the loader shuffles the rows."""

from __future__ import annotations

import glob
import logging
import os

import jax

from dpo import batches, checkpoint, data, hooks, identity, packing, registry, train
from dpo.program import Start
from models.config import check

# What the SFT stage's result depends on besides the model, seed and data (dpo/identity.py).
_OPTIM = ("sft_learning_rate", "global_batch_size", "warmup_ratio", "weight_decay", "adam_b1",
          "adam_b2", "max_grad_norm", "sft_packing")


def rows(cfg, examples: dict) -> dict:
  """The rows the stage trains on: `examples` ([N, T], data.sft), packed with --sft_packing."""
  if not cfg.optim.sft_packing:
    return examples
  packed, summary = packing.pack_sequences(examples, cfg.optim.sft_packing)
  logging.info("%s", summary)
  batch = cfg.optim.global_batch_size
  if len(packed["tokens"]) < batch:
    raise data.DataError(f"--sft_packing={cfg.optim.sft_packing}: {len(packed['tokens'])} packed "
                         f"SFT rows, fewer than one batch of --global_batch_size={batch}")
  return packed


def run(p, model: registry.Model) -> registry.Model:
  """The SFT stage from `model`; hands on the SFT model, saved to checkpoints/sft_model (reused
  as it is when a rerun finds it complete and of the same run)."""
  c = p.cfg
  sft_out = os.path.join(c.run.output_dir, "checkpoints", "sft_model")
  initial = identity.model_digest(model.path)
  arrays = rows(c, p.data.sft)
  want = {"fingerprint": p.fingerprint(SFT, arrays, initial)}
  # Step checkpoints of any other stage were trained from the SFT model (this recipe's or an
  # earlier one's in the same folder): it is not extended under them.
  others = [os.path.join(os.path.dirname(sft_out), a.name) for a in registry.ALGORITHMS.values()
            if a is not SFT]
  downstream = next((d for d in others if glob.glob(os.path.join(d, "step_*"))), "")
  if identity.reusable(sft_out, want, c.optim.sft_steps, "--sft_steps", downstream=downstream):
    logging.info("sft: %s exists; stage done", sft_out)
    return registry.Model(checkpoint.load_params(sft_out, c.model, p.mesh),
                            os.path.abspath(sft_out))
  opt, _ = SFT.step_config(c).optimizer()
  fresh = lambda: train.init_state(jax.tree.map(lambda x: x.copy(), model.params), opt,
                                   c.run.seed, p.mesh)
  stage_hooks = [hooks.LogMetrics(c.run.log_every),
                 hooks.SaveCheckpoints(c.checkpoint.checkpoint_every)]
  start = Start(fresh, None, initial, {"init_from": c.checkpoint.init_from, "lora": False})
  stage = p.stage(SFT, start, arrays, stage_hooks)
  state = stage.run()
  # The stage's fingerprint, as its checkpoints carry it: with --autotune, the tuned settings.
  checkpoint.save_params(sft_out, state.params, c.model, stage="sft", step=int(state.step),
                         metrics_records=p.writer.count, **stage.ckpts.identity)
  logging.info("sft: model -> %s", sft_out)
  return registry.Model(state.params, os.path.abspath(sft_out))


def check_config(cfg) -> None:
  """The SFT flags of the optim section ask for an sft stage."""
  here = SFT.name in cfg.run.stages
  check(not here or cfg.optim.sft_steps >= 1,
        f"--sft_steps={cfg.optim.sft_steps}: must be >= 1 with --stage={cfg.run.stage} "
        f"(--stage=dpo skips SFT)")
  check(not cfg.optim.sft_packing or here,
        f"--sft_packing={cfg.optim.sft_packing}: packs the sft stage's rows; --stage="
        f"{cfg.run.stage} has none")


SFT = registry.register(registry.Algorithm(
    name="sft", step=train.sft_step, batch=batches.Rows.of,
    step_config=train.StepConfig.sft, run=run,
    hyperparameters=lambda cfg: {k: getattr(cfg.optim, k) for k in _OPTIM},
    data_files=("sft_data", "train_data", "tokenizer"), data_seed=1,
    steps_flag="--sft_steps", unpaired=True,  # unpaired data: its desirable completions
    check=check_config, rows="demonstrations", trains_base=True,
    curves=(("SFT loss (NLL per token)", "loss", "sft"), ("gradient norm", "grad_norm", "sft"),
            ("learning rate", "learning_rate", "sft"))))

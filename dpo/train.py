"""Train state, optimizer, and the pure DPO and SFT steps, jitted with explicit shardings.

`frozen` is the part of the model that never trains and is never donated:
  * LoRA on:  the base weights. Policy = base + LoRA delta; reference = the same base with the
    delta switched off. There is no second copy of the base.
  * LoRA off: the reference copy. Policy = state.params (all weights train); reference = frozen.
  `Frozen.ref_lora` holds a frozen LoRA copy for TR-DPO with LoRA: the reference is then
  base + ref_lora (dpo/reference.py updates it every k steps).
SFT trains all weights and has no frozen part. The trainable and frozen trees are built here
(`initial_trainable`, `initial_frozen`, `trainable_specs`) and nowhere else.

Guards that need no Python live inside the step: a non-finite loss or gradient leaves params and
optimizer state unchanged and bumps `state.skipped`. `state.lr_scale` multiplies the schedule so
the runner can cut the learning rate (e.g. after a rollback) without recompiling. A step's static
argument is a `StepConfig`: only the config sections its computation reads.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dpo import logprobs, losses
from models import lora as lora_lib
from models import sharding, transformer


class TrainState(NamedTuple):
  step: jax.Array       # int32 scalar: optimizer steps taken (including skipped ones)
  params: Any           # trainable pytree: LoRA factors, or all weights
  opt_state: Any
  rng: jax.Array        # base key; step keys are fold_in(rng, step)
  lr_scale: jax.Array   # float32 scalar multiplying the schedule
  skipped: jax.Array    # int32 scalar: updates skipped for non-finite loss or gradient


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Everything a jitted step's computation reads, and nothing else: the static argument of
  `jit_step`, so an output path, a cadence or an evaluation setting never recompiles a step."""
  model: Any                # ModelConfig
  optim: Any                # OptimConfig (clipping, AdamW, warmup)
  peak_lr: float
  total_steps: int          # length of the warmup + cosine schedule
  lora: Any = None          # DPO: LoraConfig (rank 0 = full fine-tuning); SFT: None
  loss: Any = None          # DPO: LossConfig; SFT: None
  kl: bool = False          # DPO: also compute the token KL(pi || ref) metric

  @classmethod
  def sft(cls, cfg) -> "StepConfig":
    return cls(cfg.model, cfg.optim, cfg.optim.sft_learning_rate, cfg.optim.sft_steps)

  @classmethod
  def dpo(cls, cfg) -> "StepConfig":
    return cls(cfg.model, cfg.optim, cfg.optim.learning_rate, cfg.optim.steps, cfg.lora, cfg.loss,
               cfg.step_kl)

  def optimizer(self) -> tuple[optax.GradientTransformation, optax.Schedule]:
    return optimizer(self.optim, self.peak_lr, self.total_steps)


def schedule(peak_lr: float, total_steps: int, warmup_ratio: float) -> optax.Schedule:
  """Linear warmup over warmup_ratio * steps, then cosine decay to 0."""
  total = max(total_steps, 1)
  warmup = int(round(warmup_ratio * total))
  return optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, max(total, warmup + 1), 0.0)


def optimizer(o, peak_lr: float, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW on the warmup + cosine schedule, after global-norm clipping; `o` is an OptimConfig."""
  sched = schedule(peak_lr, total_steps, o.warmup_ratio)
  parts = [optax.clip_by_global_norm(o.max_grad_norm)] if o.max_grad_norm > 0 else []
  parts.append(optax.adamw(sched, b1=o.adam_b1, b2=o.adam_b2, weight_decay=o.weight_decay))
  return optax.chain(*parts), sched


def opt_state_shardings(opt: optax.GradientTransformation, params, param_shardings, mesh: Mesh):
  """Shardings for `opt.init(params)`: every params-shaped part (Adam moments) takes the
  matching parameter's sharding; everything else (step counts) is replicated.

  Needed because jit does not propagate input shardings to freshly created zeros: a bare
  `jit(opt.init)` puts the moments on one device.
  """
  abstract_state = jax.eval_shape(opt.init, params)
  replicated = NamedSharding(mesh, P())
  return optax.tree_map_params(opt, lambda _, sh: sh, abstract_state, param_shardings,
                               transform_non_params=lambda _: replicated)


def init_state(params, opt: optax.GradientTransformation, seed: int, mesh: Mesh) -> TrainState:
  """Optimizer moments take their parameter's sharding; scalars (counts) are replicated.

  Scalars are placed from host numpy values so that every process of a multi-host run provides
  its (identical) copy.
  """
  param_sh = jax.tree.map(lambda x: x.sharding, params)
  opt_state = jax.jit(opt.init, out_shardings=opt_state_shardings(opt, params, param_sh, mesh))(
      params)
  rep = lambda x: jax.device_put(x, NamedSharding(mesh, P()))
  return TrainState(step=rep(np.zeros((), np.int32)), params=params, opt_state=opt_state,
                    rng=rep(np.asarray(jax.random.key_data(jax.random.key(seed)))),
                    lr_scale=rep(np.ones((), np.float32)), skipped=rep(np.zeros((), np.int32)))


def _apply(state: TrainState, opt, sched, loss, grads, metrics) -> tuple[TrainState, dict]:
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt = opt.update(grads, state.opt_state, state.params)
  new_params = jax.tree.map(lambda p, u: p + state.lr_scale * u, state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = state._replace(
      step=state.step + 1, params=keep(new_params, state.params),
      opt_state=keep(new_opt, state.opt_state),
      skipped=state.skipped + (~finite).astype(jnp.int32))
  metrics = {**metrics, "loss": loss, "grad_norm": grad_norm,
             "learning_rate": sched(state.step) * state.lr_scale,
             "skipped_steps": new_state.skipped}
  return new_state, metrics


def _step_key(state: TrainState) -> jax.Array:
  return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)


class Frozen(NamedTuple):
  """What the DPO step reads but never trains (see the module docstring)."""
  params: Any           # base weights (LoRA on) or the reference copy (LoRA off)
  ref_lora: Any = None  # TR-DPO with LoRA: a frozen LoRA copy; reference = params + ref_lora


# --- the DPO stage's trees: built here and nowhere else ---------------------------------------------

def trainable_specs(model, lora) -> dict:
  """ParamSpecs of what DPO trains: the LoRA factors, or (rank 0) every weight."""
  return lora_lib.lora_specs(model, lora) if lora.enabled else transformer.param_specs(model)


def initial_trainable(model, lora, base, key: jax.Array, mesh: Mesh):
  """Fresh LoRA factors (B = 0, so the policy starts equal to the base), or a copy of the base."""
  if lora.enabled:
    return lora_lib.init(model, lora, key, mesh)
  return jax.tree.map(lambda x: x.copy(), base)


def initial_frozen(base, trainable=None) -> Frozen:
  """The frozen part; `trainable` (TR-DPO with LoRA) rides along as the reference adapter."""
  return Frozen(base, None if trainable is None else jax.tree.map(lambda x: x.copy(), trainable))


# --- steps ---------------------------------------------------------------------------------------

def reference_stats(spec: StepConfig, frozen: Frozen, batch, with_logits: bool = False):
  """Reference statistics of a pair batch (no dropout, no gradient)."""
  out = logprobs.pair_stats(spec.model, frozen.params, batch, lora=frozen.ref_lora,
                            lora_scale=spec.lora.scale, with_logits=with_logits)
  return jax.lax.stop_gradient(out)


def dpo_step(spec: StepConfig, state: TrainState, frozen: Frozen, batch) -> tuple[TrainState, dict]:
  """One preference update with the configured loss combination (spec.loss).

  batch: tokens/positions/segment_ids/loss_mask, each [B, 2, T]; optionally ref_logps and
  ref_shared_logps [B, 2] precomputed by dpo/reference.py, in which case no reference forward
  runs. Reference-free losses run no reference forward either. The token KL metric (spec.kl)
  needs the reference logits ([B, 2, T, V], or [B, K, V] at the scored slots of shared-prefix
  rows); without it they are never kept.
  """
  lora_on, lc = spec.lora.enabled, spec.loss
  if lc.reference_free:
    ref = None
  elif "ref_logps" in batch:
    ref = logprobs.PairStats(batch["ref_logps"], None, batch["ref_shared_logps"], None, None)
  else:
    ref = reference_stats(spec, frozen, batch, with_logits=spec.kl)

  def ld(total, shared):
    return total if lc.ld_alpha == 1.0 else losses.length_desensitised(total, shared, lc.ld_alpha)

  def loss_fn(trainable):
    policy_params, lora = (frozen.params, trainable) if lora_on else (trainable, None)
    pol = logprobs.pair_stats(
        spec.model, policy_params, batch, lora=lora, lora_scale=spec.lora.scale,
        dropout_key=_step_key(state) if lora_on else None, dropout_rate=spec.lora.lora_dropout,
        wpo=lc.wpo, with_logits=ref is not None and ref.logits is not None)
    pol_lp = ld(pol.logps, pol.shared_logps)
    ref_lp = jnp.zeros_like(pol_lp) if ref is None else ld(ref.logps, ref.shared_logps)
    lp = losses.Logps(pol_lp[:, 0], pol_lp[:, 1], ref_lp[:, 0], ref_lp[:, 1],
                      pol.tokens[:, 0], pol.tokens[:, 1], policy_chosen_full=pol.logps[:, 0])
    loss, extra = losses.combined(lp, lc, pol.wpo_logw)
    metrics = {**losses.pair_statistics(lp, lc.beta), **extra}
    if pol.logits is not None:
      # The KL-spike guard's measure: exact token KL(pi || pi_ref), mean per completion token.
      kl = logprobs.pair_kl(jax.lax.stop_gradient(pol.logits), ref.logits, batch)
      metrics["kl"] = kl.sum() / jnp.maximum(pol.tokens.sum(), 1.0)
    return loss, metrics

  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return _apply(state, *spec.optimizer(), loss, grads, metrics)


def sft_loss(model, params, batch) -> tuple[jax.Array, jax.Array]:
  """(mean NLL per completion token, scored-token count). batch arrays are [B, T]."""
  lp, n = logprobs.sequence_logps(model, params, batch)
  total = jnp.maximum(n.sum(), 1.0)
  return -lp.sum() / total, n.sum()


def sft_step(spec: StepConfig, state: TrainState, frozen, batch) -> tuple[TrainState, dict]:
  """One SFT update (all weights). `frozen` is unused; the signature matches `dpo_step`."""
  del frozen
  (loss, tokens), grads = jax.value_and_grad(functools.partial(sft_loss, spec.model),
                                             has_aux=True)(state.params, batch)
  return _apply(state, *spec.optimizer(), loss, grads, {"tokens": tokens})


# --- jit -----------------------------------------------------------------------------------------

def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Dim 0 of every batch array (tokens [B, 2, T], ref_logps [B, 2], ...) over the batch mesh
  axes; a prefix spec, so the remaining axes are replicated whatever the array's rank."""
  return NamedSharding(mesh, P(sharding.RULES["batch"]))


def jit_step(step_fn: Callable, spec: StepConfig, mesh: Mesh, state: TrainState, frozen):
  """jit(step) with explicit in/out shardings taken from the live state, state donated."""
  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  return jit_step_with_shardings(step_fn, spec, mesh, shardings(state), shardings(frozen))


def jit_step_with_shardings(step_fn: Callable, spec: StepConfig, mesh: Mesh, state_sh, frozen_sh):
  """As `jit_step`, from sharding pytrees (so abstract shapes can be lowered without arrays).

  One jitted function per (step, spec, mesh, shardings): a second stage or run with the same
  computation reuses the compiled step.
  """
  flat = lambda tree: (jax.tree.structure(tree), tuple(jax.tree.leaves(tree)))
  return _jitted(step_fn, spec, mesh, *flat(state_sh), *flat(frozen_sh))


@functools.lru_cache(maxsize=32)
def _jitted(step_fn, spec, mesh, state_def, state_sh, frozen_def, frozen_sh):
  state_sh, frozen_sh = state_def.unflatten(state_sh), frozen_def.unflatten(frozen_sh)
  return jax.jit(with_mesh(mesh, functools.partial(step_fn, spec)),
                 in_shardings=(state_sh, frozen_sh, batch_sharding(mesh)),
                 out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=(0,))


def with_mesh(mesh: Mesh, fn: Callable) -> Callable:
  """`fn` traced with `mesh` as the abstract mesh, so `sharding.constrain` takes effect."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)
  return wrapped


def device_batch(mesh: Mesh, local: dict, global_batch: int | None = None) -> dict:
  """Global arrays from this process's rows of the batch.

  `local` holds the rows this process's devices own (see `sharding.process_batch_block`);
  `global_batch` is the number of rows over all processes. When `global_batch` equals the local
  row count, every process passes the same full batch (as evaluation does).
  """
  def one(v):
    shape = None if global_batch is None else (global_batch, *v.shape[1:])
    return jax.make_array_from_process_local_data(batch_sharding(mesh), v, shape)
  return {k: one(v) for k, v in local.items()}


def memory_estimate(spec: StepConfig, mesh: Mesh) -> dict[str, int]:
  """Per-device bytes of the DPO stage's persistent arrays, from abstract shapes and shardings.

  frozen: base weights (LoRA on) or the reference copy (LoRA off); trainable: LoRA factors or the
  policy weights; optimizer: the optimizer state of the trainable part. Activations are not
  counted here; `dpo.tools.compile_check` reports the compiler's full figure.
  """
  base = transformer.param_specs(spec.model)
  tspecs = trainable_specs(spec.model, spec.lora)
  train_abs, train_sh = transformer.abstract(tspecs), transformer.shardings(tspecs, mesh)
  opt, _ = spec.optimizer()
  opt_abs = jax.eval_shape(opt.init, train_abs)
  opt_sh = opt_state_shardings(opt, train_abs, train_sh, mesh)
  out = {"frozen": sharding.shard_bytes(transformer.abstract(base), transformer.shardings(base, mesh)),
         "trainable": sharding.shard_bytes(train_abs, train_sh),
         "optimizer": sharding.shard_bytes(opt_abs, opt_sh)}
  out["total"] = sum(out.values())
  return out

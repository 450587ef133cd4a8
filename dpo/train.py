"""Train state, optimizer, and the pure DPO and SFT steps, jitted with explicit shardings.

`frozen` is the part of the model that never trains and is never donated:
  * LoRA on:  the base weights. Policy = base + LoRA delta; reference = the same base with the
    delta switched off. There is no second copy of the base.
  * LoRA off: the reference copy. Policy = state.params (all weights train); reference = frozen.
SFT trains all weights and has no frozen part.

Guards that need no Python live inside the step: a non-finite loss or gradient leaves params and
optimizer state unchanged and bumps `state.skipped`. `state.lr_scale` multiplies the schedule so
the loop can cut the learning rate (e.g. after a rollback) without recompiling.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from configs import Config
from dpo import logprobs, losses
from models import sharding


class TrainState(NamedTuple):
  step: jax.Array       # int32 scalar: optimizer steps taken (including skipped ones)
  params: Any           # trainable pytree: LoRA factors, or all weights
  opt_state: Any
  rng: jax.Array        # base key; step keys are fold_in(rng, step)
  lr_scale: jax.Array   # float32 scalar multiplying the schedule
  skipped: jax.Array    # int32 scalar: updates skipped for non-finite loss or gradient


def schedule(peak_lr: float, total_steps: int, warmup_ratio: float) -> optax.Schedule:
  """Linear warmup over warmup_ratio * steps, then cosine decay to 0."""
  total = max(total_steps, 1)
  warmup = int(round(warmup_ratio * total))
  return optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, max(total, warmup + 1), 0.0)


def optimizer(cfg: Config, peak_lr: float, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  t = cfg.train
  sched = schedule(peak_lr, total_steps, t.warmup_ratio)
  parts = [optax.clip_by_global_norm(t.max_grad_norm)] if t.max_grad_norm > 0 else []
  parts.append(optax.adamw(sched, b1=t.adam_b1, b2=t.adam_b2, weight_decay=t.weight_decay))
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


def dpo_step(cfg: Config, opt, sched, state: TrainState, frozen, batch) -> tuple[TrainState, dict]:
  """One DPO update. batch: tokens/positions/segment_ids/loss_mask, each [B, 2, T]."""
  lora_on = cfg.lora.enabled
  key = _step_key(state)

  def loss_fn(trainable):
    policy_params, lora = (frozen, trainable) if lora_on else (trainable, None)
    pol, counts = logprobs.pair_logps(
        cfg.model, policy_params, batch, lora=lora,
        lora_scale=cfg.lora.scale if lora_on else 1.0,
        dropout_key=key if lora_on else None, dropout_rate=cfg.lora.lora_dropout)
    ref, _ = logprobs.pair_logps(cfg.model, frozen, batch)
    ref = jax.lax.stop_gradient(ref)
    lp = losses.Logps(pol[:, 0], pol[:, 1], ref[:, 0], ref[:, 1], counts[:, 0], counts[:, 1])
    per_pair, extra = losses.LOSSES["sigmoid"](lp, beta=cfg.train.beta,
                                               label_smoothing=cfg.train.label_smoothing)
    return per_pair.mean(), {**losses.reward_metrics(lp, cfg.train.beta), **extra}

  (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return _apply(state, opt, sched, loss, grads, metrics)


def sft_loss(cfg: Config, params, batch) -> tuple[jax.Array, jax.Array]:
  """(mean NLL per completion token, scored-token count). batch arrays are [B, T]."""
  lp, n = logprobs.sequence_logps(cfg.model, params, batch["tokens"], batch["positions"],
                                  batch["segment_ids"], batch["loss_mask"])
  total = jnp.maximum(n.sum(), 1.0)
  return -lp.sum() / total, n.sum()


def sft_step(cfg: Config, opt, sched, state: TrainState, frozen, batch) -> tuple[TrainState, dict]:
  """One SFT update (all weights). `frozen` is unused; the signature matches `dpo_step`."""
  del frozen
  (loss, tokens), grads = jax.value_and_grad(functools.partial(sft_loss, cfg), has_aux=True)(
      state.params, batch)
  return _apply(state, opt, sched, loss, grads, {"tokens": tokens})


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Batch rows over (data, fsdp); all other axes replicated."""
  return NamedSharding(mesh, P(sharding.RULES["batch"], *([None] * (ndim - 1))))


def jit_step(step_fn: Callable, cfg: Config, opt, sched, mesh: Mesh, state: TrainState, frozen,
             batch_ndim: int):
  """jit(step) with explicit in/out shardings taken from the live state, state donated."""
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  frozen_sh = jax.tree.map(lambda x: x.sharding, frozen)
  return jit_step_with_shardings(step_fn, cfg, opt, sched, mesh, state_sh, frozen_sh, batch_ndim)


def jit_step_with_shardings(step_fn: Callable, cfg: Config, opt, sched, mesh: Mesh, state_sh,
                            frozen_sh, batch_ndim: int):
  """As `jit_step`, from sharding pytrees (so abstract shapes can be lowered without arrays)."""
  batch_sh = batch_sharding(mesh, batch_ndim)
  replicated = NamedSharding(mesh, P())
  return jax.jit(with_mesh(mesh, functools.partial(step_fn, cfg, opt, sched)),
                 in_shardings=(state_sh, frozen_sh, batch_sh),
                 out_shardings=(state_sh, replicated), donate_argnums=(0,))


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
    return jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim), v, shape)
  return {k: one(v) for k, v in local.items()}


def memory_estimate(cfg: Config, mesh: Mesh, opt: optax.GradientTransformation) -> dict[str, int]:
  """Per-device bytes of the DPO stage's persistent arrays, from abstract shapes and shardings.

  frozen: base weights (LoRA on) or the reference copy (LoRA off); trainable: LoRA factors or the
  policy weights; optimizer: the optimizer state of the trainable part. Activations are not
  counted here; `dpo.compile_check` reports the compiler's full figure.
  """
  from models import lora as lora_lib, transformer  # local: train stays importable standalone
  specs = transformer.param_specs(cfg.model)
  base_abs, base_sh = transformer.abstract(specs), transformer.shardings(specs, mesh)
  if cfg.lora.enabled:
    lspecs = lora_lib.lora_specs(cfg.model, cfg.lora)
    train_abs, train_sh = transformer.abstract(lspecs), transformer.shardings(lspecs, mesh)
  else:
    train_abs, train_sh = base_abs, base_sh
  opt_abs = jax.eval_shape(opt.init, train_abs)
  opt_sh = opt_state_shardings(opt, train_abs, train_sh, mesh)
  out = {"frozen": sharding.shard_bytes(base_abs, base_sh),
         "trainable": sharding.shard_bytes(train_abs, train_sh),
         "optimizer": sharding.shard_bytes(opt_abs, opt_sh)}
  out["total"] = sum(out.values())
  return out

"""Train state, optimizer, and the pure DPO and SFT steps, jitted with explicit shardings.

`frozen` is the part of the model that never trains and is never donated:
  * LoRA on:  the base weights. Policy = base + LoRA delta; reference = the same base with the
    delta switched off. There is no second copy of the base.
  * LoRA off: the reference copy. Policy = state.params (all weights train); reference = frozen.
  A `Frozen(params, ref_lora)` adds a frozen LoRA copy for TR-DPO with LoRA: the reference is then
  base + ref_lora (dpo/reference.py updates it every k steps; a plain pytree means ref_lora=None).
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


class Frozen(NamedTuple):
  """What the DPO step reads but never trains (see the module docstring)."""
  params: Any           # base weights (LoRA on) or the reference copy (LoRA off)
  ref_lora: Any = None  # TR-DPO with LoRA: a frozen LoRA copy; reference = params + ref_lora


def _split_frozen(frozen) -> tuple[Any, Any]:
  return (frozen.params, frozen.ref_lora) if isinstance(frozen, Frozen) else (frozen, None)


def reference_stats(cfg: Config, frozen, batch, with_logits: bool = False):
  """Reference statistics of a pair batch (no dropout, no gradient); with_logits also returns
  the reference logits [B, 2, T, V] (else None)."""
  base, ref_lora = _split_frozen(frozen)
  out = logprobs.pair_stats(cfg.model, base, batch, lora=ref_lora,
                            lora_scale=cfg.lora.scale if ref_lora is not None else 1.0,
                            with_logits=with_logits)
  return jax.lax.stop_gradient(out)


def dpo_step(cfg: Config, opt, sched, state: TrainState, frozen, batch) -> tuple[TrainState, dict]:
  """One preference update with the configured loss combination (cfg.loss).

  batch: tokens/positions/segment_ids/loss_mask, each [B, 2, T]; optionally ref_logps and
  ref_shared_logps [B, 2] precomputed by dpo/reference.py, in which case no reference forward
  runs. Reference-free losses run no reference forward either.
  """
  lora_on = cfg.lora.enabled
  lc = cfg.loss
  key = _step_key(state)
  base, _ = _split_frozen(frozen)
  ref_logits = None
  if lc.reference_free:
    ref = None
  elif "ref_logps" in batch:
    ref = (batch["ref_logps"], batch["ref_shared_logps"])
  else:
    stats, ref_logits = reference_stats(cfg, frozen, batch, with_logits=True)
    ref = (stats.logps, stats.shared_logps)

  def ld(total, shared):
    return total if lc.ld_alpha == 1.0 else losses.length_desensitised(total, shared, lc.ld_alpha)

  def loss_fn(trainable):
    policy_params, lora = (base, trainable) if lora_on else (trainable, None)
    pol, pol_logits = logprobs.pair_stats(
        cfg.model, policy_params, batch, lora=lora,
        lora_scale=cfg.lora.scale if lora_on else 1.0,
        dropout_key=key if lora_on else None, dropout_rate=cfg.lora.lora_dropout, wpo=lc.wpo,
        with_logits=True)  # unused logits are dead code under jit
    pol_lp = ld(pol.logps, pol.shared_logps)
    ref_lp = jnp.zeros_like(pol_lp) if ref is None else ld(*ref)
    lp = losses.Logps(pol_lp[:, 0], pol_lp[:, 1], ref_lp[:, 0], ref_lp[:, 1],
                      pol.tokens[:, 0], pol.tokens[:, 1])
    loss, extra = losses.combined(lp, lc.loss_type, lc.weights, losses.hyperparameters(cfg),
                                  lc.rpo_alpha, pol.wpo_logw)
    metrics = {**losses.reward_metrics(lp, cfg.train.beta), **extra}
    if ref_logits is not None:
      # The KL-spike guard's measure: exact token KL(pi || pi_ref), mean per completion token.
      # Only available when the reference runs in the step (not precomputed, not ref-free).
      kl = logprobs.token_kl(jax.lax.stop_gradient(pol_logits), ref_logits, batch["loss_mask"])
      metrics["kl"] = kl.sum() / jnp.maximum(pol.tokens.sum(), 1.0)
    return loss, metrics

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


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Dim 0 of every batch array (tokens [B, 2, T], ref_logps [B, 2], ...) over (data, fsdp); a
  prefix spec, so the remaining axes are replicated whatever the array's rank."""
  return NamedSharding(mesh, P(sharding.RULES["batch"]))


def jit_step(step_fn: Callable, cfg: Config, opt, sched, mesh: Mesh, state: TrainState, frozen):
  """jit(step) with explicit in/out shardings taken from the live state, state donated."""
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  frozen_sh = jax.tree.map(lambda x: x.sharding, frozen)
  return jit_step_with_shardings(step_fn, cfg, opt, sched, mesh, state_sh, frozen_sh)


def jit_step_with_shardings(step_fn: Callable, cfg: Config, opt, sched, mesh: Mesh, state_sh,
                            frozen_sh):
  """As `jit_step`, from sharding pytrees (so abstract shapes can be lowered without arrays)."""
  batch_sh = batch_sharding(mesh)
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
    return jax.make_array_from_process_local_data(batch_sharding(mesh), v, shape)
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

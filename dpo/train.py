"""Train state, optimizer, and the pure DPO and SFT steps, jitted with explicit shardings.

`frozen` is the part of the model that never trains and is never donated:
  * LoRA on:  the base weights. Policy = base + LoRA delta; reference = the same base with the
    delta switched off. There is no second copy of the base.
  * LoRA off: the reference copy. Policy = state.params (all weights train); reference = frozen.
  With `--ref_init_from` the reference is that model: `Frozen.ref_params` beside the base (LoRA
  on), or `Frozen.params` itself (LoRA off).
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

import chex
import einops
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dpo import logprobs, losses
from dpo.batches import PairBatch, Rows
from models import lora as lora_lib
from models import moe, sharding, transformer


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
  score_slots: int = 0      # DPO: most tokens a pair row scores (LM head only there); 0 = all
  own: Any = None           # what the algorithm's own step reads of its own sections (rm: its
                            # RewardConfig, grpo: GRPOConfig, kto: unpaired.Objective, ...)
  temperature: float = 1.0  # GRPO, RLOO: the log-probs' temperature, the sampler's (TRL's)

  @classmethod
  def sft(cls, cfg) -> "StepConfig":
    return cls(cfg.model, cfg.optim, cfg.optim.sft_learning_rate, cfg.optim.sft_steps)

  @classmethod
  def dpo(cls, cfg) -> "StepConfig":
    return cls(cfg.model, cfg.optim, cfg.optim.learning_rate, cfg.optim.steps, cfg.lora, cfg.loss,
               cfg.step_kl, score_slots=cfg.data.max_target_length)

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


class PerPart(NamedTuple):
  """An optax transformation per top-level key of a dict of trainable parts (the policy and what
  a stage trains beside it, registry.Algorithm.beside), each with its own state: its own
  clipping, moments and schedule."""
  parts: dict

  def init(self, params):
    return {k: t.init(params[k]) for k, t in self.parts.items()}

  def update(self, updates, state, params=None):
    out = {k: t.update(updates[k], state[k], None if params is None else params[k])
           for k, t in self.parts.items()}
    return {k: u for k, (u, _) in out.items()}, {k: st for k, (_, st) in out.items()}


def opt_state_shardings(opt: optax.GradientTransformation, params, param_shardings, mesh: Mesh):
  """Shardings for `opt.init(params)`: every params-shaped part (Adam moments) takes the
  matching parameter's sharding; everything else (step counts) is replicated.

  Needed because jit does not propagate input shardings to freshly created zeros: a bare
  `jit(opt.init)` puts the moments on one device.
  """
  if isinstance(opt, PerPart):
    return {k: opt_state_shardings(t, params[k], param_shardings[k], mesh)
            for k, t in opt.parts.items()}
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


def apply_update(state: TrainState, opt, sched, loss, grads,
                 metrics) -> tuple[TrainState, dict]:
  """The optimizer update of `grads`, skipped (params and moments kept, `skipped` bumped) when
  the loss or the gradient is not finite; `metrics` gains loss, grad_norm, learning_rate and
  skipped_steps."""
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


def step_key(state: TrainState) -> jax.Array:
  """The step's RNG key: fold_in(rng, step)."""
  return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)


class Frozen(NamedTuple):
  """What the DPO step reads but never trains (see the module docstring)."""
  params: Any           # base weights (LoRA on) or the reference copy (LoRA off)
  ref_lora: Any = None  # TR-DPO with LoRA: a frozen LoRA copy; reference = params + ref_lora
  ref_params: Any = None  # LoRA with --ref_init_from: the separate reference model


# --- the DPO stage's trees: built here and nowhere else ---------------------------------------------

def trainable_specs(model, lora) -> dict:
  """ParamSpecs of what DPO trains: the LoRA factors, or (rank 0) every weight."""
  return lora_lib.lora_specs(model, lora) if lora.enabled else transformer.param_specs(model)


def initial_trainable(model, lora, base, key: jax.Array, mesh: Mesh):
  """Fresh LoRA factors (B = 0, so the policy starts equal to the base), or a copy of the base."""
  if lora.enabled:
    return lora_lib.init(model, lora, key, mesh)
  return jax.tree.map(lambda x: x.copy(), base)


def initial_frozen(base, trainable=None, reference=None, lora_on: bool = True) -> Frozen:
  """The frozen part; `trainable` (TR-DPO with LoRA) rides along as the reference adapter;
  `reference` (--ref_init_from) is the reference model: beside the base with LoRA, in place
  of the base's copy without."""
  if reference is not None and not lora_on:
    return Frozen(reference)
  return Frozen(base, None if trainable is None else jax.tree.map(lambda x: x.copy(), trainable),
                reference)


# --- steps ---------------------------------------------------------------------------------------

def reference_stats(spec: StepConfig, frozen: Frozen, batch, with_logits: bool = False):
  """Reference statistics of a pair batch (no dropout, no gradient)."""
  params = frozen.params if frozen.ref_params is None else frozen.ref_params
  adapter = None if frozen.ref_lora is None else transformer.Adapter(frozen.ref_lora,
                                                                     spec.lora.scale)
  out = logprobs.pair_stats(spec.model, params, batch, adapter, with_logits=with_logits,
                            score_slots=spec.score_slots)
  return jax.lax.stop_gradient(out)


def microbatches(batch, k: int):
  """[B, ...] -> [K, B/K, ...]. Microbatch i holds rows i, i + K, ...: with B split over n
  devices and K dividing B/n, each device's rows split evenly between the microbatches, so the
  scan slices local rows and nothing moves between devices."""
  return jax.tree.map(lambda x: einops.rearrange(x, "(b k) ... -> k b ...", k=k), batch)


def accumulate(grad_fn: Callable, params, batch, k: int):
  """The mean of `grad_fn(params, microbatch, i) -> ((loss, metrics), grads)` over K microbatches,
  scanned inside the step (one microbatch's activations live at a time). A ratio metric is a
  (numerator, denominator) pair, divided after accumulation so it equals the full batch's.
  K = 1 is one call on the whole batch."""
  if k == 1:
    out = grad_fn(params, batch, 0)
  else:
    def body(total, xs):
      i, micro = xs
      micro = jax.tree.map(lambda x: sharding.constrain(x, ("batch",) + (None,) * (x.ndim - 1)),
                           micro)
      return jax.tree.map(jnp.add, total, grad_fn(params, micro, i)), None
    first = jax.tree.map(lambda x: x[0], microbatches(batch, k))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                         jax.eval_shape(grad_fn, params, first, 0))
    out, _ = jax.lax.scan(body, zeros, (jnp.arange(k), microbatches(batch, k)))
    out = jax.tree.map(lambda x: x / k, out)
  (loss, metrics), grads = out
  metrics = {name: v[0] / jnp.maximum(v[1], 1.0) if isinstance(v, tuple) else v
             for name, v in metrics.items()}
  return (loss, metrics), grads


def accumulated_grads(loss_fn: Callable, spec: StepConfig, state: TrainState, frozen, batch):
  """((loss, metrics), grads) of `loss_fn(spec, frozen, trainable, microbatch, dropout_key)`
  with respect to the trainable part, averaged over the K microbatches of `batch` (`accumulate`);
  the LoRA dropout key is the step's (K = 1) or fold_in(it, i) for microbatch i, None without
  LoRA. The DPO, reward-model and KTO steps take their gradients so."""
  lora_on, k = spec.lora.enabled, spec.optim.gradient_accumulation_steps

  def grad_fn(trainable, micro, i):
    key = step_key(state) if k == 1 else jax.random.fold_in(step_key(state), i)
    return jax.value_and_grad(loss_fn, argnums=2, has_aux=True)(
        spec, frozen, trainable, micro, key if lora_on else None)

  return accumulate(grad_fn, state.params, batch, k)


def _check_pair_rows(rows: Rows) -> None:
  chex.assert_rank(list(rows), 3)
  chex.assert_equal_shape(list(rows))
  chex.assert_axis_dimension(rows.tokens, 1, 2)  # chosen, rejected
  chex.assert_type([rows.tokens, rows.loss_mask], [jnp.int32, jnp.float32])


def dpo_step(spec: StepConfig, state: TrainState, frozen: Frozen,
             batch: PairBatch) -> tuple[TrainState, dict]:
  """One preference update with the configured loss combination (spec.loss).

  batch: the [B, 2, T] pair rows; optionally (`batch.ref`) the reference statistics
  precomputed by dpo/reference.py, in which case no reference forward runs; optionally
  shared-prefix or packed rows with their scoring plan (dpo/packing.py), which the forwards
  then run on (packed: R rows, the "fill_rate" metric). Reference-free losses run
  no reference forward either. The token KL metric (spec.kl) needs the reference logits
  ([B, 2, T, V], or [R, K, V] at the scored slots of shared-prefix or packed rows); without it
  they are never kept. With gradient_accumulation_steps = K the loss, metrics
  and gradient are those of `microbatch_loss` averaged over K microbatches of B / K pairs
  (`accumulate`).
  """
  _check_pair_rows(batch.pairs)
  (loss, metrics), grads = accumulated_grads(microbatch_loss, spec, state, frozen, batch)
  if batch.packed is not None:  # packed rows (dpo/packing.py): the share of slots holding a token
    metrics["fill_rate"] = (batch.shared.segment_ids != 0).mean()
  return apply_update(state, *spec.optimizer(), loss, grads, metrics)


def microbatch_loss(spec: StepConfig, frozen: Frozen, trainable, batch: PairBatch, dropout_key):
  """(loss, metrics) of one (micro)batch of pairs: the reference statistics (the frozen model,
  precomputed `batch.ref`, or none for reference-free losses), the policy's, the loss
  combination. The "kl" metric is (sum over tokens, token count)."""
  lc = spec.loss
  if lc.reference_free:
    ref = None
  elif batch.ref is not None:
    ref = logprobs.PairStats(batch.ref.logps, None, batch.ref.shared_logps, None, None)
  else:
    ref = reference_stats(spec, frozen, batch, with_logits=spec.kl)

  def ld(total, shared):
    return total if lc.ld_alpha == 1.0 else losses.length_desensitised(total, shared, lc.ld_alpha)

  policy_params, adapter = trainable, None
  if spec.lora.enabled:
    policy_params, adapter = frozen.params, transformer.Adapter.training(
        trainable, spec.lora, dropout_key)
  pol = logprobs.pair_stats(spec.model, policy_params, batch, adapter, wpo=lc.wpo,
                            with_logits=ref is not None and ref.logits is not None,
                            score_slots=spec.score_slots)
  pol_lp = ld(pol.logps, pol.shared_logps)
  ref_lp = jnp.zeros_like(pol_lp) if ref is None else ld(ref.logps, ref.shared_logps)
  lp = losses.Logps(pol_lp[:, 0], pol_lp[:, 1], ref_lp[:, 0], ref_lp[:, 1],
                    pol.tokens[:, 0], pol.tokens[:, 1], policy_chosen_full=pol.logps[:, 0])
  loss, extra = losses.combined(lp, lc, pol.wpo_logw)
  loss, metrics = with_router_loss(spec.model, loss, {**losses.pair_statistics(lp, lc.beta),
                                                      **extra}, pol.router)
  if pol.logits is not None:
    # The KL-spike guard's measure: exact token KL(pi || pi_ref), mean per completion token.
    kl = logprobs.pair_kl(jax.lax.stop_gradient(pol.logits), ref.logits, batch)
    metrics["kl"] = (kl.sum(), pol.tokens.sum())
  return loss, metrics


def with_router_loss(model_cfg, loss, metrics: dict, stats) -> tuple[jax.Array, dict]:
  """A training loss and its metrics with a mixture's router losses added (models/moe.py's
  `router_loss` of the policy forward's statistics; unchanged without them)."""
  if stats is None:
    return loss, metrics
  extra, figures = moe.router_loss(model_cfg, stats)
  return loss + extra, {**metrics, **figures}


def sft_step(spec: StepConfig, state: TrainState, frozen, batch: Rows) -> tuple[TrainState, dict]:
  """One SFT update (all weights). `frozen` is unused; the signature matches `dpo_step`.
  Microbatches (gradient accumulation) carry summed NLLs and token counts, so the loss and
  gradient are the whole batch's token mean for any K. Packed rows (--sft_packing) hold several
  examples apart by segment id: the summed NLL and the token count are the same sums as over the
  unpacked rows, so is the loss ("fill_rate": the share of slots that hold a token)."""
  del frozen
  chex.assert_rank(list(batch), 2)  # [B, T]

  k = spec.optim.gradient_accumulation_steps
  # A mixture's router losses are a mean per microbatch, not scaled by the token count below:
  # the NLL is scaled inside instead (by the whole batch's tokens, counted up front).
  router = spec.model.router_losses
  inside = k / jnp.maximum(batch.loss_mask.sum(), 1.0) if router else 1.0

  def grad_fn(params, micro, i):
    del i
    def summed(p):
      s = logprobs.score(spec.model, p, micro)
      aux = {"tokens": s.mask.sum(-1).sum()}
      if spec.optim.sft_packing:
        aux["fill_rate"] = ((micro.segment_ids != 0).sum().astype(jnp.float32),
                            jnp.float32(micro.segment_ids.size))
      return with_router_loss(spec.model, -s.logps.sum(-1).sum() * inside, aux, s.router)
    return jax.value_and_grad(summed, has_aux=True)(params)

  (loss, metrics), grads = accumulate(grad_fn, state.params, batch, k)  # means over microbatches
  tokens = metrics["tokens"] * k
  scale = 1.0 if router else k / jnp.maximum(tokens, 1.0)  # summed NLL -> mean per token
  return apply_update(state, *spec.optimizer(), loss * scale,
                      jax.tree.map(lambda g: g * scale, grads), {**metrics, "tokens": tokens})


# --- jit -----------------------------------------------------------------------------------------

def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Dim 0 of every batch array (tokens [B, 2, T], ref_logps [B, 2], ...) over the batch mesh
  axes; a prefix spec, so the remaining axes are replicated whatever the array's rank."""
  return NamedSharding(mesh, P(sharding.RULES["batch"]))


def shardings(tree):
  """The sharding of each array of `tree` (for `jit_step_with_shardings`)."""
  return jax.tree.map(lambda x: x.sharding, tree)


def jit_step(step_fn: Callable, spec: StepConfig, mesh: Mesh, state: TrainState, frozen):
  """jit(step) with explicit in/out shardings taken from the live state, state donated."""
  return jit_step_with_shardings(step_fn, spec, mesh, shardings(state), shardings(frozen))


def jit_step_with_shardings(step_fn: Callable, spec: StepConfig, mesh: Mesh, state_sh, frozen_sh):
  """As `jit_step`, from sharding pytrees (so abstract shapes can be lowered without arrays).

  One jitted function per (step, spec, mesh, shardings): a second stage or run with the same
  computation reuses the compiled step.
  """
  flat = lambda tree: (jax.tree.structure(tree), tuple(jax.tree.leaves(tree)))
  return _jitted(step_fn, spec, mesh, flat(state_sh), flat(frozen_sh))


@functools.lru_cache(maxsize=32)
def _jitted(step_fn, spec, mesh, state_flat, frozen_flat):
  """`jit_step_with_shardings`'s function, cached on the (hashable) flattened shardings."""
  unflatten = lambda flat: flat[0].unflatten(flat[1])
  state_sh, frozen_sh = unflatten(state_flat), unflatten(frozen_flat)
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


def device_batch(mesh: Mesh, local, global_batch: int | None = None):
  """Global arrays from this process's rows of a batch (a pytree of numpy arrays whose first
  leaf is the token rows: `Rows`, `PairBatch`, sampler prompts).

  `local` holds the rows this process's devices own (see `sharding.process_batch_block`);
  `global_batch` is the number of rows of the first leaf over all processes; every array is
  one process block of its global array (packed rows have their own row count). When
  `global_batch` equals the local row count, every process passes the same full batch (as
  evaluation does).
  """
  blocks = 1 if global_batch is None else global_batch // len(jax.tree.leaves(local)[0])

  def one(v):
    shape = None if global_batch is None else (blocks * len(v), *v.shape[1:])
    return jax.make_array_from_process_local_data(batch_sharding(mesh), v, shape)
  return jax.tree.map(one, local)


def in_batches(mesh, fn, rows, batch_size: int) -> tuple[np.ndarray, ...]:
  """Runs fn(batch) -> pytree of [batch_size, ...] arrays over every row of `rows` (a typed
  batch of host arrays), in fixed-size batches (the last one filled with wrapped-around rows,
  dropped from the result). Every process holds all rows, so each passes the whole batch; fn's
  outputs must be replicated."""
  n = len(jax.tree.leaves(rows)[0])
  outs = []
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size) % n
    batch = device_batch(mesh, jax.tree.map(lambda v: v[idx], rows), batch_size)
    outs.append([x[:min(batch_size, n - start)] for x in jax.tree.leaves(jax.device_get(fn(batch)))])
  return tuple(np.concatenate(xs) for xs in zip(*outs))


def process_block(mesh: Mesh, whole):
  """This process's block of a batch that every process holds whole (a pytree of numpy arrays,
  one leading row axis: the online stages' sampled rows), the rows the offline stages' loader
  would give it (`sharding.process_batch_block`); `device_batch` with the whole batch's row
  count makes the global batch of it."""
  n = len(jax.tree.leaves(whole)[0])
  i, blocks = sharding.process_batch_block(mesh, n)
  return jax.tree.map(lambda v: v[i * n // blocks:(i + 1) * n // blocks], whole)


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

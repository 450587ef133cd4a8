"""PPO with a learned value model (Schulman et al. 2017, arXiv:1707.06347; Tunix 0.1.7's PPO
learner, tunix/rl/ppo/ppo_learner.py): every `ppo_num_iterations` steps one completion is sampled
for each of --global_batch_size training prompts from the current policy, the judge
(dpo/judges.py) scores it, each completion token's reward is that score on its last token less
--ppo_beta times a token KL(pi_old || pi_ref) estimate, and GAE over the value model's values
gives the advantages (whitened over the batch) and the returns (`policy_gradient.token_rewards`,
`gae_advantages`); each step then updates the policy with the token-level clipped surrogate and
the value model with the clipped value loss (`ppo_policy_loss`, `ppo_value_loss`).

The value model (--ppo_value_model) is `separate` (Tunix's critic: its own LoRA factors on the
frozen base, or its own copy of every weight without LoRA, and a head [D, 1] read at each token's
final hidden state; its own AdamW at --ppo_value_learning_rate) or `head` (a head on the policy's
own final hidden states: one trunk, the value loss weighted by --ppo_vf_coef in the policy's
update). Either way it is trained beside the policy in the stage's state (`registry.Algorithm.
beside`: the state's trainable is {"policy", "beside"}), so its checkpoints, resume and rollback
are the policy's; the policy alone is exported and evaluated. The value of completion token t is
read where its log-prob is: at the hidden state of the slot before it.

Everything else is GRPO's stage (dpo/algorithms/grpo.py, whose `Generated` this subclasses):
online DPO's sampler on the training mesh, old and reference log-probs and the values computed
once per generation batch, checkpoints between generation batches (--checkpoint_every and
--ppo_steps must be multiples of --ppo_num_iterations), the sampling key of a batch fold_in(key,
its first step), so a run killed mid-generation resumes to what the uninterrupted one drew.

Logged per step: reward, reward_std, completions/mean_length, completions/clipped_ratio, kl (the
token mean of the KL estimate in the rewards, with --ppo_beta > 0), the policy's pg_clipfrac,
pg_clipfrac_lower (with --ppo_epsilon_c), entropy, policy_loss, and the value model's vf_loss,
vpred_mean, vf_clipfrac, return_mean (Tunix's names), and the time split.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpo import batches, identity, judges, logprobs, registry, train
from dpo import policy_gradient as pg
from dpo.algorithms import dpo, grpo, rm
from models import sharding, transformer
from models.config import check


class PPOBatch(NamedTuple):
  """One step's rows: prompt + completion [N, T] (the loss mask on completion tokens), and per
  token [N, T]: the log-probs of the policy that sampled them, the advantages, the returns and
  the values at sampling."""
  rows: batches.Rows
  old_logps: np.ndarray
  advantages: np.ndarray
  returns: np.ndarray
  old_values: np.ndarray


def _token_values(h_NTD, score_D1, mask_NT):
  """[N, T] the value of each completion token: the head at the slot before it (where its
  log-prob's logits are read; slot 0 scores nothing), 0 off the loss mask."""
  v_NT = jnp.einsum("ntd,do->nt", h_NTD.astype(jnp.float32), score_D1.astype(jnp.float32))
  return jnp.pad(v_NT[:, :-1], ((0, 0), (1, 0))) * mask_NT


def _value_hidden(spec: train.StepConfig, frozen, value, inputs):
  """The separate value model's final hidden states: its LoRA factors on the frozen base, or
  its own weights."""
  if spec.lora.enabled:
    return transformer.hidden(spec.model, frozen.params, inputs,
                              transformer.Adapter(value["body"], spec.lora.scale))
  return transformer.hidden(spec.model, value["body"], inputs)


def values(spec: train.StepConfig, frozen, trainable, rows: batches.Rows) -> jax.Array:
  """[N, T] the value model's values of `rows`' completion tokens (no gradient)."""
  mask = rows.loss_mask.astype(jnp.float32)
  if spec.own.ppo_value_model == "head":
    params, adapter = grpo.policy_weights(spec, frozen, trainable["policy"])
    h = transformer.hidden(spec.model, params, rows.inputs(), adapter)
  else:
    h = _value_hidden(spec, frozen, trainable["beside"], rows.inputs())
  return _token_values(h, trainable["beside"]["score"], mask)


def ppo_step(spec: train.StepConfig, state: train.TrainState, frozen,
             batch: PPOBatch) -> tuple[train.TrainState, dict]:
  """One PPO update of the policy and the value model on a generation batch's rows (gradient
  accumulation as train.accumulate does; both losses are token means over the whole batch)."""
  k = spec.optim.gradient_accumulation_steps
  num_items = batch.rows.loss_mask.sum() / k
  cfg = spec.own

  def loss_fn(trainable, micro):
    params, adapter = grpo.policy_weights(spec, frozen, trainable["policy"])
    inputs, mask = micro.rows.inputs(), micro.rows.loss_mask.astype(jnp.float32)
    h = transformer.hidden(spec.model, params, inputs, adapter)
    logits = transformer.unembed(spec.model, params, h)
    logps = logprobs.token_logps(logits, micro.rows.tokens) * mask
    entropies = pg.token_entropy(logits)
    if not cfg.ppo_entropy_coef:
      entropies = jax.lax.stop_gradient(entropies)
    policy_loss, metrics = pg.ppo_policy_loss(logps, micro.old_logps, micro.advantages, mask, cfg,
                                              num_items=num_items, entropies_NT=entropies)
    value = trainable["beside"]
    if cfg.ppo_value_model == "separate":
      h = _value_hidden(spec, frozen, value, inputs)
    value_loss, value_metrics = pg.ppo_value_loss(
        _token_values(h, value["score"], mask), micro.old_values, micro.returns, mask,
        cfg.clip_range_value, num_items=num_items)
    weight = cfg.ppo_vf_coef if cfg.ppo_value_model == "head" else 1.0
    return policy_loss + weight * value_loss, {**metrics, **value_metrics,
                                               "policy_loss": policy_loss}

  def grad_fn(trainable, micro, i):
    del i
    return jax.value_and_grad(loss_fn, has_aux=True)(trainable, micro)

  (loss, metrics), grads = train.accumulate(grad_fn, state.params, batch, k)
  return train.apply_update(state, *optimizer(spec), loss, grads, metrics)


def optimizer(spec: train.StepConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The policy's AdamW (clipped, warmup + cosine) on {"policy"}, and on {"beside"} the value
  model's: its own clipping and moments at --ppo_value_learning_rate (0: the policy's) on the
  same schedule, as Tunix's separate critic optimizer."""
  policy_opt, sched = train.optimizer(spec.optim, spec.peak_lr, spec.total_steps)
  value_opt, _ = train.optimizer(spec.optim, spec.own.ppo_value_learning_rate or spec.peak_lr,
                                 spec.total_steps)
  return train.PerPart({"policy": policy_opt, "beside": value_opt}), sched


def value_model(cfg, mesh, base, key):
  """The value model's fresh weights: a head ~ N(0, init_std^2) (the reward model's, rm.py),
  and with `separate` fresh LoRA factors (B = 0: its trunk starts as the base) or a copy of the
  base."""
  if cfg.ppo.ppo_value_model == "separate":
    return rm.initial_trainable(cfg.model, cfg.lora, base, key, mesh)
  spec = transformer.score_spec(cfg.model)
  head = jax.jit(lambda k: transformer.init_from_specs(spec, k, cfg.model.init_std),
                 out_shardings=transformer.shardings(spec, mesh))(jax.random.split(key)[1])
  return {"score": head}  # the head rm.initial_trainable draws from the same key


@dataclasses.dataclass
class Generated(grpo.Generated):
  """Program.stage's `online` for PPO: a generation batch of one completion a prompt every
  ppo_num_iterations steps, its token rewards, values and GAE advantages."""
  salt = 9
  dynamic_sampling = False  # GRPO's alone

  @staticmethod
  def completion_length(cfg) -> int:
    return cfg.ppo.ppo_max_completion_length

  @property
  def generations(self) -> int:
    return 1

  @property
  def repeat(self) -> int:
    return self.cfg.ppo.ppo_num_iterations

  def sample(self, state, batch, key, n: int = 1):
    return super().sample(_policy(state), batch, key, n)

  def rewarded(self, batch, comps):
    """GRPO's, except that a single reward function may not return None: its None is the
    judge's one-line error naming the function and the record (PPO needs every score)."""
    if isinstance(self.judge, judges.FunctionJudge):
      rewards, ended = self.scored(batch, comps)
      return rewards[:, None], ended, {}
    return super().rewarded(batch, comps)

  def generation(self, state, frozen, batch, comps, score, spec, scored=None):
    """(the PPOBatch of a generation batch, its logged figures)."""
    c = self.cfg.ppo
    rewards_NF, ended, info = scored or self.rewarded(batch, comps)
    scores = np.asarray(pg.weighted_rewards(rewards_NF.astype(np.float32),
                                            self.cfg.grpo.reward_weights), np.float32)
    if np.isnan(scores).any():  # several functions, each of which returned None for a sample
      raise ValueError(f"--reward_fn={self.cfg.eval.reward_fn}: every function returned None "
                       f"for {int(np.isnan(scores).sum())} of {len(scores)} samples at step "
                       f"{int(state.step)}; PPO's rewards need every completion scored")
    rows, old, ref = self.scored_rows(_policy(state), frozen, (batch, comps, ended), score, spec,
                                      False, c.ppo_beta > 0)
    mask = rows.loss_mask
    device_rows = train.device_batch(self.mesh, rows, len(rows.tokens))
    old_values = sharding.to_host(_values(spec, frozen, state.params, device_rows))
    rewards_NT, kl_NT = pg.token_rewards(jnp.asarray(scores), old, ref, mask, c)
    advantages, returns = pg.gae_advantages(rewards_NT, old_values, mask, c.gamma, c.gae_lambda)
    info = {**info, **grpo.figures(scores.astype(np.float64), comps, ended)}
    if kl_NT is not None:
      info["kl"] = float(np.asarray(kl_NT).sum() / max(mask.sum(), 1.0))
    f32 = lambda x: np.asarray(x, np.float32)
    return PPOBatch(rows, f32(old), f32(advantages), f32(returns), f32(old_values)), info


_values = jax.jit(values, static_argnums=0)


def _policy(state: train.TrainState) -> train.TrainState:
  """The state as the policy's alone (what the sampler and the log-probs read)."""
  return state._replace(params=PPO.policy_part(state.params))


def run(p, model: registry.Model) -> registry.Model:
  """The PPO stage: the KL guard watches the KL estimate in the rewards with --ppo_beta > 0."""
  estimate = "kl" if p.cfg.ppo.ppo_beta > 0 else None
  online = lambda p_, judge, base: grpo.generated(p_, judge, base, Generated)
  return dpo.preference_stage(p, model, PPO, online, estimate)


def step_config(cfg) -> train.StepConfig:
  return dataclasses.replace(train.StepConfig.dpo(cfg), total_steps=cfg.ppo.ppo_steps,
                             loss=None, kl=False, own=cfg.ppo)


def check_config(cfg) -> None:
  """Iterations divide the stage's length and the checkpoint cadence; a value-model flag of the
  other kind, a reference update or a GRPO-only flag is refused (nothing would read it)."""
  c, here = cfg.ppo, PPO.name in cfg.run.stages
  check(not here or (c.ppo_steps % c.ppo_num_iterations == 0
                     and cfg.checkpoint.checkpoint_every % c.ppo_num_iterations == 0),
        f"--ppo_num_iterations={c.ppo_num_iterations}: must divide --ppo_steps={c.ppo_steps} and "
        f"--checkpoint_every={cfg.checkpoint.checkpoint_every} (checkpoints fall between "
        f"generation batches)")
  default = pg.PPOConfig()
  check(c.ppo_value_model == "head" or c.ppo_vf_coef == default.ppo_vf_coef,
        f"--ppo_vf_coef={c.ppo_vf_coef}: weighs the value loss on the policy's trunk "
        f"(--ppo_value_model=head); a separate value model has its own optimizer")
  check(c.ppo_beta > 0 or (c.ppo_kl_method == default.ppo_kl_method
                          and c.ppo_kl_clamp == default.ppo_kl_clamp),
        f"--ppo_kl_method={c.ppo_kl_method} --ppo_kl_clamp={c.ppo_kl_clamp}: the token KL in "
        f"the rewards is off with --ppo_beta=0")
  check(not here or cfg.reference.ref_update == "none",
        f"--ref_update={cfg.reference.ref_update}: the ppo stage keeps its reference fixed (its "
        f"KL is in the rewards)")
  grpo.check_weights_only(cfg, PPO.name)


PPO = registry.register(registry.Algorithm(
    name="ppo", step=ppo_step, batch=lambda host: host, step_config=step_config, run=run,
    hyperparameters=lambda cfg: {**identity.sections(cfg, ("lora", "optim", "reference", "online",
                                                          "ppo")),
                                 "judge": judges.fingerprint(cfg)},
    data_files=("train_data", "tokenizer"), data_seed=9, steps_flag="--ppo_steps",
    sections=(("ppo", pg.PPOConfig),), reads=("online", "grpo"), check=check_config,
    samples=True, completion_length=Generated.completion_length, judged=True,
    beside=value_model, optimizer=optimizer, router_losses=False,
    columns=registry.COLUMNS + (("reward", "reward", ".3f"), ("kl", "kl", ".4f"),
                                ("vf", "vf_loss", ".4f"))))

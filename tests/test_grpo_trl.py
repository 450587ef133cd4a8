"""dpo/policy_gradient.py against TRL 1.16's GRPOTrainer, the oracle users compare with.

The same per-token log-probs (policy, sampling policy, reference), advantages and completion
masks go into TRL's `GRPOTrainer._compute_loss` and into `grpo_loss`. TRL's trainer is built
with `object.__new__` and the attributes `_compute_loss` reads, as tests/test_losses_trl.py does
for DPO; its `_get_per_token_logps_and_entropies` (the model's forward) is replaced by one that
returns the given log-probs as a leaf tensor, so TRL's own code computes the loss, its metrics
and, by torch autograd, the gradient with respect to the log-probs, which jax.grad of ours must
equal. The advantages are checked against TRL's formula (inline in
`_generate_and_score_completions`, not a function TRL factors out) with TRL's own `nanstd`.
"""

import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl_grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
from trl.trainer.utils import nanstd  # noqa: E402

from dpo import policy_gradient as pg  # noqa: E402

B, G, T = 4, 4, 12  # prompts, completions per prompt, completion slots
N = B * G
TOL = dict(rtol=1e-5, atol=1e-6)


def make_inputs(seed, empty=False):
  """Per-token log-probs of the policy, the sampling (old) policy and the reference [N, T] (the
  old ones far enough from the policy that the ratio leaves [0.8, 1.28] on both sides), advantages
  of both signs [N], completion masks of varied lengths [N, T] (one completion empty with
  `empty`), per-token entropies [N, T]. Padding slots hold finite values, as a model gives them."""
  rng = np.random.default_rng(seed)
  n = rng.integers(1, T + 1, N)
  if empty:
    n[3] = 0
  mask = (np.arange(T) < n[:, None]).astype(np.int64)
  logps = rng.uniform(-3.0, -0.05, (N, T)).astype(np.float32)
  f32 = lambda a: a.astype(np.float32)
  return dict(logps=logps, old=f32(logps + rng.normal(0, 0.3, (N, T))),
              ref=f32(logps + rng.normal(0, 0.3, (N, T))), adv=f32(rng.normal(0, 1, N)),
              mask=mask, entropy=f32(rng.uniform(0.0, 3.0, (N, T))))


# --- TRL's GRPOTrainer ----------------------------------------------------------------------------

class _Accelerator:
  num_processes = 1
  device = torch.device("cpu")
  gather = staticmethod(lambda t: t)
  reduce = staticmethod(lambda t, reduction="sum": t)
  pad_across_processes = staticmethod(lambda t, dim=0, pad_index=0: t)


def trl_grpo(x, cfg, on_policy=False, num_items=None, grad_accum=1, steps_per_generation=1):
  """(loss, d loss / d logps [N, T], metrics) of TRL's `GRPOTrainer._compute_loss`, its attributes
  set from our config as TRL's __init__ sets them from its GRPOConfig."""
  t = object.__new__(trl_grpo_trainer.GRPOTrainer)
  logps = torch.tensor(x["logps"], requires_grad=True)
  t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.tensor(x["entropy"]), None)
  t.__dict__.update(
      model=types.SimpleNamespace(training=True), accelerator=_Accelerator(),
      beta=cfg.grpo_beta, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
      loss_type=cfg.grpo_loss_type, importance_sampling_level=cfg.importance_sampling_level,
      top_entropy_quantile=cfg.top_entropy_quantile,
      max_completion_length=cfg.max_completion_length,
      off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
      aux_loss_enabled=False, _entropy_bonus_enabled=False,
      current_gradient_accumulation_steps=grad_accum,
      _metrics={"train": collections.defaultdict(list)},
      args=types.SimpleNamespace(delta=cfg.grpo_delta or None,
                                 use_bias_correction_kl=cfg.use_bias_correction_kl,
                                 steps_per_generation=steps_per_generation))
  mask = torch.from_numpy(x["mask"])
  items = float(mask.sum() if num_items is None else num_items)
  inputs = {"prompt_ids": torch.zeros(N, 2, dtype=torch.long),
            "prompt_mask": torch.ones(N, 2, dtype=torch.long),
            "completion_ids": torch.zeros(N, T, dtype=torch.long), "completion_mask": mask,
            "advantages": torch.tensor(x["adv"]),
            "num_items_in_batch": torch.tensor(items)}
  if not on_policy:
    inputs["old_per_token_logps"] = torch.tensor(x["old"])
  if cfg.grpo_beta:
    inputs["ref_per_token_logps"] = torch.tensor(x["ref"])
  loss = t._compute_loss(None, inputs)
  loss.backward()
  metrics = {k: v[-1] for k, v in t._metrics["train"].items()}
  return float(loss.detach()), logps.grad.numpy(), metrics


def ours(x, cfg, on_policy=False, num_items=None):
  """(loss, d loss / d logps, metrics with (sum, count) pairs divided as train.accumulate does)."""
  f = lambda k: jnp.asarray(x[k])
  def loss_fn(logps):
    return pg.grpo_loss(logps, None if on_policy else f("old"), f("ref") if cfg.grpo_beta else None,
                        f("adv"), f("mask"), cfg, num_items=num_items, entropies_NT=f("entropy"))
  (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(f("logps"))
  metrics = {k: float(v[0] / jnp.maximum(v[1], 1.0)) if isinstance(v, tuple) else float(v)
             for k, v in metrics.items()}
  return float(loss), np.asarray(grad), metrics


def check_equal(x, cfg, **kw):
  """Loss, gradient and every metric TRL logs: equal. Returns TRL's metrics."""
  on_policy = kw.pop("on_policy", False)
  want_loss, want_grad, want = trl_grpo(x, cfg, on_policy=on_policy, **kw)
  got_loss, got_grad, got = ours(x, cfg, on_policy=on_policy, num_items=_normaliser(**kw))
  np.testing.assert_allclose(got_loss, want_loss, **TOL)
  # Gradients are as small as 1 / (N * max_completion_length): the absolute tolerance scales.
  np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-6 * np.abs(want_grad).max())
  assert set(got) == set(want), (sorted(got), sorted(want))
  for k in want:
    np.testing.assert_allclose(got[k], want[k], **TOL, err_msg=k)
  return want


def _normaliser(num_items=None, grad_accum=1, steps_per_generation=1):
  """Our `num_items` for TRL's dapo normaliser (one process, training mode)."""
  if num_items is None:
    return None
  return max(num_items, 1.0) * grad_accum / steps_per_generation


# --- the loss -------------------------------------------------------------------------------------

@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", pg.LOSS_TYPES)
def test_loss_gradient_metrics_equal_trl(loss_type, beta):
  """num_iterations > 1: the old log-probs differ from the policy's, clipping active on both
  sides, asymmetric (DAPO's clip-higher); with and without the KL term."""
  x = make_inputs(pg.LOSS_TYPES.index(loss_type) + int(100 * beta))
  cfg = pg.GRPOConfig(grpo_loss_type=loss_type, grpo_beta=beta, grpo_epsilon=0.2,
                      grpo_epsilon_high=0.28, max_completion_length=T + 4)
  want = check_equal(x, cfg)
  assert want["clip_ratio/low_mean"] > 0.02 and want["clip_ratio/high_mean"] > 0.02
  assert ("kl" in want) == (beta > 0)


@pytest.mark.parametrize("loss_type", pg.LOSS_TYPES)
def test_on_policy_old_logps_none(loss_type):
  """num_iterations = 1: TRL takes the policy's own log-probs, detached (ratio 1, gradient A)."""
  cfg = pg.GRPOConfig(grpo_loss_type=loss_type, grpo_beta=0.1)
  want = check_equal(make_inputs(10), cfg, on_policy=True)
  assert want["clip_ratio/region_mean"] == 0


@pytest.mark.parametrize("loss_type", pg.LOSS_TYPES)
def test_sequence_level_importance_sampling(loss_type):
  """GSPO's one ratio per completion, with the KL term (broadcast over tokens) and an empty
  completion (TRL counts it among the completions in the clip metrics)."""
  x = make_inputs(20, empty=True)
  x["old"] = x["logps"] + (x["old"] - x["logps"]).mean(-1, keepdims=True) * 2  # ratios off 1
  cfg = pg.GRPOConfig(grpo_loss_type=loss_type, importance_sampling_level="sequence",
                      grpo_beta=0.05, grpo_epsilon_high=0.28)
  want = check_equal(x, cfg)
  assert want["clip_ratio/region_mean"] > 0


@pytest.mark.parametrize("delta", [1.5, 1.1])  # 1.1 < 1 + epsilon_high: the cap moves the metrics
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_sided_clipping_delta(loss_type, delta):
  x = make_inputs(30)
  x["old"] = x["old"] - 0.3 * (x["adv"][:, None] < 0)  # large ratios under negative advantages
  cfg = pg.GRPOConfig(grpo_loss_type=loss_type, grpo_delta=delta, grpo_epsilon_high=0.28,
                      grpo_beta=0.02)
  check_equal(x, cfg)
  no_delta = dataclasses.replace(cfg, grpo_delta=0.0)
  assert abs(ours(x, cfg)[0] - ours(x, no_delta)[0]) > 1e-3


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.0])
def test_top_entropy_quantile(quantile):
  x = make_inputs(40, empty=True)
  cfg = pg.GRPOConfig(grpo_loss_type="dapo", top_entropy_quantile=quantile, grpo_beta=0.03)
  check_equal(x, cfg)


def test_kl_without_bias_correction():
  cfg = pg.GRPOConfig(grpo_loss_type="bnpo", grpo_beta=0.2, use_bias_correction_kl=False)
  check_equal(make_inputs(50), cfg)


@pytest.mark.parametrize("num_items,grad_accum,steps_per_generation", [
    (300.0, 1, 1), (500.0, 2, 4), (0.0, 1, 1)])
def test_dapo_normaliser_spans_the_generation_batch(num_items, grad_accum, steps_per_generation):
  """TRL's dapo divides by the generation batch's active tokens per accumulation window,
  num_items_in_batch * gradient_accumulation_steps / steps_per_generation: our num_items."""
  cfg = pg.GRPOConfig(grpo_loss_type="dapo", grpo_beta=0.04)
  check_equal(make_inputs(60), cfg, num_items=num_items, grad_accum=grad_accum,
              steps_per_generation=steps_per_generation)


def test_dapo_through_train_accumulate_is_the_whole_batch():
  """train.accumulate over K = 2 microbatches (their mean), each with num_items = the whole
  batch's tokens / K, gives the whole batch's dapo loss, gradient and mean metrics (the (sum,
  count) pairs); bnpo's microbatches divide by their own token counts (TRL's local batch)."""
  from dpo import train
  batch = {k: jnp.asarray(v) for k, v in make_inputs(70).items()}
  means = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "clip_ratio/region_mean")

  def run(cfg, k, num_items=None):
    def grad_fn(scale, micro, i):  # the gradient with respect to a scale of the log-probs
      del i
      return jax.value_and_grad(lambda s: pg.grpo_loss(
          s * micro["logps"], micro["old"], micro["ref"], micro["adv"], micro["mask"], cfg,
          num_items=num_items, entropies_NT=micro["entropy"]), has_aux=True)(scale)
    (loss, metrics), grad = train.accumulate(grad_fn, jnp.float32(1.0), batch, k)
    return [float(loss), float(grad)] + [float(metrics[m]) for m in means]

  dapo = pg.GRPOConfig(grpo_loss_type="dapo", grpo_beta=0.04)
  whole = run(dapo, 1)
  np.testing.assert_allclose(run(dapo, 2, batch["mask"].sum() / 2), whole, **TOL)
  assert abs(run(dapo, 2)[0] - whole[0]) > 1e-4  # each microbatch's own count: not the same
  bnpo = dataclasses.replace(dapo, grpo_loss_type="bnpo")
  assert abs(run(bnpo, 2)[0] - run(bnpo, 1)[0]) > 1e-4


def test_jit_gives_the_same_loss():
  x = make_inputs(80)
  cfg = pg.GRPOConfig(grpo_loss_type="grpo", grpo_beta=0.04, importance_sampling_level="sequence")
  args = [jnp.asarray(x[k]) for k in ("logps", "old", "ref", "adv", "mask")]
  eager = pg.grpo_loss(*args, cfg)[0]
  jitted = jax.jit(pg.grpo_loss, static_argnums=5)(*args, cfg)[0]
  np.testing.assert_allclose(float(jitted), float(eager), **TOL)
  assert np.isfinite(float(jitted))


def test_missing_inputs_are_one_line_errors():
  x = make_inputs(90)
  args = [jnp.asarray(x[k]) for k in ("logps", "old")]
  with pytest.raises(ValueError, match="--grpo_beta=0.1: grpo_loss needs ref_logps_NT"):
    pg.grpo_loss(*args, None, jnp.asarray(x["adv"]), jnp.asarray(x["mask"]),
                 pg.GRPOConfig(grpo_beta=0.1))
  with pytest.raises(ValueError, match="--top_entropy_quantile=0.2: grpo_loss needs entropies_NT"):
    pg.grpo_loss(*args, None, jnp.asarray(x["adv"]), jnp.asarray(x["mask"]),
                 pg.GRPOConfig(top_entropy_quantile=0.2))


# --- rewards and advantages -----------------------------------------------------------------------

def trl_advantages(rewards_N, scale_rewards, num_generations):
  """TRL 1.16 trl/trainer/grpo_trainer.py, `_generate_and_score_completions`, the
  multi_objective_aggregation == "sum_then_normalize" branch and the nan_to_num after it
  (lines 2761-2788 and 2810 of the installed file), from the summed rewards on: written out with
  torch ops and TRL's own `nanstd`, because TRL does not factor it into a function."""
  rewards = rewards_N.clone()
  mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1)
  mean_grouped = mean_grouped.repeat_interleave(num_generations, dim=0)
  if scale_rewards in ["group", "none"]:
    if num_generations > 1:
      std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, 0)
    else:
      std = torch.zeros_like(rewards)
  elif scale_rewards == "batch":
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
  advantages = rewards - mean_grouped
  if scale_rewards != "none":
    advantages = advantages / (std + 1e-4)
  return torch.nan_to_num(advantages, nan=0.0)


def trl_weighted_rewards(rewards_NF, weights):
  """The same function's lines 2759-2764: nansum of the weighted functions, NaN where all are NaN."""
  unscorable = torch.isnan(rewards_NF).all(dim=1)
  rewards = (rewards_NF * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
  rewards[unscorable] = torch.nan
  return rewards


def rewards_with_none(seed, groups=B, generations=G, functions=3):
  """[groups, generations, F] rewards, NaN where a reward function returned None: one
  completion unscorable by every function, one group with a single scorable completion."""
  rng = np.random.default_rng(seed)
  r = rng.normal(0, 2, (groups, generations, functions)).astype(np.float32)
  r[rng.random(r.shape) < 0.2] = np.nan
  r[0, -1] = np.nan
  if generations > 1:
    r[1, 1:] = np.nan
  return r


@pytest.mark.parametrize("weights", [(), (1.0, 0.5, -2.0)])
def test_weighted_rewards_equal_trl(weights):
  r = rewards_with_none(0)
  want = trl_weighted_rewards(torch.from_numpy(r.reshape(N, -1)), weights or [1.0] * 3).numpy()
  got = np.asarray(pg.weighted_rewards(jnp.asarray(r), weights)).reshape(N)
  np.testing.assert_allclose(got, want, **TOL)
  assert np.isnan(got[G - 1]) and np.isnan(want[G - 1])


@pytest.mark.parametrize("generations", [G, 1])
@pytest.mark.parametrize("scale_rewards", pg.SCALE_REWARDS)
def test_group_advantages_equal_trl(scale_rewards, generations):
  r = pg.weighted_rewards(jnp.asarray(rewards_with_none(1, generations=generations)),
                          (1.0, 0.5, 2.0))
  want = trl_advantages(torch.from_numpy(np.array(r).reshape(-1)), scale_rewards, generations)
  got = np.asarray(pg.group_advantages(r, scale_rewards)).reshape(-1)
  np.testing.assert_allclose(got, want.numpy(), **TOL)
  assert np.isfinite(got).all()


def test_group_advantages_std_is_unbiased():
  """torch.std's default, Bessel's correction: rewards 0 and 2 have std sqrt(2), not 1."""
  a = pg.group_advantages(jnp.asarray([[0.0, 2.0]]), "group")
  np.testing.assert_allclose(np.asarray(a), [[-1 / (2 ** 0.5 + 1e-4), 1 / (2 ** 0.5 + 1e-4)]],
                             **TOL)


# --- the config section ---------------------------------------------------------------------------

TRL_NAMES = {"grpo_beta": "beta", "grpo_epsilon": "epsilon", "grpo_epsilon_high": "epsilon_high",
             "grpo_delta": "delta", "grpo_loss_type": "loss_type"}


def test_config_defaults_are_trls():
  """Each field's default is TRL 1.16 GRPOConfig's (TRL's None is our 0; its reward_weights None
  our empty tuple), and the docstring or help names the TRL counterpart."""
  trl_config = pytest.importorskip("trl.trainer.grpo_config")
  trl_defaults = {f.name: f.default for f in dataclasses.fields(trl_config.GRPOConfig)}
  for f in dataclasses.fields(pg.GRPOConfig):
    trl_name = TRL_NAMES.get(f.name, f.name)
    want = trl_defaults[trl_name]
    want = {None: 0.0 if f.type == "float" else ()}.get(want, want)
    assert f.default == want, (f.name, f.default, want)
    assert f"TRL's {trl_name}" in f.metadata["help"], f.name


@pytest.mark.parametrize("field,value,message", [
    ("grpo_loss_type", "cispo", "--grpo_loss_type='cispo': must be grpo, bnpo, dr_grpo or dapo"),
    ("scale_rewards", "std", "--scale_rewards='std': must be group, batch or none"),
    ("grpo_epsilon", 1.0, "--grpo_epsilon=1.0: must be in [0, 1)"),
    ("grpo_delta", 0.9, "--grpo_delta=0.9: must be 0 (off) or a finite number > 1"),
    ("num_generations", 1, "--num_generations=1: must be >= 2"),
    ("top_entropy_quantile", 1.5, "--top_entropy_quantile=1.5: must be in [0, 1]"),
    ("importance_sampling_level", "seq", "--importance_sampling_level='seq': must be token or "
                                         "sequence"),
    ("use_bias_correction_kl", False, "--use_bias_correction_kl=False: must go with --grpo_beta"),
])
def test_config_refuses_bad_values(field, value, message):
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")
                     .replace(")", r"\)")):
    pg.GRPOConfig(**{field: value})


def test_epsilon_high_zero_is_epsilon():
  assert pg.GRPOConfig(grpo_epsilon=0.1).epsilon_high == 0.1
  assert pg.GRPOConfig(grpo_epsilon=0.1, grpo_epsilon_high=0.3).epsilon_high == 0.3

"""dpo/policy_gradient.py against TRL 1.16's GRPOTrainer, the oracle users compare with.

The same per-token log-probs (policy, sampling policy, reference), advantages and completion
masks go into TRL's `GRPOTrainer._compute_loss` and into `grpo_loss`. TRL's trainer is built
with `object.__new__` and the attributes `_compute_loss` reads, as tests/test_losses_trl.py does
for DPO; its `_get_per_token_logps_and_entropies` (the model's forward) is replaced by one that
returns the given log-probs as a leaf tensor, so TRL's own code computes the loss, its metrics
and, by torch autograd, the gradient with respect to the log-probs, which jax.grad of ours must
equal. The weighted rewards, advantages and reward metrics are TRL's own lines of
`_generate_and_score_completions` (inline there, not a function TRL factors out), compiled from
the installed source and run on the rewards of each function.
"""

import collections
import dataclasses
import inspect
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl_grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

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
  sync_gradients = True  # one optimizer step per call: TRL logs entropy_coef there
  device = torch.device("cpu")
  gather = staticmethod(lambda t: t)
  reduce = staticmethod(lambda t, reduction="sum": t)
  pad_across_processes = staticmethod(lambda t, dim=0, pad_index=0: t)


def trl_grpo(x, cfg, on_policy=False, num_items=None, grad_accum=1, steps_per_generation=1):
  """(loss, d loss / d logps [N, T], d loss / d entropies [N, T], metrics) of TRL's
  `GRPOTrainer._compute_loss`, its attributes set from our config as TRL's __init__ sets them
  from its GRPOConfig (TRL's None where our 0 means off)."""
  t = object.__new__(trl_grpo_trainer.GRPOTrainer)
  logps = torch.tensor(x["logps"], requires_grad=True)
  entropy = torch.tensor(x["entropy"], requires_grad=True)
  t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropy, None)
  t.__dict__.update(
      model=types.SimpleNamespace(training=True), accelerator=_Accelerator(),
      beta=cfg.grpo_beta, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
      loss_type=cfg.grpo_loss_type, importance_sampling_level=cfg.importance_sampling_level,
      top_entropy_quantile=cfg.top_entropy_quantile,
      max_completion_length=cfg.max_completion_length,
      off_policy_mask_threshold=cfg.off_policy_mask_threshold or None, use_vllm=False,
      vllm_importance_sampling_correction=False, aux_loss_enabled=False,
      entropy_coef=cfg.entropy_coef, use_adaptive_entropy=False,
      _entropy_bonus_enabled=cfg.entropy_coef != 0.0,
      current_gradient_accumulation_steps=grad_accum,
      _metrics={"train": collections.defaultdict(list)},
      args=types.SimpleNamespace(delta=cfg.grpo_delta or None,
                                 use_bias_correction_kl=cfg.use_bias_correction_kl,
                                 steps_per_generation=steps_per_generation,
                                 sapo_temperature_neg=cfg.sapo_temperature_neg,
                                 sapo_temperature_pos=cfg.sapo_temperature_pos,
                                 vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos,
                                 vespo_k_neg=cfg.vespo_k_neg,
                                 vespo_lambda_neg=cfg.vespo_lambda_neg))
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
  d_entropy = np.zeros_like(x["entropy"]) if entropy.grad is None else entropy.grad.numpy()
  return float(loss.detach()), logps.grad.numpy(), d_entropy, metrics


def ours(x, cfg, on_policy=False, num_items=None):
  """(loss, d loss / d logps, d loss / d entropies, metrics with (sum, count) pairs divided as
  train.accumulate does)."""
  f = lambda k: jnp.asarray(x[k])
  def loss_fn(logps, entropies):
    return pg.grpo_loss(logps, None if on_policy else f("old"), f("ref") if cfg.grpo_beta else None,
                        f("adv"), f("mask"), cfg, num_items=num_items, entropies_NT=entropies)
  (loss, metrics), (grad, d_entropy) = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(
      f("logps"), f("entropy"))
  metrics = {k: float(v[0] / jnp.maximum(v[1], 1.0)) if isinstance(v, tuple) else float(v)
             for k, v in metrics.items()}
  return float(loss), np.asarray(grad), np.asarray(d_entropy), metrics


def _close_grad(got, want):
  # Gradients are as small as 1 / (N * max_completion_length): the absolute tolerance scales.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * max(np.abs(want).max(), 1e-30))


def check_equal(x, cfg, **kw):
  """Loss, gradients (with respect to the log-probs and the entropies) and every metric TRL
  logs: equal. Returns TRL's metrics."""
  on_policy = kw.pop("on_policy", False)
  want_loss, want_grad, want_dh, want = trl_grpo(x, cfg, on_policy=on_policy, **kw)
  got_loss, got_grad, got_dh, got = ours(x, cfg, on_policy=on_policy, num_items=_normaliser(**kw))
  np.testing.assert_allclose(got_loss, want_loss, **TOL)
  _close_grad(got_grad, want_grad)
  _close_grad(got_dh, want_dh)
  assert set(got) == set(want), (sorted(got), sorted(want))
  for k in want:
    np.testing.assert_allclose(got[k], want[k], **TOL, err_msg=k)
  return want


def misses(x, wrong, right, **kw):
  """A negative control: our loss under the `wrong` config against TRL's under the `right` one
  misses check_equal's bound on the loss or the gradient by 100 times."""
  on_policy = kw.pop("on_policy", False)
  want_loss, want_grad, _, _ = trl_grpo(x, right, on_policy=on_policy, **kw)
  got_loss, got_grad, _, _ = ours(x, wrong, on_policy=on_policy, num_items=_normaliser(**kw))
  loss_off = abs(got_loss - want_loss) / (TOL["atol"] + TOL["rtol"] * abs(want_loss))
  grad_off = (np.abs(got_grad - want_grad)
              / (1e-6 * np.abs(want_grad).max() + 1e-5 * np.abs(want_grad))).max()
  assert max(loss_off, grad_off) > 100, (loss_off, grad_off)


def _normaliser(num_items=None, grad_accum=1, steps_per_generation=1):
  """Our `num_items` for TRL's dapo normaliser (one process, training mode)."""
  if num_items is None:
    return None
  return max(num_items, 1.0) * grad_accum / steps_per_generation


# --- the loss -------------------------------------------------------------------------------------

# Each loss type's own hyperparameters, off TRL's defaults so that one swapped or ignored shows:
# cispo's cap on the ratio (TRL's epsilon_high, eps_max) where the ratios cross it.
OWN = {"cispo": dict(grpo_epsilon_high=1.1),
       "sapo": dict(sapo_temperature_neg=1.6, sapo_temperature_pos=0.7),
       "vespo": dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5,
                     vespo_lambda_neg=1.5)}
CLIP_FIELDS = ("grpo_epsilon", "grpo_epsilon_high", "grpo_delta")
NEW_TYPES = ("cispo", "sapo", "luspo", "vespo")


def loss_cfg(loss_type, **kw):
  """A GRPOConfig of `loss_type` with its OWN hyperparameters; the clip's fields of `kw` only
  where the loss type reads them (elsewhere the config refuses them)."""
  reads_clip = loss_type in pg.CLIPPED + ("cispo",)
  kw = {k: v for k, v in kw.items() if reads_clip or k not in CLIP_FIELDS}
  return pg.GRPOConfig(grpo_loss_type=loss_type, **{**kw, **OWN.get(loss_type, {})})


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", pg.LOSS_TYPES)
def test_loss_gradient_metrics_equal_trl(loss_type, beta):
  """num_iterations > 1: the old log-probs differ from the policy's, clipping active on both
  sides, asymmetric (DAPO's clip-higher); with and without the KL term; every loss type."""
  x = make_inputs(pg.LOSS_TYPES.index(loss_type) + int(100 * beta))
  cfg = loss_cfg(loss_type, grpo_beta=beta, grpo_epsilon=0.2, grpo_epsilon_high=0.28,
                 max_completion_length=T + 4)
  want = check_equal(x, cfg)
  if loss_type in pg.CLIPPED:
    assert want["clip_ratio/low_mean"] > 0.02 and want["clip_ratio/high_mean"] > 0.02
  assert ("kl" in want) == (beta > 0)
  assert want["entropy"] > 0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_new_loss_types_equal_trl(loss_type, level):
  """cispo, sapo, luspo, vespo with their own hyperparameters, at either importance-sampling
  level, with the KL term and an empty completion: loss, gradient and their metrics
  (cispo_clip_ratio, vespo/phi_seq_mean) equal TRL's; the ratio's clip and the soft gate both
  active."""
  x = make_inputs(200 + NEW_TYPES.index(loss_type) + 10 * (level == "sequence"), empty=True)
  if level == "sequence":  # one ratio a completion, spread about 1 as the tokens' are
    x["old"] = x["logps"] + (x["old"] - x["logps"]).mean(-1, keepdims=True) * 4
  cfg = loss_cfg(loss_type, grpo_beta=0.04, importance_sampling_level=level)
  want = check_equal(x, cfg)
  if loss_type == "cispo":
    assert 0.05 < want["cispo_clip_ratio"] < 0.95
  if loss_type == "vespo":
    assert 0 < want["vespo/phi_seq_mean"]


# A misreading of each new loss type that TRL's numbers must tell apart from the right one.
WRONG = {
    "cispo": lambda c: dataclasses.replace(c, grpo_epsilon_high=1 + c.grpo_epsilon_high),  # 1+eps
    "sapo": lambda c: dataclasses.replace(c, sapo_temperature_neg=c.sapo_temperature_pos,
                                          sapo_temperature_pos=c.sapo_temperature_neg),
    "luspo": lambda c: dataclasses.replace(c, grpo_loss_type="grpo"),  # token mean, not sum
    "vespo": lambda c: dataclasses.replace(c, vespo_k_pos=c.vespo_k_neg, vespo_k_neg=c.vespo_k_pos,
                                           vespo_lambda_pos=c.vespo_lambda_neg,
                                           vespo_lambda_neg=c.vespo_lambda_pos),
}


@pytest.mark.parametrize("loss_type", NEW_TYPES)
def test_new_loss_types_negative_controls(loss_type):
  """cispo's cap read as 1 + epsilon_high, sapo's temperatures or vespo's k and lambda swapped
  between the advantage signs, luspo's sums averaged: each misses TRL's loss or gradient by 100x
  the bound the right one meets."""
  x = make_inputs(250 + NEW_TYPES.index(loss_type))
  right = loss_cfg(loss_type, grpo_beta=0.04)
  check_equal(x, right)
  misses(x, WRONG[loss_type](right), right)


def _kl_old(x):
  """Each completion's mean token KL(pi_old || pi), TRL's off-policy statistic, [N]."""
  n = np.maximum(x["mask"].sum(-1), 1)
  return ((x["old"] - x["logps"]) * x["mask"]).sum(-1) / n


@pytest.mark.parametrize("loss_type", pg.LOSS_TYPES)
def test_off_policy_mask_equals_trl(loss_type):
  """--off_policy_mask_threshold between the negative-advantage completions' KLs (some dropped,
  some kept): TRL's get_off_policy_mask, for every loss type; off, the loss misses TRL's."""
  x = make_inputs(300 + pg.LOSS_TYPES.index(loss_type))
  x["old"] = x["old"] + 0.3  # KL(pi_old || pi) positive
  kl = _kl_old(x)[x["adv"] < 0]
  threshold = float(np.median(kl))
  assert (kl > threshold).any() and (kl <= threshold).any()
  cfg = loss_cfg(loss_type, off_policy_mask_threshold=threshold, grpo_beta=0.02)
  check_equal(x, cfg)
  misses(x, dataclasses.replace(cfg, off_policy_mask_threshold=0.0), cfg)
  check_equal(x, cfg, on_policy=True)  # on-policy: KL 0, nothing dropped


@pytest.mark.parametrize("quantile", [1.0, 0.3])
@pytest.mark.parametrize("loss_type", pg.LOSS_TYPES)
def test_entropy_coef_equals_trl(loss_type, quantile):
  """--entropy_coef: the mean entropy over the tokens the policy term acts on (the high-entropy
  ones with top_entropy_quantile < 1), subtracted whatever the loss type's normaliser; loss,
  gradient with respect to the log-probs and the entropies, policy_loss and entropy_coef equal
  TRL's. The sign flipped misses."""
  x = make_inputs(400 + pg.LOSS_TYPES.index(loss_type) + int(10 * quantile), empty=True)
  cfg = loss_cfg(loss_type, entropy_coef=0.05, top_entropy_quantile=quantile, grpo_beta=0.02)
  want = check_equal(x, cfg)
  assert want["entropy_coef"] == pytest.approx(0.05) and "policy_loss" in want
  misses(x, dataclasses.replace(cfg, entropy_coef=-0.05), cfg)


def test_token_entropy_is_trls_entropy_from_logits():
  """The entropy of the distribution that scores token t, the logits at t - 1 (TRL's
  completion logits): trl.trainer.utils.entropy_from_logits; unshifted it misses."""
  from trl.trainer.utils import entropy_from_logits
  logits = np.random.default_rng(5).normal(0, 2, (3, 9, 17)).astype(np.float32)
  want = entropy_from_logits(torch.from_numpy(logits[:, :-1])).numpy()
  got = np.asarray(pg.token_entropy(jnp.asarray(logits)))
  np.testing.assert_allclose(got[:, 1:], want, **TOL)
  assert (got[:, 0] == 0).all()
  assert np.abs(got[:, :-1] - want).max() > 100 * (TOL["atol"] + TOL["rtol"] * want.max())


@pytest.mark.parametrize("loss_type", pg.LOSS_TYPES)
def test_on_policy_old_logps_none(loss_type):
  """num_iterations = 1: TRL takes the policy's own log-probs, detached (ratio 1, gradient A)."""
  cfg = pg.GRPOConfig(grpo_loss_type=loss_type, grpo_beta=0.1)
  want = check_equal(make_inputs(10), cfg, on_policy=True)
  assert want.get("clip_ratio/region_mean", 0) == 0


@pytest.mark.parametrize("loss_type", pg.LOSS_TYPES)
def test_sequence_level_importance_sampling(loss_type):
  """GSPO's one ratio per completion, with the KL term (broadcast over tokens) and an empty
  completion (TRL counts it among the completions in the clip metrics)."""
  x = make_inputs(20, empty=True)
  x["old"] = x["logps"] + (x["old"] - x["logps"]).mean(-1, keepdims=True) * 2  # ratios off 1
  cfg = loss_cfg(loss_type, importance_sampling_level="sequence", grpo_beta=0.05,
                 grpo_epsilon_high=0.28)
  want = check_equal(x, cfg)
  assert loss_type not in pg.CLIPPED or want["clip_ratio/region_mean"] > 0


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


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
@pytest.mark.parametrize("num_items,grad_accum,steps_per_generation", [
    (300.0, 1, 1), (500.0, 2, 4), (0.0, 1, 1)])
def test_dapo_normaliser_spans_the_generation_batch(num_items, grad_accum, steps_per_generation,
                                                    loss_type):
  """TRL's dapo (and cispo, vespo) divide by the generation batch's active tokens per
  accumulation window, num_items_in_batch * gradient_accumulation_steps / steps_per_generation:
  our num_items."""
  cfg = loss_cfg(loss_type, grpo_beta=0.04)
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
  with pytest.raises(ValueError, match="--entropy_coef=0.1: grpo_loss needs entropies_NT"):
    pg.grpo_loss(*args, None, jnp.asarray(x["adv"]), jnp.asarray(x["mask"]),
                 pg.GRPOConfig(entropy_coef=0.1))


# --- rewards and advantages -----------------------------------------------------------------------

def _trl_reward_lines():
  """TRL 1.16 `GRPOTrainer._generate_and_score_completions`, from `unscorable_mask = ...` to the
  line that logs `frac_reward_zero_std`: the weighted sum of the reward functions, the group
  advantages (multi_objective_aggregation "sum_then_normalize"), their nan_to_num and the logged
  reward metrics, compiled from the installed source (TRL does not factor them into a function)."""
  lines = inspect.getsource(trl_grpo_trainer.GRPOTrainer._generate_and_score_completions)
  lines = lines.splitlines()
  first = next(i for i, l in enumerate(lines) if "unscorable_mask = torch.isnan" in l)
  last = next(i for i, l in enumerate(lines) if '["frac_reward_zero_std"].append' in l)
  return compile(textwrap.dedent("\n".join(lines[first:last + 1])), trl_grpo_trainer.__file__,
                 "exec")


TRL_REWARD_LINES = _trl_reward_lines()


def trl_rewards(rewards_NF, weights, scale_rewards, num_generations,
                aggregation="sum_then_normalize"):
  """(rewards [N], advantages [N], logged metrics) of TRL's own lines on [N, F] rewards of each
  reward function (NaN: the function returned None), one process, mode "train"."""
  F = rewards_NF.shape[1]
  trainer = types.SimpleNamespace(
      multi_objective_aggregation=aggregation, scale_rewards=scale_rewards,
      reward_weights=torch.tensor(list(weights or [1.0] * F), dtype=torch.float32),
      reward_funcs=[None] * F, reward_func_names=[f"f{i}" for i in range(F)],
      accelerator=types.SimpleNamespace(process_index=0),
      _metrics={"train": collections.defaultdict(list)})
  scope = {**vars(trl_grpo_trainer), "self": trainer, "rewards_per_func": rewards_NF.clone(),
           "num_generations": num_generations, "device": "cpu", "mode": "train",
           "prompts": [None] * len(rewards_NF)}
  exec(TRL_REWARD_LINES, scope)
  metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
  return scope["rewards"].numpy(), scope["advantages"].numpy(), metrics


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


def _trl(r_BGF, weights, scale_rewards="group", aggregation="sum_then_normalize"):
  """trl_rewards on [B, G, F] rewards (row-major: prompt b's G completions together, TRL's)."""
  B_, G_, F = r_BGF.shape
  return trl_rewards(torch.from_numpy(r_BGF.reshape(B_ * G_, F)), weights, scale_rewards, G_,
                     aggregation)


@pytest.mark.parametrize("weights", [(), (1.0, 0.5, -2.0)])
def test_weighted_rewards_equal_trl(weights):
  r = rewards_with_none(0)
  want = _trl(r, weights)[0]
  got = np.asarray(pg.weighted_rewards(jnp.asarray(r), weights)).reshape(N)
  np.testing.assert_allclose(got, want, **TOL)
  assert np.isnan(got[G - 1]) and np.isnan(want[G - 1])


@pytest.mark.parametrize("generations", [G, 1])
@pytest.mark.parametrize("scale_rewards", pg.SCALE_REWARDS)
def test_group_advantages_equal_trl(scale_rewards, generations):
  r_BGF, weights = rewards_with_none(1, generations=generations), (1.0, 0.5, 2.0)
  want = _trl(r_BGF, weights, scale_rewards)[1]
  r = pg.weighted_rewards(jnp.asarray(r_BGF), weights)
  got = np.asarray(pg.group_advantages(r, scale_rewards)).reshape(-1)
  np.testing.assert_allclose(got, want, **TOL)
  assert np.isfinite(got).all()
  cfg = pg.GRPOConfig(scale_rewards=scale_rewards, reward_weights=weights)
  np.testing.assert_allclose(np.asarray(pg.advantages(jnp.asarray(r_BGF), cfg)[0]).reshape(-1),
                             want, **TOL)


@pytest.mark.parametrize("generations", [G, 2, 1])
@pytest.mark.parametrize("weights", [(), (1.0, 0.5, -2.0)])
def test_normalize_then_sum_equals_trl(weights, generations):
  """--multi_objective_aggregation=normalize_then_sum (GDPO): TRL's branch of the same lines on
  rewards with None (a function's own, and a completion no function scored); advantages and
  frac_reward_zero_std equal. TRL's default aggregation misses on the same rewards."""
  r_BGF = rewards_with_none(5, generations=generations)
  _, want, metrics = _trl(r_BGF, weights, "group", "normalize_then_sum")
  cfg = pg.GRPOConfig(multi_objective_aggregation="normalize_then_sum", reward_weights=weights)
  adv, frac = pg.advantages(jnp.asarray(r_BGF), cfg)
  np.testing.assert_allclose(np.asarray(adv).reshape(-1), want, **TOL)
  assert float(frac) == pytest.approx(metrics["frac_reward_zero_std"], abs=1e-7)
  if generations > 1:
    summed = dataclasses.replace(cfg, multi_objective_aggregation="sum_then_normalize")
    wrong = np.asarray(pg.advantages(jnp.asarray(r_BGF), summed)[0]).reshape(-1)
    assert np.abs(wrong - want).max() > 100 * (TOL["atol"] + TOL["rtol"] * np.abs(want).max())


def test_a_single_function_may_return_none():
  """One reward function (F = 1) returning None for some completions: TRL's lines score them NaN
  and give them advantage 0, leave them out of their group's mean and std, and log the reward
  over the others; ours equal, by either aggregation."""
  rng = np.random.default_rng(6)
  r_BGF = rng.normal(0, 1, (B, G, 1)).astype(np.float32)
  r_BGF[0, 1] = r_BGF[2, 0] = r_BGF[2, 3] = np.nan
  for aggregation in pg.AGGREGATIONS:
    rewards, want, metrics = _trl(r_BGF, (), "group", aggregation)
    cfg = pg.GRPOConfig(multi_objective_aggregation=aggregation)
    adv, frac = pg.advantages(jnp.asarray(r_BGF), cfg)
    np.testing.assert_allclose(np.asarray(adv).reshape(-1), want, **TOL)
    assert float(frac) == pytest.approx(metrics["frac_reward_zero_std"], abs=1e-7)
    assert (want[[1, 2 * G, 2 * G + 3]] == 0).all() and (want != 0).sum() == N - 3
  np.testing.assert_allclose(np.asarray(pg.weighted_rewards(jnp.asarray(r_BGF))).reshape(-1),
                             rewards, **TOL)


def _tied_rewards():
  """[4, 4, 3] rewards of several functions: group 2 tied (the same rewards for each of its
  completions), group 1 with one scorable completion (its std NaN), None elsewhere."""
  r = rewards_with_none(3)
  r[2] = np.array([0.5, 1.0, -1.0], np.float32)
  return r


ZERO_STD_CASES = {
    "one tied group of two": np.array([[[1.0], [1.0]], [[0.0], [2.0]]], np.float32),
    "a tied group among others, None": _tied_rewards(),
    "every reward tied": np.full((3, 2, 1), 0.7, np.float32),
    "one completion a prompt": rewards_with_none(4, generations=1),
}


@pytest.mark.parametrize("scale_rewards", pg.SCALE_REWARDS)
@pytest.mark.parametrize("case", ZERO_STD_CASES)
def test_frac_reward_zero_std_equals_trl(case, scale_rewards):
  """TRL logs the fraction of completions whose std_rewards is 0: the std it scaled by (the
  batch's under batch), each group's under none."""
  r_BGF = ZERO_STD_CASES[case]
  want = _trl(r_BGF, (), scale_rewards)[2]["frac_reward_zero_std"]
  got = pg.frac_reward_zero_std(pg.weighted_rewards(jnp.asarray(r_BGF)), scale_rewards)
  assert float(got) == pytest.approx(want, abs=1e-7)
  cfg = pg.GRPOConfig(scale_rewards=scale_rewards)
  assert float(pg.advantages(jnp.asarray(r_BGF), cfg)[1]) == pytest.approx(want, abs=1e-7)


@pytest.mark.parametrize("case", ZERO_STD_CASES)
def test_frac_reward_zero_std_under_normalize_then_sum_equals_trl(case):
  """normalize_then_sum: the batch's std of the normalised sum, as TRL's."""
  r_BGF = ZERO_STD_CASES[case]
  want = _trl(r_BGF, (), "group", "normalize_then_sum")[2]["frac_reward_zero_std"]
  cfg = pg.GRPOConfig(multi_objective_aggregation="normalize_then_sum")
  assert float(pg.advantages(jnp.asarray(r_BGF), cfg)[1]) == pytest.approx(want, abs=1e-7)


def test_frac_reward_zero_std_under_batch_is_not_each_groups():
  """One tied group of two among two: TRL logs 0.0 under batch scaling (the batch's std is not 0)
  and 0.5 under group and none. Each group's std under batch scaling, the rule before, logs 0.5:
  the oracle tells the two apart."""
  r_BGF = ZERO_STD_CASES["one tied group of two"]
  want = {s: _trl(r_BGF, (), s)[2]["frac_reward_zero_std"] for s in pg.SCALE_REWARDS}
  assert want == {"group": 0.5, "batch": 0.0, "none": 0.5}
  r_BG = pg.weighted_rewards(jnp.asarray(r_BGF))
  each_groups = float(jnp.isclose(pg.reward_std(r_BG, "group"), 0.0).mean())
  assert each_groups == 0.5 != want["batch"]
  assert float(pg.frac_reward_zero_std(r_BG, "batch")) == want["batch"]


def test_group_advantages_std_is_unbiased():
  """torch.std's default, Bessel's correction: rewards 0 and 2 have std sqrt(2), not 1."""
  a = pg.group_advantages(jnp.asarray([[0.0, 2.0]]), "group")
  np.testing.assert_allclose(np.asarray(a), [[-1 / (2 ** 0.5 + 1e-4), 1 / (2 ** 0.5 + 1e-4)]],
                             **TOL)


# --- the config section ---------------------------------------------------------------------------

TRL_NAMES = {"grpo_beta": "beta", "grpo_epsilon": "epsilon", "grpo_epsilon_high": "epsilon_high",
             "grpo_delta": "delta", "grpo_loss_type": "loss_type"}
NOT_TRLS = ("dynamic_sampling", "dynamic_sampling_max_batches")  # DAPO's dynamic sampling


def test_config_defaults_are_trls():
  """Each field's default is TRL 1.16 GRPOConfig's (TRL's None is our 0; its reward_weights None
  our empty tuple), and the docstring or help names the TRL counterpart."""
  trl_config = pytest.importorskip("trl.trainer.grpo_config")
  trl_defaults = {f.name: f.default for f in dataclasses.fields(trl_config.GRPOConfig)}
  for f in dataclasses.fields(pg.GRPOConfig):
    if f.name in NOT_TRLS:  # TRL 1.16 has none; off by default, the paper's name in the help
      assert f.name not in trl_defaults and "DAPO" in f.metadata["help"], f.name
      assert f.default in (False, 4), f.name
      continue
    trl_name = TRL_NAMES.get(f.name, f.name)
    want = trl_defaults[trl_name]
    want = {None: 0.0 if f.type == "float" else ()}.get(want, want)
    assert f.default == want, (f.name, f.default, want)
    assert f"TRL's {trl_name}" in f.metadata["help"], f.name


@pytest.mark.parametrize("field,value,message", [
    ("grpo_loss_type", "ppo", "--grpo_loss_type='ppo': must be grpo, bnpo, dr_grpo, dapo, cispo, "
                              "sapo, luspo or vespo"),
    ("scale_rewards", "yes", "--scale_rewards='yes': must be group, batch or none"),
    ("sapo_temperature_neg", 0.0, "--sapo_temperature_neg=0.0: must be a finite number > 0"),
    ("vespo_k_pos", -1.0, "--vespo_k_pos=-1.0: must be a finite number >= 0"),
    ("entropy_coef", float("inf"), "--entropy_coef=inf: must be a finite number"),
    ("off_policy_mask_threshold", -0.5, "--off_policy_mask_threshold=-0.5: must be 0 (off) or a "
                                        "finite number > 0"),
    ("multi_objective_aggregation", "sum", "--multi_objective_aggregation='sum': must be "
                                           "sum_then_normalize or normalize_then_sum"),
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


@pytest.mark.parametrize("kw,message", [
    (dict(sapo_temperature_pos=2.0), "--sapo_temperature_pos=2.0: must go with --grpo_loss_type="
                                     "sapo (read only there), not dapo"),
    (dict(grpo_loss_type="cispo", vespo_lambda_neg=1.0), "--vespo_lambda_neg=1.0: must go with "
                                                         "--grpo_loss_type=vespo"),
    (dict(grpo_loss_type="sapo", grpo_epsilon_high=0.28), "--grpo_epsilon_high=0.28: must go with "
                                                          "--grpo_loss_type=grpo or bnpo"),
    (dict(grpo_loss_type="vespo", grpo_epsilon=0.1), "--grpo_epsilon=0.1: must go with "),
    (dict(grpo_loss_type="cispo", grpo_delta=2.0), "--grpo_delta=2.0: must go with "
                                                   "--grpo_loss_type=grpo or bnpo or dr_grpo or "
                                                   "dapo or luspo (read only there), not cispo"),
    (dict(multi_objective_aggregation="normalize_then_sum", scale_rewards="batch"),
     "--scale_rewards='batch': must go with --multi_objective_aggregation=sum_then_normalize"),
])
def test_flags_nothing_reads_are_refused(kw, message):
  """A loss type's own hyperparameter under another loss type, the clip's under sapo or vespo,
  --scale_rewards under normalize_then_sum: nothing would read them; one line naming the flag."""
  with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as e:
    pg.GRPOConfig(**kw)
  assert "\n" not in str(e.value)


def _trl_scale_rewards_line():
  """TRL 1.16 GRPOConfig.__post_init__'s line that reads scale_rewards' bools, compiled."""
  trl_config = pytest.importorskip("trl.trainer.grpo_config")
  line = next(l for l in inspect.getsource(trl_config.GRPOConfig.__post_init__).splitlines()
              if "self.scale_rewards = {True" in l)
  return compile(line.strip(), trl_config.__file__, "exec")


@pytest.mark.parametrize("given", [True, False, "group", "batch", "none"])
def test_scale_rewards_spellings_are_trls(given):
  """TRL's True / False (as values, and as the flag's text "True" / "False") mean what TRL's
  GRPOConfig makes of them; a spelling TRL has no meaning for is refused."""
  trl = types.SimpleNamespace(scale_rewards=given)
  exec(_trl_scale_rewards_line(), {"self": trl})
  assert pg.GRPOConfig(scale_rewards=given).scale_rewards == trl.scale_rewards
  assert pg.GRPOConfig(scale_rewards=str(given)).scale_rewards == trl.scale_rewards
  with pytest.raises(ValueError, match="--scale_rewards='1': must be group, batch or none"):
    pg.GRPOConfig(scale_rewards="1")


def test_epsilon_high_zero_is_epsilon():
  assert pg.GRPOConfig(grpo_epsilon=0.1).epsilon_high == 0.1
  assert pg.GRPOConfig(grpo_epsilon=0.1, grpo_epsilon_high=0.3).epsilon_high == 0.3


# --- the log-probs' temperature -------------------------------------------------------------------

def test_logps_and_entropies_at_the_samplers_temperature_are_trls(tmp_path):
  """GRPO and RLOO score their samples at the sampler's temperature, as TRL does: TRL's own
  fused LM head (`add_fused_lm_head`, the one GRPOTrainer and RLOOTrainer install with
  args.temperature) on a random transformers Llama gives the per-token log-probs and entropies
  that logprobs.score and token_entropy give at that temperature on the same weights; at T = 1
  they differ (the negative control)."""
  transformers = pytest.importorskip("transformers")
  from trl.trainer.utils import add_fused_lm_head
  from dpo import logprobs
  from dpo.algorithms import grpo
  from dpo.batches import Rows
  from models import hf, sharding
  import configs

  config = transformers.LlamaConfig(
      vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
      tie_word_embeddings=False)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")
  model = model.float().eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.3 * torch.randn_like(p))
  model.save_pretrained(tmp_path)
  cfg, params = hf.load(str(tmp_path), sharding.make_mesh("data:1", jax.devices()[:1]))
  temperature = 0.7
  add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))

  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 96, (3, 16)).astype(np.int32)
  prompt = np.array([4, 6, 9])  # each row's prompt length; the rest is its completion
  mask = (np.arange(16) >= prompt[:, None]).astype(np.float32)
  labels = torch.tensor(np.where(mask > 0, tokens, -100), dtype=torch.long)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long), labels=labels,
                fused_lm_head=True)
  trl_logps, trl_entropy = out.log_probs.numpy(), out.entropy.numpy()  # [B, T - 1], shifted
  scored = mask[:, 1:] > 0
  rows = Rows(tokens, np.tile(np.arange(16, dtype=np.int32), (3, 1)),
              np.ones_like(tokens), mask)

  def ours(t):
    s = logprobs.score(cfg, params, rows, with_logits=True, temperature=t)
    return np.asarray(s.logps)[:, 1:], np.asarray(pg.token_entropy(s.logits))[:, 1:]

  logps, entropy = ours(temperature)
  np.testing.assert_allclose(logps[scored], trl_logps[scored], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(entropy[scored], trl_entropy[scored], rtol=1e-4, atol=1e-4)
  plain, _ = ours(1.0)
  assert np.abs(plain[scored] - trl_logps[scored]).max() > 1e-2
  # The stage's steps read the sampler's temperature; greedy samples are scored at 1.
  run = configs.DEFAULT.replace(stage="sft,grpo", online_temperature=0.7)
  assert grpo.step_config(run).temperature == 0.7
  assert grpo.temperature(run.replace(online_temperature=0.0)) == 1.0

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


def trl_rewards(rewards_NF, weights, scale_rewards, num_generations):
  """(rewards [N], advantages [N], logged metrics) of TRL's own lines on [N, F] rewards of each
  reward function (NaN: the function returned None), one process, mode "train"."""
  F = rewards_NF.shape[1]
  trainer = types.SimpleNamespace(
      multi_objective_aggregation="sum_then_normalize", scale_rewards=scale_rewards,
      reward_weights=torch.tensor(list(weights or [1.0] * F), dtype=torch.float32),
      reward_func_names=[f"f{i}" for i in range(F)],
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


def _trl(r_BGF, weights, scale_rewards="group"):
  """trl_rewards on [B, G, F] rewards (row-major: prompt b's G completions together, TRL's)."""
  B_, G_, F = r_BGF.shape
  return trl_rewards(torch.from_numpy(r_BGF.reshape(B_ * G_, F)), weights, scale_rewards, G_)


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

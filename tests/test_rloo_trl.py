"""dpo/policy_gradient.py's RLOO and dpo/algorithms/rloo.py against TRL 1.16's RLOOTrainer, the
oracle users compare with.

The loss: the same per-token log-probs of the policy, summed old log-probs, advantages and
completion masks go into TRL's `RLOOTrainer._compute_loss` (the trainer built with
`object.__new__` and the attributes it reads, its `_get_per_token_logps_and_entropies` replaced
by one that returns the given log-probs and entropies as leaf tensors, as tests/test_grpo_trl.py
does) and into `rloo_loss`: loss, the gradient with respect to the log-probs (torch autograd
against jax.grad) and every metric TRL logs. The advantages: TRL's own lines of
`_generate_and_score_completions` from the unscorable mask to the logged
`frac_reward_zero_std` (inline there, not a function TRL factors out), compiled from the
installed source, run on the rewards of each reward function and the sampling policy's and the
reference's per-token log-probs; ours are `rloo.Generated.generation`, the stage's own code, on
the same arrays in the stage's row layout. Each has a negative control that misses the bound.
"""

import collections
import dataclasses
import functools
import inspect
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl_rloo_trainer = pytest.importorskip("trl.trainer.rloo_trainer")

from dpo import judges  # noqa: E402
from dpo import policy_gradient as pg  # noqa: E402
from dpo.algorithms import grpo, rloo  # noqa: E402

T = 12  # completion slots
TOL = dict(rtol=1e-5, atol=1e-6)


def make_inputs(seed, n, empty=False):
  """Per-token log-probs of the policy, the sampling (old) policy and the reference [N, T] (the
  old ones far enough from the policy that the sequence ratio leaves [0.8, 1.2] on both sides),
  advantages of both signs [N], completion masks of varied lengths [N, T] (one completion empty
  with `empty`), per-token entropies. Padding slots hold finite values, as a model gives them."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, T + 1, n)
  if empty:
    lengths[3] = 0
  mask = (np.arange(T) < lengths[:, None]).astype(np.int64)
  logps = rng.uniform(-3.0, -0.05, (n, T)).astype(np.float32)
  f32 = lambda a: a.astype(np.float32)
  shift_N1 = rng.normal(0, 0.4, (n, 1)) / np.maximum(lengths[:, None], 1)  # a sequence's log-ratio
  return dict(logps=logps, old=f32(logps + shift_N1 + rng.normal(0, 0.05, (n, T))),
              ref=f32(logps + rng.normal(0, 0.3, (n, T))), adv=f32(rng.normal(0, 1, n)),
              mask=mask, entropy=f32(rng.uniform(0.0, 3.0, (n, T))))


# --- the loss -------------------------------------------------------------------------------------

class _Accelerator:
  num_processes = 1
  process_index = 0
  device = torch.device("cpu")
  gather = staticmethod(lambda t: t)
  reduce = staticmethod(lambda t, reduction="sum": t)


def trl_loss(x, cfg):
  """(loss, d loss / d logps [N, T], metrics) of TRL's `RLOOTrainer._compute_loss`, its
  attributes set from our config as TRL's __init__ sets them from its RLOOConfig."""
  t = object.__new__(trl_rloo_trainer.RLOOTrainer)
  logps = torch.tensor(x["logps"], requires_grad=True)
  t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.tensor(x["entropy"]), None)
  t.__dict__.update(model=types.SimpleNamespace(training=True), accelerator=_Accelerator(),
                    epsilon_low=cfg.rloo_epsilon,
                    epsilon_high=cfg.rloo_epsilon_high if cfg.rloo_epsilon_high else cfg.rloo_epsilon,
                    aux_loss_enabled=False, _metrics={"train": collections.defaultdict(list)})
  mask = torch.from_numpy(x["mask"])
  n = len(mask)
  inputs = {"prompt_ids": torch.zeros(n, 2, dtype=torch.long),
            "prompt_mask": torch.ones(n, 2, dtype=torch.long),
            "completion_ids": torch.zeros(n, T, dtype=torch.long), "completion_mask": mask,
            "old_logps": (torch.tensor(x["old"]) * mask).sum(1),
            "advantages": torch.tensor(x["adv"])}
  loss = t._compute_loss(None, inputs)
  loss.backward()
  return float(loss.detach()), logps.grad.numpy(), {k: v[-1] for k, v in t._metrics["train"].items()}


def ours_loss(x, cfg, loss=pg.rloo_loss):
  """(loss, d loss / d logps, metrics with (sum, count) pairs divided as train.accumulate does)."""
  f = lambda k: jnp.asarray(x[k])
  old_N = (f("old") * f("mask")).sum(-1)
  loss_fn = lambda logps: loss(logps, old_N, f("adv"), f("mask"), cfg, entropies_NT=f("entropy"))
  (value, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(f("logps"))
  metrics = {k: float(v[0] / jnp.maximum(v[1], 1.0)) if isinstance(v, tuple) else float(v)
             for k, v in metrics.items()}
  return float(value), np.asarray(grad), metrics


def _close_grad(got, want):
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * max(np.abs(want).max(), 1e-30))


def _off(got_loss, got_grad, want_loss, want_grad) -> float:
  """How many times the loss and gradient bounds `got` misses `want` by (the larger)."""
  loss_off = abs(got_loss - want_loss) / (TOL["atol"] + TOL["rtol"] * abs(want_loss))
  grad_off = (np.abs(got_grad - want_grad)
              / (1e-6 * np.abs(want_grad).max() + 1e-5 * np.abs(want_grad))).max()
  return max(loss_off, grad_off)


@pytest.mark.parametrize("epsilon_high", [0.0, 0.28])
@pytest.mark.parametrize("n,empty", [(8, False), (12, True), (32, True)])
def test_loss_gradient_metrics_equal_trl(n, empty, epsilon_high):
  """Old log-probs off the policy's (rloo_num_iterations > 1), the clip active (on both sides in
  the largest case), symmetric and asymmetric, with and without an empty completion: loss, gradient and every
  metric TRL logs (entropy, clip_ratio/*) equal."""
  x = make_inputs(n + int(100 * epsilon_high), n, empty)
  cfg = pg.RLOOConfig(rloo_epsilon_high=epsilon_high)
  want_loss, want_grad, want = trl_loss(x, cfg)
  got_loss, got_grad, got = ours_loss(x, cfg)
  np.testing.assert_allclose(got_loss, want_loss, **TOL)
  _close_grad(got_grad, want_grad)
  assert set(got) == set(want), (sorted(got), sorted(want))
  for k in want:
    np.testing.assert_allclose(got[k], want[k], **TOL, err_msg=k)
  assert want["clip_ratio/region_mean"] > 0
  if n == 32:
    assert want["clip_ratio/low_mean"] > 0 and want["clip_ratio/high_mean"] > 0
  if empty:
    assert np.abs(want_grad[3]).max() == 0.0


def test_loss_on_policy_is_the_advantage_weighted_log_prob():
  """Old log-probs equal to the policy's (the first update of a generation batch): no clipping,
  and the gradient is REINFORCE's, -A_i / N on each of completion i's tokens, as TRL's."""
  x = make_inputs(7, 8)
  x["old"] = x["logps"]
  cfg = pg.RLOOConfig()
  want_loss, want_grad, want = trl_loss(x, cfg)
  got_loss, got_grad, _ = ours_loss(x, cfg)
  np.testing.assert_allclose(got_loss, want_loss, **TOL)
  _close_grad(got_grad, want_grad)
  np.testing.assert_allclose(got_grad, -x["adv"][:, None] * x["mask"] / 8, rtol=1e-5, atol=1e-7)
  assert want["clip_ratio/region_mean"] == 0.0


def test_loss_negative_control_token_level_ratio():
  """GRPO's clipped loss (a ratio per token, each completion's token mean) on the same arrays
  misses TRL's RLOO loss or gradient by 100 times the bound: the ratio is the sequence's."""
  x = make_inputs(11, 12, empty=True)
  cfg = pg.RLOOConfig()
  want_loss, want_grad, _ = trl_loss(x, cfg)
  gcfg = pg.GRPOConfig(grpo_loss_type="grpo")
  f = lambda k: jnp.asarray(x[k])
  loss_fn = lambda logps: pg.grpo_loss(logps, f("old"), None, f("adv"), f("mask"), gcfg)[0]
  got_loss, got_grad = jax.value_and_grad(loss_fn)(f("logps"))
  assert _off(float(got_loss), np.asarray(got_grad), want_loss, want_grad) > 100


# --- rewards, the KL penalty and the advantages --------------------------------------------------

def _trl_advantage_lines():
  """TRL 1.16 `RLOOTrainer._generate_and_score_completions`, from `unscorable_mask = ...` to the
  line that logs `frac_reward_zero_std`: the weighted sum, the reward clip, the KL penalty in the
  reward, the leave-one-out advantages, their normalisation and nan_to_num, and the logged
  metrics, compiled from the installed source."""
  lines = inspect.getsource(trl_rloo_trainer.RLOOTrainer._generate_and_score_completions)
  lines = lines.splitlines()
  first = next(i for i, l in enumerate(lines) if "unscorable_mask = torch.isnan" in l)
  last = next(i for i, l in enumerate(lines) if '["frac_reward_zero_std"].append' in l)
  return compile(textwrap.dedent("\n".join(lines[first:last + 1])), trl_rloo_trainer.__file__,
                 "exec")


TRL_ADVANTAGE_LINES = _trl_advantage_lines()


def trl_advantages(r_BGF, x, cfg, weights=()):
  """(advantages [B * G], logged metrics) of TRL's own lines, one process, mode "train", on
  [B, G, F] rewards (NaN: the function returned None) and per-token log-probs in TRL's layout
  (prompt b's G completions together)."""
  B, G, F = r_BGF.shape
  trainer = types.SimpleNamespace(
      reward_weights=torch.tensor(list(weights or [1.0] * F), dtype=torch.float32),
      reward_clip_range=tuple(cfg.reward_clip_range) or None, beta=cfg.rloo_beta,
      normalize_advantages=cfg.normalize_advantages,
      reward_func_names=[f"f{i}" for i in range(F)], accelerator=_Accelerator(),
      _metrics={"train": collections.defaultdict(list)})
  scope = {**vars(trl_rloo_trainer), "self": trainer, "gather": lambda t: t,
           "rewards_per_func": torch.from_numpy(r_BGF.reshape(B * G, F)).clone(),
           "num_generations": G, "device": "cpu", "mode": "train", "prompts": [None] * B * G,
           "old_per_token_logps": torch.tensor(x["old"]),
           "ref_per_token_logps": torch.tensor(x["ref"]),
           "completion_mask": torch.from_numpy(x["mask"])}
  exec(TRL_ADVANTAGE_LINES, scope)
  return scope["advantages"].numpy(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def ours_advantages(r_BGF, x, cfg, weights=()):
  """(advantages [B * G] in TRL's layout, metrics) of `rloo.Generated.generation`, the stage's
  own code: the rows are [sample 0 of every prompt, sample 1, ...], so TRL's arrays are laid out
  so first; the judge is several reward functions (their per-function metrics are GRPO's
  `rewarded`), sampling and scoring given."""
  B, G, F = r_BGF.shape
  to_rows = lambda a: a.reshape(B, G, *a.shape[1:]).swapaxes(0, 1).reshape(B * G, *a.shape[1:])
  judge = object.__new__(judges.RewardFunctions)
  judge.names = [f"f{i}" for i in range(F)]
  rows = types.SimpleNamespace(loss_mask=to_rows(x["mask"]).astype(np.float32))
  fake = types.SimpleNamespace(
      generations=G, judge=judge,
      cfg=types.SimpleNamespace(grpo=pg.GRPOConfig(reward_weights=tuple(weights)), rloo=cfg),
      scored=lambda batch, comps, score=None: (to_rows(r_BGF.reshape(B * G, F)),
                                               np.ones(B * G, bool)),
      scored_rows=lambda *a: (rows, to_rows(x["old"]), to_rows(x["ref"])))
  fake.rewarded = functools.partial(grpo.Generated.rewarded, fake)
  batch = {"tokens": np.zeros((B, 1), np.int32)}
  out, info = rloo.Generated.generation(fake, None, None, batch, [[1]] * (B * G), None, None)
  adv = out.advantages.reshape(G, B).T.reshape(-1)  # back to TRL's layout
  np.testing.assert_allclose(out.old_logps, (rows.loss_mask * to_rows(x["old"])).sum(-1),
                             rtol=1e-6)
  return adv, {k: v for k, v in info.items() if not k.startswith("completions/")}


def rewards_with_none(seed, groups, generations, functions=2):
  """[groups, generations, F] rewards, NaN where a function returned None: one completion
  unscorable by every function, one group with a single scorable completion."""
  rng = np.random.default_rng(seed)
  r = rng.normal(0, 2, (groups, generations, functions)).astype(np.float32)
  r[rng.random(r.shape) < 0.2] = np.nan
  r[0, -1] = np.nan
  r[1, 1:] = np.nan
  return r


def _check_advantages(r_BGF, x, cfg, weights=()):
  want_adv, want = trl_advantages(r_BGF, x, cfg, weights)
  got_adv, got = ours_advantages(r_BGF, x, cfg, weights)
  np.testing.assert_allclose(got_adv, want_adv, rtol=1e-5, atol=1e-5)
  assert set(got) == set(want), (sorted(got), sorted(want))
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  return want_adv, want


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_advantages_and_metrics_equal_trl(k, beta, normalize):
  """Several k, with and without the KL in the reward, with and without normalisation, an empty
  completion, unscorable completions (NaN, advantage 0) and a group with one scorable member:
  the advantages and every metric TRL logs there (kl, reward, reward_std, frac_reward_zero_std,
  rewards/<function>/mean and /std) equal."""
  B = 4
  r = rewards_with_none(k, B, k)
  x = make_inputs(10 * k, B * k, empty=True)
  cfg = pg.RLOOConfig(rloo_beta=beta, normalize_advantages=normalize, rloo_num_generations=k)
  adv, metrics = _check_advantages(r, x, cfg, weights=(1.0, 0.5))
  assert ("kl" in metrics) == (beta > 0)
  assert (adv.reshape(B, k)[1] == 0).all()  # one scorable member: no baseline
  assert np.abs(adv).max() > 0.1


def test_reward_clip_range_and_ties_equal_trl():
  """--reward_clip_range clamps before the KL penalty; groups tied after clipping log
  frac_reward_zero_std as TRL (over the penalised rewards: ties without the KL only)."""
  B, k = 4, 4
  r = np.random.default_rng(3).normal(0, 2, (B, k, 1)).astype(np.float32)
  r[0] = 5.0  # tied above the clip
  r[2, :2] = -5.0
  x = make_inputs(5, B * k)
  for beta in (0.0, 0.05):
    cfg = pg.RLOOConfig(rloo_beta=beta, reward_clip_range=(-1.0, 1.5))
    _, metrics = _check_advantages(r, x, cfg)
    assert metrics["frac_reward_zero_std"] == (0.25 if beta == 0 else 0.0)


def _misses_advantages(got_adv, want_adv):
  off = np.abs(got_adv - want_adv) / (1e-5 + 1e-5 * np.abs(want_adv))
  assert off.max() > 100, off.max()


@pytest.mark.parametrize("k", [2, 4])
def test_advantage_negative_controls(k):
  """A baseline that includes the sample itself (GRPO's group mean, unscaled), the KL left out
  of the reward, GRPO's k3 in place of RLOO's k1, and the normalisation ignored: each misses
  TRL's advantages by 100 times the bound."""
  B = 4
  r = rewards_with_none(20 + k, B, k)
  x = make_inputs(30 + k, B * k)
  cfg = pg.RLOOConfig(rloo_beta=0.05, rloo_num_generations=k)
  want_adv, _ = trl_advantages(r, x, cfg)
  k1 = ((x["old"] - x["ref"]) * x["mask"]).sum(-1).reshape(B, k)
  d = x["ref"] - x["old"]
  k3 = ((np.exp(d) - d - 1) * x["mask"]).sum(-1).reshape(B, k)
  penalised = pg.weighted_rewards(jnp.asarray(r)) - cfg.rloo_beta * k1
  with_self = np.asarray(pg.group_advantages(penalised, "none")).reshape(-1)
  _misses_advantages(with_self, want_adv)
  no_kl, _ = ours_advantages(r, x, dataclasses.replace(cfg, rloo_beta=0.0))
  _misses_advantages(no_kl, want_adv)
  as_k3, _ = pg.rloo_advantages(pg.weighted_rewards(jnp.asarray(r)), jnp.asarray(k3), cfg)
  _misses_advantages(np.asarray(as_k3).reshape(-1), want_adv)
  want_norm, _ = trl_advantages(r, x, dataclasses.replace(cfg, normalize_advantages=True))
  plain, _ = ours_advantages(r, x, cfg)
  _misses_advantages(plain, want_norm)


# --- the config -----------------------------------------------------------------------------------

TRL_NAMES = {"rloo_beta": "beta", "rloo_epsilon": "epsilon", "rloo_epsilon_high": "epsilon_high",
             "rloo_num_generations": "num_generations", "rloo_num_iterations": "num_iterations",
             "rloo_max_completion_length": "max_completion_length",
             "rloo_mask_truncated_completions": "mask_truncated_completions"}


def test_config_defaults_are_trls():
  """Each field's default is TRL 1.16 RLOOConfig's (TRL's None is our 0 or empty tuple), and its
  help names the TRL counterpart."""
  trl_config = pytest.importorskip("trl.trainer.rloo_config")
  trl_defaults = {f.name: f.default for f in dataclasses.fields(trl_config.RLOOConfig)}
  for f in dataclasses.fields(pg.RLOOConfig):
    trl_name = TRL_NAMES.get(f.name, f.name)
    want = trl_defaults[trl_name]
    want = {None: 0.0 if f.type == "float" else ()}.get(want, want)
    assert f.default == want, (f.name, f.default, want)
    assert f"TRL's {trl_name}" in f.metadata["help"], f.name


@pytest.mark.parametrize("field,value,message", [
    ("rloo_beta", -0.1, "--rloo_beta=-0.1: must be a finite number >= 0"),
    ("rloo_epsilon", 1.0, "--rloo_epsilon=1.0: must be in [0, 1)"),
    ("rloo_num_generations", 1, "--rloo_num_generations=1: must be >= 2"),
    ("reward_clip_range", (2.0, 1.0), "--reward_clip_range=2.0,1.0: must be empty or min,max"),
    ("reward_clip_range", (1.0,), "--reward_clip_range=1.0: must be empty or min,max"),
])
def test_config_refuses_bad_values(field, value, message):
  with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("(", r"\(")
                     .replace(")", r"\)")) as e:
    pg.RLOOConfig(**{field: value})
  assert "\n" not in str(e.value)

"""dpo/policy_gradient.py's PPO against Tunix 0.1.7's own PPO functions, the oracle its users
compare with (TRL 1.16 ships no PPO trainer).

Tunix's functions run on the same arrays as ours: `compute_kl_divergence` (tunix/rl/common.py),
`compute_gae_advantages`, `ppo_policy_loss_fn` and `ppo_value_loss_fn` (tunix/rl/algo_core.py),
and the lines of `PPOLearner._generate_and_compute_advantage` (tunix/rl/ppo/ppo_learner.py) that
turn a completion's score and the token KL into token rewards and advantages, compiled from the
installed source. Where a Tunix function reads a model, the model is replaced by the given
arrays (`nnx.split` and `common.compute_per_token_logps`, or `common.compute_score`, patched to
return them), so the loss, its gradient and every metric are Tunix's own. Tunix is imported
without running its package's `__init__` (which imports its trainers and their dependencies:
google-tunix is installed with --no-deps, flax beside it). Each comparison has a negative
control that misses its bound.
"""

import importlib.util
import inspect
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpo import policy_gradient as pg


def _tunix():
  """tunix.rl's algo_core and common, and ppo_learner's source, without tunix/__init__.py."""
  if "tunix" not in sys.modules:
    spec = importlib.util.find_spec("tunix")
    package = types.ModuleType("tunix")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["tunix"] = package
  from tunix.rl import algo_core, common
  origin = importlib.util.find_spec("tunix.rl.ppo.ppo_learner").origin
  return algo_core, common, open(origin).read()


algo_core, common, LEARNER_SOURCE = _tunix()
TOL = dict(rtol=2e-5, atol=2e-6)
T, V = 10, 7  # completion slots, vocabulary


def make_inputs(seed, n=6):
  """Completion masks of varied lengths (right-padded, every completion at least one token),
  log-probs of the policy, of the sampling policy (far enough that the token ratio leaves [0.8,
  1.2] both ways) and of the reference, token advantages of both signs, values, returns, logits,
  scores. Padding slots hold finite values, as a model gives them."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, T + 1, n)
  lengths[0] = T
  mask = (np.arange(T) < lengths[:, None]).astype(np.int32)
  f32 = lambda a: np.asarray(a, np.float32)
  logps = f32(rng.uniform(-3.0, -0.05, (n, T)))
  return dict(mask=mask, logps=logps, old=f32(logps + rng.normal(0, 0.3, (n, T))),
              ref=f32(logps + rng.normal(0, 0.5, (n, T))), adv=f32(rng.normal(0, 1, (n, T))),
              values=f32(rng.normal(0, 1, (n, T))), old_values=f32(rng.normal(0, 1, (n, T))),
              returns=f32(rng.normal(0, 1, (n, T))), logits=f32(rng.normal(0, 2, (n, T, V))),
              scores=f32(rng.normal(0, 1, n)))


def close(ours, theirs, mask=None, tol=TOL):
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  if mask is not None:
    ours, theirs = ours[mask > 0], theirs[mask > 0]
  np.testing.assert_allclose(ours, theirs, **tol)


def ratio(metric):
  """A metric of ours: a (sum, count) pair is divided, as train.accumulate does."""
  return metric[0] / metric[1] if isinstance(metric, tuple) else metric


# --- the token KL, rewards and GAE ------------------------------------------------------------

@pytest.mark.parametrize("method", pg.KL_METHODS)
@pytest.mark.parametrize("clamp", [0.0, 0.4])
def test_token_kl_equals_tunix(method, clamp):
  x = make_inputs(0)
  theirs = common.compute_kl_divergence(x["old"], x["ref"], method=method,
                                        clamp_value=clamp or None)
  close(pg.token_kl(x["old"], x["ref"], method, clamp), theirs)
  if method != "mse_kl":  # negative control: the arguments swapped
    with pytest.raises(AssertionError):
      close(pg.token_kl(x["ref"], x["old"], method, clamp), theirs)


def _tunix_advantages(x, scores, cfg: pg.PPOConfig, completion_ids):
  """The reward and advantage lines of Tunix's PPOLearner._generate_and_compute_advantage, from
  `eos_idx = ...` and from `rewards = jnp.zeros_like(...)` to the GAE call, run as written."""
  start = LEARNER_SOURCE.index("    eos_idx = jnp.max(")
  eos = LEARNER_SOURCE[start:LEARNER_SOURCE.index("    # ===== Compute log probs", start)]
  start = LEARNER_SOURCE.index("    rewards = jnp.zeros_like(jax_completion_ids)")
  body = LEARNER_SOURCE[start:LEARNER_SOURCE.index("    # ===== Metric logging", start)]
  algo = types.SimpleNamespace(beta=cfg.ppo_beta, kl_method=cfg.ppo_kl_method,
                               kl_clamp_value=cfg.ppo_kl_clamp or None,
                               advantage_estimator="gae", gamma=cfg.gamma,
                               gae_lambda=cfg.gae_lambda)
  scope = dict(jnp=jnp, common=common, registry=algo_core.registry,
               self=types.SimpleNamespace(algo_config=algo), batch_size=len(scores),
               jax_completion_ids=completion_ids, jax_completion_mask=jnp.asarray(x["mask"] > 0),
               jax_last_token_scores=jnp.asarray(scores), old_per_token_logps=x["old"],
               ref_per_token_logps=x["ref"], values=x["values"] * x["mask"])
  exec(textwrap.dedent(eos) + textwrap.dedent(body), scope)
  return scope["rewards"], scope["advantages"], scope["returns"]


def _ours(x, scores, cfg):
  rewards, _ = pg.token_rewards(jnp.asarray(scores), x["old"], x["ref"], x["mask"], cfg)
  advantages, returns = pg.gae_advantages(rewards, x["values"] * x["mask"], x["mask"], cfg.gamma,
                                          cfg.gae_lambda)
  return rewards, advantages, returns


CONFIGS = {
    "tunix defaults": pg.PPOConfig(),
    "discounted, kl": pg.PPOConfig(gamma=0.9, gae_lambda=0.8, ppo_beta=0.1, ppo_kl_method="kl"),
    "mse_kl clamped": pg.PPOConfig(ppo_kl_method="mse_kl", ppo_kl_clamp=0.05, gae_lambda=1.0),
    "no kl": pg.PPOConfig(ppo_beta=0.0, gamma=0.99),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rewards_and_gae_equal_tunix(name):
  """Token rewards (the score on the last completion token, less beta times the token KL) and
  GAE's whitened advantages and returns, against Tunix's lines on the same arrays. Tunix builds
  the rewards in the completion ids' dtype; given float ids its lines keep the score whole, as
  ours do."""
  cfg, x = CONFIGS[name], make_inputs(1)
  ids = jnp.zeros(x["mask"].shape, jnp.float32)
  theirs = _tunix_advantages(x, x["scores"], cfg, ids)
  ours = _ours(x, x["scores"], cfg)
  for o, t in zip(ours, theirs):
    close(o, t, x["mask"])
  # Negative controls: lambda off by 0.05, and the score one token early.
  off = pg.gae_advantages(ours[0], x["values"] * x["mask"], x["mask"], cfg.gamma,
                          cfg.gae_lambda - 0.05)[0]
  early = jnp.roll(ours[0], -1, axis=1) * x["mask"]
  with pytest.raises(AssertionError):
    close(off, theirs[1], x["mask"])
  with pytest.raises(AssertionError):
    close(pg.gae_advantages(early, x["values"] * x["mask"], x["mask"], cfg.gamma,
                            cfg.gae_lambda)[0], theirs[1], x["mask"])


def test_prompt_slots_before_the_completion_change_nothing():
  """The stage's rows hold the prompt's slots (mask 0) before the completion: the rewards,
  advantages and returns at the completion tokens are Tunix's on the completion alone."""
  cfg, x = pg.PPOConfig(gamma=0.97, ppo_beta=0.1), make_inputs(6)
  theirs = _tunix_advantages(x, x["scores"], cfg, jnp.zeros(x["mask"].shape, jnp.float32))
  P = 5
  rng = np.random.default_rng(7)
  wide = {k: np.concatenate([rng.normal(size=(len(v), P)).astype(v.dtype), v], axis=1)
          for k, v in x.items() if k in ("old", "ref", "values")}
  wide["mask"] = np.concatenate([np.zeros((len(x["mask"]), P), np.int32), x["mask"]], axis=1)
  ours = _ours(wide, x["scores"], cfg)
  for o, t in zip(ours, theirs):
    close(np.asarray(o)[:, P:], t, x["mask"])


@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types")  # Tunix's, as said
def test_tunix_integer_rewards_drop_a_scores_fraction():
  """The one place ours differ by design: with Tunix's integer completion ids its rewards array
  is integer, so a score of 0.7 adds 0 (and -1.5 adds -1) before the KL; ours keep the score.
  With whole scores the two agree."""
  cfg, x = pg.PPOConfig(), make_inputs(2)
  ids = jnp.zeros(x["mask"].shape, jnp.int32)
  whole = np.round(x["scores"] * 3)
  for o, t in zip(_ours(x, whole, cfg), _tunix_advantages(x, whole, cfg, ids)):
    close(o, t, x["mask"])
  with pytest.raises(AssertionError):
    close(_ours(x, x["scores"], cfg)[0], _tunix_advantages(x, x["scores"], cfg, ids)[0],
          x["mask"])


# --- the losses -------------------------------------------------------------------------------

def _tunix_policy_loss(logps, logits, x, cfg: pg.PPOConfig, monkeypatch):
  monkeypatch.setattr(algo_core, "nnx", types.SimpleNamespace(split=lambda m: (None, m)))
  monkeypatch.setattr(common, "compute_per_token_logps",
                      lambda graphdef, state, **kw: (state["logps"], state["logits"]))
  example = types.SimpleNamespace(
      prompt_ids=None, completion_ids=jnp.zeros(x["mask"].shape, jnp.int32),
      completion_mask=jnp.asarray(x["mask"]), advantages=x["adv"], old_per_token_logps=x["old"],
      ref_per_token_logps=None)
  algo = types.SimpleNamespace(epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
                               entropy_coef=cfg.ppo_entropy_coef or None,
                               epsilon_c=cfg.ppo_epsilon_c or None, kl_coef=0.0)
  return algo_core.ppo_policy_loss_fn({"logps": logps, "logits": logits}, example, algo,
                                      pad_id=0, eos_id=1)


def _our_policy_loss(logps, logits, x, cfg):
  """Tunix's logits are those that score each completion token; the project's at a slot score
  the next one (`pg.token_entropy` reads slot t - 1 for token t): one slot more, then cut."""
  entropies = pg.token_entropy(jnp.pad(logits, ((0, 0), (0, 1), (0, 0))))[:, 1:]
  return pg.ppo_policy_loss(logps, x["old"], x["adv"], x["mask"], cfg,
                            num_items=float(x["mask"].sum()), entropies_NT=entropies)


POLICY_CONFIGS = {
    "tunix defaults": pg.PPOConfig(),
    "clip higher": pg.PPOConfig(ppo_epsilon=0.1, ppo_epsilon_high=0.28),
    "dual clip": pg.PPOConfig(ppo_epsilon_c=1.5),
    "entropy bonus": pg.PPOConfig(ppo_entropy_coef=0.05, ppo_epsilon_high=0.3),
}


@pytest.mark.parametrize("name", sorted(POLICY_CONFIGS))
def test_policy_loss_equals_tunix(name, monkeypatch):
  """Loss, its gradient with respect to the log-probs and the logits, and Tunix's metrics."""
  cfg, x = POLICY_CONFIGS[name], make_inputs(3)
  logps, logits = jnp.asarray(x["logps"]), jnp.asarray(x["logits"])
  theirs, their_metrics = _tunix_policy_loss(logps, logits, x, cfg, monkeypatch)
  ours, metrics = _our_policy_loss(logps, logits, x, cfg)
  close(ours, theirs)
  grad = lambda f: jax.grad(lambda a, b: f(a, b)[0], argnums=(0, 1))(logps, logits)
  ours_g = grad(lambda a, b: _our_policy_loss(a, b, x, cfg))
  theirs_g = grad(lambda a, b: _tunix_policy_loss(a, b, x, cfg, monkeypatch))
  for o, t in zip(ours_g, theirs_g):
    close(o, t, tol=dict(rtol=1e-4, atol=1e-6))
  assert 0 < float(their_metrics["pg_clipfrac"]) < 1
  close(ratio(metrics["pg_clipfrac"]), their_metrics["pg_clipfrac"])
  if cfg.ppo_epsilon_c:
    assert float(their_metrics["pg_clipfrac_lower"]) > 0
    close(ratio(metrics["pg_clipfrac_lower"]), their_metrics["pg_clipfrac_lower"])
  if cfg.ppo_entropy_coef:
    close(ratio(metrics["entropy"]), their_metrics["loss/entropy"])
  # Negative control: ours without the clip's upper side (epsilon_high huge) misses.
  loose = pg.PPOConfig(**{**cfg.__dict__, "ppo_epsilon_high": 10.0})
  with pytest.raises(AssertionError):
    close(_our_policy_loss(logps, logits, x, loose)[0], theirs)


def test_policy_loss_does_not_depend_on_the_microbatches():
  """Over K microbatches, each summed over the whole batch's token count / K (`num_items`), the
  mean of the K losses is the whole batch's loss, as Tunix's token mean of one batch."""
  cfg, x = pg.PPOConfig(ppo_epsilon_c=2.0), make_inputs(4, n=8)
  whole, _ = pg.ppo_policy_loss(x["logps"], x["old"], x["adv"], x["mask"], cfg,
                                num_items=float(x["mask"].sum()))
  k, items = 4, x["mask"].sum() / 4
  parts = [pg.ppo_policy_loss(*(x[f][i::k] for f in ("logps", "old", "adv", "mask")), cfg,
                              num_items=items)[0] for i in range(k)]
  close(np.mean(parts), whole)


def _tunix_value_loss(values, x, clip, monkeypatch):
  monkeypatch.setattr(common, "compute_score",
                      lambda model, *a, **kw: jnp.pad(model, ((0, 0), (0, 1))))
  example = types.SimpleNamespace(
      prompt_ids=None, completion_ids=jnp.zeros(x["mask"].shape, jnp.int32),
      completion_mask=jnp.asarray(x["mask"]), old_values=x["old_values"], returns=x["returns"])
  return algo_core.ppo_value_loss_fn(values, example, clip, pad_id=0, eos_id=1)


@pytest.mark.parametrize("clip", [0.2, 0.5])
def test_value_loss_equals_tunix(clip, monkeypatch):
  x = make_inputs(5)
  values = jnp.asarray(x["values"])
  ours = lambda v: pg.ppo_value_loss(v, x["old_values"], x["returns"], x["mask"], clip,
                                     num_items=float(x["mask"].sum()))
  theirs = lambda v: _tunix_value_loss(v, x, clip, monkeypatch)
  (loss, metrics), (their_loss, their_metrics) = ours(values), theirs(values)
  close(loss, their_loss)
  close(jax.grad(lambda v: ours(v)[0])(values), jax.grad(lambda v: theirs(v)[0])(values))
  assert 0 < float(their_metrics["vf_clipfrac"]) < 1
  for name in ("vf_loss", "vpred_mean", "vf_clipfrac", "return_mean"):
    close(ratio(metrics[name]), their_metrics[name])
  # Negative control: the value clipped around the new value instead of the old one.
  with pytest.raises(AssertionError):
    close(pg.ppo_value_loss(values, values, x["returns"], x["mask"], clip,
                            num_items=float(x["mask"].sum()))[0], their_loss)


def test_ppo_config_rules():
  assert pg.PPOConfig().epsilon_high == 0.2
  assert pg.PPOConfig(ppo_epsilon_high=0.3).epsilon_high == 0.3
  for bad in (dict(ppo_epsilon_c=1.0), dict(ppo_kl_method="k2"), dict(gamma=1.5),
              dict(clip_range_value=0.0)):
    with pytest.raises(ValueError, match=next(iter(bad))):
      pg.PPOConfig(**bad)
  assert "ppo_policy_loss_fn" in inspect.getsource(algo_core)  # the oracle is the one we read

"""dpo/losses.py against independent numpy implementations of each paper's formula."""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpo import losses
from dpo.losses import Logps

LN2 = math.log(2.0)
B = 16


# --- numpy references, written from the papers' formulas ------------------------------------------

def np_logsig(x):
  return -np.logaddexp(0.0, -x)


def np_sig(x):
  return 1.0 / (1.0 + np.exp(-x))


def np_fprime(lu, div="reverse_kl", a=0.5):
  """f'(u) of f-DPO (Wang et al. 2024, Table 1) at lu = log u; `a` is TRL's alpha, so the
  paper's alpha-divergence f'(u) = (1 - u^-alpha_p) / alpha_p is taken at alpha_p = 1 - a."""
  ap = 1.0 - a
  return {
      "reverse_kl": lambda: lu,
      "forward_kl": lambda: 1.0 - np.exp(-lu),
      "js_divergence": lambda: np.log(2 * np.exp(lu) / (1 + np.exp(lu))),
      "alpha_divergence": lambda: (1 - np.exp(-ap * lu)) / ap,
  }[div]()


def np_fmargin(pw, pl, rw_ref, rl_ref, div="reverse_kl", a=0.5):
  return np_fprime(pw - rw_ref, div, a) - np_fprime(pl - rl_ref, div, a)


def np_nll(pw, nw, per_pair):
  return -pw / nw if per_pair else np.full_like(pw, -pw.sum() / nw.sum())


def reference_losses(x, beta, eps, hp):
  """{name: [B] losses} from the formulas; x = dict of float64 numpy arrays."""
  pw, pl, rw0, rl0, nw, nl = (x[k] for k in ("pw", "pl", "rw", "rl", "nw", "nl"))
  rw, rl = pw - rw0, pl - rl0
  h = np_fmargin(pw, pl, rw0, rl0, hp["f_divergence"], hp["f_alpha"])
  z = beta * h
  out = {}
  out["sigmoid"] = -(1 - eps) * np_logsig(z) - eps * np_logsig(-z)
  out["robust"] = (-(1 - eps) * np_logsig(z) + eps * np_logsig(-z)) / (1 - 2 * eps)
  out["hinge"] = np.maximum(0.0, 1 - z)
  div, a = hp["f_divergence"], hp["f_alpha"]
  h_avg = np_fprime(rw, div, a) / nw - np_fprime(rl, div, a) / nl
  out["ipo"] = (h_avg - 1 / (2 * beta)) ** 2
  e = hp["exo_epsilon"]
  p = np_sig(z)
  out["exo_pair"] = p * (np.log(p) - np.log(1 - e)) + (1 - p) * (np.log(1 - p) - np.log(e))
  out["nca_pair"] = (-np_logsig(beta * rw) - 0.5 * np_logsig(-beta * rw)
                     - 0.5 * np_logsig(-beta * rl))
  delta = np.mean(np.concatenate([beta * rw, beta * rl])) if hp["bco_shift"] else 0.0
  out["bco_pair"] = -np_logsig(beta * rw - delta) - np_logsig(-(beta * rl - delta))
  out["sppo_hard"] = (rw - 1 / (2 * beta)) ** 2 + (rl + 1 / (2 * beta)) ** 2
  d = np.sort(pw - pl) - np.sort(rw0 - rl0)
  out["aot"] = -(1 - eps) * np_logsig(beta * d) - eps * np_logsig(-beta * d)
  d = np.sort(rw) - np.sort(rl)
  out["aot_unpaired"] = -(1 - eps) * np_logsig(beta * d) - eps * np_logsig(-beta * d)
  out["apo_zero"] = (1 - np_sig(beta * rw)) + np_sig(beta * rl)
  out["apo_down"] = np_sig(beta * rw) + (1 - np_sig(beta * (rw - rl)))
  m = np_sig(z / hp["discopop_tau"])
  out["discopop"] = (1 - m) * -np_logsig(z) + m * np.exp(-z)
  out["sigmoid_norm"] = -np_logsig(beta * h_avg)
  nll = np_nll(pw, nw, hp["nll_per_pair"])
  out["sft"] = nll
  sb, sg = hp["simpo_beta"], hp["simpo_gamma"]
  sm = sb * (pw / nw - pl / nl) - sg
  out["simpo"] = -(1 - eps) * np_logsig(sm) - eps * np_logsig(-sm)
  out["cpo_simpo"] = out["simpo"] + hp["cpo_alpha"] * nll
  # AlphaPO (Gupta et al. 2025): r = beta / alpha * (1 - pi(y)^(-alpha / |y|))
  al = hp["alphapo_alpha"]
  r = lambda lp, n: sb / al * (1 - np.exp(lp) ** (-al / n))
  am = r(pw, nw) - r(pl, nl) - sg
  out["alphapo"] = -(1 - eps) * np_logsig(am) - eps * np_logsig(-am)
  c = beta * (pw - pl)
  out["cpo"] = -(1 - eps) * np_logsig(c) - eps * np_logsig(-c) + hp["cpo_alpha"] * nll
  out["cpo_hinge"] = np.maximum(0.0, 1 - c) + hp["cpo_alpha"] * nll
  out["cpo_ipo"] = (pw / nw - pl / nl - 1 / (2 * beta)) ** 2 + hp["cpo_alpha"] * nll
  pw_avg, pl_avg = np.exp(pw / nw), np.exp(pl / nl)
  log_odds = np.log(pw_avg / (1 - pw_avg)) - np.log(pl_avg / (1 - pl_avg))
  out["orpo"] = nll - hp["orpo_lambda"] * np_logsig(log_odds)
  return out


def random_inputs(seed, scale=30.0):
  rng = np.random.default_rng(seed)
  nw = rng.integers(3, 40, B).astype(np.float64)
  nl = rng.integers(3, 40, B).astype(np.float64)
  # average log-probs in (-3, -0.05): realistic and away from ORPO's P = 1 singularity
  pw, pl = -nw * rng.uniform(0.05, 3, B), -nl * rng.uniform(0.05, 3, B)
  rw = pw + rng.normal(0, scale / 10, B)
  rl = pl + rng.normal(0, scale / 10, B)
  return {"pw": pw, "pl": pl, "rw": rw, "rl": rl, "nw": nw, "nl": nl}


def to_logps(x) -> Logps:
  f = lambda k: jnp.asarray(x[k], jnp.float32)
  return Logps(f("pw"), f("pl"), f("rw"), f("rl"), f("nw"), f("nl"))


# Every loss hyperparameter at its registry default (beta and label_smoothing are each case's).
HP = {name: h.default for name, h in losses.hyperparameters().items()
      if name not in ("beta", "label_smoothing") and name not in
      {m.name for m in losses.MODIFIERS.values()}}


@pytest.mark.parametrize("flag", [False, True], ids=["trl", "paper"])
@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.2), (0.05, 0.1)])
@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_matches_numpy(name, beta, eps, flag):
  """flag: the paper's choice where TRL departs from it (bco_shift, nll_per_pair)."""
  x = random_inputs(zlib.crc32(f"{name}{beta}{eps}".encode()))
  hp = dict(HP, simpo_beta=2.0 + beta, orpo_lambda=0.1 + beta, cpo_alpha=1.0 - beta,
            exo_epsilon=max(eps, 1e-3), alphapo_alpha=0.25 - 2 * beta, bco_shift=flag,
            nll_per_pair=flag)
  want = reference_losses(x, beta, eps, hp)[name]
  got, _ = jax.jit(lambda lp: losses.LOSSES[name].apply(lp, dict(hp, beta=beta, label_smoothing=eps)))(
      to_logps(x))
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("div", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("name", ["sigmoid", "robust", "hinge", "ipo", "exo_pair", "discopop",
                                  "sigmoid_norm"])
def test_f_divergences_match_numpy(name, div):
  x = random_inputs(7, scale=5.0)  # log-ratios of a few nats: exp terms stay moderate
  hp = dict(HP, f_divergence=div, f_alpha=0.3)
  want = reference_losses(x, 0.1, 0.1, hp)[name]
  got, _ = losses.LOSSES[name].apply(to_logps(x), dict(hp, beta=0.1, label_smoothing=0.1))
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)


def _known_at_equal(beta, eps, e=1e-3):
  return {
      "sigmoid": LN2, "robust": LN2, "hinge": 1.0, "ipo": (1 / (2 * beta)) ** 2,
      "exo_pair": 0.5 * (-LN2 - math.log(1 - e)) + 0.5 * (-LN2 - math.log(e)),
      "nca_pair": 2 * LN2, "bco_pair": 2 * LN2, "sppo_hard": 2 * (1 / (2 * beta)) ** 2,
      "aot": LN2, "aot_unpaired": LN2, "apo_zero": 1.0, "apo_down": 1.0,
      "discopop": 0.5 * LN2 + 0.5, "sigmoid_norm": LN2,
  }


@pytest.mark.parametrize("div", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.3, 0.25)])
def test_known_value_when_policy_equals_reference(beta, eps, div):
  x = random_inputs(3)
  x["rw"], x["rl"] = x["pw"].copy(), x["pl"].copy()
  lp = to_logps(x)
  hp = dict(HP, f_divergence=div)
  for name, want in _known_at_equal(beta, eps).items():
    got, _ = losses.LOSSES[name].apply(lp, dict(hp, beta=beta, label_smoothing=eps))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("div", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_margins_finite(sign, div):
  """Log-prob differences of +-1e4 nats: every loss and its gradient stay finite."""
  rng = np.random.default_rng(0)
  n = jnp.asarray(rng.integers(5, 50, B), jnp.float32)
  base = -jnp.asarray(rng.uniform(1, 5, B), jnp.float32) * n
  big = sign * 1e4
  cases = [
      Logps(base, base - big, base - big, base, n, n),       # policy margin +-1e4, ref opposite
      Logps(base - 1e4, base, base, base - 1e4, n, n),
      Logps(jnp.full(B, -1e4), jnp.full(B, -1e-3), jnp.full(B, -1e-3), jnp.full(B, -1e4), n, n),
      Logps(jnp.full(B, -1e-7), jnp.full(B, -1e4), jnp.full(B, -1e4), jnp.full(B, -1e-7), n, n),
  ]
  hp = dict(HP, f_divergence=div)
  for lp in cases:
    for name, loss in losses.LOSSES.items():
      if name == "ipo" and div in ("forward_kl", "alpha_divergence"):
        continue  # squares a score near exp(80) (TRL's cap): past float32, in TRL too
      def total(lp):
        return loss.apply(lp, dict(hp, beta=0.1, label_smoothing=0.1))[0].sum()
      val, grads = jax.value_and_grad(total)(lp)
      assert np.isfinite(float(val)), (name, div, lp)
      for g in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(g))), (name, div)


def test_combination_weights_and_modifiers():
  x = random_inputs(11)
  lp = to_logps(x)
  beta, eps = 0.2, 0.1
  cfg = losses.LossConfig(beta=beta, label_smoothing=eps)
  ref = reference_losses(x, beta, eps, HP)
  loss, m = losses.combined(lp, cfg.__class__(loss_type=("sigmoid", "ipo", "orpo"),
                                              loss_weights=(0.3, 2.0, 0.5), beta=beta,
                                              label_smoothing=eps))
  want = np.mean(0.3 * ref["sigmoid"] + 2.0 * ref["ipo"] + 0.5 * ref["orpo"])
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(m["loss/ipo"]), ref["ipo"].mean(), rtol=1e-5)
  assert "orpo/log_odds_ratio" in m and "orpo/log_odds_chosen" in m

  # RPO: DPO + alpha * NLL of the chosen completion, over the batch's tokens or (paper) per pair.
  for per_pair in (False, True):
    loss, _ = losses.combined(lp, losses.LossConfig(beta=beta, label_smoothing=eps, rpo_alpha=0.7,
                                                    nll_per_pair=per_pair))
    want = np.mean(ref["sigmoid"] + 0.7 * np_nll(x["pw"], x["nw"], per_pair))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)

  # WPO: each pair's loss (its RPO term included) times exp(logw_w + logw_l), unclamped, no
  # gradient through the weight.
  logw = np.random.default_rng(1).normal(-0.5, 1.0, (B, 2))
  w = np.exp(logw.sum(-1))
  assert w.max() > 1.0
  rpo = losses.LossConfig(beta=beta, label_smoothing=eps, rpo_alpha=0.7, wpo=True)
  loss, m = losses.combined(lp, rpo, wpo_logw_B2=jnp.asarray(logw, jnp.float32))
  want = np.mean(w * (ref["sigmoid"] + 0.7 * np_nll(x["pw"], x["nw"], False)))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  g = jax.grad(lambda lw: losses.combined(lp, cfg, wpo_logw_B2=lw)[0])(
      jnp.asarray(logw, jnp.float32))
  assert np.all(np.asarray(g) == 0.0)


def test_nll_terms_read_the_log_probs_before_ld_dpo():
  """LD-DPO scales the DPO terms' log-probs; the NLL terms (sft, RPO, CPO, ORPO) read the full
  chosen log-prob `policy_chosen_full`, as TRL's sft term reads the unweighted token log-probs."""
  x = random_inputs(13)
  full = to_logps(x)
  lp = full._replace(policy_chosen=0.5 * full.policy_chosen, policy_chosen_full=full.policy_chosen)
  want = -x["pw"].sum() / x["nw"].sum()
  np.testing.assert_allclose(np.asarray(losses.sft(lp, nll_per_pair=False)[0]), want, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(losses.nll_chosen(lp, True)), -x["pw"] / x["nw"],
                             rtol=1e-5)


def test_length_desensitised():
  total, shared = np.array([-30.0, -12.0]), np.array([-10.0, -12.0])
  got = losses.length_desensitised(jnp.asarray(total), jnp.asarray(shared), 0.25)
  np.testing.assert_allclose(np.asarray(got), [-10.0 + 0.25 * -20.0, -12.0])


def test_orpo_metrics_are_log_odds():
  x = random_inputs(5)
  _, m = losses.orpo(to_logps(x), orpo_lambda=0.1, nll_per_pair=False)
  pw, pl = np.exp(x["pw"] / x["nw"]), np.exp(x["pl"] / x["nl"])
  lo = np.log(pw / (1 - pw)) - np.log(pl / (1 - pl))
  np.testing.assert_allclose(float(m["orpo/log_odds_chosen"]), lo.mean(), rtol=1e-4)
  np.testing.assert_allclose(float(m["orpo/log_odds_ratio"]), np_logsig(lo).mean(), rtol=1e-4)


# --- the registry ---------------------------------------------------------------------------------

def test_each_loss_declares_exactly_the_hyperparameters_it_reads():
  """register() checks the signature; here: every declared name is a LossConfig field with the
  declared default, and a call with only the declared names works (nothing read from **kwargs)."""
  import dataclasses
  fields = {f.name: f for f in dataclasses.fields(losses.LossConfig)}
  lp = to_logps(random_inputs(2))
  for name, loss in losses.LOSSES.items():
    for h in loss.hyperparameters:
      assert fields[h.name].default == h.default and fields[h.name].metadata["help"] == h.help
    got, _ = loss.fn(lp, **{h.name: h.default for h in loss.hyperparameters})
    assert got.shape == (B,), name
  with pytest.raises(TypeError, match="signature"):
    losses.register("bad", losses.BETA)(lambda lp, beta, extra: (lp.policy_chosen, {}))
  assert "bad" not in losses.LOSSES


class _Reads:
  """A LossConfig that records, in order, the fields read from it."""

  def __init__(self, cfg):
    self.cfg, self.names = cfg, []

  def __getattr__(self, name):
    self.names.append(name)
    return getattr(self.cfg, name)


def test_each_loss_call_reads_exactly_its_declared_hyperparameters():
  """Each registered `call` (lambda lp, c: fn(lp, c.beta, ...), written out so grep follows a
  field to its loss) reads the declared hyperparameters, each once, in the declared order (the
  order of fn's parameters, which register() checks), and computes what fn does with them."""
  lp = to_logps(random_inputs(4))
  cfg = losses.LossConfig(beta=0.3)  # beta off its default: a call that dropped it would differ
  for name, loss in losses.LOSSES.items():
    reads = _Reads(cfg)
    got, _ = loss.call(lp, reads)
    assert reads.names == [h.name for h in loss.hyperparameters], name
    want, _ = loss.fn(lp, **{h.name: getattr(cfg, h.name) for h in loss.hyperparameters})
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


def test_loss_config_fields_are_the_registry_hyperparameters():
  """LossConfig is built from the registry: exactly loss_type, loss_weights and one field per
  registry hyperparameter (losses' and modifiers'), each of its default's type, with its help."""
  import dataclasses
  import typing
  hints = typing.get_type_hints(losses.LossConfig)
  fields = [f.name for f in dataclasses.fields(losses.LossConfig)]
  registry = losses.hyperparameters()
  assert fields == ["loss_type", "loss_weights", *registry]
  for name, h in registry.items():
    assert hints[name] is type(h.default), name
  helps = {f.name: f.metadata["help"] for f in dataclasses.fields(losses.LossConfig)}
  assert all(helps[name] == h.help for name, h in registry.items())


@pytest.mark.parametrize("flags,match", [
    (dict(simpo_gamma=2.0),
     "--simpo_gamma=2.0: must go with a loss that reads it .*; none of --loss_type=sigmoid"),
    (dict(loss_type=("ipo",), label_smoothing=0.1), "label_smoothing=0.1: must go with a loss"),
    (dict(loss_type=("sigmoid_norm",), label_smoothing=0.1),
     "label_smoothing=0.1: must go with a loss"),
    (dict(loss_type=("nca_pair",), f_divergence="forward_kl"),
     "f_divergence='forward_kl': must go with a loss that reads it"),
    # TRL refuses an f-divergence that one loss of the combination would ignore; so do we.
    (dict(loss_type=("sigmoid", "bco_pair"), f_divergence="js_divergence"),
     "f_divergence='js_divergence': must apply to every loss of --loss_type=sigmoid,bco_pair "
     "that reads the reference; bco_pair does not"),
    (dict(loss_type=("sigmoid", "aot"), wpo=True),
     "wpo=True: must apply to every loss .*; aot does not"),
    (dict(loss_type=("simpo",), wpo=True),
     "wpo=True: must go with a loss that reads it .*; none of --loss_type=simpo"),
    (dict(loss_type=("cpo",), rpo_alpha=1.0), "rpo_alpha=1.0: must go with a loss"),
    (dict(loss_type=("sft",), ld_alpha=0.5), "ld_alpha=0.5: must go with a loss"),
    (dict(nll_per_pair=True), "nll_per_pair=True: must go .*; none of --loss_type=sigmoid"),
    (dict(loss_type=("exo_pair",), exo_epsilon=0.0), r"--exo_epsilon=0.0: must be in \(0, 0.5\)"),
    (dict(loss_type=("alphapo",), alphapo_alpha=0.0), "--alphapo_alpha=0.0: must be != 0"),
    (dict(f_alpha=0.3), "--f_alpha=0.3: must go with --f_divergence=alpha_divergence"),
    (dict(beta=0.0), "--beta=0.0: must be > 0"),
    (dict(label_smoothing=0.5), r"--label_smoothing=0.5: must be in \[0, 0.5\)"),
    (dict(loss_type=("sigmoid", "sigmoid")), "--loss_type=sigmoid,sigmoid: must be losses from"),
    (dict(loss_type=("dpo",)),
     "--loss_type=dpo: must be losses from sigmoid, .*, each at most once"),
    (dict(loss_type=("sigmoid", "ipo"), loss_weights=(1.0,)),
     "--loss_weights=1.0: must be one weight per loss of --loss_type=sigmoid,ipo"),
])
def test_config_refuses_what_nothing_reads(flags, match):
  with pytest.raises(ValueError, match=match):
    losses.LossConfig(**flags)


def test_config_accepts_what_a_selected_loss_reads():
  c = losses.LossConfig(loss_type=("sigmoid", "simpo"), simpo_gamma=0.5, label_smoothing=0.1,
                        f_divergence="alpha_divergence", f_alpha=0.3, rpo_alpha=1.0, wpo=True)
  assert c.weights == (1.0, 1.0) and not c.reference_free
  assert losses.LossConfig(loss_type=("simpo", "orpo")).reference_free
  # sft takes any f-divergence (it reads no reference), as in TRL; RPO reads nll_per_pair.
  losses.LossConfig(loss_type=("sigmoid", "sft"), f_divergence="forward_kl", wpo=True)
  losses.LossConfig(rpo_alpha=1.0, nll_per_pair=True)


def test_a_misspelt_hyperparameter_is_an_error():
  with pytest.raises(TypeError, match="label_smothing"):
    losses.LossConfig(label_smothing=0.1)
  with pytest.raises(KeyError, match="label_smothing"):
    losses.LOSSES["sigmoid"].apply(to_logps(random_inputs(1)), dict(HP, beta=0.1,
                                                                     label_smothing=0.1))


def test_workspace_carries_the_registry_table():
  import os
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "WORKSPACE.md")) as f:
    assert losses.table() in f.read()


def test_a_loss_without_a_docstring_is_refused_by_name():
  """The loss table describes each loss by its docstring: a loss without one is refused when it
  is registered, naming it, not an AttributeError when the table is drawn."""
  with pytest.raises(TypeError, match="loss undocumented: .* has no docstring"):
    @losses.register("undocumented")
    def undocumented(lp):
      return lp.policy_chosen, {}
  assert "undocumented" not in losses.LOSSES

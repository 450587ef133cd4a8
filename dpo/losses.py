"""Preference losses as pure functions of per-sequence log-probs, and the registry of them.

Every loss takes a `Logps` (summed log-probs of chosen and rejected completions under the policy and
the reference, plus token counts) and exactly the hyperparameters it declares, and returns (per-pair
losses [B], extra metrics). `register` puts a loss in `LOSSES` together with everything about it:
its hyperparameters (name, default, help, valid range), its `call` (the function applied to the
LossConfig fields its signature names, read by name in `register`; a loss's parameters must be
its declared hyperparameters in order, so grep for a field leads to its `Hyperparameter` and to
the parameter of that name in each loss that declares it), whether it
reads the reference, which modifiers (RPO, WPO, LD-DPO) combine with it, and its name in TRL 1.16
(the test oracle, tests/test_losses_trl.py). The `loss` config section (`LossConfig`, at the end of
this module) has one field per hyperparameter, written out (a test keeps it equal to the registry);
its flags, validation, `--help` and the loss table in WORKSPACE.md (`table`) derive from the
registry. `combined` applies the weights and the modifiers; the trainer never contains loss logic.
LD-DPO and the f-divergences change the inputs to the losses rather than the losses, see
`length_desensitised` and `f_margin`.

Notation: rw = log pi(y_w) - log pi_ref(y_w), rl likewise for y_l (summed over tokens unless a
loss says "average"); h = rw - rl, the DPO margin before beta.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from models.config import check, one_of, rules, shown

log_sigmoid = jax.nn.log_sigmoid
LN2 = 0.6931471805599453

# exp() arguments are capped here so that forward-KL / alpha-divergence terms stay finite at
# extreme log-ratios (float32 exp overflows near 88); the gradient beyond the cap is zero. 80 is
# TRL's clamp of the alpha-divergence exponent in float32 (TRL leaves forward KL uncapped, which
# is inf past 88 where this is finite).
_EXP_CAP = 80.0


class Logps(NamedTuple):
  policy_chosen: jax.Array    # [B] summed log pi(y_w | x), nats
  policy_rejected: jax.Array  # [B] summed log pi(y_l | x)
  ref_chosen: jax.Array       # [B] summed log pi_ref(y_w | x) (zeros when reference-free)
  ref_rejected: jax.Array     # [B] summed log pi_ref(y_l | x)
  chosen_tokens: jax.Array    # [B] completion token counts
  rejected_tokens: jax.Array  # [B]
  # [B] summed log pi(y_w | x) before LD-DPO's down-weighting, read by the NLL terms (as TRL's
  # are); None: policy_chosen.
  policy_chosen_full: jax.Array | None = None


# --- the registry ---------------------------------------------------------------------------------

class Hyperparameter(NamedTuple):
  """One loss hyperparameter: a field of the `loss` config section and a flag of the same name."""
  name: str
  default: Any
  help: str
  valid: Callable[[Any], bool] = lambda v: True
  rule: str = ""                     # what `valid` demands, for the error message
  read_when: tuple[str, Any] | None = None  # (field, value): only read when that field has it
  # Set off its default, every selected loss that reads the reference must read it (f-divergence,
  # the modifiers: a value that one loss of a combination ignores would be silently half-applied).
  every: bool = False
  modifier: str = ""                 # also read through this modifier (in MODIFIERS) when it is on


class Loss(NamedTuple):
  name: str
  fn: Callable
  # fn on a LossConfig c, each hyperparameter passed by name: fn(lp, beta=c.beta, ...).
  call: Callable[[Logps, Any], tuple[jax.Array, dict]]
  hyperparameters: tuple[Hyperparameter, ...]
  reference: bool                    # reads reference log-probs (False: reference-free)
  modifiers: tuple[str, ...]         # names in MODIFIERS that combine with it
  trl: str                           # the same loss in TRL 1.16 ("-" where TRL has none)

  def apply(self, lp: Logps, values) -> tuple[jax.Array, dict]:
    """`call` on `lp` with `values`: a LossConfig, or a dict that holds at least this loss's
    hyperparameters and no name that is not a hyperparameter."""
    if isinstance(values, dict):
      unknown = set(values) - set(hyperparameters())
      if unknown:
        raise KeyError(f"loss {self.name}: unknown hyperparameters {sorted(unknown)}")
      values = types.SimpleNamespace(**values)
    return self.call(lp, values)


LOSSES: dict[str, Loss] = {}

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")

BETA = Hyperparameter(
    "beta", 0.1, "Inverse temperature beta (strength of the KL anchor); also scales the implicit "
    "rewards beta * log(pi / pi_ref) reported for every loss.", lambda v: v > 0, "> 0")
LABEL_SMOOTHING = Hyperparameter(
    "label_smoothing", 0.0, "Label noise eps (conservative DPO, robust DPO, AOT, CPO, SimPO).",
    lambda v: 0.0 <= v < 0.5, "in [0, 0.5)")
F_DIVERGENCE = Hyperparameter(
    "f_divergence", "reverse_kl", f"f-DPO divergence (Wang et al. 2024), from {F_DIVERGENCES}.",
    *one_of(F_DIVERGENCES), every=True)
F_ALPHA = Hyperparameter(
    "f_alpha", 0.5, "Alpha of the alpha-divergence f-DPO variant, as TRL's "
    "f_alpha_divergence_coef: f'(u) = (u^(alpha-1) - 1) / (alpha - 1), i.e. 1 minus the alpha of "
    "Wang et al. 2024 (equal at 0.5); 1 is reverse KL, 0 forward KL.", lambda v: 0.0 <= v <= 1.0,
    "in [0, 1]", read_when=("f_divergence", "alpha_divergence"))
DISCOPOP_TAU = Hyperparameter(
    "discopop_tau", 0.05, "DiscoPOP temperature of the log-ratio modulation (Lu et al. 2024).",
    lambda v: v > 0, "> 0")
EXO_EPSILON = Hyperparameter(
    "exo_epsilon", 1e-3, "EXO label smoothing eps of the target (1 - eps, eps), > 0 for the KL to "
    "be finite (Ji et al. 2024 recommend 1e-3; TRL's label_smoothing for exo_pair).",
    lambda v: 0.0 < v < 0.5, "in (0, 0.5)")
BCO_SHIFT = Hyperparameter(
    "bco_shift", False, "bco_pair: shift the rewards by the batch's mean reward delta (Jung et al. "
    "2024); off, no shift, as TRL 1.16.")
SIMPO_BETA = Hyperparameter(
    "simpo_beta", 2.0, "SimPO / AlphaPO reward scale beta on average log-probs (Meng et al. 2024).",
    lambda v: v > 0, "> 0")
SIMPO_GAMMA = Hyperparameter(
    "simpo_gamma", 1.0, "SimPO / AlphaPO target reward margin gamma (Meng et al. 2024: gamma/beta "
    "= 0.5).")
ALPHAPO_ALPHA = Hyperparameter(
    "alphapo_alpha", 0.25, "AlphaPO reward shape alpha: r = beta (1 - p^-alpha) / alpha with p the "
    "per-token average probability (Gupta et al. 2025; alpha -> 0 is SimPO; TRL's CPO alpha).",
    lambda v: v != 0, "!= 0 (use simpo for 0)")
CPO_ALPHA = Hyperparameter(
    "cpo_alpha", 1.0, "Weight of the NLL term on the chosen completion in CPO and its variants "
    "(Xu et al. 2024).", lambda v: v >= 0, ">= 0")
ORPO_LAMBDA = Hyperparameter(
    "orpo_lambda", 0.1, "ORPO weight lambda of the odds-ratio term (Hong et al. 2024; TRL's ORPO "
    "beta).", lambda v: v >= 0, ">= 0")
NLL_PER_PAIR = Hyperparameter(
    "nll_per_pair", False, "NLL terms (sft, RPO, CPO, ORPO): average each pair's NLL over its own "
    "tokens, then over pairs (Pang et al. 2024 eq. 2; Hong et al. 2024 eq. 2); off, over all the "
    "batch's chosen tokens, as TRL 1.16.", modifier="rpo")

# Modifiers act on the combination (dpo.train.dpo_step and `combined`), not inside a loss.
MODIFIERS: dict[str, Hyperparameter] = {
    "rpo": Hyperparameter(
        "rpo_alpha", 0.0, "RPO: add alpha * NLL of the chosen completion (Pang et al. 2024 use "
        "1.0; TRL: loss_type sigmoid,sft with weights 1,alpha); 0 disables.", lambda v: v >= 0,
        ">= 0", every=True),
    "wpo": Hyperparameter(
        "wpo", False, "WPO: weight each pair by its length-normalised policy probability "
        "(Zhou et al. 2024, with weight alignment; TRL use_weighting).", every=True),
    "ld": Hyperparameter(
        "ld_alpha", 1.0, "LD-DPO (Liu et al. 2024): weight of log-probs past the pair's shared "
        "length; 1.0 disables, values in (0, 1) desensitise to length.",
        lambda v: 0.0 < v <= 1.0, "in (0, 1] (0 would drop every token past the shared length)",
        every=True),
}
_F = (F_DIVERGENCE, F_ALPHA)
_ALL = tuple(MODIFIERS)


def register(name: str, *hyperparameters: Hyperparameter, reference: bool = True,
             modifiers: tuple[str, ...] = _ALL, trl: str = "-"):
  """Decorator: adds the loss to LOSSES. Its signature is (lp, *hyperparameter names), in the
  declared order, and a run calls it with the LossConfig fields of those names; LossConfig's
  fields, flags, help and rules are the registry's (`LossConfig` below), so a new loss with a new
  hyperparameter is its `Hyperparameter`, this decorator and the function."""
  def add(fn):
    params = list(inspect.signature(fn).parameters)[1:]
    if params != [h.name for h in hyperparameters]:
      raise TypeError(f"loss {name}: signature {params} != declared hyperparameters")
    if not (fn.__doc__ or "").strip():
      raise TypeError(f"loss {name}: {fn.__qualname__} has no docstring (the loss table in "
                      f"WORKSPACE.md and --help describe each loss by it: its math and source)")
    if "LossConfig" in globals():
      raise ValueError(f"loss {name}: registered after LossConfig was built (configs was "
                       f"imported first); import {fn.__module__} before configs: "
                       f"python launch.py --imports={fn.__module__}")
    names = tuple(params)
    call = lambda lp, c: fn(lp, **{n: getattr(c, n) for n in names})
    LOSSES[name] = Loss(name, fn, call, hyperparameters, reference, modifiers, trl)
    return fn
  return add


# --- shared pieces --------------------------------------------------------------------------------

def _ratios(lp: Logps) -> tuple[jax.Array, jax.Array]:
  return lp.policy_chosen - lp.ref_chosen, lp.policy_rejected - lp.ref_rejected


def _counts(lp: Logps) -> tuple[jax.Array, jax.Array]:
  return jnp.maximum(lp.chosen_tokens, 1.0), jnp.maximum(lp.rejected_tokens, 1.0)


def _capped_exp(x: jax.Array) -> jax.Array:
  return jnp.exp(jnp.minimum(x, _EXP_CAP))


def _smoothed_logistic(z: jax.Array, label_smoothing: float) -> jax.Array:
  """-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)."""
  return -(1 - label_smoothing) * log_sigmoid(z) - label_smoothing * log_sigmoid(-z)


def _log1mexp(x: jax.Array) -> jax.Array:
  """log(1 - exp(x)) for x < 0, branching at -log 2 against cancellation (as TRL's ORPO)."""
  return jnp.where(x < -LN2, jnp.log1p(-jnp.exp(jnp.minimum(x, -LN2))),
                   jnp.log(-jnp.expm1(jnp.maximum(x, -LN2))))



def nll_chosen(lp: Logps, nll_per_pair: bool = False) -> jax.Array:
  """[B] negative log-likelihood of the chosen completions per token, before LD-DPO.

  Default (TRL 1.16's sft loss, CPO's and ORPO's cross-entropy): one number for the batch, the
  NLL summed over all chosen tokens divided by their count, repeated for each pair.
  nll_per_pair: each pair's mean over its own tokens (Pang et al. 2024, RPO eq. 2; Hong et al.
  2024, ORPO eq. 2), so short and long completions weigh alike.
  """
  full = lp.policy_chosen if lp.policy_chosen_full is None else lp.policy_chosen_full
  if nll_per_pair:
    return -full / jnp.maximum(lp.chosen_tokens, 1.0)
  return jnp.broadcast_to(-full.sum() / jnp.maximum(lp.chosen_tokens.sum(), 1.0), full.shape)


# --- input transforms: f-divergences and LD-DPO ---------------------------------------------------

def f_scores(lp: Logps, f_divergence: str = "reverse_kl", f_alpha: float = 0.5):
  """Per-completion f-DPO scores f'(u), u = pi / pi_ref (Wang et al. 2024, "Beyond Reverse KL",
  Thm 1), in TRL's forms (constants matter once the scores are divided by token counts):

  reverse KL: log u
  forward KL: 1 - 1 / u
  JS:         log 2 + log sigmoid(log u)        = log(2u / (1 + u))
  alpha-div:  (u^(alpha-1) - 1) / (alpha - 1)   (TRL's alpha; the paper's alpha is 1 - it)
  """
  rw, rl = _ratios(lp)
  if f_divergence == "reverse_kl" or (f_divergence == "alpha_divergence" and
                                      abs(f_alpha - 1.0) < 1e-6):
    return rw, rl
  if f_divergence == "forward_kl":
    return 1 - _capped_exp(-rw), 1 - _capped_exp(-rl)
  if f_divergence == "js_divergence":
    return LN2 + log_sigmoid(rw), LN2 + log_sigmoid(rl)
  if f_divergence == "alpha_divergence":
    a = f_alpha - 1.0
    return (_capped_exp(a * rw) - 1) / a, (_capped_exp(a * rl) - 1) / a
  raise ValueError(f"unknown f_divergence {f_divergence!r}")


def f_margin(lp: Logps, f_divergence: str = "reverse_kl", f_alpha: float = 0.5) -> jax.Array:
  """f-DPO margin f'(u_w) - f'(u_l); reverse KL gives h = rw - rl (plain DPO)."""
  sw, sl = f_scores(lp, f_divergence, f_alpha)
  return sw - sl


def length_desensitised(total: jax.Array, shared: jax.Array, ld_alpha: float) -> jax.Array:
  """LD-DPO log-prob (Liu et al. 2024, "Length Desensitization in DPO", arXiv:2409.06411): the tokens up to the pair's
  shared length count fully, the longer completion's excess tokens are scaled by alpha:
  log p~ = log p(y_{<=l_s}) + alpha * log p(y_{>l_s}). alpha = 1 is plain DPO."""
  return shared + ld_alpha * (total - shared)


# --- losses with a reference ----------------------------------------------------------------------

@register("sigmoid", BETA, LABEL_SMOOTHING, *_F, trl="DPO `sigmoid`")
def sigmoid(lp: Logps, beta, label_smoothing, f_divergence, f_alpha):
  """DPO (Rafailov et al. 2023, eq. 7) with conservative label smoothing eps (cDPO, Mitchell 2023):

  loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h); h generalised by `f_margin`.
  TRL 1.16's sigmoid has no label smoothing (it is TRL's loss at eps = 0); cDPO is kept here.
  """
  return _smoothed_logistic(beta * f_margin(lp, f_divergence, f_alpha), label_smoothing), {}


@register("robust", BETA, LABEL_SMOOTHING, *_F, trl="DPO `robust`")
def robust(lp: Logps, beta, label_smoothing, f_divergence, f_alpha):
  """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO", the de-biased loss), unbiased under label flips
  with rate eps: [-(1 - eps) log sig(beta h) + eps log sig(-beta h)] / (1 - 2 eps)."""
  z = beta * f_margin(lp, f_divergence, f_alpha)
  losses = (-(1 - label_smoothing) * log_sigmoid(z) + label_smoothing * log_sigmoid(-z))
  return losses / (1 - 2 * label_smoothing), {}


@register("hinge", BETA, *_F, trl="DPO `hinge`")
def hinge(lp: Logps, beta, f_divergence, f_alpha):
  """SLiC-HF calibration hinge (Zhao et al. 2023; the rank-calibration hinge, on the DPO margin h):
  max(0, 1 - beta h), i.e. a margin of 1/beta on h."""
  return jax.nn.relu(1.0 - beta * f_margin(lp, f_divergence, f_alpha)), {}


@register("ipo", BETA, *_F, trl="DPO `ipo`")
def ipo(lp: Logps, beta, f_divergence, f_alpha):
  """IPO (Azar et al. 2023, "A General Theoretical Paradigm", the sampled IPO loss): (h - 1/(2 tau))^2 with
  tau = beta, on per-token AVERAGE log-ratios (the f-scores divided by token counts, as TRL)."""
  sw, sl = f_scores(lp, f_divergence, f_alpha)
  nc, nr = _counts(lp)
  return (sw / nc - sl / nr - 1.0 / (2.0 * beta)) ** 2, {}


@register("exo_pair", BETA, EXO_EPSILON, *_F, trl="DPO `exo_pair` (`label_smoothing`=eps)")
def exo_pair(lp: Logps, beta, exo_epsilon, f_divergence, f_alpha):
  """EXO, pairwise (Ji et al. 2024, "Towards Efficient Exact Optimization of LM Alignment", pairwise EXO):
  KL(p_theta || p_target) between the model's preference p = sigmoid(beta h) and the smoothed
  label (1 - eps, eps), eps > 0."""
  eps = exo_epsilon
  z = beta * f_margin(lp, f_divergence, f_alpha)
  p = jax.nn.sigmoid(z)
  losses = p * (log_sigmoid(z) - jnp.log1p(-eps)) + (1 - p) * (log_sigmoid(-z) - jnp.log(eps))
  return losses, {}


@register("nca_pair", BETA, trl="DPO `nca_pair`")
def nca_pair(lp: Logps, beta):
  """NCA, pairwise (Chen et al. 2024, "Noise Contrastive Alignment", pairwise NCA) with r = beta * ratio:
  -log sig(r_w) - 1/2 log sig(-r_w) - 1/2 log sig(-r_l)."""
  rw, rl = _ratios(lp)
  zw, zl = beta * rw, beta * rl
  return -log_sigmoid(zw) - 0.5 * log_sigmoid(-zw) - 0.5 * log_sigmoid(-zl), {}


@register("bco_pair", BETA, BCO_SHIFT, trl="DPO `bco_pair` (`bco_shift` off)")
def bco_pair(lp: Logps, beta, bco_shift):
  """BCO on pairs (Jung et al. 2024, "Binary Classifier Optimization", with reward shift delta): chosen -> 1,
  rejected -> 0: -log sig(beta rw - delta) - log sig(-(beta rl - delta)).

  bco_shift off: delta = 0, as TRL 1.16. On: delta = the mean reward of the current global batch
  (chosen and rejected, no gradient); the paper keeps delta as a moving average over batches,
  the batch mean keeps the step pure (no loss state in TrainState).
  """
  rw, rl = _ratios(lp)
  zw, zl = beta * rw, beta * rl
  if not bco_shift:
    return -log_sigmoid(zw) - log_sigmoid(-zl), {}
  delta = jax.lax.stop_gradient(jnp.concatenate([zw, zl]).mean())
  return -log_sigmoid(zw - delta) - log_sigmoid(-(zl - delta)), {"bco/delta": delta}


@register("sppo_hard", BETA, trl="DPO `sppo_hard`")
def sppo_hard(lp: Logps, beta):
  """SPPO with hard labels (Wu et al. 2024, "Self-Play Preference Optimization", the SPPO
  square loss with P(y_w > y_l) = 1, eta = 1/beta): (rw - 1/(2 beta))^2 + (rl + 1/(2 beta))^2."""
  rw, rl = _ratios(lp)
  return (rw - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2, {}


# Sorting across the batch misaligns per-pair weights, so AOT takes no WPO (TRL refuses it too).
@register("aot", BETA, LABEL_SMOOTHING, modifiers=("rpo", "ld"), trl="DPO `aot`")
def aot(lp: Logps, beta, label_smoothing):
  """AOT, paired (Melnyk et al. 2024, "Distributional Preference Alignment via Optimal Transport"):
  the batch's sorted policy log-ratios log pi(y_w)/pi(y_l) must dominate the sorted
  reference ones; logistic loss on the sorted differences."""
  pol = jnp.sort(lp.policy_chosen - lp.policy_rejected)
  ref = jnp.sort(lp.ref_chosen - lp.ref_rejected)
  return _smoothed_logistic(beta * (pol - ref), label_smoothing), {}


@register("aot_unpaired", BETA, LABEL_SMOOTHING, modifiers=("rpo", "ld"),
          trl="DPO `aot_unpaired`")
def aot_unpaired(lp: Logps, beta, label_smoothing):
  """AOT, unpaired (Melnyk et al. 2024): the sorted chosen ratios rw must dominate the
  sorted rejected ratios rl across the batch; logistic loss on the sorted differences."""
  rw, rl = _ratios(lp)
  return _smoothed_logistic(beta * (jnp.sort(rw) - jnp.sort(rl)), label_smoothing), {}


@register("apo_zero", BETA, trl="DPO `apo_zero`")
def apo_zero(lp: Logps, beta):
  """APO-zero (D'Oosterlinck et al. 2024, "Anchored Preference Optimization"): raise the
  chosen and lower the rejected likelihood: (1 - sig(beta rw)) + sig(beta rl)."""
  rw, rl = _ratios(lp)
  return (1 - jax.nn.sigmoid(beta * rw)) + jax.nn.sigmoid(beta * rl), {}


@register("apo_down", BETA, trl="DPO `apo_down`")
def apo_down(lp: Logps, beta):
  """APO-down (D'Oosterlinck et al. 2024, "Anchored Preference Optimization"): lower both likelihoods, the rejected more:
  sig(beta rw) + (1 - sig(beta (rw - rl)))."""
  rw, rl = _ratios(lp)
  return jax.nn.sigmoid(beta * rw) + (1 - jax.nn.sigmoid(beta * (rw - rl))), {}


@register("discopop", BETA, DISCOPOP_TAU, *_F, trl="DPO `discopop`")
def discopop(lp: Logps, beta, discopop_tau, f_divergence, f_alpha):
  """DiscoPOP / log-ratio modulated loss (Lu et al. 2024, "Discovering Preference Optimization
  Algorithms", LRML): with z = beta h and m = sig(z / tau), (1 - m) * -log sig(z) + m * exp(-z).

  m * exp(-z) is computed as exp(log sig(z / tau) - z), finite wherever the product is.
  """
  z = beta * f_margin(lp, f_divergence, f_alpha)
  log_m = log_sigmoid(z / discopop_tau)
  m = jnp.exp(log_m)
  losses = (1 - m) * -log_sigmoid(z) + _capped_exp(log_m - z)
  return losses, {"discopop/modulation": m.mean()}


@register("sigmoid_norm", BETA, *_F, trl="DPO `sigmoid_norm`")
def sigmoid_norm(lp: Logps, beta, f_divergence, f_alpha):
  """Length-normalised DPO (LN-DPO; Ahrabian et al. 2024, "A Practical Analysis of Human Alignment
  with *PO"): DPO eq. 7 on per-token AVERAGE log-ratios (the f-scores divided by token counts)."""
  sw, sl = f_scores(lp, f_divergence, f_alpha)
  nc, nr = _counts(lp)
  return -log_sigmoid(beta * (sw / nc - sl / nr)), {}


# --- reference-free losses ------------------------------------------------------------------------
# TRL's CPO and ORPO trainers have no RPO, WPO or LD-DPO; `sft` (TRL's DPO loss type) takes WPO.

@register("sft", NLL_PER_PAIR, reference=False, modifiers=("wpo",), trl="DPO `sft`")
def sft(lp: Logps, nll_per_pair):
  """Supervised NLL on the chosen completion (the NLL term of RPO, Pang et al. 2024; no reference,
  averaged as `nll_chosen` says)."""
  nll = nll_chosen(lp, nll_per_pair)
  return nll, {"sft/nll": nll.mean()}


def _simpo_reward_margin(lp: Logps, simpo_beta, alpha=None) -> jax.Array:
  """[B] r_w - r_l with SimPO's reward r = beta * AVERAGE log-prob (AlphaPO's: beta (1 - p^-alpha)
  / alpha, p = exp(average)); the loss subtracts gamma from it, the logged margin does not (TRL's
  CPOTrainer logs rewards/margins without gamma)."""
  nc, nr = _counts(lp)
  aw, al = lp.policy_chosen / nc, lp.policy_rejected / nr
  if alpha is not None:
    aw, al = (1 - _capped_exp(-alpha * aw)) / alpha, (1 - _capped_exp(-alpha * al)) / alpha
  return simpo_beta * (aw - al)


@register("simpo", SIMPO_BETA, SIMPO_GAMMA, LABEL_SMOOTHING, reference=False, modifiers=(),
          trl="CPO `simpo`, `cpo_alpha`=0, `beta`=simpo_beta")
def simpo(lp: Logps, simpo_beta, simpo_gamma, label_smoothing):
  """SimPO (Meng et al. 2024, eq. 6): reward = beta * AVERAGE log-prob, no reference;
  -log sig(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma) (label smoothing as cDPO)."""
  margin = _simpo_reward_margin(lp, simpo_beta)
  return (_smoothed_logistic(margin - simpo_gamma, label_smoothing),
          {"simpo/reward_margin": margin.mean()})


@register("cpo_simpo", SIMPO_BETA, SIMPO_GAMMA, LABEL_SMOOTHING, CPO_ALPHA, NLL_PER_PAIR,
          reference=False, modifiers=(), trl="CPO `simpo`, `beta`=simpo_beta")
def cpo_simpo(lp: Logps, simpo_beta, simpo_gamma, label_smoothing, cpo_alpha, nll_per_pair):
  """SimPO with CPO's NLL term (Meng et al. 2024, eq. 6, plus Xu et al. 2024's L_NLL, as TRL's CPO
  trainer runs loss_type simpo): `simpo` + alpha * NLL(y_w)."""
  margin = _simpo_reward_margin(lp, simpo_beta)
  nll = nll_chosen(lp, nll_per_pair)
  return _smoothed_logistic(margin - simpo_gamma, label_smoothing) + cpo_alpha * nll, {
      "simpo/reward_margin": margin.mean(), "cpo/nll": nll.mean()}


@register("alphapo", SIMPO_BETA, SIMPO_GAMMA, ALPHAPO_ALPHA, LABEL_SMOOTHING, reference=False,
          modifiers=(), trl="CPO `alphapo`, `alpha`=alphapo_alpha, `beta`=simpo_beta")
def alphapo(lp: Logps, simpo_beta, simpo_gamma, alphapo_alpha, label_smoothing):
  """AlphaPO (Gupta et al. 2025, "AlphaPO: Reward Shape Matters for LLM Alignment", arXiv:2501.03884): SimPO
  with the reward r = beta (1 - p^-alpha) / alpha, p = exp(AVERAGE log-prob):
  -log sig(r_w - r_l - gamma) (label smoothing as cDPO); alpha -> 0 is SimPO."""
  margin = _simpo_reward_margin(lp, simpo_beta, alphapo_alpha)
  return (_smoothed_logistic(margin - simpo_gamma, label_smoothing),
          {"alphapo/reward_margin": margin.mean()})


@register("cpo", BETA, CPO_ALPHA, LABEL_SMOOTHING, NLL_PER_PAIR, reference=False, modifiers=(),
          trl="CPO `sigmoid`")
def cpo(lp: Logps, beta, cpo_alpha, label_smoothing, nll_per_pair):
  """CPO (Xu et al. 2024, "Contrastive Preference Optimization": L_prefer + L_NLL): DPO with a
  uniform reference, -log sig(beta (log pi(y_w) - log pi(y_l))), plus alpha * NLL(y_w)."""
  nll = nll_chosen(lp, nll_per_pair)
  pref = _smoothed_logistic(beta * (lp.policy_chosen - lp.policy_rejected), label_smoothing)
  return pref + cpo_alpha * nll, {"cpo/nll": nll.mean()}


@register("cpo_hinge", BETA, CPO_ALPHA, NLL_PER_PAIR, reference=False, modifiers=(),
          trl="CPO `hinge`")
def cpo_hinge(lp: Logps, beta, cpo_alpha, nll_per_pair):
  """CPO, hinge variant (Xu et al. 2024, with SLiC's hinge of Zhao et al. 2023 as L_prefer):
  max(0, 1 - beta (log pi(y_w) - log pi(y_l))) + alpha * NLL(y_w)."""
  nll = nll_chosen(lp, nll_per_pair)
  pref = jax.nn.relu(1.0 - beta * (lp.policy_chosen - lp.policy_rejected))
  return pref + cpo_alpha * nll, {"cpo/nll": nll.mean()}


@register("cpo_ipo", BETA, CPO_ALPHA, NLL_PER_PAIR, reference=False, modifiers=(),
          trl="CPO `ipo`")
def cpo_ipo(lp: Logps, beta, cpo_alpha, nll_per_pair):
  """CPO, IPO variant (Xu et al. 2024, with IPO's square loss of Azar et al. 2023 as L_prefer):
  (avg log pi(y_w) - avg log pi(y_l) - 1/(2 beta))^2 on per-token AVERAGE log-probs (as TRL),
  plus alpha * NLL(y_w)."""
  nc, nr = _counts(lp)
  nll = nll_chosen(lp, nll_per_pair)
  pref = (lp.policy_chosen / nc - lp.policy_rejected / nr - 1.0 / (2.0 * beta)) ** 2
  return pref + cpo_alpha * nll, {"cpo/nll": nll.mean()}


@register("orpo", ORPO_LAMBDA, NLL_PER_PAIR, reference=False, modifiers=(),
          trl="ORPO (`beta`=lambda)")
def orpo(lp: Logps, orpo_lambda, nll_per_pair):
  """ORPO (Hong et al. 2024, eqs. 6-7): NLL(y_w) + lambda * -log sig(log odds(y_w) - log odds(y_l)),
  odds(y) = P / (1 - P) with P = exp(AVERAGE log-prob of y).

  The NLL covers the completion tokens, as the paper's eq. 2; TRL 1.16's ORPO trainer also counts
  the prompt's tokens in it (tests/test_losses_trl.py names the difference).
  """
  nc, nr = _counts(lp)
  # log P is capped just below 0 so that log(1 - P) stays finite.
  avg_w = jnp.minimum(lp.policy_chosen / nc, -1e-6)
  avg_l = jnp.minimum(lp.policy_rejected / nr, -1e-6)
  log_odds = (avg_w - avg_l) - (_log1mexp(avg_w) - _log1mexp(avg_l))
  ratio = log_sigmoid(log_odds)
  nll = nll_chosen(lp, nll_per_pair)
  return nll - orpo_lambda * ratio, {"orpo/log_odds_ratio": ratio.mean(),
                                     "orpo/log_odds_chosen": log_odds.mean(),
                                     "orpo/nll": nll.mean()}


# --- combination and statistics -------------------------------------------------------------------

def wpo_weight(wpo_logw_B2: jax.Array) -> jax.Array:
  """WPO pair weight (Zhou et al. 2024, "WPO: Weighted Preference Optimization", eq. 2 with weight
  alignment): w = exp(mean_t logw(y_w) + mean_t logw(y_l)), no gradient, unclamped as in TRL."""
  return jax.lax.stop_gradient(jnp.exp(wpo_logw_B2.sum(-1)))


def combined(lp: Logps, cfg, wpo_logw_B2: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """(scalar loss, metrics): the mean over pairs of sum_i w_i * loss_i over cfg.loss_type (a
  LossConfig), plus RPO's alpha * NLL(y_w) (Pang et al. 2024, "Iterative Reasoning Preference
  Optimization": DPO + NLL), each pair's total weighted by WPO if given (TRL weights its sft
  term, its RPO, alike)."""
  per_pair = jnp.zeros_like(lp.policy_chosen)
  metrics = {}
  for name, w in zip(cfg.loss_type, cfg.weights):
    l, m = LOSSES[name].call(lp, cfg)
    per_pair = per_pair + w * l
    metrics.update(m)
    if len(cfg.loss_type) > 1:
      metrics[f"loss/{name}"] = l.mean()
  if cfg.rpo_alpha:
    nll = nll_chosen(lp, cfg.nll_per_pair)
    per_pair = per_pair + cfg.rpo_alpha * nll
    metrics["rpo/nll"] = nll.mean()
  if wpo_logw_B2 is not None:
    weight = wpo_weight(wpo_logw_B2)
    per_pair = per_pair * weight
    metrics["wpo/weight"] = weight.mean()
  return per_pair.mean(), metrics


def pair_statistics(lp: Logps, beta: float) -> dict[str, jax.Array]:
  """Implicit rewards r = beta * (log pi - log pi_ref) and log-probs, averaged over the pairs,
  under the names TRL reports. Training logs them per batch (jax arrays); evaluation over all
  held-out pairs (numpy arrays: only array methods are used, so either works)."""
  rc = beta * (lp.policy_chosen - lp.ref_chosen)
  rr = beta * (lp.policy_rejected - lp.ref_rejected)
  return {
      "rewards/chosen": rc.mean(),
      "rewards/rejected": rr.mean(),
      "rewards/accuracies": (rc > rr).astype(jnp.float32).mean(),
      "rewards/margins": (rc - rr).mean(),
      "logps/chosen": lp.policy_chosen.mean(),
      "logps/rejected": lp.policy_rejected.mean(),
  }


# --- the config section ---------------------------------------------------------------------------

def hyperparameters() -> dict[str, Hyperparameter]:
  """Every loss and modifier hyperparameter by name (each defined once, shared by losses)."""
  out = {}
  for h in [h for loss in LOSSES.values() for h in loss.hyperparameters] + list(MODIFIERS.values()):
    if out.setdefault(h.name, h) is not h:
      raise TypeError(f"two hyperparameters are named {h.name}")
  return out


def readers(name: str) -> list[str]:
  """The losses that read hyperparameter `name` (as theirs or through a modifier)."""
  mods = {m for m, h in MODIFIERS.items() if h.name == name}
  h = hyperparameters()[name]
  if h.modifier:
    mods.add(h.modifier)
  return [l.name for l in LOSSES.values()
          if any(x.name == name for x in l.hyperparameters) or mods & set(l.modifiers)]


def _validate(cfg) -> None:
  """Values in range (`rules`: the registry's tests), and (`check`) no hyperparameter set that
  the selected losses do not read: none of them, or (`every`) one of them that reads the
  reference."""
  rules(cfg, loss_type=(lambda v: bool(v) and set(v) <= set(LOSSES) and len(set(v)) == len(v),
                        f"losses from {', '.join(LOSSES)}, each at most once"),
        **{name: (h.valid, h.rule) for name, h in hyperparameters().items()})
  chosen = shown(cfg.loss_type)
  check(not cfg.loss_weights or len(cfg.loss_weights) == len(cfg.loss_type),
        f"--loss_weights={shown(cfg.loss_weights)}: must be one weight per loss of "
        f"--loss_type={chosen}")
  for name, h in hyperparameters().items():
    value = getattr(cfg, name)
    if value == h.default or name == BETA.name:  # beta also scales every reported reward
      continue
    who = readers(name)
    if h.modifier:  # read through a modifier only while that modifier is on
      mod = MODIFIERS[h.modifier]
      if getattr(cfg, mod.name) == mod.default:
        who = [l for l in who if any(x.name == name for x in LOSSES[l].hyperparameters)]
    check(bool(set(who) & set(cfg.loss_type)),
          f"--{name}={shown(value)}: must go with a loss that reads it ({', '.join(who)}); "
          f"none of --loss_type={chosen} does")
    ignoring = [t for t in cfg.loss_type if LOSSES[t].reference and t not in who]
    check(not (h.every and ignoring),
          f"--{name}={shown(value)}: must apply to every loss of --loss_type={chosen} that "
          f"reads the reference; {', '.join(ignoring)} does not (it applies to {', '.join(who)})")
    if h.read_when:
      field, wanted = h.read_when
      check(getattr(cfg, field) == wanted,
            f"--{name}={shown(value)}: must go with --{field}={wanted} (read only there)")


def _field(h: Hyperparameter):
  """The LossConfig field of hyperparameter `h`: the registry's default and help."""
  return dataclasses.field(default=h.default, metadata={"help": h.help})


class _LossConfigMethods:
  """What LossConfig adds to its fields."""

  def __post_init__(self):
    _validate(self)

  @property
  def weights(self) -> tuple[float, ...]:
    return self.loss_weights or (1.0,) * len(self.loss_type)

  @property
  def reference_free(self) -> bool:
    return not any(LOSSES[t].reference for t in self.loss_type)


def _build_config() -> type:
  """The preference objective: which losses, their weights, and one field per hyperparameter of
  the registry (losses' and modifiers'), in the order each first appears there, with its
  default, help and type; `_validate` checks its value against the `Hyperparameter`'s rule and
  which losses read it. Built from the registry, so a hyperparameter is declared once."""
  config = dataclasses.make_dataclass(
      "LossConfig",
      [("loss_type", tuple[str, ...], dataclasses.field(default=("sigmoid",), metadata={
          "help": f"Comma-separated losses, from {', '.join(LOSSES)}."})),
       ("loss_weights", tuple[float, ...], dataclasses.field(default=(), metadata={
           "help": "Weights of loss_type's losses (empty = all 1.0)."})),
       *((h.name, type(h.default), _field(h)) for h in hyperparameters().values())],
      bases=(_LossConfigMethods,), frozen=True)
  config.__module__ = __name__  # pickling and reprs name it here
  config.__doc__ = ("The preference objective: loss_type, loss_weights and one field per loss "
                    "or modifier hyperparameter of the registry (dpo/losses.py).")
  return config


def __getattr__(name: str):
  """`LossConfig`, built from the registry when first asked for (configs.py asks when it builds
  `Config`), so a loss registered in a fork's own module imported before that (`launch.py
  --imports=MODULE`) gets its fields, flags, help and checks as a built-in one does."""
  if name == "LossConfig":
    globals()["LossConfig"] = _build_config()
    return globals()["LossConfig"]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _citation(doc: str) -> str:
  """A docstring's text up to the parenthesis that closes its first "(" (the citation)."""
  depth = 0
  for i, ch in enumerate(doc):
    depth += (ch == "(") - (ch == ")")
    if ch == ")" and depth == 0:
      return doc[:i + 1]
  return doc


def table() -> str:
  """The markdown table of the registry (WORKSPACE.md carries it; a test keeps them equal)."""
  rows = ["| loss | reference | hyperparameters (defaults) | modifiers | TRL 1.16 | source |",
          "|---|---|---|---|---|---|"]
  for l in LOSSES.values():
    hps = ", ".join(f"`{h.name}={h.default}`" for h in l.hyperparameters) or "-"
    source = _citation(" ".join(l.fn.__doc__.split()))
    rows.append(f"| `{l.name}` | {'yes' if l.reference else 'no'} | {hps} | "
                f"{', '.join(l.modifiers) or '-'} | {l.trl} | {source} |")
  return "\n".join(rows)

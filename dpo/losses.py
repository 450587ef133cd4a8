"""Preference losses as pure functions of per-sequence log-probs, and the registry of them.

Every loss takes a `Logps` (summed log-probs of chosen and rejected completions under the policy
and the reference, plus token counts) and exactly the hyperparameters it declares, and returns
(per-pair losses [B], extra metrics). `register` puts a loss in `LOSSES` together with everything
about it: its hyperparameters (name, default, help, valid range), whether it reads the reference,
and which modifiers (RPO, WPO, LD-DPO) combine with it. The `loss` config section (`LossConfig`,
built at the end of this module), its flags, its validation, `--help` and the loss table in
WORKSPACE.md (`table`) are all derived from the registry, so adding a loss touches this module
only. `combined` applies the weights and the modifiers; the trainer never contains loss logic.
LD-DPO and the f-divergences change the inputs to the losses rather than the losses, see
`length_desensitised` and `f_margin`.

Notation: rw = log pi(y_w) - log pi_ref(y_w), rl likewise for y_l (summed over tokens unless a
loss says "average"); h = rw - rl, the DPO margin before beta.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

log_sigmoid = jax.nn.log_sigmoid

# exp() arguments are capped here so that forward-KL / alpha-divergence terms stay finite at
# extreme log-ratios (float32 exp overflows near 88); the gradient beyond the cap is zero.
_EXP_CAP = 50.0


class Logps(NamedTuple):
  policy_chosen: jax.Array    # [B] summed log pi(y_w | x), nats
  policy_rejected: jax.Array  # [B] summed log pi(y_l | x)
  ref_chosen: jax.Array       # [B] summed log pi_ref(y_w | x) (zeros when reference-free)
  ref_rejected: jax.Array     # [B] summed log pi_ref(y_l | x)
  chosen_tokens: jax.Array    # [B] completion token counts
  rejected_tokens: jax.Array  # [B]

  def averaged(self) -> "Logps":
    """Per-token average log-probs (same fields divided by the token counts)."""
    nc, nr = jnp.maximum(self.chosen_tokens, 1.0), jnp.maximum(self.rejected_tokens, 1.0)
    return self._replace(policy_chosen=self.policy_chosen / nc,
                         policy_rejected=self.policy_rejected / nr,
                         ref_chosen=self.ref_chosen / nc, ref_rejected=self.ref_rejected / nr)


# --- the registry ---------------------------------------------------------------------------------

class Hyperparameter(NamedTuple):
  """One loss hyperparameter: a field of the `loss` config section and a flag of the same name."""
  name: str
  default: Any
  help: str
  valid: Callable[[Any], bool] = lambda v: True
  rule: str = ""                     # what `valid` demands, for the error message
  read_when: tuple[str, Any] | None = None  # (field, value): only read when that field has it


class Loss(NamedTuple):
  name: str
  fn: Callable
  hyperparameters: tuple[Hyperparameter, ...]
  reference: bool                    # reads reference log-probs (False: reference-free)
  modifiers: tuple[str, ...]         # names in MODIFIERS that combine with it

  def apply(self, lp: Logps, values) -> tuple[jax.Array, dict]:
    """The loss on `lp`, reading its hyperparameters from `values` (a LossConfig or a dict)."""
    get = values.get if isinstance(values, dict) else lambda k: getattr(values, k)
    return self.fn(lp, **{h.name: get(h.name) for h in self.hyperparameters})


LOSSES: dict[str, Loss] = {}

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")

BETA = Hyperparameter(
    "beta", 0.1, "Inverse temperature beta (strength of the KL anchor); also scales the implicit "
    "rewards beta * log(pi / pi_ref) reported for every loss.", lambda v: v > 0, "> 0")
LABEL_SMOOTHING = Hyperparameter(
    "label_smoothing", 0.0, "Label noise eps (conservative DPO, robust DPO, EXO).",
    lambda v: 0.0 <= v < 0.5, "in [0, 0.5)")
F_DIVERGENCE = Hyperparameter(
    "f_divergence", "reverse_kl", f"f-DPO divergence (Wang et al. 2024), from {F_DIVERGENCES}.",
    lambda v: v in F_DIVERGENCES, f"one of {F_DIVERGENCES}")
F_ALPHA = Hyperparameter(
    "f_alpha", 0.5, "Alpha of the alpha-divergence f-DPO variant.", lambda v: 0.0 < v <= 1.0,
    "in (0, 1]", read_when=("f_divergence", "alpha_divergence"))
DISCOPOP_TAU = Hyperparameter(
    "discopop_tau", 0.05, "DiscoPOP temperature of the log-ratio modulation (Lu et al. 2024).",
    lambda v: v > 0, "> 0")
SIMPO_BETA = Hyperparameter(
    "simpo_beta", 2.0, "SimPO reward scale beta on average log-probs (Meng et al. 2024).",
    lambda v: v > 0, "> 0")
SIMPO_GAMMA = Hyperparameter(
    "simpo_gamma", 1.0, "SimPO target reward margin gamma (Meng et al. 2024: gamma/beta = 0.5).")
CPO_ALPHA = Hyperparameter(
    "cpo_alpha", 1.0, "CPO weight of the NLL term on the chosen completion (Xu et al. 2024).",
    lambda v: v >= 0, ">= 0")
ORPO_LAMBDA = Hyperparameter(
    "orpo_lambda", 0.1, "ORPO weight lambda of the odds-ratio term (Hong et al. 2024).",
    lambda v: v >= 0, ">= 0")

# Modifiers act on the combination (dpo.train.dpo_step and `combined`), not inside a loss.
MODIFIERS: dict[str, Hyperparameter] = {
    "rpo": Hyperparameter(
        "rpo_alpha", 0.0, "RPO: add alpha * mean NLL of the chosen completion (Pang et al. 2024 "
        "use 1.0); 0 disables.", lambda v: v >= 0, ">= 0"),
    "wpo": Hyperparameter(
        "wpo", False, "WPO: weight each pair by its (clamped) length-normalised policy "
        "probability (Zhou et al. 2024)."),
    "ld": Hyperparameter(
        "ld_alpha", 1.0, "LD-DPO (Liu et al. 2024): weight of log-probs past the pair's shared "
        "length; 1.0 disables, values in (0, 1) desensitise to length.",
        lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
}
_F = (F_DIVERGENCE, F_ALPHA)


def register(name: str, *hyperparameters: Hyperparameter, reference: bool = True,
             modifiers: tuple[str, ...] = tuple(MODIFIERS)):
  """Decorator: adds the loss to LOSSES; its signature must be (lp, *hyperparameter names)."""
  def add(fn):
    params = list(inspect.signature(fn).parameters)[1:]
    if params != [h.name for h in hyperparameters]:
      raise TypeError(f"loss {name}: signature {params} != declared hyperparameters")
    LOSSES[name] = Loss(name, fn, hyperparameters, reference, modifiers)
    return fn
  return add


# --- shared pieces --------------------------------------------------------------------------------

def _ratios(lp: Logps) -> tuple[jax.Array, jax.Array]:
  return lp.policy_chosen - lp.ref_chosen, lp.policy_rejected - lp.ref_rejected


def _capped_exp(x: jax.Array) -> jax.Array:
  return jnp.exp(jnp.minimum(x, _EXP_CAP))


def _smoothed_logistic(z: jax.Array, label_smoothing: float) -> jax.Array:
  """-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)."""
  return -(1 - label_smoothing) * log_sigmoid(z) - label_smoothing * log_sigmoid(-z)


def nll_chosen(lp: Logps) -> jax.Array:
  """[B] mean negative log-likelihood per token of the chosen completion."""
  return -lp.policy_chosen / jnp.maximum(lp.chosen_tokens, 1.0)


# --- input transforms: f-divergences and LD-DPO ---------------------------------------------------

def f_margin(lp: Logps, f_divergence: str = "reverse_kl", f_alpha: float = 0.5) -> jax.Array:
  """f-DPO margin f'(u_w) - f'(u_l), u = pi / pi_ref (Wang et al. 2024, "Beyond Reverse KL", Thm 1).

  reverse KL: f'(u) = log u + 1            -> rw - rl (plain DPO)
  forward KL: f'(u) = -1 / u               -> exp(-rl) - exp(-rw)
  JS:         f'(u) = log(2u / (1 + u))    -> (rw - softplus(rw)) - (rl - softplus(rl))
  alpha-div:  f'(u) = (1 - u^-alpha)/alpha -> (exp(-alpha rl) - exp(-alpha rw)) / alpha
  """
  rw, rl = _ratios(lp)
  if f_divergence == "reverse_kl":
    return rw - rl
  if f_divergence == "js_divergence":
    return (rw - jax.nn.softplus(rw)) - (rl - jax.nn.softplus(rl))
  a = 1.0 if f_divergence == "forward_kl" else f_alpha
  if f_divergence in ("forward_kl", "alpha_divergence"):
    return (_capped_exp(-a * rl) - _capped_exp(-a * rw)) / a
  raise ValueError(f"unknown f_divergence {f_divergence!r}")


def length_desensitised(total: jax.Array, shared: jax.Array, ld_alpha: float) -> jax.Array:
  """LD-DPO log-prob (Liu et al. 2024, "Length Desensitization in DPO", arXiv:2409.06411): the tokens up to the pair's
  shared length count fully, the longer completion's excess tokens are scaled by alpha:
  log p~ = log p(y_{<=l_s}) + alpha * log p(y_{>l_s}). alpha = 1 is plain DPO."""
  return shared + ld_alpha * (total - shared)


# --- losses with a reference ----------------------------------------------------------------------

@register("sigmoid", BETA, LABEL_SMOOTHING, *_F)
def sigmoid(lp: Logps, beta, label_smoothing, f_divergence, f_alpha):
  """DPO (Rafailov et al. 2023, eq. 7) with conservative label smoothing eps (cDPO, Mitchell 2023):

  loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h); h generalised by `f_margin`.
  """
  return _smoothed_logistic(beta * f_margin(lp, f_divergence, f_alpha), label_smoothing), {}


@register("robust", BETA, LABEL_SMOOTHING, *_F)
def robust(lp: Logps, beta, label_smoothing, f_divergence, f_alpha):
  """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO", the de-biased loss), unbiased under label flips
  with rate eps: [-(1 - eps) log sig(beta h) + eps log sig(-beta h)] / (1 - 2 eps)."""
  z = beta * f_margin(lp, f_divergence, f_alpha)
  losses = (-(1 - label_smoothing) * log_sigmoid(z) + label_smoothing * log_sigmoid(-z))
  return losses / (1 - 2 * label_smoothing), {}


@register("hinge", BETA, *_F)
def hinge(lp: Logps, beta, f_divergence, f_alpha):
  """SLiC-HF calibration hinge (Zhao et al. 2023; the rank-calibration hinge, on the DPO margin h):
  max(0, 1 - beta h), i.e. a margin of 1/beta on h."""
  return jax.nn.relu(1.0 - beta * f_margin(lp, f_divergence, f_alpha)), {}


@register("ipo", BETA)
def ipo(lp: Logps, beta):
  """IPO (Azar et al. 2023, "A General Theoretical Paradigm", the sampled IPO loss): (h - 1/(2 tau))^2 with
  tau = beta, on per-token AVERAGE log-probs as the authors specify for sequences."""
  rw, rl = _ratios(lp.averaged())
  return (rw - rl - 1.0 / (2.0 * beta)) ** 2, {}


@register("exo_pair", BETA, LABEL_SMOOTHING, *_F)
def exo_pair(lp: Logps, beta, label_smoothing, f_divergence, f_alpha):
  """EXO, pairwise (Ji et al. 2024, "Towards Efficient Exact Optimization of LM Alignment", pairwise EXO):
  KL(p_theta || p_target) between the model's preference p = sigmoid(beta h) and the smoothed
  label (1 - eps, eps); eps = 1e-3 when label_smoothing is 0 (the KL needs eps > 0)."""
  eps = label_smoothing if label_smoothing > 0 else 1e-3
  z = beta * f_margin(lp, f_divergence, f_alpha)
  p = jax.nn.sigmoid(z)
  losses = p * (log_sigmoid(z) - jnp.log1p(-eps)) + (1 - p) * (log_sigmoid(-z) - jnp.log(eps))
  return losses, {}


@register("nca_pair", BETA)
def nca_pair(lp: Logps, beta):
  """NCA, pairwise (Chen et al. 2024, "Noise Contrastive Alignment", pairwise NCA) with r = beta * ratio:
  -log sig(r_w) - 1/2 log sig(-r_w) - 1/2 log sig(-r_l)."""
  rw, rl = _ratios(lp)
  zw, zl = beta * rw, beta * rl
  return -log_sigmoid(zw) - 0.5 * log_sigmoid(-zw) - 0.5 * log_sigmoid(-zl), {}


@register("bco_pair", BETA)
def bco_pair(lp: Logps, beta):
  """BCO on pairs (Jung et al. 2024, "Binary Classifier Optimization", with reward shift delta): chosen -> 1,
  rejected -> 0, rewards beta * ratio shifted by delta = mean reward of the batch (chosen and
  rejected, no gradient): -log sig(beta rw - delta) - log sig(-(beta rl - delta)).

  The paper keeps delta as a moving average over batches; here it is the current global batch's
  mean, which keeps the step pure (no loss state in TrainState).
  """
  rw, rl = _ratios(lp)
  zw, zl = beta * rw, beta * rl
  delta = jax.lax.stop_gradient(jnp.concatenate([zw, zl]).mean())
  return -log_sigmoid(zw - delta) - log_sigmoid(-(zl - delta)), {"bco/delta": delta}


@register("sppo_hard", BETA)
def sppo_hard(lp: Logps, beta):
  """SPPO with hard labels (Wu et al. 2024, "Self-Play Preference Optimization", the SPPO
  square loss with P(y_w > y_l) = 1, eta = 1/beta): (rw - 1/(2 beta))^2 + (rl + 1/(2 beta))^2."""
  rw, rl = _ratios(lp)
  return (rw - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2, {}


@register("aot", BETA, LABEL_SMOOTHING)
def aot(lp: Logps, beta, label_smoothing):
  """AOT, paired (Melnyk et al. 2024, "Distributional Preference Alignment via Optimal Transport"):
  the batch's sorted policy log-ratios log pi(y_w)/pi(y_l) must dominate the sorted
  reference ones; logistic loss on the sorted differences."""
  pol = jnp.sort(lp.policy_chosen - lp.policy_rejected)
  ref = jnp.sort(lp.ref_chosen - lp.ref_rejected)
  return _smoothed_logistic(beta * (pol - ref), label_smoothing), {}


@register("aot_unpaired", BETA, LABEL_SMOOTHING)
def aot_unpaired(lp: Logps, beta, label_smoothing):
  """AOT, unpaired (Melnyk et al. 2024): the sorted chosen ratios rw must dominate the
  sorted rejected ratios rl across the batch; logistic loss on the sorted differences."""
  rw, rl = _ratios(lp)
  return _smoothed_logistic(beta * (jnp.sort(rw) - jnp.sort(rl)), label_smoothing), {}


@register("apo_zero", BETA)
def apo_zero(lp: Logps, beta):
  """APO-zero (D'Oosterlinck et al. 2024, "Anchored Preference Optimization"): raise the
  chosen and lower the rejected likelihood: (1 - sig(beta rw)) + sig(beta rl)."""
  rw, rl = _ratios(lp)
  return (1 - jax.nn.sigmoid(beta * rw)) + jax.nn.sigmoid(beta * rl), {}


@register("apo_down", BETA)
def apo_down(lp: Logps, beta):
  """APO-down (D'Oosterlinck et al. 2024, "Anchored Preference Optimization"): lower both likelihoods, the rejected more:
  sig(beta rw) + (1 - sig(beta (rw - rl)))."""
  rw, rl = _ratios(lp)
  return jax.nn.sigmoid(beta * rw) + (1 - jax.nn.sigmoid(beta * (rw - rl))), {}


@register("discopop", BETA, DISCOPOP_TAU, *_F)
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


@register("sigmoid_norm", BETA, LABEL_SMOOTHING)
def sigmoid_norm(lp: Logps, beta, label_smoothing):
  """Length-normalised DPO (LN-DPO; Ahrabian et al. 2024, "A Practical Analysis of Human Alignment
  with *PO"): DPO eq. 7 on per-token AVERAGE log-probs of policy and reference."""
  rw, rl = _ratios(lp.averaged())
  return _smoothed_logistic(beta * (rw - rl), label_smoothing), {}


# --- reference-free losses ------------------------------------------------------------------------

@register("sft", reference=False)
def sft(lp: Logps):
  """Supervised NLL on the chosen completion, mean per token of each pair (no reference)."""
  nll = nll_chosen(lp)
  return nll, {"sft/nll": nll.mean()}


@register("simpo", SIMPO_BETA, SIMPO_GAMMA, LABEL_SMOOTHING, reference=False)
def simpo(lp: Logps, simpo_beta, simpo_gamma, label_smoothing):
  """SimPO (Meng et al. 2024, eq. 6): reward = beta * AVERAGE log-prob, no reference;
  -log sig(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma) (label smoothing as cDPO)."""
  nc, nr = jnp.maximum(lp.chosen_tokens, 1.0), jnp.maximum(lp.rejected_tokens, 1.0)
  margin = simpo_beta * (lp.policy_chosen / nc - lp.policy_rejected / nr)
  return _smoothed_logistic(margin - simpo_gamma, label_smoothing), {
      "simpo/reward_margin": margin.mean()}


@register("cpo", BETA, CPO_ALPHA, LABEL_SMOOTHING, reference=False)
def cpo(lp: Logps, beta, cpo_alpha, label_smoothing):
  """CPO (Xu et al. 2024, "Contrastive Preference Optimization": L_prefer + L_NLL): DPO with a
  uniform reference, -log sig(beta (log pi(y_w) - log pi(y_l))), plus alpha * NLL(y_w)."""
  nll = nll_chosen(lp)
  pref = _smoothed_logistic(beta * (lp.policy_chosen - lp.policy_rejected), label_smoothing)
  return pref + cpo_alpha * nll, {"cpo/nll": nll.mean()}


@register("orpo", ORPO_LAMBDA, reference=False)
def orpo(lp: Logps, orpo_lambda):
  """ORPO (Hong et al. 2024, eqs. 6-7): NLL(y_w) + lambda * -log sig(log odds(y_w) - log odds(y_l)),
  odds(y) = P / (1 - P) with P = exp(AVERAGE log-prob of y)."""
  nc, nr = jnp.maximum(lp.chosen_tokens, 1.0), jnp.maximum(lp.rejected_tokens, 1.0)
  # log(1 - P) = log(-expm1(log P)); log P is capped just below 0 so it stays finite.
  avg_w = jnp.minimum(lp.policy_chosen / nc, -1e-6)
  avg_l = jnp.minimum(lp.policy_rejected / nr, -1e-6)
  log_odds = (avg_w - avg_l) - (jnp.log(-jnp.expm1(avg_w)) - jnp.log(-jnp.expm1(avg_l)))
  ratio = log_sigmoid(log_odds)
  nll = nll_chosen(lp)
  return nll - orpo_lambda * ratio, {"orpo/log_odds_ratio": ratio.mean(),
                                     "orpo/log_odds_chosen": log_odds.mean(),
                                     "orpo/nll": nll.mean()}


# --- combination and statistics -------------------------------------------------------------------

def wpo_weight(wpo_logw_B2: jax.Array) -> jax.Array:
  """WPO pair weight (Zhou et al. 2024, "WPO: Weighted Preference Optimization", with weight alignment):
  w = min(1, exp(mean_t logw(y_w) + mean_t logw(y_l))), no gradient."""
  return jax.lax.stop_gradient(jnp.exp(jnp.minimum(wpo_logw_B2.sum(-1), 0.0)))


def combined(lp: Logps, cfg, wpo_logw_B2: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """(scalar loss, metrics): sum_i w_i * loss_i over cfg.loss_type (a LossConfig), each pair
  weighted by WPO if given, plus RPO's alpha * NLL(y_w) (Pang et al. 2024, "Iterative Reasoning
  Preference Optimization": DPO + NLL)."""
  per_pair = jnp.zeros_like(lp.policy_chosen)
  metrics = {}
  for name, w in zip(cfg.loss_type, cfg.weights):
    l, m = LOSSES[name].apply(lp, cfg)
    per_pair = per_pair + w * l
    metrics.update(m)
    if len(cfg.loss_type) > 1:
      metrics[f"loss/{name}"] = l.mean()
  if wpo_logw_B2 is not None:
    weight = wpo_weight(wpo_logw_B2)
    per_pair = per_pair * weight
    metrics["wpo/weight"] = weight.mean()
  if cfg.rpo_alpha:
    nll = nll_chosen(lp)
    per_pair = per_pair + cfg.rpo_alpha * nll
    metrics["rpo/nll"] = nll.mean()
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
  mod = next((m for m, h in MODIFIERS.items() if h.name == name), None)
  return [l.name for l in LOSSES.values()
          if any(h.name == name for h in l.hyperparameters) or mod in l.modifiers]


def _validate(cfg) -> None:
  """Values in range, and no hyperparameter set that none of the selected losses reads."""
  bad = [t for t in cfg.loss_type if t not in LOSSES]
  if bad or not cfg.loss_type or len(set(cfg.loss_type)) < len(cfg.loss_type):
    raise ValueError(f"--loss_type={','.join(cfg.loss_type) or '(empty)'}: each must appear once, "
                     f"from {', '.join(LOSSES)}")
  if cfg.loss_weights and len(cfg.loss_weights) != len(cfg.loss_type):
    raise ValueError(f"--loss_weights={cfg.loss_weights} must have one weight per --loss_type "
                     f"{cfg.loss_type}")
  for name, h in hyperparameters().items():
    value = getattr(cfg, name)
    if not h.valid(value):
      raise ValueError(f"--{name} must be {h.rule}, got {value!r}")
    if value == h.default or name == BETA.name:  # beta also scales every reported reward
      continue
    who = readers(name)
    if not set(who) & set(cfg.loss_type):
      raise ValueError(f"--{name}={value!r} is read by none of --loss_type={','.join(cfg.loss_type)}"
                       f" (it applies to {', '.join(who)})")
    if h.read_when and getattr(cfg, h.read_when[0]) != h.read_when[1]:
      raise ValueError(f"--{name}={value!r} is read only with --{h.read_when[0]}={h.read_when[1]}")


def _make_config_class():
  fields = [
      ("loss_type", tuple[str, ...], dataclasses.field(default=("sigmoid",), metadata={
          "help": f"Comma-separated losses, from {', '.join(LOSSES)}."})),
      ("loss_weights", tuple[float, ...], dataclasses.field(default=(), metadata={
          "help": "Weights of loss_type's losses (empty = all 1.0)."})),
  ]
  fields += [(h.name, type(h.default), dataclasses.field(default=h.default, metadata={"help": h.help}))
             for h in hyperparameters().values()]
  namespace = {
      "__post_init__": _validate,
      "weights": property(lambda self: self.loss_weights or (1.0,) * len(self.loss_type)),
      "reference_free": property(lambda self: not any(LOSSES[t].reference for t in self.loss_type)),
      "__module__": __name__,
      "__doc__": "The preference objective: which losses, their weights and hyperparameters "
                 "(derived from dpo.losses.LOSSES and MODIFIERS).",
  }
  return dataclasses.make_dataclass("LossConfig", fields, frozen=True, namespace=namespace)


LossConfig = _make_config_class()


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
  rows = ["| loss | reference | hyperparameters | modifiers | source |", "|---|---|---|---|---|"]
  for l in LOSSES.values():
    hps = ", ".join(f"`{h.name}`" for h in l.hyperparameters) or "-"
    source = _citation(" ".join(l.fn.__doc__.split()))
    rows.append(f"| `{l.name}` | {'yes' if l.reference else 'no'} | {hps} | "
                f"{', '.join(l.modifiers)} | {source} |")
  return "\n".join(rows)

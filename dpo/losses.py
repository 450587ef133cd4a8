"""Preference losses as pure functions of per-sequence log-probs.

Every loss takes a `Logps` (summed log-probs of chosen and rejected completions under the policy
and the reference, plus token counts) and keyword hyperparameters, and returns (per-pair losses
[B], extra metrics). Each function reads the hyperparameters it needs and ignores the rest, so
`combined` can pass one dict to all of them. The trainer averages the losses; it never contains
loss logic. `LOSSES` is the registry that `--loss_type` selects from; `combined` applies the
weights and the modifiers (RPO, WPO). LD-DPO and the f-divergences change the inputs to the
losses rather than the losses, see `length_desensitised` and `f_margin`.

Notation: rw = log pi(y_w) - log pi_ref(y_w), rl likewise for y_l (summed over tokens unless a
loss says "average"); h = rw - rl, the DPO margin before beta.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

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

def f_margin(lp: Logps, f_divergence: str = "reverse_kl", f_alpha: float = 0.5, **_) -> jax.Array:
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

def sigmoid(lp: Logps, beta: float, label_smoothing: float = 0.0, **hp):
  """DPO (Rafailov et al. 2023, eq. 7) with conservative label smoothing eps (cDPO, Mitchell 2023):

  loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h); h generalised by `f_margin`.
  """
  return _smoothed_logistic(beta * f_margin(lp, **hp), label_smoothing), {}


def robust(lp: Logps, beta: float, label_smoothing: float = 0.0, **hp):
  """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO", the de-biased loss), unbiased under label flips
  with rate eps: [-(1 - eps) log sig(beta h) + eps log sig(-beta h)] / (1 - 2 eps)."""
  z = beta * f_margin(lp, **hp)
  losses = (-(1 - label_smoothing) * log_sigmoid(z) + label_smoothing * log_sigmoid(-z))
  return losses / (1 - 2 * label_smoothing), {}


def hinge(lp: Logps, beta: float, **hp):
  """SLiC-HF calibration hinge (Zhao et al. 2023; the rank-calibration hinge, on the DPO margin h):
  max(0, 1 - beta h), i.e. a margin of 1/beta on h."""
  return jax.nn.relu(1.0 - beta * f_margin(lp, **hp)), {}


def ipo(lp: Logps, beta: float, **_):
  """IPO (Azar et al. 2023, "A General Theoretical Paradigm", the sampled IPO loss): (h - 1/(2 tau))^2 with
  tau = beta, on per-token AVERAGE log-probs as the authors specify for sequences."""
  rw, rl = _ratios(lp.averaged())
  return (rw - rl - 1.0 / (2.0 * beta)) ** 2, {}


def exo_pair(lp: Logps, beta: float, label_smoothing: float = 0.0, **hp):
  """EXO, pairwise (Ji et al. 2024, "Towards Efficient Exact Optimization of LM Alignment", pairwise EXO):
  KL(p_theta || p_target) between the model's preference p = sigmoid(beta h) and the smoothed
  label (1 - eps, eps); eps = 1e-3 when label_smoothing is 0 (the KL needs eps > 0)."""
  eps = label_smoothing if label_smoothing > 0 else 1e-3
  z = beta * f_margin(lp, **hp)
  p = jax.nn.sigmoid(z)
  losses = p * (log_sigmoid(z) - jnp.log1p(-eps)) + (1 - p) * (log_sigmoid(-z) - jnp.log(eps))
  return losses, {}


def nca_pair(lp: Logps, beta: float, **_):
  """NCA, pairwise (Chen et al. 2024, "Noise Contrastive Alignment", pairwise NCA) with r = beta * ratio:
  -log sig(r_w) - 1/2 log sig(-r_w) - 1/2 log sig(-r_l)."""
  rw, rl = _ratios(lp)
  zw, zl = beta * rw, beta * rl
  return -log_sigmoid(zw) - 0.5 * log_sigmoid(-zw) - 0.5 * log_sigmoid(-zl), {}


def bco_pair(lp: Logps, beta: float, **_):
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


def sppo_hard(lp: Logps, beta: float, **_):
  """SPPO with hard labels (Wu et al. 2024, "Self-Play Preference Optimization", the SPPO
  square loss with P(y_w > y_l) = 1, eta = 1/beta): (rw - 1/(2 beta))^2 + (rl + 1/(2 beta))^2."""
  rw, rl = _ratios(lp)
  return (rw - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2, {}


def aot(lp: Logps, beta: float, label_smoothing: float = 0.0, **_):
  """AOT, paired (Melnyk et al. 2024, "Distributional Preference Alignment via Optimal Transport"):
  the batch's sorted policy log-ratios log pi(y_w)/pi(y_l) must dominate the sorted
  reference ones; logistic loss on the sorted differences."""
  pol = jnp.sort(lp.policy_chosen - lp.policy_rejected)
  ref = jnp.sort(lp.ref_chosen - lp.ref_rejected)
  return _smoothed_logistic(beta * (pol - ref), label_smoothing), {}


def aot_unpaired(lp: Logps, beta: float, label_smoothing: float = 0.0, **_):
  """AOT, unpaired (Melnyk et al. 2024): the sorted chosen ratios rw must dominate the
  sorted rejected ratios rl across the batch; logistic loss on the sorted differences."""
  rw, rl = _ratios(lp)
  return _smoothed_logistic(beta * (jnp.sort(rw) - jnp.sort(rl)), label_smoothing), {}


def apo_zero(lp: Logps, beta: float, **_):
  """APO-zero (D'Oosterlinck et al. 2024, "Anchored Preference Optimization"): raise the
  chosen and lower the rejected likelihood: (1 - sig(beta rw)) + sig(beta rl)."""
  rw, rl = _ratios(lp)
  return (1 - jax.nn.sigmoid(beta * rw)) + jax.nn.sigmoid(beta * rl), {}


def apo_down(lp: Logps, beta: float, **_):
  """APO-down (D'Oosterlinck et al. 2024, "Anchored Preference Optimization"): lower both likelihoods, the rejected more:
  sig(beta rw) + (1 - sig(beta (rw - rl)))."""
  rw, rl = _ratios(lp)
  return jax.nn.sigmoid(beta * rw) + (1 - jax.nn.sigmoid(beta * (rw - rl))), {}


def discopop(lp: Logps, beta: float, discopop_tau: float = 0.05, **hp):
  """DiscoPOP / log-ratio modulated loss (Lu et al. 2024, "Discovering Preference Optimization
  Algorithms", LRML): with z = beta h and m = sig(z / tau), (1 - m) * -log sig(z) + m * exp(-z).

  m * exp(-z) is computed as exp(log sig(z / tau) - z), finite wherever the product is.
  """
  z = beta * f_margin(lp, **hp)
  log_m = log_sigmoid(z / discopop_tau)
  m = jnp.exp(log_m)
  losses = (1 - m) * -log_sigmoid(z) + _capped_exp(log_m - z)
  return losses, {"discopop/modulation": m.mean()}


def sigmoid_norm(lp: Logps, beta: float, label_smoothing: float = 0.0, **_):
  """Length-normalised DPO (LN-DPO; Ahrabian et al. 2024, "A Practical Analysis of Human Alignment
  with *PO"): DPO eq. 7 on per-token AVERAGE log-probs of policy and reference."""
  rw, rl = _ratios(lp.averaged())
  return _smoothed_logistic(beta * (rw - rl), label_smoothing), {}


def sft(lp: Logps, **_):
  """Supervised NLL on the chosen completion, mean per token of each pair (no reference)."""
  nll = nll_chosen(lp)
  return nll, {"sft/nll": nll.mean()}


# --- reference-free losses ------------------------------------------------------------------------

def simpo(lp: Logps, simpo_beta: float = 2.0, simpo_gamma: float = 1.0,
          label_smoothing: float = 0.0, **_):
  """SimPO (Meng et al. 2024, eq. 6): reward = beta * AVERAGE log-prob, no reference;
  -log sig(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma) (label smoothing as cDPO)."""
  nc, nr = jnp.maximum(lp.chosen_tokens, 1.0), jnp.maximum(lp.rejected_tokens, 1.0)
  margin = simpo_beta * (lp.policy_chosen / nc - lp.policy_rejected / nr)
  return _smoothed_logistic(margin - simpo_gamma, label_smoothing), {
      "simpo/reward_margin": margin.mean()}


def cpo(lp: Logps, beta: float, cpo_alpha: float = 1.0, label_smoothing: float = 0.0, **_):
  """CPO (Xu et al. 2024, "Contrastive Preference Optimization": L_prefer + L_NLL): DPO with a
  uniform reference, -log sig(beta (log pi(y_w) - log pi(y_l))), plus alpha * NLL(y_w)."""
  nll = nll_chosen(lp)
  pref = _smoothed_logistic(beta * (lp.policy_chosen - lp.policy_rejected), label_smoothing)
  return pref + cpo_alpha * nll, {"cpo/nll": nll.mean()}


def orpo(lp: Logps, orpo_lambda: float = 0.1, **_):
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


LOSSES: dict[str, Callable] = {
    "sigmoid": sigmoid, "robust": robust, "hinge": hinge, "ipo": ipo, "exo_pair": exo_pair,
    "nca_pair": nca_pair, "bco_pair": bco_pair, "sppo_hard": sppo_hard, "aot": aot,
    "aot_unpaired": aot_unpaired, "apo_zero": apo_zero, "apo_down": apo_down,
    "discopop": discopop, "sigmoid_norm": sigmoid_norm, "sft": sft,
    "simpo": simpo, "cpo": cpo, "orpo": orpo,
}


def hyperparameters(cfg) -> dict:
  """The keyword hyperparameters every loss is called with, from a Config."""
  l = cfg.loss
  return dict(beta=cfg.train.beta, label_smoothing=cfg.train.label_smoothing,
              f_divergence=l.f_divergence, f_alpha=l.f_alpha, discopop_tau=l.discopop_tau,
              simpo_beta=l.simpo_beta, simpo_gamma=l.simpo_gamma, cpo_alpha=l.cpo_alpha,
              orpo_lambda=l.orpo_lambda)


def wpo_weight(wpo_logw_B2: jax.Array) -> jax.Array:
  """WPO pair weight (Zhou et al. 2024, "WPO: Weighted Preference Optimization", with weight alignment):
  w = min(1, exp(mean_t logw(y_w) + mean_t logw(y_l))), no gradient."""
  return jax.lax.stop_gradient(jnp.exp(jnp.minimum(wpo_logw_B2.sum(-1), 0.0)))


def combined(lp: Logps, loss_types, weights, hp: dict, rpo_alpha: float = 0.0,
             wpo_logw_B2: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """(scalar loss, metrics): sum_i w_i * loss_i, each pair weighted by WPO if given, plus RPO's
  alpha * NLL(y_w) (Pang et al. 2024, "Iterative Reasoning Preference Optimization": DPO + NLL)."""
  per_pair = jnp.zeros_like(lp.policy_chosen)
  metrics = {}
  for name, w in zip(loss_types, weights):
    l, m = LOSSES[name](lp, **hp)
    per_pair = per_pair + w * l
    metrics.update(m)
    if len(loss_types) > 1:
      metrics[f"loss/{name}"] = l.mean()
  if wpo_logw_B2 is not None:
    weight = wpo_weight(wpo_logw_B2)
    per_pair = per_pair * weight
    metrics["wpo/weight"] = weight.mean()
  if rpo_alpha:
    nll = nll_chosen(lp)
    per_pair = per_pair + rpo_alpha * nll
    metrics["rpo/nll"] = nll.mean()
  return per_pair.mean(), metrics


def reward_metrics(lp: Logps, beta: float) -> dict[str, jax.Array]:
  """Implicit rewards r = beta * (log pi - log pi_ref), under the names TRL reports."""
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

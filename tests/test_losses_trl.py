"""dpo/losses.py against TRL 1.16's own loss code, the oracle users compare with.

The same random per-token log-probs go into TRL's trainers and into ours. TRL's trainers are
built with `object.__new__` and the attributes their loss methods read; a stub model stands for
the network: for DPOTrainer it returns the per-token log-probs (its fused LM head's output), for
CPOTrainer and ORPOTrainer two-token logits whose log-softmax is exactly those log-probs, so
TRL's own log-prob, length-averaging and cross-entropy code runs. Every case is equal to 1e-5,
or a test says which deliberate difference it names and checks that difference exactly. For
SimPO, CPO-SimPO and AlphaPO the logged reward margin is compared too (TRL's rewards/margins).
"""

import contextlib
import types

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
from trl.experimental.cpo.cpo_trainer import CPOTrainer  # noqa: E402
from trl.experimental.orpo.orpo_trainer import ORPOTrainer  # noqa: E402

from dpo import losses  # noqa: E402

B, T, PROMPT = 8, 40, 3
TOL = dict(rtol=1e-5, atol=1e-5)


# --- inputs -----------------------------------------------------------------------------------------

def make_inputs(seed, prompt=PROMPT):
  """Per-token log-probs [B, 2, T] of policy and reference (0 off the completion), the completion
  mask [B, 2, T] (tokens prompt .. prompt+n-1), WPO's log sum_v p(v)^2 per token, and the prompt's
  own per-token policy log-probs (only ORPO's NLL reads them)."""
  rng = np.random.default_rng(seed)
  n = rng.integers(3, T - prompt, (B, 2))
  pos = np.arange(T)
  mask = ((pos >= prompt) & (pos < prompt + n[..., None])).astype(np.float32)
  pol = rng.uniform(-3.0, -0.05, (B, 2, T)).astype(np.float32)
  ref = (pol + rng.normal(0, 0.3, (B, 2, T))).astype(np.float32)
  ref = np.minimum(ref, -1e-3)
  sumsq = rng.uniform(-2.5, -0.5, (B, 2, T)).astype(np.float32)
  prompt_lp = np.where(pos < prompt, pol, 0.0).astype(np.float32)
  prompt_lp[..., 0] = 0.0  # the first token is never scored
  return dict(pol=pol * mask, ref=ref * mask, mask=mask, sumsq=sumsq * mask, prompt=prompt_lp,
              prompt_mask=((pos >= 1) & (pos < prompt)).astype(np.float32))


def ours_logps(x, ld_alpha=1.0, ref_shift=0.0):
  """losses.Logps as dpo_step builds it (the shared-length sums as logprobs.pair_stats)."""
  n = x["mask"].sum(-1)
  rank = np.cumsum(x["mask"], -1)
  shared = rank <= n.min(1, keepdims=True)[..., None]
  def ld(lp):
    total, sh = lp.sum(-1), (lp * shared).sum(-1)
    return np.asarray(losses.length_desensitised(jnp.asarray(total), jnp.asarray(sh), ld_alpha))
  pol, ref = ld(x["pol"]), ld(x["ref"]) + ref_shift
  f = lambda a: jnp.asarray(a, jnp.float32)
  return losses.Logps(f(pol[:, 0]), f(pol[:, 1]), f(ref[:, 0]), f(ref[:, 1]), f(n[:, 0]),
                      f(n[:, 1]), policy_chosen_full=f(x["pol"][:, 0].sum(-1)))


def ours_metrics(x, ld_alpha=1.0, wpo=False, ref_shift=0.0, **cfg):
  """(loss, the loss's own logged metrics) of losses.combined."""
  cfg = losses.LossConfig(ld_alpha=ld_alpha, wpo=wpo, **cfg)
  logw = None
  if wpo:
    n = np.maximum(x["mask"].sum(-1), 1.0)
    logw = jnp.asarray(((x["pol"] - x["sumsq"]) * x["mask"]).sum(-1) / n, jnp.float32)
  loss, metrics = losses.combined(ours_logps(x, ld_alpha, ref_shift), cfg, logw)
  return float(loss), {k: float(v) for k, v in metrics.items()}


def ours(x, **kw):
  return ours_metrics(x, **kw)[0]


# --- TRL's DPOTrainer -------------------------------------------------------------------------------

class _Accelerator:
  device = torch.device("cpu")
  gather_for_metrics = gather = staticmethod(lambda t: t)
  autocast = staticmethod(contextlib.nullcontext)


def _concat(a):  # [B, 2, ...] -> TRL's [chosen rows; rejected rows]
  return torch.from_numpy(np.ascontiguousarray(np.concatenate([a[:, 0], a[:, 1]], 0)))


class _FusedHead:
  """Stands for a model with TRL's fused LM head: returns the given per-token log-probs."""
  training = True
  is_gradient_checkpointing = False
  _modules: dict = {}  # no submodules (accelerate's unwrap_model walks them)

  def __init__(self, lp, sumsq):
    self.lp, self.sumsq = _concat(lp)[:, 1:], _concat(sumsq)[:, 1:]

  def __call__(self, **_):
    z = torch.zeros_like(self.lp)
    return types.SimpleNamespace(log_probs=self.lp, log_sum_sq_probs=self.sumsq, entropy=z,
                                 mean_logits=z, is_top1=z.bool())


def trl_dpo_loss(x, loss_type, loss_weights=None, beta=0.1, label_smoothing=0.0,
                 f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, ld_alpha=None,
                 use_weighting=False, discopop_tau=0.05, ref_shift=0.0):
  t = object.__new__(trl_dpo.DPOTrainer)
  policy = _FusedHead(x["pol"], x["sumsq"])
  t.__dict__.update(
      model=policy, ref_model=None, accelerator=_Accelerator(), beta=beta,
      args=types.SimpleNamespace(discopop_tau=discopop_tau, gradient_checkpointing_kwargs=None),
      loss_types=list(loss_type), loss_weights=loss_weights or [1.0] * len(loss_type),
      ld_alpha=ld_alpha, f_divergence_type=f_divergence_type,
      f_alpha_divergence_coef=f_alpha_divergence_coef, label_smoothing=label_smoothing,
      use_weighting=use_weighting, precompute_ref_logps=True, aux_loss_enabled=False,
      _metrics={"train": __import__("collections").defaultdict(list)}, _total_train_tokens=0,
      _tp_size=1)
  mask = _concat(x["mask"]).long()
  inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask),
            "completion_mask": mask}
  ref_c, ref_r = t.compute_ref_log_probs(_FusedHead(x["ref"], x["sumsq"]), inputs)
  inputs.update(ref_chosen_logps=ref_c + ref_shift, ref_rejected_logps=ref_r + ref_shift)
  with torch.no_grad():
    return float(t._compute_loss(policy, inputs, return_outputs=False))


DPO_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
             "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
F_TYPES = ["sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"]
SMOOTHED = {"robust": 0.2, "aot": 0.1, "aot_unpaired": 0.3, "exo_pair": 0.05}
MAX_DIFF = []  # every compared case's |ours - TRL|, reported by test_report_max_difference


def _ours_kw(loss_type, eps):
  """Our flags for TRL's (loss types, label_smoothing)."""
  kw = {}
  if eps and any(t in ("robust", "aot", "aot_unpaired") for t in loss_type):
    kw["label_smoothing"] = eps
  if "exo_pair" in loss_type:
    kw["exo_epsilon"] = eps
  return kw


def check(a, b):
  MAX_DIFF.append(abs(a - b))
  np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("loss_type", DPO_TYPES)
def test_dpo_loss_types(loss_type, beta):
  x = make_inputs(DPO_TYPES.index(loss_type))
  eps = SMOOTHED.get(loss_type, 0.0)
  want = trl_dpo_loss(x, [loss_type], beta=beta, label_smoothing=eps)
  check(ours(x, loss_type=(loss_type,), beta=beta, **_ours_kw([loss_type], eps)), want)


@pytest.mark.parametrize("div,coef", [("forward_kl", 0.5), ("js_divergence", 0.5),
                                      ("alpha_divergence", 0.3), ("alpha_divergence", 0.8),
                                      ("alpha_divergence", 1.0)])
@pytest.mark.parametrize("loss_type", F_TYPES)
def test_dpo_f_divergences(loss_type, div, coef):
  x = make_inputs(100 + F_TYPES.index(loss_type))
  eps = SMOOTHED.get(loss_type, 0.0)
  want = trl_dpo_loss(x, [loss_type], label_smoothing=eps, f_divergence_type=div,
                      f_alpha_divergence_coef=coef)
  kw = dict(f_divergence=div, **_ours_kw([loss_type], eps))
  if div == "alpha_divergence":
    kw["f_alpha"] = coef
  if loss_type == "sft":  # sft reads no reference: TRL accepts the divergence alone, we refuse it
    kw = {}
  check(ours(x, loss_type=(loss_type,), **kw), want)


# TRL refuses WPO with aot (sorting misaligns the weights), and its sft term crashes under WPO
# (an in-place product on an expanded tensor): see test_named_difference_sft_under_wpo.
@pytest.mark.parametrize("loss_type", [t for t in DPO_TYPES if not t.startswith("aot")
                                       and t != "sft"])
def test_dpo_wpo(loss_type):
  x = make_inputs(200 + DPO_TYPES.index(loss_type))
  eps = SMOOTHED.get(loss_type, 0.0)
  want = trl_dpo_loss(x, [loss_type], label_smoothing=eps, use_weighting=True)
  check(ours(x, loss_type=(loss_type,), wpo=True, **_ours_kw([loss_type], eps)), want)


@pytest.mark.parametrize("ld_alpha", [0.25, 0.5])  # 0 is refused (drops every token past the shared length)
@pytest.mark.parametrize("loss_type", DPO_TYPES)
def test_dpo_ld(loss_type, ld_alpha):
  x = make_inputs(300 + DPO_TYPES.index(loss_type))
  eps = SMOOTHED.get(loss_type, 0.0)
  want = trl_dpo_loss(x, [loss_type], label_smoothing=eps, ld_alpha=ld_alpha)
  kw = {} if loss_type == "sft" else dict(ld_alpha=ld_alpha)  # LD leaves sft alone: refused
  check(ours(x, loss_type=(loss_type,), **kw, **_ours_kw([loss_type], eps)), want)


@pytest.mark.parametrize("loss_type", [t for t in DPO_TYPES if t != "sft"])
def test_rpo_is_trls_sft_term(loss_type):
  """Our --rpo_alpha=a is TRL's loss_type=[X, sft], loss_weights=[1, a]; with LD too."""
  x = make_inputs(400 + DPO_TYPES.index(loss_type))
  eps = SMOOTHED.get(loss_type, 0.0)
  want = trl_dpo_loss(x, [loss_type, "sft"], [1.0, 0.7], label_smoothing=eps, ld_alpha=0.5)
  got = ours(x, loss_type=(loss_type,), rpo_alpha=0.7, ld_alpha=0.5, **_ours_kw([loss_type], eps))
  check(got, want)


@pytest.mark.parametrize("types,weights,extra", [
    (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], {}),          # MPO
    (["ipo", "hinge", "discopop"], [0.3, 2.0, 0.5], dict(f_divergence_type="js_divergence")),
    (["robust", "exo_pair", "sigmoid_norm"], [1.0, 0.5, 0.25],
     dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3)),
    (["apo_zero", "apo_down", "nca_pair", "sppo_hard"], [1.0, 1.0, 0.5, 0.1],
     dict(use_weighting=True, ld_alpha=0.3)),
    (["aot", "aot_unpaired", "nca_pair"], [0.5, 0.5, 1.0], dict(ld_alpha=0.7)),
])
def test_dpo_weighted_combinations(types, weights, extra):
  x = make_inputs(500 + len(types))
  eps = 0.1 if {"robust", "exo_pair", "aot"} & set(types) else 0.0
  want = trl_dpo_loss(x, types, weights, label_smoothing=eps, **extra)
  kw = dict(loss_type=tuple(types), loss_weights=tuple(weights), **_ours_kw(types, eps))
  if "f_divergence_type" in extra:
    kw["f_divergence"] = extra["f_divergence_type"]
  if "f_alpha_divergence_coef" in extra:
    kw["f_alpha"] = extra["f_alpha_divergence_coef"]
  kw.update(wpo=extra.get("use_weighting", False), ld_alpha=extra.get("ld_alpha", 1.0))
  check(ours(x, **kw), want)


# --- deliberate differences, each checked exactly ----------------------------------------------------

def test_named_difference_sft_under_wpo():
  """TRL 1.16's sft term raises under use_weighting (`per_sequence_loss *= w` on an expanded
  tensor); its code means each loss type's per-pair loss times the pair weight, which ours does:
  RPO + WPO = TRL's weighted sigmoid + a * TRL's sft * mean(w)."""
  x = make_inputs(603)
  with pytest.raises(RuntimeError, match="memory location"):
    trl_dpo_loss(x, ["sft"], use_weighting=True)
  n = np.maximum(x["mask"].sum(-1), 1.0)
  w = np.exp(((x["pol"] - x["sumsq"]) * x["mask"]).sum(-1) / n).prod(-1)
  want = trl_dpo_loss(x, ["sigmoid"], use_weighting=True) + 0.7 * trl_dpo_loss(x, ["sft"]) * w.mean()
  check(ours(x, rpo_alpha=0.7, wpo=True), want)
  check(ours(x, loss_type=("sft",), wpo=True), trl_dpo_loss(x, ["sft"]) * w.mean())


def test_named_difference_sigmoid_label_smoothing_is_cdpo():
  """TRL 1.16's sigmoid reads no label smoothing; ours keeps cDPO (Mitchell 2023):
  (1 - eps) * TRL(pairs) + eps * TRL(pairs with chosen and rejected swapped)."""
  x = make_inputs(600)
  swapped = {k: v[:, ::-1] if v.ndim == 3 else v for k, v in x.items()}
  eps = 0.2
  want = (1 - eps) * trl_dpo_loss(x, ["sigmoid"]) + eps * trl_dpo_loss(swapped, ["sigmoid"])
  check(ours(x, label_smoothing=eps), want)
  assert abs(ours(x, label_smoothing=eps) - trl_dpo_loss(x, ["sigmoid"])) > 1e-3


def test_named_difference_bco_shift():
  """bco_shift (Jung et al. 2024's reward shift, the batch mean here): TRL 1.16 has no shift.
  Shifting the rewards by delta is TRL's bco_pair with both reference log-probs raised by
  delta / beta."""
  x, beta = make_inputs(601), 0.1
  x["ref"] = x["ref"] - 0.2 * x["mask"]  # a policy ahead of its reference: delta well off 0
  lp = ours_logps(x)
  rw, rl = lp.policy_chosen - lp.ref_chosen, lp.policy_rejected - lp.ref_rejected
  delta = float(jnp.concatenate([beta * rw, beta * rl]).mean())
  want = trl_dpo_loss(x, ["bco_pair"], ref_shift=delta / beta)
  check(ours(x, loss_type=("bco_pair",), bco_shift=True), want)
  assert abs(want - trl_dpo_loss(x, ["bco_pair"])) > 1e-3


def test_named_difference_nll_per_pair():
  """nll_per_pair (the RPO and ORPO papers' per-pair mean): TRL averages over the batch's tokens;
  the per-pair mean is TRL's sft on each pair alone, averaged."""
  x = make_inputs(602)
  one = lambda i: {k: v[i:i + 1] for k, v in x.items()}
  want = np.mean([trl_dpo_loss(one(i), ["sft"]) for i in range(B)])
  check(ours(x, loss_type=("sft",), nll_per_pair=True), want)
  assert abs(want - trl_dpo_loss(x, ["sft"])) > 1e-4


# --- TRL's CPOTrainer and ORPOTrainer ----------------------------------------------------------------

def _logits(lp_BT):
  """[N, T, 2] logits whose log-softmax at token 0 in position t - 1 is lp[:, t]."""
  lp = torch.from_numpy(lp_BT).double().clamp(max=-1e-7)
  other = torch.log(-torch.expm1(lp)) - lp
  logits = torch.zeros(*lp.shape, 2, dtype=torch.float64)
  logits[:, :-1, 1] = other[:, 1:]
  return logits.float()


class _LogitsModel:
  def __init__(self, lp):
    self.logits = _logits(np.concatenate([lp[:, 0], lp[:, 1]], 0))

  def __call__(self, *_, **__):
    return types.SimpleNamespace(logits=self.logits)


def _pair_batch(x):
  seen = (x["mask"] + np.pad(np.ones((B, 2, PROMPT)), ((0, 0), (0, 0), (0, T - PROMPT)))) > 0
  batch = {}
  for i, side in enumerate(("chosen", "rejected")):
    ids = torch.zeros(B, T, dtype=torch.long)
    batch[f"{side}_input_ids"] = ids
    batch[f"{side}_attention_mask"] = torch.from_numpy(seen[:, i].astype(np.int64))
    batch[f"{side}_labels"] = ids.masked_fill(torch.from_numpy(x["mask"][:, i] == 0), -100)
  return batch


def _trainer(cls, **attrs):
  t = object.__new__(cls)
  t.__dict__.update(accelerator=_Accelerator(), is_encoder_decoder=False, pad_token_id=0,
                    padding_value=0, aux_loss_enabled=False, **attrs)
  return t


def trl_cpo(x, loss_type, beta=0.1, label_smoothing=0.0, cpo_alpha=1.0, simpo_gamma=0.5,
            alpha=0.0):
  """(loss, logged metrics) of TRL's CPOTrainer.get_batch_loss_metrics."""
  t = _trainer(CPOTrainer, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing,
               cpo_alpha=cpo_alpha, simpo_gamma=simpo_gamma, alpha=alpha)
  with torch.no_grad():
    loss, metrics = t.get_batch_loss_metrics(_LogitsModel(x["pol"]), _pair_batch(x))
  return float(loss), metrics


def _ref_free_metrics(x, **cfg):
  return ours_metrics(dict(x, ref=np.zeros_like(x["ref"])), **cfg)


def _ref_free(x, **cfg):
  return _ref_free_metrics(x, **cfg)[0]


MARGIN = {"cpo_simpo": "simpo/reward_margin", "simpo": "simpo/reward_margin",
          "alphapo": "alphapo/reward_margin"}


def check_simpo(x, loss_type, want, simpo_gamma, **cfg):
  """Our loss and logged reward margin against TRL's (loss, metrics): the loss, and the margin
  against TRL's rewards/margins, beta (r_w - r_l) without gamma. Negative control: the margin
  less gamma (the rule before) misses TRL's by more than the tolerance."""
  loss, metrics = _ref_free_metrics(x, loss_type=(loss_type,), simpo_gamma=simpo_gamma, **cfg)
  check(loss, want[0])
  margin, trl_margin = metrics[MARGIN[loss_type]], want[1]["rewards/margins"]
  check(margin, trl_margin)
  assert not np.isclose(margin - simpo_gamma, trl_margin, **TOL)


@pytest.mark.parametrize("cpo_alpha", [0.0, 0.7])
@pytest.mark.parametrize("ours_type,trl_type,eps", [
    ("cpo", "sigmoid", 0.0), ("cpo", "sigmoid", 0.2), ("cpo_hinge", "hinge", 0.0),
    ("cpo_ipo", "ipo", 0.0), ("cpo_simpo", "simpo", 0.0), ("cpo_simpo", "simpo", 0.1)])
def test_cpo_trainer(ours_type, trl_type, eps, cpo_alpha):
  x = make_inputs(700 + len(ours_type) + int(10 * eps))
  simpo = trl_type == "simpo"
  beta = 2.5 if simpo else 0.3
  want = trl_cpo(x, trl_type, beta=beta, label_smoothing=eps, cpo_alpha=cpo_alpha,
                 simpo_gamma=1.2)
  kw = dict(simpo_beta=beta) if simpo else dict(beta=beta)
  if eps:
    kw["label_smoothing"] = eps
  if simpo:
    check_simpo(x, ours_type, want, 1.2, cpo_alpha=cpo_alpha, **kw)
  else:
    check(_ref_free(x, loss_type=(ours_type,), cpo_alpha=cpo_alpha, **kw), want[0])


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_simpo_is_cpo_simpo_without_nll(eps):
  x = make_inputs(710)
  want = trl_cpo(x, "simpo", beta=2.0, label_smoothing=eps, cpo_alpha=0.0, simpo_gamma=1.0)
  check_simpo(x, "simpo", want, 1.0, **({"label_smoothing": eps} if eps else {}))


@pytest.mark.parametrize("alpha", [0.25, 0.5, -0.3])
def test_alphapo(alpha):
  """TRL's loss_type='alphapo' is simpo with cpo_alpha=0 and the reward shape alpha."""
  x = make_inputs(720)
  want = trl_cpo(x, "simpo", beta=2.0, cpo_alpha=0.0, simpo_gamma=0.8, alpha=alpha)
  check_simpo(x, "alphapo", want, 0.8, alphapo_alpha=alpha)


def trl_orpo_loss(x, lam):
  t = _trainer(ORPOTrainer, beta=lam)
  lp = x["pol"] + x["prompt"]
  with torch.no_grad():
    return float(t.get_batch_loss_metrics(_LogitsModel(lp), _pair_batch(x))[0])


@pytest.mark.parametrize("lam", [0.1, 0.5])
def test_orpo_trainer(lam):
  """With a one-token prompt (never scored) TRL's ORPO NLL covers the completion only: equal."""
  x = make_inputs(800, prompt=1)
  check(_ref_free(x, loss_type=("orpo",), orpo_lambda=lam), trl_orpo_loss(x, lam))


def test_named_difference_orpo_nll_covers_the_prompt_in_trl():
  """TRL 1.16's ORPO trainer counts the prompt's tokens in its NLL; ours, as Hong et al. 2024
  eq. 2, the completion's only. The difference is exactly the two token means' difference."""
  x = make_inputs(801)
  lam = 0.1
  c_sum, c_n = x["pol"][:, 0].sum(), x["mask"][:, 0].sum()
  p_sum, p_n = x["prompt"][:, 0].sum(), B * x["prompt_mask"].sum()
  gap = -(c_sum + p_sum) / (c_n + p_n) + c_sum / c_n
  want = trl_orpo_loss(x, lam)
  check(_ref_free(x, loss_type=("orpo",), orpo_lambda=lam) + gap, want)
  assert abs(gap) > 1e-3


def test_report_max_difference():
  """Runs last: the largest |ours - TRL| over the cases above (pytest -s prints it)."""
  if MAX_DIFF:
    print(f"\n{len(MAX_DIFF)} cases against TRL 1.16, max |ours - TRL| = {max(MAX_DIFF):.2e}")
    assert max(MAX_DIFF) < 1e-4

"""KTO (dpo/unpaired.py) and unpaired data against TRL 1.16's own code.

The data: the unpaired format, and TRL's `unpair_preference_dataset`. The loss: TRL's
`KTOTrainer._compute_loss`, built with `object.__new__` and the attributes it reads, a stub
model standing for the network (it returns the given per-token log-probs, its fused LM head's
output, for the matched and the mismatched rows), on the same log-probs as ours.
"""

import collections
import contextlib
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpo import data as data_lib
from dpo import formats, unpaired
from dpo.tokenizer import ByteTokenizer

T = 24
TOL = dict(rtol=1e-5, atol=1e-6)


def _trl():
  """(torch, TRL's kto_trainer module); the test skips without them."""
  return pytest.importorskip("torch"), pytest.importorskip("trl.trainer.kto_trainer")


# --- unpaired data: the format, and TRL's unpairing ---------------------------------------------

def _pairs(n, seed=0):
  rng = np.random.default_rng(seed)
  word = lambda: "".join(rng.choice(list("abcdefgh"), rng.integers(1, 9)))
  return [data_lib.PreferenceRecord(word(), word(), word()) for _ in range(n)]


def test_conversion_equals_trls_unpair_preference_dataset():
  """More pairs than one of datasets' map batches (1000), so TRL's order across batches is
  checked: each batch's chosen completions, then its rejected ones."""
  datasets = pytest.importorskip("datasets")
  unpair_preference_dataset = pytest.importorskip("trl.data_utils").unpair_preference_dataset
  records = _pairs(2300)
  ds = datasets.Dataset.from_dict({k: [getattr(r, k) for r in records]
                                   for k in ("prompt", "chosen", "rejected")})
  theirs = [(r["prompt"], r["completion"], r["label"]) for r in unpair_preference_dataset(ds)]
  assert [tuple(r) for r in formats.unpair(records)] == theirs


def test_converted_rows_are_the_unpaired_records_tokenised():
  tok = ByteTokenizer()
  records = _pairs(40, seed=1)
  rows = data_lib.unpair_rows(data_lib.tokenize_pairs(records, tok, 16, 16))
  unpaired_records = formats.unpair(records)
  want = data_lib.tokenize_sft([r.example() for r in unpaired_records], tok, 16, 16)
  for k, v in want.items():
    np.testing.assert_array_equal(rows[k], v, err_msg=k)
  np.testing.assert_array_equal(rows["label"], [r.label for r in unpaired_records])


def _write(path, objs):
  path.write_text("".join(json.dumps(o) + "\n" for o in objs))
  return str(path)


def test_unpaired_records_read_from_jsonl_in_both_layouts(tmp_path):
  text = _write(tmp_path / "t.jsonl", [{"prompt": "2+2?", "completion": " 4", "label": True},
                                       {"prompt": "2+2?", "completion": " 5", "label": False}])
  chat = _write(tmp_path / "c.jsonl", [
      {"prompt": [{"role": "user", "content": "2+2?"}],
       "completion": [{"role": "assistant", "content": "4"}], "label": True}])
  assert [r for _, r in formats.iter_unpaired_records(text)] == [
      formats.UnpairedRecord("2+2?", " 4", True), formats.UnpairedRecord("2+2?", " 5", False)]
  (where, rec), = formats.iter_unpaired_records(chat)
  assert where == f"{chat}:1" and rec.label is True
  assert rec.prompt == (formats.Message("user", "2+2?"),)
  assert rec.completion == (formats.Message("assistant", "4"),)
  assert formats.is_unpaired(text) and not formats.is_unpaired(
      _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}]))


@pytest.mark.parametrize("bad, match", [
    ({"prompt": "a", "completion": "b", "label": 1}, r":2: field 'label' must be true "
                                                    r"\(desirable\) or false"),
    ({"prompt": "a", "completion": 3, "label": True}, r":2: field 'completion' must be a string"),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user",
                                                                    "content": "b"}],
      "label": True}, r":2: this record reads as conversational \(1 such records\) but 2 records"),
])
def test_unpaired_errors_are_one_line_naming_file_record_and_field(tmp_path, bad, match):
  path = _write(tmp_path / "u.jsonl", [{"prompt": "a", "completion": "b", "label": True}, bad,
                                       {"prompt": "c", "completion": "d", "label": False}])
  with pytest.raises(data_lib.DataError, match=match) as e:
    list(formats.iter_unpaired_records(path))
  assert "\n" not in str(e.value) and str(e.value).startswith(path)
  skips = formats.Skips(path)
  kept = list(formats.iter_unpaired_records(path, skips=skips))
  assert [w for w, _ in kept] == [f"{path}:1", f"{path}:3"] and skips.count == 1


def test_a_pair_stage_names_unpaired_data_and_a_mixture_of_kinds_is_refused(tmp_path):
  u = _write(tmp_path / "u.jsonl", [{"prompt": "a", "completion": "b", "label": True}])
  p = _write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
  with pytest.raises(data_lib.DataError, match="holds unpaired records .* only the kto stage"):
    list(formats.iter_records(u))
  with pytest.raises(data_lib.DataError, match="mixes unpaired records"):
    formats.is_unpaired(f"{u},{p}")


# --- the loss: TRL's KTOTrainer._compute_loss -----------------------------------------------------

def make_inputs(seed, labels):
  """Per-token log-probs [B, T] of policy and reference on the matched rows and on the
  mismatched (KL) rows of width T + 4, their completion masks, and the labels."""
  rng = np.random.default_rng(seed)
  B = len(labels)

  def rows(width, shift=0.0):
    start = rng.integers(1, 6, B)
    n = rng.integers(2, width - 6, B)
    pos = np.arange(width)
    mask = ((pos >= start[:, None]) & (pos < (start + n)[:, None])).astype(np.float32)
    pol = rng.uniform(-4.0, -0.05, (B, width)).astype(np.float32)
    ref = np.minimum(pol + rng.normal(-shift, 0.4, (B, width)), -1e-3).astype(np.float32)
    return pol * mask, ref * mask, mask

  # the mismatched pairs' reference a little below the policy, so z0 > 0 is not clamped
  return dict(main=rows(T), kl=rows(T + 4, 0.1), label=np.asarray(labels, bool))


class _Accelerator:
  device = "cpu"
  gather_for_metrics = gather = staticmethod(lambda t: t)
  autocast = staticmethod(contextlib.nullcontext)


class _FusedHead:
  """Stands for a model with TRL's fused LM head: the given per-token log-probs of the rows
  of the width it is called with (matched or mismatched)."""
  training = True
  is_gradient_checkpointing = False
  _modules: dict = {}

  def __init__(self, by_width):
    torch, _ = _trl()
    self.by_width = {w: torch.from_numpy(lp[:, 1:]) for w, lp in by_width.items()}

  def __call__(self, input_ids, **_):
    lp = self.by_width[input_ids.shape[1]]
    z = lp * 0.0
    return types.SimpleNamespace(log_probs=lp, entropy=z, mean_logits=z)


def trl_kto_loss(x, loss_type="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0):
  """(loss, the metrics TRL logs) of TRL 1.16 KTOTrainer._compute_loss on the inputs `x`."""
  torch, trl_kto = _trl()
  t = object.__new__(trl_kto.KTOTrainer)
  (pol, ref, mask), (kl_pol, kl_ref, kl_mask) = x["main"], x["kl"]
  policy = _FusedHead({T: pol, T + 4: kl_pol})
  t.__dict__.update(
      model=policy, ref_model=None, accelerator=_Accelerator(), beta=beta, loss_type=loss_type,
      desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
      calculate_KL=loss_type != "apo_zero_unpaired", precompute_ref_logps=True,
      aux_loss_enabled=False, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
      _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
  long = lambda a: torch.from_numpy(a).long()
  zeros, ones = (lambda a: torch.zeros_like(long(a))), (lambda a: torch.ones_like(long(a)))
  inputs = {"input_ids": zeros(mask), "attention_mask": ones(mask), "completion_mask": long(mask),
            "KL_input_ids": zeros(kl_mask), "KL_attention_mask": ones(kl_mask),
            "KL_completion_mask": long(kl_mask), "label": torch.from_numpy(x["label"])}
  ref_lp, ref_kl = t.compute_ref_log_probs(_FusedHead({T: ref, T + 4: kl_ref}), inputs)
  inputs.update(ref_logps=ref_lp, ref_KL_logps=ref_kl)
  with torch.no_grad():
    loss = float(t._compute_loss(policy, inputs, return_outputs=False))
  return loss, {k: v[-1] for k, v in t._metrics["train"].items()}


def ours(x, loss_type="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0):
  cfg = unpaired.KTOConfig(loss_type, desirable_weight, undesirable_weight)
  (pol, ref, _), (kl_pol, kl_ref, _) = x["main"], x["kl"]
  f = lambda a: jnp.asarray(a.sum(-1))
  z0 = unpaired.reference_point(f(kl_pol), f(kl_ref)) if cfg.reference_point else 0.0
  lp = unpaired.UnpairedLogps(f(pol), f(ref), jnp.asarray(x["label"]))
  loss, metrics = jax.jit(unpaired.kto_loss, static_argnums=(2, 3))(lp, z0, beta, cfg)
  ratio = lambda v: float(v[0] / max(float(v[1]), 1.0)) if isinstance(v, tuple) else float(v)
  return float(loss), {k: ratio(v) for k, v in metrics.items()}


LABELS = {"mixed": [True, False, True, True, False, False, True, False, False],
          "desirable only": [True] * 6, "undesirable only": [False] * 5}


@pytest.mark.parametrize("batch", LABELS)
@pytest.mark.parametrize("loss_type", unpaired.LOSS_TYPES)
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.6)])
def test_loss_and_metrics_equal_trls_kto_trainer(batch, loss_type, weights):
  x = make_inputs(len(LABELS[batch]), LABELS[batch])
  kw = dict(loss_type=loss_type, beta=0.3, desirable_weight=weights[0],
            undesirable_weight=weights[1])
  theirs_loss, theirs = trl_kto_loss(x, **kw)
  our_loss, ours_m = ours(x, **kw)
  np.testing.assert_allclose(our_loss, theirs_loss, **TOL)
  np.testing.assert_allclose(ours_m["kl"], theirs["kl"], **TOL)
  assert (ours_m["kl"] > 0) == (loss_type == "kto")
  shared = {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"} & set(theirs)
  assert shared == ({"rewards/chosen", "logps/chosen"} if batch == "desirable only" else
                    {"rewards/rejected", "logps/rejected"} if batch == "undesirable only" else
                    {"rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected"})
  for k in shared:  # TRL logs a label's figures only when the batch holds that label
    np.testing.assert_allclose(ours_m[k], theirs[k], **TOL, err_msg=k)
  if "rewards/margins" in theirs:
    np.testing.assert_allclose(ours_m["rewards/chosen"] - ours_m["rewards/rejected"],
                               theirs["rewards/margins"], **TOL)
  assert ours_m["count/chosen"] == sum(LABELS[batch])


def test_the_reference_point_is_clamped_at_zero_and_holds_no_gradient():
  """A policy below the reference on the mismatched pairs: TRL's kl clamps to 0, as z0 does;
  and z0 passes no gradient to the policy's mismatched log-probs."""
  x = make_inputs(3, LABELS["mixed"])
  pol, ref, mask = x["kl"]
  x["kl"] = (pol - 3.0 * mask, ref, mask)
  assert trl_kto_loss(x)[1]["kl"] == 0.0 == ours(x)[1]["kl"]
  grad = jax.grad(lambda p: unpaired.reference_point(p, jnp.zeros(3)))(jnp.ones(3))
  assert not np.any(np.asarray(grad))

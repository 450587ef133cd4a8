"""KTO (dpo/unpaired.py, dpo/algorithms/kto.py) and unpaired data against TRL 1.16's own code.

The data: TRL's `unpair_preference_dataset`, and `KTOTrainer._prepare_dataset` with a byte
tokenizer that tokenises as ours does (BOS, UTF-8 bytes, EOS), whose mismatched completions
(`KL_completion_ids`) our mismatched rows must equal. The loss: TRL's
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

import configs
import records
from dpo import data as data_lib
from dpo import formats, unpaired
from dpo.algorithms import kto
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


# --- the stage: mismatched rows, settings, runs -----------------------------------------------

class _ByteTokenizer:
  """TRL's tokenizer interface over our byte tokenizer's ids: BOS, the UTF-8 bytes, and the NUL
  character (TRL's EOS token text, appended to each completion) as our EOS id."""
  eos_token = "\x00"

  def __call__(self, text):
    tok = ByteTokenizer()
    return {"input_ids": [tok.bos_id] + [b if b else tok.eos_id for b in text.encode()]}


@pytest.mark.parametrize("batch", [4, 5])
def test_mismatched_rows_are_trls_kl_completions(batch):
  """TRL's `_prepare_dataset` (unpairing, tokenising, rotating each per-device batch's
  completions) and its collator's KL rows, against our converted rows' mismatched rows, batch
  by batch of TRL's sequential sampler (the last batch partial, when 5 does not divide 18)."""
  datasets = pytest.importorskip("datasets")
  _, trl_kto = _trl()
  records = _pairs(9, seed=2)
  t = object.__new__(trl_kto.KTOTrainer)
  t.__dict__.update(_tokenizer=_ByteTokenizer(), calculate_KL=True, desirable_weight=1.0,
                    undesirable_weight=1.0)
  args = types.SimpleNamespace(dataset_num_proc=None, max_length=None,
                               per_device_train_batch_size=batch)
  ds = datasets.Dataset.from_dict({k: [getattr(r, k) for r in records]
                                   for k in ("prompt", "chosen", "rejected")})
  prepared = t._prepare_dataset(ds, _ByteTokenizer(), args, "train")
  tok = ByteTokenizer()
  rows = data_lib.unpair_rows(data_lib.tokenize_pairs(records, tok, 64, 64))
  width = kto.mismatched_width(rows)
  collate = trl_kto.DataCollatorForUnpairedPreference(pad_token_id=tok.pad_id)
  for start in range(0, len(prepared), batch):
    theirs = collate([prepared[i] for i in range(start, min(start + batch, len(prepared)))])
    ours_rows = kto.mismatched_rows({k: v[start:start + batch] for k, v in rows.items()}, 1,
                                    width, tok.pad_id)
    kl_ids, kl_mask = theirs["KL_input_ids"].numpy(), theirs["KL_completion_mask"].numpy()
    L = kl_ids.shape[1]
    np.testing.assert_array_equal(ours_rows["tokens"][:, :L], kl_ids)
    np.testing.assert_array_equal(ours_rows["loss_mask"][:, :L], kl_mask)
    assert not ours_rows["segment_ids"][:, L:].any()
    np.testing.assert_array_equal(rows["label"][start:start + batch], theirs["label"].numpy())


def test_mismatched_rows_rotate_within_each_microbatch():
  """With K microbatches (rows m, m + K, ...), each example is joined to the completion of the
  one before it in its own microbatch."""
  records = _pairs(6, seed=3)
  rows = data_lib.unpair_rows(data_lib.tokenize_pairs(records, ByteTokenizer(), 32, 32))
  rows = {k: v[:8] for k, v in rows.items()}
  out = kto.mismatched_rows(rows, 2, kto.mismatched_width(rows), 256)
  prompt, completion = kto._lengths(rows)
  for i in range(8):
    j = (i - 2) % 8
    assert j % 2 == i % 2
    got = out["tokens"][i][out["loss_mask"][i] > 0]
    np.testing.assert_array_equal(got, rows["tokens"][j, prompt[j]:prompt[j] + completion[j]])


def test_settings_the_kto_stage_cannot_honour_are_one_line_errors():
  base = configs.DEFAULT.replace(stage="sft,kto")
  with pytest.raises(ValueError, match=r"^--desirable_weight=2.0: must go with a kto stage"):
    configs.DEFAULT.replace(desirable_weight=2.0)
  with pytest.raises(ValueError, match=r"^--packing=True: the kto stage"):
    base.replace(packing=True)
  with pytest.raises(ValueError, match=r"^--precompute_ref=True: the kto stage"):
    base.replace(precompute_ref=True)
  with pytest.raises(ValueError, match=r"^--kto_loss_type='x': must be kto or apo_zero"):
    base.replace(kto_loss_type="x")
  assert base.replace(undesirable_weight=0.5).kto.undesirable_weight == 0.5


def _tiny(out, **kw):
  """A tiny sft,kto run: 2 microbatches of 4 examples a step (the mismatched rows rotate within
  each), LoRA, the KL guard on."""
  return configs.DEFAULT.replace(**{
      **dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
             task_train_pairs=32, task_sft_examples=16, task_eval_pairs=8, task_eval_prompts=2,
             eval_max_new_tokens=4, global_batch_size=8, gradient_accumulation_steps=2,
             sft_steps=2, steps=4, learning_rate=1e-3, log_every=1, eval_every=0,
             checkpoint_every=2, stage="sft,kto", desirable_weight=1.2, output_dir=str(out)),
      **kw})


def _run(cfg, **kw):
  from dpo import loop
  from models import sharding
  return loop.run(cfg, mesh=sharding.make_mesh("data:2", jax.devices()[:2]), **kw)


def _records(out):
  return records.metrics(out)


@pytest.mark.slow
def test_sft_kto_on_the_embedded_task_trains_and_resumes_bitwise(tmp_path):
  """--stage=sft,kto on the embedded task's pairs (converted, 64 unpaired examples): the KTO
  records carry TRL's metric names, the policy moves off the reference (z0 > 0), and a crash
  after step 3 (last checkpoint: step 2) resumes to the uninterrupted run's records and
  weights."""
  from dpo import checkpoint
  from faults import Crash, SimulatedCrash
  from models import sharding
  whole, cut = tmp_path / "whole", tmp_path / "cut"
  summary = _run(_tiny(whole))
  with pytest.raises(SimulatedCrash):
    _run(_tiny(cut), extra_hooks={"kto": [Crash(3)]})
  _run(_tiny(cut))
  assert _records(cut) == _records(whole)
  steps = [r for r in _records(whole) if r["stage"] == "kto"]
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  from test_workspace import _rows, _section
  documented, conditional = _rows(_section("What a run directory holds"), "record")["kto"]
  assert not conditional and all(set(r) | {"tokens_per_sec"} == set(documented) | {"stage", "step"}
                                 for r in steps)
  assert all(r["count/chosen"] + r["count/rejected"] == 8 for r in steps)
  assert steps[0]["kl"] == 0.0 and steps[-1]["kl"] > 0  # the policy starts at the reference
  assert summary["kto_time_s"] > 0 and summary["eval_prompts"] == 2
  cfg = _tiny(whole)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  load = lambda d: checkpoint.load_params(str(d / "checkpoints" / "policy"), cfg.model, mesh)
  for a, b in zip(jax.tree.leaves(load(cut)), jax.tree.leaves(load(whole))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert checkpoint.read_meta(str(whole / "checkpoints" / "policy"))["stage"] == "kto"


@pytest.mark.slow
def test_sft_kto_on_an_unpaired_file(tmp_path):
  """--train_data of unpaired records: SFT on its desirable completions, KTO on every example
  as read (no conversion), the evaluation sampling the held-out examples' prompts; a pair
  stage is refused naming the file."""
  rng = np.random.default_rng(0)
  words = lambda: " ".join(rng.choice(["good", "bad", "fine", "plot"], rng.integers(1, 6)))
  path = _write(tmp_path / "u.jsonl", [{"prompt": f"q{i} " + words(), "completion": words(),
                                        "label": bool(i % 3)} for i in range(60)])
  summary = _run(_tiny(tmp_path / "run", train_data=path, eval_split=0.2,
                           lora_rank=0))
  data = summary["data"][0]
  assert data["role"] == "unpaired" and data["train_examples"] + data["held_out_examples"] == 60
  steps = [r for r in _records(tmp_path / "run") if r["stage"] == "kto"]
  assert len(steps) == 4 and all(np.isfinite(r["loss"]) for r in steps)
  assert summary["eval_prompts"] == 2 and summary["reward_accuracy"] is None
  with pytest.raises(data_lib.DataError, match=r"holds unpaired records .* the dpo stage needs "
                                               r"preference pairs"):
    _run(_tiny(tmp_path / "dpo", train_data=path, stage="sft,dpo", desirable_weight=1.0))

"""Iterative DPO (dpo/algorithms/iterative_dpo.py): each round's file is a preference file that
the project's reader and `datasets` read back, its chosen sample is the judge's higher-scored
one, the reference moves only with --iterative_ref_update, a crashed run resumes bitwise reusing
the round's file, and settings the stage cannot honour are one-line errors."""

import json
import os

import numpy as np
import pytest

import configs
import numerics
import records
from dpo import checkpoint, chat, loop, prepare
from dpo import data as data_lib
from dpo import tokenizer as tokenizer_lib
from dpo.algorithms import iterative_dpo, online_dpo
from models import sharding
from faults import Crash, SimulatedCrash
from test_online_dpo import assert_tree_bitwise
from test_checkpoint import permission_cases
from test_workspace import _documented_paths, _metric_keys, _rows, _section, _written


def length_reward(prompt, completion):
  return float(len(completion))


def _cfg(out, **kw):
  return configs.DEFAULT.replace(**{**dict(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, lora_dropout=0.0,
      task_train_pairs=64, task_sft_examples=32, task_eval_pairs=8, task_eval_prompts=4,
      global_batch_size=8, sft_steps=10, sft_learning_rate=3e-3, learning_rate=1e-3,
      log_every=1, eval_every=0, checkpoint_every=2, eval_max_new_tokens=4,
      online_max_new_tokens=8, stage="iterative_dpo", iterative_rounds=2,
      iterative_steps_per_round=3, output_dir=str(out)), **kw})


def _records(out, stage="iterative_dpo"):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if r["stage"] == stage]


def test_settings_the_iterative_stage_cannot_honour_are_one_line_errors():
  with pytest.raises(ValueError, match=r"^--iterative_rounds=3: must go with an iterative_dpo stage "
                                       r"\(--stage=sft,dpo has none\)$"):
    configs.DEFAULT.replace(iterative_rounds=3)
  base = configs.DEFAULT.replace(stage="sft,iterative_dpo")
  with pytest.raises(ValueError, match="--iterative_prompts=4: must be 0 or at least "
                                       "--global_batch_size=16"):
    base.replace(iterative_prompts=4)
  with pytest.raises(ValueError, match="--iterative_ref_update=True: the policy already becomes "
                                       "the reference each round; not with --ref_update='hard'"):
    base.replace(iterative_ref_update=True, ref_update="hard")
  with pytest.raises(ValueError, match="--iterative_ref_update=True with --ref_init_from="):
    base.replace(iterative_ref_update=True, ref_init_from="ref")
  with pytest.raises(ValueError, match="--iterative_ref_update=True: must go with a loss that "
                                       "reads the reference, not the reference-free "
                                       "--loss_type=simpo"):
    base.replace(iterative_ref_update=True, loss_type=("simpo",), rpo_alpha=0.0)
  with pytest.raises(ValueError, match="--precompute_ref=True: the online stage iterative_dpo"):
    base.replace(precompute_ref=True)
  with pytest.raises(ValueError, match="an online stage needs a judge"):
    base.replace(train_data="pairs.jsonl")
  base.replace(online_temperature=0.7, missing_eos_penalty=1.0)  # the online sampling flags


def test_a_chat_rounds_file_is_read_back_by_the_reader_and_by_datasets(tmp_path):
  """Round records of chat prompts are conversational pairs: the project's reader renders them
  with the chat template, and datasets' json builder reads the same rows."""
  datasets = pytest.importorskip("datasets")
  chats = [(("user", "Hi there"),), (("system", "Be brief."), ("user", "Name a fruit"))]
  texts = ["hello", "pear", "hey", "an apple"]  # [first samples, second samples]
  chosen = np.array([True, False])
  rows = iterative_dpo.records(chats, chosen, texts, np.array([2.0, 0.5, 1.0, 3.0]))
  path = str(tmp_path / "iterative" / "round_0.jsonl")
  sha = iterative_dpo.write_jsonl(path, rows)
  assert sha == data_lib.file_sha256(path)
  assert not os.path.exists(path + ".tmp")
  got = datasets.load_dataset("json", data_files=path, split="train").to_list()
  assert got == [json.loads(l) for l in open(path)]
  assert [g["chosen"][0]["content"] for g in got] == ["hello", "an apple"]
  assert [(g["score_chosen"], g["score_rejected"]) for g in got] == [(2.0, 1.0), (3.0, 0.5)]
  assert got[1]["prompt"] == [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Name a fruit"}]
  tok = tokenizer_lib.ByteTokenizer()
  template = chat.resolve_template("chatml", tok)
  prepared = prepare.prepare_pairs(path, prepare.Preparation(tok, template=template))
  assert prepared.report["format_conversational"] == 2
  first = prepared.train["tokens"][0, 0][prepared.train["segment_ids"][0, 0] != 0]
  assert tok.decode([int(t) for t in first if t < 256]) == (
      "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>")


@pytest.mark.slow
def test_a_tiny_run_writes_rounds_the_judge_ordered_and_moves_the_reference(tmp_path):
  """sft,iterative_dpo on the embedded task with a length judge, a missing-EOS penalty and
  --iterative_ref_update: each round's file holds the judge's ordering of the policy's samples
  (TRL's rule), the reader reads it back, the reference is the policy at each round's start (the
  first step of round 1 has zero implicit rewards, lora_dropout 0), and WORKSPACE.md's tables
  name every file and metric key the run writes."""
  datasets = pytest.importorskip("datasets")
  out = tmp_path / "run"
  penalty = 0.5
  cfg = _cfg(out, stage="sft,iterative_dpo", iterative_ref_update=True,
             missing_eos_penalty=penalty, reward_fn="tests.test_iterative_dpo:length_reward")
  summary = loop.run(cfg)
  data = loop.Data(cfg)
  for r in range(2):
    path = str(out / "iterative" / f"round_{r}.jsonl")
    rows = datasets.load_dataset("json", data_files=path, split="train").to_list()
    assert rows == [json.loads(l) for l in open(path)] and len(rows) == 3 * 8
    for row in rows:
      for side in ("chosen", "rejected"):  # the judge's score, less the penalty if unended
        assert row[f"score_{side}"] in (len(row[side]), len(row[side]) - penalty)
      assert row["score_chosen"] >= row["score_rejected"]
    prepared = prepare.prepare_pairs(path, prepare.Preparation(data.tok, template=data.template))
    kept = prepared.report["filters"]["kept"]
    assert len(prepared.train["tokens"]) == kept and kept >= 8
  steps = _records(out)
  assert [s["iterative/round"] for s in steps] == [0, 0, 0, 1, 1, 1]
  # A round's first step scores the policy against the reference it equals (LoRA's B is zero,
  # dropout off): the same function, but the policy's forward adds the adapters' exact zeros in
  # another compiled program, whose sums float32 may round otherwise (by -9.5e-8 in the margins
  # on one CPU). A summed log-prob, through the forward's contractions of at most n terms, is then
  # within tests/numerics.py's reordering bound tau of its magnitude; a mean implicit reward is
  # beta times the difference of two such log-probs, so within 2 beta tau of their magnitude.
  tau = numerics.forward_tol(cfg.model, cfg.data.max_prompt_length + cfg.data.max_target_length)
  bound = lambda s, *sides: numerics.implicit_reward_noise(
      cfg.loss.beta, tau, *(s[f"logps/{k}"] for k in sides))
  for first in (steps[0], steps[3]):
    assert abs(first["rewards/chosen"]) <= bound(first, "chosen"), first
    assert abs(first["rewards/margins"]) <= bound(first, "chosen", "rejected"), first
  # The policy moved within round 0: by more than rounding could explain.
  assert abs(steps[2]["rewards/chosen"]) > bound(steps[2], "chosen")
  assert summary["judge"] == "reward function tests.test_iterative_dpo:length_reward"

  paths, written = _documented_paths(), _written(str(out))
  assert written - set(paths) == set(), "written but not in WORKSPACE.md's table"
  with open(out / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  table = _rows(_section("What a run directory holds"), "record")
  own = set(table["iterative_dpo"][0]) - {"dpo"}  # "the `dpo` row's keys, and ..."
  dpo_always, dpo_conditional = table["dpo"]
  got = _metric_keys(records, "iterative_dpo")
  assert own | set(dpo_always) <= got, "documented as always written, not written"
  assert got - own - set(dpo_always) - set(dpo_conditional) == set(), "written, not documented"


@pytest.mark.slow
def test_a_crashed_run_resumes_bitwise_reusing_the_rounds_file(tmp_path, monkeypatch):
  """A crash after step 4 (round 1's first step; checkpoints every 2 steps, round 1 sampled
  after step 3): the rerun reuses round_1.jsonl instead of sampling it again and ends with the
  records and weights of the uninterrupted run; without --iterative_ref_update the reference
  stays the start model (nonzero implicit rewards at round 1's first step). A round file
  changed since the checkpoint is refused in one line."""
  whole, cut = tmp_path / "whole", tmp_path / "cut"
  loop.run(_cfg(whole))
  assert abs(_records(whole)[3]["rewards/chosen"]) > 1e-4
  with pytest.raises(SimulatedCrash):
    loop.run(_cfg(cut), extra_hooks={"iterative_dpo": [Crash(4)]})
  round_1 = cut / "iterative" / "round_1.jsonl"
  text = round_1.read_text()
  round_1.write_text(text.replace('"score_chosen": ', '"score_chosen": 1', 1))
  with pytest.raises(checkpoint.CheckpointError, match="round_1.jsonl: changed since the "
                                                       "checkpoint that trained on it"):
    loop.run(_cfg(cut))
  round_1.write_text(text)
  calls = []
  sample = online_dpo.Sampled.sample
  monkeypatch.setattr(online_dpo.Sampled, "sample",
                      lambda self, *a, **k: calls.append(1) or sample(self, *a, **k))
  loop.run(_cfg(cut))
  assert calls == []  # round 1 was read back, not sampled again
  assert records.metrics(cut) == records.metrics(whole)
  for r in range(2):
    name = f"iterative/round_{r}.jsonl"
    assert (cut / name).read_bytes() == (whole / name).read_bytes()
  cfg = _cfg(whole)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  assert_tree_bitwise(checkpoint.load_params(str(cut / "checkpoints" / "policy"), cfg.model, mesh),
                      checkpoint.load_params(str(whole / "checkpoints" / "policy"), cfg.model,
                                             mesh))


@pytest.mark.parametrize("real_chmod", permission_cases())
@pytest.mark.slow
def test_an_unreadable_round_file_stops_the_resume_in_one_line(tmp_path, monkeypatch,
                                                               real_chmod):
  """A crash in round 1; round_1.jsonl then unreadable (chmod 000, or simulated where root reads
  through it): the rerun stops with one line naming the file; the file and the checkpoints stay
  as they were."""
  import builtins
  from dpo import data
  out = tmp_path / "cut"
  with pytest.raises(SimulatedCrash):
    loop.run(_cfg(out), extra_hooks={"iterative_dpo": [Crash(4)]})
  round_1 = out / "iterative" / "round_1.jsonl"
  text, steps = round_1.read_bytes(), sorted(os.listdir(out / "checkpoints" / "iterative_dpo"))
  if real_chmod:
    os.chmod(round_1, 0)
  else:
    real_open, real_access = builtins.open, os.access
    denied = lambda p: isinstance(p, (str, os.PathLike)) and os.path.abspath(p) == str(round_1)
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", os.fspath(p))) if denied(p) else
        real_open(p, *a, **k))
    monkeypatch.setattr(os, "access", lambda p, mode, **k: not denied(p) and
                        real_access(p, mode, **k))
  try:
    with pytest.raises(data.DataError) as e:
      loop.run(_cfg(out))
  finally:
    os.chmod(round_1, 0o644)
    monkeypatch.undo()
  message = str(e.value)
  assert message.startswith(f"{round_1}: permission denied reading it") and "\n" not in message
  assert round_1.read_bytes() == text
  assert sorted(os.listdir(out / "checkpoints" / "iterative_dpo")) == steps

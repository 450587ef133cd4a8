"""TensorBoard and W&B mirror metrics.jsonl: read back with TensorBoard's own event reader and
W&B's own record protobuf; a resumed run's truncated file is followed from its new end."""

import glob
import json
import os
import struct
import time

import pytest

import configs
from dpo import tracking
from dpo.runner import MetricsWriter


def tensorboard_scalars(logdir) -> dict:
  """{tag: {step: value}} through TensorBoard's EventAccumulator (every event kept)."""
  from tensorboard.backend.event_processing import event_accumulator as ea
  from tensorboard.util import tensor_util
  acc = ea.EventAccumulator(str(logdir), size_guidance={ea.TENSORS: 0})
  acc.Reload()
  return {tag: {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
          for tag in acc.Tags()["tensors"]}


def wandb_history(run_dir, timeout=60.0) -> list[dict]:
  """The history rows of an offline W&B run: the .wandb transaction log (LevelDB log framing:
  32 KiB blocks of records with a 7-byte header after the 7-byte W&B file header), each record
  parsed with W&B's own protobuf. W&B's service may still be writing the log when `finish()`
  returns (a loaded machine read it with no history yet), so it is read again until it holds
  the run's exit record."""
  from wandb.proto import wandb_internal_pb2
  (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
  deadline = time.monotonic() + timeout
  while True:
    data, pos, chunk, rows, ended = open(path, "rb").read(), 7, b"", [], False
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
      if 32768 - pos % 32768 < 7:
        pos += 32768 - pos % 32768
        continue
      _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
      if kind == 0 or pos + 7 + length > len(data):  # the end, or a record still being written
        break
      chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
      if kind in (1, 4):  # FULL or LAST
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        chunk = b""
        ended |= record.WhichOneof("record_type") == "exit"
        if record.WhichOneof("record_type") == "history":
          rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in record.history.item})
    if ended:
      return rows
    assert time.monotonic() < deadline, f"{path}: no exit record {timeout:.0f} s after finish()"
    time.sleep(0.1)


def assert_mirrored(records, out, wandb=True):
  """Every number of every metrics.jsonl record is in TensorBoard (and W&B) at its step."""
  tb = tensorboard_scalars(os.path.join(out, "tb"))
  rows = wandb_history(out) if wandb else []
  for r in records:
    for tag, value in tracking.scalars(r):
      assert tb[tag][r["step"]] == pytest.approx(value, rel=1e-6), (tag, r)
      if wandb:
        stage = r["stage"]
        assert any(row.get(f"{stage}/step") == r["step"] and row.get(tag) == pytest.approx(value)
                   for row in rows), (tag, r)
  return tb


def test_mirror_forwards_every_record_the_writer_appends(tmp_path):
  cfg = configs.DEFAULT.replace(output_dir=str(tmp_path), wandb_project="test",
                                wandb_mode="offline")
  writer = MetricsWriter(str(tmp_path), ("sft", "dpo"))
  records = [{"stage": "sft", "step": 2, "loss": 5.0, "tokens_per_sec": 10.0},
             {"stage": "dpo", "step": 2, "loss": 0.69, "rewards/margins": 0.0, "kl": 0.01},
             {"stage": "eval", "step": 2, "eval/win_rate": 0.5, "eval/perplexity": None},
             {"stage": "dpo", "step": 4, "event": "rollback", "reason": "kl", "to_step": 2,
              "lr_scale": 0.1, "rollbacks": 1}]
  mirror = tracking.Mirror(cfg, writer)
  for r in records:
    writer.write(r)
  # A rollback rewinds the file to a checkpoint and writes the replayed steps again.
  writer.rewind(1, "step 2", "dpo")  # the dpo section's first record
  resumed = {"stage": "dpo", "step": 3, "loss": 0.6}
  writer.write(resumed)
  mirror.close()
  assert len(open(tmp_path / "metrics.jsonl").readlines()) == 3
  tb = assert_mirrored(records + [resumed], tmp_path)
  assert tb["dpo/rollback/lr_scale"] == {4: pytest.approx(0.1)}
  assert tb["eval/win_rate"] == {2: 0.5} and "eval/perplexity" not in tb  # nulls are skipped
  assert tb["dpo/loss"] == {2: pytest.approx(0.69), 3: pytest.approx(0.6)}


def test_missing_wandb_is_one_clear_error(tmp_path, monkeypatch):
  import builtins
  real_import = builtins.__import__
  monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (
      (_ for _ in ()).throw(ImportError(name)) if name == "wandb" else real_import(name, *a, **k)))
  cfg = configs.DEFAULT.replace(output_dir=str(tmp_path), wandb_project="p")
  with pytest.raises(tracking.MissingExtra, match=r"--wandb_project=p needs the wandb package: pip install"):
    tracking.sinks(cfg)


def test_without_tensorboard_the_run_says_how_to_get_it(tmp_path, monkeypatch, caplog):
  import builtins
  import logging
  real_import = builtins.__import__
  monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (
      (_ for _ in ()).throw(ImportError(name)) if name.startswith("tensorboard")
      else real_import(name, *a, **k)))
  with caplog.at_level(logging.INFO):
    assert tracking.sinks(configs.DEFAULT.replace(output_dir=str(tmp_path))) == []
  said = [r.getMessage() for r in caplog.records if "TensorBoard" in r.getMessage()]
  assert said == ["TensorBoard logs off (tensorboard is not installed): "
                  "pip install 'dpo-jax[tensorboard]'"]
  assert not os.path.exists(tmp_path / "tb")

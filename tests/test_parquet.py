"""dpo/data.py's Parquet and Arrow sources (files, globs of shards, save_to_disk folders) and
mixtures: the records `datasets` itself reads from the same files, the arrays the same rows give
as JSONL, a cache and fingerprint that follow every shard, TRL's mixture rows, one-line errors."""

import glob
import gzip
import json
import os
import re
import sys

import numpy as np
import pytest

import configs
from conftest import SHARED_DATA
from dpo import data, formats, identity, loop, prepare, tokenizer
from dpo.data import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

HH = os.path.join(SHARED_DATA, "hh-rlhf", "harmless-base-test.jsonl.gz")
pytestmark = pytest.mark.skipif(not os.path.exists(HH), reason="no ../shared/data")
PLAIN = (bool, int, float, str, type(None))


def _turns(text: str) -> list[dict]:
  """An HH-RLHF transcript ("\\n\\nHuman: ...\\n\\nAssistant: ...") as a message list."""
  parts = re.split(r"\n\n(Human|Assistant): ?", text)[1:]
  return [{"role": "user" if who == "Human" else "assistant", "content": said.strip()}
          for who, said in zip(parts[::2], parts[1::2])]


def _ultrafeedback(n: int, start: int = 0) -> list[dict]:
  """HH-RLHF pairs laid out as HuggingFaceH4/ultrafeedback_binarized is: a string prompt, the
  whole conversations as message lists, `messages`, scores and an id beside them."""
  with gzip.open(HH, "rt", encoding="utf-8") as f:
    hh = [json.loads(line) for _, line in zip(range(start + n), f)][start:]
  rows = []
  for i, r in enumerate(hh):
    chosen, rejected = _turns(r["chosen"]), _turns(r["rejected"])
    rows.append({"prompt": chosen[-2]["content"], "prompt_id": f"{start + i:08x}",
                 "chosen": chosen, "rejected": rejected, "messages": chosen,
                 "score_chosen": 8.5 - i % 3, "score_rejected": float(i % 5)})
  return rows


def _parquet(path, rows, row_group_size=7) -> str:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
  return str(path)


def _jsonl(path, rows) -> str:
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(path)


def _shards(tmp_path, rows, cut=23) -> str:
  """Two Parquet shards of several row groups each; the glob that names them."""
  folder = tmp_path / "uf"
  _parquet(folder / "train-00000-of-00002.parquet", rows[:cut])
  _parquet(folder / "train-00001-of-00002.parquet", rows[cut:])
  return str(folder / "train-*.parquet")


def _leaves(obj):
  if isinstance(obj, dict):
    for v in obj.values():
      yield from _leaves(v)
  elif isinstance(obj, list):
    for v in obj:
      yield from _leaves(v)
  else:
    yield obj


HOW = prepare.Preparation(tokenizer.ByteTokenizer(), max_prompt_length=96, max_target_length=64)


def _same_arrays(a: prepare.Prepared, b: prepare.Prepared) -> None:
  for part in ("train", "held"):
    x, y = getattr(a, part), getattr(b, part)
    assert (x is None) == (y is None)
    if x is not None:
      assert x.keys() == y.keys()
      for k in x:
        np.testing.assert_array_equal(x[k], y[k])


# --- reading --------------------------------------------------------------------------------

def test_parquet_shards_read_as_datasets_reads_them(tmp_path, monkeypatch):
  rows = _ultrafeedback(40)
  pattern = _shards(tmp_path, rows)
  files = sorted(glob.glob(pattern))
  assert all(pq.ParquetFile(f).num_row_groups >= 3 for f in files)
  ours = list(data.iter_objects(pattern))
  oracle = list(datasets.load_dataset("parquet", data_files=files, split="train",
                                      cache_dir=str(tmp_path / "hf")))
  assert [obj for _, obj in ours] == oracle == rows
  assert ours[17][0] == f"{files[0]} row 17" and ours[23][0] == f"{files[1]} row 0"
  assert {type(v) for _, obj in ours for v in _leaves(obj)} <= set(PLAIN)
  # Batches smaller than a row group and cutting across them read the same rows.
  monkeypatch.setattr(data, "_BATCH_ROWS", 5)
  assert list(data.iter_objects(pattern)) == ours


def test_parquet_prepares_the_arrays_its_jsonl_does(tmp_path):
  rows = _ultrafeedback(40)
  pattern, jsonl = _shards(tmp_path, rows), _jsonl(tmp_path / "uf.jsonl", rows)
  how = HOW._replace(template="chatml")
  ours, theirs = (prepare.prepare_pairs(p, how, eval_split=0.2) for p in (pattern, jsonl))
  _same_arrays(ours, theirs)
  assert ours.report["format_implicit"] == 40 and ours.held is not None
  assert ours.held_records == theirs.held_records
  # The prompt is the messages both conversations share (TRL's maybe_extract_prompt), not the
  # string `prompt` column.
  record = next(r for _, r in formats.iter_records(pattern))
  assert [m._asdict() for m in record.prompt] == rows[0]["chosen"][:-1]
  # The `messages` column is SFT data in the same files.
  sft, report = prepare.prepare_sft(pattern, how)
  sft_jsonl, _ = prepare.prepare_sft(jsonl, how)
  assert report["format_messages"] == 40
  for k in sft:
    np.testing.assert_array_equal(sft[k], sft_jsonl[k])


def test_save_to_disk_folder_reads_as_load_from_disk(tmp_path):
  rows = _ultrafeedback(30)
  folder = str(tmp_path / "saved")
  datasets.Dataset.from_list(rows).save_to_disk(folder, max_shard_size="20KB")
  with open(os.path.join(folder, "state.json")) as f:
    shards = [d["filename"] for d in json.load(f)["_data_files"]]
  assert len(shards) >= 2
  ours = list(data.iter_objects(folder))
  assert [obj for _, obj in ours] == list(datasets.load_from_disk(folder)) == rows
  assert ours[0][0] == f"{os.path.join(folder, shards[0])} row 0"
  _same_arrays(prepare.prepare_pairs(folder, HOW, eval_split=0.2),
               prepare.prepare_pairs(_jsonl(tmp_path / "uf.jsonl", rows), HOW, eval_split=0.2))
  data.check_sources("train_data", folder)  # accepted before any work


def test_arrow_ipc_file_and_plain_python_values(tmp_path):
  rows = [{"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}",
           "margin": 0.25 * i, "votes": i} for i in range(12)]
  table = pa.Table.from_pylist(rows).cast(pa.schema([
      ("prompt", pa.string()), ("chosen", pa.large_string()), ("rejected", pa.string()),
      ("margin", pa.float32()), ("votes", pa.int16())]))
  path = tmp_path / "pairs.arrow"
  with pa.ipc.new_file(str(path), table.schema) as writer:
    for batch in table.to_batches(max_chunksize=5):
      writer.write_batch(batch)
  read = [obj for _, obj in data.iter_objects(str(path))]
  assert read == rows and all(type(v) in PLAIN for obj in read for v in obj.values())
  assert formats.margins(str(path)) == {f"{path} row {i}": 0.25 * i for i in range(12)}
  out = prepare.prepare_pairs(str(path), HOW)
  np.testing.assert_array_equal(out.train["margin"], 0.25 * np.arange(12, dtype=np.float32))


# --- cache and fingerprint ------------------------------------------------------------------

def test_a_changed_shard_rebuilds_the_cache_and_changes_the_fingerprint(tmp_path):
  rows = _ultrafeedback(30)
  pattern, cache = _shards(tmp_path, rows, cut=15), str(tmp_path / "cache")
  prep = lambda value: prepare.prepare_pairs(value, HOW, cache_dir=cache).report["cache"]
  digest = lambda value: identity.fingerprint(
      configs.DEFAULT.replace(train_data=value), {}, ("train_data",), {})["train_data sha256"]
  assert (prep(pattern), prep(pattern)) == ("miss", "hit")
  before = digest(pattern)
  changed = [dict(r) for r in rows[15:]]
  changed[4]["chosen"] = changed[4]["chosen"][:-1] + [{"role": "assistant", "content": "No."}]
  _parquet(tmp_path / "uf" / "train-00001-of-00002.parquet", changed)
  assert digest(pattern) != before
  assert (prep(pattern), prep(pattern)) == ("miss", "hit")
  _parquet(tmp_path / "uf" / "train-00002-of-00002.parquet", _ultrafeedback(3, start=30))
  assert prep(pattern) == "miss"
  # A save_to_disk folder: its data files, in state.json's order.
  folder = str(tmp_path / "saved")
  datasets.Dataset.from_list(rows).save_to_disk(folder)
  assert (prep(folder), prep(folder)) == ("miss", "hit")
  before = digest(folder)
  datasets.Dataset.from_list(rows[:-1]).save_to_disk(str(tmp_path / "saved2"))
  for name in os.listdir(tmp_path / "saved2"):
    os.replace(tmp_path / "saved2" / name, os.path.join(folder, name))
  assert digest(folder) != before and prep(folder) == "miss"


# --- mixtures -------------------------------------------------------------------------------

def _mixture_sources(tmp_path) -> tuple[str, str]:
  """30 ultrafeedback-like rows in Parquet, 20 standard string pairs in JSONL."""
  a = _parquet(tmp_path / "a.parquet", _ultrafeedback(30))
  b = _jsonl(tmp_path / "b.jsonl", [{"prompt": f"beta {i}?", "chosen": f" yes {i}",
                                      "rejected": f" no {i}"} for i in range(20)])
  return a, b


@pytest.mark.parametrize("fractions", [(0.7, 0.3), (0.5, 0.5)])
def test_mixture_takes_the_rows_trl_takes(tmp_path, monkeypatch, fractions):
  a, b = _mixture_sources(tmp_path)
  value = f"{a}:{fractions[0]},{b}:{fractions[1]}"
  located, report = data.read_sources(value, formats.iter_records, "train_data")
  # TRL's get_dataset on the same files and fractions: its rows, in its order, are ours.
  from trl.scripts.utils import DatasetConfig, DatasetMixtureConfig, get_dataset
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
  mixed = get_dataset(DatasetMixtureConfig(datasets=[  # one column: TRL concatenates
      DatasetConfig(path="parquet", data_files=a, columns=["prompt"], fraction=fractions[0]),
      DatasetConfig(path="json", data_files=b, columns=["prompt"], fraction=fractions[1])]))
  prompt_of = {f"{a} row {i}": r["prompt"] for i, r in enumerate(_ultrafeedback(30))}
  prompt_of.update({f"{b}:{i + 1}": f"beta {i}?" for i in range(20)})
  assert [prompt_of[w] for w, _ in located] == mixed["train"]["prompt"]
  assert [s["taken"] for s in report] == {(0.7, 0.3): [30, 13], (0.5, 0.5): [20, 20]}[fractions]
  assert [(s["records"], s["fraction"]) for s in report] == [(30, fractions[0]),
                                                             (20, fractions[1])]
  # Each source in its own format.
  assert isinstance(located[0][1], formats.ChatRecord)
  assert isinstance(located[-1][1], formats.PreferenceRecord)
  # Through prepare: the report, the cache key, the fingerprint.
  how, cache = HOW._replace(flag="train_data"), str(tmp_path / "cache")
  out = prepare.prepare_pairs(value, how, cache_dir=cache)
  assert out.report["sources"] == report and len(out.train["tokens"]) == sum(
      s["taken"] for s in report)
  assert prepare.prepare_pairs(value, how, cache_dir=cache).report["cache"] == "hit"
  fp = lambda v: identity.fingerprint(configs.DEFAULT.replace(train_data=v), {},
                                      ("train_data",), {})["train_data sha256"]
  assert fp(value) != fp(f"{a}:0.6,{b}:0.4") and fp(value) != fp(f"{a},{b}")


def test_loop_data_reads_a_mixture_and_a_saved_sft_folder(tmp_path):
  a, b = _mixture_sources(tmp_path)
  sft = str(tmp_path / "sft")
  datasets.Dataset.from_list([{"messages": r["chosen"]} for r in _ultrafeedback(8, 40)]
                             ).save_to_disk(sft)
  cfg = configs.DEFAULT.replace(train_data=f"{a}:0.5,{b}:0.5", sft_data=sft,
                                chat_template="chatml", max_prompt_length=96,
                                max_target_length=64, global_batch_size=4, seed=3,
                                output_dir=str(tmp_path / "run"))
  d = loop.Data(cfg)
  assert [s["taken"] for s in d.reports[0]["sources"]] == [20, 20]
  assert len(d.pairs["tokens"]) == 40 and len(d.sft["tokens"]) == 8


# --- errors: one line, naming the flag or the file -------------------------------------------

@pytest.mark.parametrize("value,message", [
    ("a.parquet:1.5,b.jsonl:0.3", r"a\.parquet's fraction 1\.5 must be a number in \(0, 1\]"),
    ("a.parquet:0,b.jsonl:1", r"a\.parquet's fraction 0 must be a number in \(0, 1\]"),
    ("a.parquet:nan,b.jsonl:0.5", r"a\.parquet's fraction nan must be a number in \(0, 1\]"),
    ("a.parquet:0.5,b.jsonl", r"give every source of a mixture a fraction or none"),
    ("a.parquet:0.5", r"a mixture needs two or more sources; a\.parquet alone is read whole"),
    ("a.parquet:0.5,a.parquet:0.5", r"names a\.parquet twice"),
    ("a.parquet:0.5,,b.jsonl:0.5", r"an empty source between commas"),
])
@pytest.mark.parametrize("flag", data.DATA_FLAGS)
def test_a_bad_mixture_is_one_line_naming_the_flag(flag, value, message):
  with pytest.raises(ValueError, match=f"^--{flag}={re.escape(value)}: {message}") as e:
    configs.DEFAULT.replace(**{flag: value})
  assert "\n" not in str(e.value)


def test_a_path_with_colons_is_a_path(tmp_path):
  rows = _ultrafeedback(2)
  drive = _jsonl(tmp_path / "C:\\data\\x.jsonl", rows)  # a file name holding ':' and '\'
  assert data.parse_sources(drive) == (data.Source(drive),)
  assert data.parse_sources(r"C:\data\a.parquet:0.7,D:\b.jsonl:0.3") == (
      data.Source(r"C:\data\a.parquet", 0.7), data.Source(r"D:\b.jsonl", 0.3))
  assert data.parse_sources(f"{tmp_path}/x:y.jsonl") == (data.Source(f"{tmp_path}/x:y.jsonl"),)


def test_a_fraction_too_small_for_its_source_is_one_line(tmp_path):
  a = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "chosen": "y", "rejected": "n"}
                                     for i in range(100)])
  b = _parquet(tmp_path / "b.parquet", [{"prompt": f"b{i}", "chosen": "y", "rejected": "n"}
                                        for i in range(5)])
  value = f"{a}:0.999,{b}:0.001"
  with pytest.raises(DataError, match=(f"^--train_data={re.escape(value)}: {re.escape(b)}'s "
                                       f"fraction 0.001 comes to no record")) as e:
    prepare.prepare_pairs(value, HOW._replace(flag="train_data"))
  assert "\n" not in str(e.value)


def test_unreadable_sources_are_one_line_naming_the_flag(tmp_path, monkeypatch):
  pattern = str(tmp_path / "train-*.parquet")
  for value, message in [
      (pattern, "the pattern matches no file"),
      (str(tmp_path), "is a directory, not a folder written by datasets' save_to_disk"),
      (f"{tmp_path / 'a.jsonl'}:0.5,{pattern}:0.5", f"{re.escape(pattern)}: the pattern "
                                                    f"matches no file")]:
    if value.startswith(str(tmp_path / "a.jsonl")):
      _jsonl(tmp_path / "a.jsonl", _ultrafeedback(2))
    with pytest.raises(ValueError, match=f"^--eval_data={re.escape(value)}: {message}") as e:
      data.check_sources("eval_data", value)
    assert "\n" not in str(e.value)
  with pytest.raises(DataError, match="is a directory, not a folder written by"):
    prepare.prepare_pairs(str(tmp_path), HOW)
  datasets.DatasetDict({"train": datasets.Dataset.from_list(_ultrafeedback(2))}).save_to_disk(
      str(tmp_path / "dd"))
  with pytest.raises(ValueError, match=r"holding a DatasetDict \(splits train\); give one split's "
                                       r"folder, e.g. .*dd/train$"):
    data.check_sources("train_data", str(tmp_path / "dd"))
  data.check_sources("train_data", str(tmp_path / "dd" / "train"))
  shard = _parquet(tmp_path / "train-00000.parquet", _ultrafeedback(3))
  data.check_sources("train_data", pattern)  # a glob that matches is accepted
  # Without pyarrow: the flag, the file and how to install it.
  monkeypatch.setitem(sys.modules, "pyarrow", None)
  with pytest.raises(ValueError, match=(f"^--train_data={re.escape(pattern)}: {re.escape(shard)}: "
                                        f"reading Parquet and Arrow files needs pyarrow: pip "
                                        f"install 'dpo-jax\\[parquet\\]'$")):
    data.check_sources("train_data", pattern)
  with pytest.raises(DataError, match=f"^{re.escape(shard)}: reading Parquet"):
    list(data.iter_objects(shard))


def test_bad_rows_and_files_name_the_file_and_row(tmp_path):
  rows = _ultrafeedback(20)
  rows[17]["chosen"] = rows[17]["chosen"] + [{"role": "user", "content": "and?"}]
  pattern = _shards(tmp_path, rows, cut=10)
  second = sorted(glob.glob(pattern))[1]
  with pytest.raises(DataError, match=(f"^{re.escape(second)} row 7: field 'chosen' continues "
                                       f"with non-assistant turns \\['user'\\]")):
    list(formats.iter_records(pattern))
  broken = tmp_path / "broken.parquet"
  with open(second, "rb") as f:
    broken.write_bytes(f.read()[:200])
  with pytest.raises(DataError, match=f"^{re.escape(str(broken))}: not a readable parquet "
                                      f"file after 0 rows") as e:
    list(data.iter_objects(str(broken)))
  assert "\n" not in str(e.value)

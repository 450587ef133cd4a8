"""Data: the one reader (JSONL / JSON array / gzip) and loader errors naming file/line/field;
tokenization layout; truncation; batching."""

import gzip
import json

import numpy as np
import pytest

from dpo import data, formats
from dpo.data import DataError, PreferenceRecord
from dpo.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _write(tmp_path, lines):
  path = tmp_path / "pairs.jsonl"
  path.write_bytes(b"\n".join(l if isinstance(l, bytes) else l.encode() for l in lines) + b"\n")
  return str(path)


GOOD = json.dumps({"prompt": "Q?", "chosen": "yes", "rejected": "no"})


def test_loads_good_records(tmp_path):
  recs = data.load_preference_jsonl(_write(tmp_path, [GOOD, "", GOOD]))
  assert recs == [PreferenceRecord("Q?", "yes", "no")] * 2


@pytest.mark.parametrize("line, needle", [
    ("{not json", r"pairs.jsonl:2: invalid JSON"),
    (json.dumps({"prompt": "Q", "chosen": "a"}), r"pairs.jsonl:2: missing field 'rejected'"),
    (json.dumps({"prompt": "Q", "chosen": "", "rejected": "b"}), r"pairs.jsonl:2: field 'chosen' is empty"),
    (json.dumps({"prompt": "Q", "chosen": 3, "rejected": "b"}), r"pairs.jsonl:2: field 'chosen' must be a string"),
    (json.dumps(["a", "b"]), r"pairs.jsonl:2: expected a JSON object"),
    (b"\xff\xfe{}", r"pairs.jsonl:2: line is not valid UTF-8"),
])
def test_bad_records_name_file_line_field(tmp_path, line, needle):
  with pytest.raises(DataError, match=needle):
    data.load_preference_jsonl(_write(tmp_path, [GOOD, line]))


def test_empty_file(tmp_path):
  with pytest.raises(DataError, match="no records"):
    data.load_preference_jsonl(_write(tmp_path, [""]))


def test_missing_file(tmp_path):
  with pytest.raises(DataError, match=r"nope.jsonl: no such file"):
    data.load_preference_jsonl(str(tmp_path / "nope.jsonl"))


SFT = [{"prompt": "", "completion": "hello"}, {"prompt": "Q", "completion": "A"}]
PAIRS = [{"prompt": "Q?", "chosen": "yes", "rejected": "no"},
         {"prompt": "", "chosen": "a", "rejected": "b"}]


def _file(tmp_path, name, rows, array=False, gz=False):
  """Writes rows as JSONL or one JSON array, gzipped or not; the name says nothing of either."""
  raw = (json.dumps(rows, indent=1) if array else "\n".join(json.dumps(r) for r in rows) + "\n")
  raw = raw.encode()
  path = tmp_path / name
  path.write_bytes(gzip.compress(raw) if gz else raw)
  return str(path)


@pytest.mark.parametrize("array", [False, True])
@pytest.mark.parametrize("gz", [False, True])
def test_loaders_read_jsonl_arrays_and_gzip(tmp_path, array, gz):
  pairs = data.load_preference_jsonl(_file(tmp_path, "pairs.data", PAIRS, array, gz))
  assert pairs == [PreferenceRecord(**r) for r in PAIRS]
  sft = [r for _, r in formats.iter_sft_records(_file(tmp_path, "sft.data", SFT, array, gz))]
  assert sft == [data.SFTRecord(**r) for r in SFT]


@pytest.mark.parametrize("array, gz, where", [
    (False, False, r"sft.data:2"), (False, True, r"sft.data:2"),
    (True, False, r"sft.data\[1\]"), (True, True, r"sft.data\[1\]")])
def test_sft_errors_name_record_and_field(tmp_path, array, gz, where):
  bad = [SFT[0], {"prompt": "Q", "completion": ""}]
  read = lambda rows: list(formats.iter_sft_records(_file(tmp_path, "sft.data", rows, array, gz)))
  with pytest.raises(DataError, match=where + r": field 'completion' is empty"):
    read(bad)
  bad = [SFT[0], {"prompt": "Q", "answer": "A"}]
  with pytest.raises(DataError, match=where + r": missing field 'completion'"):
    read(bad)


def test_preference_errors_in_gzip_and_array(tmp_path):
  bad = PAIRS + [{"prompt": "Q", "chosen": "a", "rejected": 7}]
  with pytest.raises(DataError, match=r"p.jsonl.gz:3: field 'rejected' must be a string"):
    data.load_preference_jsonl(_file(tmp_path, "p.jsonl.gz", bad, gz=True))
  with pytest.raises(DataError, match=r"p.json\[2\]: field 'rejected' must be a string"):
    data.load_preference_jsonl(_file(tmp_path, "p.json", bad, array=True))
  cut = tmp_path / "cut.jsonl.gz"
  rows = [json.dumps({"prompt": f"q{i}", "chosen": f"c{i * 7919}", "rejected": f"r{i}"})
          for i in range(2000)]
  whole = gzip.compress(("\n".join(rows) + "\n").encode())
  cut.write_bytes(whole[:len(whole) // 2])
  with pytest.raises(DataError, match=r"cut.jsonl.gz:\d+: gzip stream is truncated"):
    data.load_preference_jsonl(str(cut))


def test_pair_layout():
  arr = data.tokenize_pairs([PreferenceRecord("ab", "xyz", "q")], TOK, 16, 16)
  tokens, mask, seg, pos = (arr[k][0] for k in ("tokens", "loss_mask", "segment_ids", "positions"))
  assert tokens.shape == (2, 8)
  assert list(tokens[0, :7]) == [TOK.bos_id, 97, 98, 120, 121, 122, TOK.eos_id]
  assert list(mask[0]) == [0, 0, 0, 1, 1, 1, 1, 0]
  assert list(seg[1]) == [1, 1, 1, 1, 1, 0, 0, 0]
  assert list(tokens[1, :5]) == [TOK.bos_id, 97, 98, 113, TOK.eos_id]
  assert list(pos[0]) == [0, 1, 2, 3, 4, 5, 6, 0]


def test_truncation_keeps_prompt_end_and_completion_start(caplog):
  arr = data.tokenize_pairs([PreferenceRecord("0123456789", "abcdefgh", "ab")], TOK, 4, 5)
  row = arr["tokens"][0, 0]
  assert list(row[:4]) == [TOK.bos_id] + list(b"789")
  assert list(row[4:9]) == list(b"abcde")  # EOS lost with the cut
  assert "truncated 1 of 1 prompts" in caplog.text


def test_loader_deterministic_and_sliced():
  arrays = {"x": np.arange(40)}
  a = data.Loader(arrays, 8, seed=3)
  first = [next(a)["x"] for _ in range(7)]  # crosses an epoch boundary (5 batches per epoch)
  b = data.Loader(arrays, 8, seed=3)
  assert all(np.array_equal(x, next(b)["x"]) for x in first)
  assert sorted(np.concatenate(first[:5])) == list(range(40))  # an epoch covers every row once
  # Two processes see disjoint halves of the same global batch.
  p0, p1 = data.Loader(arrays, 8, 3, (0, 2)), data.Loader(arrays, 8, 3, (1, 2))
  g0, g1 = next(p0)["x"], next(p1)["x"]
  assert np.array_equal(np.concatenate([g0, g1]), first[0])
  # Resuming from a saved position continues the same stream.
  c = data.Loader(arrays, 8, seed=3)
  c.restore({"epoch": 1, "index": 8})
  assert np.array_equal(next(c)["x"], first[6])


def test_loader_rejects_impossible_batch():
  with pytest.raises(ValueError, match="fewer than one global batch"):
    data.Loader({"x": np.arange(4)}, 8, 0)

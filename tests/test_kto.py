"""KTO's unpaired data against TRL 1.16's own code: the unpaired format, and TRL's
`unpair_preference_dataset`.
"""

import json

import numpy as np
import pytest

from dpo import data as data_lib
from dpo import formats
from dpo.tokenizer import ByteTokenizer


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

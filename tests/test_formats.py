"""dpo/formats.py: every format parses to the same record; HH-RLHF prompt extraction on the real
sample; quality-filter counts; broken inputs name file, record and field."""

import collections
import gzip
import json
import logging
import os

import numpy as np
import pytest

from conftest import SHARED_DATA
from dpo import chat, formats
from dpo.data import DataError, PreferenceRecord

HH = os.path.join(SHARED_DATA, "hh-rlhf", "harmless-base-test.jsonl.gz")
SE = os.path.join(SHARED_DATA, "stack-exchange-paired", "stack_exchange_paired_tiny.json")
needs_data = pytest.mark.skipif(not os.path.isdir(SHARED_DATA), reason="no ../shared/data")

# One two-turn conversation, written out in every supported format.
SYS, U1, A1, U2 = "Be brief.", "Hi there", "Hello!", "Name a colour."
GOOD, BAD = "Blue.", "I will not."
TEXT_PROMPT = f"{SYS}\n\nHuman: {U1}\n\nAssistant: {A1}\n\nHuman: {U2}\n\nAssistant:"
MSGS = [{"role": "system", "content": SYS}, {"role": "user", "content": U1},
        {"role": "assistant", "content": A1}, {"role": "user", "content": U2}]
ROWS = {
    "standard": {"prompt": TEXT_PROMPT, "chosen": f" {GOOD}", "rejected": f" {BAD}"},
    "implicit": {"chosen": f"{TEXT_PROMPT} {GOOD}", "rejected": f"{TEXT_PROMPT} {BAD}"},
    "columns": {"q": TEXT_PROMPT, "good": f" {GOOD}", "bad": f" {BAD}"},
    "conversational": {"prompt": MSGS, "chosen": [{"role": "assistant", "content": GOOD}],
                       "rejected": [{"role": "assistant", "content": BAD}]},
    "openai": {"input": {"messages": MSGS, "tools": []},
               "preferred_output": [{"role": "assistant", "content": GOOD}],
               "non_preferred_output": [{"role": "assistant", "content": BAD}]},
    "implicit_messages": {"chosen": MSGS + [{"role": "assistant", "content": GOOD}],
                          "rejected": MSGS + [{"role": "assistant", "content": BAD}]},
    # LLaMA-Factory's ShareGPT preference layout (data/README.md, "ranking": true).
    "sharegpt": {"conversations": [{"from": "human", "value": U1}, {"from": "gpt", "value": A1},
                                   {"from": "human", "value": U2}],
                 "system": SYS, "chosen": {"from": "gpt", "value": GOOD},
                 "rejected": {"from": "gpt", "value": BAD}},
    # OpenAI content-part lists: the text parts are joined.
    "openai_parts": {"input": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": SYS}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text",
                                                                        "text": "there"}]},
        {"role": "assistant", "content": A1}, {"role": "user", "content": U2}]},
        "preferred_output": [{"role": "assistant", "content": [{"type": "text", "text": GOOD}]}],
        "non_preferred_output": [{"role": "assistant", "content": BAD}]},
    "columns_nested": {"meta": {"q": TEXT_PROMPT}, "answers": [{"text": f" {GOOD}"},
                                                               {"text": f" {BAD}"}]},
    # HuggingFaceH4/ultrafeedback_binarized: a string prompt beside the whole conversations.
    "ultrafeedback": {"prompt": U2, "prompt_id": "0f1e", "chosen": MSGS + [
        {"role": "assistant", "content": GOOD}], "rejected": MSGS + [
        {"role": "assistant", "content": BAD}], "messages": MSGS + [
        {"role": "assistant", "content": GOOD}], "score_chosen": 8.0, "score_rejected": 3.5},
}
COLUMNS = formats.FormatSpec(prompt_field="q", chosen_field="good", rejected_field="bad")
SPECS = {"columns": COLUMNS, "columns_nested": formats.FormatSpec(
    prompt_field="meta.q", chosen_field="answers.0.text", rejected_field="answers.-1.text")}
FORMAT_OF = {"implicit_messages": "implicit", "openai_parts": "openai",
             "columns_nested": "columns", "ultrafeedback": "implicit"}
CHAT_ROWS = ("conversational", "openai", "implicit_messages", "sharegpt", "openai_parts",
             "ultrafeedback")
EXPECTED_TEXT = PreferenceRecord(TEXT_PROMPT, f" {GOOD}", f" {BAD}")
EXPECTED_CHAT = formats.ChatRecord(
    (formats.Message("system", SYS), formats.Message("user", U1),
     formats.Message("assistant", A1), formats.Message("user", U2)),
    (formats.Message("assistant", GOOD),), (formats.Message("assistant", BAD),))


def _write(path, rows, kind="jsonl", gz=False):
  if kind == "parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)
  text = (json.dumps(rows) if kind == "array" else "".join(json.dumps(r) + "\n" for r in rows))
  data = text.encode()
  with open(path, "wb") as f:
    f.write(gzip.compress(data) if gz else data)
  return str(path)


@pytest.mark.parametrize("name", sorted(ROWS))
@pytest.mark.parametrize("kind,gz", [("jsonl", False), ("jsonl", True), ("array", False),
                                     ("array", True), ("parquet", False)])
def test_every_format_gives_the_same_record(tmp_path, name, kind, gz):
  if kind == "parquet" and name == "openai_parts":
    pytest.skip("an Arrow column cannot mix strings and content-part lists")
  path = _write(tmp_path / "d", [ROWS[name]] * 2, kind, gz)
  spec = SPECS.get(name, formats.FormatSpec())
  stats = collections.Counter()
  recs = [r for _, r in formats.iter_records(path, spec, stats)]
  assert len(recs) == 2
  assert stats[f"format_{FORMAT_OF.get(name, name)}"] == 2
  expected = EXPECTED_CHAT if name in CHAT_ROWS else EXPECTED_TEXT
  assert recs[0] == expected
  # Rendered with the plain (base-model) template, chat data equals the text formats.
  assert chat.render_record(recs[0], chat.TEMPLATES["plain"]) == EXPECTED_TEXT


def test_explicit_format_overrides_detection(tmp_path):
  path = _write(tmp_path / "d.jsonl", [ROWS["standard"]])
  with pytest.raises(DataError, match=r"d.jsonl:1: missing field 'input'"):
    list(formats.iter_records(path, formats.FormatSpec("openai")))


def test_column_flags_must_name_both_responses():
  with pytest.raises(ValueError, match="--chosen_field and --rejected_field"):
    formats.FormatSpec(prompt_field="question")
  with pytest.raises(ValueError, match="only used with data_format=columns"):
    formats.FormatSpec("standard", chosen_field="a", rejected_field="b")


def test_undetectable_format_says_which_flags(tmp_path):
  path = _write(tmp_path / "d.jsonl", [{"question": "q", "response_j": "a", "response_k": "b"}])
  with pytest.raises(DataError, match=r"d.jsonl:1: cannot detect.*--prompt_field"):
    list(formats.iter_records(path))


@needs_data
def test_stack_exchange_columns():
  spec = formats.FormatSpec(prompt_field="question", chosen_field="response_j",
                            rejected_field="response_k")
  recs = list(formats.iter_records(SE, spec))
  with open(SE) as f:
    raw = json.load(f)
  assert len(recs) == len(raw) == 25
  assert recs[3][0] == f"{SE}[3]"
  assert recs[3][1] == PreferenceRecord(raw[3]["question"], raw[3]["response_j"],
                                        raw[3]["response_k"])


def _reference_split(chosen, rejected, marker="\n\nAssistant:"):
  """Independent: the longest prefix shared by both that ends exactly at a marker."""
  best = 0
  start = chosen.find(marker)
  while start >= 0:
    end = start + len(marker)
    if rejected[:end] == chosen[:end]:
      best = end
    start = chosen.find(marker, start + 1)
  return best


@needs_data
def test_hh_rlhf_prompt_extraction_on_all_records():
  with gzip.open(HH, "rt", encoding="utf-8") as f:
    raw = [json.loads(line) for line in f]
  stats = collections.Counter()
  recs = list(formats.iter_records(HH, formats.FormatSpec(), stats))
  assert len(recs) == len(raw) == 2312
  assert stats["format_implicit"] == 2312
  fallback = []
  for i, ((where, rec), obj) in enumerate(zip(recs, raw)):
    assert where == f"{HH}:{i + 1}"
    c, r = obj["chosen"], obj["rejected"]
    assert rec.prompt + rec.chosen == c and rec.prompt + rec.rejected == r
    assert rec.prompt.endswith("\n\nAssistant:")
    assert len(rec.prompt) == _reference_split(c, r)
    if c[:c.rindex("\n\nAssistant:")] != r[:r.rindex("\n\nAssistant:")]:
      fallback.append(i)  # chosen and rejected disagree before their last assistant marker
  assert fallback == [1254, 1688, 1950, 1952, 2036]
  assert stats["prompt_from_common_prefix"] == 5


@needs_data
def test_hh_rlhf_filter_counts():
  with gzip.open(HH, "rt", encoding="utf-8") as f:
    raw = [json.loads(line) for line in f]
  recs = list(formats.iter_records(HH))
  kept, report = formats.filter_records(recs)
  # Independent count: responses after the last "\n\nAssistant:" that are blank.
  marker = "\n\nAssistant:"
  empty = [i + 1 for i, o in enumerate(raw)
           if not o["chosen"][o["chosen"].rindex(marker) + len(marker):].strip()
           or not o["rejected"][o["rejected"].rindex(marker) + len(marker):].strip()]
  assert empty == [87, 517, 926, 1104]
  assert report.empty_response == 4 and report.examples["empty_response"] == [
      f"{HH}:{n}" for n in empty]
  assert report.chosen_equals_rejected == 0
  pairs = [(o["chosen"], o["rejected"]) for o in raw]
  assert report.duplicate_pair == len(pairs) - len(set(pairs)) == 0
  assert report.kept == len(kept) == 2308


def test_filter_counts_and_order():
  P = PreferenceRecord
  recs = [P("p", "a", "b"), P("p", "", "b"), P("p", "a", "  "), P("q", "same", "same"),
          P("p", "a", "b"), P("p", "a", "b"), P("r", "x", "y")]
  located = [(f"f:{i + 1}", r) for i, r in enumerate(recs)]
  kept, rep = formats.filter_records(located)
  assert [w for w, _ in kept] == ["f:1", "f:7"]
  assert (rep.records, rep.empty_response, rep.chosen_equals_rejected, rep.duplicate_pair,
          rep.kept) == (7, 2, 1, 2, 2)
  assert rep.examples == {"empty_response": ["f:2", "f:3"], "chosen_equals_rejected": ["f:4"],
                          "duplicate_pair": ["f:5", "f:6"]}
  # Chat records: an empty assistant message is an empty response.
  M = formats.Message
  chat_rec = formats.ChatRecord((M("user", "u"),), (M("assistant", ""),), (M("assistant", "n"),))
  assert formats.filter_records([("c:1", chat_rec)])[1].empty_response == 1


def test_distinct_n_and_low_diversity_warning(caplog):
  assert formats.distinct_n(["a b a b"], 1) == 2 / 4
  assert formats.distinct_n(["a b a b"], 2) == 2 / 3
  assert formats.distinct_n(["a b", "c"], 2) == 1.0
  assert formats.distinct_n(["a"], 2) == 0.0
  recs = [(f"f:{i}", PreferenceRecord(f"p{i}", "the same answer every time",
                                      "the same refusal every time")) for i in range(50)]
  _, rep = formats.filter_records(recs)
  # 6 distinct bigrams ("the same", "same answer", "same refusal", ...) of 100 x 4 in all.
  assert rep.distinct_2 == pytest.approx(6 / 400)
  with caplog.at_level(logging.INFO):
    rep.log("toy")
  assert any(r.levelno == logging.WARNING and "distinct-2" in r.message for r in caplog.records)



def _distinct_numpy(texts, n):
  """Independent count: each text's n-grams as rows of a sliding window, unique rows by numpy."""
  rows = [np.lib.stride_tricks.sliding_window_view(np.array(w), n)
          for w in (t.split() for t in texts) if len(w) >= n]
  if not rows:
    return 0.0
  grams = np.concatenate(rows)
  return len(np.unique(grams, axis=0)) / len(grams)


@pytest.mark.parametrize("texts", [
    ["the cat sat on the mat", "the cat  ran\n off the mat", "mat"],  # n-grams never span texts
    [" ".join(np.random.default_rng(0).choice(list("abcd"), size=k)) for k in (0, 1, 3, 9, 40)],
])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_distinct_n_matches_independent_count(texts, n):
  assert formats.distinct_n(texts, n) == pytest.approx(_distinct_numpy(texts, n))


@pytest.mark.parametrize("texts", [[], [""], ["  \n "], ["one", "two"]])
def test_distinct_n_without_ngrams_is_zero(texts):
  assert formats.distinct_n(texts, 2) == 0.0 == _distinct_numpy(texts, 2)

# --- broken inputs ------------------------------------------------------------------------------

def test_truncated_gzip(tmp_path):
  rows = [ROWS["standard"] | {"chosen": f" answer {i} " * 20} for i in range(400)]
  data = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())
  path = tmp_path / "cut.jsonl.gz"
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(DataError, match=r"cut.jsonl.gz:\d+: gzip stream is truncated"):
    list(formats.iter_records(str(path)))
  arr = tmp_path / "cut.json.gz"
  arr.write_bytes(gzip.compress(json.dumps(rows).encode())[:2000])
  with pytest.raises(DataError, match=r"cut.json.gz: gzip stream is truncated"):
    list(formats.iter_records(str(arr)))


def test_non_utf8_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  good = json.dumps(ROWS["standard"]).encode()
  path.write_bytes(good + b"\n" + good + b"\n" + b'{"prompt": "\xff\xfe", "chosen": "a"}\n')
  with pytest.raises(DataError, match=r"bad.jsonl:3: line is not valid UTF-8"):
    list(formats.iter_records(str(path)))


@pytest.mark.parametrize("row,field,what", [
    ({"prompt": "p", "chosen": "a"}, "'rejected'", "missing field"),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, "'chosen'", "must be a string, got int"),
    ({"prompt": [{"role": "user", "content": 5}], "chosen": [], "rejected": []},
     "'prompt[0].content'", "must be a string"),
    ({"prompt": [{"role": "user", "content": "u"}],
      "chosen": [{"role": "user", "content": "a"}], "rejected": []},
     "'chosen[0].role'", "is 'user'"),
    ({"input": {"messages": "hi"}, "preferred_output": [], "non_preferred_output": []},
     "'input.messages'", "must be a list of messages"),
])
def test_bad_records_name_file_record_field(tmp_path, row, field, what):
  first = ROWS["conversational"] if isinstance(row.get("prompt"), list) else (
      ROWS["openai"] if "input" in row else ROWS["standard"])
  path = _write(tmp_path / "x.jsonl", [first, row])
  with pytest.raises(DataError) as e:
    list(formats.iter_records(path))
  msg = str(e.value)
  assert msg.startswith(f"{path}:2: ") and field in msg and what in msg, msg


def test_array_record_location(tmp_path):
  path = _write(tmp_path / "a.json", [ROWS["standard"], {"prompt": "p", "chosen": "a",
                                                         "rejected": None}], "array")
  with pytest.raises(DataError, match=r"a.json\[1\]: field 'rejected' must be a string"):
    list(formats.iter_records(path))


@pytest.mark.parametrize("kind", ["jsonl", "array"])
def test_utf8_bom_is_read(tmp_path, kind):
  path = tmp_path / "bom"
  path.write_bytes(b"\xef\xbb\xbf" + open(_write(tmp_path / "x", [ROWS["sharegpt"]] * 2, kind),
                                            "rb").read())
  assert [r for _, r in formats.iter_records(str(path))] == [EXPECTED_CHAT] * 2


def test_format_is_decided_over_all_records(tmp_path):
  # One prompt-less first record among prompt/chosen/rejected records is named, not followed.
  rows = [ROWS["implicit"]] + [ROWS["standard"]] * 3
  path = _write(tmp_path / "m.jsonl", rows)
  with pytest.raises(DataError, match=r"m\.jsonl:1: this record reads as implicit \(1 such "
                                      r"records\) but 3 records .* are standard"):
    list(formats.iter_records(path))
  skips = formats.Skips(path)
  assert [r for _, r in formats.iter_records(path, skips=skips)] == [EXPECTED_TEXT] * 3
  assert skips.count == 1 and "reads as implicit" in skips.examples[0]
  # A record missing a field of the file's format says which field.
  path = _write(tmp_path / "f.jsonl", [ROWS["standard"], {"prompt": "p", "chosen": "c"}])
  with pytest.raises(DataError, match=r"f\.jsonl:2: missing field 'rejected'"):
    list(formats.iter_records(path))


@pytest.mark.parametrize("row,match", [
    ({**ROWS["sharegpt"], "conversations": ROWS["sharegpt"]["conversations"][:2]},
     r"field 'conversations' ends with an assistant turn"),
    ({**ROWS["conversational"], "prompt": MSGS[:3]}, r"field 'prompt' ends with an assistant"),
    ({**ROWS["sharegpt"], "chosen": {"from": "bot", "value": "x"}},
     r"field 'chosen\.from' is 'bot'"),
    ({**ROWS["openai"], "preferred_output": [{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]},
     r"field 'preferred_output\[0\]\.content\[0\]' is a 'image_url' part; only text"),
    ({**ROWS["standard"], "chosen": "bad \ud800 text"},
     r"field 'chosen' holds '\\ud800' at character 4, a lone surrogate"),
    ({**ROWS["sharegpt"], "rejected": {"from": "gpt", "value": "\udfff"}},
     r"field 'rejected\.value' holds .* lone surrogate"),
])
def test_records_that_do_not_fit_are_named(tmp_path, row, match):
  path = _write(tmp_path / "b.jsonl", [row])
  with pytest.raises(DataError, match=r"b\.jsonl:1: " + match):
    list(formats.iter_records(path))


def test_dotted_paths_name_where_they_fail(tmp_path):
  path = _write(tmp_path / "n.jsonl", [ROWS["columns_nested"]])
  for field, match in (("meta.x", r"missing field 'meta\.x' \(meta has \['q'\]\)"),
                       ("answers.5.text", r"'answers\.5': index 5 is out of range"),
                       ("meta.q.z", r"'meta\.q\.z': meta\.q is a str, not an object")):
    spec = formats.FormatSpec(prompt_field="meta.q", chosen_field=field,
                              rejected_field="answers.1.text")
    with pytest.raises(DataError, match=r"n\.jsonl:1: .*" + match):
      list(formats.iter_records(path, spec))


def test_unreadable_inputs_are_one_line_errors(tmp_path):
  deep = tmp_path / "deep.jsonl"
  deep.write_text('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
  with pytest.raises(DataError, match=r"deep\.jsonl:1: JSON nested too deeply"):
    list(formats.iter_records(str(deep)))
  deep.write_text("[" * 100_000 + "]" * 100_000)
  with pytest.raises(DataError, match=r"deep\.jsonl: JSON nested too deeply"):
    list(formats.iter_records(str(deep)))
  with pytest.raises(DataError, match="is a directory"):
    list(formats.iter_records(str(tmp_path)))


# --- SFT data: the same conversation in every SFT layout --------------------------------------

SFT_ROWS = {
    "standard": {"prompt": TEXT_PROMPT, "completion": f" {GOOD}"},
    "conversational": {"prompt": MSGS, "completion": [{"role": "assistant", "content": GOOD}]},
    # TRL's conversational language-modeling layout and OpenAI's chat fine-tuning files.
    "messages": {"messages": MSGS + [{"role": "assistant",
                                      "content": [{"type": "text", "text": GOOD}]}]},
    # LLaMA-Factory's ShareGPT SFT layout (data/README.md).
    "sharegpt": {"conversations": [{"from": "human", "value": U1}, {"from": "gpt", "value": A1},
                                   {"from": "human", "value": U2}, {"from": "gpt", "value": GOOD}],
                 "system": SYS},
}
EXPECTED_SFT_CHAT = formats.ChatSFTRecord(EXPECTED_CHAT.prompt, EXPECTED_CHAT.chosen)


@pytest.mark.parametrize("name", sorted(SFT_ROWS))
@pytest.mark.parametrize("kind", ["jsonl", "array"])
def test_every_sft_layout_gives_the_same_record(tmp_path, name, kind):
  path = _write(tmp_path / f"sft.{kind}", [SFT_ROWS[name]] * 3, kind)
  stats = collections.Counter()
  records = [r for _, r in formats.iter_sft_records(path, stats)]
  want = (formats.SFTRecord(TEXT_PROMPT, f" {GOOD}") if name == "standard" else
          EXPECTED_SFT_CHAT)
  assert records == [want] * 3 and stats[f"format_{name}"] == 3
  # Rendered, a conversation is exactly the preference pair's prompt and chosen side.
  t = chat.TEMPLATES["chatml"]
  pair = chat.render_record(EXPECTED_CHAT if name != "standard" else EXPECTED_TEXT, t)
  assert chat.render_sft(records[0], t) == formats.SFTRecord(pair.prompt, pair.chosen)


def test_multi_turn_sft_trains_on_the_trailing_assistant_turns(tmp_path):
  extra = {"role": "assistant", "content": "Or red."}
  path = _write(tmp_path / "m.jsonl", [{"messages": SFT_ROWS["messages"]["messages"] + [extra]}])
  (rec,) = [r for _, r in formats.iter_sft_records(path)]
  assert rec.prompt == EXPECTED_CHAT.prompt  # the earlier assistant turn stays in the prompt
  assert rec.completion == (formats.Message("assistant", GOOD), formats.Message("assistant",
                                                                                "Or red."))


@pytest.mark.parametrize("row,match", [
    ({"messages": MSGS}, r"m\.jsonl:2: field 'messages\[3\]' is a 'user' turn; an SFT "
                         r"conversation must end with the assistant's answer"),
    ({"messages": [{"role": "assistant", "content": "x"}]},
     r"m\.jsonl:2: field 'messages' holds only assistant turns"),
    ({"messages": []}, r"m\.jsonl:2: field 'messages' has no messages"),
    ({"messages": MSGS + [{"role": "assistant", "content": "  "}]},
     r"m\.jsonl:2: field 'messages' is empty"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "text": "a"}]},
     r"m\.jsonl:2: messages\[1\]: missing field 'content'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]},
                   {"role": "assistant", "content": "a"}]},
     r"m\.jsonl:2: field 'messages\[0\]\.content\[0\]' is a 'image_url' part"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]},
     r"m\.jsonl:2: this record reads as sharegpt \(1 such records\)"),
    ({"prompt": "q", "completion": "a"},
     r"m\.jsonl:2: this record reads as standard \(1 such records\)"),
    ({"text": "a"}, r"m\.jsonl:2: missing field 'messages'"),
])
def test_sft_records_that_do_not_fit_are_named(tmp_path, row, match):
  path = _write(tmp_path / "m.jsonl", [SFT_ROWS["messages"], row, SFT_ROWS["messages"]])
  with pytest.raises(DataError, match=match):
    list(formats.iter_sft_records(path))
  skips = formats.Skips("m.jsonl")
  assert len(list(formats.iter_sft_records(path, skips=skips))) == 2 and skips.count == 1


def test_sft_layout_mismatch_and_unknown_fields(tmp_path):
  one = _write(tmp_path / "s.jsonl", [SFT_ROWS["sharegpt"], SFT_ROWS["standard"],
                                      SFT_ROWS["sharegpt"]])
  with pytest.raises(DataError, match=r"s\.jsonl:2: this record reads as standard \(1 such "
                                      r"records\) but 2 records of .* are sharegpt; fix the file "
                                      r"or pass --skip_bad_records"):
    list(formats.iter_sft_records(one))
  bad = _write(tmp_path / "t.jsonl", [{"text": "x"}])
  with pytest.raises(DataError, match=r"t\.jsonl:1: cannot read fields \['text'\] as SFT data"):
    list(formats.iter_sft_records(bad))

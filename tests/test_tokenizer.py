"""dpo/tokenizer.py: the byte tokenizer and the real GPT-2 tokenizer.json (round trip, standard
ids, special tokens) and how both meet the prompt/completion boundary in dpo/data.py."""

import gzip
import json
import os

import numpy as np
import pytest

from conftest import SHARED_DATA
from dpo import data, tokenizer

GPT2 = os.path.join(SHARED_DATA, "tokenizers", "gpt2", "tokenizer.json")
HH = os.path.join(SHARED_DATA, "hh-rlhf", "harmless-base-test.jsonl.gz")
needs_data = pytest.mark.skipif(not os.path.isdir(SHARED_DATA), reason="no ../shared/data")


def test_byte_tokenizer_default():
  tok = tokenizer.load_tokenizer("")
  assert isinstance(tok, tokenizer.ByteTokenizer)
  assert tok.encode("hé") == [104, 195, 169] and tok.decode([104, 195, 169, 258]) == "hé"
  with pytest.raises(ValueError, match="need --tokenizer"):
    tokenizer.load_tokenizer("", eos_token="</s>")


@needs_data
def test_gpt2_ids_and_specials():
  tok = tokenizer.load_tokenizer(GPT2)
  # Standard GPT-2 ids (as published with the original vocabulary).
  assert tok.encode("Hello world") == [15496, 995]
  assert tok.vocab_size == 50257
  assert tok.bos_id == tok.eos_id == tok.pad_id == 50256
  assert tok.encode("<|endoftext|>") == [50256]
  assert tokenizer.load_tokenizer(os.path.dirname(GPT2)).fingerprint() == tok.fingerprint()


@needs_data
def test_gpt2_round_trips_real_transcripts():
  tok = tokenizer.load_tokenizer(GPT2)
  with gzip.open(HH, "rt", encoding="utf-8") as f:
    rows = [json.loads(next(f)) for _ in range(200)]
  for row in rows:
    for text in (row["chosen"], row["rejected"]):
      assert tok.decode(tok.encode(text)) == text
  odd = "naïve café – 日本語 🙂 \t tabs\n\n  spaces"
  assert tok.decode(tok.encode(odd)) == odd


@needs_data
def test_special_tokens_from_config_and_flags(tmp_path):
  os.symlink(GPT2, tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": None, "eos_token": {"content": "<|endoftext|>"}, "pad_token": "!"}))
  tok = tokenizer.load_tokenizer(str(tmp_path))
  assert tok.bos_id is None and tok.eos_id == 50256 and tok.pad_id == 0  # "!" is id 0
  tok = tokenizer.load_tokenizer(str(tmp_path), bos_token="Hello", pad_token="none")
  assert tok.bos_id == 15496 and tok.pad_id == 50256  # pad falls back to EOS
  assert tok.fingerprint() != tokenizer.load_tokenizer(str(tmp_path)).fingerprint()
  with pytest.raises(ValueError, match="'<unk>' is not in the vocabulary"):
    tokenizer.load_tokenizer(GPT2, eos_token="<unk>")


@needs_data
def test_boundary_never_merges_and_eos_not_doubled():
  tok = tokenizer.load_tokenizer(GPT2)
  prompt, completion = "\n\nHuman: hi\n\nAssistant:", " Hello there"
  arrays = data.tokenize_pairs([data.PreferenceRecord(prompt, completion, " No<|endoftext|>")],
                               tok, 64, 64)
  p, c = tok.encode(prompt), tok.encode(completion)
  row = arrays["tokens"][0, 0]
  n = 1 + len(p) + len(c) + 1
  np.testing.assert_array_equal(row[:n], [50256] + p + c + [50256])
  np.testing.assert_array_equal(arrays["loss_mask"][0, 0, :n], [0] * (1 + len(p)) + [1] * (
      len(c) + 1))
  # A completion that already ends with EOS (a chat template's end of turn) gets no second one.
  rej = tok.encode(" No") + [50256]
  np.testing.assert_array_equal(arrays["tokens"][0, 1, 1 + len(p):1 + len(p) + len(rej) + 1],
                                rej + [50256])  # the trailing id here is padding (PAD = EOS)
  assert arrays["segment_ids"][0, 1].sum() == 1 + len(p) + len(rej)


@needs_data
def test_no_bos_truncation_keeps_prompt_end(tmp_path):
  os.symlink(GPT2, tmp_path / "tokenizer.json")
  tok = tokenizer.load_tokenizer(str(tmp_path), bos_token="none")
  stats = data.TruncationStats()
  ids = data.encode_prompt(tok, "one two three four five", 3, stats)
  assert ids == tok.encode("one two three four five")[-3:] and stats.prompts_truncated == 1


@needs_data
def test_tokenizer_paths(tmp_path, monkeypatch):
  # A relative path is resolved against the working directory; a folder means its tokenizer.json.
  monkeypatch.chdir(os.path.dirname(os.path.dirname(GPT2)))
  rel = tokenizer.load_tokenizer(os.path.join("gpt2", "tokenizer.json"))
  real = os.path.abspath(GPT2)
  assert rel.path == real and tokenizer.load_tokenizer("gpt2").path == real
  with pytest.raises(data.DataError, match=r"--tokenizer: .*nope\.json does not exist"):
    tokenizer.load_tokenizer("nope.json")
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(data.DataError, match=r"bad\.json is not a tokenizers JSON file"):
    tokenizer.load_tokenizer(str(tmp_path / "bad.json"))

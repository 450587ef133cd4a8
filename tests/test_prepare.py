"""dpo/prepare.py: tokenise once and cache, the held-out split, and loop.Data on real formats."""

import collections
import hashlib
import json
import os
import re

import numpy as np
import pytest

import configs
from dpo import data, formats, loop, prepare, tokenizer

ROWS = [{"prompt": f"question {i % 40}?", "chosen": f" good answer {i}", "rejected": f" bad {i}"}
        for i in range(120)]


def _write(tmp_path, rows, name="d.jsonl"):
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def test_second_run_loads_the_cache_without_reading(tmp_path, monkeypatch):
  path, cache = _write(tmp_path, ROWS), str(tmp_path / "cache")
  tok = tokenizer.ByteTokenizer()
  first = prepare.prepare_pairs(path, prepare.Preparation(tok, max_prompt_length=16,
      max_target_length=16), eval_split=0.25, cache_dir=cache)
  assert first.report["cache"] == "miss" and len(os.listdir(cache)) == 1

  def no_reading(*a, **k):
    raise AssertionError("re-read the data although it was cached")
  monkeypatch.setattr(formats, "iter_records", no_reading)
  monkeypatch.setattr(prepare, "tokenize_pairs", no_reading)
  second = prepare.prepare_pairs(path, prepare.Preparation(tok, max_prompt_length=16,
      max_target_length=16), eval_split=0.25, cache_dir=cache)
  assert second.report["cache"] == "hit"
  for part in ("train", "held"):
    a, b = getattr(first, part), getattr(second, part)
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  # A changed setting or a changed file is a different key: it must read again.
  with pytest.raises(AssertionError, match="re-read"):
    prepare.prepare_pairs(path, prepare.Preparation(tok, max_prompt_length=16,
        max_target_length=8), eval_split=0.25, cache_dir=cache)
  _write(tmp_path, ROWS[:-1])
  with pytest.raises(AssertionError, match="re-read"):
    prepare.prepare_pairs(path, prepare.Preparation(tok, max_prompt_length=16,
        max_target_length=16), eval_split=0.25, cache_dir=cache)


def test_held_out_split_by_prompt(tmp_path):
  path = _write(tmp_path, ROWS)
  out = prepare.prepare_pairs(path, prepare.Preparation(tokenizer.ByteTokenizer(),
      max_prompt_length=32, max_target_length=32), eval_split=0.3)
  # Independent membership: SHA-256 of the prompt's first 8 bytes as a fraction of 2**64.
  held_prompts = {r["prompt"] for r in ROWS
                  if int(hashlib.sha256(r["prompt"].encode()).hexdigest()[:16], 16) < 0.3 * 2**64}
  n_held = sum(r["prompt"] in held_prompts for r in ROWS)
  assert 0 < n_held < len(ROWS)
  assert len(out.held["tokens"]) == n_held == out.report["held_out_pairs"]
  assert len(out.train["tokens"]) == len(ROWS) - n_held
  tok = tokenizer.ByteTokenizer()
  decoded = {tok.decode(row[1:][m[1:] == 0]) for row, m in
             zip(out.held["tokens"][:, 0], out.held["loss_mask"][:, 0])}
  assert decoded == held_prompts  # every pair of a held-out prompt, and only those


def test_filters_are_reported(tmp_path):
  rows = ROWS[:10] + [ROWS[0], {"prompt": "x", "chosen": "same", "rejected": "same"},
                      {"prompt": "y", "chosen": " ", "rejected": "b"}]
  out = prepare.prepare_pairs(_write(tmp_path, rows),
      prepare.Preparation(tokenizer.ByteTokenizer(), max_prompt_length=32, max_target_length=32))
  f = out.report["filters"]
  assert (f["records"], f["duplicate_pair"], f["chosen_equals_rejected"], f["empty_response"],
          f["kept"]) == (13, 1, 1, 1, 10)
  assert len(out.train["tokens"]) == 10


def test_loop_data_on_a_conversational_file(tmp_path):
  rows = [{"prompt": [{"role": "user", "content": f"q{i}"}],
           "chosen": [{"role": "assistant", "content": f"yes {i}"}],
           "rejected": [{"role": "assistant", "content": f"no {i}"}]} for i in range(64)]
  cfg = configs.DEFAULT.replace(train_data=_write(tmp_path, rows), chat_template="chatml",
                                eval_split=0.25, max_prompt_length=96,
                                output_dir=str(tmp_path / "run"))
  d = loop.Data(cfg)
  n_train, n_held = len(d.pairs["tokens"]), len(d.held["tokens"])
  assert n_train + n_held == 64 and n_held > 0
  np.testing.assert_array_equal(d.sft["tokens"], d.pairs["tokens"][:, 0])
  tok = tokenizer.ByteTokenizer()
  text = tok.decode(d.pairs["tokens"][0, 0])
  assert text.startswith("<|im_start|>user\nq") and "<|im_end|>\n<|im_start|>assistant\nyes" in text
  assert d.reports[0]["format_conversational"] == 64
  assert os.listdir(tmp_path / "run" / "data_cache")
  with pytest.raises(ValueError, match="either --eval_data or --eval_split"):
    loop.Data(cfg.replace(eval_data=cfg.data.train_data))
  with pytest.raises(data.DataError, match="no such file"):
    loop.Data(cfg.replace(train_data=str(tmp_path / "missing.jsonl")))


SHAREGPT = [{"conversations": [{"from": "human", "value": f"q{i}"}], "system": "Be brief.",
             "chosen": {"from": "gpt", "value": f"yes {i}"},
             "rejected": {"from": "gpt", "value": f"no {i}"}} for i in range(64)]
OPENAI_PARTS = [{"input": {"messages": [{"role": "user", "content": [
    {"type": "text", "text": "q"}, {"type": "text", "text": str(i)}]}]},
    "preferred_output": [{"role": "assistant", "content": [{"type": "text", "text": f"yes {i}"}]}],
    "non_preferred_output": [{"role": "assistant", "content": f"no {i}"}]} for i in range(64)]


@pytest.mark.parametrize("rows,name,fmt", [
    (SHAREGPT, "sharegpt.json", "sharegpt"),  # LLaMA-Factory ships JSON arrays
    (OPENAI_PARTS, "openai.jsonl", "openai")])
@pytest.mark.slow
def test_run_end_to_end(tmp_path, capsys, rows, name, fmt):
  path = tmp_path / name
  path.write_text(json.dumps(rows) if name.endswith(".json") else
                  "".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "run"
  cfg = configs.DEFAULT.replace(train_data=str(path), eval_split=0.25, chat_template="chatml",
                                n_layers=1, d_model=32, head_dim=8, mlp_dim=64, stage="dpo",
                                steps=1, log_every=1, output_dir=str(out))
  summary = loop.run(cfg)
  assert summary["data"][0][f"format_{fmt}"] == 64
  assert summary["pairs"] == summary["data"][0]["held_out_pairs"] > 0
  with open(out / "summary.json") as f:
    assert json.load(f)["data"][0]["filters"]["kept"] == 64
  # Generation metrics on real data: the held-out prompts as the template rendered them are
  # sampled; KL, lengths and distinct-n are measured, win rate has no judge and is
  # null with the reason, in summary.json, its verdict and the table.
  with open(out / "summary.json") as f:
    written = json.load(f)
  for k in ("kl_per_token", "kl_per_sequence", "policy_length_mean", "reference_length_mean",
            "policy_distinct_1", "policy_distinct_2", "reference_distinct_2"):
    assert isinstance(written[k], float), k
  assert written["policy_length_mean"] > 0
  assert written["win_rate"] is None and written["policy_wellformed_rate"] is None
  assert written["win_rate_reason"].startswith("no judge")
  verdicts = {v["target"]: v for v in written["verdicts"]}
  assert verdicts["win rate"]["verdict"] == "n/a" and verdicts["KL per token (nats)"][
      "verdict"] != "n/a"
  assert verdicts["win rate"]["reason"] == written["win_rate_reason"]
  table = capsys.readouterr().out
  assert f"n/a ({written['win_rate_reason']})" in table
  assert "KL(policy||ref) per token (nats)" in table and "distinct-1 / distinct-2" in table
  # samples.jsonl: every sampled prompt with both responses side by side, their log-ratio and
  # lengths; the mean log-ratio is the KL per sequence, the lengths' mean the length figure.
  samples = [json.loads(l) for l in open(out / "samples.jsonl")]
  assert len(samples) == summary["eval_prompts"] == summary["pairs"]
  assert all(s["prompt"].endswith("<|im_start|>assistant\n") for s in samples)
  assert all(isinstance(s["policy"], str) and isinstance(s["reference"], str) for s in samples)
  assert np.mean([s["log_ratio"] for s in samples]) == pytest.approx(written["kl_per_sequence"],
                                                                    rel=1e-5, abs=1e-6)
  assert np.mean([s["policy_tokens"] for s in samples]) == written["policy_length_mean"]
  assert np.mean([s["reference_tokens"] for s in samples]) == written["reference_length_mean"]
  assert f"  policy:    {samples[0]['policy']!r}" in table


def test_inspect_data_writes_the_preview_and_trains_nothing(tmp_path, capsys):
  out = tmp_path / "run"
  cfg = configs.DEFAULT.replace(train_data=_write(tmp_path, SHAREGPT, "s.jsonl"),
                                chat_template="chatml", inspect_data=5, max_prompt_length=96,
                                output_dir=str(out))
  summary = loop.run(cfg)
  assert summary["pairs"] == 5 and not (out / "checkpoints").exists()
  rows = [json.loads(x) for x in open(out / "data_preview.jsonl")]
  tok = tokenizer.ByteTokenizer()
  d = loop.Data(cfg)
  for i, r in enumerate(rows):
    assert r["prompt_text"] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + (
        f"q{i}<|im_end|>\n<|im_start|>assistant\n")  # file order: nothing is held out
    assert r["chosen_text"].startswith("yes ") and r["chosen_text"].endswith("<|im_end|>")
    assert r["prompt_ids"] == [tok.bos_id] + tok.encode(r["prompt_text"])
    assert r["chosen_ids"] == tok.encode(r["chosen_text"]) + [tok.eos_id]
    n = len(r["prompt_ids"])
    assert r["chosen_scored_positions"] == list(range(n, n + len(r["chosen_ids"])))
    np.testing.assert_array_equal(d.pairs["tokens"][i, 1, n:n + len(r["rejected_ids"])],
                                  r["rejected_ids"])
  printed = capsys.readouterr().out
  assert "prompt_text: '<|im_start|>system" in printed and "not training" in printed
  # With --rm_split the preview is the policy stages' pairs, and says so.
  loop.run(cfg.replace(stage="sft,rm,dpo", rm_split=0.5, inspect_data=500))
  d = loop.Data(cfg.replace(stage="sft,rm,dpo", rm_split=0.5))
  n, rm = len(d.pairs["tokens"]), len(d.rm_pairs["tokens"])
  assert n > 0 and rm > 0 and n + rm == len(loop.Data(cfg).pairs["tokens"])
  assert (f"wrote {n} pairs (the policy stages'; --rm_split gives the reward model {rm} "
          f"others) to {out / 'data_preview.jsonl'}") in capsys.readouterr().out


def test_the_preview_and_the_log_say_which_prompts_lost_turns(tmp_path, capsys, caplog):
  """Conversations over --max_prompt_length (a hand-written template, the byte tokenizer): the
  preview's rows name each prompt's cut, a cut prompt still opens with the system turn and ends
  with the generation prompt, the printed lines and the log count them, and a second run that
  loads the cache says the same."""
  caplog.set_level("INFO")
  long_conv = lambda i: [{"from": "human", "value": "an earlier question " * 3},
                         {"from": "gpt", "value": "an earlier answer " * 3},
                         {"from": "human", "value": f"q{i}"}]
  rows = [{**r, "conversations": long_conv(i) if i % 4 == 0 else r["conversations"]}
          for i, r in enumerate(SHAREGPT)]
  rows[1] = {**rows[1], "conversations": [{"from": "human", "value": "a long question " * 20}]}
  path = _write(tmp_path, rows, "long.jsonl")
  system = "<|im_start|>system\nBe brief.<|im_end|>\n"
  for run in ("first", "cached"):
    out = tmp_path / run
    cfg = configs.DEFAULT.replace(train_data=path, chat_template="chatml", inspect_data=8,
                                  max_prompt_length=96, output_dir=str(out),
                                  data_cache_dir=str(tmp_path / "cache"))
    loop.run(cfg)
    preview = [json.loads(x) for x in open(out / "data_preview.jsonl")]
    for r in preview:
      assert r["prompt_text"].startswith(system), r
      assert r["prompt_text"].endswith("<|im_end|>\n<|im_start|>assistant\n")
      assert len(r["prompt_ids"]) <= 96
    assert [r["index"] for r in preview if "prompt_cut" in r] == [0, 1, 4]
    assert preview[0]["prompt_cut"] == preview[4]["prompt_cut"] == "lost earlier turns: 2 of 3"
    assert preview[0]["prompt_text"] == system + (
        "<|im_start|>user\nq0<|im_end|>\n<|im_start|>assistant\n")
    assert preview[1]["prompt_cut"].startswith("cut inside a turn: kept the last ")
    assert preview[1]["prompt_text"].startswith(system + "<|im_start|>user\n")
    printed = capsys.readouterr().out
    assert (f"{path} train: over --max_prompt_length, 16 prompts lost earlier turns, 1 cut "
            f"inside a turn") in printed
    assert ", prompt lost earlier turns: 2 of 3" in printed  # the pair's own line
  assert (f"{path} train pairs: 16 prompts lost earlier turns, 1 cut inside a turn (of 64; "
          f"--max_prompt_length=96; first: lost earlier turns: {path}:1, {path}:5, {path}:9; "
          f"cut inside a turn: {path}:2)") in caplog.text


def test_unpaired_conversations_lose_whole_turns_as_pairs_do(tmp_path):
  """prepare_unpaired fits each conversation's prompt as prepare_pairs does: the kept prompt
  is the template's rendering of the system message and the last turn, the cut counted."""
  from dpo import chat
  turns = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "an earlier question " * 4},
           {"role": "assistant", "content": "an earlier answer " * 4},
           {"role": "user", "content": "q?"}]
  rows = [{"prompt": turns if i == 0 else turns[-1:], "completion": [
      {"role": "assistant", "content": f"a{i}"}], "label": i % 2 == 0} for i in range(4)]
  tok = tokenizer.ByteTokenizer()
  prep = prepare.prepare_unpaired(_write(tmp_path, rows, "u.jsonl"), prepare.Preparation(
      tok, template="chatml", max_prompt_length=96, max_target_length=16))
  assert prep.cuts == ["lost earlier turns: 2 of 3", "", "", ""]
  assert prep.report["prompt_cuts"]["train"]["lost earlier turns"] == 1
  kept = [formats.Message(m["role"], m["content"]) for m in (turns[0], turns[-1])]
  start = int(prep.train["loss_mask"][0].argmax())
  assert prep.train["tokens"][0, :start].tolist() == [tok.bos_id] + tok.encode(
      chat.render_prompt(chat.TEMPLATES["chatml"], kept))


def test_corrupt_cache_is_rebuilt_and_stale_tmp_removed(tmp_path, caplog):
  path, cache = _write(tmp_path, ROWS), tmp_path / "cache"
  tok = tokenizer.ByteTokenizer()
  how = prepare.Preparation(tok, max_prompt_length=16, max_target_length=16)
  kw = dict(cache_dir=str(cache))
  first = prepare.prepare_pairs(path, how, **kw)
  (npz,) = os.listdir(cache)
  # An interrupted write of this host (its process is gone) and one of another host, old.
  dead = cache / f"{npz}.tmp.{prepare.socket.gethostname()}.999999999"
  other = cache / f"{npz}.tmp.otherhost.12"
  for f in (dead, other):
    f.write_bytes(b"half")
  os.utime(other, (0, 0))
  live = cache / f"{npz}.tmp.{prepare.socket.gethostname()}.{os.getppid()}"  # a live writer
  live.write_bytes(b"busy")
  for garbage in (b"not a zip", open(cache / npz, "rb").read()[:100], b""):
    (cache / npz).write_bytes(garbage)
    again = prepare.prepare_pairs(path, how, **kw)
    assert again.report["cache"] == "miss" and "does not load" in caplog.text
    np.testing.assert_array_equal(again.train["tokens"], first.train["tokens"])
  assert sorted(os.listdir(cache)) == sorted([npz, live.name])
  assert prepare.prepare_pairs(path, how, **kw).report["cache"] == "hit"


def test_a_batch_larger_than_the_data_is_named(tmp_path):
  cfg = configs.DEFAULT.replace(train_data=_write(tmp_path, ROWS[:6]), global_batch_size=8,
                                output_dir=str(tmp_path / "run"))
  for _ in range(2):  # before and after the cache exists
    with pytest.raises(data.DataError, match=r"d\.jsonl: 6 training examples .* fewer than one "
                                             r"batch of --global_batch_size=8"):
      loop.Data(cfg)


@pytest.mark.parametrize("kind", ["pairs", "unpaired", "embedded"])
def test_loop_data_parses_each_data_flag_once(tmp_path, monkeypatch, kind):
  """A data flag's value is parsed into its sources once, where loop.Data reads it; prepare,
  data and formats take the parsed value (a cache miss and a hit alike)."""
  pairs = [{"prompt": f"q{i}?", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(24)]
  unpaired = [{"prompt": f"u{i}?", "completion": f" c{i}", "label": i % 2 == 0}
              for i in range(24)]
  rows = unpaired if kind == "unpaired" else pairs
  mixture = (f"{_write(tmp_path, rows[:12], 'a.jsonl')}:0.5,"
             f"{_write(tmp_path, rows[12:], 'b.jsonl')}:0.5")
  held = _write(tmp_path, [{"prompt": f"h{i}?", "chosen": " y", "rejected": " n"}
                           for i in range(4)], "held.jsonl")
  sft = _write(tmp_path, [{"prompt": f"s{i}?", "completion": " ok"} for i in range(8)], "s.jsonl")
  cfg = configs.DEFAULT.replace(
      train_data="" if kind == "embedded" else mixture, eval_data=held, sft_data=sft,
      stage="sft,kto" if kind == "unpaired" else "sft,dpo", global_batch_size=4,
      task_train_pairs=16, task_sft_examples=16, output_dir=str(tmp_path / "run"))
  parsed = []
  def counting(value, parse=data.parse_sources):
    parsed.append(value)
    return parse(value)
  monkeypatch.setattr(data, "parse_sources", counting)
  monkeypatch.setattr(formats, "parse_sources", counting, raising=False)  # were it imported
  for _ in range(2):  # the cache written, then read
    parsed.clear()
    loop.Data(cfg)
    names = {cfg.data.train_data: "train_data", held: "eval_data", sft: "sft_data"}
    assert collections.Counter(names[v] for v in parsed) == {
        name: 1 for value, name in names.items() if value}


@pytest.mark.parametrize("flag", data.DATA_FLAGS)
def test_loop_data_names_the_flag_of_a_mixture(tmp_path, flag):
  """The parsed value carries its flag down: a mixture's error through loop.Data names it."""
  row = ((lambda i: {"prompt": f"s{i}?", "completion": " ok"}) if flag == "sft_data" else
         (lambda i: {"prompt": f"q{i}?", "chosen": " y", "rejected": " n"}))
  a = _write(tmp_path, [row(i) for i in range(100)], "a.jsonl")
  b = _write(tmp_path, [row(i) for i in range(5)], "b.jsonl")
  value = f"{a}:0.999,{b}:0.001"
  cfg = configs.DEFAULT.replace(**{flag: value}, task_train_pairs=16, task_sft_examples=16,
                                output_dir=str(tmp_path / "run"))
  with pytest.raises(data.DataError, match=f"^--{flag}={re.escape(value)}: {re.escape(b)}'s "
                                           f"fraction 0.001 comes to no record"):
    loop.Data(cfg)

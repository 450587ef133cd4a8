"""Malformed user inputs end in one DataError naming the flag or file, record and field (which
launch.py prints as one `error:` line with exit status 2), never a crash deeper inside."""

import json
import os
import re
import subprocess
import sys

import pytest

import configs
from conftest import SHARED_DATA
from dpo import data, loop

GPT2 = os.path.join(SHARED_DATA, "tokenizers", "gpt2", "tokenizer.json")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = {"prompt": [{"role": "user", "content": "q"}],
        "chosen": [{"role": "assistant", "content": "yes"}],
        "rejected": [{"role": "assistant", "content": "no"}]}


def _file(tmp_path, text, name="d.jsonl"):
  path = tmp_path / name
  path.write_text(text, encoding="utf-8", errors="surrogatepass")
  return str(path)


CASES = {  # name: (make the flags, the message's pattern)
    "lone surrogate": (
        lambda p: {"train_data": _file(p, json.dumps(GOOD) + "\n" + json.dumps(
            {**GOOD, "chosen": [{"role": "assistant", "content": "x\ud800"}]}) + "\n")},
        r"d\.jsonl:2: field 'chosen\[0\]\.content' holds '\\ud800' at character 1"),
    "deep nesting": (lambda p: {"train_data": _file(p, "[" * 50_000 + "]" * 50_000)},
                     r"d\.jsonl: JSON nested too deeply"),
    "gemma, system only": (
        lambda p: {"train_data": _file(p, json.dumps(
            {**GOOD, "prompt": [{"role": "system", "content": "S"}]}) + "\n"),
            "chat_template": "gemma"},
        r"d\.jsonl:1: gemma: a system message needs a following user turn"),
    "a directory as data": (lambda p: {"train_data": str(p)}, r"is a directory"),
    "missing tokenizer (relative path)": (
        lambda p: {"train_data": _file(p, json.dumps(GOOD) + "\n"),
                   "tokenizer": "no/such/tokenizer.json"},
        r"--tokenizer: /.*no/such/tokenizer\.json does not exist"),
    "batch larger than the data": (
        lambda p: {"train_data": _file(p, json.dumps(GOOD) + "\n"), "global_batch_size": 8},
        r"d\.jsonl: 1 training examples .* --global_batch_size=8"),
    "sft conversation without the answer": (
        lambda p: {"train_data": _file(p, json.dumps(GOOD) + "\n"), "sft_data": _file(p, json.dumps(
            {"messages": [{"role": "user", "content": "q"}]}) + "\n", "s.jsonl")},
        r"s\.jsonl:1: field 'messages\[0\]' is a 'user' turn; an SFT conversation must end "
        r"with the assistant's answer"),
    "sft ShareGPT speaker": (
        lambda p: {"train_data": _file(p, json.dumps(GOOD) + "\n"), "sft_data": _file(p, json.dumps(
            {"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]})
            + "\n", "s.jsonl")},
        r"s\.jsonl:1: field 'conversations\[1\]\.from' is 'bot'; expected one of"),
    "sft, gemma, system only": (
        lambda p: {"train_data": _file(p, json.dumps(GOOD) + "\n"), "chat_template": "gemma",
                   "sft_data": _file(p, json.dumps({"messages": [
                       {"role": "system", "content": "S"}, {"role": "assistant",
                                                            "content": "a"}]}) + "\n",
                       "s.jsonl")},
        r"s\.jsonl:1: gemma: a system message needs a following user turn"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_input_is_one_named_error(tmp_path, case):
  flags, pattern = CASES[case]
  cfg = configs.DEFAULT.replace(output_dir=str(tmp_path / "run"), **flags(tmp_path))
  with pytest.raises(data.DataError, match=pattern):
    loop.Data(cfg)


@pytest.mark.skipif(not os.path.exists(GPT2), reason="no ../shared/data")
def test_launch_prints_one_line_and_exits_2(tmp_path):
  cmd = [sys.executable, "launch.py", f"--train_data={tmp_path}", f"--tokenizer={GPT2}",
         f"--output_dir={tmp_path / 'run'}", "--vocab_size=50304"]
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 2, r.stderr[-2000:]
  errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
  assert errors == [f"error: --train_data={tmp_path}: is a directory, not a folder written by "
                    f"datasets' save_to_disk (no state.json); give a JSONL, JSON, Parquet or "
                    f"Arrow file, a glob of shards, or such a folder"]
  assert "Traceback" not in r.stderr


def _lora_state(tmp_path):
  """A LoRA training state checkpoint (adapters and moments, no full model weights)."""
  import jax
  import numpy as np
  from dpo import checkpoint
  path = tmp_path / "lora_state"
  checkpoint.Manager(path, 1).save(3, {"a": jax.numpy.asarray(np.zeros(4, np.float32))},
                                   {"lora": True})
  return str(path / "step_00000003")


INPUTS = {  # name: (make the flag's value, the message after `--flag=value: `)
    "init_from, missing": ("init_from", lambda p: str(p / "nope"), r"not a complete checkpoint"),
    "init_from, a LoRA training state": (
        "init_from", _lora_state, r"kind 'state' \(lora=True\) holds no full model weights"),
    "init_from, hf: without config.json": (
        "init_from", lambda p: f"hf:{p}", r"/config\.json is missing"),
    "train_data, missing": ("train_data", lambda p: str(p / "pairs.jsonl"), r"no such file$"),
    "sft_data, a glob that matches nothing": (
        "sft_data", lambda p: str(p / "train-*.parquet"), r": the pattern matches no file$"),
}


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_an_unusable_input_is_one_line_naming_the_flag_and_file(tmp_path, case):
  flag, value, pattern = INPUTS[case]
  value = value(tmp_path)
  r = subprocess.run([sys.executable, "launch.py", f"--{flag}={value}",
                      f"--output_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True,
                     text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 2, r.stderr[-2000:]
  errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
  assert len(errors) == 1 and errors[0].startswith(f"error: --{flag}={value}: "), r.stderr[-2000:]
  assert re.search(pattern, errors[0]), errors[0]
  assert "Traceback" not in r.stderr

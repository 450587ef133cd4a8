"""Tokenizers: the zero-dependency byte tokenizer (the default) and Hugging Face tokenizer.json.

Both expose `encode(text) -> ids` (no special tokens), `decode`, `bos_id` (None: no BOS),
`eos_id`, `pad_id`, `vocab_size`, `chat_template` (None, or the folder's Jinja source),
`special_ids()` and `fingerprint()` (keys the tokenised-data cache).
"""

from __future__ import annotations

import hashlib
import json
import os

from dpo import chat
from dpo.data import DataError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")  # transformers' named special tokens


class ByteTokenizer:
  """ids 0..255 are bytes; 256 = PAD, 257 = BOS, 258 = EOS."""

  pad_id = 256
  bos_id = 257
  eos_id = 258
  vocab_size = 259
  name = "bytes"

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

  chat_template = None

  def special_ids(self) -> set[int]:
    return {self.pad_id, self.bos_id, self.eos_id}

  def fingerprint(self) -> str:
    return "bytes-v1"


def _special(value) -> str | None:
  """A tokenizer_config.json special-token entry: a string, {"content": str} or null."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


class HFTokenizer:
  """A Hugging Face `tokenizer.json` through the `tokenizers` library (an optional extra).

  Text is encoded without the file's post-processor (`add_special_tokens=False`): the data code
  adds BOS and EOS as ids itself, exactly once, so a template that also inserts them cannot
  double them. BOS/EOS/PAD come from, in order: the explicit arguments (flags), the
  `tokenizer_config.json` beside the file, and for GPT-2-style vocabularies `<|endoftext|>`
  (GPT-2 uses it as both document separator and end of text; it has no PAD, so PAD = EOS).
  "none" for BOS means the model has no BOS (e.g. Qwen); PAD only fills masked positions.
  """

  def __init__(self, path: str, bos_token: str = "", eos_token: str = "", pad_token: str = ""):
    try:
      from tokenizers import Tokenizer
    except ImportError as e:
      raise ImportError("--tokenizer needs the `tokenizers` package: pip install "
                        "'dpo-jax[hf]' (or pip install tokenizers)") from e
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    path = os.path.abspath(path)
    if not os.path.isfile(path):
      raise DataError(f"--tokenizer: {path} does not exist (give a tokenizer.json or the "
                       f"Hugging Face tokenizer folder holding it)")
    self.path = path
    try:
      self._tok = Tokenizer.from_file(path)
    except Exception as e:  # the Rust error type is not importable; name the file instead
      raise DataError(f"--tokenizer: {path} is not a tokenizers JSON file ({e})") from None
    self.directory = os.path.dirname(path)
    config = {}
    config_path = os.path.join(self.directory, "tokenizer_config.json")
    if os.path.exists(config_path):
      try:
        with open(config_path, encoding="utf-8") as f:
          config = json.load(f)
      except (OSError, ValueError) as e:
        raise DataError(f"{config_path}: cannot read ({e})") from None
    self._config = config
    self.chat_template = chat.read_chat_template(self.directory)
    default = "<|endoftext|>" if self._tok.token_to_id("<|endoftext|>") is not None else None

    def pick(flag: str, key: str, fallback):
      if flag:
        return None if flag == "none" else flag
      if key in config:
        return _special(config[key])
      return fallback

    self.bos_token = pick(bos_token, "bos_token", default)
    self.eos_token = pick(eos_token, "eos_token", default)
    self.pad_token = pick(pad_token, "pad_token", None) or self.eos_token
    if self.eos_token is None:
      raise ValueError(f"{path}: no EOS token known; pass --eos_token")
    self.bos_id = self._id(self.bos_token) if self.bos_token is not None else None
    self.eos_id = self._id(self.eos_token)
    self.pad_id = self._id(self.pad_token)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.name = os.path.basename(self.directory) or path

  @property
  def config(self) -> dict:
    """tokenizer_config.json beside the file ({} when there is none)."""
    return dict(self._config)

  def special_tokens(self) -> dict[str, str]:
    """The template variables transformers passes to a chat template (its special_tokens_map):
    the named special tokens of tokenizer_config.json, with BOS/EOS/PAD as resolved here."""
    out = {k: _special(self._config.get(k)) for k in SPECIAL_TOKEN_NAMES}
    out.update(bos_token=self.bos_token, eos_token=self.eos_token)
    if "pad_token" not in self._config:
      out["pad_token"] = None
    return {k: v for k, v in out.items() if v is not None}

  def special_ids(self) -> set[int]:
    """Ids of the vocabulary's special added tokens (and BOS/EOS/PAD)."""
    ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    return ids | {self.eos_id, self.pad_id} | ({self.bos_id} if self.bos_id is not None else set())

  def _id(self, token: str) -> int:
    i = self._tok.token_to_id(token)
    if i is None:
      raise ValueError(f"{self.path}: special token {token!r} is not in the vocabulary")
    return i

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def fingerprint(self) -> str:
    h = hashlib.sha256()
    with open(self.path, "rb") as f:
      h.update(f.read())
    h.update(repr((self.bos_token, self.eos_token, self.pad_token)).encode())
    h.update((self.chat_template or "").encode())
    return "hf-" + h.hexdigest()[:16]


def load_tokenizer(path: str = "", bos_token: str = "", eos_token: str = "",
                   pad_token: str = ""):
  """The byte tokenizer when `path` is empty, else a Hugging Face tokenizer.json."""
  if not path:
    if bos_token or eos_token or pad_token:
      raise ValueError("--bos_token/--eos_token/--pad_token need --tokenizer")
    return ByteTokenizer()
  return HFTokenizer(path, bos_token, eos_token, pad_token)

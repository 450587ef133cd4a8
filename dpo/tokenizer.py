"""The zero-dependency default tokenizer: one id per UTF-8 byte, plus PAD, BOS and EOS."""

from __future__ import annotations


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

"""Preference and SFT data: files -> records -> token arrays -> per-process batches.

Every data file is read by `iter_objects`: JSONL or a JSON array, optionally gzipped (detected
from the magic bytes, not the name), with or without a UTF-8 byte-order mark. JSONL is read
lazily; a JSON array is parsed whole (the format allows nothing else). Errors are `DataError`s whose message starts with the record's
location, `file:LINE` for JSONL (1-based line) or `file[INDEX]` for JSON arrays (0-based), and
names the offending field. `dpo.formats` parses the objects of the preference and SFT formats
users bring; `load_preference_jsonl` reads plain string preference records (--eval_data of the
embedded task).

Layout of a tokenized DPO example (one row per pair, axis P = 2 for chosen / rejected):

    tokens      [BOS p p p c c c EOS PAD PAD]   prompt then completion, right-padded
    positions   [0   1 2 3 4 5 6 7   0   0  ]
    segment_ids [1   1 1 1 1 1 1 1   0   0  ]   0 marks padding
    loss_mask   [0   0 0 0 1 1 1 1   0   0  ]   1 where the token is a scored completion token

Prompt and completion are tokenized separately and then concatenated, so no token ever spans the
boundary. Truncation keeps BOS plus the *end* of the prompt and the *start* of the completion
(the EOS is lost when a completion is cut), and every truncation is counted and reported.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import logging
import os
import zlib
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from dpo import packing


class DataError(ValueError):
  """Bad input data; the message names the file, record (file:LINE or file[INDEX]) and field."""


class PreferenceRecord(NamedTuple):
  prompt: str
  chosen: str
  rejected: str


class SFTRecord(NamedTuple):
  prompt: str
  completion: str


# --- reading ----------------------------------------------------------------------------------

def _open(path: str) -> io.BufferedIOBase:
  f = open(path, "rb")
  if f.peek(2)[:2] == b"\x1f\x8b":
    return gzip.GzipFile(fileobj=f)
  return f


_BOM = b"\xef\xbb\xbf"


def _first_char(path: str) -> bytes:
  with _open(path) as f:
    try:
      first = True
      while chunk := f.read(4096):
        if first and chunk.startswith(_BOM):
          chunk = chunk[len(_BOM):]
        first = False
        stripped = chunk.lstrip()
        if stripped:
          return stripped[:1]
    except (EOFError, OSError, zlib.error) as e:
      raise DataError(f"{path}: gzip stream is truncated or corrupt ({e})") from None
  return b""


def iter_objects(path: str) -> Iterator[tuple[str, dict]]:
  """Yields (location, object) for each record; lazy for JSONL."""
  if not os.path.exists(path):
    raise DataError(f"{path}: no such file")
  if os.path.isdir(path):
    raise DataError(f"{path}: is a directory; give a JSONL or JSON file")
  if _first_char(path) == b"[":
    yield from _iter_array(path)
  else:
    yield from _iter_jsonl(path)


def _iter_array(path: str) -> Iterator[tuple[str, dict]]:
  try:
    with _open(path) as f:
      raw = f.read()
  except (EOFError, OSError, zlib.error) as e:
    raise DataError(f"{path}: gzip stream is truncated or corrupt ({e})") from None
  try:
    items = json.loads(raw.removeprefix(_BOM).decode("utf-8"))
  except UnicodeDecodeError as e:
    line = raw[:e.start].count(b"\n") + 1
    raise DataError(f"{path}: line {line} is not valid UTF-8 ({e.reason})") from None
  except json.JSONDecodeError as e:
    raise DataError(f"{path}: invalid JSON array ({e.msg} at line {e.lineno} column {e.colno})"
                    ) from None
  except RecursionError:
    raise DataError(f"{path}: JSON nested too deeply to read") from None
  if not isinstance(items, list):
    raise DataError(f"{path}: expected a JSON array of objects, got {type(items).__name__}")
  for i, obj in enumerate(items):
    where = f"{path}[{i}]"
    if not isinstance(obj, dict):
      raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    yield where, obj


def _iter_jsonl(path: str) -> Iterator[tuple[str, dict]]:
  lineno = 0
  with _open(path) as f:
    lines = iter(f)
    while True:
      try:
        raw = next(lines)
      except StopIteration:
        return
      except (EOFError, OSError, zlib.error) as e:
        raise DataError(f"{path}:{lineno + 1}: gzip stream is truncated or corrupt after line "
                        f"{lineno} ({e})") from None
      lineno += 1
      if not raw.strip():
        continue
      where = f"{path}:{lineno}"
      if lineno == 1:
        raw = raw.removeprefix(_BOM)
      try:
        obj = json.loads(raw.decode("utf-8"))
      except UnicodeDecodeError as e:
        raise DataError(f"{where}: line is not valid UTF-8 ({e.reason} at byte {e.start})"
                        ) from None
      except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
      except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read") from None
      if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
      yield where, obj


# --- records ----------------------------------------------------------------------------------

def get_field(obj: dict, field: str, where: str):
  if field not in obj:
    raise DataError(f"{where}: missing field {field!r} (has {sorted(obj)})")
  return obj[field]


def check_text(value: str, field: str, where: str) -> str:
  """`value`, unless it holds what UTF-8 cannot encode (a lone surrogate such as "\\ud800")."""
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    raise DataError(f"{where}: field {field!r} holds {value[e.start]!r} at character {e.start}, "
                    f"a lone surrogate that is not text (an escape cut in half?)") from None
  return value


def text_field(obj: dict, field: str, where: str, allow_empty: bool = False) -> str:
  value = get_field(obj, field, where)
  if not isinstance(value, str):
    raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
  check_text(value, field, where)
  if not allow_empty and not value.strip():
    raise DataError(f"{where}: field {field!r} is empty")
  return value


def load_preference_jsonl(path: str) -> list[PreferenceRecord]:
  """Reads {"prompt", "chosen", "rejected"} records from any file `iter_objects` reads."""
  out = [PreferenceRecord(text_field(o, "prompt", where, allow_empty=True),
                          text_field(o, "chosen", where), text_field(o, "rejected", where))
         for where, o in iter_objects(path)]
  if not out:
    raise DataError(f"{path}: no records")
  return out


# --- tokenization ---------------------------------------------------------------------------------

@dataclasses.dataclass
class TruncationStats:
  examples: int = 0
  prompts_truncated: int = 0
  completions_truncated: int = 0

  def report(self, what: str) -> None:
    if self.prompts_truncated or self.completions_truncated:
      logging.warning("%s: truncated %d of %d prompts (kept the end) and %d completions "
                      "(kept the start)", what, self.prompts_truncated, self.examples,
                      self.completions_truncated)


def encode_prompt(tok, prompt: str, max_len: int, stats: TruncationStats,
                  add_bos: bool = True) -> list[int]:
  """BOS (unless the tokenizer has none, or a chat template that emits none rendered the
  prompt: `add_bos`) + prompt ids, keeping the end when too long."""
  bos = [] if tok.bos_id is None or not add_bos else [tok.bos_id]
  ids = bos + tok.encode(prompt)
  if len(ids) > max_len:
    stats.prompts_truncated += 1
    ids = bos + ids[len(ids) - max_len + len(bos):]
  return ids


def encode_completion(tok, completion: str, max_len: int, stats: TruncationStats,
                      add_eos: bool = True) -> list[int]:
  """Completion ids + EOS (not doubled when a chat template already ends with the EOS token;
  none with `add_eos=False`: a tokenizer's own template ends the turn itself)."""
  ids = tok.encode(completion)
  if add_eos and (not ids or ids[-1] != tok.eos_id):
    ids.append(tok.eos_id)
  if len(ids) > max_len:
    stats.completions_truncated += 1
    ids = ids[:max_len]
  return ids


def _pack_rows(rows: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict:
  n = len(rows)
  tokens = np.full((n, seq_len), pad_id, np.int32)
  positions = np.zeros((n, seq_len), np.int32)
  segment_ids = np.zeros((n, seq_len), np.int32)
  loss_mask = np.zeros((n, seq_len), np.float32)
  for i, (p, c) in enumerate(rows):
    L = len(p) + len(c)
    tokens[i, :L] = p + c
    positions[i, :L] = np.arange(L)
    segment_ids[i, :L] = 1
    loss_mask[i, len(p):L] = 1.0
  return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids,
          "loss_mask": loss_mask}


class Ends(NamedTuple):
  """Whether each row gets a BOS id before its prompt and an EOS id after its completion (texts
  rendered by a tokenizer's own chat template carry what the template writes)."""
  bos: bool = True
  eos: bool = True


def tokenize_pairs(records: Sequence[PreferenceRecord], tok, max_prompt_length: int,
                   max_target_length: int, what: str = "pairs",
                   ends: Ends = Ends()) -> dict[str, np.ndarray]:
  """Arrays of shape [N, 2, T] (chosen, rejected); T is the longest pair rounded up to 8."""
  add_bos, add_eos = ends
  stats = TruncationStats(examples=len(records))
  chosen, rejected = [], []
  for r in records:
    p = encode_prompt(tok, r.prompt, max_prompt_length, stats, add_bos)
    chosen.append((p, encode_completion(tok, r.chosen, max_target_length, stats, add_eos)))
    rejected.append((p, encode_completion(tok, r.rejected, max_target_length, stats, add_eos)))
  stats.report(what)
  seq_len = packing.round_up(max(len(p) + len(c) for p, c in chosen + rejected), 8)
  c, r = _pack_rows(chosen, seq_len, tok.pad_id), _pack_rows(rejected, seq_len, tok.pad_id)
  return {k: np.stack([c[k], r[k]], axis=1) for k in c}


def tokenize_sft(records: Sequence[SFTRecord], tok, max_prompt_length: int,
                 max_target_length: int, what: str = "sft", ends: Ends = Ends()
                 ) -> dict[str, np.ndarray]:
  """Arrays of shape [N, T]; `ends` as for `tokenize_pairs`."""
  add_bos, add_eos = ends
  stats = TruncationStats(examples=len(records))
  rows = [(encode_prompt(tok, r.prompt, max_prompt_length, stats, add_bos),
           encode_completion(tok, r.completion, max_target_length, stats, add_eos))
          for r in records]
  stats.report(what)
  seq_len = packing.round_up(max(len(p) + len(c) for p, c in rows), 8)
  return _pack_rows(rows, seq_len, tok.pad_id)


# --- batching -------------------------------------------------------------------------------------

class Repeat:
  """A loader whose every batch is given `k` times in a row (GRPO's num_iterations updates on
  one generation batch). Its state is the inner loader's after the batch being repeated, and a
  restore starts a new batch: checkpoints fall between repeated batches."""

  def __init__(self, loader, k: int):
    self.loader, self.k, self.given, self.batch = loader, k, 0, None

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self.given % self.k == 0:
      self.batch = next(self.loader)
    self.given += 1
    return self.batch

  def state(self) -> dict:
    return self.loader.state()

  def restore(self, state: dict) -> None:
    self.loader.restore(state)
    self.given, self.batch = 0, None


class Loader:
  """Deterministic, seeded, epoch-shuffled batches; each process reads only its slice.

  The order is a pure function of (seed, epoch), so the loader's whole state is (epoch, index)
  and a resumed run sees exactly the batches an uninterrupted one would. The global batch is
  rows [index, index + global_batch) of the epoch's permutation (a partial final batch is
  dropped); process i takes the i-th contiguous block of it. `pack(global batch rows, block)`
  adds arrays built from the whole global batch (packed rows, dpo/packing.py) to each batch.
  """

  def __init__(self, arrays: dict[str, np.ndarray], global_batch: int, seed: int,
               block: tuple[int, int] = (0, 1), what: str = "dataset",
               pack: Callable[[np.ndarray, int], dict[str, np.ndarray]] | None = None):
    """`block` = (this process's index, the process count): which block of each global batch
    this process reads."""
    process_index, process_count = block
    self.arrays, self.pack = arrays, pack
    self.n = len(next(iter(arrays.values())))
    if global_batch % process_count:
      raise ValueError(f"global batch {global_batch} not divisible by {process_count} processes")
    if self.n < global_batch:
      raise DataError(f"{what}: {self.n} examples, fewer than one global batch of "
                      f"--global_batch_size={global_batch}")
    self.global_batch, self.seed = global_batch, seed
    self.local = global_batch // process_count
    self.offset = process_index * self.local
    self.epoch, self.index = 0, 0

  def _perm(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(self.n)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self.index + self.global_batch > self.n:
      self.epoch, self.index = self.epoch + 1, 0
    rows = self._perm(self.epoch)[self.index:self.index + self.global_batch]
    self.index += self.global_batch
    batch = {k: v[rows[self.offset:self.offset + self.local]] for k, v in self.arrays.items()}
    if self.pack is not None:
      batch.update(self.pack(rows, self.offset // self.local))
    return batch

  def batch_rows(self, epoch: int) -> np.ndarray:
    """[batches, global_batch]: the rows of every global batch of `epoch`, all processes'."""
    whole = self.n // self.global_batch * self.global_batch
    return self._perm(epoch)[:whole].reshape(-1, self.global_batch)

  def state(self) -> dict:
    return {"epoch": self.epoch, "index": self.index}

  def restore(self, state: dict) -> None:
    self.epoch, self.index = int(state["epoch"]), int(state["index"])

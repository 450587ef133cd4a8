"""Preference and SFT data: files -> records -> token arrays -> per-process batches.

A data flag's value (`--train_data`, `--eval_data`, `--sft_data`) names one source or a mixture
of several (`parse_sources`); it is parsed once, where it is read (`data_value`, in loop.Data),
and the readers below take that `DataValue`, never the string again. A source is a file, a glob
pattern of shards (read in sorted order), or a folder written by `datasets`'
`Dataset.save_to_disk` (the Arrow files its state.json lists, in that order). Every source is
read by `iter_objects`, which tells a file's kind from its magic bytes, not its name: JSONL or a
JSON array, optionally gzipped, with or without a UTF-8 byte-order mark; Parquet; Arrow IPC
(stream, as `save_to_disk` writes it, or file). JSONL, Parquet and Arrow are read lazily
(Parquet and Arrow one record batch at a time, turned into plain Python dicts, so a large file
is never held twice in memory); a JSON array is parsed whole (the format allows nothing else).
Parquet and Arrow need pyarrow (the `parquet` extra). Errors are `DataError`s whose message
starts with the record's location, `file:LINE` for JSONL (1-based line), `file[INDEX]` for JSON
arrays (0-based), `file row ROW` for Parquet and Arrow (0-based within the file), and names the
offending field. `dpo.formats` parses the objects of the preference and SFT formats users bring;
a mixture is each source's records parsed on their own, then `read_sources` takes each source's
share of them; `load_preference_jsonl` reads plain string preference records (--eval_data of the
embedded task).

Layout of a tokenized DPO example (one row per pair, axis P = 2 for chosen / rejected):

    tokens      [BOS p p p c c c EOS PAD PAD]   prompt then completion, right-padded
    positions   [0   1 2 3 4 5 6 7   0   0  ]
    segment_ids [1   1 1 1 1 1 1 1   0   0  ]   0 marks padding
    loss_mask   [0   0 0 0 1 1 1 1   0   0  ]   1 where the token is a scored completion token

Prompt and completion are tokenized separately and then concatenated, so no token ever spans the
boundary. Truncation keeps BOS plus the *end* of the prompt and the *start* of the completion
(the EOS is lost when a completion is cut), and every truncation is counted and reported. A
conversation's prompt is fitted to its budget before it gets here (`chat.fit_record`: whole
earlier turns dropped and the rest rendered again), so this cut reaches it only when its system
message and last turn alone are over the budget.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import hashlib
import io
import json
import logging
import os
import zlib
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence, TypeVar

import numpy as np

from dpo import hub, packing


class DataError(ValueError):
  """Bad input data; the message names the file, record (file:LINE, file[INDEX] or file row ROW)
  and field."""


T = TypeVar("T")


class PreferenceRecord(NamedTuple):
  prompt: str
  chosen: str
  rejected: str


class SFTRecord(NamedTuple):
  prompt: str
  completion: str


# --- sources: what a data flag names ---------------------------------------------------------

PARQUET_EXTRA = "pip install 'dpo-jax[parquet]'"
DATA_FLAGS = ("train_data", "eval_data", "sft_data")  # the DataConfig fields that name data
_GLOB = "*?["


class Source(NamedTuple):
  """One source of a data flag: a file, a glob of shards or a save_to_disk folder, and its
  share of a mixture (None: all its records)."""
  path: str
  fraction: float | None = None


def _split_fraction(part: str) -> Source:
  """A part split at its last ':' when what follows reads as a number (`a.parquet:0.7`); else
  all path (`C:\\data\\a.jsonl`, `x:y.jsonl`)."""
  path, sep, tail = part.rpartition(":")
  try:
    return Source(path, float(tail)) if sep and path else Source(part)
  except ValueError:
    return Source(part)


def parse_sources(value: str) -> tuple[Source, ...]:
  """The sources a data flag's value names (`()` for an empty value).

  `PATH` is one source (`hf:PATH` the same: dpo/hub.py). `PATH:FRACTION,PATH:FRACTION,...` is
  a mixture whose fractions are each source's share of it, as TRL's `DatasetMixtureConfig`
  means them (`mixture_counts`); `PATH,PATH,...` without fractions is every record of each
  source, one after another. A part is split at its last ':' only when what follows reads as a
  number, so a path holding ':' (`C:\\data\\a.jsonl`) stays a path, and a value that names an
  existing file or folder is that one source whatever it holds. ValueError, in words that follow
  `--flag=VALUE: `, for a fraction that is not a number in (0, 1], fractions on some sources
  only, a fraction on a lone source, a source named twice, or an empty part.
  """
  if not value:
    return ()
  if os.path.exists(value):
    return (Source(value),)
  # `hf:NAME` is NAME: a local path, else a Hub data set (dpo/hub.py's one rule for every flag).
  sources = tuple(_split_fraction(part.strip().removeprefix(hub.HF)) for part in value.split(","))
  if any(not s.path for s in sources):
    raise ValueError("an empty source between commas")
  for s in sources:
    if s.fraction is not None and not 0 < s.fraction <= 1:
      raise ValueError(f"{s.path}'s fraction {s.fraction:g} must be a number in (0, 1]")
  given = [s.fraction is not None for s in sources]
  if any(given) and not all(given):
    without, with_one = sources[given.index(False)].path, sources[given.index(True)].path
    raise ValueError(f"give every source of a mixture a fraction or none ({without} has none, "
                     f"{with_one} has one)")
  if len(sources) == 1 and given[0]:
    raise ValueError(f"a mixture needs two or more sources; {sources[0].path} alone is read "
                     f"whole (drop ':{sources[0].fraction:g}')")
  paths = [s.path for s in sources]
  twice = [p for p in paths if paths.count(p) > 1]
  if twice:
    raise ValueError(f"names {twice[0]} twice")
  return sources


class DataValue(NamedTuple):
  """A data flag's value parsed once (`data_value`): the flag that gave it ("" for a path given
  in code), the value as given (what messages, logs and reports name) and its sources."""
  flag: str
  value: str
  sources: tuple[Source, ...]

  @property
  def named(self) -> str:
    """`--flag=value` (the value alone without a flag): how an error about the whole value
    begins."""
    return f"--{self.flag}={self.value}" if self.flag else self.value


def data_value(value: str | DataValue, flag: str = "") -> DataValue:
  """`value` parsed into its sources (`parse_sources`; a DataValue is returned as it is): the
  one parse of a data flag's value, where it is read (loop.Data), or at the top of a function
  that code calls with a plain path."""
  if isinstance(value, DataValue):
    return value
  return DataValue(flag, value, parse_sources(value))


def hub_identity(cfg) -> dict[str, str]:
  """{"<flag> hub": "REPO[/DIR]:[SUBSET:]SPLIT@COMMIT, ..."} for each data flag whose sources name
  Hub data sets (what `hub.dataset` resolved them to); {} for none."""
  out = {}
  for flag in DATA_FLAGS:
    value = getattr(cfg.data, flag)
    names = []
    for s in parse_sources(value) if value else ():
      if hub.data_name(s.path):
        d = hub.dataset(s.path)
        where = "/".join(x for x in (d.repo, d.data_dir) if x)
        names.append(f"{where}:{d.subset + ':' if d.subset else ''}{d.split}@{d.commit}")
    if names:
      out[f"{flag} hub"] = ", ".join(names)
  return out


def source_files(path: str) -> list[str]:
  """The files one source reads, in reading order: the file itself, the sorted files a glob
  matches (`**` spans folders), the Arrow files a save_to_disk folder's state.json lists, or,
  for a Hub data set's name (`hub.data_name`: no local path of that name), the Arrow files
  `datasets.load_dataset` prepared for its split (`hub.dataset`). A DataError naming the path
  for anything else."""
  if os.path.isdir(path):
    return _saved_dataset_files(path)
  if os.path.exists(path):
    return [path]
  if any(c in path for c in _GLOB):
    files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
      raise DataError(f"{path}: the pattern matches no file")
    return files
  if hub.data_name(path):
    try:
      return list(hub.dataset(path).files)
    except hub.HubError as e:
      raise DataError(str(e)) from None
  raise DataError(f"{path}: no such file")


def _saved_dataset_files(folder: str) -> list[str]:
  """The Arrow files of a folder written by `datasets.Dataset.save_to_disk`, in state.json's
  order (the order `datasets.load_from_disk` reads them)."""
  state = os.path.join(folder, "state.json")
  if not os.path.isfile(state):
    splits = os.path.join(folder, "dataset_dict.json")
    if os.path.isfile(splits):
      with open(splits) as f:
        names = json.load(f).get("splits") or ["train"]
      raise DataError(f"{folder}: is a directory holding a DatasetDict (splits "
                      f"{', '.join(names)}); give one split's folder, e.g. "
                      f"{os.path.join(folder, names[0])}")
    raise DataError(f"{folder}: is a directory, not a folder written by datasets' save_to_disk "
                    f"(no state.json); give a JSONL, JSON, Parquet or Arrow file, a glob of "
                    f"shards, or such a folder")
  try:
    with open(state) as f:
      files = [os.path.join(folder, d["filename"]) for d in json.load(f)["_data_files"]]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise DataError(f"{state}: not the state.json of save_to_disk ({type(e).__name__}: {e})"
                    ) from None
  missing = [f for f in files if not os.path.isfile(f)]
  if missing:
    raise DataError(f"{missing[0]}: listed in {state} but missing")
  if not files:
    raise DataError(f"{state}: lists no data files")
  return files


def _pyarrow(path: str):
  """pyarrow with its Parquet and IPC modules, or one line saying how to install it."""
  try:
    import pyarrow
    import pyarrow.ipc
    import pyarrow.parquet
  except ImportError:
    raise DataError(f"{path}: reading Parquet and Arrow files needs pyarrow: {PARQUET_EXTRA}"
                    ) from None
  return pyarrow


def check_sources(flag: str, value: str) -> None:
  """A ValueError, one line naming `--flag=value`, for a value whose sources cannot be read:
  a path that does not exist, a glob that matches nothing, a folder that save_to_disk did not
  write, a Parquet or Arrow file without pyarrow. Run before any work (launch.py)."""
  for s in parse_sources(value):
    try:
      files = source_files(s.path)
      arrow = [f for f in files if _kind(f) != "json"]
      if arrow:
        _pyarrow(arrow[0])
    except DataError as e:
      # A lone source's error starts with its path, which `--flag=value` already names.
      alone = value.removeprefix(hub.HF) == s.path
      message = str(e).removeprefix(f"{s.path}: ") if alone else str(e)
      where = f" ({os.path.abspath(value)})" if (
          value == s.path and message == "no such file" and not os.path.isabs(value)) else ""
      raise ValueError(f"--{flag}={value}: {message}{where}") from None


@functools.lru_cache(maxsize=256)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
  del size, mtime_ns  # the cache key: a rewritten file is hashed again
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def denied(path: str, e: PermissionError) -> DataError:
  """A file this process may not read: one line naming it, the user, and the way out."""
  return DataError(f"{os.fspath(e.filename or path)}: permission denied reading it (as uid "
                   f"{os.geteuid()}); left in place: give this user read access (chmod u+r) "
                   f"and rerun")


def file_sha256(path: str) -> str:
  """sha256 of a file's content, hashed once per version of the file (its size and mtime); a
  file this process may not read is a DataError naming it."""
  try:
    st = os.stat(path)
    if not os.access(path, os.R_OK):  # a cached digest must not hide it (root reads anyway)
      raise PermissionError(13, "Permission denied", path)
    return _sha256(os.path.abspath(path), st.st_size, st.st_mtime_ns)
  except PermissionError as e:
    raise denied(path, e) from None


def source_digest(value: str | DataValue) -> str:
  """sha256 of what a data flag's value reads: one file's content (so a file's digest is the
  same whatever names it); else, source by source, its fraction and the names and contents of
  the files it reads, in reading order (a changed, added or removed shard changes it)."""
  sources = data_value(value).sources
  if len(sources) == 1 and os.path.isfile(sources[0].path):
    return file_sha256(sources[0].path)
  h = hashlib.sha256()
  for s in sources:
    h.update(f"source {s.fraction}\n".encode())
    for f in source_files(s.path):
      h.update(f"{os.path.basename(f)}:{file_sha256(f)}\n".encode())
  return h.hexdigest()


def mixture_counts(sizes: Sequence[int], fractions: Sequence[float]) -> list[int]:
  """How many records a mixture takes from each source, as TRL's `DatasetMixtureConfig`
  (trl.scripts.utils.get_dataset) decides: the fractions are the sources' shares of the
  mixture, normalised to sum to one; the mixture is the largest that oversamples no source,
  N = min(size / share); each source gives round(share * N) of its records."""
  weights = [f / sum(fractions) for f in fractions]
  total = min(n / w for n, w in zip(sizes, weights))
  return [round(w * total) for w in weights]


def read_sources(value: str | DataValue, read: Callable[[str], Iterable[tuple[str, T]]],
                 flag: str = "") -> tuple[list[tuple[str, T]], list[dict]]:
  """((location, record) of every record `value` gives, {source, fraction, records, taken} of
  each source).

  Each source is read on its own by `read(path)` (so each has its own format); a mixture then
  takes the first `mixture_counts` of each source's records, in reading order, as TRL's
  `get_dataset` does (`dataset.select(range(k))`; shuffle a source first to take others); the
  sources follow one another. A source that would give no record is a DataError naming the
  value's flag (`flag`, for a plain string) and the source.
  """
  value = data_value(value, flag)
  sources, named = value.sources, value.named
  if not sources:
    raise DataError(f"{named}: no data given")
  located = [list(read(s.path)) for s in sources]
  sizes = [len(x) for x in located]
  counts = (sizes if sources[0].fraction is None else
            mixture_counts(sizes, [s.fraction for s in sources]))
  for s, n, k in zip(sources, sizes, counts):
    if len(sources) == 1:
      break  # a lone source that gives nothing: its caller's "no records"
    if not n:
      raise DataError(f"{named}: {s.path} has no records")
    if not k:
      cap = min(range(len(sources)), key=lambda i: sizes[i] / sources[i].fraction)
      raise DataError(f"{named}: {s.path}'s fraction {s.fraction:g} comes to no record of a "
                      f"mixture of {sum(counts)} (capped by the {sizes[cap]} records of "
                      f"{sources[cap].path}); raise the fraction or give "
                      f"{sources[cap].path} more records")
  out, report = [], []
  for s, records, k in zip(sources, located, counts):
    out.extend(records[:k])
    report.append({"source": s.path, "fraction": s.fraction, "records": len(records),
                   "taken": k})
    if len(sources) > 1:
      logging.info("%s: %d of %d records from %s%s", value.value, k, len(records), s.path,
                   "" if s.fraction is None else f" (fraction {s.fraction:g}: the first {k})")
  return out, report


# --- reading ----------------------------------------------------------------------------------

def _open(path: str) -> io.BufferedIOBase:
  try:
    f = open(path, "rb")
  except PermissionError as e:
    raise denied(path, e) from None
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


def _kind(path: str) -> str:
  """A file's kind from its magic bytes: "parquet", "arrow stream" (IPC stream, as save_to_disk
  writes it), "arrow file" (IPC file) or "json" (JSONL or a JSON array, maybe gzipped)."""
  try:
    with open(path, "rb") as f:
      head = f.read(6)
  except PermissionError as e:
    raise denied(path, e) from None
  if head[:4] == b"PAR1":
    return "parquet"
  if head == b"ARROW1":
    return "arrow file"
  if head[:4] == b"\xff\xff\xff\xff":
    return "arrow stream"
  return "json"


def iter_objects(path: str) -> Iterator[tuple[str, dict]]:
  """Yields (location, object) for each record of one source (a file, a glob of shards, a
  save_to_disk folder: `source_files`), each file read as its kind; lazy but for a JSON array."""
  for file in source_files(path):
    kind = _kind(file)
    if kind != "json":
      yield from _iter_arrow(file, kind)
    elif _first_char(file) == b"[":
      yield from _iter_array(file)
    else:
      yield from _iter_jsonl(file)


_BATCH_ROWS = 1024  # rows turned into Python objects at a time


def _iter_arrow(path: str, kind: str) -> Iterator[tuple[str, dict]]:
  """The rows of a Parquet (row group by row group) or Arrow IPC file (batch by batch) as plain
  Python dicts (`to_pylist`: Python ints, floats, strings, lists, dicts), `_BATCH_ROWS` at a
  time, so only that many exist as Python objects at once."""
  pa = _pyarrow(path)
  row = 0
  try:
    with (pa.parquet.ParquetFile(path) if kind == "parquet" else pa.memory_map(path)) as source:
      if kind == "parquet":
        batches = source.iter_batches(batch_size=_BATCH_ROWS)
      elif kind == "arrow stream":
        batches = pa.ipc.open_stream(source)
      else:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
      for batch in batches:
        for start in range(0, batch.num_rows, _BATCH_ROWS):
          for obj in batch.slice(start, _BATCH_ROWS).to_pylist():
            yield f"{path} row {row}", obj
            row += 1
  except (pa.ArrowException, OSError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise DataError(f"{path}: not a readable {kind} file after {row} rows ({first})") from None


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


def load_preference_jsonl(path: str | DataValue, flag: str = "") -> list[PreferenceRecord]:
  """Reads {"prompt", "chosen", "rejected"} records from any source `iter_objects` reads, or a
  mixture of them (`read_sources`; errors name the value's flag, `flag` for a plain string)."""
  value = data_value(path, flag)
  read = lambda p: ((where, PreferenceRecord(
      text_field(o, "prompt", where, allow_empty=True), text_field(o, "chosen", where),
      text_field(o, "rejected", where))) for where, o in iter_objects(p))
  located, _ = read_sources(value, read)
  if not located:
    raise DataError(f"{value.value}: no records")
  return [r for _, r in located]


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


class PromptBudget(NamedTuple):
  """--max_prompt_length as `encode_prompt` counts it: the prompt's ids plus the BOS id it adds
  (`add_bos`, and the tokenizer has one)."""
  tok: object
  max_len: int
  add_bos: bool = True

  def fits(self, prompt: str) -> bool:
    bos = self.add_bos and self.tok.bos_id is not None
    return bos + len(self.tok.encode(prompt)) <= self.max_len


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


def pack_rows(rows: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> dict:
  """[N, seq_len] right-padded rows of (prompt ids, completion ids): tokens, positions, segment
  ids (1 on each row's tokens) and a loss mask over the completion's slots."""
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
  c, r = pack_rows(chosen, seq_len, tok.pad_id), pack_rows(rejected, seq_len, tok.pad_id)
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
  return pack_rows(rows, seq_len, tok.pad_id)


# --- unpaired examples (KTO) ----------------------------------------------------------------------

# datasets' `Dataset.map` batch size, which TRL's `unpair_preference_dataset` leaves at its default:
# each map batch of pairs becomes its chosen examples, then its rejected ones.
UNPAIR_BATCH = 1000
_ROWS = ("tokens", "positions", "segment_ids", "loss_mask")


def unpair_order(n: int, batch: int = UNPAIR_BATCH) -> tuple[np.ndarray, np.ndarray]:
  """(pair index [2n], side [2n]: 0 chosen, 1 rejected) of each unpaired example that TRL's
  `trl.data_utils.unpair_preference_dataset` makes of n pairs, in its order: per map batch of
  `batch` pairs, their chosen completions (label True), then their rejected ones (False)."""
  index, side = [], []
  for start in range(0, n, batch):
    rows = np.arange(start, min(start + batch, n))
    index += [rows, rows]
    side += [np.zeros_like(rows), np.ones_like(rows)]
  cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)
  return cat(index), cat(side)


def unpair_rows(pairs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """[N, 2, T] pair rows -> [2N, T] unpaired rows and `label` [2N] (True: desirable, the
  chosen side), in `unpair_order`: the rows tokenising the unpaired records would give, since a
  pair's sides are tokenised as prompt ids + completion ids each. Other per-pair arrays (the rm
  stage's `margin`) are not carried."""
  index, side = unpair_order(len(pairs["tokens"]))
  out = {k: pairs[k][index, side] for k in _ROWS}
  out["label"] = side == 0
  return out


# --- batching -------------------------------------------------------------------------------------

def distinct_prompts(pairs: dict | None, n: int | None = None) -> list[tuple[int, list[int]]]:
  """The distinct prompts (token ids before the first scored token) of pair arrays, in order,
  at most n, each with the index of its first pair."""
  out: dict[tuple[int, ...], int] = {}
  rows = zip(pairs["tokens"][:, 0], pairs["loss_mask"][:, 0]) if pairs else ()
  for i, (tokens, mask) in enumerate(rows):
    if len(out) == n:
      break
    scored = np.flatnonzero(mask)
    out.setdefault(tuple(int(t) for t in tokens[:scored[0] if len(scored) else 0]), i)
  return [(i, list(p)) for p, i in out.items() if p]


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

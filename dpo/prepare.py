"""A preference file -> filtered, templated, split, tokenised arrays, cached on disk.

    read lazily (dpo.formats) -> quality filters -> chat template (dpo.chat)
      -> held-out split by prompt hash -> prompts fitted to --max_prompt_length (a
      conversation loses whole earlier turns: chat.fit_record) -> tokenise (dpo.data)
      -> .npz cache

A file, a glob of shards, a save_to_disk folder or a mixture of them (`dpo.data.read_sources`:
each source read and parsed on its own, then the first records of its share, as TRL takes them) all
go the same way. Tokenising is the slow part for real data, so the result is stored under
`<cache_dir>/prefs-<key>.npz`, where the key is a SHA-256 over the data's bytes
(`data.source_digest`: every shard's name and content, a mixture's fractions),
the tokenizer's fingerprint, the chat template's and every setting that changes the arrays;
a second run with the same inputs loads the arrays instead of re-reading and re-tokenising. The
cache file is written to a temporary name (`.tmp.<host>.<pid>`) and renamed, so concurrent
processes (multi-host) never read a half-written file; a cache file that does not load (corrupt,
truncated, missing arrays) is removed and rebuilt, and temporary files left by interrupted
writes (their process is gone, or they are over an hour old) are removed.

The held-out split hashes the rendered prompt, so it does not depend on file order or seed and
pairs that share a prompt never straddle train and held-out.

`prepare_sft` reads an SFT file (`--sft_data`) the same way, renders its conversations with the
same template and tokenises them (not cached: SFT files are read once per run).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import logging
import os
import socket
import time
import zipfile
from typing import Any, NamedTuple

import numpy as np

from dpo import chat, data, formats
from dpo.data import DataError, Ends, tokenize_pairs, tokenize_sft

_VERSION = "prefs-v5"  # v3: the per-pair margin column; v4: the held-out records; v5: chat
                       # prompts fitted by whole turns, each training row's cut
_ARRAYS = ("tokens", "positions", "segment_ids", "loss_mask")


class Preparation(NamedTuple):
  """How a file becomes arrays: the tokenizer, the record layout (--data_format and its
  fields), the --chat_template value (`chat.resolve_template`), the token budgets, whether
  records that do not fit the format or that the template refuses are counted and skipped, and
  the flag that named the data when it is given as a plain string (`train_data`; a mixture's
  errors name it; a `data.DataValue` names its own)."""
  tok: Any
  spec: formats.FormatSpec = formats.FormatSpec()
  template: Any = "auto"
  max_prompt_length: int = 512
  max_target_length: int = 512
  skip_bad: bool = False
  flag: str = ""

  @property
  def lens(self) -> tuple[int, int]:
    return self.max_prompt_length, self.max_target_length


class Prepared(NamedTuple):
  train: dict[str, np.ndarray]            # [N, 2, T] arrays (see dpo.data)
  held: dict[str, np.ndarray] | None      # [M, 2, T'] or None when nothing was held out
  report: dict                            # counts: formats, fallbacks, filters, split, cache
  held_records: list | None = None        # the M held-out records as read (before rendering),
                                          # for a judge that renders them its own way
  train_records: list | None = None       # the same of the training pairs, when asked for
  cuts: list | None = None                # how each training row's prompt was fitted to
                                          # --max_prompt_length ("" whole; chat.fit_record)


def in_held_out(prompt: str, fraction: float) -> bool:
  """Deterministic membership of a prompt in the held-out fraction (hash of its UTF-8 bytes)."""
  if fraction <= 0.0:
    return False
  h = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
  return h / 2.0**64 < fraction


def cache_key(value: data.DataValue, how: Preparation, template_fingerprint: str,
              eval_split: float, train_records: bool = False) -> str:
  """The cache file's key: the data's bytes (`data.source_digest`; a mixture's fractions
  too), the tokenizer's fingerprint, the chat template's (`chat.template_fingerprint`),
  and every setting that changes the arrays."""
  parts = [_VERSION, data.source_digest(value), how.tok.fingerprint(),
           repr(dataclasses.astuple(how.spec)), template_fingerprint, repr(tuple(how.lens)),
           repr(float(eval_split)), repr(bool(how.skip_bad)), repr(bool(train_records))]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _save(path: str, prepared: Prepared) -> None:
  flat = {f"train/{k}": v for k, v in prepared.train.items()}
  if prepared.held is not None:
    flat.update({f"held/{k}": v for k, v in prepared.held.items()})
  buf = io.BytesIO()
  for part, records in (("held", prepared.held_records), ("train", prepared.train_records)):
    if records is not None:
      flat[f"{part}_records"] = np.frombuffer(
          json.dumps([formats.record_json(r) for r in records]).encode(), np.uint8)
  if prepared.cuts is not None:
    flat["train_cuts"] = np.frombuffer(json.dumps(prepared.cuts).encode(), np.uint8)
  np.savez(buf, report=np.frombuffer(json.dumps(prepared.report).encode(), np.uint8), **flat)
  tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(buf.getvalue())
  os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_stale_tmp(cache_dir: str, max_age_s: float = 3600.0) -> list[str]:
  """Removes the temporary files of interrupted cache writes: this host's whose process is gone,
  any host's older than `max_age_s` (a live write takes seconds). Returns what it removed."""
  removed, host = [], socket.gethostname()
  for name in os.listdir(cache_dir) if os.path.isdir(cache_dir) else ():
    if ".npz.tmp" not in name:
      continue
    path = os.path.join(cache_dir, name)
    owner = name.rsplit(".tmp", 1)[1].lstrip(".").rsplit(".", 1)
    ours_dead = (len(owner) == 2 and owner[0] == host and owner[1].isdigit()
                 and not _pid_alive(int(owner[1])))
    try:
      old = time.time() - os.path.getmtime(path) > max_age_s
      if ours_dead or old:
        os.remove(path)
        removed.append(path)
    except FileNotFoundError:  # another process finished or removed it meanwhile
      continue
  for path in removed:
    logging.warning("removed %s, left by an interrupted cache write", path)
  return removed


def _load(path: str) -> Prepared:
  """The cached arrays; ValueError when the file is not a complete cache."""
  try:
    with np.load(path) as z:
      train = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("train/")}
      held = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("held/")} or None
      report = json.loads(z["report"].tobytes().decode())
      records = {part: None if f"{part}_records" not in z.files else
                 [formats.record_of_json(r)
                  for r in json.loads(z[f"{part}_records"].tobytes().decode())]
                 for part in ("held", "train")}
      cuts = (json.loads(z["train_cuts"].tobytes().decode()) if "train_cuts" in z.files
              else None)
  except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as e:
    raise ValueError(f"{type(e).__name__}: {e}") from None
  for part, arrays in (("train", train), ("held", held or {a: None for a in _ARRAYS})):
    missing = [a for a in _ARRAYS if a not in arrays]
    if missing:
      raise ValueError(f"{part} arrays {missing} missing")
  shapes = {a.shape for k, a in train.items() if k != "margin"}  # margin is [N]
  if len(shapes) != 1 or len(next(iter(shapes))) != 3:
    raise ValueError(f"train arrays disagree in shape: {sorted(shapes)}")
  for part, arrays in (("held", held), ("train", train)):
    if arrays is not None and records[part] is not None and (
        len(records[part]) != len(arrays["tokens"])):
      raise ValueError(f"{part} records not one per {part} pair")
  if held is not None and records["held"] is None:
    raise ValueError("held-out records missing")
  if cuts is None or len(cuts) != len(train["tokens"]):
    raise ValueError("prompt cuts not one per train pair")
  return Prepared(train, held, report, records["held"], records["train"], cuts)


def _budget(how: Preparation, t, rendered: bool) -> data.PromptBudget:
  """The prompt budget `data.encode_prompt` will count, with `_template_marks`' BOS rule."""
  return data.PromptBudget(how.tok, how.max_prompt_length,
                           _template_marks(t, rendered).get("ends", Ends()).bos)


def _template_marks(t, rendered: bool) -> dict:
  """tokenize_* keywords for texts rendered (`rendered`) by template `t`: a tokenizer's own
  template writes BOS (or not: `emits_bos`, learnt from its renderings) and the end of each
  turn itself, so its texts get a BOS id only where it writes one, and no EOS. Text records and
  hand-written templates get both."""
  if rendered and isinstance(t, chat.JinjaTemplate) and t.emits_bos is not None:
    return dict(ends=Ends(bos=t.emits_bos, eos=False))
  return {}


def prepare_pairs(path: str | data.DataValue, how: Preparation, eval_split: float = 0.0,
                  cache_dir: str = "", train_records: bool = False) -> Prepared:
  """Reads, filters, renders, splits and tokenises preference data (a file, a glob of shards, a
  save_to_disk folder, or a mixture of them: a data flag's parsed value, `data.DataValue`, or
  a plain one, parsed here) (or loads the cache at <cache_dir>/prefs-<key>.npz; "" = no
  cache). The held-out records are kept as read (for a judge that renders them its own way);
  the training ones too with `train_records` (a file that is all held-out data,
  --eval_data)."""
  if not 0.0 <= eval_split < 1.0:
    raise ValueError(f"eval_split must be in [0, 1), got {eval_split}")
  value = data.data_value(path, how.flag)
  path = value.value  # what messages, logs and the report name
  for source in value.sources:
    data.source_files(source.path)  # a path that names no data: one line, before any work
  t = chat.resolve_template(how.template, how.tok)
  cache_path = None
  if cache_dir:
    remove_stale_tmp(cache_dir)
    key = cache_key(value, how, chat.template_fingerprint(t), eval_split, train_records)
    cache_path = os.path.join(cache_dir, f"prefs-{key}.npz")
    prepared = _cached(path, cache_path)
    if prepared is not None:
      return prepared
  (train, held), (train_m, held_m), records, cuts, report = _read_pairs(value, how, t,
                                                                          eval_split)
  report["cache"] = "miss" if cache_path else "off"
  logging.info("%s: %d train pairs, %d held-out (eval_split=%g), chat template %s", path,
               len(train), len(held), eval_split, t.name)
  marks = _template_marks(t, report.pop("chats"))
  with_margin = lambda arrays, m: arrays if m is None else {
      **arrays, "margin": np.asarray(m, np.float32)}
  prepared = Prepared(
      with_margin(tokenize_pairs(train, how.tok, *how.lens, what=f"{path} train pairs",
                                 **marks), train_m),
      with_margin(tokenize_pairs(held, how.tok, *how.lens, what=f"{path} held-out pairs",
                                 **marks), held_m) if held else None,
      report, records[1] if held else None, records[0] if train_records else None, cuts)
  if cache_path:
    os.makedirs(cache_dir, exist_ok=True)
    _save(cache_path, prepared)
    logging.info("%s: cached tokenised pairs at %s", path, cache_path)
  return prepared


def _cached(path: str, cache_path: str) -> Prepared | None:
  """The cached arrays of `path`, or None (no cache file, or one that does not load: removed)."""
  if not os.path.exists(cache_path):
    return None
  try:
    prepared = _load(cache_path)
  except ValueError as e:
    logging.warning("%s: cache file %s does not load (%s); removing it and rebuilding",
                    path, cache_path, e)
    try:
      os.remove(cache_path)
    except FileNotFoundError:
      pass
    return None
  logging.info("%s: loaded tokenised pairs from cache %s (%d train, %d held-out)", path,
               cache_path, len(prepared.train["tokens"]),
               0 if prepared.held is None else len(prepared.held["tokens"]))
  prepared.report["cache"] = "hit"
  return prepared


def _read_pairs(value: data.DataValue, how: Preparation, t, eval_split: float):
  """((train texts, held-out texts), their margins (None: the file has no `margin` field),
  (train, held-out) records as read, how each training prompt was cut, report): the file's
  records read, filtered, rendered with template `t`, split by the whole prompt's hash (so the
  split does not move with --max_prompt_length) and fitted to the prompt budget
  (`chat.fit_record`)."""
  path, stats = value.value, collections.Counter()
  skips = formats.Skips(path) if how.skip_bad else None
  located, sources = data.read_sources(
      value, lambda p: formats.iter_records(p, how.spec, stats, skips))
  if not located:
    raise DataError(f"{path}: no records")
  kept, filt = formats.filter_records(located)
  read = dict(kept)  # where -> the record as read
  chats = any(isinstance(r, formats.ChatRecord) for _, r in kept)
  train, held, rendered = [], [], []
  for where, rec in kept:
    try:
      text = chat.render_record(rec, t, where)
    except DataError as e:
      if skips is None:
        raise
      skips.add(e)
      continue
    rendered.append((where, text))
  kept, filt = formats.filter_rendered(rendered, filt)
  filt.log(path)
  margin = _margins(value, [where for where, _ in kept])
  train_m, held_m, records = [], [], ([], [])
  budget, cuts = _budget(how, t, chats), (chat.PromptCuts(), chat.PromptCuts())
  for (where, text), m in zip(kept, margin or [None] * len(kept)):
    out = in_held_out(text.prompt, eval_split)
    text = _fit(read[where], text, t, budget, where, skips, cuts[out])
    if text is None:
      continue
    (held if out else train).append(text)
    (held_m if out else train_m).append(m)
    records[out].append(read[where])
  if skips is not None:
    skips.log()
  for part, c in zip(("train pairs", "held-out pairs"), cuts):
    c.log(f"{path} {part}", how.max_prompt_length)
  if not train:
    raise DataError(f"{path}: no training pairs left after filtering and the held-out split")
  report = {"path": path, **dict(stats), "filters": dataclasses.asdict(filt),
            "skipped_bad_records": skips.count if skips is not None else 0,
            "train_pairs": len(train), "held_out_pairs": len(held), "template": t.name,
            "template_emits_bos": t.emits_bos if isinstance(t, chat.JinjaTemplate) else None,
            "tokenizer": how.tok.fingerprint(), "chats": chats,
            "prompt_cuts": {"train": cuts[0].counts, "held_out": cuts[1].counts}}
  if len(sources) > 1:
    report["sources"] = sources
  margins = (None, None) if margin is None else (train_m, held_m)
  return (train, held), margins, records, cuts[0].rows, report


def _margins(value: data.DataValue, wheres: list[str]) -> list[float] | None:
  """The `margin` of each kept record (at `wheres`), or None when no record has one; a file
  where some records have it and others do not is a DataError naming a record without it."""
  found = formats.margins(value)
  if not found:
    return None
  missing = [w for w in wheres if w not in found]
  if missing:
    raise DataError(f"{missing[0]}: field 'margin' is missing, and {next(iter(found))} has "
                    f"one; give every record a margin or none")
  return [found[w] for w in wheres]


def prepare_sft(path: str | data.DataValue, how: Preparation
                ) -> tuple[dict[str, np.ndarray], dict]:
  """(the [N, T] arrays, a report) of SFT data (a source or a mixture, as for `prepare_pairs`)
  in any layout `formats.iter_sft_records` reads (`how.spec` is not read), its conversations
  rendered by the template exactly as
  `prepare_pairs` renders a pair's prompt and chosen side (so SFT and DPO see one text
  format)."""
  value = data.data_value(path, how.flag)
  tok, path = how.tok, value.value
  t = chat.resolve_template(how.template, tok)
  stats = collections.Counter()
  skips = formats.Skips(path) if how.skip_bad else None
  examples, chats = [], False
  located, sources = data.read_sources(
      value, lambda p: formats.iter_sft_records(p, stats, skips))
  rendered = []
  for where, rec in located:
    chats = chats or isinstance(rec, formats.ChatSFTRecord)
    try:
      rendered.append((where, rec, chat.render_sft(rec, t, where)))
    except DataError as e:
      if skips is None:
        raise
      skips.add(e)
  budget, cuts = _budget(how, t, chats), chat.PromptCuts()
  examples = [e for e in (_fit(rec, text, t, budget, where, skips, cuts)
                          for where, rec, text in rendered) if e is not None]
  if skips is not None:
    skips.log()
  cuts.log(f"{path} SFT examples", how.max_prompt_length)
  if not examples:
    raise DataError(f"{path}: no SFT examples" + (" left after skipping bad records" if skips
                                                   and skips.count else ""))
  report = {"path": path, "role": "sft", **dict(stats), "examples": len(examples),
            "skipped_bad_records": skips.count if skips is not None else 0,
            "template": t.name if chats else None, "prompt_cuts": cuts.counts}
  if len(sources) > 1:
    report["sources"] = sources
  logging.info("%s: %d SFT examples%s", path, len(examples),
               f", chat template {t.name}" if chats else " (text, no chat template)")
  arrays = tokenize_sft(examples, tok, *how.lens, what=f"{path} SFT examples",
                        **_template_marks(t, chats))
  return arrays, report


def _fit(record, text, t, budget: data.PromptBudget, where: str, skips, cuts: chat.PromptCuts):
  """`text` (the rendering of `record`) fitted to `budget` (`chat.fit_record`), its cut added to
  `cuts`; None when the template refuses the cut conversation and `skips` counts it (without
  --skip_bad_records, the DataError)."""
  try:
    text, cut = chat.fit_record(record, text, t, budget, where)
  except DataError as e:
    if skips is None:
      raise
    skips.add(e)
    return None
  cuts.add(where, cut)
  return text


def _read_one_side(path, how: Preparation, eval_split: float, iterate):
  """(the data's name, its template, the format counts, the skips or None, the (location,
  record)s `iterate` reads of every source, the mixture's sources) of unpaired or prompt
  data."""
  if not 0.0 <= eval_split < 1.0:
    raise ValueError(f"eval_split must be in [0, 1), got {eval_split}")
  value = data.data_value(path, how.flag)
  stats = collections.Counter()
  skips = formats.Skips(value.value) if how.skip_bad else None
  located, sources = data.read_sources(value, lambda p: iterate(p, stats, skips))
  return (value.value, chat.resolve_template(how.template, how.tok), stats, skips, located,
          sources)


class PreparedUnpaired(NamedTuple):
  train: dict[str, np.ndarray]          # [N, T] rows and `label` [N] (True: desirable)
  held: dict[str, np.ndarray] | None    # the same of the held-out examples, or None
  held_records: list | None             # the held-out examples as read
  report: dict
  cuts: list | None = None              # how each training example's prompt was fitted


def prepare_unpaired(path: str | data.DataValue, how: Preparation, eval_split: float = 0.0
                     ) -> PreparedUnpaired:
  """Unpaired feedback ({prompt, completion, label}, a source or a mixture, as for
  `prepare_pairs`; `formats.iter_unpaired_records`), each example rendered by the template as
  `prepare_sft` renders one (so SFT, DPO and KTO see one text format), split by prompt hash as
  `prepare_pairs` splits pairs, and tokenised to [N, T] rows with `label` beside them (not
  cached: read once per run, as SFT data)."""
  path, t, stats, skips, located, sources = _read_one_side(path, how, eval_split,
                                                         formats.iter_unpaired_records)
  parts = ([], []), ([], []), ([], [])  # (texts, labels, records) of (train, held-out)
  chats, rendered = False, []
  for where, rec in located:
    chats = chats or not isinstance(rec.prompt, str)
    try:
      rendered.append((where, rec, chat.render_sft(rec.example(), t, where)))
    except DataError as e:
      if skips is None:
        raise
      skips.add(e)
  budget, cuts = _budget(how, t, chats), (chat.PromptCuts(), chat.PromptCuts())
  for where, rec, text in rendered:
    out = in_held_out(text.prompt, eval_split)  # the whole prompt's hash, as for pairs
    text = _fit(rec.example(), text, t, budget, where, skips, cuts[out])
    if text is None:
      continue
    for part, value in zip(parts, (text, rec.label, rec)):
      part[out].append(value)
  if skips is not None:
    skips.log()
  for part, c in zip(("unpaired examples", "held-out unpaired examples"), cuts):
    c.log(f"{path} {part}", how.max_prompt_length)
  (train, held), (train_l, held_l), (_, held_r) = parts
  if not train:
    raise DataError(f"{path}: no unpaired training examples" + (
        " left after skipping bad records and the held-out split" if located else ""))
  report = {"path": path, "role": "unpaired", **dict(stats),
            "skipped_bad_records": skips.count if skips is not None else 0,
            "train_examples": len(train), "held_out_examples": len(held),
            "desirable": int(sum(train_l)), "template": t.name if chats else None,
            "prompt_cuts": {"train": cuts[0].counts, "held_out": cuts[1].counts}}
  if len(sources) > 1:
    report["sources"] = sources
  logging.info("%s: %d unpaired training examples (%d desirable), %d held-out (eval_split=%g)%s",
               path, len(train), sum(train_l), len(held), eval_split,
               f", chat template {t.name}" if chats else "")
  marks = _template_marks(t, chats)
  rows = lambda texts, labels, what: {
      **tokenize_sft(texts, how.tok, *how.lens, what=f"{path} {what}", **marks),
      "label": np.asarray(labels, bool)}
  return PreparedUnpaired(rows(train, train_l, "unpaired examples"),
                          rows(held, held_l, "held-out unpaired examples") if held else None,
                          held_r or None, report, cuts[0].rows)


class PreparedPrompts(NamedTuple):
  train: dict[str, np.ndarray]       # [N, T] rows: each prompt and its worked solution (none:
                                     # only the EOS after the prompt is scored)
  held: dict[str, np.ndarray] | None  # the same of the held-out prompts, or None
  train_records: list                # the N training records as read (formats.PromptRecord)
  held_records: list | None          # the held-out ones
  solved: np.ndarray                 # [N] bool: the record has a worked solution (SFT data)
  report: dict
  cuts: list | None = None           # how each training prompt was fitted


def prepare_prompts(path: str | data.DataValue, how: Preparation, eval_split: float = 0.0
                    ) -> PreparedPrompts:
  """Prompts with answers (`formats.iter_prompt_records`: TRL's prompt-only layout, GSM8K,
  MATH; a source or a mixture) for the sampling stages: each prompt (and its worked solution,
  where the layout has one, for an SFT stage) rendered by the template as `prepare_sft` renders
  an example, split by the prompt's hash as `prepare_pairs` splits pairs, fitted to
  --max_prompt_length, and tokenised to [N, T] rows; the records kept as read, their extra
  columns for the reward functions (not cached: read once per run, as SFT data)."""
  path, t, stats, skips, located, sources = _read_one_side(path, how, eval_split,
                                                         formats.iter_prompt_records)
  parts = ([], []), ([], [])  # (texts, records) of (train, held-out)
  chats, rendered = False, []
  for where, rec in located:
    chats = chats or not isinstance(rec.prompt, str)
    # A prompt without a worked solution is rendered with an empty one (its prompt the same).
    example = rec._replace(completion=rec.completion or (
        "" if isinstance(rec.prompt, str) else (formats.Message("assistant", ""),))).example()
    try:
      rendered.append((where, rec, example, chat.render_sft(example, t, where)))
    except DataError as e:
      if skips is None:
        raise
      skips.add(e)
  budget, cuts = _budget(how, t, chats), (chat.PromptCuts(), chat.PromptCuts())
  for where, rec, example, text in rendered:
    out = in_held_out(text.prompt, eval_split)
    text = _fit(example, text, t, budget, where, skips, cuts[out])
    if text is None:
      continue
    for part, value in zip(parts, (text, rec)):
      part[out].append(value)
  if skips is not None:
    skips.log()
  for part, c in zip(("prompts", "held-out prompts"), cuts):
    c.log(f"{path} {part}", how.max_prompt_length)
  (train, held), (train_r, held_r) = parts
  if not train:
    raise DataError(f"{path}: no training prompts" + (
        " left after skipping bad records and the held-out split" if located else ""))
  solved = np.array([r.completion is not None for r in train_r], bool)
  report = {"path": path, "role": "prompts", **dict(stats),
            "skipped_bad_records": skips.count if skips is not None else 0,
            "train_prompts": len(train), "held_out_prompts": len(held),
            "worked_solutions": int(solved.sum()), "template": t.name if chats else None,
            "prompt_cuts": {"train": cuts[0].counts, "held_out": cuts[1].counts}}
  if len(sources) > 1:
    report["sources"] = sources
  logging.info("%s: %d training prompts (%d with worked solutions), %d held-out "
               "(eval_split=%g)%s", path, len(train), solved.sum(), len(held), eval_split,
               f", chat template {t.name}" if chats else "")
  rows = lambda texts, what: tokenize_sft(texts, how.tok, *how.lens, what=f"{path} {what}",
                                          **_template_marks(t, chats))
  return PreparedPrompts(rows(train, "prompts"), rows(held, "held-out prompts") if held else None,
                         train_r, held_r or None, solved, report, cuts[0].rows)

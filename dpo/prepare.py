"""A preference file -> filtered, templated, split, tokenised arrays, cached on disk.

    read lazily (dpo.formats) -> quality filters -> chat template (dpo.chat)
      -> held-out split by prompt hash -> tokenise (dpo.data) -> .npz cache

Tokenising is the slow part for real data, so the result is stored under
`<cache_dir>/prefs-<key>.npz`, where the key is a SHA-256 over the file's bytes, the tokenizer's
fingerprint and every setting that changes the arrays; a second run with the same inputs loads
the arrays instead of re-reading and re-tokenising. The cache file is written to a temporary
name and renamed, so concurrent processes (multi-host) never read a half-written file.

The held-out split hashes the rendered prompt, so it does not depend on file order or seed and
pairs that share a prompt never straddle train and held-out.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import logging
import os
from typing import NamedTuple

import numpy as np

from dpo import chat, formats
from dpo.data import DataError, tokenize_pairs

_VERSION = "prefs-v1"


class Prepared(NamedTuple):
  train: dict[str, np.ndarray]            # [N, 2, T] arrays (see dpo.data)
  held: dict[str, np.ndarray] | None      # [M, 2, T'] or None when nothing was held out
  report: dict                            # counts: formats, fallbacks, filters, split, cache


def in_held_out(prompt: str, fraction: float) -> bool:
  """Deterministic membership of a prompt in the held-out fraction (hash of its UTF-8 bytes)."""
  if fraction <= 0.0:
    return False
  h = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
  return h / 2.0**64 < fraction


def _file_digest(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def cache_key(path: str, tok, spec: formats.FormatSpec, template: str, lens: tuple[int, int],
              eval_split: float) -> str:
  parts = [_VERSION, _file_digest(path), tok.fingerprint(), repr(dataclasses.astuple(spec)),
           template, repr(tuple(lens)), repr(float(eval_split))]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _save(path: str, prepared: Prepared) -> None:
  flat = {f"train/{k}": v for k, v in prepared.train.items()}
  if prepared.held is not None:
    flat.update({f"held/{k}": v for k, v in prepared.held.items()})
  buf = io.BytesIO()
  np.savez(buf, report=np.frombuffer(json.dumps(prepared.report).encode(), np.uint8), **flat)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(buf.getvalue())
  os.replace(tmp, path)


def _load(path: str) -> Prepared:
  with np.load(path) as z:
    train = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("train/")}
    held = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("held/")} or None
    report = json.loads(z["report"].tobytes().decode())
  return Prepared(train, held, report)


def prepare_pairs(path: str, tok, spec: formats.FormatSpec = formats.FormatSpec(),
                  template: str = "plain", max_prompt_length: int = 512,
                  max_target_length: int = 512, eval_split: float = 0.0,
                  cache_dir: str = "") -> Prepared:
  """Reads, filters, renders, splits and tokenises one preference file (or loads the cache)."""
  if not 0.0 <= eval_split < 1.0:
    raise ValueError(f"eval_split must be in [0, 1), got {eval_split}")
  if not os.path.exists(path):
    raise DataError(f"{path}: no such file")
  t = chat.get_template(template)
  lens = (max_prompt_length, max_target_length)
  cache_path = None
  if cache_dir:
    key = cache_key(path, tok, spec, t.name, lens, eval_split)
    cache_path = os.path.join(cache_dir, f"prefs-{key}.npz")
    if os.path.exists(cache_path):
      prepared = _load(cache_path)
      logging.info("%s: loaded tokenised pairs from cache %s (%d train, %d held-out)", path,
                   cache_path, len(prepared.train["tokens"]),
                   0 if prepared.held is None else len(prepared.held["tokens"]))
      prepared.report["cache"] = "hit"
      return prepared

  stats = collections.Counter()
  located = list(formats.iter_records(path, spec, stats))
  if not located:
    raise DataError(f"{path}: no records")
  kept, filt = formats.filter_records(located)
  filt.log(path)
  train, held = [], []
  for _, rec in kept:
    text = chat.render_record(rec, t)
    (held if in_held_out(text.prompt, eval_split) else train).append(text)
  if not train:
    raise DataError(f"{path}: no training pairs left after filtering and the held-out split")
  report = {"path": path, **dict(stats), "filters": dataclasses.asdict(filt),
            "train_pairs": len(train), "held_out_pairs": len(held), "template": t.name,
            "tokenizer": tok.fingerprint(), "cache": "miss" if cache_path else "off"}
  logging.info("%s: %d train pairs, %d held-out (eval_split=%g)", path, len(train), len(held),
               eval_split)
  prepared = Prepared(
      tokenize_pairs(train, tok, *lens, what=f"{path} train pairs"),
      tokenize_pairs(held, tok, *lens, what=f"{path} held-out pairs") if held else None,
      report)
  if cache_path:
    os.makedirs(cache_dir, exist_ok=True)
    _save(cache_path, prepared)
    logging.info("%s: cached tokenised pairs at %s", path, cache_path)
  return prepared

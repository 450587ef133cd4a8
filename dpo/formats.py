"""Preference data as users bring it: format detection, parsing, quality filters.

Files are read by `dpo.data.iter_objects` (JSONL or a JSON array, optionally gzipped). Every
record is parsed into one of two internal records:

    PreferenceRecord(prompt, chosen, rejected)   plain strings (from dpo.data)
    ChatRecord(prompt, chosen, rejected)         tuples of Message(role, content)

`dpo.chat` renders a ChatRecord into a PreferenceRecord with a model family's template.

Formats (`--data_format`, "auto" detects from the first record's keys):

    standard        {"prompt": str, "chosen": str, "rejected": str}
    conversational  {"prompt": [msg], "chosen": [assistant msg], "rejected": [assistant msg]}
    implicit        {"chosen": str, "rejected": str}, full transcripts (Anthropic HH-RLHF's
                    "\\n\\nHuman: ...\\n\\nAssistant: ..."); the prompt is the shared text up to and
                    including the last "\\n\\nAssistant:". Where the two transcripts disagree
                    before that marker, the prompt falls back to the longest common prefix, cut
                    back to the last marker inside it. Message-list transcripts split at the
                    longest common run of messages.
    openai          {"input": {"messages": [msg]}, "preferred_output": [assistant msg],
                    "non_preferred_output": [assistant msg]}  (OpenAI preference fine-tuning)
    columns         any other names, mapped by --prompt_field / --chosen_field / --rejected_field

Errors are `DataError`s whose message starts with the record's location (`file:LINE` or
`file[INDEX]`, as `iter_objects` yields it) and names the offending field.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
from typing import Iterator, NamedTuple, Sequence, Union

from dpo.data import DataError, PreferenceRecord, get_field, iter_objects, text_field

FORMATS = ("auto", "standard", "conversational", "implicit", "openai", "columns")
HH_ASSISTANT = "\n\nAssistant:"


class Message(NamedTuple):
  role: str
  content: str


class ChatRecord(NamedTuple):
  prompt: tuple[Message, ...]
  chosen: tuple[Message, ...]
  rejected: tuple[Message, ...]


Record = Union[PreferenceRecord, ChatRecord]


@dataclasses.dataclass(frozen=True)
class FormatSpec:
  """How to read records: the format name and, for "columns", the three field names."""
  data_format: str = "auto"
  prompt_field: str = ""
  chosen_field: str = ""
  rejected_field: str = ""

  def __post_init__(self):
    if self.data_format not in FORMATS:
      raise ValueError(f"data_format must be one of {FORMATS}, got {self.data_format!r}")
    named = [self.prompt_field, self.chosen_field, self.rejected_field]
    if (self.data_format == "columns" or any(named)) and not (self.chosen_field and
                                                              self.rejected_field):
      raise ValueError("data_format=columns needs --chosen_field and --rejected_field "
                       "(and --prompt_field unless the data has no prompt)")
    if any(named) and self.data_format not in ("auto", "columns"):
      raise ValueError(f"column flags are only used with data_format=columns, not "
                       f"{self.data_format!r}")


# --- fields -----------------------------------------------------------------------------------

def _text(obj: dict, field: str, where: str) -> str:
  """A string field that may be empty: the quality filters count and drop empty responses."""
  return text_field(obj, field, where, allow_empty=True)


def _messages(value, field: str, where: str, roles: Sequence[str] | None = None
              ) -> tuple[Message, ...]:
  if not isinstance(value, list):
    raise DataError(f"{where}: field {field!r} must be a list of messages, got "
                    f"{type(value).__name__}")
  out = []
  for i, m in enumerate(value):
    name = f"{field}[{i}]"
    if not isinstance(m, dict):
      raise DataError(f"{where}: field {name!r} must be a {{role, content}} object, got "
                      f"{type(m).__name__}")
    at = f"{where}: {name}"
    role, content = _text(m, "role", at), get_field(m, "content", at)
    if not isinstance(content, str):
      raise DataError(f"{where}: field '{name}.content' must be a string, got "
                      f"{type(content).__name__}")
    if roles is not None and role not in roles:
      raise DataError(f"{where}: field '{name}.role' is {role!r}; expected one of {list(roles)}")
    out.append(Message(role, content))
  return tuple(out)


_PROMPT_ROLES = ("system", "developer", "user", "assistant")


def _parse_standard(obj, where, spec, stats) -> Record:
  return PreferenceRecord(_text(obj, "prompt", where), _text(obj, "chosen", where),
                          _text(obj, "rejected", where))


def _parse_conversational(obj, where, spec, stats) -> Record:
  prompt = _messages(get_field(obj, "prompt", where), "prompt", where, _PROMPT_ROLES)
  if not prompt:
    raise DataError(f"{where}: field 'prompt' has no messages")
  return ChatRecord(prompt,
                    _messages(get_field(obj, "chosen", where), "chosen", where, ("assistant",)),
                    _messages(get_field(obj, "rejected", where), "rejected", where, ("assistant",)))


def _parse_openai(obj, where, spec, stats) -> Record:
  inp = get_field(obj, "input", where)
  if not isinstance(inp, dict):
    raise DataError(f"{where}: field 'input' must be an object, got {type(inp).__name__}")
  prompt = _messages(get_field(inp, "messages", f"{where}: input"), "input.messages", where,
                     _PROMPT_ROLES)
  if not prompt:
    raise DataError(f"{where}: field 'input.messages' has no messages")
  return ChatRecord(
      prompt,
      _messages(get_field(obj, "preferred_output", where), "preferred_output", where,
                ("assistant",)),
      _messages(get_field(obj, "non_preferred_output", where), "non_preferred_output", where,
                ("assistant",)))


def _parse_columns(obj, where, spec, stats) -> Record:
  prompt = _text(obj, spec.prompt_field, where) if spec.prompt_field else ""
  return PreferenceRecord(prompt, _text(obj, spec.chosen_field, where),
                          _text(obj, spec.rejected_field, where))


def split_transcripts(chosen: str, rejected: str, marker: str = HH_ASSISTANT
                      ) -> tuple[str, str, str, bool]:
  """(prompt, chosen completion, rejected completion, used_fallback) for two full transcripts.

  The prompt is the text up to and including the last `marker` when both transcripts agree up
  to there. Otherwise (a response containing a stray marker or an extra turn) it is the longest
  common prefix cut back to the end of the last marker inside it, or the whole common prefix
  when it holds no marker.
  """
  kc, kr = chosen.rfind(marker), rejected.rfind(marker)
  if kc >= 0 and kr >= 0:
    cut = kc + len(marker)
    if kc == kr and chosen[:cut] == rejected[:cut]:
      return chosen[:cut], chosen[cut:], rejected[cut:], False
  common = os.path.commonprefix([chosen, rejected])
  k = common.rfind(marker)
  cut = k + len(marker) if k >= 0 else len(common)
  return chosen[:cut], chosen[cut:], rejected[cut:], True


def _split_messages(chosen, rejected):
  n = 0
  while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
    n += 1
  while n > 0 and chosen[n - 1].role == "assistant":  # completions start at an assistant turn
    n -= 1
  return chosen[:n], chosen[n:], rejected[n:]


def _parse_implicit(obj, where, spec, stats) -> Record:
  c, r = get_field(obj, "chosen", where), get_field(obj, "rejected", where)
  if isinstance(c, list) or isinstance(r, list):
    c, r = _messages(c, "chosen", where), _messages(r, "rejected", where)
    prompt, cc, rc = _split_messages(c, r)
    if not prompt:
      raise DataError(f"{where}: fields 'chosen' and 'rejected' share no prompt messages")
    for field, msgs in (("chosen", cc), ("rejected", rc)):
      bad = [m.role for m in msgs if m.role != "assistant"]
      if bad:
        raise DataError(f"{where}: field {field!r} continues with non-assistant turns {bad} "
                        f"after the shared prompt")
    return ChatRecord(prompt, cc, rc)
  for field, v in (("chosen", c), ("rejected", r)):
    if not isinstance(v, str):
      raise DataError(f"{where}: field {field!r} must be a string or a list of messages, got "
                      f"{type(v).__name__}")
  prompt, cc, rc, fallback = split_transcripts(c, r)
  if fallback:
    stats["prompt_from_common_prefix"] += 1
    logging.info("%s: chosen and rejected disagree before the last %r; prompt = their longest "
                 "common prefix (%d chars)", where, HH_ASSISTANT, len(prompt))
  return PreferenceRecord(prompt, cc, rc)


_PARSERS = {"standard": _parse_standard, "conversational": _parse_conversational,
            "implicit": _parse_implicit, "openai": _parse_openai, "columns": _parse_columns}


def detect_format(obj: dict, where: str, spec: FormatSpec = FormatSpec()) -> str:
  """The format of a record from its keys (explicit column flags win)."""
  if spec.data_format != "auto":
    return spec.data_format
  if spec.chosen_field or spec.rejected_field:
    return "columns"
  if "input" in obj and "preferred_output" in obj:
    return "openai"
  if "chosen" in obj and "rejected" in obj:
    if "prompt" not in obj:
      return "implicit"
    return "conversational" if isinstance(obj["prompt"], list) else "standard"
  raise DataError(f"{where}: cannot detect the data format from fields {sorted(obj)}; pass "
                  f"--data_format, or --prompt_field/--chosen_field/--rejected_field to map "
                  f"other column names")


def iter_records(path: str, spec: FormatSpec = FormatSpec(),
                 stats: collections.Counter | None = None) -> Iterator[tuple[str, Record]]:
  """Lazily yields (location, record); the format is detected once, from the first record.

  `stats` (if given) counts records per format and implicit-prompt fallbacks.
  """
  stats = collections.Counter() if stats is None else stats
  parse = None
  for where, obj in iter_objects(path):
    if parse is None:
      fmt = detect_format(obj, where, spec)
      logging.info("%s: data format %s", path, fmt)
      parse = _PARSERS[fmt]
    stats[f"format_{fmt}"] += 1
    yield where, parse(obj, where, spec, stats)


# --- quality filters --------------------------------------------------------------------------

def response_text(response: str | tuple[Message, ...]) -> str:
  return response if isinstance(response, str) else "\n".join(m.content for m in response)


@dataclasses.dataclass
class FilterReport:
  """What the quality filters saw and dropped; every drop is counted, none is silent."""
  records: int = 0
  empty_response: int = 0
  chosen_equals_rejected: int = 0
  duplicate_pair: int = 0
  kept: int = 0
  distinct_1: float = 0.0
  distinct_2: float = 0.0
  examples: dict = dataclasses.field(default_factory=dict)  # reason -> first few locations

  def log(self, what: str, low_distinct2: float = 0.1) -> None:
    logging.info("%s: %d records, dropped %d with an empty response, %d with chosen == rejected, "
                 "%d exact duplicate pairs; kept %d. distinct-1 %.3f, distinct-2 %.3f over "
                 "responses", what, self.records, self.empty_response,
                 self.chosen_equals_rejected, self.duplicate_pair, self.kept, self.distinct_1,
                 self.distinct_2)
    for reason, where in self.examples.items():
      logging.info("%s: %s, e.g. %s", what, reason, ", ".join(where))
    if self.kept and self.distinct_2 < low_distinct2:
      logging.warning("%s: low response diversity, distinct-2 = %.3f < %.2f; the responses "
                      "repeat themselves (templated or degenerate data?)", what,
                      self.distinct_2, low_distinct2)


def distinct_n(texts: Sequence[str], n: int) -> float:
  """Unique word n-grams / total word n-grams over all texts (whitespace words; 0 if none)."""
  seen, total = set(), 0
  for t in texts:
    words = t.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    seen.update(grams)
    total += len(grams)
  return len(seen) / total if total else 0.0


def filter_records(located: Sequence[tuple[str, Record]]) -> tuple[list[tuple[str, Record]],
                                                                  FilterReport]:
  """Drops pairs with an empty response, chosen == rejected, or an exact duplicate (in that
  order of precedence); returns the kept (location, record) pairs and the counts."""
  report = FilterReport(records=len(located))
  examples = collections.defaultdict(list)
  seen, kept = set(), []
  for where, rec in located:
    c, r = response_text(rec.chosen), response_text(rec.rejected)
    reason = None
    if not c.strip() or not r.strip():
      reason = "empty_response"
    elif rec.chosen == rec.rejected:
      reason = "chosen_equals_rejected"
    elif rec in seen:
      reason = "duplicate_pair"
    if reason:
      setattr(report, reason, getattr(report, reason) + 1)
      if len(examples[reason]) < 5:
        examples[reason].append(where)
      continue
    seen.add(rec)
    kept.append((where, rec))
  report.kept = len(kept)
  responses = [response_text(x) for _, rec in kept for x in (rec.chosen, rec.rejected)]
  report.distinct_1, report.distinct_2 = distinct_n(responses, 1), distinct_n(responses, 2)
  report.examples = dict(examples)
  return kept, report

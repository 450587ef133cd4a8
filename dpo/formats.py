"""Preference data as users bring it: format detection, parsing, quality filters.

Sources are read by `dpo.data.iter_objects` (JSONL or a JSON array, optionally gzipped;
Parquet; Arrow; a glob of shards or a save_to_disk folder of them), so a Parquet row reaches the
parsers as the same dict its JSON line would. Every record is parsed into one of two internal
records:

    PreferenceRecord(prompt, chosen, rejected)   plain strings (from dpo.data)
    ChatRecord(prompt, chosen, rejected)         tuples of Message(role, content)

`dpo.chat` renders a ChatRecord into a PreferenceRecord with a model family's template.

Formats (`--data_format`; "auto" decides over all records of the file, and a record that fits
another format than the file's is an error naming it, or a counted skip with
--skip_bad_records):

    standard        {"prompt": str, "chosen": str, "rejected": str}
    conversational  {"prompt": [msg], "chosen": [assistant msg], "rejected": [assistant msg]}
    implicit        {"chosen": str, "rejected": str}, full transcripts (Anthropic HH-RLHF's
                    "\\n\\nHuman: ...\\n\\nAssistant: ..."); the prompt is the shared text up to and
                    including the last "\\n\\nAssistant:". Where the two transcripts disagree
                    before that marker, the prompt falls back to the longest common prefix, cut
                    back to the last marker inside it. Message-list transcripts split at the
                    longest common run of messages; so do they beside a string "prompt"
                    (HuggingFaceH4/ultrafeedback_binarized; TRL's maybe_extract_prompt also
                    takes the prompt from the conversations then, and the string is not read).
    openai          {"input": {"messages": [msg]}, "preferred_output": [assistant msg],
                    "non_preferred_output": [assistant msg]}  (OpenAI preference fine-tuning)
    sharegpt        LLaMA-Factory's ShareGPT preference layout: {"conversations": [{"from",
                    "value"}], "chosen": {"from": "gpt", "value"}, "rejected": {...}} (chosen /
                    rejected may also be message lists or strings; an optional "system" string;
                    roles human, gpt, system, observation (-> tool), function / function_call
                    (-> assistant); {"role", "content"} messages are accepted too)
    columns         any other names, mapped by --prompt_field / --chosen_field / --rejected_field,
                    dotted paths reaching into nested records ("meta.question", "turns.0.text");
                    a mapped value may be a string or a message list

SFT data (`--sft_data`; the layout decided over all records the same way, `iter_sft_records`):

    standard        {"prompt": str, "completion": str}
    conversational  {"prompt": [msg], "completion": [assistant msg]}  (TRL prompt-completion)
    messages        {"messages": [msg, ..., assistant msg]}  (TRL / OpenAI chat fine-tuning)
    sharegpt        {"conversations": [{"from", "value"}, ..., gpt turn], "system": optional}

A conversation's trailing assistant turns are the completion and everything before them the
prompt; a conversation that does not end with an assistant turn is an error naming the record.

Unpaired feedback (the kto stage, `iter_unpaired_records`; TRL's unpaired preference format):

    standard        {"prompt": str, "completion": str, "label": bool}
    conversational  {"prompt": [msg], "completion": [assistant msg], "label": bool}

`label` is true for a desirable completion, false for an undesirable one. Preference pairs
become unpaired examples as TRL's `unpair_preference_dataset` makes them (`unpair`): each pair
gives its chosen completion (true) and its rejected one (false) with the same prompt. A pair
format's detection names a file of unpaired records as such (only the kto stage reads them).

A message's content is a string or an OpenAI content-part list ([{"type": "text", "text": ...}]:
the text parts are joined; any other part is an error). The prompt of a conversation must not
end with an assistant turn (the completion would be a second one).

Errors are `DataError`s whose message starts with the record's location (`file:LINE`,
`file[INDEX]` or `file row ROW`, as `iter_objects` yields it) and names the offending field.
`iter_records` and `iter_sft_records` read one source; a mixture (`dpo.data.read_sources`) reads
each of its sources through them, so each source has its own format.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
from typing import Iterator, NamedTuple, Sequence, Union

from dpo.data import (DataError, DataValue, PreferenceRecord, SFTRecord, check_text, data_value,
                      get_field, iter_objects, text_field, unpair_order)

FORMATS = ("auto", "standard", "conversational", "implicit", "openai", "sharegpt", "columns")
HH_ASSISTANT = "\n\nAssistant:"


class Message(NamedTuple):
  role: str
  content: str


class ChatRecord(NamedTuple):
  prompt: tuple[Message, ...]
  chosen: tuple[Message, ...]
  rejected: tuple[Message, ...]


class ChatSFTRecord(NamedTuple):
  prompt: tuple[Message, ...]
  completion: tuple[Message, ...]


Record = Union[PreferenceRecord, ChatRecord]
SFTExample = Union[SFTRecord, ChatSFTRecord]


class UnpairedRecord(NamedTuple):
  """One unpaired example: a prompt, a completion (strings, or tuples of Messages for a
  conversation) and whether the completion is desirable."""
  prompt: str | tuple[Message, ...]
  completion: str | tuple[Message, ...]
  label: bool

  def example(self) -> SFTExample:
    """The prompt and completion as an SFT example (what `chat.render_sft` renders)."""
    kind = SFTRecord if isinstance(self.prompt, str) else ChatSFTRecord
    return kind(self.prompt, self.completion)


def record_json(rec: Record) -> dict:
  """A record as plain JSON (a cache stores the held-out records so): text fields stay strings,
  a conversation is a list of [role, content]."""
  turns = lambda v: v if isinstance(v, str) else [list(m) for m in v]
  return {"prompt": turns(rec.prompt), "chosen": turns(rec.chosen),
          "rejected": turns(rec.rejected)}


def record_of_json(obj: dict) -> Record:
  """The record `record_json` wrote."""
  if isinstance(obj["prompt"], str):
    return PreferenceRecord(obj["prompt"], obj["chosen"], obj["rejected"])
  turns = lambda v: tuple(Message(*m) for m in v)
  return ChatRecord(turns(obj["prompt"]), turns(obj["chosen"]), turns(obj["rejected"]))


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


def get_path(obj: dict, path: str, where: str):
  """The value at a dotted path: object keys, or list indices for lists ("turns.0.text")."""
  value, seen = obj, []
  for part in path.split("."):
    here = ".".join(seen) or "the record"
    if isinstance(value, dict):
      if part not in value:
        raise DataError(f"{where}: missing field {'.'.join([*seen, part])!r} ({here} has "
                        f"{sorted(value)})")
      value = value[part]
    elif isinstance(value, list) and part.lstrip("-").isdigit():
      if not -len(value) <= int(part) < len(value):
        raise DataError(f"{where}: field {'.'.join([*seen, part])!r}: index {part} is out of "
                        f"range ({here} has {len(value)} items)")
      value = value[int(part)]
    else:
      raise DataError(f"{where}: field {'.'.join([*seen, part])!r}: {here} is a "
                      f"{type(value).__name__}, not an object")
    seen.append(part)
  return value


_TEXT_PARTS = ("text", "input_text", "output_text")  # OpenAI chat and Responses API part types


def content_text(value, field: str, where: str) -> str:
  """A message's content: a string, or an OpenAI content-part list whose text parts are joined."""
  if isinstance(value, str):
    return check_text(value, field, where)
  if not isinstance(value, list):
    raise DataError(f"{where}: field {field!r} must be a string or a list of content parts, got "
                    f"{type(value).__name__}")
  texts = []
  for i, part in enumerate(value):
    name = f"{field}[{i}]"
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
      raise DataError(f"{where}: field {name!r} must be a content part {{\"type\": \"text\", "
                      f"\"text\": ...}}, got {part!r:.60}")
    if part["type"] not in _TEXT_PARTS:
      raise DataError(f"{where}: field {name!r} is a {part['type']!r} part; only text parts "
                      f"({', '.join(_TEXT_PARTS)}) can be trained on")
    texts.append(text_field(part, "text", f"{where}: {name}", allow_empty=True))
  return "".join(texts)


# ShareGPT speaker names (LLaMA-Factory's `from` values) -> chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "observation": "tool", "tool": "tool",
                  "function": "assistant", "function_call": "assistant"}


def _message(m, name: str, where: str, roles: Sequence[str] | None) -> Message:
  if not isinstance(m, dict):
    raise DataError(f"{where}: field {name!r} must be a {{role, content}} object, got "
                    f"{type(m).__name__}")
  at = f"{where}: {name}"
  if "from" in m and "role" not in m:  # ShareGPT
    speaker = _text(m, "from", at)
    if speaker not in SHAREGPT_ROLES:
      raise DataError(f"{where}: field '{name}.from' is {speaker!r}; expected one of "
                      f"{sorted(SHAREGPT_ROLES)}")
    role, content = SHAREGPT_ROLES[speaker], content_text(get_field(m, "value", at),
                                                          f"{name}.value", where)
  else:
    role = _text(m, "role", at)
    content = content_text(get_field(m, "content", at), f"{name}.content", where)
  if roles is not None and role not in roles:
    raise DataError(f"{where}: field '{name}.role' is {role!r}; expected one of {list(roles)}")
  return Message(role, content)


def _messages(value, field: str, where: str, roles: Sequence[str] | None = None
              ) -> tuple[Message, ...]:
  if not isinstance(value, list):
    raise DataError(f"{where}: field {field!r} must be a list of messages, got "
                    f"{type(value).__name__}")
  return tuple(_message(m, f"{field}[{i}]", where, roles) for i, m in enumerate(value))


def _prompt(value, field: str, where: str) -> tuple[Message, ...]:
  prompt = _messages(value, field, where, _PROMPT_ROLES)
  if not prompt:
    raise DataError(f"{where}: field {field!r} has no messages")
  if prompt[-1].role == "assistant":
    raise DataError(f"{where}: field {field!r} ends with an assistant turn; the prompt must end "
                    f"where the assistant's answer (chosen / rejected) begins")
  return prompt


def _response(value, field: str, where: str) -> tuple[Message, ...]:
  """A completion: a message list, one message object, or a string (one assistant turn)."""
  if isinstance(value, str):
    return (Message("assistant", check_text(value, field, where)),)
  if isinstance(value, dict):
    return (_message(value, field, where, ("assistant",)),)
  return _messages(value, field, where, ("assistant",))


_PROMPT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _parse_standard(obj, where, spec, stats) -> Record:
  return PreferenceRecord(_text(obj, "prompt", where), _text(obj, "chosen", where),
                          _text(obj, "rejected", where))


def _parse_conversational(obj, where, spec, stats) -> Record:
  return ChatRecord(_prompt(get_field(obj, "prompt", where), "prompt", where),
                    _messages(get_field(obj, "chosen", where), "chosen", where, ("assistant",)),
                    _messages(get_field(obj, "rejected", where), "rejected", where, ("assistant",)))


def _parse_sharegpt(obj, where, spec, stats) -> Record:
  prompt = _prompt(get_field(obj, "conversations", where), "conversations", where)
  system = obj.get("system")
  if system is not None and system != "":
    prompt = (Message("system", content_text(system, "system", where)),) + prompt
  return ChatRecord(prompt, _response(get_field(obj, "chosen", where), "chosen", where),
                    _response(get_field(obj, "rejected", where), "rejected", where))


def _parse_openai(obj, where, spec, stats) -> Record:
  inp = get_field(obj, "input", where)
  if not isinstance(inp, dict):
    raise DataError(f"{where}: field 'input' must be an object, got {type(inp).__name__}")
  prompt = _prompt(get_field(inp, "messages", f"{where}: input"), "input.messages", where)
  return ChatRecord(
      prompt,
      _messages(get_field(obj, "preferred_output", where), "preferred_output", where,
                ("assistant",)),
      _messages(get_field(obj, "non_preferred_output", where), "non_preferred_output", where,
                ("assistant",)))


def _parse_columns(obj, where, spec, stats) -> Record:
  """Mapped fields: three strings (text), or a message-list prompt with responses (chat)."""
  prompt = get_path(obj, spec.prompt_field, where) if spec.prompt_field else ""
  chosen, rejected = (get_path(obj, f, where) for f in (spec.chosen_field, spec.rejected_field))
  if isinstance(prompt, list) or not all(isinstance(v, str) for v in (chosen, rejected)):
    if not isinstance(prompt, list):
      raise DataError(f"{where}: field {spec.prompt_field!r} must be a list of messages when "
                      f"the responses are messages, got {type(prompt).__name__}")
    return ChatRecord(_prompt(prompt, spec.prompt_field, where),
                      _response(chosen, spec.chosen_field, where),
                      _response(rejected, spec.rejected_field, where))
  for field, v in ((spec.prompt_field, prompt), (spec.chosen_field, chosen),
                   (spec.rejected_field, rejected)):
    if not isinstance(v, str):
      raise DataError(f"{where}: field {field!r} must be a string, got {type(v).__name__}")
    check_text(v, field, where)
  return PreferenceRecord(prompt, chosen, rejected)


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
    check_text(v, field, where)
  prompt, cc, rc, fallback = split_transcripts(c, r)
  if fallback:
    stats["prompt_from_common_prefix"] += 1
    logging.info("%s: chosen and rejected disagree before the last %r; prompt = their longest "
                 "common prefix (%d chars)", where, HH_ASSISTANT, len(prompt))
  return PreferenceRecord(prompt, cc, rc)


_PARSERS = {"standard": _parse_standard, "conversational": _parse_conversational,
            "implicit": _parse_implicit, "openai": _parse_openai, "sharegpt": _parse_sharegpt,
            "columns": _parse_columns}


def record_format(obj: dict) -> str | None:
  """The format one record's keys say it is in (None: none of them)."""
  if "input" in obj and "preferred_output" in obj:
    return "openai"
  if unpaired_record_format(obj) is not None:
    return "unpaired"  # no pair format: `detect_format` says which stage reads it
  if "chosen" in obj and "rejected" in obj:
    if "conversations" in obj:
      return "sharegpt"
    if "prompt" not in obj:
      return "implicit"
    if isinstance(obj["prompt"], list):
      return "conversational"
    # A string prompt beside whole conversations (HuggingFaceH4/ultrafeedback_binarized): the
    # prompt is the messages both share, as TRL's maybe_extract_prompt takes it.
    conversations = isinstance(obj["chosen"], list) and isinstance(obj["rejected"], list)
    return "implicit" if conversations else "standard"
  return None


def _undetectable(where: str, obj: dict) -> DataError:
  return DataError(f"{where}: cannot detect the data format from fields {sorted(obj)}; pass "
                   f"--data_format, or --prompt_field/--chosen_field/--rejected_field to map "
                   f"other column names")


def _decide(path: str, classify, undetectable, skips: "Skips | None",
            fix: str = "fix the file, pass --data_format, or") -> str:
  """The format every record of `path` says it is in (`classify`), which must agree: a record
  of another format than the most common one is an error naming it, unless skips are counted."""
  counts, first, unknown = collections.Counter(), {}, None
  for where, obj in iter_objects(path):
    fmt = classify(obj)
    if fmt is None:  # parsed as the file's format later, which names its missing field
      unknown = unknown or undetectable(where, obj)
      continue
    counts[fmt] += 1
    first.setdefault(fmt, where)
  if not counts:
    raise unknown or DataError(f"{path}: no records")
  fmt = counts.most_common(1)[0][0]
  others = {f: n for f, n in counts.items() if f != fmt}
  if others and skips is None:
    f, n = max(others.items(), key=lambda kv: kv[1])
    raise DataError(f"{first[f]}: this record reads as {f} ({n} such records) but {counts[fmt]} "
                    f"records of {path} are {fmt}; {fix} "
                    f"--skip_bad_records to skip the records that do not fit")
  return fmt


def detect_format(path: str, spec: FormatSpec = FormatSpec(), skips: "Skips | None" = None
                  ) -> str:
  """The file's format (explicit flags win): every record's own format, all of which must agree.

  A record of another format than the others (say, one record without a prompt in a file of
  prompt/chosen/rejected records) is an error naming it and the majority, or a counted skip.
  """
  if spec.data_format != "auto":
    return spec.data_format
  if spec.chosen_field or spec.rejected_field:
    return "columns"
  fmt = _decide(path, record_format, _undetectable, skips)
  if fmt == "unpaired":
    raise DataError(f"{path}: holds unpaired records {{prompt, completion, label}}, which only "
                    f"the kto stage reads (--stage=sft,kto); this stage needs preference pairs "
                    f"(chosen and rejected)")
  return fmt


class Skips:
  """Records skipped with --skip_bad_records: counted, the first few logged with their error."""

  def __init__(self, what: str, show: int = 5):
    self.what, self.show, self.count, self.examples = what, show, 0, []

  def add(self, error: DataError) -> None:
    self.count += 1
    if len(self.examples) < self.show:
      self.examples.append(str(error))
      logging.warning("%s: skipped a bad record (--skip_bad_records): %s", self.what, error)

  def log(self) -> None:
    if self.count:
      logging.warning("%s: skipped %d records that do not fit (--skip_bad_records)", self.what,
                      self.count)


def _iter_parsed(path: str, fmt: str, parse, classify, skips: "Skips | None", stats
                 ) -> Iterator[tuple[str, object]]:
  """(location, record) of each object `parse` reads; a record `classify` puts in another
  format than the file's `fmt` (None: do not check) is an error, or a counted skip."""
  for where, obj in iter_objects(path):
    try:
      own = classify(obj) if classify is not None else None
      if own is not None and own != fmt:
        raise DataError(f"{where}: this record reads as {own}, not as the file's {fmt}")
      record = parse(obj, where)
    except DataError as e:
      if skips is None:
        raise
      skips.add(e)
      continue
    stats[f"format_{fmt}"] += 1
    yield where, record


def margins(path: str | DataValue) -> dict[str, float]:
  """{location: margin} of the records with a `margin` field (TRL's reward-model column: the
  pair's required reward gap, read by the rm stage) in every source `path` names (a data flag's
  parsed value, or a plain one); a value that is not a finite number is a DataError naming the
  record and the field."""
  out = {}
  for where, obj in (x for s in data_value(path).sources for x in iter_objects(s.path)):
    value = obj.get("margin") if isinstance(obj, dict) else None
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      raise DataError(f"{where}: field 'margin' is {value!r}; it must be a finite number")
    out[where] = float(value)
  return out


def iter_records(path: str, spec: FormatSpec = FormatSpec(),
                 stats: collections.Counter | None = None, skips: Skips | None = None
                 ) -> Iterator[tuple[str, Record]]:
  """Lazily yields (location, record) in the format `detect_format` decides over the file.

  `stats` (if given) counts records per format and implicit-prompt fallbacks. With `skips`, a
  record that does not fit the format is counted there and left out instead of raising.
  """
  stats = collections.Counter() if stats is None else stats
  fmt = detect_format(path, spec, skips)
  logging.info("%s: data format %s", path, fmt)
  parse = _PARSERS[fmt]
  check = record_format if spec.data_format == "auto" and fmt != "columns" else None
  yield from _iter_parsed(path, fmt, lambda obj, where: parse(obj, where, spec, stats), check,
                          skips, stats)


# --- SFT data ---------------------------------------------------------------------------------

def _nonempty(turns: tuple[Message, ...], field: str, where: str) -> tuple[Message, ...]:
  if not any(m.content.strip() for m in turns):
    raise DataError(f"{where}: field {field!r} is empty; an SFT example needs the assistant's "
                    f"answer")
  return turns


def _conversation(value, field: str, where: str, system=None) -> ChatSFTRecord:
  """A whole conversation: its trailing assistant turns are the completion, the rest the
  prompt (a leading `system` string first)."""
  msgs = _messages(value, field, where, _PROMPT_ROLES)
  if not msgs:
    raise DataError(f"{where}: field {field!r} has no messages")
  if msgs[-1].role != "assistant":
    raise DataError(f"{where}: field '{field}[{len(msgs) - 1}]' is a {msgs[-1].role!r} turn; an "
                    f"SFT conversation must end with the assistant's answer (the completion)")
  k = len(msgs)
  while k and msgs[k - 1].role == "assistant":
    k -= 1
  if not k:
    raise DataError(f"{where}: field {field!r} holds only assistant turns; the prompt before "
                    f"the answer is missing")
  if system is not None and system != "":
    msgs = (Message("system", content_text(system, "system", where)),) + msgs
    k += 1
  return ChatSFTRecord(msgs[:k], _nonempty(msgs[k:], field, where))


def _sft_standard(obj, where) -> SFTExample:
  return SFTRecord(text_field(obj, "prompt", where, allow_empty=True),
                   text_field(obj, "completion", where))


def _sft_conversational(obj, where) -> SFTExample:
  return ChatSFTRecord(_prompt(get_field(obj, "prompt", where), "prompt", where),
                       _nonempty(_response(get_field(obj, "completion", where), "completion",
                                           where), "completion", where))


def _sft_messages(obj, where) -> SFTExample:
  return _conversation(get_field(obj, "messages", where), "messages", where)


def _sft_sharegpt(obj, where) -> SFTExample:
  return _conversation(get_field(obj, "conversations", where), "conversations", where,
                       obj.get("system"))


_SFT_PARSERS = {"standard": _sft_standard, "conversational": _sft_conversational,
                "messages": _sft_messages, "sharegpt": _sft_sharegpt}
SFT_FORMATS = tuple(_SFT_PARSERS)


def sft_record_format(obj: dict) -> str | None:
  """The SFT layout one record's keys say it is in (None: none of them)."""
  if "messages" in obj:
    return "messages"
  if "conversations" in obj:
    return "sharegpt"
  if "prompt" in obj and "completion" in obj:
    return "conversational" if isinstance(obj["prompt"], list) else "standard"
  return None


def _sft_undetectable(where: str, obj: dict) -> DataError:
  return DataError(f"{where}: cannot read fields {sorted(obj)} as SFT data; expected "
                   f"{{prompt, completion}} (strings or messages), {{messages}} ending with an "
                   f"assistant turn, or ShareGPT {{conversations}}")


class Layouts(NamedTuple):
  """A kind of record that is not a pair, and its layouts: what the log calls it, what one
  record's keys say (`classify`), the error for a record they say nothing of, the parsers."""
  what: str
  classify: object
  undetectable: object
  parsers: dict


def _iter_layout(path: str, kind: Layouts, stats: collections.Counter | None,
                 skips: "Skips | None") -> Iterator[tuple[str, object]]:
  """Lazily yields (location, record) of `path` in the layout of `kind` decided over all its
  records (a record of another layout is an error naming it, or a counted skip)."""
  stats = collections.Counter() if stats is None else stats
  fmt = _decide(path, kind.classify, kind.undetectable, skips, fix="fix the file or pass")
  logging.info("%s: %s format %s", path, kind.what, fmt)
  yield from _iter_parsed(path, fmt, kind.parsers[fmt], kind.classify, skips, stats)


def iter_sft_records(path: str, stats: collections.Counter | None = None,
                     skips: Skips | None = None) -> Iterator[tuple[str, SFTExample]]:
  """Lazily yields (location, SFT record) of `path`, its layout decided over all records (a
  record of another layout is an error naming it, or a counted skip)."""
  return _iter_layout(path, Layouts("SFT data", sft_record_format, _sft_undetectable,
                                    _SFT_PARSERS), stats, skips)


# --- unpaired feedback (KTO) ------------------------------------------------------------------

def _label(obj: dict, where: str) -> bool:
  value = get_field(obj, "label", where)
  if not isinstance(value, bool):
    raise DataError(f"{where}: field 'label' must be true (desirable) or false (undesirable), "
                    f"got {type(value).__name__} {value!r:.40}")
  return value


def _unpaired_standard(obj, where) -> UnpairedRecord:
  return UnpairedRecord(_text(obj, "prompt", where), _text(obj, "completion", where),
                        _label(obj, where))


def _unpaired_conversational(obj, where) -> UnpairedRecord:
  return UnpairedRecord(_prompt(get_field(obj, "prompt", where), "prompt", where),
                        _response(get_field(obj, "completion", where), "completion", where),
                        _label(obj, where))


_UNPAIRED_PARSERS = {"standard": _unpaired_standard, "conversational": _unpaired_conversational}


def unpaired_record_format(obj: dict) -> str | None:
  """The unpaired layout one record's keys say it is in (None: none of them): an SFT
  prompt-completion layout with a `label`."""
  fmt = sft_record_format(obj) if "label" in obj else None
  return fmt if fmt in _UNPAIRED_PARSERS else None


def _unpaired_undetectable(where: str, obj: dict) -> DataError:
  return DataError(f"{where}: cannot read fields {sorted(obj)} as unpaired feedback; expected "
                   f"{{prompt, completion, label}} (prompt and completion strings or messages, "
                   f"label true or false)")


def iter_unpaired_records(path: str, stats: collections.Counter | None = None,
                          skips: Skips | None = None) -> Iterator[tuple[str, UnpairedRecord]]:
  """Lazily yields (location, unpaired record) of `path`, as `iter_sft_records` yields SFT
  records."""
  return _iter_layout(path, Layouts("unpaired data", unpaired_record_format,
                                    _unpaired_undetectable, _UNPAIRED_PARSERS), stats, skips)


def _first_kinds(value: DataValue, classify) -> dict[str, bool]:
  """{source path: whether its first record is of the kind `classify` names} of a data flag."""
  kinds = {}
  for source in value.sources:
    first = next(iter_objects(source.path), None)
    if first is not None:
      kinds[source.path] = classify(first[1]) is not None
  return kinds


def is_unpaired(value: str | DataValue) -> bool:
  """Whether a data flag's sources (its parsed value, or a plain one) hold unpaired records, by
  each source's first record (every record is checked when it is parsed); sources of both
  kinds are a DataError naming one of each."""
  value = data_value(value)
  kinds = _first_kinds(value, unpaired_record_format)
  if len(set(kinds.values())) > 1:
    paired = next(p for p, k in kinds.items() if not k)
    unpaired = next(p for p, k in kinds.items() if k)
    raise DataError(f"{value.value}: mixes unpaired records ({unpaired}) with preference pairs "
                    f"({paired}); give one kind (the kto stage converts pairs itself)")
  return any(kinds.values())


def unpair(records: Sequence[Record]) -> list[UnpairedRecord]:
  """Preference pairs as unpaired examples, as TRL's `unpair_preference_dataset` makes them
  (`data.unpair_order`): each pair's chosen completion (desirable) and rejected one
  (undesirable), with its prompt."""
  index, side = unpair_order(len(records))
  return [UnpairedRecord(records[i].prompt, records[i].rejected if s else records[i].chosen,
                         not s) for i, s in zip(index, side)]


# --- prompts with answers (the sampling stages: GRPO, RLOO, PPO, online DPO) -------------------

class PromptRecord(NamedTuple):
  """A prompt to sample from (a string, or a tuple of Messages), its worked solution for an SFT
  stage (None: the layout has none), and the record's other columns, which reward functions
  read by name (TRL passes a data set's extra columns so), e.g. `solution`."""
  prompt: str | tuple[Message, ...]
  completion: str | tuple[Message, ...] | None
  columns: dict

  def example(self) -> SFTExample:
    kind = SFTRecord if isinstance(self.prompt, str) else ChatSFTRecord
    return kind(self.prompt, self.completion)


GSM8K_MARK = "####"  # GSM8K's answer ends "#### N", N the final answer
_PAIR_KEYS = ("chosen", "rejected", "completion", "label", "messages", "conversations")


def gsm8k_answer(answer: str) -> str | None:
  """The final answer of a GSM8K `answer` (after its last "####", thousands commas dropped), or
  None where it has none."""
  if GSM8K_MARK not in answer:
    return None
  final = answer.rsplit(GSM8K_MARK, 1)[1].strip().replace(",", "")
  return final or None


def boxed_answer(solution: str) -> str | None:
  """The content of the last \\boxed{...} (or \\fbox{...}) of a MATH solution, braces
  balanced, or None where it has none."""
  start = max(solution.rfind("\\boxed{"), solution.rfind("\\fbox{"))
  if start < 0:
    return None
  i = solution.index("{", start) + 1
  depth, j = 1, i
  while j < len(solution) and depth:
    depth += {"{": 1, "}": -1}.get(solution[j], 0)
    j += 1
  return solution[i:j - 1].strip() or None if depth == 0 else None


def _others(obj: dict, *used: str) -> dict:
  return {k: v for k, v in obj.items() if k not in used}


def _prompt_only_standard(obj, where) -> PromptRecord:
  return PromptRecord(text_field(obj, "prompt", where), None, _others(obj, "prompt"))


def _prompt_only_conversational(obj, where) -> PromptRecord:
  return PromptRecord(_prompt(get_field(obj, "prompt", where), "prompt", where), None,
                      _others(obj, "prompt"))


def _gsm8k(obj, where) -> PromptRecord:
  question, answer = text_field(obj, "question", where), text_field(obj, "answer", where)
  final = gsm8k_answer(answer)
  if final is None:
    raise DataError(f"{where}: field 'answer' has no final answer after {GSM8K_MARK!r} "
                    f"(GSM8K's layout: the worked solution, then '#### N')")
  return PromptRecord((Message("user", question),), (Message("assistant", answer),),
                      {**_others(obj, "question"), "solution": final})


def _math(obj, where) -> PromptRecord:
  problem, solution = text_field(obj, "problem", where), text_field(obj, "solution", where)
  if boxed_answer(solution) is None:
    raise DataError(f"{where}: field 'solution' has no \\boxed{{...}} answer (MATH's layout: "
                    f"the worked solution, its answer boxed)")
  return PromptRecord((Message("user", problem),), (Message("assistant", solution),),
                      {**_others(obj, "problem"), "solution": solution})


_PROMPT_PARSERS = {"standard": _prompt_only_standard, "conversational": _prompt_only_conversational,
                   "gsm8k": _gsm8k, "math": _math}


def prompt_record_format(obj: dict) -> str | None:
  """The prompt layout one record's keys say it is in (None: none): GSM8K ({question, answer}),
  MATH ({problem, solution}), or TRL's prompt-only ({prompt} with no response field; a string
  prompt is standard, a message list conversational), whatever other columns it has."""
  if "question" in obj and "answer" in obj:
    return "gsm8k"
  if "problem" in obj and "solution" in obj:
    return "math"
  if "prompt" in obj and not any(k in obj for k in _PAIR_KEYS):
    return "standard" if isinstance(obj["prompt"], str) else "conversational"
  return None


def _prompts_undetectable(where: str, obj: dict) -> DataError:
  return DataError(f"{where}: cannot read fields {sorted(obj)} as prompts; expected {{prompt}} "
                   f"(a string or messages, with any other columns), GSM8K's {{question, "
                   f"answer}} or MATH's {{problem, solution}}")


def iter_prompt_records(path: str, stats: collections.Counter | None = None,
                        skips: Skips | None = None) -> Iterator[tuple[str, PromptRecord]]:
  """Lazily yields (location, prompt record) of `path`, as `iter_sft_records` yields SFT
  records."""
  return _iter_layout(path, Layouts("prompt data", prompt_record_format, _prompts_undetectable,
                                    _PROMPT_PARSERS), stats, skips)


def is_prompts(value: str | DataValue) -> bool:
  """Whether a data flag's sources hold prompts without responses (`prompt_record_format`), by
  each source's first record, as `is_unpaired` decides; sources of both kinds are a DataError."""
  value = data_value(value)
  kinds = _first_kinds(value, prompt_record_format)
  if len(set(kinds.values())) > 1:
    mine = next(p for p, k in kinds.items() if k)
    other = next(p for p, k in kinds.items() if not k)
    raise DataError(f"{value.value}: mixes prompts without responses ({mine}) with other "
                    f"records ({other}); give one kind")
  return any(kinds.values())


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
  equal_after_template: int = 0   # chosen != rejected, but their rendered texts are equal
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
    if self.equal_after_template:
      logging.warning("%s: dropped %d pairs whose chosen and rejected differ but render to the "
                      "same text (the chat template trims them?)", what, self.equal_after_template)
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


def filter_rendered(rendered: Sequence[tuple[str, PreferenceRecord]], report: FilterReport
                    ) -> tuple[list[tuple[str, PreferenceRecord]], FilterReport]:
  """Drops (and counts) pairs the template made equal, e.g. answers that differ only by the
  trailing spaces Gemma's and Llama's templates trim."""
  kept, examples = [], []
  for where, rec in rendered:
    if rec.chosen == rec.rejected:
      report.equal_after_template += 1
      if len(examples) < 5:
        examples.append(where)
      continue
    kept.append((where, rec))
  if examples:
    report.examples = {**report.examples, "equal_after_template": examples}
  report.kept = len(kept)
  return kept, report

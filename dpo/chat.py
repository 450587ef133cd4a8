"""Chat templates: conversation messages -> the exact prompt and completion text a model expects.

The model's own template comes first: a Hugging Face tokenizer folder's `chat_template`
(`chat_template.jinja` or `tokenizer_config.json`) is rendered by `JinjaTemplate` with the
semantics of transformers' `apply_chat_template` (a sandboxed Jinja2 environment with
`trim_blocks` / `lstrip_blocks`, `raise_exception`, `strftime_now`, `tojson`, `namespace`,
`add_generation_prompt`, the special tokens as variables; tests/test_chat.py compares text and
ids with transformers itself). The prompt is the rendering with the generation prompt; each
completion is the rendering of prompt + its assistant turns minus the prompt, which must be an
exact prefix of it (an error names the record where it is not). `resolve_template` picks it.
SFT conversations (`render_sft`) are rendered the same way: the prompt with the generation
prompt, the completion the full rendering minus the prompt.

For tokenizers without a template (the byte tokenizer, GPT-2) these hand-written families are
named choices (`--chat_template=NAME`), one small function set each, written from the family's
published prompt format, so a reader can check every character:

    llama3   Meta Llama 3 instruct: <|start_header_id|>ROLE<|end_header_id|>\\n\\nTEXT<|eot_id|>
    chatml   ChatML as used by Qwen: <|im_start|>ROLE\\nTEXT<|im_end|>\\n
    gemma    Gemma instruct: <start_of_turn>user|model\\nTEXT<end_of_turn>\\n; Gemma has no system
             role, so a system message is prepended to the first user turn (separated by a
             blank line), as Gemma's documentation advises
    plain    base models: Anthropic HH-RLHF style "\\n\\nHuman: TEXT\\n\\nAssistant: TEXT", with a
             system message as leading plain text; a ChatRecord rendered with it equals the
             same conversation given as an HH-RLHF transcript

Rendered strings leave out the BOS token (`bos_text` names it): the tokenizer adds BOS as an id
to every sequence, so the BOS text in a template would be encoded twice. A completion ends with
the family's end-of-turn marker and no trailing separator; the tokenizer appends EOS only when
the completion does not already end with it (see `dpo.data.encode_completion`). A Jinja
template's BOS text is removed from the prompt the same way, and `JinjaTemplate.emits_bos` says
whether the tokenizer should add the BOS id; its completions get no extra EOS (the template's
end-of-turn text is what the model learns to stop on; `end_of_turn_ids` names those ids).

A conversation whose rendered prompt is over --max_prompt_length loses whole earlier turns
(`fit_prompt`): the leading system messages stay, the kept conversation starts at a later user
message, and the template renders it again, framing and generation prompt included, so the
prompt is what the template makes of the kept turns (tests/test_chat.py compares the ids with
transformers' apply_chat_template of them). Only when the system message and the last user
turn alone are over the budget is the start of that turn's text cut; `PromptCuts` counts and
logs each kind, and the preview names each record's.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from typing import Callable, NamedTuple, Sequence, Union

from dpo.data import DataError, PreferenceRecord, SFTRecord
from dpo.formats import ChatRecord, Message, Record, SFTExample

_SYSTEM_ROLES = ("system", "developer")


class ChatTemplate(NamedTuple):
  name: str
  bos_text: str                       # the BOS token's text (added by the tokenizer, not here)
  turn: Callable[[Message], str]      # one whole prompt turn, separator included
  generation_prompt: str              # opens the assistant turn the completion fills
  completion: Callable[[str], str]    # the assistant's text plus its end-of-turn marker
  next_turn: str                      # between two assistant messages of one completion
  fold_system: bool = False           # merge system messages into the first user turn
  jinja: str = ""                     # the same template in Jinja, for exported tokenizers


def _llama3_turn(m: Message) -> str:
  return f"<|start_header_id|>{m.role}<|end_header_id|>\n\n{m.content}<|eot_id|>"


def _chatml_turn(m: Message) -> str:
  return f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n"


def _gemma_turn(m: Message) -> str:
  role = "model" if m.role == "assistant" else m.role
  return f"<start_of_turn>{role}\n{m.content}<end_of_turn>\n"


def _plain_turn(m: Message) -> str:
  if m.role == "system":
    return m.content
  return f"\n\n{'Assistant' if m.role == 'assistant' else 'Human'}: {m.content}"


# The Jinja forms render what the functions render (tests/test_chat.py checks them through
# transformers' apply_chat_template), BOS included; a final assistant turn has no separator after
# its end-of-turn marker, as `completion` writes it. Newlines are '\n' expressions, since
# trim_blocks eats a newline that follows a block tag.
_SYSTEM = "m.role in ['system', 'developer']"
_LLAMA3_JINJA = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>"
    "{{ 'system' if " + _SYSTEM + " else m.role }}<|end_header_id|>{{ '\\n\\n' }}"
    "{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}")
_CHATML_JINJA = (
    "{% for m in messages %}<|im_start|>{{ 'system' if " + _SYSTEM + " else m.role }}"
    "{{ '\\n' }}{{ m.content }}<|im_end|>{% if not (loop.last and m.role == 'assistant') %}"
    "{{ '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant"
    "{{ '\\n' }}{% endif %}")
_GEMMA_JINJA = (
    "{{ bos_token }}{% set ns = namespace(system=[], started=false) %}{% for m in messages %}"
    "{% if " + _SYSTEM + " %}{% if ns.started %}{{ raise_exception('gemma: no system role, "
    "and a system message comes after the conversation started') }}{% endif %}"
    "{% set ns.system = ns.system + [m.content] %}{% else %}{% set content = m.content %}"
    "{% if not ns.started and ns.system %}{% if m.role != 'user' %}{{ raise_exception('gemma: "
    "a system message needs a following user turn to merge into') }}{% endif %}"
    "{% set content = ns.system | join('\\n\\n') ~ '\\n\\n' ~ m.content %}{% endif %}"
    "{% set ns.started = true %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}"
    "{{ '\\n' }}{{ content }}<end_of_turn>{% if not (loop.last and m.role == 'assistant') %}"
    "{{ '\\n' }}{% endif %}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<start_of_turn>model{{ '\\n' }}{% endif %}")
_PLAIN_JINJA = (
    "{% for m in messages %}{% if " + _SYSTEM + " %}{{ m.content }}{% elif m.role == 'assistant' "
    "%}{{ '\\n\\nAssistant: ' ~ m.content }}{% else %}{{ '\\n\\nHuman: ' ~ m.content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '\\n\\nAssistant:' }}{% endif %}")

TEMPLATES: dict[str, ChatTemplate] = {
    "llama3": ChatTemplate(
        "llama3", "<|begin_of_text|>", _llama3_turn,
        "<|start_header_id|>assistant<|end_header_id|>\n\n", lambda t: f"{t}<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n", jinja=_LLAMA3_JINJA),
    "chatml": ChatTemplate(
        "chatml", "", _chatml_turn, "<|im_start|>assistant\n", lambda t: f"{t}<|im_end|>",
        "\n<|im_start|>assistant\n", jinja=_CHATML_JINJA),
    "gemma": ChatTemplate(
        "gemma", "<bos>", _gemma_turn, "<start_of_turn>model\n", lambda t: f"{t}<end_of_turn>",
        "\n<start_of_turn>model\n", fold_system=True, jinja=_GEMMA_JINJA),
    "plain": ChatTemplate(
        "plain", "", _plain_turn, "\n\nAssistant:", lambda t: f" {t}", "\n\nAssistant:",
        jinja=_PLAIN_JINJA),
}
TEMPLATES["qwen"] = TEMPLATES["chatml"]


def get_template(name: str) -> ChatTemplate:
  if name not in TEMPLATES:
    raise ValueError(f"unknown chat_template {name!r}; choose from {sorted(TEMPLATES)}")
  return TEMPLATES[name]


def _normalise(t: ChatTemplate, messages: Sequence[Message]) -> list[Message]:
  msgs = [Message("system", m.content) if m.role in _SYSTEM_ROLES else m for m in messages]
  if not t.fold_system:
    return msgs
  lead = next((i for i, m in enumerate(msgs) if m.role != "system"), len(msgs))
  late = [i for i, m in enumerate(msgs) if m.role == "system" and i > lead]
  if late:
    raise ValueError(f"{t.name}: no system role, and the system message at position {late[0]} "
                     f"comes after the conversation started (only leading ones are merged into "
                     f"the first user turn)")
  system = [m.content for m in msgs if m.role == "system"]
  rest = [m for m in msgs if m.role != "system"]
  if system:
    if not rest or rest[0].role != "user":
      raise ValueError(f"{t.name}: a system message needs a following user turn to merge into")
    rest[0] = Message("user", "\n\n".join(system) + "\n\n" + rest[0].content)
  return rest


def render_prompt(t: ChatTemplate, messages: Sequence[Message]) -> str:
  """The prompt turns followed by the opening of the assistant's turn (no BOS)."""
  return "".join(t.turn(m) for m in _normalise(t, messages)) + t.generation_prompt


def render_completion(t: ChatTemplate, messages: Sequence[Message]) -> str:
  """Assistant messages as they follow `render_prompt`; ends at the last end-of-turn marker."""
  return t.next_turn.join(t.completion(m.content) for m in messages)


# --- the tokenizer's own template (Jinja2) ----------------------------------------------------

def _environment():
  """The Jinja2 environment of transformers' `_compile_jinja_template` (chat_template_utils.py):
  templates from the Hub are untrusted code, so it is sandboxed and immutable."""
  try:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
  except ImportError as e:
    raise ImportError("a tokenizer's chat template needs Jinja2: pip install 'dpo-jax[hf]' "
                      "(or pip install jinja2)") from e

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text; it renders its body."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class Namespace(jinja2.utils.Namespace):
    """`namespace(...)` without underscore attributes (no reach into CPython internals)."""

    def __init__(*args, **kwargs):
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        Namespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, namespace=Namespace, dict=dict,
                     strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  return env, jinja2.exceptions.TemplateError


class JinjaTemplate:
  """A Hugging Face chat template, rendered as `tokenizer.apply_chat_template(messages,
  add_generation_prompt=..., tokenize=False)` renders it.

  `special` holds the template variables transformers passes from the tokenizer's special
  tokens (bos_token, eos_token, ...). `emits_bos` is learnt from the first rendering (does it
  open with the BOS text?) and every later rendering must agree.
  """

  def __init__(self, source: str, special: dict[str, str], name: str):
    env, self._error = _environment()
    try:
      self._compiled = env.from_string(source)
    except self._error as e:
      raise ValueError(f"chat template {name}: not a valid Jinja template ({e})") from None
    self.source, self.special, self.name = source, dict(special), name
    self.bos_text = special.get("bos_token") or ""
    self.emits_bos: bool | None = None

  def fingerprint(self) -> str:
    """Keys the tokenised-data cache: the source, the variables and, for a template that reads
    the clock (a date in the system header), today's date."""
    h = hashlib.sha256(self.source.encode())
    h.update(repr(sorted(self.special.items())).encode())
    if "strftime_now" in self.source:
      h.update(datetime.date.today().isoformat().encode())
    return "jinja-" + h.hexdigest()[:16]

  def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """The template's text for `messages` (raises ValueError with the template's own message,
    e.g. Gemma's "System role not supported")."""
    chat = [{"role": m.role, "content": m.content} for m in messages]
    try:
      return self._compiled.render(messages=chat, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self.special)
    except self._error as e:
      raise ValueError(f"chat template {self.name} refused the conversation: {e}") from None

  def strip_bos(self, prompt: str) -> str:
    emits = bool(self.bos_text) and prompt.startswith(self.bos_text)
    if self.emits_bos is None:
      self.emits_bos = emits
    elif emits != self.emits_bos:
      raise ValueError(f"chat template {self.name} opens some prompts with the BOS text "
                       f"{self.bos_text!r} and others without")
    return prompt[len(self.bos_text):] if emits else prompt

  def render_turns(self, prompt: Sequence[Message], completions: dict[str, Sequence[Message]]
                   ) -> tuple[str, list[str]]:
    """(prompt text without BOS, each completion's text): the prompt rendered with the
    generation prompt, each completion the rendering of prompt + its turns minus the prompt,
    which must extend it exactly (ValueError naming the side where it does not)."""
    text = self.render(prompt, True)
    out = []
    for side, turns in completions.items():
      full = self.render(tuple(prompt) + tuple(turns), False)
      if not full.startswith(text):
        k = next((i for i, (a, b) in enumerate(zip(text, full)) if a != b), len(full))
        raise ValueError(
            f"chat template {self.name}: the rendering of prompt + {side} does not extend the "
            f"rendered prompt (with the generation prompt); they differ from character {k}: "
            f"prompt has {text[k:k + 40]!r}, prompt + {side} has {full[k:k + 40]!r}")
      out.append(full[len(text):])
    return self.strip_bos(text), out

  def render_pair(self, record: "ChatRecord") -> PreferenceRecord:
    prompt, sides = self.render_turns(record.prompt, {"chosen": record.chosen,
                                                      "rejected": record.rejected})
    return PreferenceRecord(prompt, *sides)


def read_chat_template(directory: str) -> str | None:
  """The chat template of a tokenizer folder: `chat_template.jinja` (transformers >= 4.47 saves
  it there), else `tokenizer_config.json`'s `chat_template` (a string, or a list of named
  templates of which "default" is the one apply_chat_template uses)."""
  jinja_path = os.path.join(directory, "chat_template.jinja")
  if os.path.exists(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      return f.read()
  config_path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.exists(config_path):
    return None
  with open(config_path, encoding="utf-8") as f:
    value = json.load(f).get("chat_template")
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if "default" not in named:
      raise ValueError(f"{config_path}: chat_template lists {sorted(named)} but no 'default'")
    value = named["default"]
  if value is not None and not isinstance(value, str):
    raise ValueError(f"{config_path}: chat_template must be a string, got "
                     f"{type(value).__name__}")
  return value


Template = Union[ChatTemplate, JinjaTemplate]


def resolve_template(name, tok) -> Template:
  """--chat_template: "auto" (the tokenizer's own template if it has one, else plain),
  "tokenizer" (its own, required), a hand-written family, or a path to a .jinja file. A
  template object passes through."""
  if isinstance(name, (ChatTemplate, JinjaTemplate)):
    return name
  own = getattr(tok, "chat_template", None)
  if name in ("auto", "tokenizer"):
    if own:
      return JinjaTemplate(own, tok.special_tokens(), f"{tok.name} (the tokenizer's own)")
    if name == "tokenizer":
      raise ValueError(f"--chat_template=tokenizer: {tok.name} has no chat_template "
                       f"(tokenizer_config.json or chat_template.jinja)")
    return TEMPLATES["plain"]
  if name in TEMPLATES:
    if own:
      logging.warning("--chat_template=%s replaces %s's own chat template", name, tok.name)
    return TEMPLATES[name]
  if os.path.isfile(name):
    with open(name, encoding="utf-8") as f:
      special = tok.special_tokens() if hasattr(tok, "special_tokens") else {}
      return JinjaTemplate(f.read(), special, name)
  raise ValueError(f"unknown --chat_template {name!r}; choose auto, tokenizer, a .jinja file "
                   f"or one of {sorted(TEMPLATES)}")


def template_fingerprint(t: Template) -> str:
  return t.fingerprint() if isinstance(t, JinjaTemplate) else t.name


def end_of_turn_ids(t: Template, tok) -> list[int]:
  """EOS, then the special tokens that close an assistant turn of `t` (Gemma's <end_of_turn>,
  Qwen's <|im_end|>, ...): what `generate` must stop on."""
  probe = ChatRecord((Message("user", "Hi"),), (Message("assistant", "Yes"),),
                     (Message("assistant", "No"),))
  if isinstance(t, JinjaTemplate):  # a fresh copy: the probe must not decide emits_bos
    t = JinjaTemplate(t.source, t.special, t.name)
  try:
    completion = render_record(probe, t).chosen
  except ValueError:  # a template with stricter rules than the probe meets: EOS alone
    return [tok.eos_id]
  specials = tok.special_ids()
  return list(dict.fromkeys([tok.eos_id, *(i for i in tok.encode(completion) if i in specials)]))


def _refusal(where: str, e: ValueError) -> DataError:
  return e if isinstance(e, DataError) else DataError(f"{where}: {e}" if where else str(e))


def render_record(record: Record, t: Template, where: str = "") -> PreferenceRecord:
  """A ChatRecord as prompt/completion text; text records pass through unchanged. A template
  that refuses the conversation raises DataError naming `where`."""
  if isinstance(record, PreferenceRecord):
    return record
  try:
    if isinstance(t, JinjaTemplate):
      return t.render_pair(record)
    return PreferenceRecord(render_prompt(t, record.prompt), render_completion(t, record.chosen),
                            render_completion(t, record.rejected))
  except ValueError as e:
    raise _refusal(where, e) from None


def render_sft(record: SFTExample, t: Template, where: str = "") -> SFTRecord:
  """An SFT conversation as prompt/completion text, rendered exactly as `render_record` renders
  a preference pair's prompt and chosen side; text records pass through unchanged."""
  if isinstance(record, SFTRecord):
    return record
  try:
    if isinstance(t, JinjaTemplate):
      prompt, (completion,) = t.render_turns(record.prompt, {"completion": record.completion})
      return SFTRecord(prompt, completion)
    return SFTRecord(render_prompt(t, record.prompt), render_completion(t, record.completion))
  except ValueError as e:
    raise _refusal(where, e) from None


# --- fitting a conversation's prompt to --max_prompt_length ---------------------------------

LOST_TURNS, CUT_IN_TURN, CUT_TOKENS = "lost earlier turns", "cut inside a turn", "cut at tokens"


def _prompt_renderer(t: Template) -> Callable[[Sequence[Message]], str]:
  """The prompt text (no BOS) of a conversation's messages, as `render_record` writes it."""
  if isinstance(t, JinjaTemplate):
    return lambda messages: t.strip_bos(t.render(messages, True))
  return lambda messages: render_prompt(t, messages)


def _first_fit(n: int, fits: Callable[[int], bool]) -> int:
  """The smallest i in [0, n) with fits(i), for a `fits` false then true; n when none is."""
  lo, hi = 0, n
  while lo < hi:
    mid = (lo + hi) // 2
    if fits(mid):
      hi = mid
    else:
      lo = mid + 1
  return lo


def fit_prompt(prompt: Sequence[Message], t: Template, fits: Callable[[str], bool]
               ) -> tuple[tuple[Message, ...], str]:
  """(the prompt messages to render, how they were cut: "" when whole) for a prompt whose
  rendering `fits` the budget once cut.

  Whole earliest turns go first: the kept conversation starts at a later user message (the
  fewest turns dropped that fit), after the leading system messages, which stay, and the
  template renders it again with its framing and the generation prompt. When the system
  messages and the last user turn (with what follows it) alone are over the budget, the start
  of that turn's text is dropped too, the fewest characters that fit. When even its whole text
  would go, nothing is cut here (CUT_TOKENS: `data.encode_prompt` keeps the rendering's end)."""
  render = _prompt_renderer(t)
  prompt = tuple(prompt)
  if fits(render(prompt)):
    return prompt, ""
  lead = next((i for i, m in enumerate(prompt) if m.role not in _SYSTEM_ROLES), len(prompt))
  system, rest = prompt[:lead], prompt[lead:]
  starts = [i for i, m in enumerate(rest) if m.role == "user" and i > 0]
  k = _first_fit(len(starts), lambda j: fits(render(system + rest[starts[j]:])))
  if k < len(starts):
    return system + rest[starts[k]:], f"{LOST_TURNS}: {starts[k]} of {len(rest)}"
  dropped = starts[-1] if starts else 0
  last = rest[dropped:]
  if not last:
    return prompt, f"{CUT_TOKENS}: the system message alone is over the budget"
  text = last[0].content
  cut = lambda c: system + (Message(last[0].role, text[c:]),) + last[1:]
  c = _first_fit(len(text), lambda c: fits(render(cut(c))))
  if c == len(text):
    return prompt, (f"{CUT_TOKENS}: the system message and the last turn's framing alone are "
                    f"over the budget")
  lost = f"{LOST_TURNS}: {dropped} of {len(rest)}, then " if dropped else ""
  return cut(c), f"{lost}{CUT_IN_TURN}: kept the last {len(text) - c} of {len(text)} characters"


def fit_record(record: Record | SFTExample, text: PreferenceRecord | SFTRecord, t: Template,
               budget, where: str = "") -> tuple[PreferenceRecord | SFTRecord, str]:
  """(`text`, the record as `render_record` (a pair) or `render_sft` (an SFT example) rendered
  it, fitted to `budget`, a `data.PromptBudget`; how its prompt was cut, "" when whole): a
  conversation's prompt by `fit_prompt` and rendered again with its completions; a text prompt
  as it is (`data.encode_prompt` keeps its end). A cut the template refuses raises DataError
  naming `where`."""
  if budget.fits(text.prompt):
    return text, ""
  if isinstance(record, (PreferenceRecord, SFTRecord)):
    return text, f"{CUT_TOKENS}: a text prompt"
  try:
    kept, how = fit_prompt(record.prompt, t, budget.fits)
  except ValueError as e:
    raise _refusal(where, e) from None
  render = render_record if isinstance(record, ChatRecord) else render_sft
  return render(record._replace(prompt=kept), t, where), how


class PromptCuts:
  """How each prompt of a set was fitted to --max_prompt_length (`rows`: one entry a record, ""
  when whole), counted by kind and logged with the first records of each."""

  KINDS = (LOST_TURNS, CUT_IN_TURN, CUT_TOKENS)

  def __init__(self, show: int = 3):
    self.rows, self.show = [], show
    self.where: dict[str, list[str]] = {k: [] for k in self.KINDS}
    self.counts: dict[str, int] = {k: 0 for k in self.KINDS}

  def add(self, where: str, how: str) -> None:
    self.rows.append(how)
    if how:
      kind = next(k for k in reversed(self.KINDS) if k in how)  # the last, most severe cut
      self.counts[kind] += 1
      if len(self.where[kind]) < self.show:
        self.where[kind].append(where)

  def log(self, what: str, max_len: int) -> None:
    if describe_cuts(self.counts):
      first = "; ".join(f"{k}: {', '.join(w)}" for k, w in self.where.items() if w)
      logging.warning("%s: %s (of %d; --max_prompt_length=%d; first: %s)", what,
                      describe_cuts(self.counts), len(self.rows), max_len, first)


def describe_cuts(counts: dict[str, int]) -> str:
  """`PromptCuts.counts` in words, e.g. "12 prompts lost earlier turns, 1 cut inside a turn";
  "" when none was cut."""
  parts = [f"{n} {k}" for k, n in counts.items() if n]
  if parts:
    n, rest = parts[0].split(" ", 1)
    parts[0] = f"{n} {'prompt' if n == '1' else 'prompts'} {rest}"
  return ", ".join(parts)

"""Chat templates: conversation messages -> the exact prompt and completion text a model expects.

One small, explicit function set per family, written from each family's published prompt
format (not from a Jinja template engine), so a reader can check every character:

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
the completion does not already end with it (see `dpo.data.encode_completion`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from dpo.data import PreferenceRecord
from dpo.formats import ChatRecord, Message, Record

_SYSTEM_ROLES = ("system", "developer")


class ChatTemplate(NamedTuple):
  name: str
  bos_text: str                       # the BOS token's text (added by the tokenizer, not here)
  turn: Callable[[Message], str]      # one whole prompt turn, separator included
  generation_prompt: str              # opens the assistant turn the completion fills
  completion: Callable[[str], str]    # the assistant's text plus its end-of-turn marker
  next_turn: str                      # between two assistant messages of one completion
  fold_system: bool = False           # merge system messages into the first user turn


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


TEMPLATES: dict[str, ChatTemplate] = {
    "llama3": ChatTemplate(
        "llama3", "<|begin_of_text|>", _llama3_turn,
        "<|start_header_id|>assistant<|end_header_id|>\n\n", lambda t: f"{t}<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "chatml": ChatTemplate(
        "chatml", "", _chatml_turn, "<|im_start|>assistant\n", lambda t: f"{t}<|im_end|>",
        "\n<|im_start|>assistant\n"),
    "gemma": ChatTemplate(
        "gemma", "<bos>", _gemma_turn, "<start_of_turn>model\n", lambda t: f"{t}<end_of_turn>",
        "\n<start_of_turn>model\n", fold_system=True),
    "plain": ChatTemplate(
        "plain", "", _plain_turn, "\n\nAssistant:", lambda t: f" {t}", "\n\nAssistant:"),
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


def render_record(record: Record, t: ChatTemplate) -> PreferenceRecord:
  """A ChatRecord as prompt/completion text; text records pass through unchanged."""
  if isinstance(record, PreferenceRecord):
    return record
  return PreferenceRecord(render_prompt(t, record.prompt), render_completion(t, record.chosen),
                          render_completion(t, record.rejected))

"""dpo/chat.py: each template against strings written out by hand from the family's published
prompt format (BOS text removed: the tokenizer adds BOS as an id)."""

import pytest

from dpo import chat
from dpo.data import PreferenceRecord
from dpo.formats import ChatRecord, Message as M

SYSTEM = M("system", "You are a helpful AI assistant for travel tips and recommendations")
CONV = (SYSTEM, M("user", "What is France's capital?"),
        M("assistant", "Bonjour! The capital of France is Paris!"),
        M("user", "What can I do there?"))
ANSWER = M("assistant", "Visit the Louvre.")

# Meta Llama 3 model card, multi-turn example.
LLAMA3_PROMPT = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "You are a helpful AI assistant for travel tips and recommendations<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is France's capital?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nBonjour! The capital of France is Paris!"
    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat can I do there?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n")
LLAMA3_ANSWER = "Visit the Louvre.<|eot_id|>"

# ChatML (Qwen chat format).
CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant for travel tips and recommendations"
    "<|im_end|>\n<|im_start|>user\nWhat is France's capital?<|im_end|>\n"
    "<|im_start|>assistant\nBonjour! The capital of France is Paris!<|im_end|>\n"
    "<|im_start|>user\nWhat can I do there?<|im_end|>\n<|im_start|>assistant\n")
CHATML_ANSWER = "Visit the Louvre.<|im_end|>"

# Gemma: user/model turns; the system text opens the first user turn.
GEMMA_PROMPT = (
    "<bos><start_of_turn>user\nYou are a helpful AI assistant for travel tips and "
    "recommendations\n\nWhat is France's capital?<end_of_turn>\n<start_of_turn>model\n"
    "Bonjour! The capital of France is Paris!<end_of_turn>\n<start_of_turn>user\n"
    "What can I do there?<end_of_turn>\n<start_of_turn>model\n")
GEMMA_ANSWER = "Visit the Louvre.<end_of_turn>"

# Plain (Anthropic HH-RLHF transcript style, for base models).
PLAIN_PROMPT = (
    "You are a helpful AI assistant for travel tips and recommendations"
    "\n\nHuman: What is France's capital?\n\nAssistant: Bonjour! The capital of France is Paris!"
    "\n\nHuman: What can I do there?\n\nAssistant:")
PLAIN_ANSWER = " Visit the Louvre."


@pytest.mark.parametrize("name,prompt,answer", [
    ("llama3", LLAMA3_PROMPT, LLAMA3_ANSWER), ("chatml", CHATML_PROMPT, CHATML_ANSWER),
    ("qwen", CHATML_PROMPT, CHATML_ANSWER), ("gemma", GEMMA_PROMPT, GEMMA_ANSWER),
    ("plain", PLAIN_PROMPT, PLAIN_ANSWER)])
def test_template_matches_documented_string(name, prompt, answer):
  t = chat.get_template(name)
  assert prompt.startswith(t.bos_text)
  assert t.bos_text + chat.render_prompt(t, CONV) == prompt
  assert chat.render_completion(t, [ANSWER]) == answer


def test_multi_message_completion_continues_the_conversation():
  # Two assistant messages in a completion read exactly as two consecutive assistant turns.
  a2 = M("assistant", "Then the Eiffel Tower.")
  for name in ("llama3", "chatml", "gemma", "plain"):
    t = chat.get_template(name)
    two = chat.render_prompt(t, CONV) + chat.render_completion(t, [ANSWER, a2])
    longer = chat.render_prompt(t, CONV + (ANSWER, M("user", "x")))
    # The first part, up to the end of ANSWER's turn, matches the longer conversation's prompt.
    first = chat.render_prompt(t, CONV) + chat.render_completion(t, [ANSWER])
    assert longer.startswith(first)
    assert two.startswith(first) and two.endswith(chat.render_completion(t, [a2]))
  t = chat.TEMPLATES["chatml"]
  assert chat.render_completion(t, [ANSWER, a2]) == (
      "Visit the Louvre.<|im_end|>\n<|im_start|>assistant\nThen the Eiffel Tower.<|im_end|>")


def test_render_record_and_text_passthrough():
  rec = ChatRecord((M("user", "Hi"),), (M("assistant", "Hello."),), (M("assistant", "No."),))
  assert chat.render_record(rec, chat.TEMPLATES["llama3"]) == PreferenceRecord(
      "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n", "Hello.<|eot_id|>", "No.<|eot_id|>")
  text = PreferenceRecord("p", "c", "r")
  assert chat.render_record(text, chat.TEMPLATES["gemma"]) is text


def test_developer_role_is_system_and_gemma_needs_a_user_turn():
  t = chat.TEMPLATES["chatml"]
  assert chat.render_prompt(t, [M("developer", "D"), M("user", "U")]) == (
      "<|im_start|>system\nD<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
  with pytest.raises(ValueError, match="gemma"):
    chat.render_prompt(chat.TEMPLATES["gemma"], [M("system", "S"), M("assistant", "A")])
  with pytest.raises(ValueError, match="unknown chat_template"):
    chat.get_template("mistral")

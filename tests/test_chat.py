"""dpo/chat.py: each template against strings written out by hand from the family's published
prompt format (BOS text removed: the tokenizer adds BOS as an id)."""

import pytest

from dpo import chat, formats
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
  with pytest.raises(ValueError, match="gemma: no system role, and the system message at "
                                       "position 2 comes after"):
    chat.render_prompt(chat.TEMPLATES["gemma"], [M("user", "U"), M("assistant", "A"),
                                                 M("system", "S"), M("user", "V")])
  with pytest.raises(ValueError, match="unknown chat_template"):
    chat.get_template("mistral")


# --- the tokenizer's own template, against transformers' apply_chat_template -----------------
# Tiny tokenizer folders: the GPT-2 tokenizer.json with each family's special tokens added, and
# the family's template written from its published format (no downloads).

import datetime
import json
import os

import numpy as np

from conftest import SHARED_DATA
from dpo import data, prepare, tokenizer
from dpo.data import DataError

GPT2 = os.path.join(SHARED_DATA, "tokenizers", "gpt2", "tokenizer.json")
needs_gpt2 = pytest.mark.skipif(not os.path.exists(GPT2), reason="no ../shared/data")

LLAMA31 = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
QWEN25 = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
GEMMA2 = r"""{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""
MISTRAL = r"""{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"""
PHI3 = r"""{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"""
# Zephyr's multi-line template: trim_blocks / lstrip_blocks decide every newline of it.
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""
# namespace() and transformers' tojson (no HTML escaping, ensure_ascii off).
TOJSON = r"""{%- set ns = namespace(turn=0) -%}
{%- for m in messages -%}
{%- set ns.turn = ns.turn + 1 -%}
{{ '[' ~ ns.turn ~ '] ' ~ (m.role | tojson) ~ ': ' ~ (m.content | tojson) ~ '\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '[' ~ (ns.turn + 1) ~ '] "assistant": ' }}{%- endif -%}"""

# SmolLM2-135M-Instruct's template as its tokenizer_config.json carries it: ChatML, a default
# system turn, and "<|im_start|>" as the BOS token, so every rendering opens with the BOS text.
SMOLLM2 = """{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""

FAMILIES = {  # name: (template, added special tokens, bos, eos, template in chat_template.jinja)
    "llama3.1": (LLAMA31, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", False),
    "qwen2.5": (QWEN25, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", False),
    "gemma2": (GEMMA2, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>",
               True),
    "mistral": (MISTRAL, ["<s>", "</s>"], "<s>", "</s>", False),
    "phi3": (PHI3, ["<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<s>",
             "<|endoftext|>", False),
    "zephyr": (ZEPHYR, ["<s>", "</s>"], "<s>", "</s>", True),
    "tojson": (TOJSON, [], None, "<|endoftext|>", False),
    "smollm2": (SMOLLM2, ["<|im_start|>", "<|im_end|>"], "<|im_start|>", "<|im_end|>", False),
}
NO_SYSTEM = ("gemma2", "mistral")


def _folder(tmp_path, family):
  from tokenizers import AddedToken, Tokenizer
  template, specials, bos, eos, jinja_file = FAMILIES[family]
  tok = Tokenizer.from_file(GPT2)
  tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
  d = tmp_path / family
  d.mkdir()
  tok.save(str(d / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
  if jinja_file:
    (d / "chat_template.jinja").write_text(template)
  else:
    config["chat_template"] = template
  (d / "tokenizer_config.json").write_text(json.dumps(config))
  return str(d)


def _conversations(family):
  system = [] if family in NO_SYSTEM else [{"role": "system", "content": "Be brief. <b>&</b>"}]
  multi = [{"role": "user", "content": "What is France's capital?"},
           {"role": "assistant", "content": "Paris."},
           {"role": "user", "content": "And Spain's?  "}]
  return [  # (prompt, chosen, rejected)
      (system + multi, "Madrid, café.", "Barcelona."),
      ([{"role": "user", "content": "Hi"}], "Hello!\nHow can I help?", "No."),
  ]


def _ids(out):
  return list(out["input_ids"] if hasattr(out, "keys") else out)


@needs_gpt2
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tokenizer_template_matches_transformers(tmp_path, family):
  transformers = pytest.importorskip("transformers")
  folder = _folder(tmp_path, family)
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  tok = tokenizer.load_tokenizer(folder)
  t = chat.resolve_template("auto", tok)
  assert isinstance(t, chat.JinjaTemplate)
  rows = [{"prompt": p, "chosen": [{"role": "assistant", "content": c}],
           "rejected": [{"role": "assistant", "content": r}]} for p, c, r in _conversations(family)]
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  arrays = prepare.prepare_pairs(str(path), prepare.Preparation(tok, max_prompt_length=512,
      max_target_length=512)).train
  records = [rec for _, rec in formats.iter_records(str(path))]
  for i, (prompt, chosen, rejected) in enumerate(_conversations(family)):
    text = chat.render_record(records[i], t)
    bos = hf.bos_token if t.emits_bos else ""
    want_prompt = hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert bos + text.prompt == want_prompt
    for side, answer, got in ((0, chosen, text.chosen), (1, rejected, text.rejected)):
      conv = prompt + [{"role": "assistant", "content": answer}]
      want_full = hf.apply_chat_template(conv, tokenize=False)
      assert bos + text.prompt + got == want_full
      # Token ids: the prompt exactly as transformers tokenises it, then the completion's text
      # (prompt and completion are tokenised apart, so no token spans the boundary).
      tokens, mask = arrays["tokens"][i, side], arrays["loss_mask"][i, side]
      start, end = int(mask.argmax()), int(arrays["segment_ids"][i, side].sum())
      assert tokens[:start].tolist() == _ids(hf.apply_chat_template(
          prompt, add_generation_prompt=True, tokenize=True))
      assert tokens[start:end].tolist() == hf(want_full[len(want_prompt):],
                                              add_special_tokens=False)["input_ids"]
    # The whole conversation as one string encodes to transformers' ids.
    assert ([tok.bos_id] if t.emits_bos else []) + tok.encode(text.prompt + text.chosen) == _ids(
        hf.apply_chat_template(prompt + [{"role": "assistant", "content": chosen}]))


@needs_gpt2
def test_template_details(tmp_path):
  llama = tokenizer.load_tokenizer(_folder(tmp_path, "llama3.1"))
  t = chat.resolve_template("auto", llama)
  prompt = t.render([M("user", "x")], True)
  assert f"Today Date: {datetime.datetime.now().strftime('%d %b %Y')}\n\n" in prompt
  assert t.fingerprint() != chat.JinjaTemplate(LLAMA31 + " ", t.special, "x").fingerprint()
  qwen = chat.resolve_template("auto", tokenizer.load_tokenizer(_folder(tmp_path, "qwen2.5")))
  assert qwen.render([M("user", "x")], True).startswith(
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
  js = chat.resolve_template("auto", tokenizer.load_tokenizer(_folder(tmp_path, "tojson")))
  assert js.render([M("user", "é <b>&")], False) == '[1] "user": "é <b>&"\n'
  # A named hand-written template replaces the tokenizer's own; unknown names are refused.
  assert chat.resolve_template("chatml", llama) is chat.TEMPLATES["chatml"]
  with pytest.raises(ValueError, match="has no chat_template"):
    chat.resolve_template("tokenizer", tokenizer.load_tokenizer(GPT2))
  assert chat.resolve_template("auto", tokenizer.load_tokenizer(GPT2)) is chat.TEMPLATES["plain"]
  with pytest.raises(ValueError, match="unknown --chat_template"):
    chat.resolve_template("mistral", llama)
  # The sandbox: no attribute access into Python internals.
  evil = chat.JinjaTemplate("{{ messages.__class__.__mro__ }}", {}, "evil")
  with pytest.raises(Exception, match="unsafe|not safely|access"):
    evil.render([M("user", "x")], False)


@needs_gpt2
def test_gemma_refuses_system_and_a_non_extending_template_is_named(tmp_path):
  tok = tokenizer.load_tokenizer(_folder(tmp_path, "gemma2"))
  rows = [{"prompt": [{"role": "user", "content": "Hi"}],
           "chosen": [{"role": "assistant", "content": "A"}],
           "rejected": [{"role": "assistant", "content": "B"}]},
          {"prompt": [{"role": "system", "content": "S"}],  # a system message only
           "chosen": [{"role": "assistant", "content": "A"}],
           "rejected": [{"role": "assistant", "content": "B"}]},
          {"prompt": [{"role": "user", "content": "Hi"}],   # differ only by trailing spaces
           "chosen": [{"role": "assistant", "content": "Same"}],
           "rejected": [{"role": "assistant", "content": "Same  "}]}]
  path = tmp_path / "g.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(DataError, match=r"g\.jsonl:2: chat template .* System role not supported"):
    prepare.prepare_pairs(str(path), prepare.Preparation(tok))
  prep = prepare.prepare_pairs(str(path), prepare.Preparation(tok, skip_bad=True))
  assert prep.report["skipped_bad_records"] == 1
  assert prep.report["filters"]["equal_after_template"] == 1
  assert len(prep.train["tokens"]) == 1
  bad = chat.JinjaTemplate(
      "{% for m in messages %}<|{{ m.role }}|> {{ m.content }}\n{% endfor %}"
      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}", {}, "bad")
  rec = ChatRecord((M("user", "Hi"),), (M("assistant", "A"),), (M("assistant", "B"),))
  with pytest.raises(DataError, match=r"f\.jsonl:7: chat template bad: the rendering of prompt "
                                      r"\+ chosen does not extend"):
    chat.render_record(rec, bad, "f.jsonl:7")


@needs_gpt2
@pytest.mark.parametrize("name", ["llama3", "chatml", "gemma", "plain"])
def test_hand_written_templates_jinja_form_renders_the_same_in_transformers(name):
  """What an export's tokenizer_config.json carries for a hand-written template: transformers'
  apply_chat_template renders it to exactly the trained text (BOS text included)."""
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(GPT2))
  t = chat.TEMPLATES[name]
  as_dicts = lambda ms: [{"role": m.role, "content": m.content} for m in ms]
  a2 = M("assistant", "Then the Eiffel Tower.")
  for conv, answers in ((CONV, [ANSWER]), (CONV, [ANSWER, a2]),
                        ((M("developer", "D"), M("user", "U")), [ANSWER])):
    render = lambda ms, gen: hf.apply_chat_template(
        as_dicts(ms), chat_template=t.jinja, add_generation_prompt=gen, tokenize=False,
        bos_token=t.bos_text)
    prompt = t.bos_text + chat.render_prompt(t, conv)
    assert render(conv, True) == prompt
    assert render(tuple(conv) + tuple(answers), False) == prompt + chat.render_completion(
        t, answers)
  if name == "gemma":
    with pytest.raises(Exception, match="system message comes after"):
      hf.apply_chat_template([{"role": "user", "content": "U"},
                              {"role": "system", "content": "S"}], chat_template=t.jinja)


def test_where_a_folder_keeps_its_template(tmp_path):
  """chat_template.jinja wins over tokenizer_config.json (as in transformers); a list of named
  templates gives its "default"; --chat_template=FILE.jinja renders that file."""
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default",
                                                                 "template": "D"}]}))
  assert chat.read_chat_template(str(tmp_path)) == "D"
  (tmp_path / "chat_template.jinja").write_text("J")
  assert chat.read_chat_template(str(tmp_path)) == "J"
  (tmp_path / "chat_template.jinja").unlink()
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": [{"name": "tool_use", "template": "T"}]}))
  with pytest.raises(ValueError, match=r"lists \['tool_use'\] but no 'default'"):
    chat.read_chat_template(str(tmp_path))
  path = tmp_path / "mine.jinja"
  path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant] {% endif %}")
  t = chat.resolve_template(str(path), tokenizer.ByteTokenizer())
  rec = ChatRecord((M("user", "Hi"),), (M("assistant", "A"),), (M("assistant", "B"),))
  assert chat.render_record(rec, t) == PreferenceRecord("[user] Hi\n[assistant] ", "A\n", "B\n")


@needs_gpt2
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sft_data_renders_as_transformers_does(tmp_path, family):
  """--sft_data conversations get the tokenizer's own template: the prompt's ids are
  apply_chat_template(prompt, add_generation_prompt=True)'s, the completion's the rest of the
  whole conversation's rendering; a ShareGPT file reads the same."""
  transformers = pytest.importorskip("transformers")
  folder = _folder(tmp_path, family)
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  tok = tokenizer.load_tokenizer(folder)
  convs = [(p, c) for p, c, _ in _conversations(family)]
  messages = [{"messages": p + [{"role": "assistant", "content": c}]} for p, c in convs]
  speaker = {"user": "human", "assistant": "gpt", "system": "system"}
  sharegpt = [{"conversations": [{"from": speaker[m["role"]], "value": m["content"]}
                                 for m in r["messages"]]} for r in messages]
  arrays = {}
  for name, rows in (("messages", messages), ("sharegpt", sharegpt)):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arrays[name], report = prepare.prepare_sft(str(path), prepare.Preparation(tok,
        max_prompt_length=512, max_target_length=512))
    assert report[f"format_{name}"] == len(rows) and report["template"].endswith("own)")
  for k in arrays["messages"]:
    np.testing.assert_array_equal(arrays["messages"][k], arrays["sharegpt"][k])
  a = arrays["messages"]
  for i, (prompt, answer) in enumerate(convs):
    tokens, mask = a["tokens"][i], a["loss_mask"][i]
    start, end = int(mask.argmax()), int(a["segment_ids"][i].sum())
    want_prompt = hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    want_full = hf.apply_chat_template(prompt + [{"role": "assistant", "content": answer}],
                                       tokenize=False)
    assert tokens[:start].tolist() == _ids(hf.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True))
    assert tokens[start:end].tolist() == hf(want_full[len(want_prompt):],
                                            add_special_tokens=False)["input_ids"]


@needs_gpt2
def test_loop_sft_data_uses_the_preference_data_template(tmp_path):
  """loop.Data: --sft_data and --train_data in chat layouts, one tokenizer folder: the SFT rows
  equal the chosen rows of the same conversations as preference pairs; a conversation the
  template refuses is a DataError naming the SFT file and record."""
  import configs
  from dpo import loop
  folder = _folder(tmp_path, "qwen2.5")
  prefs, sft = tmp_path / "prefs.jsonl", tmp_path / "sft.jsonl"
  convs = [([{"role": "user", "content": f"q{i}"}], f"yes {i}", f"no {i}") for i in range(8)]
  prefs.write_text("".join(json.dumps({
      "prompt": p, "chosen": [{"role": "assistant", "content": c}],
      "rejected": [{"role": "assistant", "content": r}]}) + "\n" for p, c, r in convs))
  sft.write_text("".join(json.dumps({"messages": p + [{"role": "assistant", "content": c}]})
                         + "\n" for p, c, _ in convs))
  cfg = configs.DEFAULT.replace(train_data=str(prefs), sft_data=str(sft), tokenizer=folder,
                                vocab_size=50304, global_batch_size=4, data_cache_dir="none",
                                output_dir=str(tmp_path / "run"))
  d = loop.Data(cfg)
  for k in d.sft:
    np.testing.assert_array_equal(d.sft[k], d.pairs[k][:, 0])
  assert d.reports[-1]["role"] == "sft" and d.reports[-1]["format_messages"] == 8
  gemma = _folder(tmp_path, "gemma2")
  sft.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "a"}]}) + "\n" +
                 json.dumps({"messages": [{"role": "system", "content": "S"},
                                          {"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "a"}]}) + "\n")
  with pytest.raises(DataError, match=r"sft\.jsonl:2: chat template .* System role not "
                                      r"supported"):
    loop.Data(cfg.replace(tokenizer=gemma))
  arrays, report = prepare.prepare_sft(str(sft),
      prepare.Preparation(tokenizer.load_tokenizer(gemma), skip_bad=True))
  assert report["skipped_bad_records"] == 1 and len(arrays["tokens"]) == report["examples"] == 1


# --- prompts over --max_prompt_length: whole earlier turns, then a cut inside the last ------------

TURN = ("Tell me more about the history of the {} and the people who lived near it, in detail, "
        "with dates.")
REPLY = "The {} was settled early; its people traded grain, wool and salt along the river."


def _long_conversation(family, exchanges=4):
  """[system] + `exchanges` user/assistant exchanges + a final user turn, as dicts."""
  system = [] if family in NO_SYSTEM else [{"role": "system", "content": "Answer as a guide."}]
  places = ["valley", "harbour", "castle", "abbey", "market", "bridge"]
  conv = []
  for p in places[:exchanges]:
    conv += [{"role": "user", "content": TURN.format(p)},
             {"role": "assistant", "content": REPLY.format(p)}]
  return system, conv + [{"role": "user", "content": "And what is there to see today?"}]


def _hf_prompt_ids(hf, messages):
  return _ids(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


@needs_gpt2
@pytest.mark.parametrize("family", ["smollm2", "llama3.1", "gemma2", "mistral"])
def test_a_long_conversation_loses_whole_earlier_turns_as_transformers_renders_them(
    tmp_path, family, caplog):
  """The prompt over the budget is transformers' rendering of the system message and the last
  turns that fit (whole exchanges, from a user turn), framing and generation prompt included;
  the completions follow that prompt as transformers renders them; a prompt within the budget is
  untouched; the SFT path fits the same conversations the same way; the log counts them."""
  transformers = pytest.importorskip("transformers")
  caplog.set_level("INFO")
  folder = _folder(tmp_path, family)
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  tok = tokenizer.load_tokenizer(folder)
  system, conv = _long_conversation(family)
  short = [{"role": "user", "content": "Hi"}]
  # The budget: what the system message and the last two exchanges plus the final turn take.
  budget = len(_hf_prompt_ids(hf, system + conv[-5:]))
  # The oracle: of the conversations that start at a user turn, the longest that fits.
  fitting = lambda b: next(system + conv[k:] for k in range(0, len(conv), 2)
                           if len(_hf_prompt_ids(hf, system + conv[k:])) <= b)
  assert fitting(budget) == system + conv[-5:] and fitting(budget - 1) == system + conv[-3:]
  rows = [{"prompt": system + conv, "chosen": [{"role": "assistant", "content": "The old mill."}],
           "rejected": [{"role": "assistant", "content": "Nothing."}]},
          {"prompt": short, "chosen": [{"role": "assistant", "content": "Hello!"}],
           "rejected": [{"role": "assistant", "content": "No."}]}]
  path = tmp_path / "long.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  sft_path = tmp_path / "long_sft.jsonl"
  sft_path.write_text("".join(json.dumps({"messages": r["prompt"] + r["chosen"]}) + "\n"
                              for r in rows))
  for b in (budget, budget - 1):
    how = prepare.Preparation(tok, max_prompt_length=b, max_target_length=64)
    prep = prepare.prepare_pairs(str(path), how)
    sft, sft_report = prepare.prepare_sft(str(sft_path), how)
    for i, (row, prompt) in enumerate(zip(rows, (fitting(b), short))):
      want_prompt = hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
      for side, name in ((0, "chosen"), (1, "rejected")):
        tokens, mask = prep.train["tokens"][i, side], prep.train["loss_mask"][i, side]
        start, end = int(mask.argmax()), int(prep.train["segment_ids"][i, side].sum())
        assert tokens[:start].tolist() == _hf_prompt_ids(hf, prompt), (b, i, name)
        full = hf.apply_chat_template(prompt + row[name], tokenize=False)
        assert tokens[start:end].tolist() == hf(full[len(want_prompt):],
                                                add_special_tokens=False)["input_ids"]
      start = int(sft["loss_mask"][i].argmax())
      assert sft["tokens"][i, :start].tolist() == _hf_prompt_ids(hf, prompt)
    dropped = len(conv) - len(fitting(b)) + len(system)
    assert prep.cuts == [f"lost earlier turns: {dropped} of {len(conv)}", ""]
    assert prep.report["prompt_cuts"]["train"] == {
        "lost earlier turns": 1, "cut inside a turn": 0, "cut at tokens": 0}
    assert sft_report["prompt_cuts"]["lost earlier turns"] == 1
  assert f"long.jsonl train pairs: 1 prompt lost earlier turns (of 2; --max_prompt_length=" \
         f"{budget - 1}; first: lost earlier turns: {path}:1)" in caplog.text
  assert "truncated" not in caplog.text  # no token cut reached these prompts
  # Negative control: the token cut of the whole rendering (what the prompt was before),
  # which starts inside a turn at budget - 1, is not the rendering of the kept turns, so the
  # comparison above tells the two apart.
  whole = _hf_prompt_ids(hf, system + conv)
  bos = [tok.bos_id] if hf.bos_token and whole[0] == tok.bos_id else []
  token_cut = bos + whole[len(whole) - (budget - 1) + len(bos):]
  assert len(token_cut) == budget - 1 and token_cut != _hf_prompt_ids(hf, fitting(budget - 1))


@needs_gpt2
def test_a_last_turn_alone_over_the_budget_is_cut_inside_its_text(tmp_path):
  """The system message and the final user turn alone are over the budget: the earlier turns
  go and the start of the last turn's text is dropped, the fewest characters that fit (one more
  would not, by transformers' count), inside the template's framing; a budget that not even
  the framing fits leaves the rendering to the token cut, and says so."""
  transformers = pytest.importorskip("transformers")
  folder = _folder(tmp_path, "smollm2")
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  tok = tokenizer.load_tokenizer(folder)
  t = chat.resolve_template("auto", tok)
  system, conv = _long_conversation("smollm2", exchanges=2)
  last = " ".join(TURN.format(p) for p in ("valley", "harbour", "castle", "abbey"))
  conv[-1] = {"role": "user", "content": last}
  as_messages = lambda ms: tuple(M(m["role"], m["content"]) for m in ms)
  rec = ChatRecord(as_messages(system + conv), (M("assistant", "Yes."),), (M("assistant", "No."),))
  budget = data.PromptBudget(tok, 60, add_bos=True)
  text = chat.render_record(rec, t)
  assert t.emits_bos  # SmolLM2's BOS is <|im_start|>, which opens every rendering
  fitted, how = chat.fit_record(rec, text, t, budget, "f.jsonl:1")
  kept = int(how.split("kept the last ")[1].split(" ")[0])
  assert how == (f"lost earlier turns: 4 of 5, then cut inside a turn: kept the last {kept} of "
                 f"{len(last)} characters")
  with_last = lambda c: system + [{"role": "user", "content": last[len(last) - c:]}]
  assert len(_hf_prompt_ids(hf, with_last(kept))) <= 60 < len(_hf_prompt_ids(hf, with_last(
      kept + 1)))
  assert t.bos_text + fitted.prompt == hf.apply_chat_template(
      with_last(kept), add_generation_prompt=True, tokenize=False)
  assert fitted.chosen == text.chosen == "Yes.<|im_end|>\n"
  assert [tok.bos_id] + tok.encode(fitted.prompt) == _hf_prompt_ids(hf, with_last(kept))
  # Not even the system turn and the framing fit: nothing is cut here, the token cut keeps
  # the rendering's end, and the words say which.
  same, how = chat.fit_record(rec, text, t, data.PromptBudget(tok, 12, add_bos=True), "f")
  assert same == text and how.startswith("cut at tokens: the system message and the last "
                                         "turn's framing alone are over the budget")
  cuts = chat.PromptCuts()
  for where, h in (("a", ""), ("b", "lost earlier turns: 2 of 5"), ("c", how),
                   ("d", "lost earlier turns: 4 of 5, then cut inside a turn: kept ...")):
    cuts.add(where, h)
  assert chat.describe_cuts(cuts.counts) == ("1 prompt lost earlier turns, 1 cut inside a turn, "
                                             "1 cut at tokens")
  assert cuts.rows[0] == "" and cuts.where["cut inside a turn"] == ["d"]


def test_a_text_prompt_over_the_budget_keeps_the_token_cut():
  """A plain-string prompt is not a conversation: it passes as it is, and the token cut keeps
  its end as before."""
  tok = tokenizer.ByteTokenizer()
  text = PreferenceRecord("x" * 30 + "the question?", "a", "b")
  rec, how = chat.fit_record(text, text, chat.TEMPLATES["plain"],
                             data.PromptBudget(tok, 20), "t.jsonl:1")
  assert rec is text and how == "cut at tokens: a text prompt"
  stats = data.TruncationStats()
  ids = data.encode_prompt(tok, rec.prompt, 20, stats)
  assert len(ids) == 20 and tok.decode(ids[1:]).endswith("the question?")
  assert stats.prompts_truncated == 1
  assert chat.fit_record(text, text, chat.TEMPLATES["plain"], data.PromptBudget(tok, 64)) == (
      text, "")

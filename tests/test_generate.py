"""dpo/tools/generate.py: a tiny model's answers to AlpacaEval and MT-Bench question files.

The files are read back with `datasets.load_dataset("json")` (what a judge's loader sees); the
prompts the sampler gets are captured and compared with the chat template's rendering (and, for
a Hugging Face folder, with transformers' `apply_chat_template` ids); a run killed after its first
batch and rerun writes what one run writes; bad files are one-line errors naming them.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

import configs
from conftest import SHARED_DATA
from dpo import chat, checkpoint, evaluate
from dpo import tokenizer as tokenizer_lib
from dpo.data import DataError
from dpo.formats import Message as M
from dpo.tools import generate
from models import sharding, transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = os.path.join(SHARED_DATA, "tokenizers", "gpt2", "tokenizer.json")
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
            eval_temperature=0.0, eval_max_new_tokens=6, eval_batch_size=2, max_prompt_length=32)

ALPACA = [  # alpaca_eval.json's layout: each instruction with a reference output, its generator
    {"dataset": "helpful_base", "instruction": "Name a colour of the sky.", "output": "Blue.",
     "generator": "text_davinci_003"},
    {"dataset": "koala", "instruction": "Say hello.", "output": "Hello!",
     "generator": "text_davinci_003"},
    {"dataset": "oasst", "instruction": "Count to three.", "output": "1, 2, 3.",
     "generator": "text_davinci_003"},
    {"dataset": "vicuna", "instruction": "Name a fruit.", "output": "Apple.",
     "generator": "text_davinci_003"},
]
MT_BENCH = [  # FastChat's question.jsonl layout
    {"question_id": 81, "category": "writing", "turns": ["Write a line.", "Now make it shorter."]},
    {"question_id": 101, "category": "reasoning", "turns": ["Who is second?", "And the last?"],
     "reference": ["You are second.", "Uncertain."]},
    {"question_id": 130, "category": "stem", "turns": ["One turn only."]},
    {"question_id": 131, "category": "math", "turns": ["Two plus two?"]},
]
# Two questions a batch and prompts of one padded length a turn: few shapes, few compiles.


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh("data:1", jax.devices()[:1])


@pytest.fixture(scope="module")
def policy(tmp_path_factory, mesh):
  """The default preset, tiny, greedy, from a params checkpoint at runs/tiny/checkpoints/policy."""
  cfg = configs.get_config("default").replace(**TINY)
  path = str(tmp_path_factory.mktemp("runs") / "tiny" / "checkpoints" / "policy")
  checkpoint.save_params(path, transformer.init(cfg.model, jax.random.key(0), mesh), cfg.model)
  return cfg.replace(init_from=path)


def _alpaca(tmp_path):
  path = tmp_path / "alpaca_eval.json"
  path.write_text(json.dumps(ALPACA, indent=2))
  return str(path)


def _mt_bench(tmp_path):
  path = tmp_path / "question.jsonl"
  path.write_text("".join(json.dumps(q) + "\n" for q in MT_BENCH))
  return str(path)


def _spy(monkeypatch, fail_at: int = 0):
  """Records each `evaluate.sample` call's (prompts, completions); call `fail_at` raises."""
  calls, real = [], evaluate.sample

  def sample(cfg, mesh, scfg, weights, prompts, key):
    if len(calls) + 1 == fail_at:
      raise KeyboardInterrupt("killed")
    out = real(cfg, mesh, scfg, weights, prompts, key)
    calls.append(([list(p) for p in prompts], out))
    return out

  monkeypatch.setattr(evaluate, "sample", sample)
  return calls


def _load(path, tmp_path):
  datasets = pytest.importorskip("datasets")
  return datasets.load_dataset("json", data_files=str(path), split="train",
                               cache_dir=str(tmp_path / "hf_datasets"))


def test_alpaca_eval_model_outputs_in_order_with_the_dataset_copied(policy, mesh, tmp_path,
                                                                    monkeypatch):
  calls = _spy(monkeypatch)
  out = tmp_path / "model_outputs.json"
  summary = generate.run(policy, generate.Job(_alpaca(tmp_path), str(out)), mesh)
  assert summary["answered"] == 4 and summary["skipped"] == 0
  assert [len(c[0]) for c in calls] == [2, 2]  # eval_batch_size=2
  got = json.loads(out.read_text())
  assert [list(r) for r in got] == [["instruction", "output", "generator", "dataset"]] * 4
  assert [r["instruction"] for r in got] == [q["instruction"] for q in ALPACA]
  assert [r["dataset"] for r in got] == [q["dataset"] for q in ALPACA]
  assert {r["generator"] for r in got} == {"tiny-policy"}  # runs/tiny/checkpoints/policy
  assert not os.path.exists(tmp_path / "model_outputs.partial.jsonl")
  # Each prompt: BOS + the plain template's rendering (the byte model's `auto`), end kept at 32.
  tok, plain = tokenizer_lib.ByteTokenizer(), chat.TEMPLATES["plain"]
  prompts = [p for c in calls for p in c[0]]
  comps = [x for c in calls for x in c[1]]
  for q, p in zip(ALPACA, prompts):
    ids = [tok.bos_id] + tok.encode(chat.render_prompt(plain, [M("user", q["instruction"])]))
    assert p == (ids if len(ids) <= 32 else [tok.bos_id] + ids[len(ids) - 31:])
  for r, c in zip(got, comps):
    stop = bool(c) and c[-1] == tok.eos_id
    assert r["output"] == tok.decode(c[:-1] if stop else c).strip()
  ds = _load(out, tmp_path)
  assert sorted(ds.column_names) == ["dataset", "generator", "instruction", "output"]
  assert ds["instruction"] == [q["instruction"] for q in ALPACA]
  assert ds["output"] == [r["output"] for r in got]
  assert ds["dataset"] == [q["dataset"] for q in ALPACA]


def test_mt_bench_second_turn_prompt_holds_the_first_answer(policy, mesh, tmp_path,
                                                           monkeypatch):
  source = chat.TEMPLATES["chatml"].jinja
  (tmp_path / "chatml.jinja").write_text(source)
  cfg = policy.replace(chat_template=str(tmp_path / "chatml.jinja"), max_prompt_length=512)
  calls = _spy(monkeypatch)
  out = tmp_path / "tiny.jsonl"
  generate.run(cfg, generate.Job(_mt_bench(tmp_path), str(out), model_id="tiny"), mesh)
  answers = [json.loads(line) for line in out.read_text().splitlines()]
  assert [list(a) for a in answers] == [
      ["question_id", "answer_id", "model_id", "choices", "tstamp"]] * 4
  assert [a["question_id"] for a in answers] == [81, 101, 130, 131]
  assert {a["model_id"] for a in answers} == {"tiny"}
  assert len({a["answer_id"] for a in answers}) == 4
  assert [[c["index"] for c in a["choices"]] for a in answers] == [[0]] * 4
  turns = [a["choices"][0]["turns"] for a in answers]
  assert [len(t) for t in turns] == [2, 2, 1, 1]
  # Calls: batch 1 turn 1, batch 1 turn 2 (after turn 1's answers), batch 2 turn 1.
  assert [len(c[0]) for c in calls] == [2, 2, 2]
  tok, t = tokenizer_lib.ByteTokenizer(), chat.JinjaTemplate(source, {}, "chatml")
  for row, (q, answer) in enumerate(zip(MT_BENCH[:2], turns)):
    first = t.render([M("user", q["turns"][0])], add_generation_prompt=True)
    conv = [M("user", q["turns"][0]), M("assistant", answer[0]), M("user", q["turns"][1])]
    second = t.render(conv, add_generation_prompt=True)
    assert calls[0][0][row] == tok.encode(first)  # the template writes no BOS, none is added
    assert calls[1][0][row] == tok.encode(second)
    assert f"<|im_start|>assistant\n{answer[0]}<|im_end|>" in tok.decode(calls[1][0][row])
  ds = _load(out, tmp_path)
  assert ds["question_id"] == [81, 101, 130, 131]
  assert [c[0]["turns"] for c in ds["choices"]] == turns


@pytest.mark.parametrize("layout", ["alpaca_eval", "mt_bench"])
def test_a_run_killed_after_its_first_batch_resumes_to_the_same_file(policy, mesh, tmp_path,
                                                                     monkeypatch, caplog, layout):
  questions = _alpaca(tmp_path) if layout == "alpaca_eval" else _mt_bench(tmp_path)
  name = "model_outputs.json" if layout == "alpaca_eval" else "answers.jsonl"
  once, twice = tmp_path / "once" / name, tmp_path / "twice" / name
  generate.run(policy, generate.Job(questions, str(once)), mesh)
  fail_at = 2 if layout == "alpaca_eval" else 3  # the second batch's first sampling call
  _spy(monkeypatch, fail_at=fail_at)
  with pytest.raises(KeyboardInterrupt):
    generate.run(policy, generate.Job(questions, str(twice)), mesh)
  monkeypatch.undo()
  if layout == "alpaca_eval":
    assert not twice.exists()
    partial = (tmp_path / "twice" / "model_outputs.partial.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in partial] == [0, 1]
  else:
    assert [json.loads(line)["question_id"] for line in twice.read_text().splitlines()] == [81, 101]
  caplog.set_level("INFO")
  summary = generate.run(policy, generate.Job(questions, str(twice)), mesh)
  assert (summary["skipped"], summary["answered"]) == (2, 2)
  assert "skipped 2 already answered" in caplog.text
  if layout == "alpaca_eval":
    assert twice.read_text() == once.read_text()
    assert not (tmp_path / "twice" / "model_outputs.partial.jsonl").exists()
  else:
    strip = lambda p: [{k: v for k, v in json.loads(line).items() if k != "tstamp"}
                       for line in p.read_text().splitlines()]
    assert strip(twice) == strip(once)
  assert generate.run(policy, generate.Job(questions, str(twice)), mesh)["answered"] == 0


@pytest.mark.parametrize("text,why", [
    (json.dumps([{"prompt": "Hi", "chosen": "a"}]), "record 0 has no string 'instruction'"),
    (json.dumps([{"instruction": "Hi"}]), "record 0 has no string 'dataset'"),
    (json.dumps({"question_id": 1, "turns": ["Hi"]}) + "\n", "line 1 has no 'category'"),
    ('{"question_id": 1, "category": "x", "turns": "Hi"}\n', "'turns' is not a non-empty list"),
    ("question,answer\nHi,there\n", "neither a JSON list nor JSON lines"),
])
def test_a_file_in_neither_layout_is_one_line_naming_it(policy, tmp_path, text, why):
  path = tmp_path / "questions.json"
  path.write_text(text)
  with pytest.raises(DataError) as e:
    generate.run(policy, generate.Job(str(path), str(tmp_path / "out.json")))
  message = str(e.value)
  assert "\n" not in message and str(path) in message and why in message
  assert "AlpacaEval's instruction file" in message and "MT-Bench's question.jsonl" in message


def test_missing_question_file_and_answers_of_another_model_are_refused(policy, tmp_path):
  missing = str(tmp_path / "nope.json")
  with pytest.raises(DataError, match=f"^--questions={missing}: no such file$"):
    generate.run(policy, generate.Job(missing, str(tmp_path / "out.json")))
  alpaca, mt = _alpaca(tmp_path), _mt_bench(tmp_path)
  theirs = tmp_path / "model_outputs.json"
  theirs.write_text(json.dumps(ALPACA))  # text_davinci_003's outputs
  with pytest.raises(DataError) as e:
    generate.run(policy, generate.Job(alpaca, str(theirs)))
  assert "\n" not in str(e.value) and str(e.value).startswith(f"{theirs}: ")
  assert "'text_davinci_003'" in str(e.value) and "'tiny-policy'" in str(e.value)
  theirs = tmp_path / "gpt-4.jsonl"
  theirs.write_text(json.dumps({"question_id": 81, "answer_id": "x", "model_id": "gpt-4",
                                "choices": [{"index": 0, "turns": ["a", "b"]}],
                                "tstamp": 0.0}) + "\n")
  with pytest.raises(DataError) as e:
    generate.run(policy, generate.Job(mt, str(theirs), model_id="mine"))
  assert "\n" not in str(e.value) and str(e.value).startswith(f"{theirs}: ")
  assert "'gpt-4'" in str(e.value)


def test_a_template_that_refuses_a_turn_names_the_question(policy, mesh, tmp_path):
  one_turn = ("{% if messages | length > 1 %}{{ raise_exception('one turn only') }}{% endif %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
              "{% if add_generation_prompt %}assistant:{% endif %}")
  (tmp_path / "one_turn.jinja").write_text(one_turn)
  questions = _mt_bench(tmp_path)
  with pytest.raises(DataError) as e:
    generate.run(policy.replace(chat_template=str(tmp_path / "one_turn.jinja")),
                 generate.Job(questions, str(tmp_path / "a.jsonl")), mesh)
  assert str(e.value).startswith(f"{questions}: question 81, turn 2: ")
  assert "one turn only" in str(e.value) and "\n" not in str(e.value)


def test_the_command_line_prints_one_error_line_and_exits_2(policy, tmp_path):
  bad = tmp_path / "q.json"
  bad.write_text("[1, 2]")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  p = subprocess.run([sys.executable, "-m", "dpo.tools.generate",
                      f"--init_from={policy.checkpoint.init_from}", f"--questions={bad}",
                      f"--answers={tmp_path / 'out.json'}"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert p.returncode == 2, p.stderr
  assert p.stderr.strip().splitlines()[-1] == (
      f"error: {bad}: not AlpacaEval's layout (record 0 is not an object); "
      f"{generate.EXPECTED}")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(GPT2), reason="no ../shared/data")
def test_hf_folder_gives_its_tokenizer_and_template_as_transformers_renders_them(tmp_path,
                                                                                monkeypatch):
  """hf:DIR without --tokenizer: DIR's tokenizer and chat template; the turn-2 prompt ids are
  transformers' `apply_chat_template` ids, and sampling stops at <|im_end|>."""
  transformers = pytest.importorskip("transformers")
  from tokenizers import AddedToken, Tokenizer
  from models import hf
  folder = tmp_path / "qwen-tiny"
  tok = Tokenizer.from_file(GPT2)
  tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
  folder.mkdir()
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>", "chat_template": chat.TEMPLATES["chatml"].jinja}))
  cfg = configs.get_config("default").replace(**{**TINY, "vocab_size": 50304,
                                                  "max_prompt_length": 256})
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  hf.save(str(folder), cfg.model, transformer.init(cfg.model, jax.random.key(1), mesh))
  calls = _spy(monkeypatch)
  out = tmp_path / "qwen-tiny.jsonl"
  summary = generate.run(cfg.replace(init_from=f"hf:{folder}"),
                         generate.Job(_mt_bench(tmp_path), str(out)), mesh)
  assert summary["model_id"] == "qwen-tiny"
  answers = [json.loads(line)["choices"][0]["turns"] for line in out.read_text().splitlines()]
  theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
  for row, (q, answer) in enumerate(zip(MT_BENCH[:2], answers)):
    conv = [{"role": "user", "content": q["turns"][0]},
            {"role": "assistant", "content": answer[0]},
            {"role": "user", "content": q["turns"][1]}]
    ids = theirs.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    assert calls[1][0][row] == list(ids["input_ids"] if hasattr(ids, "keys") else ids)
  im_end = theirs.convert_tokens_to_ids("<|im_end|>")
  for _, comps in calls:
    for c in comps:
      assert im_end not in c[:-1]  # a stop token only ever ends a completion

"""Prompts with answers for the sampling stages (dpo/formats.py's prompt layouts,
dpo/prepare.py's prepare_prompts): GSM8K as the Hub ships it (question, answer ending "#### N";
JSONL and Parquet), MATH (problem, solution with its answer boxed) and TRL's prompt-only layout
(a text or conversational prompt with extra columns), read as `datasets` reads the same files;
an answer that cannot be parsed is a one-line error naming the record and field, or a counted
skip; the columns reach the reward functions of a tiny sft,grpo run, and the evaluation reads
them: pass@k and majority@k of the `solution` column by math-verify (reasoning.Solutions)."""

import json
import math

import numpy as np
import pytest

import configs
from dpo import data, formats, loop, prepare, reasoning, tokenizer

datasets = pytest.importorskip("datasets")

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                 "many clips in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
               "<<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A shop sells 1,200 pens a week. How many in two weeks?",
     "answer": "1,200*2=<<1200*2=2400>>2,400\n#### 2,400"},
    {"question": "What is 7 minus 9?", "answer": "7-9=-2\n#### -2"},
]
MATH = [
    {"problem": "What is $\\frac{1}{2}+\\frac{1}{6}$?", "level": "Level 1",
     "type": "Prealgebra",
     "solution": "We have $\\frac{1}{2}+\\frac{1}{6}=\\frac{3}{6}+\\frac{1}{6}="
                 "\\boxed{\\frac{2}{3}}$."},
    {"problem": "Find $x$ if $x^2=9$ and $x>0$.", "level": "Level 2", "type": "Algebra",
     "solution": "Since $x>0$, $x=\\boxed{3}$."},
]


def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  return str(path)


def _read(path, **kw):
  return [r for _, r in formats.iter_prompt_records(path, **kw)]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_gsm8k_as_the_hub_ships_it(tmp_path, kind):
  if kind == "jsonl":
    path = _write_jsonl(tmp_path / "test.jsonl", GSM8K)
  else:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path = str(tmp_path / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K), path)
  theirs = datasets.load_dataset("json" if kind == "jsonl" else "parquet", data_files=path,
                                 split="train")
  records = _read(path)
  assert len(records) == len(theirs) == 3
  for rec, row in zip(records, theirs):
    assert rec.prompt == (formats.Message("user", row["question"]),)
    assert rec.completion == (formats.Message("assistant", row["answer"]),)
    assert rec.columns == {"answer": row["answer"],
                           "solution": row["answer"].rsplit("####", 1)[1].strip()
                           .replace(",", "")}
  assert [r.columns["solution"] for r in records] == ["72", "2400", "-2"]


def test_math_keeps_the_solution_and_its_other_columns(tmp_path):
  path = _write_jsonl(tmp_path / "math.jsonl", MATH)
  theirs = datasets.load_dataset("json", data_files=path, split="train")
  records = _read(path)
  for rec, row in zip(records, theirs):
    assert rec.prompt[0].content == row["problem"]
    assert rec.columns == {"solution": row["solution"], "level": row["level"],
                           "type": row["type"]}
  assert [formats.boxed_answer(r.columns["solution"]) for r in records] == ["\\frac{2}{3}", "3"]


def test_trl_prompt_only_layouts_keep_every_extra_column(tmp_path):
  text = _write_jsonl(tmp_path / "text.jsonl", [
      {"prompt": "2+2=", "solution": "4", "difficulty": 1},
      {"prompt": "3+5=", "solution": "8", "difficulty": 2}])
  chats = _write_jsonl(tmp_path / "chat.jsonl", [
      {"prompt": [{"role": "system", "content": "Think first."},
                  {"role": "user", "content": "2+2?"}], "solution": "4"}])
  a = _read(text)
  assert [(r.prompt, r.completion, r.columns) for r in a] == [
      ("2+2=", None, {"solution": "4", "difficulty": 1}),
      ("3+5=", None, {"solution": "8", "difficulty": 2})]
  (b,) = _read(chats)
  assert b.prompt == (formats.Message("system", "Think first."), formats.Message("user", "2+2?"))
  assert b.columns == {"solution": "4"} and b.completion is None
  assert formats.is_prompts(text) and formats.is_prompts(chats)
  pairs = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
  assert not formats.is_prompts(pairs)


@pytest.mark.parametrize("rows,message", [
    ([GSM8K[0], {"question": "q?", "answer": "no final answer"}],
     r"^{path}:2: field 'answer' has no final answer after '####' \(GSM8K's layout"),
    ([MATH[0], {"problem": "p?", "solution": "x = 3, not boxed"}],
     r"^{path}:2: field 'solution' has no \\boxed\{{\.\.\.\}} answer \(MATH's layout"),
])
def test_an_answer_that_cannot_be_parsed_is_named_or_counted(tmp_path, rows, message):
  path = _write_jsonl(tmp_path / "d.jsonl", rows)
  with pytest.raises(data.DataError, match=message.format(path=path)) as e:
    _read(path)
  assert "\n" not in str(e.value)
  skips = formats.Skips(path)
  assert len(_read(path, skips=skips)) == 1 and skips.count == 1


def test_prepare_prompts_splits_renders_and_keeps_the_solutions(tmp_path):
  path = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K * 20)  # 60 records, 3 distinct prompts
  how = prepare.Preparation(tokenizer.ByteTokenizer(), template="chatml", max_prompt_length=256,
                            max_target_length=256)
  out = prepare.prepare_prompts(path, how)
  assert out.held is None and len(out.train_records) == 60 and out.solved.all()
  tok = how.tok
  row = out.train["tokens"][0][out.train["segment_ids"][0] != 0]
  scored = out.train["loss_mask"][0] > 0
  text = tok.decode([int(t) for t in row])
  assert "<|im_start|>user\n" + GSM8K[0]["question"] in text and "#### 72" in text
  assert "#### 72" in tok.decode([int(t) for t, s in zip(row, scored[:len(row)]) if s])
  # the held-out split by prompt: a prompt is held out with all its copies
  many = _write_jsonl(tmp_path / "many.jsonl", [
      {"question": f"What is {i} plus 1?", "answer": f"#### {i + 1}"} for i in range(40)] * 2)
  split = prepare.prepare_prompts(many, how, eval_split=0.5)
  assert 0 < len(split.held_records) < 80
  held = {r.prompt for r in split.held_records or ()}
  assert held.isdisjoint({r.prompt for r in split.train_records})


def test_a_pair_stage_on_prompt_data_is_refused_in_one_line(tmp_path):
  path = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K * 4)
  cfg = configs.DEFAULT.replace(train_data=path, stage="sft,dpo", chat_template="chatml",
                                output_dir=str(tmp_path / "run"))
  with pytest.raises(data.DataError, match=r"holds prompts without responses .* the dpo stage "
                     r"needs preference pairs"):
    loop.Data(cfg)
  prompt_only = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}+1=", "solution": str(i + 1)}
                                                   for i in range(16)])
  cfg = cfg.replace(train_data=prompt_only, stage="sft,grpo", reward_fn="think_format")
  with pytest.raises(data.DataError, match=r"carry no worked solutions .* the sft stage needs "
                     r"--sft_data"):
    loop.Data(cfg)


SEEN = []


def test_solutions_evaluate_pass_at_k_and_majority_by_math_verify():
  """Held-out problems sampled k times each (the evaluation's order: the prompts tiled): an
  answer after GSM8K's "####", after </think>, or boxed; answers math-verify finds equal
  (4/6, 2/3) vote together and a tie goes to the first seen; a solution that does not parse
  leaves its problem out, counted; per-level pass@1 from MATH's `level` column."""
  pytest.importorskip("math_verify")
  columns = [{"solution": "72"}, {"solution": MATH[0]["solution"], "level": "Level 1"},
             {"solution": "no answer here"}]
  by_problem = [
      ["<think>48/2=24, 48+24=72</think> 72", "Natalia sold 72.\n#### 72",
       "So the answer is $\\boxed{72}$.", "I do not know"],
      ["$\\boxed{1}$", "$\\boxed{\\frac{4}{6}}$", "$\\boxed{1}$", "$\\boxed{\\frac{2}{3}}$"],
      ["1", "2", "3", "4"]]
  prompts = ["p1", "p2", "p3"] * 4
  texts = [by_problem[i % 3][i // 3] for i in range(12)]
  m, rows = reasoning.Solutions(columns * 4).metrics(prompts, texts, "reference_")
  assert m == {"reference_pass@1": (0.75 + 0.5) / 2, "reference_pass@4": 1.0,
               "reference_maj@4": 0.5, "reference_extraction_failure_rate": 1 / 8,
               "reference_format_rate": 1 / 8, "reference_unscorable_problems": 1,
               "reference_pass@1/difficulty_Level_1": 0.5}
  assert [(r["problem"], r["answer"], r["answers"], r["correct"], r["majority"]) for r in rows] == [
      ("p1", "72", ["72", "72", "72", None], [True, True, True, False], "72"),
      ("p2", "\\frac{2}{3}", ["1", "\\frac{4}{6}", "1", "\\frac{2}{3}"],
       [False, True, False, True], "1")]
  assert reasoning.pass_at_k(4, 2, 2) == 1 - 1 / 6 and rows[1]["maj@4"] == 0.0


def test_eval_samples_per_prompt_is_checked_and_keeps_the_reasoning_preset_samples():
  """k samples a prompt tile the prompts, so the reasoning preset's 128 problems x 4 are the 512
  prompts it sampled before the flag (the same rows, so the same keys and samples)."""
  with pytest.raises(ValueError, match="eval_samples_per_prompt"):
    configs.DEFAULT.replace(eval_samples_per_prompt=0)
  cfg = configs.REASONING
  k = cfg.eval.eval_samples_per_prompt
  assert (reasoning.eval_prompts(cfg.data.task_eval_prompts, cfg.data.task_difficulty) * k
          == reasoning.eval_prompts(512, cfg.data.task_difficulty))


def solution_reward(prompts, completions, completion_ids, solution, **kwargs):
  """A reward in TRL's convention that records what the GRPO stage hands it."""
  SEEN.append({"solution": list(solution), "ids": [len(c) for c in completion_ids],
               "extra": sorted(kwargs)})
  return [float(c[0]["content"].strip().endswith(s)) for c, s in zip(completions, solution)]


@pytest.mark.slow
def test_sft_on_gsm8k_solutions_then_grpo_reads_the_solution_column(tmp_path):
  """sft,grpo on a GSM8K file: SFT on its worked answers, GRPO's reward function gets each
  prompt's `solution` (its final answer) for each of its G completions, and the evaluation's
  held-out prompts theirs."""
  rows = [{"question": f"What is {a} plus {b}?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
          for a in range(8) for b in range(8)]
  path = _write_jsonl(tmp_path / "gsm8k.jsonl", rows)
  out = tmp_path / "run"
  import importlib
  importlib.import_module("tests.test_prompt_data").SEEN.clear()
  loop.run(configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
      train_data=path, eval_split=0.1, chat_template="chatml", max_prompt_length=80,
      max_target_length=24, global_batch_size=8, num_generations=4, sft_steps=4, grpo_steps=2,
      max_completion_length=6, log_every=1, eval_every=0, checkpoint_every=2,
      eval_max_new_tokens=6, task_eval_prompts=3, eval_samples_per_prompt=2, stage="sft,grpo",
      output_dir=str(out), reward_fn="tests.test_prompt_data:solution_reward"))
  answers = {str(a + b) for a in range(8) for b in range(8)}
  import importlib  # the run imported this file by its --reward_fn name, maybe as another module
  seen = importlib.import_module("tests.test_prompt_data").SEEN
  grpo_calls = [c for c in seen if len(c["solution"]) == 8]
  assert len(grpo_calls) >= 2
  for call in grpo_calls:  # 2 prompts x 4 completions, the prompts repeated per sample
    assert set(call["solution"]) <= answers and call["extra"] == ["answer"]
    assert call["solution"][:2] * 4 == call["solution"]
    assert all(0 < n <= 6 for n in call["ids"])
  with open(out / "metrics.jsonl") as f:
    steps = [json.loads(l) for l in f if '"stage": "grpo"' in l]
  assert len(steps) == 2 and all(math.isfinite(r["reward"]) for r in steps)
  summary = json.loads((out / "summary.json").read_text())
  assert summary["judge"].startswith("reward function tests.test_prompt_data:solution_reward")
  assert np.isfinite(summary["policy_reward"])
  # the held-out problems' pass@k and majority@k by their solutions, one answers line a problem
  assert summary["eval_prompts"] == 6 and 0 <= summary["pass@2"] <= 1
  assert {"pass@1", "maj@2", "reference_pass@1", "pass@1_gain"} <= set(summary)
  with open(out / "answers.jsonl") as f:
    lines = [json.loads(l) for l in f]
  assert len(lines) == 3 and {l["answer"] for l in lines} <= answers
  assert all(len(l["answers"]) == len(l["reference_answers"]) == 2 for l in lines)

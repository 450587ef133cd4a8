"""A model's answers to published benchmark questions, in the files outside judges read.

    python -m dpo.tools.generate --init_from=runs/default/checkpoints/policy \\
        --questions=alpaca_eval.json --answers=runs/default/model_outputs.json
    python -m dpo.tools.generate --config=llama3.2-1b --init_from=hf:models/Llama-3.2-1B-Instruct \\
        --questions=question.jsonl --answers=data/mt_bench/model_answer/llama-dpo.jsonl \\
        --model_id=llama-dpo --eval_temperature=0 --eval_max_new_tokens=1024

The question file's layout is detected:
  * AlpacaEval's instruction file (alpaca_eval.json): a JSON list of objects with `instruction`
    and `dataset` (other keys, e.g. a reference `output` and `generator`, are ignored). The
    answers are AlpacaEval's `model_outputs.json`: a JSON list in the same order, one
    `{"instruction", "output", "generator", "dataset"}` per instruction; `generator` is the
    model's name on the leaderboard (`--model_id`), `dataset` is copied from the question.
  * MT-Bench's question.jsonl (FastChat's llm_judge layout): one JSON object a line with
    `question_id`, `category`, `turns` (the user turns) and an optional `reference`. The answers
    are FastChat's answer JSONL: one `{"question_id", "answer_id", "model_id", "choices":
    [{"index": 0, "turns": [...]}], "tstamp"}` a line. Turns are answered in order: turn k's
    prompt is the conversation so far (each user turn and the model's own answer to it) as the
    chat template renders it. FastChat's judge names a model by its answer file's name
    (data/mt_bench/model_answer/<model_id>.jsonl).

The model is `--init_from` as the launcher takes it (a params checkpoint such as
runs/default/checkpoints/policy or sft_model, hf:DIR, or hf:ORG/NAME[@REVISION], a Hub model:
dpo/hub.py), with `--tokenizer` (default for hf:DIR: DIR itself) and `--chat_template`
(`chat.resolve_template`). Every config flag applies; sampling
reads the eval flags (`--eval_temperature`, `--eval_top_k`, `--eval_top_p`,
`--eval_max_new_tokens`, `--eval_batch_size` questions a batch), for every question alike (FastChat
picks a temperature per MT-Bench category instead). A prompt longer than `--max_prompt_length`
keeps its end (counted in the log). An answer is the decoded completion without its end-of-turn
or EOS token, stripped of surrounding whitespace as FastChat strips it.

Answers are written after every batch (the answer JSONL; for AlpacaEval a `.partial.jsonl`
sidecar, the JSON list once every instruction is answered), each file replaced whole and
atomically, so a killed run leaves only whole answers. A rerun with the same `--answers` skips
the questions answered there (by question_id; AlpacaEval by position and instruction) and logs
how many; with the same `--eval_batch_size` and `--seed` it writes what one uninterrupted run
writes (batches are fixed slices of the question file, each sampled with its own key). A file of
another model_id, or of other questions, is refused. Errors in files and flags are one line
(exit status 2). Single process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from typing import Any, NamedTuple, Sequence

import jax
from absl import app, flags
from absl import logging as absl_logging

from dpo import chat, checkpoint, cli, evaluate, hub, loop
from dpo import data as data_lib
from dpo import tokenizer as tokenizer_lib
from dpo.data import DataError
from dpo.formats import Message
from models import sharding

FLAGS = flags.FLAGS

EXPECTED = ("expected AlpacaEval's instruction file (a JSON list of objects with \"instruction\" "
            "and \"dataset\") or MT-Bench's question.jsonl (one JSON object a line with "
            "\"question_id\", \"category\" and \"turns\", a list of user turns)")


class Job(NamedTuple):
  """What to answer and where: the question file, the answers file, the model's name in it."""
  questions: str
  answers: str
  model_id: str = ""


class Question(NamedTuple):
  key: Any                # MT-Bench: question_id; AlpacaEval: position in the file
  turns: tuple[str, ...]  # the user turns, answered in order
  source: dict            # the record as read


class _NotThisLayout(Exception):
  """A file that does not hold a layout; its message says where it departs."""


def _write_atomic(path: str, text: str) -> None:
  """`text` at `path`, whole or not at all: written beside it, then renamed over it."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _jsonl(records: Sequence[dict]) -> str:
  return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def _read_jsonl(path: str) -> list[tuple[int, dict]]:
  """(line number, object) of each non-blank line; anything else is a DataError naming it."""
  out = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if line.strip():
        try:
          r = json.loads(line)
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(r, dict):
          raise DataError(f"{path}:{n}: not a JSON object")
        out.append((n, r))
  return out


def _check_model(path: str, where: str, found, model_id: str) -> None:
  if found != model_id:
    raise DataError(f"{path}: answers of model_id {found!r} ({where}), not {model_id!r}; give "
                    f"another --answers, or --model_id={found} to continue that file")


class AlpacaEval:
  """alpaca_eval.json in, model_outputs.json out (tatsu-lab/alpaca_eval: `alpaca_eval
  --model_outputs` reads `instruction` and `output`, and names the model by `generator`)."""

  name = "AlpacaEval"

  def parse(self, text: str) -> list[Question]:
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise _NotThisLayout(f"not one JSON document ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list) or not data:
      raise _NotThisLayout("not a non-empty JSON list")
    for i, r in enumerate(data):
      if not isinstance(r, dict):
        raise _NotThisLayout(f"record {i} is not an object")
      for k in ("instruction", "dataset"):
        if not isinstance(r.get(k), str):
          raise _NotThisLayout(f"record {i} has no string {k!r}")
    return [Question(i, (r["instruction"],), r) for i, r in enumerate(data)]

  @staticmethod
  def sidecar(path: str) -> str:
    return os.path.splitext(path)[0] + ".partial.jsonl"

  def read_done(self, path: str, questions: Sequence[Question], model_id: str) -> dict:
    """{position: output record} of the final list at `path` and its sidecar."""
    found: list[tuple[str, str, int, dict]] = []  # (file, where in it, position, record)
    if os.path.exists(path):
      try:
        with open(path, encoding="utf-8") as f:
          data = json.load(f)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}: not a JSON list of model outputs ({e.msg})") from None
      if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{path}: not a JSON list of model outputs")
      found += [(path, f"record {i}", i, r) for i, r in enumerate(data)]
    side = self.sidecar(path)
    if os.path.exists(side):
      for n, r in _read_jsonl(side):
        index = r.pop("index", None)
        if not isinstance(index, int):
          raise DataError(f"{side}:{n}: no integer 'index'")
        found.append((side, f"line {n}", index, r))
    done = {}
    for file, where, i, r in found:
      missing = [k for k in ("instruction", "output", "generator") if k not in r]
      if missing:
        raise DataError(f"{file}: {where} has no {missing[0]!r}; not a model output")
      _check_model(file, where, r["generator"], model_id)
      if not 0 <= i < len(questions) or r["instruction"] != questions[i].turns[0]:
        raise DataError(f"{file}: {where} answers another instruction than the question file's "
                        f"record {i}; give another --answers")
      done[i] = r
    return done

  def record(self, q: Question, answers: Sequence[str], model_id: str) -> dict:
    return {"instruction": q.turns[0], "output": answers[0], "generator": model_id,
            "dataset": q.source["dataset"]}

  def save(self, path: str, questions: Sequence[Question], done: dict) -> None:
    """The sidecar while questions are left, then the JSON list (and the sidecar removed)."""
    if len(done) < len(questions):
      _write_atomic(self.sidecar(path), _jsonl([{"index": q.key, **done[q.key]}
                                                for q in questions if q.key in done]))
      return
    _write_atomic(path, json.dumps([done[q.key] for q in questions], ensure_ascii=False,
                                   indent=2) + "\n")
    if os.path.exists(self.sidecar(path)):
      os.remove(self.sidecar(path))


class MTBench:
  """question.jsonl in, FastChat's answer JSONL out (lm-sys/FastChat fastchat/llm_judge:
  gen_model_answer.py writes it, common.py's load_model_answers reads it by question_id)."""

  name = "MT-Bench"

  def parse(self, text: str) -> list[Question]:
    out, seen = [], {}
    for n, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      try:
        r = json.loads(line)
      except json.JSONDecodeError:
        raise _NotThisLayout(f"line {n} is not JSON") from None
      if not isinstance(r, dict):
        raise _NotThisLayout(f"line {n} is not a JSON object")
      missing = [k for k in ("question_id", "category", "turns") if k not in r]
      if missing:
        raise _NotThisLayout(f"line {n} has no {missing[0]!r}")
      qid, turns = r["question_id"], r["turns"]
      if not isinstance(qid, (int, str)) or isinstance(qid, bool):
        raise _NotThisLayout(f"line {n}: question_id is not an integer or a string")
      if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
        raise _NotThisLayout(f"line {n}: 'turns' is not a non-empty list of strings")
      if qid in seen:
        raise DataError(f"line {n}: question_id {qid!r} repeats line {seen[qid]}")
      seen[qid] = n
      out.append(Question(qid, tuple(turns), r))
    if not out:
      raise _NotThisLayout("no JSON lines")
    return out

  def read_done(self, path: str, questions: Sequence[Question], model_id: str) -> dict:
    """{question_id: answer record} of the answer file at `path`."""
    if not os.path.exists(path):
      return {}
    by_id = {q.key: q for q in questions}
    done, lines = {}, {}
    for n, r in _read_jsonl(path):
      where = f"{path}:{n}"
      missing = [k for k in ("question_id", "model_id", "choices") if k not in r]
      if missing:
        raise DataError(f"{where}: no {missing[0]!r}; not a FastChat answer")
      _check_model(path, f"line {n}", r["model_id"], model_id)
      qid = r["question_id"]
      try:
        turns = r["choices"][0]["turns"]
      except (KeyError, IndexError, TypeError):
        raise DataError(f"{where}: no choices[0].turns; not a FastChat answer") from None
      if qid not in by_id:
        raise DataError(f"{where}: question_id {qid!r} is not in the question file; give "
                        f"another --answers")
      if len(turns) != len(by_id[qid].turns):
        raise DataError(f"{where}: {len(turns)} answer turns for the {len(by_id[qid].turns)} "
                        f"turns of question_id {qid!r}")
      if qid in done:
        raise DataError(f"{where}: question_id {qid!r} answered again (line {lines[qid]})")
      done[qid], lines[qid] = r, n
    return done

  def record(self, q: Question, answers: Sequence[str], model_id: str) -> dict:
    answer_id = hashlib.sha256(json.dumps([model_id, q.key]).encode()).hexdigest()[:22]
    return {"question_id": q.key, "answer_id": answer_id, "model_id": model_id,
            "choices": [{"index": 0, "turns": list(answers)}], "tstamp": time.time()}

  def save(self, path: str, questions: Sequence[Question], done: dict) -> None:
    _write_atomic(path, _jsonl([done[q.key] for q in questions if q.key in done]))


LAYOUTS = {"[": AlpacaEval(), "{": MTBench()}  # by the file's first character


def read_questions(path: str) -> tuple[AlpacaEval | MTBench, list[Question]]:
  """(layout, questions) of a question file; a file in neither layout is a DataError."""
  if not os.path.exists(path):
    raise DataError(f"--questions={path}: no such file")
  if os.path.isdir(path):
    raise DataError(f"--questions={path}: is a directory; {EXPECTED}")
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError:
    raise DataError(f"{path}: not UTF-8 text; {EXPECTED}") from None
  layout = LAYOUTS.get(text.lstrip()[:1])
  if layout is None:
    raise DataError(f"{path}: neither a JSON list nor JSON lines; {EXPECTED}")
  try:
    return layout, layout.parse(text)
  except _NotThisLayout as e:
    raise DataError(f"{path}: not {layout.name}'s layout ({e}); {EXPECTED}") from None
  except DataError as e:
    raise DataError(f"{path}: {e}") from None


def default_model_id(init_from: str) -> str:
  """The model's name from its path: runs/NAME/checkpoints/policy -> NAME-policy, hf:DIR -> DIR's
  folder name (hf:ORG/NAME, a Hub model: NAME)."""
  path = os.path.abspath(init_from.removeprefix("hf:"))
  parent, name = os.path.split(path)
  if os.path.basename(parent) == "checkpoints":
    return f"{os.path.basename(os.path.dirname(parent))}-{name}"
  return name


class Generator:
  """A model answering conversations: each prompt rendered by the chat template and encoded as
  the project encodes rendered prompts, sampled with the eval settings (`evaluate.sample`)."""

  def __init__(self, cfg, mesh, tok, template: chat.Template, params):
    self.cfg, self.mesh, self.tok, self.template, self.params = cfg, mesh, tok, template, params
    self.stop_ids = tuple(chat.end_of_turn_ids(template, tok))
    self.scfg = evaluate.sampling_config(cfg, tok, self.stop_ids)
    self.stats = data_lib.TruncationStats()

  def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
    """BOS where the template's rendering has it (`chat.py`: a hand-written template's text
    leaves BOS to the tokenizer; a Jinja template's says itself), then the rendered prompt."""
    t = self.template
    if isinstance(t, chat.JinjaTemplate):
      text = t.strip_bos(t.render(messages, add_generation_prompt=True))
      add_bos = t.emits_bos
    else:
      text, add_bos = chat.render_prompt(t, messages), True
    self.stats.examples += 1
    return data_lib.encode_prompt(self.tok, text, self.cfg.data.max_prompt_length, self.stats,
                                  add_bos)

  def complete(self, prompts: Sequence[Sequence[int]], key: jax.Array) -> list[list[int]]:
    """One completion per prompt (token ids, the stop token kept if emitted)."""
    return evaluate.sample(self.cfg, self.mesh, self.scfg, evaluate.Weights(self.params),
                           prompts, key)

  def finished(self, completion: Sequence[int]) -> bool:
    """Whether the completion ended at EOS or an end-of-turn id (not at the token limit)."""
    return bool(completion) and completion[-1] in (self.scfg.eos_id, *self.stop_ids)

  def text(self, completion: Sequence[int]) -> str:
    """The answer: decoded without its stop token, surrounding whitespace stripped."""
    ids = list(completion)[:-1] if self.finished(completion) else list(completion)
    return self.tok.decode(ids).strip()


def answer_batch(gen: Generator, questions: Sequence[Question], key: jax.Array):
  """(answers [question][turn], tokens sampled, completions without a stop token) of one batch:
  turn k of every question that has it in one sampling call, after turn k - 1's answers."""
  answers: list[list[str]] = [[] for _ in questions]
  tokens = unfinished = 0
  for turn in range(max(len(q.turns) for q in questions)):
    rows = [i for i, q in enumerate(questions) if len(q.turns) > turn]
    prompts = []
    for i in rows:
      messages = []
      for k in range(turn):
        messages += [Message("user", questions[i].turns[k]), Message("assistant", answers[i][k])]
      try:
        prompts.append(gen.prompt_ids(messages + [Message("user", questions[i].turns[turn])]))
      except ValueError as e:  # a template that refuses the conversation
        raise DataError(f"question {questions[i].key!r}, turn {turn + 1}: {e}") from None
    comps = gen.complete(prompts, jax.random.fold_in(key, turn))
    for i, c in zip(rows, comps):
      answers[i].append(gen.text(c))
      tokens += len(c)
      unfinished += not gen.finished(c)
  return answers, tokens, unfinished


def load_model(cfg, mesh):
  """(config, tokenizer, chat template, params) as the launcher resolves --init_from,
  --tokenizer and --chat_template; the tokenizer of hf:DIR defaults to DIR."""
  src = cfg.checkpoint.init_from
  checkpoint.check_model_source("init_from", src)
  if src.startswith("hf:") and not cfg.data.tokenizer:
    folder = src.removeprefix("hf:")
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
      raise ValueError(f"--init_from={src}: no tokenizer.json in {folder}; give --tokenizer")
    cfg = cfg.replace(tokenizer=folder)
  d = cfg.data
  tok = tokenizer_lib.load_tokenizer(d.tokenizer, d.bos_token, d.eos_token, d.pad_token)
  template = chat.resolve_template(d.chat_template, tok)
  cfg, params = loop.initial_params(cfg, jax.random.key(cfg.run.seed), mesh)
  if cfg.model.vocab_size < tok.vocab_size:
    raise ValueError(f"--init_from={src}: vocab_size={cfg.model.vocab_size} is smaller than the "
                     f"tokenizer's {tok.vocab_size} ids")
  return cfg, tok, template, params


def run(cfg, job: Job, mesh=None) -> dict:
  """Answers every question of `job.questions` not yet in `job.answers`; returns the counts.
  Every file is checked before the model loads."""
  if not cfg.checkpoint.init_from:
    raise ValueError("--init_from: which model answers? a params checkpoint (e.g. "
                     "runs/default/checkpoints/policy), hf:DIR or hf:ORG/NAME")
  layout, questions = read_questions(job.questions)
  model_id = job.model_id or default_model_id(cfg.checkpoint.init_from)
  cfg = hub.resolve(cfg)  # a Hub name -> its snapshot folder, after the id is taken from it
  done = layout.read_done(job.answers, questions, model_id)
  skipped = sum(q.key in done for q in questions)
  logging.info("%s: %d %s questions; %s: skipped %d already answered by %s", job.questions,
               len(questions), layout.name, job.answers, skipped, model_id)
  if isinstance(layout, MTBench) and os.path.basename(job.answers) != f"{model_id}.jsonl":
    logging.info("FastChat's judge names a model by its answer file: <model_answer dir>/%s.jsonl",
                 model_id)
  mesh = mesh or sharding.make_mesh(cfg.mesh.mesh)
  cfg, tok, template, params = load_model(cfg, mesh)
  gen = Generator(cfg, mesh, tok, template, params)
  key = jax.random.fold_in(jax.random.key(cfg.run.seed), 17)
  bs = cfg.eval.eval_batch_size
  batches = -(-len(questions) // bs)
  total = {"answered": 0, "tokens": 0, "unfinished": 0}
  for b in range(batches):
    todo = [q for q in questions[b * bs:(b + 1) * bs] if q.key not in done]
    if not todo:
      continue
    t = time.perf_counter()
    try:
      answers, tokens, unfinished = answer_batch(gen, todo, jax.random.fold_in(key, b))
    except DataError as e:
      raise DataError(f"{job.questions}: {e}") from None
    for q, a in zip(todo, answers):
      done[q.key] = layout.record(q, a, model_id)
    layout.save(job.answers, questions, done)
    seconds = time.perf_counter() - t
    for k, v in (("answered", len(todo)), ("tokens", tokens), ("unfinished", unfinished)):
      total[k] += v
    logging.info("batch %d/%d: %d/%d answered, %d tokens in %.1fs (%.0f tokens/s)", b + 1,
                 batches, len(done), len(questions), tokens, seconds, tokens / max(seconds, 1e-9))
  layout.save(job.answers, questions, done)  # the final list even when nothing was left to answer
  gen.stats.report(job.questions)
  if total["unfinished"]:
    logging.warning("%d answer turns reached --eval_max_new_tokens=%d without an end of turn",
                    total["unfinished"], gen.scfg.max_new_tokens)
  logging.info("%s: %d answers of %s (%d new, %d skipped)", job.answers, len(done), model_id,
               total["answered"], skipped)
  return {"layout": layout.name, "model_id": model_id, "questions": len(questions),
          "skipped": skipped, **total}


def main(argv) -> None:
  del argv
  absl_logging.set_verbosity(absl_logging.INFO)
  try:
    run(cli.from_flags(), Job(FLAGS.questions, FLAGS.answers, FLAGS.model_id))
  except ValueError as e:  # DataError, CheckpointError, a bad flag value: one line
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  cli.define_flags()
  flags.DEFINE_string("questions", None, "AlpacaEval's alpaca_eval.json or MT-Bench's "
                      "question.jsonl (the layout is detected).")
  flags.DEFINE_string("answers", None, "model_outputs.json (AlpacaEval) or the answer JSONL "
                      "(MT-Bench); a rerun continues it.")
  flags.DEFINE_string("model_id", "", "The model's name in the answers (AlpacaEval's generator, "
                      "FastChat's model_id); default: from --init_from, e.g. "
                      "runs/NAME/checkpoints/policy -> NAME-policy.")
  flags.mark_flags_as_required(["questions", "answers"])
  app.run(main)

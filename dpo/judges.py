"""Judges: what scores a response on any data, so that a run can say whether it aligned.

A judge maps (prompt, response) records to one number each, higher meaning better:
  * `FunctionJudge` (--reward_fn=module:function): a Python function of the prompt and the
    response, for rule-based or verifiable rewards. The prompt is the prompt text, or for
    conversational data the conversation as a list of {"role", "content"} dicts (as TRL passes
    conversational prompts to its reward functions); the response is the text. The embedded
    task's true reward is one (`dpo.task:reward`), the default on that task.
  * `RewardFunctions` (--reward_fn=a:f,b:g with --reward_weights): several functions as one
    judge, the weighted sum of their rewards (TRL GRPOTrainer's reward_funcs/reward_weights);
    GRPO also logs each function's rewards.
  * `RewardModelJudge` (--judge=): a reward model (dpo/reward_model.py's scalar head on the
    transformer): `hf:DIR`, a transformers `*ForSequenceClassification` folder with one label
    and its tokenizer; a reward-model checkpoint (checkpoints/rm_model of an rm stage), which
    reads text with the tokenizer and chat template it was trained with, the run's; or `rm`,
    the one this run's rm stage trained. Each record is rendered the judge's way (its own chat
    template for conversations, else the prompt text and the response) and tokenised as its
    training pairs were, and the reward read at the last token.

`load(cfg, mesh, run_tok, run_template)` builds the judge the flags name (None: no judge).
Every judge input that cannot work is a `JudgeError`, one line naming the flag and the file; a
reward function that raises, or returns what is not a finite number, is one line naming the
function, the record (its index and the prompt's first characters) and the value, and
`rehearse` finds it on a few records of the data before any compile or sampling.
`fingerprint(cfg)` is what the judge is, by content and without its path (a reward-model
checkpoint's manifest digest, a transformers folder's weights and tokenizer, a function's
source file), for the fingerprint of a stage its labels train (dpo/identity.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import importlib
import inspect
import math
import numbers
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dpo import chat, checkpoint, formats, registry, reward_model, rewards, task, train
from dpo import data as data_lib
from dpo import tokenizer as tokenizer_lib
from dpo.batches import Rows
from dpo.formats import ChatRecord, Message, Record
from dpo.data import PreferenceRecord


class JudgeError(ValueError):
  """A judge that cannot be built or cannot score, named with its flag."""


def _short(value, limit: int = 60, repr_: bool = True) -> str:
  """`value` (its repr) cut to `limit` characters, for a one-line message."""
  text = repr(value) if repr_ else " ".join(str(value).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def records_of(prompt, responses: Sequence[str]) -> list[Record]:
  """One record per response to `prompt` (text, or a conversation of Messages), the response
  as both sides (a judge scores the chosen side)."""
  if isinstance(prompt, str):
    return [PreferenceRecord(prompt, r, r) for r in responses]
  return [ChatRecord(tuple(prompt), (Message("assistant", r),), (Message("assistant", r),))
          for r in responses]


class FunctionJudge:
  """--reward_fn=module:function, or a name of dpo/rewards.py's (TRL's reward functions). A
  function of (prompt, response) is called once a record; a function with a `completions`
  parameter (TRL's convention, as dpo/rewards.py's) once a batch, with the keywords `prompts`,
  `completions` (text, or for a conversation's prompt its one assistant message as a list of one
  {"role", "content"} dict), `completion_ids` (the completions' token ids) and the data's extra
  columns (e.g. `solution`), returning one reward or None per completion."""

  def __init__(self, spec: str, flag: str = "--reward_fn", completion_length: int | None = None):
    self.name, self.flag, self.tok = spec, flag, None
    if rewards.is_named(spec):
      try:
        self.fn = rewards.build(spec, completion_length)
      except rewards.RewardSpecError as e:
        raise JudgeError(f"{flag}={spec}: {str(e).removeprefix(spec + ': ')}") from None
      self.batch = True
      return
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
      raise JudgeError(f"{flag}={spec}: give module:function (e.g. dpo.task:reward) or a reward "
                       f"function's name ({', '.join(rewards.PARAMETERS)})")
    try:
      mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 (whatever the import raises, it is this flag's)
      raise JudgeError(f"{flag}={spec}: cannot import {module!r} "
                       f"({type(e).__name__}: {e})") from None
    if not hasattr(mod, attr):
      raise JudgeError(f"{flag}={spec}: module {module!r} has no function {attr!r}")
    fn = getattr(mod, attr)
    if not callable(fn):
      raise JudgeError(f"{flag}={spec}: {module}.{attr} is {_short(fn)} "
                       f"({type(fn).__name__}), not a function of (prompt, response)")
    self.fn: Callable[..., Any] = fn
    self.batch = "completions" in _parameters(fn)

  @classmethod
  def wrap(cls, fn: Callable[[Any, str], Any], name: str = "") -> "FunctionJudge":
    """A judge of a function in hand (a tool's or a test's), named `name`."""
    judge = cls.__new__(cls)
    judge.name, judge.flag, judge.fn = name or getattr(fn, "__name__", "function"), "judge", fn
    judge.tok, judge.batch = None, "completions" in _parameters(fn)
    return judge

  def score(self, records: Sequence[Record], allow_none: bool = False,
            what: str = "record", ids: Sequence[Sequence[int]] | None = None,
            columns: Sequence[dict] | None = None) -> np.ndarray:
    """[N] float64: the function of each record's prompt and chosen response; with
    `allow_none`, a None is NaN (TRL's "this function does not apply to this completion").
    A batch function also reads `ids`, the responses' token ids (None: the responses tokenised
    by the judge's tokenizer, the EOS appended as a sample that ended has it), and `columns`,
    each record's extra data columns.
    An exception or a value that is not a finite number is a JudgeError naming the function,
    `what` and the record's index, its prompt's first characters and the value."""
    prompts = [rec.prompt if isinstance(rec.prompt, str) else
               [{"role": m.role, "content": m.content} for m in rec.prompt] for rec in records]
    texts = [formats.response_text(rec.chosen) for rec in records]
    if self.batch:
      values = self._batch(prompts, texts, what, ids, columns)
    else:
      values = []
      for i, (prompt, text) in enumerate(zip(prompts, texts)):
        try:
          values.append(self.fn(prompt, text))
        except Exception as e:  # noqa: BLE001 (whatever the user's function raises is its own)
          raise JudgeError(f"{self.flag}={self.name}: raised {type(e).__name__}: "
                           f"{_short(str(e), 120, repr_=False)} on {what} {i} (prompt "
                           f"{_short(prompt)})") from None
    out = np.empty(len(records), np.float64)
    for i, value in enumerate(values):
      if value is None and allow_none:
        out[i] = np.nan
        continue
      if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or (
          not math.isfinite(float(value))):
        raise JudgeError(f"{self.flag}={self.name}: returned {_short(value)} "
                         f"({type(value).__name__}) for {what} {i} (prompt "
                         f"{_short(prompts[i])}); a reward function returns a "
                         f"finite number{' or None' if allow_none else ''}")
      out[i] = float(value)
    return out

  def _batch(self, prompts, texts, what, ids, columns) -> list:
    """A batch function's rewards (TRL's calling convention), one per record."""
    n = len(texts)
    if not n:
      return []
    where = (f"{what} 0 (prompt {_short(prompts[0])})" if n == 1 else
             f"the {n} {what}s (first prompt {_short(prompts[0])})")
    params = _parameters(self.fn)
    if ids is None and "completion_ids" in params:
      if self.tok is None:
        raise JudgeError(f"{self.flag}={self.name}: needs the completions' token ids, not "
                         f"given for {where}")
      # as sampled ids end: with the EOS (these responses are whole)
      eos = [] if getattr(self.tok, "eos_id", None) is None else [self.tok.eos_id]
      ids = [self.tok.encode(t) + eos for t in texts]
    given = {}
    for row in columns or ():
      for key in row:
        given.setdefault(key, [])
    for key in given:
      given[key] = [row.get(key) for row in columns]
    needed = [k for k, v in params.items() if v and k not in ("prompts", "completions",
                                                              "completion_ids")]
    missing = [k for k in needed if k not in given]
    if missing:
      have = ", ".join(sorted(given)) or "none"
      raise JudgeError(f"{self.flag}={self.name}: needs the data's {missing[0]!r} column, "
                       f"missing from {where} (extra columns: {have})")
    completions = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                   for p, t in zip(prompts, texts)]
    try:
      values = self.fn(prompts=prompts, completions=completions,
                       completion_ids=None if ids is None else [list(x) for x in ids], **given)
    except Exception as e:  # noqa: BLE001 (whatever the function raises is its own)
      raise JudgeError(f"{self.flag}={self.name}: raised {type(e).__name__}: "
                       f"{_short(str(e), 120, repr_=False)} on {where}") from None
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != n:
      raise JudgeError(f"{self.flag}={self.name}: returned {_short(values)} for {where}; a "
                       f"function of `completions` returns one reward per completion ({n})")
    return list(values)


def _parameters(fn) -> dict[str, bool]:
  """{name: required} of `fn`'s named parameters (none for a callable without a signature)."""
  try:
    sig = inspect.signature(fn, follow_wrapped=False)
  except (TypeError, ValueError):
    return {}
  return {k: p.default is inspect.Parameter.empty for k, p in sig.parameters.items()
          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class RewardFunctions:
  """--reward_fn=a:f,b:g (several functions) with --reward_weights (TRL GRPOTrainer's
  reward_funcs and reward_weights): one judge whose reward is the weighted sum of the functions'
  rewards. A function may return None for a completion it does not apply to (NaN, counted as 0 in
  the sum, as TRL's nansum); a completion every function left None is unscorable (NaN: GRPO gives
  it advantage 0; the win rate and online DPO, which need a number, refuse it)."""

  def __init__(self, specs: Sequence[str], weights: Sequence[float] = (),
               flag: str = "--reward_fn", completion_length: int | None = None):
    self.flag, self.name = flag, ",".join(specs)
    twice = sorted({s for s in specs if list(specs).count(s) > 1})
    if twice:  # the same function twice would log two columns under one name
      raise JudgeError(f"{flag}={self.name}: {', '.join(twice)} named more than once; weight one "
                       f"function with --reward_weights instead")
    self.functions = [FunctionJudge(s, flag, completion_length) for s in specs]
    if weights and len(weights) != len(specs):
      raise JudgeError(f"--reward_weights={','.join(map(str, weights))}: give one weight per "
                       f"{flag} function ({len(specs)}: {self.name}), not {len(weights)}")
    self.weights = tuple(float(w) for w in weights) or (1.0,) * len(specs)
    # TRL logs a function by its name
    short = [s.partition("(")[0] if rewards.is_named(s) else s.partition(":")[2] for s in specs]
    self.names = short if len(set(short)) == len(short) else list(specs)

  @property
  def tok(self):
    return self.functions[0].tok

  @tok.setter
  def tok(self, tok):
    for f in self.functions:
      f.tok = tok

  def each(self, records: Sequence[Record], what: str = "record", ids=None,
           columns=None) -> np.ndarray:
    """[N, F] float64: each function's reward of each record (NaN where it returned None)."""
    return np.stack([f.score(records, allow_none=True, what=what, ids=ids, columns=columns)
                     for f in self.functions], axis=-1)

  def combined(self, rewards_NF: np.ndarray) -> np.ndarray:
    """[N] the weighted sum (policy_gradient.weighted_rewards: TRL's nansum; NaN unscorable)."""
    from dpo import policy_gradient as pg
    return np.asarray(pg.weighted_rewards(np.asarray(rewards_NF, np.float32), self.weights),
                      np.float64)

  def score(self, records: Sequence[Record], ids=None, columns=None) -> np.ndarray:
    """[N] float64: the weighted sum; a record no function scored is a JudgeError."""
    total = self.combined(self.each(records, ids=ids, columns=columns))
    bad = np.flatnonzero(np.isnan(total))
    if bad.size:
      raise JudgeError(f"{self.flag}={self.name}: every function returned None for record "
                       f"{bad[0]} ({bad.size} of {len(total)}); this judge must give each a "
                       f"number")
    return total


def specs(cfg) -> list[str]:
  """The functions --reward_fn names, comma-separated ([] = none; a comma inside a name's
  parameters is the name's)."""
  return rewards.split(cfg.eval.reward_fn)


def completion_length(cfg) -> int:
  """What dpo/rewards.py's length parameters default to: the first sampling stage's completion
  length (registry.Algorithm.completion_length), or the evaluation sampler's."""
  for algorithm in registry.recipe(cfg.run.stages):  # the first stage that samples
    if algorithm.completion_length is not None:
      return algorithm.completion_length(cfg)
  return cfg.eval.eval_max_new_tokens or cfg.data.max_target_length


@dataclasses.dataclass
class RewardModelJudge:
  """A reward model's params ({transformer..., "score"}) with the tokenizer and chat template
  it reads text with; scores in batches of `batch_size` rows on `mesh`."""
  name: str
  model: Any           # models.config.ModelConfig
  params: Any
  tok: Any
  template: Any
  mesh: Any
  batch_size: int
  max_prompt_length: int
  max_target_length: int
  digest: str = ""     # its content (`fingerprint`), named in the metrics beside `name`

  def rows(self, records: Sequence[Record]) -> dict[str, np.ndarray]:
    """[N, T] arrays of the records' chosen sides, rendered, fitted and tokenised as the judge's
    own training pairs were (dpo.prepare): a conversation by its chat template (BOS where the
    template writes one, no EOS added; earlier turns dropped whole to fit
    --max_prompt_length), a text record as prompt + response + EOS."""
    parts = []
    for is_chat in (False, True):
      idx = [i for i, r in enumerate(records) if isinstance(r, ChatRecord) == is_chat]
      if not idx:
        continue
      where = [f"{self.name} record {i}" for i in idx]
      rendered = [chat.render_record(records[i], self.template, w) for i, w in zip(idx, where)]
      # After a rendering: a template learns whether it writes a BOS by rendering.
      marks = ({"ends": data_lib.Ends(bos=self.template.emits_bos, eos=False)}
               if is_chat and isinstance(self.template, chat.JinjaTemplate)
               and self.template.emits_bos is not None else {})
      # A conversation over --max_prompt_length loses whole earlier turns, as the judge's own
      # training pairs did (dpo.prepare), never the start of a turn and its role header.
      budget = data_lib.PromptBudget(self.tok, self.max_prompt_length,
                                     marks.get("ends", data_lib.Ends()).bos)
      rendered = [chat.fit_record(records[i], text, self.template, budget, w)[0]
                  for i, text, w in zip(idx, rendered, where)]
      pairs = data_lib.tokenize_pairs(rendered, self.tok, self.max_prompt_length,
                                      self.max_target_length, what=f"judge {self.name}",
                                      **marks)
      parts.append((idx, {k: v[:, 0] for k, v in pairs.items()}))
    T = max(a["tokens"].shape[1] for _, a in parts)
    out = {k: np.zeros((len(records), T), v.dtype) for k, v in parts[0][1].items()}
    out["tokens"][:] = self.tok.pad_id
    for idx, arrays in parts:
      for k, v in arrays.items():
        out[k][idx, :v.shape[1]] = v
    return out

  def score(self, records: Sequence[Record]) -> np.ndarray:
    """[N] float64 rewards of the records' chosen sides."""
    if not records:
      return np.zeros(0)
    fn = _score_fn(self.model, self.mesh)
    (r,) = train.in_batches(self.mesh, lambda b: fn(self.params, b),
                               Rows.of(self.rows(records)), self.batch_size)
    return np.asarray(r, np.float64)


_SCORE_FNS: dict = {}


def _score_fn(model, mesh):
  key = (model, id(mesh))
  if key not in _SCORE_FNS:
    _SCORE_FNS[key] = jax.jit(
        lambda p, rows: reward_model.sequence_rewards(model, p, p["score"], rows),
                              out_shardings=NamedSharding(mesh, P()))
  return _SCORE_FNS[key]


Judge = FunctionJudge | RewardFunctions | RewardModelJudge


def _check_hf_folder(path: str) -> None:
  """A folder this process may not read is one line naming it, never taken for a missing file."""
  from models import hf
  flag = f"--judge=hf:{path}"
  try:
    has = {name: checkpoint.is_file(os.path.join(path, name), path)
           for name in ("config.json", "tokenizer.json")}
  except checkpoint.Unreadable as e:
    raise JudgeError(f"{flag}: {str(e).removeprefix(path + ': ')}") from None
  if not has["config.json"]:
    raise JudgeError(f"{flag}: {path} has no config.json (a transformers "
                     f"*ForSequenceClassification folder)")
  if not hf.is_reward_model(path):
    raise JudgeError(f"{flag}: config.json names no *ForSequenceClassification; a judge is a "
                     f"reward model (one label, score.weight)")
  if not has["tokenizer.json"]:
    raise JudgeError(f"{flag}: {path} has no tokenizer (tokenizer.json); a judge reads text "
                     f"with its own tokenizer")


def _hf_judge(cfg, mesh, path: str) -> RewardModelJudge:
  from models import hf
  flag = f"--judge=hf:{path}"
  _check_hf_folder(path)
  tok = tokenizer_lib.HFTokenizer(path)
  if tok.pad_id is None or tok.eos_id is None:
    raise JudgeError(f"{flag}: the tokenizer in {path} names no EOS/PAD token")
  try:
    model, params = hf.load(path, mesh, dataclasses.replace(cfg.model), reward=True)
  except hf.HFError as e:
    raise JudgeError(f"{flag}: {e}") from None
  template = chat.resolve_template("auto", tok)
  return RewardModelJudge(f"hf:{path}", model, params, tok, template, mesh,
                          cfg.eval.eval_batch_size, cfg.data.max_prompt_length,
                          cfg.data.max_target_length, _hf_digest(flag, path))


def _checkpoint_meta(flag: str, path: str) -> dict:
  try:
    meta = checkpoint.read_meta(path)
  except (OSError, checkpoint.CheckpointError, ValueError) as e:
    raise JudgeError(f"{flag}: {path} is not a readable reward-model checkpoint ({e})") from None
  if registry.judge_stage(meta.get("stage", "")) is None or "model" not in meta:
    raise JudgeError(f"{flag}: {path} is a {meta.get('stage')!r} checkpoint, not a reward "
                     f"model (checkpoints/rm_model of an rm stage)")
  return meta


def _checkpoint_judge(cfg, mesh, path: str, run_tok, run_template) -> RewardModelJudge:
  """The reward-model checkpoint at `path`, named as --judge names it (`rm`: the run's own)."""
  from models.config import ModelConfig
  flag = f"--judge={cfg.eval.judge}"
  meta = _checkpoint_meta(flag, path)
  reads = meta.get("reads") or {}
  want = {"tokenizer": run_tok.fingerprint(),
          "chat_template": chat.template_fingerprint(run_template)}
  if reads != want:
    raise JudgeError(f"{flag}: {path} reads text with another tokenizer or chat template than "
                     f"this run ({reads or 'not recorded'} vs {want}); export it with "
                     f"--export_rm_hf and give --judge=hf:DIR, which carries its own")
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  model = ModelConfig(**{k: v for k, v in meta["model"].items() if k in fields})
  model = dataclasses.replace(model, **{k: tuple(v) for k, v in dataclasses.asdict(model).items()
                                        if isinstance(v, list)})
  params = reward_model.load(path, model, mesh)
  return RewardModelJudge(cfg.eval.judge, model, params, run_tok, run_template, mesh,
                          cfg.eval.eval_batch_size, cfg.data.max_prompt_length,
                          cfg.data.max_target_length, _checkpoint_digest(flag, path))


def source(cfg) -> str:
  """What --judge / --reward_fn name, as the judge's name in the metrics ("" = none)."""
  if cfg.eval.judge:
    return cfg.eval.judge
  if cfg.eval.reward_fn:
    return f"reward_fn:{cfg.eval.reward_fn}"
  return f"reward_fn:{task.embedded(cfg.data).reward_fn}" if not cfg.data.train_data else ""


def _functions(cfg) -> FunctionJudge | RewardFunctions | None:
  """--reward_fn's judge, imported: one function, several as RewardFunctions, None without."""
  names, length = specs(cfg), completion_length(cfg)
  if len(names) > 1:
    return RewardFunctions(names, cfg.grpo.reward_weights, completion_length=length)
  return FunctionJudge(names[0], completion_length=length) if names else None


def check(cfg) -> None:
  """What can be checked before any work: --reward_fn imports, --judge names a reward-model
  checkpoint or a folder with a sequence classifier and its tokenizer (`rm` is checked when the
  rm stage has run)."""
  e = cfg.eval
  _functions(cfg)
  if e.judge.startswith("hf:"):
    _check_hf_folder(e.judge[3:])
  elif e.judge and registry.judge_stage(e.judge) is None:
    if not os.path.isdir(e.judge):
      raise JudgeError(f"--judge={e.judge}: no such directory (give a reward-model checkpoint, "
                       f"hf:DIR or rm)")
    _checkpoint_meta(f"--judge={e.judge}", e.judge)


def _rm_path(cfg) -> str:
  """--judge=NAME of a stage that trains a reward model (`rm`): the model it saves,
  checkpoints/NAME_model (registry.Algorithm.scores)."""
  return os.path.join(cfg.run.output_dir, "checkpoints", f"{cfg.eval.judge}_model")


def load(cfg, mesh, run_tok, run_template) -> Judge | None:
  """The judge --judge or --reward_fn names; on the embedded task without either, its true
  reward; else None."""
  e = cfg.eval
  if registry.judge_stage(e.judge) is not None:
    path = _rm_path(cfg)
    if not os.path.isdir(path):
      raise JudgeError(f"--judge={e.judge}: {path} does not exist; --judge={e.judge} is the "
                       f"reward model an {e.judge} stage earlier in --stage trains")
    return _checkpoint_judge(cfg, mesh, path, run_tok, run_template)
  if e.judge.startswith("hf:"):
    return _hf_judge(cfg, mesh, e.judge[3:])
  if e.judge:
    check(cfg)
    return _checkpoint_judge(cfg, mesh, e.judge, run_tok, run_template)
  judge = None
  if e.reward_fn:
    judge = _functions(cfg)
  elif not cfg.data.train_data:
    judge = FunctionJudge(task.embedded(cfg.data).reward_fn, "the embedded task's reward")
  if judge is not None:
    judge.tok = run_tok  # completion_ids of texts the caller has no ids for
  return judge


def describe(judge: Judge | None) -> str:
  """The judge in words, as the metrics and the summary name it: the same for two equal runs
  in two folders (`--judge=rm` is "rm" and its content digest, never the run's path)."""
  if judge is None:
    return "none"
  if isinstance(judge, RewardFunctions):
    return f"reward functions {judge.name} weighted {','.join(map(str, judge.weights))}"
  if isinstance(judge, RewardModelJudge):
    return f"reward model {judge.name}" + (f" (sha256 {judge.digest[:16]})" if judge.digest
                                           else "")
  return f"reward function {judge.name}"


# --- what a judge is, for a stage's fingerprint --------------------------------------------------

# What a transformers judge folder reads: its config, weights and tokenizer.
_HF_FILES = ("config.json", "*.safetensors", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja")


def _hf_digest(flag: str, path: str) -> str:
  """sha256 over the names and contents of the folder's `_HF_FILES` (listed so that a folder
  this process may not read is an error, not a digest of nothing)."""
  h = hashlib.sha256()
  try:
    names = sorted(n for n in checkpoint.listdir(path) if not n.startswith(".") and
                   any(fnmatch.fnmatchcase(n, p) for p in _HF_FILES))  # what glob matches
    for name in names:
      h.update(f"{name}:{data_lib.file_sha256(os.path.join(path, name))}\n".encode())
  except (data_lib.DataError, checkpoint.Unreadable) as e:  # one line naming the file, whole
    raise JudgeError(f"{flag}: {str(e).removeprefix(path + ': ')}") from None
  except OSError as e:
    raise JudgeError(f"{flag}: {_short(str(e), 200, repr_=False)}") from None
  return h.hexdigest()


def _checkpoint_digest(flag: str, path: str) -> str:
  """A reward-model checkpoint's content: its manifest's checksums (checkpoint.digest)."""
  try:
    return checkpoint.digest(path)
  except (OSError, checkpoint.CheckpointError) as e:
    raise JudgeError(f"{flag}: {path} is not a readable reward-model checkpoint "
                     f"({str(e).removeprefix(path + ': ')})") from None


def _source(judge: FunctionJudge) -> str:
  """A reward function by the source file that defines it: its sha256, or "library source" for
  one of this library's files (those are the fingerprint's `code`, whose change is logged)."""
  from dpo import identity
  fn = inspect.unwrap(judge.fn)  # a named function's (dpo/rewards.py) own
  try:
    f = inspect.getsourcefile(fn) or inspect.getsourcefile(inspect.getmodule(fn))
  except TypeError:  # a builtin, or a callable object without a source file
    f = None
  if f is None:
    return "no source file"
  if os.path.relpath(os.path.abspath(f), identity.ROOT) in identity.source_digests():
    return "library source"
  try:
    return f"source sha256 {data_lib.file_sha256(f)[:16]}"
  except (OSError, data_lib.DataError) as e:
    raise JudgeError(f"{judge.flag}={judge.name}: {_short(str(e), 200, repr_=False)}") from None


def fingerprint(cfg) -> str:
  """What the judge of `cfg` is, without its path: the flag, the kind and the content's digest
  (a reward-model checkpoint: its manifest's checksums; `hf:DIR`: its config, weights and
  tokenizer; a reward function: its source file, and the weights of several); "none" without
  one. A stage trained on the judge's labels carries it in its fingerprint, so a resume onto
  another judge is refused, naming the flag."""
  e = cfg.eval
  if registry.judge_stage(e.judge) is not None:
    flag = f"--judge={e.judge}"
    return f"{flag}: this run's reward model, sha256 {_checkpoint_digest(flag, _rm_path(cfg))}"
  if e.judge.startswith("hf:"):
    return (f"--judge=hf:DIR: config, weights and tokenizer sha256 "
            f"{_hf_digest(f'--judge={e.judge}', e.judge[3:])}")
  if e.judge:
    return (f"--judge=DIR: reward-model checkpoint sha256 "
            f"{_checkpoint_digest(f'--judge={e.judge}', e.judge)}")
  judge = load(cfg, None, None, None)
  if judge is None:
    return "none"
  functions = judge.functions if isinstance(judge, RewardFunctions) else [judge]
  named = "; ".join(f"{f.name}: {_source(f)}" for f in functions)
  weights = (f"; weighted {','.join(map(str, judge.weights))}"
             if isinstance(judge, RewardFunctions) else "")
  return f"--reward_fn={named}{weights}"


# --- a reward function tried before any work -----------------------------------------------------

_REHEARSAL = 4  # records of the data each reward function is tried on, every response of each


def rehearse(cfg, records: Sequence | None, what: str = "training record", tok=None) -> None:
  """Calls the reward functions of `cfg` (--reward_fn, or the embedded task's reward) on every
  response of the first `_REHEARSAL` `records` (preference pairs or unpaired examples, as the
  data gave them; `what` names them in a message), before any compile or sampling: a function that raises or returns what is
  not a finite number (None allowed where several functions share the judging, or where GRPO or
  RLOO is the only stage that samples: TRL scores it NaN) is the
  JudgeError it would be mid-run, naming the function, the record and the value. A prompt
  record is tried with its worked solution (or an empty response) and its columns; `tok`
  tokenises the responses for a function that reads completion_ids. A reward model is not
  tried (it scores on the mesh, compiled)."""
  if cfg.eval.judge or not records:
    return
  judge = load(cfg, None, tok, None)
  if judge is None:
    return
  score = judge.each if isinstance(judge, RewardFunctions) else judge.score
  online = [registry.ALGORITHMS[s] for s in cfg.online_stages]
  if isinstance(judge, FunctionJudge) and len(online) == 1 and online[0].abstain:  # TRL's
    score = functools.partial(judge.score, allow_none=True)
  for i, rec in enumerate(list(records)[:_REHEARSAL]):
    sides = (rec.chosen, rec.rejected) if hasattr(rec, "rejected") else (rec.completion or "",)
    context = {}
    if isinstance(rec, formats.PromptRecord):
      context = {"columns": [rec.columns] * len(sides)}
    score(records_of(rec.prompt, [formats.response_text(s) for s in sides]),
          what=f"{what} {i}, tried before training: response", **context)


def accuracy(judge: Judge, records: Sequence[Record]) -> float | None:
  """The judge's accuracy on preference pairs: the fraction whose chosen response it scores
  strictly above the rejected one (ties count half). None without pairs."""
  if not records:
    return None
  chosen = judge.score(records)
  rejected = judge.score([r._replace(chosen=r.rejected) for r in records])
  return float(np.mean((chosen > rejected) + 0.5 * (chosen == rejected)))


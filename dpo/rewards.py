"""Reward functions by name: `--reward_fn=accuracy,think_format` (and with parameters,
`--reward_fn=soft_overlong_punishment(soft_punish_cache=16)`), the rewards TRL 1.16's
`trl.rewards` gives on the same completions (tests/test_rewards_trl.py runs TRL's functions as the
oracle):

  accuracy               1 if the completion's answer equals the `solution` column, else 0, both
                         read by math-verify (the `math` extra, as TRL; a \\boxed{} answer or
                         LaTeX in the completion, the first match); None (left out of its group's
                         statistics) where the solution itself cannot be parsed.
  reasoning_accuracy     accuracy of the text after the last reasoning delimiter (`</think>`);
                         0 for a completion that never closes its reasoning.
  think_format           1 if the completion opens with <think>, closes it once, and opens no
                         second one; else 0 (DeepSeek-R1's format reward).
  soft_overlong_punishment
                         0 up to max_completion_len - soft_punish_cache tokens, then falling
                         linearly to -1 at max_completion_len, -1 past it (DAPO, Yu et al. 2025,
                         arXiv:2503.14476, eq. 13).
  repetition_penalty     max_penalty times the fraction of the completion's token n-grams that
                         repeat (1 - distinct / total; 0 below ngram_size tokens) (Yeo et al. 2025,
                         arXiv:2502.03373, appendix C.2).
  cosine_scaled          accuracy scaled by length on a cosine: a correct completion earns from
                         max_value_correct (empty) down to min_value_correct (max_len tokens), a
                         wrong one from min_value_wrong (empty) up to max_value_wrong (Yeo et al.
                         2025, appendix C.1).

Each is a function of the batch in TRL's convention (`completions`, `completion_ids`, and the
data's extra columns such as `solution`, as keywords), which is also how a user's own function
with a `completions` parameter is called (dpo/judges.py). `max_completion_len` and `max_len`
default to the sampling stage's completion length. A completion is text or a conversation's one
assistant message ([{"role": "assistant", "content": ...}]).
"""

from __future__ import annotations

import ast
import functools
import logging
import math
import re
import threading
from typing import Any, Callable, Sequence

# The reward functions' names and the parameters each takes, with their defaults (None:
# required; `LENGTH`: the sampling stage's completion length unless given).
LENGTH = "the sampling stage's completion length"
PARAMETERS: dict[str, dict[str, Any]] = {
    "accuracy": {},
    "reasoning_accuracy": {"reasoning_delimiters": ("</think>",)},
    "think_format": {},
    "soft_overlong_punishment": {"max_completion_len": LENGTH, "soft_punish_cache": None},
    "repetition_penalty": {"ngram_size": 3, "max_penalty": -1.0},
    "cosine_scaled": {"max_len": LENGTH, "min_value_wrong": -1.0, "max_value_wrong": -0.5,
                      "min_value_correct": 0.5, "max_value_correct": 1.0},
}
NEEDS_MATH = ("accuracy", "reasoning_accuracy", "cosine_scaled")  # math-verify reads them


class RewardSpecError(ValueError):
  """A --reward_fn name or parameter that cannot work (judges.py names the flag)."""


def split(text: str) -> list[str]:
  """--reward_fn's functions: comma-separated, a comma inside a name's parentheses kept."""
  out, depth, cur = [], 0, ""
  for ch in text:
    depth += (ch == "(") - (ch == ")")
    if ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
    else:
      cur += ch
  return [s for s in out + [cur.strip()] if s] if text.strip() else []


def is_named(spec: str) -> bool:
  """A name of this module's (with or without parameters), not module:function."""
  return spec.partition("(")[0].strip() in PARAMETERS


def parse(spec: str) -> tuple[str, dict[str, Any]]:
  """(name, parameters given) of `name` or `name(key=value, ...)`; values are Python literals
  (numbers, strings, tuples of strings)."""
  name, paren, rest = spec.partition("(")
  name = name.strip()
  if name not in PARAMETERS:
    raise RewardSpecError(f"{name!r} is no reward function; the names are "
                          f"{', '.join(PARAMETERS)}, or give module:function")
  if not paren:
    return name, {}
  if not rest.endswith(")"):
    raise RewardSpecError(f"{spec}: close the parameters with ')'")
  try:
    call = ast.parse(f"f({rest}", mode="eval").body
    if call.args:
      raise ValueError("give each parameter as key=value")
    given = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
  except (SyntaxError, ValueError) as e:
    raise RewardSpecError(f"{spec}: parameters are key=value literals ({e})") from None
  unknown = sorted(set(given) - set(PARAMETERS[name]))
  if unknown:
    raise RewardSpecError(f"{spec}: {name} takes no {unknown[0]!r}; its parameters are "
                          f"{', '.join(PARAMETERS[name]) or 'none'}")
  return name, given


def build(spec: str, completion_length: int | None) -> Callable[..., list]:
  """The reward function `spec` names, its parameters given or defaulted (`completion_length`:
  what LENGTH parameters default to; None where nothing samples)."""
  name, given = parse(spec)
  params = {**PARAMETERS[name], **given}
  for key, value in params.items():
    if value is None:
      raise RewardSpecError(f"{spec}: give {name}'s {key} (e.g. {name}({key}=...))")
    if value == LENGTH:
      if completion_length is None:
        raise RewardSpecError(f"{spec}: give {name}'s {key} (no sampling stage sets it)")
      params[key] = completion_length
  if name in NEEDS_MATH:
    _math_verify(spec)
  _check(spec, name, params)
  fn = functools.partial(_FUNCTIONS[name], **params)
  fn.__name__ = name  # TRL logs a function by its name
  fn.__wrapped__ = _FUNCTIONS[name]  # its source file (the judge's fingerprint)
  return fn


def _check(spec: str, name: str, p: dict) -> None:
  def need(ok: bool, what: str):
    if not ok:
      raise RewardSpecError(f"{spec}: {what}")
  ints = lambda *keys: all(isinstance(p[k], int) and not isinstance(p[k], bool) for k in keys)
  nums = lambda *keys: all(isinstance(p[k], (int, float)) and not isinstance(p[k], bool) and
                           math.isfinite(p[k]) for k in keys)
  if name == "soft_overlong_punishment":
    need(ints("max_completion_len", "soft_punish_cache"), "max_completion_len and "
         "soft_punish_cache are token counts (integers)")
    need(0 <= p["soft_punish_cache"] <= p["max_completion_len"],
         f"soft_punish_cache={p['soft_punish_cache']} must be in [0, max_completion_len="
         f"{p['max_completion_len']}] (0: -1 past max_completion_len only, as TRL's)")
  elif name == "repetition_penalty":
    need(ints("ngram_size") and p["ngram_size"] >= 1, "ngram_size must be an integer >= 1")
    need(nums("max_penalty") and p["max_penalty"] <= 0,
         f"max_penalty={p['max_penalty']} must be a number <= 0 (TRL's)")
  elif name == "cosine_scaled":
    need(ints("max_len") and p["max_len"] >= 1, "max_len must be an integer >= 1")
    need(nums("min_value_wrong", "max_value_wrong", "min_value_correct", "max_value_correct"),
         "the four values must be finite numbers")
  elif name == "reasoning_accuracy":
    d = p["reasoning_delimiters"]
    need(isinstance(d, (tuple, list)) and d and all(isinstance(x, str) and x for x in d),
         "reasoning_delimiters must be a tuple of non-empty strings")


def _math_verify(spec: str):
  """math_verify and latex2sympy2_extended, or a one-line error naming the extra."""
  try:
    import math_verify
    from latex2sympy2_extended import NormalizationConfig
  except ImportError:
    raise RewardSpecError(f"{spec}: needs math-verify: pip install 'dpo-jax[math]'") from None
  return math_verify, NormalizationConfig


# --- the functions ---------------------------------------------------------------------------

def _text(completion) -> str:
  """A completion's text: the string, or the content of a conversation's one message."""
  if isinstance(completion, str):
    return completion
  return completion[0]["content"]


def _timeouts() -> tuple[int | None, int | None]:
  """(parse, verify) timeouts in seconds: math-verify's alarm works only on the main thread, so
  elsewhere none (and its warnings about that quiet), as TRL."""
  if threading.current_thread() is threading.main_thread():
    return 10, 5
  for name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(name).setLevel(logging.ERROR)
  return None, None


def _answer_config(math_verify, NormalizationConfig) -> list:
  """How accuracy reads a completion's answer: LaTeX, \\boxed{} first, units normalised."""
  return [math_verify.LatexExtractionConfig(
      normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
      try_extract_without_anchor=False)]


def parse_solution(gold: str) -> list:
  """A reference solution as math-verify reads it ([] when it does not parse)."""
  math_verify, _ = _math_verify("accuracy")
  return math_verify.parse(gold, parsing_timeout=_timeouts()[0])


def parse_answer(text: str) -> list:
  """A completion's answer as `accuracy` reads it (its first LaTeX answer, \\boxed{} first;
  [] when none is found)."""
  math_verify, NormalizationConfig = _math_verify("accuracy")
  return math_verify.parse(text, extraction_config=_answer_config(math_verify, NormalizationConfig),
                           extraction_mode="first_match", parsing_timeout=_timeouts()[0])


def parse_any(text: str) -> list:
  """An answer as math-verify reads it by its own defaults (LaTeX, \\boxed{} first, or a plain
  expression such as GSM8K's final number; [] when none is found)."""
  math_verify, _ = _math_verify("accuracy")
  return math_verify.parse(text, parsing_timeout=_timeouts()[0])


def verify(gold: list, answer: list) -> bool:
  """Whether parsed `answer` equals parsed `gold` by math-verify."""
  math_verify, _ = _math_verify("accuracy")
  return bool(math_verify.verify(gold, answer, timeout_seconds=_timeouts()[1]))


def _correct(texts: Sequence[str], solution: Sequence[str]) -> list[float | None]:
  """Whether each text's first LaTeX answer (\\boxed{} first; units normalised) verifies
  against its solution by math-verify; None where the solution does not parse."""
  out = []
  for text, gold in zip(texts, solution, strict=True):
    reference = parse_solution(gold)
    out.append(float(verify(reference, parse_answer(text))) if reference else None)
  return out


def accuracy(completions, solution, **kwargs) -> list[float | None]:
  return _correct([_text(c) for c in completions], solution)


def reasoning_accuracy(completions, solution, reasoning_delimiters=("</think>",),
                       **kwargs) -> list[float | None]:
  out: list[float | None] = [0.0] * len(completions)
  finished, answers, golds = [], [], []
  for i, c in enumerate(completions):
    text = _text(c)
    delimiter = next((d for d in reasoning_delimiters if d in text), None)
    if delimiter is not None:  # the answer: after the delimiter's last occurrence
      finished.append(i)
      answers.append(text.split(delimiter)[-1])
      golds.append(solution[i])
  for i, r in zip(finished, _correct(answers, golds)):
    out[i] = r
  return out


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format(completions, **kwargs) -> list[float]:
  return [1.0 if _THINK.match(_text(c)) else 0.0 for c in completions]


def soft_overlong_punishment(completion_ids, max_completion_len, soft_punish_cache,
                             **kwargs) -> list[float]:
  start = max_completion_len - soft_punish_cache  # no punishment up to here
  out = []
  for ids in completion_ids:
    n = len(ids)  # (with a cache of 0 the middle case is empty)
    out.append(0.0 if n <= start else (start - n) / soft_punish_cache
               if n <= max_completion_len else -1.0)
  return out


def repetition_penalty(completion_ids, ngram_size=3, max_penalty=-1.0, **kwargs) -> list[float]:
  out = []
  for ids in completion_ids:
    grams = [tuple(ids[i:i + ngram_size]) for i in range(len(ids) - ngram_size + 1)]
    repeated = 1.0 - len(set(grams)) / len(grams) if grams else 0.0
    out.append(repeated * max_penalty if repeated else 0.0)
  return out


def cosine_scaled(completions, solution, completion_ids, max_len, min_value_wrong=-1.0,
                  max_value_wrong=-0.5, min_value_correct=0.5, max_value_correct=1.0,
                  **kwargs) -> list[float | None]:
  out = []
  for ok, ids in zip(accuracy(completions, solution), completion_ids, strict=True):
    if ok is None:
      out.append(None)
      continue
    # Past max_len the length stays at the bound (the cosine would rise again).
    cos = math.cos(min(len(ids) / max_len, 1.0) * math.pi)
    short, long = ((max_value_correct, min_value_correct) if ok else
                   (min_value_wrong, max_value_wrong))
    out.append(float(long + 0.5 * (short - long) * (1.0 + cos)))
  return out


_FUNCTIONS = {"accuracy": accuracy, "reasoning_accuracy": reasoning_accuracy,
              "think_format": think_format, "soft_overlong_punishment": soft_overlong_punishment,
              "repetition_penalty": repetition_penalty, "cosine_scaled": cosine_scaled}

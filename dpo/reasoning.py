"""The embedded reasoning task: chain arithmetic with worked solutions and a verifiable reward,
and the evaluation of reasoning (pass@k, majority@k, answer extraction, format).

    prompt:      "Solve 7+5-3:"
    completion:  "<think>7+5=12, 12-3=9</think> 9"

A problem's difficulty is its number of operations, 1 to `--task_difficulty`; operands are 1 to
9, and a subtraction never takes the running value below zero, so every answer is one exact
non-negative integer. A completion is a reasoning block in TRL's think format (`<think>` first,
one block, as `trl.rewards.think_format_reward` checks), one "a+b=c" step per operation, then the
answer. The reward is verifiable, computed, never judged: 1.0 when the integer after the
reasoning block equals the problem's answer, else 0.0 (a completion with no such integer is
counted by the evaluation as an extraction failure).

SFT demonstrations are of mixed quality, as human worked solutions are: each step slips with
probability `SLIP` (its result off by 1 or 2) and the chain goes on from the slipped value, so
the final answer is wrong. The SFT model learns to slip too, and reinforcement learning against
the verifiable reward has something to remove. A preference pair is a correct worked solution
over one with a slip, for the same problem (DPO on the task; GRPO reads only the prompts).

A fifth of all problems (by a hash of the expression) never appear in training; the held-out
problems sampled at evaluation are drawn from them, spread over the difficulties as evenly as
each has problems (`eval_problems`), so a gain is measured on problems the policy never saw, per
difficulty too.
"""

from __future__ import annotations

import collections
import math
import re
import zlib
from typing import NamedTuple, Sequence

import numpy as np

from dpo.data import PreferenceRecord, SFTRecord

SLIP = 0.4           # per-step probability that a demonstration's step is wrong
HELD_OUT = 5         # one problem in HELD_OUT (by hash) is held out
EVAL_PROBLEMS = 128  # distinct held-out problems the evaluation cycles over
_PROMPT = re.compile(r"^Solve ([0-9+\-]+):$")
# TRL's think format (trl.rewards.think_format_reward: one block, first), then the answer.
_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>\s*(-?\d+)$", re.DOTALL)
_AFTER_THINK = re.compile(r"</think>\s*(-?\d+)\s*$")


class Problem(NamedTuple):
  """`operands[0] ops[0] operands[1] ...`, evaluated left to right."""
  operands: tuple[int, ...]
  ops: tuple[str, ...]

  @property
  def text(self) -> str:
    return str(self.operands[0]) + "".join(f"{o}{x}" for o, x in zip(self.ops, self.operands[1:]))

  @property
  def difficulty(self) -> int:
    return len(self.ops)

  def steps(self, slips: Sequence[int] = ()) -> list[tuple[int, str, int, int]]:
    """(left, op, right, result) per operation; `slips[i]` added to step i's result, later
    steps going on from it."""
    value, out = self.operands[0], []
    for i, (op, x) in enumerate(zip(self.ops, self.operands[1:])):
      result = (value + x if op == "+" else value - x) + (slips[i] if i < len(slips) else 0)
      out.append((value, op, x, result))
      value = result
    return out

  @property
  def answer(self) -> int:
    return self.steps()[-1][3]


def prompt_text(problem: Problem) -> str:
  return f"Solve {problem.text}:"


def parse(prompt: str) -> Problem:
  """The problem a prompt states (ValueError naming the prompt for one that states none)."""
  m = _PROMPT.match(prompt.strip())
  if m is None:
    raise ValueError(f"not an arithmetic task prompt ('Solve a+b-c:'): {prompt!r}")
  tokens = re.findall(r"\d+|[+\-]", m.group(1))
  return Problem(tuple(int(t) for t in tokens[0::2]), tuple(tokens[1::2]))


def solution(problem: Problem, slips: Sequence[int] = ()) -> str:
  """The worked solution: the reasoning block, one step per operation, then the answer."""
  steps = problem.steps(slips)
  work = ", ".join(f"{a}{op}{b}={c}" for a, op, b, c in steps)
  return f"<think>{work}</think> {steps[-1][3]}"


def extract(text: str) -> int | None:
  """The answer of a completion: the integer after its (last) reasoning block, alone at the
  end; None when there is none (an extraction failure)."""
  m = _AFTER_THINK.search(text.strip())
  return int(m.group(1)) if m else None


def reward(prompt: str, completion: str) -> float:
  """The verifiable reward (--reward_fn=dpo.reasoning:reward): 1.0 when the completion's
  answer is the problem's, else 0.0."""
  return float(extract(completion) == parse(prompt).answer)


def well_formed(prompt: str, text: str) -> bool:
  """Whether `text` is in the task's format: one reasoning block first (TRL's think format),
  then an integer answer and nothing else (whether the answer is right is the reward's)."""
  del prompt
  return _FORMAT.match(text.strip()) is not None


def _held_out(problem: Problem) -> bool:
  return zlib.crc32(problem.text.encode()) % HELD_OUT == 0


def _problem(rng: np.random.Generator, difficulty: int) -> Problem:
  operands, ops = [int(rng.integers(1, 10))], []
  value = operands[0]
  for _ in range(difficulty):
    x = int(rng.integers(1, 10))
    op = "-" if x <= value and rng.random() < 0.5 else "+"
    value = value + x if op == "+" else value - x
    operands.append(x)
    ops.append(op)
  return Problem(tuple(operands), tuple(ops))


def _problems(rng: np.random.Generator, n: int, max_difficulty: int, held_out: bool):
  """`n` problems of difficulties 1 to max_difficulty (uniform), held out or not."""
  out = []
  while len(out) < n:
    p = _problem(rng, int(rng.integers(1, max_difficulty + 1)))
    if _held_out(p) == held_out:
      out.append(p)
  return out


def _lowest(problem: Problem, slips: Sequence[int]) -> int:
  return min(result for *_, result in problem.steps(slips))


def _slips(rng: np.random.Generator, problem: Problem) -> list[int]:
  """Each step's slip: 0, or +-1 or +-2 with probability SLIP (upward where downward would take
  the chain below zero, so every demonstration's numbers stay non-negative)."""
  out = []
  for _ in range(problem.difficulty):
    s = 0
    if rng.random() < SLIP:
      s = int(rng.choice([-2, -1, 1, 2]))
      if _lowest(problem, [*out, s]) < 0:
        s = -s
    out.append(s)
  return out


def sft_records(n: int, seed: int, max_difficulty: int) -> list[SFTRecord]:
  """Worked solutions of training problems, each step slipping with probability SLIP."""
  rng = np.random.default_rng([seed, 11])
  return [SFTRecord(prompt_text(p), solution(p, _slips(rng, p)))
          for p in _problems(rng, n, max_difficulty, held_out=False)]


def preference_records(n: int, seed: int, max_difficulty: int,
                       held_out: bool = False) -> list[PreferenceRecord]:
  """A correct worked solution over one whose steps slip (at least one), per problem."""
  rng = np.random.default_rng([seed, 12 if held_out else 13])
  out = []
  for p in _problems(rng, n, max_difficulty, held_out):
    slips = [0] * p.difficulty
    slips[int(rng.integers(p.difficulty))] = int(rng.choice([-2, -1, 1, 2]))
    if _lowest(p, slips) < 0:
      slips = [-s for s in slips]
    out.append(PreferenceRecord(prompt_text(p), solution(p), solution(p, slips)))
  return out


def eval_problems(max_difficulty: int) -> list[Problem]:
  """The held-out problems of the evaluation: EVAL_PROBLEMS distinct ones, as many of each
  difficulty as it has (one operation has only a few dozen held out; the harder ones share
  what it lacks), fixed whatever the seed, so runs compare on one set."""
  rng = np.random.default_rng(99)
  pools = []
  for d in range(1, max_difficulty + 1):  # up to EVAL_PROBLEMS distinct ones of each
    pool = {}
    for _ in range(50 * EVAL_PROBLEMS):
      p = _problem(rng, d)
      if _held_out(p):
        pool.setdefault(p.text, p)
        if len(pool) == EVAL_PROBLEMS:
          break
    pools.append(list(pool.values()))
  out, want = [], EVAL_PROBLEMS
  for i, pool in enumerate(sorted(pools, key=len)):  # the scarcest difficulty first
    take = min(len(pool), -(-want // (len(pools) - i)))
    out += pool[:take]
    want -= take
  return sorted(out, key=lambda p: p.difficulty)


def eval_prompts(n: int, max_difficulty: int) -> list[str]:
  """Held-out prompts, the evaluation problems cycled to n: with n a multiple of their number,
  each problem is sampled n / EVAL_PROBLEMS times (the k of pass@k and majority@k)."""
  prompts = [prompt_text(p) for p in eval_problems(max_difficulty)]
  return [prompts[i % len(prompts)] for i in range(n)]


# --- reasoning evaluation -------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code", eq. 1): 1 - C(n - c, k) / C(n, k)."""
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority(answers: Sequence[int | None]) -> int | None:
  """The most frequent extracted answer (extraction failures do not vote; ties go to the answer
  seen first); None when none was extracted."""
  votes = collections.Counter(a for a in answers if a is not None)
  if not votes:
    return None
  top = max(votes.values())
  return next(a for a in answers if a is not None and votes[a] == top)


def _groups(prompts: Sequence[str]) -> tuple[dict[str, list[int]], int]:
  """({prompt: the indices of its samples}, in first-seen order; k, the fewest samples any
  prompt has)."""
  groups: dict[str, list[int]] = collections.defaultdict(list)
  for i, p in enumerate(prompts):
    groups[p].append(i)
  return groups, min(len(g) for g in groups.values())


def _scores(correct: Sequence[bool], voted_right: bool, k: int) -> dict:
  """One problem's pass@1, pass@k and maj@k from its samples' correctness."""
  return {"pass@1": float(np.mean(correct)),
          f"pass@{k}": pass_at_k(len(correct), sum(correct), k), f"maj@{k}": float(voted_right)}


def _means(rows: Sequence[dict], k: int, prefix: str) -> dict:
  """The mean over problems of each of `_scores` (None for no problems)."""
  return {f"{prefix}{key}": float(np.mean([r[key] for r in rows])) if rows else None
          for key in ("pass@1", f"pass@{k}", f"maj@{k}")}


def metrics(prompts: Sequence[str], texts: Sequence[str], prefix: str) -> tuple[dict, list[dict]]:
  """({prefix}pass@1, pass@k, maj@k, extraction failure and format rates, per difficulty
  pass@1}, one record a problem) of completions `texts` of `prompts`, a problem's samples
  grouped by its prompt; k is the fewest samples any problem has."""
  groups, k = _groups(prompts)
  rows, by_difficulty = [], collections.defaultdict(list)
  for prompt, index in groups.items():
    problem = parse(prompt)
    answers = [extract(texts[i]) for i in index]
    correct = [a == problem.answer for a in answers]
    voted = majority(answers[:k])
    rows.append({"problem": problem.text, "difficulty": problem.difficulty,
                 "answer": problem.answer, "answers": answers, "correct": correct,
                 "majority": voted, **_scores(correct, voted == problem.answer, k)})
    by_difficulty[problem.difficulty].append(rows[-1]["pass@1"])
  m = {**_means(rows, k, prefix),
       f"{prefix}extraction_failure_rate": float(np.mean([extract(t) is None for t in texts])),
       f"{prefix}format_rate": float(np.mean([well_formed("", t) for t in texts])),
       **{f"{prefix}pass@1/difficulty_{d}": float(np.mean(v))
          for d, v in sorted(by_difficulty.items())}}
  return m, rows


class Solutions:
  """The reasoning evaluation of prompt data that carries reference answers: each prompt's
  `solution` column (GSM8K's final number, MATH's worked solution with its \\boxed{} answer, TRL's
  prompt-only layout with a solution) against completions, by math-verify (the `math` extra).

  A completion's answer is read from its text after the last "####" (GSM8K's answer mark) when it
  has one, else after its last `</think>`, else the whole text, by math-verify's own default
  extraction (LaTeX, \\boxed{} first, or a plain expression); none found is an extraction
  failure. Majority voting counts answers math-verify finds equal as one. A problem whose
  solution does not parse is left out of every figure and counted (`unscorable_problems`); the
  format rate is TRL's think format; pass@1 per difficulty comes from a `level` column (MATH's).
  `metrics` has the embedded task's signature (`metrics` above), `columns` one dict a prompt."""

  MARKS = ("####", "</think>")

  def __init__(self, columns: Sequence[dict]):
    from dpo import rewards
    self.columns, self.rewards, self._solutions = list(columns), rewards, {}
    rewards.parse_solution("1")  # math-verify present, or the one-line error naming the extra

  def answer(self, text: str) -> list:
    """The parsed answer of a completion ([] when none is found)."""
    mark = next((m for m in self.MARKS if m in text), None)
    return self.rewards.parse_any(text if mark is None else text.rsplit(mark, 1)[1])

  @staticmethod
  def show(parsed: list) -> str | None:
    """What a reader sees of a parsed answer: the text math-verify matched (None: none)."""
    return None if not parsed else str(parsed[-1])

  def _majority(self, parsed: Sequence[list]) -> list:
    """The answer most completions agree on, equal ones (by math-verify) voting together; ties
    go to the answer seen first; [] when none was extracted."""
    clusters: list[list] = []  # [representative, votes]
    for a in parsed:
      if a:
        home = next((c for c in clusters if self.rewards.verify(c[0], a)), None)
        if home is None:
          clusters.append([a, 1])
        else:
          home[1] += 1
    return max(clusters, key=lambda c: c[1])[0] if clusters else []

  def metrics(self, prompts: Sequence[str], texts: Sequence[str],
              prefix: str) -> tuple[dict, list[dict]]:
    groups, k = _groups(prompts)
    rows, by_level, unscorable, parsed_all, scored = [], collections.defaultdict(list), 0, [], []
    for prompt, index in groups.items():
      columns = self.columns[index[0]]
      gold = self._gold(str(columns.get("solution", "")))
      if not gold:
        unscorable += 1
        continue
      parsed = [self.answer(texts[i]) for i in index]
      parsed_all += parsed
      scored += [texts[i] for i in index]
      correct = [bool(a) and self.rewards.verify(gold, a) for a in parsed]
      voted = self._majority(parsed[:k])
      rows.append({"problem": prompt, "difficulty": columns.get("level"),
                   "answer": self.show(gold), "answers": [self.show(a) for a in parsed],
                   "correct": correct, "majority": self.show(voted),
                   **_scores(correct, bool(voted) and self.rewards.verify(gold, voted), k)})
      if columns.get("level") is not None:
        by_level[columns["level"]].append(rows[-1]["pass@1"])
    m = {**_means(rows, k, prefix),
         f"{prefix}extraction_failure_rate":
             float(np.mean([not a for a in parsed_all])) if parsed_all else None,
         f"{prefix}format_rate":
             float(np.mean(self.rewards.think_format(scored))) if scored else None,
         f"{prefix}unscorable_problems": unscorable,
         **{f"{prefix}pass@1/difficulty_{str(d).replace(' ', '_')}": float(np.mean(v))
            for d, v in sorted(by_level.items(), key=lambda kv: str(kv[0]))}}
    return m, rows

  def _gold(self, solution: str) -> list:
    """A solution as math-verify reads it, parsed once for the policy's and the reference's
    samples alike."""
    if solution not in self._solutions:
      self._solutions[solution] = self.rewards.parse_solution(solution)
    return self._solutions[solution]

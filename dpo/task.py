"""The embedded default task: short reviews with a sentiment reward computable from the text.

In the spirit of the DPO paper's controlled sentiment generation (Rafailov et al. 2023, sec. 6.1),
where a known reward lets alignment be measured exactly rather than judged.

    prompt:      "Review the cafe in Oslo:"
    completion:  " warm coffee, rude staff, fresh bread."

Each prompt names a place (which fixes the plausible nouns) and a city. A completion is three
"<adjective> <noun>" clauses. The true reward is (#positive - #negative adjectives) / 3, in
[-1, 1]; text that is not a well-formed review still gets a score from the words it contains,
so the reward is defined for anything a model samples. `well_formed` says whether a text is a
review of the task's grammar, so a reward gained by breaking the grammar (reward hacking) shows.

SFT demonstrations are of mixed quality (each adjective positive with probability 1/2). A
preference pair is two such completions for the same prompt, the higher true reward chosen; pairs
with equal reward are not generated. Held-out prompts use (place, city) combinations never seen
in training.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Callable, NamedTuple

import numpy as np

from dpo.data import PreferenceRecord, SFTRecord

POSITIVE = ("great", "lovely", "superb", "fresh", "warm", "friendly")
NEGATIVE = ("awful", "bland", "rude", "stale", "cold", "dirty")
PLACES = {
    "cafe": ("coffee", "cake", "staff", "music", "bread"),
    "hotel": ("room", "bed", "staff", "view", "lobby"),
    "diner": ("burger", "fries", "staff", "booth", "coffee"),
    "bakery": ("bread", "cake", "staff", "pastry", "prices"),
    "museum": ("art", "guide", "staff", "shop", "lights"),
    "inn": ("room", "bed", "host", "view", "soup"),
}
CITIES = ("Oslo", "Lima", "Rome", "Kyiv", "Pune", "Baku", "Cork", "Nice", "Bonn", "Fez")
CLAUSES = 3
_POS, _NEG = frozenset(POSITIVE), frozenset(NEGATIVE)
_WORD = re.compile(r"[a-z]+")


def true_reward(text: str) -> float:
  """(#positive - #negative adjective occurrences) / 3, clipped to [-1, 1]."""
  words = _WORD.findall(text.lower())
  score = sum(w in _POS for w in words) - sum(w in _NEG for w in words)
  return float(np.clip(score / CLAUSES, -1.0, 1.0))


def reward(prompt: str, completion: str) -> float:
  """The true reward as a judge's reward function (--reward_fn=dpo.task:reward): the prompt
  does not enter it."""
  del prompt
  return true_reward(completion)


_PROMPT = re.compile(r"Review the ([a-z]+) in [A-Z][a-z]+:$")
_CLAUSE = re.compile(r"([a-z]+) ([a-z]+)$")


def well_formed(prompt: str, text: str) -> bool:
  """Whether `text` is a review of the task's grammar for `prompt`: a leading space, then
  CLAUSES ", "-separated "<adjective> <noun>" clauses and a final period, every adjective from
  the lexicon and every noun one of the prompt's place's."""
  m = _PROMPT.search(prompt)
  if m is None or m.group(1) not in PLACES or not text.startswith(" ") or not text.endswith("."):
    return False
  clauses = [_CLAUSE.match(c) for c in text[1:-1].split(", ")]
  if len(clauses) != CLAUSES or not all(clauses):
    return False
  return all((c.group(1) in _POS or c.group(1) in _NEG) and c.group(2) in PLACES[m.group(1)]
             for c in clauses)


def _prompts(held_out: bool) -> list[tuple[str, str]]:
  """(place, city) pairs; every fourth combination (by a fixed rule) is held out."""
  combos = [(p, c) for i, p in enumerate(PLACES) for j, c in enumerate(CITIES)]
  return [pc for k, pc in enumerate(combos) if (k % 4 == 3) == held_out]


def prompt_text(place: str, city: str) -> str:
  return f"Review the {place} in {city}:"


def _completion(rng: np.random.Generator, place: str) -> tuple[str, float]:
  nouns = rng.choice(PLACES[place], size=CLAUSES, replace=False)
  positive = rng.random(CLAUSES) < 0.5
  adjs = [rng.choice(POSITIVE) if s else rng.choice(NEGATIVE) for s in positive]
  text = " " + ", ".join(f"{a} {n}" for a, n in zip(adjs, nouns)) + "."
  return text, (2 * positive.sum() - CLAUSES) / CLAUSES


def sft_records(n: int, seed: int) -> list[SFTRecord]:
  rng = np.random.default_rng([seed, 1])
  prompts = _prompts(held_out=False)
  out = []
  for _ in range(n):
    place, city = prompts[rng.integers(len(prompts))]
    out.append(SFTRecord(prompt_text(place, city), _completion(rng, place)[0]))
  return out


def preference_records(n: int, seed: int, held_out: bool = False) -> list[PreferenceRecord]:
  rng = np.random.default_rng([seed, 2 if held_out else 3])
  prompts = _prompts(held_out)
  out = []
  while len(out) < n:
    place, city = prompts[rng.integers(len(prompts))]
    (a, ra), (b, rb) = _completion(rng, place), _completion(rng, place)
    if ra == rb:
      continue
    chosen, rejected = (a, b) if ra > rb else (b, a)
    out.append(PreferenceRecord(prompt_text(place, city), chosen, rejected))
  return out


def eval_prompts(n: int) -> list[str]:
  """Held-out prompts, cycled to n."""
  prompts = [prompt_text(p, c) for p, c in _prompts(held_out=True)]
  return [prompts[i % len(prompts)] for i in range(n)]


# --- the embedded tasks (--task) ------------------------------------------------------------------

# Each a module with sft_records(n, seed), preference_records(n, seed, held_out),
# eval_prompts(n), reward(prompt, completion) and well_formed(prompt, text); a module whose
# functions take a difficulty (dpo/reasoning.py) gets --task_difficulty.
TASKS = {"reviews": "dpo.task", "arithmetic": "dpo.reasoning"}


class Embedded(NamedTuple):
  """One embedded task as a run reads it (`embedded`): its data, its held-out prompts, its true
  reward (`reward_fn`, the judge's --reward_fn spelling) and its format check; `reasoning` the
  module whose `metrics` evaluate reasoning (None for a task without answers)."""
  name: str
  sft_records: Callable[[int, int], list]
  preference_records: Callable[..., list]
  eval_prompts: Callable[[int], list]
  reward_fn: str
  well_formed: Callable[[str, str], bool]
  reasoning: object = None


def embedded(d) -> Embedded:
  """The embedded task --task names (`d` the data section)."""
  module = importlib.import_module(TASKS[d.task])
  knob = {"max_difficulty": d.task_difficulty} if d.task == "arithmetic" else {}
  bind = lambda f: functools.partial(f, **knob)
  return Embedded(d.task, bind(module.sft_records), bind(module.preference_records),
                  bind(module.eval_prompts), f"{TASKS[d.task]}:reward", module.well_formed,
                  module if d.task == "arithmetic" else None)

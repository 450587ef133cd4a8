"""Training algorithms, one module each, on one seam.

An algorithm is a stage of a recipe (`--stage=sft,dpo`): its pure step lives in dpo/train.py or
its own module, and its module registers an `Algorithm` whose `run` builds the stage (initial
state, frozen inputs, the rows it trains on, its hooks) on `Program.stage`, runs it and exports
what it made. `loop.run` walks the recipe's names through `ALGORITHMS` and never names one;
each stage hands the next a `Model`. Adding an algorithm is one module that calls `register`
(tests/test_loop.py registers one from the test file alone).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple


class Model(NamedTuple):
  """What a stage hands the next: the weights it made (or was given) and where they are saved
  ("" for a random init; `hf:DIR` for an imported folder). The next stage's checkpoints
  fingerprint the saved model's content (dpo/identity.py)."""
  params: Any
  path: str


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One training algorithm, registered under its stage name."""
  name: str                      # --stage entry, checkpoints/<name>/, metrics' "stage"
  step: Callable                 # the pure step (StepConfig, state, frozen, batch) -> (state, metrics)
  batch: Callable                # host arrays of a step's rows -> the typed batch (dpo/batches.py);
                                 # every leaf has a leading row axis, the first is the token rows
  step_config: Callable          # cfg -> train.StepConfig, the jitted step's static argument
  run: Callable                  # (Program, Model) -> Model: build the stage, run it, hand on
  hyperparameters: Callable      # cfg -> {name: value}: what its result depends on (identity)
  data_files: tuple[str, ...]    # DataConfig fields of files it reads (identity hashes them)
  data_seed: int                 # its loader shuffles with --seed + this
  steps_flag: str                # the flag that sets its length (StepConfig.total_steps)
  unpaired: bool = False         # it trains on unpaired --train_data ({prompt, completion,
                                 # label}; loop.Data refuses such data for a recipe with others)


ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
  if algorithm.name in ALGORITHMS:
    raise ValueError(f"two algorithms are named {algorithm.name}")
  ALGORITHMS[algorithm.name] = algorithm
  return algorithm


def recipe(stages: tuple[str, ...]) -> list[Algorithm]:
  """The algorithms of `--stage`, in order; an unknown name is a ValueError naming the flag."""
  unknown = [s for s in stages if s not in ALGORITHMS]
  if unknown:
    raise ValueError(f"--stage={','.join(stages)}: no algorithm named {', '.join(unknown)} "
                     f"(registered: {', '.join(ALGORITHMS)})")
  return [ALGORITHMS[s] for s in stages]


# Each module registers itself; the registry lists them in the order of the article's recipe.
from dpo.algorithms import sft  # noqa: E402,F401
from dpo.algorithms import dpo  # noqa: E402,F401
from dpo.algorithms import rm  # noqa: E402,F401
from dpo.algorithms import online_dpo  # noqa: E402,F401
from dpo.algorithms import grpo  # noqa: E402,F401
from dpo.algorithms import rloo  # noqa: E402,F401
from dpo.algorithms import kto  # noqa: E402,F401
from dpo.algorithms import iterative_dpo  # noqa: E402,F401

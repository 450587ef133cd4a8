"""The seam every training algorithm registers on: `Algorithm` (a stage of a recipe, `--stage`),
`Model` (what a stage hands the next), and the registry `ALGORITHMS` that `loop.run` walks.

An algorithm module (dpo/algorithms/) imports this module and calls `register`; the package
dpo/algorithms imports each module, so importing it fills the registry. Nothing here imports an
algorithm.
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

"""The seam every training algorithm registers on: `Algorithm` (a stage of a recipe, `--stage`),
`Model` (what a stage hands the next), and the registry `ALGORITHMS` that `loop.run` walks.

An algorithm module (dpo/algorithms/) imports this module and calls `register`; the package
dpo/algorithms imports each module, so importing it fills the registry. Nothing here imports an
algorithm. What is an algorithm's own is declared on its `Algorithm`: its config sections
(`configs.Config` gains one attribute, and every field one flag, per section), the sections of
others it reads, its cross-checks, its log line and its curves; configs.py, the loop, the hooks
and the curves ask the registry and never name a stage.
"""


from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, NamedTuple


# A stage's log line unless it names its own: (label, metric key, %-format).
COLUMNS = (("loss", "loss", ".4f"), ("|g|", "grad_norm", ".3f"), ("lr", "learning_rate", ".2e"))


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
  steps_flag: str                # the flag that sets its length (StepConfig.total_steps)
  data_seed: int | None = None   # its loader shuffles with --seed + `loader_seed`: this, or
                                 # (None) a number derived from its name; two registered
                                 # stages never share one
  unpaired: bool = False         # it trains on unpaired --train_data ({prompt, completion,
                                 # label}; loop.Data refuses such data for a recipe with others)
  sections: tuple[tuple[str, type], ...] = ()
                                 # config sections it owns: (Config attribute, frozen dataclass of
                                 # models.config `option`s); each field is a flag (dpo/cli.py)
  reads: tuple[str, ...] = ()    # others' sections it reads too (a field off its default must go
                                 # with a stage that owns or reads its section)
  check: Callable[[Any], None] | None = None
                                 # its cross-checks, cfg -> None (models.config.check), run on
                                 # every Config whether or not it is in --stage
  rows: str = ""                 # the loop.Data table it trains on: "pairs", "rm_pairs",
                                 # "demonstrations" (Data.sft), or "" (none: it samples its
                                 # own, or reads unpaired rows or its own file);
                                 # each must hold one global batch before any stage runs
  trains_base: bool = False      # it trains the base weights (else a run without such a stage
                                 # holds the base frozen from the start, in --base_quant's format)
  samples: bool = False          # it samples from the policy as it trains (an online stage: it
                                 # needs a judge, fresh reference log-probs, one pair a row)
  judged: bool = False           # its policy is what the evaluation's judge scores (a reward
                                 # model it is judged with is trained before it)
  scores: bool = False           # it trains a reward model, saved to checkpoints/<name>_model
                                 # (`--judge=<name>` names it; a sequence classifier --init_from
                                 # starts only it)
  abstain: bool = False          # a reward function may return None for its samples, scored NaN
                                 # (TRL's GRPO and RLOO), when it is the recipe's one online stage
  completion_length: Callable | None = None
                                 # a sampling stage's completion budget, cfg -> tokens (what the
                                 # length parameters of dpo/rewards.py default to)
  router_losses: bool = True     # its step adds a mixture's router losses (models/moe.py) to
                                 # its loss; a run with --router_aux_loss_coef or
                                 # --router_z_loss_coef and a stage that does not is refused
  columns: tuple[tuple[str, str, str], ...] = COLUMNS
                                 # its log line: (label, metric key, %-format); a key the step did
                                 # not return is left out, never printed as nan
  curves: tuple[tuple[str, str, str], ...] = ()
                                 # its lines on curves.png: (panel title, metric key, label)
  beside: Callable | None = None  # (cfg, mesh, base params, key) -> a pytree it trains beside
                                 # the policy (PPO's value model); the state's trainable is then
                                 # {"policy": the policy's, "beside": it} (`policy_part`)
  optimizer: Callable | None = None
                                 # StepConfig -> (optax transformation, schedule) over its state's
                                 # trainable; None: StepConfig.optimizer (the policy's AdamW)

  @property
  def loader_seed(self) -> int:
    """What its loader adds to --seed: `data_seed`, or one derived from the stage's name."""
    if self.data_seed is not None:
      return self.data_seed
    return 100 + zlib.crc32(self.name.encode()) % 1_000_000

  def policy_part(self, trainable):
    """The policy's part of a state's trainable pytree (all of it unless `beside`)."""
    return trainable["policy"] if self.beside is not None else trainable

  @property
  def policy_path(self) -> str:
    """Where `policy_part` sits in the state's trainable, as a key path ("" for all of it)."""
    return "['policy']" if self.beside is not None else ""


ALGORITHMS: dict[str, Algorithm] = {}
# Set by configs.py when it builds `Config` from the sections registered so far: an algorithm
# with sections of its own registers before that (dpo/algorithms/__init__.py imports it).
_closed: list[str] = []


def register(algorithm: Algorithm) -> Algorithm:
  if algorithm.name in ALGORITHMS:
    raise ValueError(f"two algorithms are named {algorithm.name}")
  names = [n for n, _ in algorithm.sections]
  if algorithm.sections and _closed:
    raise ValueError(f"algorithm {algorithm.name}: its config sections {names} register after "
                     f"configs.Config was built; import its module first (python launch.py "
                     f"--imports=MODULE, or a line in dpo/algorithms/__init__.py)")
  owned = {n for a in ALGORITHMS.values() for n, _ in a.sections}
  if set(names) & owned:
    raise ValueError(f"algorithm {algorithm.name}: config section {sorted(set(names) & owned)} "
                     f"already has an owner")
  same = [a.name for a in ALGORITHMS.values() if a.loader_seed == algorithm.loader_seed]
  if same:
    raise ValueError(f"algorithm {algorithm.name}: data_seed {algorithm.loader_seed} is "
                     f"{same[0]}'s too (its loader would draw the same order); leave data_seed "
                     f"out (None: one derived from the stage's name)")
  ALGORITHMS[algorithm.name] = algorithm
  return algorithm


def sections() -> dict[str, type]:
  """{Config attribute: section class} of every registered algorithm, in registration order;
  configs.py builds `Config` from them once, after which no algorithm adds a section."""
  _closed.append("configs")
  return {n: cls for a in ALGORITHMS.values() for n, cls in a.sections}


def readers(section: str) -> tuple[str, ...]:
  """The algorithms that own or read config section `section`."""
  return tuple(a.name for a in ALGORITHMS.values()
               if section in a.reads or section in dict(a.sections))


def judge_stage(judge: str) -> Algorithm | None:
  """The algorithm `--judge=NAME` names: a registered stage that trains a reward model."""
  if not ALGORITHMS:
    raise RuntimeError("the algorithm registry is empty: import dpo.algorithms (configs does) "
                       "before asking it which stage trains a reward model")
  algorithm = ALGORITHMS.get(judge)
  return algorithm if algorithm is not None and algorithm.scores else None


def recipe(stages: tuple[str, ...]) -> list[Algorithm]:
  """The algorithms of `--stage`, in order; an unknown name is a ValueError naming the flag."""
  unknown = [s for s in stages if s not in ALGORITHMS]
  if unknown:
    raise ValueError(f"--stage={','.join(stages)}: no algorithm named {', '.join(unknown)} "
                     f"(registered: {', '.join(ALGORITHMS)})")
  return [ALGORITHMS[s] for s in stages]

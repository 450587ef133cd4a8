"""Training algorithms, one module each, on one seam.

An algorithm is a stage of a recipe (`--stage=sft,dpo`): its pure step lives in dpo/train.py or
its own module, and its module registers an `Algorithm` whose `run` builds the stage (initial
state, frozen inputs, the rows it trains on, its hooks) on `Program.stage`, runs it and exports
what it made. `loop.run` walks the recipe's names through `registry.ALGORITHMS`
(dpo/registry.py) and never names one; each stage hands the next a `Model`. Adding an algorithm
is one module that calls `registry.register` (tests/test_loop.py registers one from the test file
alone) and its import line below.
"""

# Each module registers itself on dpo/registry.py; the registry lists them in the order of the
# article's recipe.
from dpo.algorithms import sft  # noqa: E402,F401
from dpo.algorithms import dpo  # noqa: E402,F401
from dpo.algorithms import rm  # noqa: E402,F401
from dpo.algorithms import online_dpo  # noqa: E402,F401
from dpo.algorithms import grpo  # noqa: E402,F401
from dpo.algorithms import rloo  # noqa: E402,F401
from dpo.algorithms import ppo  # noqa: E402,F401
from dpo.algorithms import kto  # noqa: E402,F401
from dpo.algorithms import iterative_dpo  # noqa: E402,F401

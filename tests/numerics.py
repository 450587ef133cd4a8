"""Comparing float32 results that differ only in the order of their sums.

Another row layout, vocabulary chunks, query blocks, a sharded mesh, microbatches or the
written-out matmul backward compute the same sums in another order. float32 rounds each order
differently, and which element a rounding lands on depends on the CPU's kernels (their blocking
differs between AVX2 and AVX-512 machines), so an element-wise tolerance tuned on one CPU fails
on another. These comparisons are per leaf and in norm, ||got - want|| / ||want||, against a
bound derived from the accumulation length, and each test that uses them also runs a deliberately
wrong variant that must exceed the same bound by `MISTAKE_FACTOR`.

The bound. A sum or inner product of n float32 terms, in any order, is within
gamma_n = n u / (1 - n u) of the exact value relative to the sum of the terms' magnitudes, with
u = 2**-24 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 2002, sec. 3.1 and
4.2); a matrix product inherits it column by column, ||dC||_F <= gamma_n ||A||_F ||B||_F. A
result that passes through `depth` such contractions in sequence (the layers' matmuls and
attention forward, then backward) carries at most about depth * gamma_n to first order, relative
to its operands' scale. `reorder_tol` is that worst case. Rounding errors of a reordered sum
behave like a random walk (about sqrt(n) u), so measured errors sit well below it, while a real
mistake (a dropped chunk, a missing cross-device sum, a shifted position) moves a leaf by a
relative 1e-2 to 1.

Adam. Parameters after AdamW steps are compared by their displacement from the common start,
p - p0. AdamW divides each element's moment by its own RMS, so the update is scale-free: an
element whose gradient |g| is large against the gradient's error d moves by a relative d / |g|,
and an element with |g| below d can move by up to 2 lr (a flipped sign) however small d is.
Summed over a leaf whose gradients have a density of about 1 / s near zero (s their RMS), the
squared norm of these changes is O(tau) for a relative gradient error tau = d / s, so the
displacement's norm-wise relative error is O(sqrt(tau)): `adam_tol` is 4 sqrt(tau), at the
worst-case tau above.
"""

import math
from typing import Any, NamedTuple

import jax
import optax
import numpy as np

U = 2.0 ** -24  # float32's unit roundoff (half of np.finfo(np.float32).eps)
# A deliberately wrong variant of a computation must miss the bound by at least this factor:
# loosening a bound until a mistake passes would show up as this factor failing.
MISTAKE_FACTOR = 100.0


def reorder_tol(n: int, depth: int = 1) -> float:
  """Worst-case norm-wise relative error of float32 results whose sums, each over at most `n`
  terms, are taken in another order, through `depth` contractions in sequence (module doc)."""
  gamma = n * U / (1.0 - n * U)
  return depth * gamma


def adam_tol(tau: float) -> float:
  """Norm-wise relative error of AdamW displacements when the gradients carry a relative
  error tau (module doc): O(sqrt(tau)), a flipped sign costing 2 lr."""
  return 4.0 * math.sqrt(tau)


def rel_err(got, want) -> float:
  """||got - want|| / ||want|| over the whole array (Frobenius norm), in float64; 0 when both
  are zero and inf when only `want` is."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  diff = float(np.linalg.norm((got - want).ravel()))
  scale = float(np.linalg.norm(want.ravel()))
  if scale == 0.0:
    return 0.0 if diff == 0.0 else math.inf
  return diff / scale


def excess(checks: dict) -> tuple[float, str]:
  """The worst leaf's rel_err / tol over `checks` {what: (got, want, tol)}, whose got and want
  are pytrees of one structure, with that leaf's name: at most 1 means within the bounds."""
  worst, where = 0.0, ""
  for what, (got, want, tol) in checks.items():
    flat_got, def_got = jax.tree_util.tree_flatten_with_path(got)
    flat_want, def_want = jax.tree_util.tree_flatten_with_path(want)
    assert def_got == def_want, (what, def_got, def_want)
    for (path, a), (_, b) in zip(flat_got, flat_want):
      ratio = rel_err(a, b) / tol
      if ratio >= worst:
        worst, where = ratio, f"{what}{jax.tree_util.keystr(path)} (bound {tol:.3g})"
  return worst, where


def assert_close(checks: dict) -> None:
  """Every leaf of every check {what: (got, want, tol)} within its norm-wise bound."""
  ratio, where = excess(checks)
  assert ratio <= 1.0, f"{where}: relative error in norm is {ratio:.3g}x the bound"


def assert_mistake_caught(checks: dict, mistake: str) -> None:
  """A deliberately wrong computation misses the same bounds by at least MISTAKE_FACTOR on
  some leaf: the bounds are tight enough to catch that mistake, with orders of magnitude to
  spare."""
  ratio, where = excess(checks)
  assert ratio >= MISTAKE_FACTOR, (f"{mistake}: its worst leaf {where} is only {ratio:.3g}x the "
                                   f"bound (want >= {MISTAKE_FACTOR:g}x)")


def forward_tol(model, seq_len: int) -> float:
  """The reordering bound of a forward pass's log-probs: its longest sums are over the
  vocabulary (the softmax's normaliser), the MLP's hidden units, the model width or the
  sequence (attention), through the forward half of `backprop_depth`'s contractions."""
  return reorder_tol(max(model.vocab_size, model.mlp_dim, model.d_model, seq_len),
                     backprop_depth(model.n_layers) // 2)


def implicit_reward_noise(beta: float, tau: float, *logps: float) -> float:
  """How far from 0 an implicit reward (or a mean or difference of them) of a policy equal to
  its reference can land when the two forwards are compiled apart: a reward is beta times a
  difference of two log-probs, each within tau of its magnitude, so at most 2 beta tau times
  the magnitudes of the log-probs `logps` it is made of."""
  return 2 * beta * tau * sum(abs(x) for x in logps)


def backprop_depth(n_layers: int) -> int:
  """Contractions in sequence on the longest path of a forward and backward pass: six a layer
  (the q/k/v projections, the scores, the weighted values, the output projection, gate/up,
  down) and the LM head, forward and back."""
  return 2 * (6 * n_layers + 1)


class Steps(NamedTuple):
  """Where some optimizer steps started and ended: `start` and `params` the trainable pytree
  before and after, `moments` AdamW's (mu, nu) after, all numpy."""
  start: Any
  params: Any
  moments: Any

  @classmethod
  def of(cls, start, state) -> "Steps":
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    (adam,) = [x for x in jax.tree.leaves(state.opt_state, is_leaf=is_adam) if is_adam(x)]
    host = lambda tree: jax.tree.map(np.asarray, tree)
    return cls(host(start), host(state.params), host((adam.mu, adam.nu)))


def step_checks(got: Steps, want: Steps, tau: float) -> dict:
  """The checks of two runs of the same AdamW steps whose gradients differ by reordering, at
  most a relative `tau`: the moments (mu linear in the gradients, nu quadratic) within tau each
  (2 tau for nu), the displacements p - p0 within adam_tol(tau) (module doc)."""
  moved = lambda s: jax.tree.map(lambda p, p0: p - p0, s.params, s.start)
  return {"mu": (got.moments[0], want.moments[0], tau),
          "nu": (got.moments[1], want.moments[1], 2 * tau),
          "displacement": (moved(got), moved(want), adam_tol(tau))}

"""The compiler's freed heap is handed back after each compile (dpo/hostmem.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from dpo import hostmem


def test_every_compile_is_followed_by_a_trim():
  assert hostmem.trim_after_compiles()  # glibc: the machines the project runs on
  assert hostmem.trim_after_compiles()  # installing twice is a no-op
  x = jax.device_put(np.ones(5, np.float32))
  f = jax.jit(lambda x: jnp.tanh(x) * 3.0)
  before = hostmem.trims
  y = f(x)
  after_one = hostmem.trims
  np.testing.assert_allclose(np.asarray(f(x)), np.asarray(y))  # cached: no compile, no trim
  assert after_one == before + 1 and hostmem.trims == after_one

"""The Pallas attention kernel against the XLA path on this machine's platform: errors and times.

    python -m dpo.tools.flash_check                  # on a TPU: the compiled kernel
    python -m dpo.tools.flash_check --rows=2 --slots=256 --heads=4 --kv_heads=2   # a CPU

For each mask the project builds (causal, packed segments with padding, shared-prefix branches,
a sliding window, a logit soft-cap), the kernel's output and its q/k/v gradients (of
sum(out * w), w random at real slots) against the XLA path's (models/transformer.py), both in
float32 and in --dtype: the norm-wise relative error ||got - want|| / ||want||, and in --dtype
each path's error against the float32 XLA result (the kernel keeps its tile scores in float32).
Then the forward + backward time of each path at that shape. tests/test_flash.py checks the
same on a CPU in interpret mode, against bounds.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from models import flash, transformer
from models.config import ModelConfig

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 8, "Rows (sequences) a call.")
flags.DEFINE_integer("slots", 1536, "Slots a row (a shared-prefix DPO row: 512 + 2 x 512).")
flags.DEFINE_integer("heads", 32, "Query heads.")
flags.DEFINE_integer("kv_heads", 8, "Key/value heads.")
flags.DEFINE_integer("head_dim", 64, "Head width.")
flags.DEFINE_integer("tile", 512, "The kernel's tile (--attention_tile).")
flags.DEFINE_string("dtype", "bfloat16", "The low-precision dtype compared beside float32.")
flags.DEFINE_integer("repeats", 5, "Timed calls a path (after one warm-up).")
flags.DEFINE_list("cases", ["causal", "packed", "branches", "window", "softcap"],
                  "The masks compared, from causal, packed, branches, window, softcap.")
flags.register_validator("cases", lambda names: set(names) <= {
    "causal", "packed", "branches", "window", "softcap"},
                         "--cases must name masks from causal, packed, branches, window, softcap")


def _rows(B: int, T: int, case: str):
  segment, branch = np.ones((B, T), np.int32), np.zeros((B, T), np.int32)
  if case in ("packed", "branches"):
    third = T // 3
    branch[:, third:2 * third], branch[:, 2 * third:] = 1, 2
  if case == "packed":
    segment[:, T // 2:] = 2
    segment[-1, T - T // 8:] = 0
  return (jnp.asarray(segment),
          jnp.asarray(branch) if case in ("packed", "branches") else None)


CASES = {"causal": (0, 0.0), "packed": (0, 0.0), "branches": (0, 0.0), "window": (300, 0.0),
         "softcap": (0, 50.0)}


def _paths(segment, branch, window, softcap, d):
  scale = d ** -0.5
  index = jnp.broadcast_to(jnp.arange(segment.shape[1]), segment.shape)
  slots = transformer.Slots(segment, index, branch)
  mask = transformer.attention_mask(slots, slots, window)
  cfg = ModelConfig(head_dim=d, attn_softcap=softcap)
  xla = lambda q, k, v: transformer.attend(cfg, q, k, v, mask)
  kernel = lambda q, k, v: flash.attention(q, k, v, segment, branch, window, scale=scale,
                                           softcap=softcap, block=FLAGS.tile)
  return {"kernel": kernel, "xla": xla}


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv):
  del argv
  B, T, H, K, d = FLAGS.rows, FLAGS.slots, FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim
  low = jnp.dtype(FLAGS.dtype)
  print(f"platform {jax.devices()[0].platform} ({jax.devices()[0].device_kind}); rows {B} x "
        f"{T} slots, {H} / {K} heads of {d}, tile {FLAGS.tile}")
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, T, K, H // K, d)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, T, K, d)), jnp.float32) for _ in range(2))
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  print(f"{'mask':<9} {'out f32':>9} {'grads f32':>9} | {FLAGS.dtype} vs f32 xla: "
        f"{'kernel':>8} {'xla':>8} | fwd+bwd ms: {'kernel':>8} {'xla':>8}")
  for case in FLAGS.cases:
    window, softcap = CASES[case]
    segment, branch = _rows(B, T, case)
    real = (segment != 0)[:, :, None, None, None]
    paths = _paths(segment, branch, window, softcap, d)

    def run(fn, dtype):
      loss = lambda q, k, v: jnp.sum(jnp.where(real, fn(q, k, v).astype(jnp.float32) * w, 0.0))
      step = jax.jit(lambda q, k, v: (jnp.where(real, fn(q, k, v), 0),
                                      jax.grad(loss, (0, 1, 2))(q, k, v)))
      args = [x.astype(dtype) for x in (q, k, v)]
      out = jax.block_until_ready(step(*args))
      start = time.perf_counter()
      for _ in range(FLAGS.repeats):
        jax.block_until_ready(step(*args))
      return out, (time.perf_counter() - start) / FLAGS.repeats * 1e3

    (o32, g32), _ = run(paths["xla"], jnp.float32)
    (ok32, gk32), _ = run(paths["kernel"], jnp.float32)
    (olo, _), t_kernel = run(paths["kernel"], low)
    (xlo, _), t_xla = run(paths["xla"], low)
    grads = max(_rel(a, b) for a, b in zip(gk32, g32))
    print(f"{case:<9} {_rel(ok32, o32):9.2e} {grads:9.2e} | {'':>21}{_rel(olo, o32):8.2e} "
          f"{_rel(xlo, o32):8.2e} | {'':>12}{t_kernel:8.2f} {t_xla:8.2f}")


if __name__ == "__main__":
  app.run(main)

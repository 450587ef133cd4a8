"""The KL-spike guard: host-side bookkeeping the KL-guard hook consults once per DPO step.

The step reports `kl`, the mean token-level KL(pi || pi_ref) over the batch's completion tokens (see
`dpo.logprobs.token_kl`), or the hook hands in an estimate of it (dpo/hooks.py). A spike is a KL
above `kl_max`, or above `spike_factor` times the largest of the last `window` accepted values. The
relative test waits until `window` values exist (KL grows from exactly 0 at the first LoRA step,
many-fold per step at first) and ignores KL below `spike_min`. It compares with the window's largest
value, not its mean: during warmup KL grows several-fold within a window while growing only a little
per step (docs/presets.md has the default task's figures), and batch-to-batch noise stays under the
window's maximum; an update gone wrong jumps far past it. The runner answers a spike by rolling back
to the last good checkpoint and cutting the learning rate 10x; that policy lives in dpo/hooks.py and
dpo/runner.py, the detection here, so each can be tested alone.
"""

from __future__ import annotations

import math
from typing import Sequence


class SpikeDetector:
  """The KL-spike test of the module docstring, with its window of accepted values."""

  def __init__(self, kl_max: float, spike_factor: float, window: int, spike_min: float = 0.0,
               history: Sequence[float] = ()):
    if window < 1:
      raise ValueError(f"kl_window must be >= 1, got {window}")
    self.kl_max, self.spike_factor, self.window = kl_max, spike_factor, window
    self.spike_min = spike_min
    self.history = list(history)[-window:]

  @property
  def enabled(self) -> bool:
    return self.kl_max > 0 or self.spike_factor > 0

  def check(self, kl: float) -> str | None:
    """None if `kl` is acceptable (it joins the history), else the reason it is a spike.

    A non-finite KL comes from a step the non-finite guard already skipped; it is neither a
    spike nor history.
    """
    if not math.isfinite(kl):
      return None
    if self.kl_max > 0 and kl > self.kl_max:
      return f"kl {kl:.4g} > kl_max {self.kl_max:.4g}"
    if self.spike_factor > 0 and len(self.history) >= self.window and kl > self.spike_min:
      top = max(self.history)
      if kl > self.spike_factor * top:
        return (f"kl {kl:.4g} > kl_spike_factor {self.spike_factor:g} x recent max {top:.4g} "
                f"(last {len(self.history)} steps)")
    self.history = (self.history + [kl])[-self.window:]
    return None

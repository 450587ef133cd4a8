"""What a jitted step reads: typed batches whose optional parts are None.

On the host, a dataset is a table of numpy arrays by name (`tokens`, `shared_tokens`,
`ref_logps`, ...; dpo/data.py, dpo/packing.py, dpo/reference.py): the form that is cached as
.npz, fingerprinted per field and indexed by the loader. At the dispatch of a step the loader's
rows become one of the pytrees below (`Rows.of`, `PairBatch.of`), so the code inside `jit`
reads fields and asks only whether an optional part is None, never which keys a dict holds.

Shapes: N sequences (SFT) or B pairs, T slots a sequence; R shared-prefix rows of S slots with
K scored slots each; P pairs a packed row. Fields are typed as the host's numpy arrays; inside
`jit` the same fields are jax arrays (or ShapeDtypeStructs when lowered abstractly).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np

from models import transformer


class Rows(NamedTuple):
  """Token rows: [N, T] (SFT, evaluation) or [B, 2, T] (a pair's chosen and rejected rows)."""
  tokens: np.ndarray       # int32 token ids
  positions: np.ndarray    # int32 RoPE positions
  segment_ids: np.ndarray  # int32, 0 marks padding
  loss_mask: np.ndarray    # float32, 1 on the scored (completion) tokens

  @classmethod
  def of(cls, arrays: Mapping[str, np.ndarray]) -> "Rows":
    return cls(*(arrays[name] for name in cls._fields))

  def inputs(self) -> transformer.Inputs:
    """The forward's inputs of [N, T] rows (pair rows: one side, after a vmap over axis 1)."""
    return transformer.Inputs(self.tokens, self.positions, self.segment_ids)


class SharedRows(NamedTuple):
  """Shared-prefix rows (prompt | chosen | rejected, dpo/packing.py) and their scoring plan."""
  tokens: np.ndarray        # [R, S] int32
  positions: np.ndarray     # [R, S] int32, the rejected branch restarting after the prompt
  segment_ids: np.ndarray   # [R, S] int32, 0 padding (packed: the pair's slot in its row + 1)
  branch: np.ndarray        # [R, S] int32, 0 prompt, 1 chosen, 2 rejected
  score_from: np.ndarray    # [R, K] int32, the slot whose hidden state predicts the token
  score_target: np.ndarray  # [R, K] int32, the scored token
  score_side: np.ndarray    # [R, K] int32, 0 chosen, 1 rejected
  score_rank: np.ndarray    # [R, K] float32, its rank within its completion (from 1)
  score_weight: np.ndarray  # [R, K] float32, its loss-mask weight (0 on padding entries)

  @classmethod
  def of(cls, arrays: Mapping[str, np.ndarray]) -> "SharedRows":
    """From the host arrays `shared_tokens`, `shared_positions`, `shared_segment_ids`,
    `shared_branch` and the `score_*` arrays of the same names."""
    return cls(*(arrays[name if name.startswith("score_") else "shared_" + name]
                 for name in cls._fields))

  def inputs(self) -> transformer.Inputs:
    return transformer.Inputs(self.tokens, self.positions, self.segment_ids, self.branch)


class Packed(NamedTuple):
  """How the pairs of packed shared-prefix rows (--packing) are laid out."""
  score_pair: np.ndarray      # [R, K] int32, the slot (in its row) of each scored token's pair
  pair_valid: np.ndarray      # [R, P] float32, 1 where the row's slot holds a pair
  pair_index: np.ndarray      # [B] int32, where each pair's sums land (row x P + slot)
  # [R, S] int32, each slot's place in the unpacked shared rows, whose LoRA dropout masks it
  # takes (None: each packed slot draws its own, which makes the masks depend on the packing)
  dropout_source: np.ndarray | None = None

  @classmethod
  def of(cls, arrays: Mapping[str, np.ndarray]) -> "Packed":
    return cls(arrays["score_pair"], arrays["pair_valid"], arrays["pair_index"],
               arrays.get("dropout_source"))


class RefStats(NamedTuple):
  """Precomputed reference statistics (--precompute_ref, dpo/reference.py)."""
  logps: np.ndarray         # [B, 2] summed log-probs of chosen and rejected, nats
  shared_logps: np.ndarray  # [B, 2] the same over each side's first min(|y_w|, |y_l|) tokens

  @classmethod
  def of(cls, arrays: Mapping[str, np.ndarray]) -> "RefStats":
    return cls(arrays["ref_logps"], arrays["ref_shared_logps"])


class PairBatch(NamedTuple):
  """A batch of preference pairs: always the [B, 2, T] rows; the shared-prefix rows the
  forwards run on instead when prefix sharing applies, their packing with --packing, and the
  precomputed reference statistics with --precompute_ref."""
  pairs: Rows
  shared: SharedRows | None = None
  packed: Packed | None = None
  ref: RefStats | None = None
  margin: np.ndarray | None = None  # [B] float32, the reward model's per-pair margin (rm)

  @classmethod
  def of(cls, arrays: Mapping[str, np.ndarray]) -> "PairBatch":
    """The batch of a table of host arrays (the loader's rows of one step)."""
    has = lambda name: name in arrays
    return cls(Rows.of(arrays),
               SharedRows.of(arrays) if has("shared_tokens") else None,
               Packed.of(arrays) if has("pair_index") else None,
               RefStats.of(arrays) if has("ref_logps") else None, arrays.get("margin"))

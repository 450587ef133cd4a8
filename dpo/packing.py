"""Shared-prefix rows: one row per pair, laid out prompt | chosen | rejected (arXiv 2410.20305).

The pair arrays of dpo/data.py hold each prompt twice ([N, 2, T]: chosen row, rejected row), so
a step that scores both rows with the policy and the reference computes every prompt four
times. `shared_prefix` lays each pair out once:

    shared_tokens      [BOS p p p | c c EOS | r r r EOS | PAD]
    shared_positions   [0   1 2 3 | 4 5 6   | 4 5 6 7   | 0  ]   rejected restarts after the prompt
    shared_segment_ids [1   1 1 1 | 1 1 1   | 1 1 1 1   | 0  ]   0 marks padding
    shared_branch      [0   0 0 0 | 1 1 1   | 2 2 2 2   | 0  ]   0 prompt, 1 chosen, 2 rejected

and `transformer.attention_mask` keeps branches 1 and 2 apart, so every slot sees exactly the
keys it saw in its own row. The scoring plan (`score_*`, [N, K], K the most scored tokens of any
pair) lists each scored token once: the slot whose hidden state predicts it (`score_from`), the
token (`score_target`), its side (0 chosen, 1 rejected), its rank within its completion (the
running loss-mask sum, for LD-DPO's shared length) and its loss-mask weight (0 on padding entries). Only those K hidden
states reach the LM head (`logprobs.shared_pair_stats`).

Positions, tokens and weights are copied from the pair rows, so the log-probs equal the
unshared layout's by construction (tests/test_packing.py pins it to 1e-5).
"""

from __future__ import annotations

import numpy as np

SHARED_KEYS = ("shared_tokens", "shared_positions", "shared_segment_ids", "shared_branch")
SCORE_KEYS = ("score_from", "score_target", "score_side", "score_rank", "score_weight")
_PAIR_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def prompt_lengths(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, str | None]:
  """Per pair, the length of the prefix both rows share unscored; and why sharing does not apply
  (None if it does): each row must be one segment then padding, with at least one shared token."""
  tok, pos, seg, mask = (np.asarray(arrays[k]) for k in _PAIR_KEYS)
  n, _, t = tok.shape
  length = (seg != 0).sum(-1)                                   # [N, 2] real tokens
  if not ((seg == (np.arange(t) < length[..., None])).all()):
    return np.zeros(n, np.int64), "a pair row is not one segment followed by padding"
  same = ((tok[:, 0] == tok[:, 1]) & (pos[:, 0] == pos[:, 1]) & (seg[:, 0] != 0) & (seg[:, 1] != 0)
          & (mask[:, 0] == 0) & (mask[:, 1] == 0))
  prompt = np.where(same.all(-1), t, same.argmin(-1))           # first slot that differs
  if (prompt == 0).any():
    return prompt, f"pair {int(np.argmin(prompt))} has no shared unscored prefix"
  if (mask[..., 0] != 0).any():
    return prompt, "a row scores its first token (nothing predicts it)"
  return prompt, None


def shared_prefix(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray] | None, str]:
  """(shared-prefix arrays of every pair, a one-line summary), or (None, the reason it does not
  apply). `arrays` are the [N, 2, T] pair arrays of `data.tokenize_pairs`."""
  prompt, why = prompt_lengths(arrays)
  if why is not None:
    return None, f"prefix sharing does not apply: {why}"
  tok, pos, seg, mask = (np.asarray(arrays[k]) for k in _PAIR_KEYS)
  n = tok.shape[0]
  length = (seg != 0).sum(-1)
  scored = (mask != 0).sum(-1)
  S = _round_up(int((length.sum(-1) - prompt).max()), 8)
  K = _round_up(int(scored.sum(-1).max()), 8)
  out = {k: np.zeros((n, S), np.int32) for k in SHARED_KEYS}
  out.update({k: np.zeros((n, K), np.int32) for k in SCORE_KEYS[:3]})
  out.update({k: np.zeros((n, K), np.float32) for k in SCORE_KEYS[3:]})
  for i in range(n):
    p, (lw, ll) = int(prompt[i]), length[i]
    slots = [np.arange(lw), np.arange(p, ll)]                   # source slots of chosen / rejected
    start = [0, lw - p]                                         # shared slot = source + start
    for j in range(2):
      dst = slots[j] + start[j]
      out["shared_tokens"][i, dst] = tok[i, j, slots[j]]
      out["shared_positions"][i, dst] = pos[i, j, slots[j]]
      out["shared_segment_ids"][i, dst] = seg[i, j, slots[j]]
      out["shared_branch"][i, dst] = np.where(slots[j] < p, 0, j + 1)
    k = 0
    for j in range(2):
      t = np.flatnonzero(mask[i, j])                            # scored source slots (all >= p)
      prev = t - 1
      out["score_from"][i, k:k + len(t)] = np.where(prev < p, prev, prev + start[j])
      out["score_target"][i, k:k + len(t)] = tok[i, j, t]
      out["score_side"][i, k:k + len(t)] = j
      out["score_rank"][i, k:k + len(t)] = np.cumsum(mask[i, j, t])
      out["score_weight"][i, k:k + len(t)] = mask[i, j, t]
      k += len(t)
  unshared = 2 * n * tok.shape[-1]
  summary = (f"prefix sharing: {n} pairs in rows of {S} slots (was 2 x {tok.shape[-1]}; "
             f"{n * S / unshared:.0%} of the unshared slots), {K} scored slots per row")
  return out, summary

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
running loss-mask sum, for LD-DPO's shared length) and its loss-mask weight (0 on padding
entries). Only those K hidden states reach the LM head (`logprobs.shared_pair_stats`).

Positions, tokens and weights are copied from the pair rows, so the log-probs equal the
unshared layout's by construction (tests/test_packing.py).

Packing (`Packer`, --packing) places several pairs' shared rows one after another in rows of L
slots (L the longest shared row), so short pairs stop paying for the longest one's padding:

    shared_segment_ids [1 1 1 1 1 1 | 2 2 2 2 | 3 3 3 3 3 3 3 | 0 0]   pair's slot in the row + 1
    shared_positions   [0 1 2 3 2 3 | 0 1 2 1 | 0 1 2 3 4 3 4 | 0 0]   restart with each pair

Tokens, positions and branches are each pair's shared row; the segment id (the pair's slot in the
row) keeps pairs apart in `transformer.attention_mask`. The scoring plan gains `score_pair` (the
slot of each scored token's pair), `logprobs.shared_pair_stats` sums it into a [R, P, 2] layout
(`pair_valid` marks the slots that hold a pair) and gathers each pair's sums back to its
position in the batch (`pair_index`), so the loss sees the [B, 2] statistics of the unpacked
layout, in the same order. Each global batch is packed on the host, first-fit decreasing, within
each process's block of pairs and each microbatch (rows i, i + K, ... hold microbatch i's
pairs), into R rows, R the smallest of a few buckets that fits: at most four shapes compile.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

SHARED_KEYS = ("shared_tokens", "shared_positions", "shared_segment_ids", "shared_branch")
SCORE_KEYS = ("score_from", "score_target", "score_side", "score_rank", "score_weight")
_PAIR_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


def round_up(n: int, m: int) -> int:
  """The least multiple of m that is >= n."""
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
  S = round_up(int((length.sum(-1) - prompt).max()), 8)
  K = round_up(int(scored.sum(-1).max()), 8)
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


def first_fit_decreasing(lengths, scored, slots: int, scored_slots: int) -> list[list[int]]:
  """Bins of item indices: items by decreasing length (ties in index order), each into the
  first bin with room for its length (`slots` a bin) and its scored tokens (`scored_slots`)."""
  bins: list[list[int]] = []
  room: list[tuple[int, int]] = []
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    for b, (free, free_scored) in enumerate(room):
      if lengths[i] <= free and scored[i] <= free_scored:
        bins[b].append(i)
        room[b] = (free - lengths[i], free_scored - scored[i])
        break
    else:
      bins.append([i])
      room.append((slots - lengths[i], scored_slots - scored[i]))
  return bins


def choose_buckets(needs, largest: int, n: int = 3) -> tuple[int, ...]:
  """At most `n` row counts, then `largest` (which always fits), that minimise the rows of
  batches needing `needs` rows when each takes the smallest bucket that fits (a batch needing
  more than every chosen one takes `largest`). Dynamic programming over the distinct needs."""
  vals, counts = np.unique(np.asarray(needs, np.int64), return_counts=True)
  keep = vals < largest
  vals, counts = [int(v) for v in vals[keep]], counts[keep]
  cum = np.concatenate([[0], np.cumsum(counts)]).astype(int)  # batches needing <= vals[j - 1]
  # best[t, j]: (rows of the batches needing <= vals[j], buckets) with t buckets, the top vals[j]
  best: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
  for j, v in enumerate(vals):
    best[1, j] = (v * cum[j + 1], (v,))
    for t in range(2, n + 1):
      options = [(best[t - 1, i][0] + v * (cum[j + 1] - cum[i + 1]), best[t - 1, i][1] + (v,))
                 for i in range(j) if (t - 1, i) in best]
      if options:
        best[t, j] = min(options)
  total = lambda key: best[key][0] + largest * (cum[-1] - cum[key[1] + 1])
  chosen = best[min(best, key=total)][1] if best else ()
  return (*chosen, largest)


@dataclasses.dataclass
class Packer:
  """Packs the shared rows of each global batch's pairs into R rows of `slots` slots.

  `shared` holds `shared_prefix`'s arrays of every pair. The batch's `blocks` process blocks (see
  `sharding.process_batch_block`) and, inside each, its `microbatches` microbatches (batch
  positions i, i + K, ...) each pack their own pairs into their own rows (rows i, i + K, ... of
  the block's), so every process builds only its own rows and every microbatch of rows holds
  exactly the pairs of the same microbatch of the pair arrays. R is a multiple of `multiple`
  (the mesh's batch shards x microbatches) taken from `buckets` (`fit` chooses them).
  """
  shared: dict
  global_batch: int
  blocks: int = 1
  microbatches: int = 1
  multiple: int = 1
  buckets: tuple[int, ...] = ()

  def __post_init__(self):
    seg = self.shared["shared_segment_ids"]
    self.length = (seg != 0).sum(1)                      # [N] slots of each pair's shared row
    self.scored = (self.shared["score_weight"] != 0).sum(1)  # [N] its scored tokens
    self.slots = seg.shape[1]
    group = self.global_batch // (self.blocks * self.microbatches)
    fit_shortest = int((np.cumsum(np.sort(self.length)) <= self.slots).sum())
    self.pairs_per_row = max(1, min(group, fit_shortest))  # P: no row can hold more
    # The LM head runs on `scored_slots` hidden states a row: room for 1.5x the data's share of
    # scored slots, so a row is rarely closed for want of scored room (docs/benchmarks.md).
    share = self.scored.sum() / max(int(self.length.sum()), 1)
    per_pair = self.shared["score_from"].shape[1]
    self.scored_slots = min(self.slots, self.pairs_per_row * per_pair,
                            max(per_pair, round_up(int(np.ceil(1.5 * share * self.slots)), 8)))
    self.buckets = self.buckets or (self.global_batch,)

  def _bins(self, batch: np.ndarray) -> dict[tuple[int, int], list[np.ndarray]]:
    """{(block, microbatch): its rows, each the batch positions of its pairs in slot order}."""
    per_block, k = len(batch) // self.blocks, self.microbatches
    out = {}
    for p in range(self.blocks):
      for i in range(k):
        pos = np.arange(p * per_block + i, (p + 1) * per_block, k)
        bins = first_fit_decreasing(self.length[batch[pos]], self.scored[batch[pos]], self.slots,
                                    self.scored_slots)
        out[p, i] = [pos[b] for b in bins]
    return out

  def _need(self, bins) -> int:
    """The fewest rows (a multiple of `multiple`) that hold every group's rows."""
    most = max(map(len, bins.values()))
    return round_up(most * self.blocks * self.microbatches, self.multiple)

  def fit(self, batches: np.ndarray) -> str:
    """Chooses the buckets for `batches` ([batches, global_batch] pair indices: the loader's
    first epoch); returns the one-line summary with the fill rate they reach."""
    needs = [self._need(self._bins(b)) for b in batches]
    self.buckets = choose_buckets(needs, self.global_batch)
    used = sum(min(b for b in self.buckets if b >= n) for n in needs)
    tokens = int(sum(self.length[b].sum() for b in batches))
    one_a_row = tokens / (len(batches) * self.global_batch * self.slots)
    return (f"packing: {self.global_batch} pairs a step into rows of {self.slots} slots (at "
            f"most {self.pairs_per_row} pairs and {self.scored_slots} scored slots a row), "
            f"{{{', '.join(map(str, self.buckets))}}} rows; over the first {len(batches)} "
            f"batches {used / len(batches):.1f} rows a step, fill rate "
            f"{tokens / (used * self.slots):.0%} of the slots ({one_a_row:.0%} at one pair a row)")

  def plan(self, batch: np.ndarray) -> tuple[int, list[tuple[int, np.ndarray]]]:
    """(R, [(global row, the batch positions of its pairs in slot order)]) for the global batch
    `batch` (pair indices); R is the smallest bucket that holds it."""
    bins = self._bins(batch)
    need = self._need(bins)
    R = min(b for b in self.buckets if b >= need)
    per_block = R // self.blocks
    return R, [(p * per_block + j * self.microbatches + i, b)
               for (p, i), group in bins.items() for j, b in enumerate(group)]

  def pack(self, batch: np.ndarray, block: int = 0) -> dict[str, np.ndarray]:
    """Process block `block`'s rows of the global batch `batch` (pair indices): the
    shared-row and scoring-plan arrays ([R / blocks, slots], [R / blocks, scored_slots]),
    `score_pair`, `pair_valid` [R / blocks, P], `dropout_source` [R / blocks, slots] (each slot's
    place in its microbatch's unpacked shared rows, row x slots + slot) and, for the block's
    pairs, `pair_index` [B / blocks] (row within its microbatch x P + slot: where its sums
    land)."""
    R, placed = self.plan(batch)
    n, P = R // self.blocks, self.pairs_per_row
    out = {k: np.zeros((n, self.slots), np.int32) for k in SHARED_KEYS}
    out.update({k: np.zeros((n, self.scored_slots), self.shared[k].dtype) for k in SCORE_KEYS})
    out["score_pair"] = np.zeros((n, self.scored_slots), np.int32)
    out["pair_valid"] = np.zeros((n, P), np.float32)
    out["dropout_source"] = np.zeros((n, self.slots), np.int32)
    index = np.zeros(len(batch), np.int32)
    for row, positions in placed:
      r, o, q = row - block * n, 0, 0
      for j, b in enumerate(positions):
        index[b] = row // self.microbatches * P + j
        if not 0 <= r < n:
          continue  # another process's row
        i = batch[b]
        length, scored = self.length[i], self.scored[i]
        for k in SHARED_KEYS:
          out[k][r, o:o + length] = self.shared[k][i, :length]
        out["shared_segment_ids"][r, o:o + length] = j + 1
        # Its slots' LoRA dropout masks: those of its own shared row, row b // K of its
        # microbatch's unpacked rows (models/transformer.py DropoutSource).
        out["dropout_source"][r, o:o + length] = (b // self.microbatches * self.slots
                                                  + np.arange(length))
        for k in SCORE_KEYS:
          out[k][r, q:q + scored] = self.shared[k][i, :scored]
        out["score_from"][r, q:q + scored] += o
        out["score_pair"][r, q:q + scored] = j
        out["pair_valid"][r, j] = 1.0
        o, q = o + length, q + scored
    local = len(batch) // self.blocks
    out["pair_index"] = index[block * local:(block + 1) * local]
    return out


# --- SFT packing (--sft_packing) -------------------------------------------------------------------

SEQUENCE_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


def best_fit_decreasing(lengths, slots: int) -> list[list[int]]:
  """Bins of item indices: items by decreasing length (ties in index order), each into the bin
  with the least room that still holds it (a new bin when none does), as TRL's "bfd" packing;
  within a bin, items in the order they were placed."""
  bins: list[list[int]] = []
  rooms: list[tuple[int, int]] = []                     # sorted (free slots, bin)
  for i in sorted(range(len(lengths)), key=lambda i: -int(lengths[i])):
    n = int(lengths[i])
    at = bisect.bisect_left(rooms, (n, -1))
    if at == len(rooms):
      bins.append([i])
      free, b = slots - n, len(bins) - 1
    else:
      free, b = rooms.pop(at)
      bins[b].append(i)
      free -= n
    bisect.insort(rooms, (free, b))
  return bins


def pack_sequences(arrays: dict[str, np.ndarray], slots: int,
                   what: str = "SFT examples") -> tuple[dict[str, np.ndarray], str]:
  """(rows of `slots` slots each holding whole examples of the [N, T] `arrays` one after
  another, best-fit decreasing; a one-line summary with the fill rate). Each example keeps its
  tokens, positions (so they restart at its start) and loss mask; its segment id is its slot in
  the row + 1, so no example attends to another (`transformer.attention_mask`). An example's first
  token must be unscored: in a packed row the slot before it is another example's."""
  tok, pos, seg, mask = (np.asarray(arrays[k]) for k in SEQUENCE_KEYS)
  n, t = tok.shape
  length = (seg != 0).sum(-1)
  if not (seg == (np.arange(t) < length[:, None])).all():
    raise ValueError(f"--sft_packing: a row of the {what} is not one segment followed by padding")
  if (mask[:, 0] != 0).any():
    raise ValueError(f"--sft_packing: {what} row {int(np.argmax(mask[:, 0] != 0))} scores its "
                     f"first token, which a packed row would predict from another example")
  if length.max() > slots:
    raise ValueError(f"--sft_packing={slots}: shorter than the longest of the {what} "
                     f"({int(length.max())} tokens)")
  bins = best_fit_decreasing(length, slots)
  out = {k: np.zeros((len(bins), slots), arrays[k].dtype) for k in SEQUENCE_KEYS}
  for r, items in enumerate(bins):
    o = 0
    for j, i in enumerate(items):
      m = int(length[i])
      for k in ("tokens", "positions", "loss_mask"):
        out[k][r, o:o + m] = arrays[k][i, :m]
      out["segment_ids"][r, o:o + m] = j + 1
      o += m
  fill = length.sum() / (len(bins) * slots)
  summary = (f"sft packing: {n} {what} in {len(bins)} rows of {slots} slots (at most "
             f"{max(map(len, bins))} a row), fill rate {fill:.0%} of the slots "
             f"({length.sum() / (n * t):.0%} at one a row of {t})")
  return out, summary

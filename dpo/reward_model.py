"""A reward model's scores: the scalar head `score` [D, 1] on the transformer's final hidden state
at a sequence's last scored token, as transformers' `*ForSequenceClassification` reads the last
non-padding token with `score.weight`. Pair rows are right-padded, so that is the last slot whose
segment id is not 0; in shared-prefix rows (--prefix_sharing) it is the last slot of each side's
branch.

The rm stage (dpo/algorithms/rm.py) trains such a model and the judges (dpo/judges.py) score with
one; both read it from here, and nothing here imports either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpo import checkpoint, registry
from dpo.batches import PairBatch, Rows
from models import transformer


def last_slot(valid_BT: jax.Array) -> jax.Array:
  """[B] int32: the last slot where `valid_BT` holds (0 for a row with none)."""
  T = valid_BT.shape[1]
  return jnp.max(jnp.where(valid_BT, jnp.arange(T), 0), axis=1)


def sequence_rewards(model, params, score_D1, rows: Rows) -> jax.Array:
  """[N] float32 rewards of right-padded sequences `rows` ([N, T]): the final hidden state at
  each one's last token that is not padding times `score_D1` (a judge's scores)."""
  inputs = transformer.Inputs(rows.tokens, rows.positions, rows.segment_ids)
  h_NTD = transformer.hidden(model, params, inputs)
  last_N = last_slot(rows.segment_ids != 0)
  h_ND = jnp.take_along_axis(h_NTD, last_N[:, None, None], axis=1)[:, 0]
  return jnp.einsum("nd,do->n", h_ND.astype(jnp.float32), score_D1.astype(jnp.float32))


def rewards(model, params, score_D1, batch: PairBatch, adapter=None) -> jax.Array:
  """[B, 2] float32 rewards of chosen and rejected: the final hidden state at each sequence's
  last scored token times `score_D1`. Runs on the shared-prefix rows when the batch has them
  (one pair a row; packed rows are refused by the stage)."""
  if batch.shared is None:
    rows = batch.pairs
    B, _, T = rows.tokens.shape
    flat = lambda x: x.reshape(2 * B, T)
    inputs = transformer.Inputs(flat(rows.tokens), flat(rows.positions), flat(rows.segment_ids))
    h_NTD = transformer.hidden(model, params, inputs, adapter)
    last_N = last_slot(inputs.segment_ids_BT != 0)
    h_ND = jnp.take_along_axis(h_NTD, last_N[:, None, None], axis=1)[:, 0]
    h_B2D = h_ND.reshape(B, 2, -1)
  else:
    sh = batch.shared
    h_BSD = transformer.hidden(model, params, sh.inputs(), adapter)
    live_BS = sh.segment_ids != 0
    last_B2 = jnp.stack([last_slot(live_BS & (sh.branch == b)) for b in (1, 2)], axis=1)
    h_B2D = jnp.take_along_axis(h_BSD, last_B2[:, :, None], axis=1)
  return jnp.einsum("bsd,do->bs", h_B2D.astype(jnp.float32), score_D1.astype(jnp.float32))


def load(path: str, model_cfg, mesh) -> dict:
  """A reward model the stage saved (checkpoints/rm_model): the transformer's params and
  `score`, sharded for `mesh` (without an LM head when it was imported from a sequence
  classifier, which has none); a checkpoint of another stage is a CheckpointError naming it."""
  meta = checkpoint.read_meta(path)
  stage = meta.get("stage")
  if registry.judge_stage(stage or "") is None:
    raise checkpoint.CheckpointError(f"{path}: a {stage!r} checkpoint, not a reward model "
                                     f"(checkpoints/rm_model of an rm stage)")
  specs = {**transformer.param_specs(model_cfg), "score": transformer.score_spec(model_cfg)}
  if not any(e["path"].startswith("['lm_head']") for e in meta.get("leaves", ())):
    specs.pop("lm_head", None)
  like = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      transformer.abstract(specs), transformer.shardings(specs, mesh))
  return checkpoint.load(path, like)[0]

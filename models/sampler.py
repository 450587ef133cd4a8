"""Autoregressive sampling with a KV cache: one prefill, then a jitted decode loop.

Layout: prompts are LEFT-padded to a common length P, so every row's last prompt token sits in
slot P - 1 and all rows decode in lockstep (new token i goes to slot P + i). RoPE positions are
per row (0 at the row's first real token), and padding slots have segment id 0, so they are
never attended to: a prompt's continuation does not depend on the other prompts in its batch.

Randomness: the key for row b at step i is fold_in(fold_in(key, i), b), so a row's sample
depends only on (key, its row index, its prompt), never on the batch size or the device count.
The same function samples the policy (base + LoRA: pass its `transformer.Adapter`) and the
reference (base alone: no adapter).

Shape suffixes as in models/transformer.py; P prompt length, N new tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import sharding, transformer

if TYPE_CHECKING:
  from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Static decoding settings (hashable: part of the jit cache key).

  temperature 0 means greedy; top_k 0 and top_p 1.0 switch those filters off. Ids at or above
  `vocab_limit` (model rows the tokenizer never produces) and the ids in `banned_ids` (padding,
  BOS) are never sampled; vocab_limit 0 allows every row. A row ends at `eos_id` or at any of
  `stop_ids` (a chat template's end-of-turn tokens), which is kept as its last token.
  """
  max_new_tokens: int
  eos_id: int
  pad_id: int
  stop_ids: tuple[int, ...] = ()
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  vocab_limit: int = 0
  banned_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if self.max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class Samples(NamedTuple):
  tokens: jax.Array    # [B, N] int32; pad_id after a row's EOS (the EOS itself is kept)
  lengths: jax.Array   # [B] int32 generated tokens, EOS included
  finished: jax.Array  # [B] bool: the row emitted EOS within N tokens


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, multiple: int = 1, length: int = 0):
  """(tokens [B, P], segment_ids [B, P]) numpy int32, each prompt right-aligned.

  P is the longest prompt, or `length` if longer, rounded up to `multiple` (fewer distinct
  shapes, fewer compiles: batches padded to one `length` share one compiled sampler).
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token (e.g. BOS)")
  P = -(-max(length, *(len(p) for p in prompts)) // multiple) * multiple
  tokens = np.full((len(prompts), P), pad_id, np.int32)
  segments = np.zeros((len(prompts), P), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, P - len(p):] = p
    segments[i, P - len(p):] = 1
  return tokens, segments


def filter_logits(logits_BV: jax.Array, scfg: SamplingConfig) -> jax.Array:
  """Temperature, then top-k, then top-p (nucleus) on float32 logits; removed entries -> -inf."""
  neg = jnp.float32(-jnp.inf)
  logits = logits_BV.astype(jnp.float32)
  V = logits.shape[-1]
  ids = jnp.arange(V)
  banned = jnp.zeros((V,), bool)
  if scfg.vocab_limit:
    banned = banned | (ids >= scfg.vocab_limit)
  for i in scfg.banned_ids:
    banned = banned | (ids == i)
  logits = jnp.where(banned, neg, logits)
  logits = logits / scfg.temperature
  if 0 < scfg.top_k < V:
    kth_B1 = jax.lax.top_k(logits, scfg.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth_B1, neg, logits)
  if scfg.top_p < 1.0:
    sorted_BV = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    n_keep = jnp.maximum(jnp.sum(mass_before < scfg.top_p, axis=-1, keepdims=True), 1)
    threshold_B1 = jnp.take_along_axis(sorted_BV, n_keep - 1, axis=-1)
    logits = jnp.where(logits < threshold_B1, neg, logits)
  return logits


def sample_token(key: jax.Array, step: jax.Array, logits_BV: jax.Array,
                 scfg: SamplingConfig) -> jax.Array:
  """[B] int32 next tokens; row b uses fold_in(fold_in(key, step), b)."""
  if scfg.temperature == 0.0:
    logits = filter_logits(logits_BV, dataclasses.replace(scfg, temperature=1.0, top_k=0,
                                                          top_p=1.0))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = filter_logits(logits_BV, scfg)
  step_key = jax.random.fold_in(key, step)
  rows = jnp.arange(logits.shape[0])
  keys = jax.vmap(lambda r: jax.random.fold_in(step_key, r))(rows)
  return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


class Prompts(NamedTuple):
  """Left-padded prompts (`left_pad`): [B, P] int32 tokens and segment ids (0 = padding)."""
  tokens_BP: jax.Array
  segment_ids_BP: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "scfg", "samples_per_prompt"))
def generate(cfg: ModelConfig, scfg: SamplingConfig, params, prompts: Prompts, key: jax.Array,
             adapter: transformer.Adapter | None = None,
             samples_per_prompt: int = 1) -> Samples:
  """Samples up to `max_new_tokens` after each left-padded prompt; stops a row at EOS.

  `samples_per_prompt` n > 1 says the B rows are B / n prompts tiled n times (row j * B / n + b
  is prompt b, the layout of GRPO's groups and online DPO's pairs): the B / n prompts are
  prefilled once and their cache and last logits copied to the n rows of each, so the samples
  are those of the tiled prompts (the same rows and keys) for 1 / n of the prefill.

  `adapter` is the policy's LoRA delta (None: the base alone). The loop ends early once every
  row has finished. `key` is a typed or raw PRNG key. The layers run as a Python loop over
  per-layer weights and per-layer caches (`transformer.hidden` with `Decode`); `params["layers"]`
  may be stacked, as training holds them (sliced apart once per call), or already a
  `transformer.unstack_layers` tuple.
  """
  tokens_BP, segment_ids_BP = prompts
  B, P = tokens_BP.shape
  N = scfg.max_new_tokens

  def run(tokens_BT, positions_BT, segment_ids_BT, cache, index):
    return transformer.hidden(cfg, params, transformer.Inputs(tokens_BT, positions_BT,
                                                              segment_ids_BT),
                              adapter, transformer.Decode(cache, index))

  params, adapter = _unstacked(cfg, params, adapter)
  n = samples_per_prompt
  if B % n:
    raise ValueError(f"{B} prompt rows are not {n} copies of the same prompts")
  U = B // n  # the distinct prompts, prefilled once
  tokens_UP, segment_ids_UP = tokens_BP[:U], segment_ids_BP[:U]
  positions_UP = jnp.maximum(jnp.cumsum(segment_ids_UP, axis=-1) - 1, 0).astype(jnp.int32)
  constrain = lambda arrays: tuple(sharding.constrain(a, _CACHE_AXES) for a in arrays)
  cache = transformer.init_cache(cfg, B, P + N)  # the decode loop's, as the unshared path's
  cache = cache._replace(k=constrain(cache.k), v=constrain(cache.v))
  if n == 1:
    h_UPD, cache = run(tokens_UP, positions_UP, segment_ids_UP, cache, 0)
    logits_BV = transformer.unembed(cfg, params, h_UPD[:, -1:])[:, 0]
  else:  # the prompts' P slots, prefilled once, written into each of their n rows
    prefilled = transformer.init_cache(cfg, U, P)
    prefilled = prefilled._replace(k=constrain(prefilled.k), v=constrain(prefilled.v))
    h_UPD, prefilled = run(tokens_UP, positions_UP, segment_ids_UP, prefilled, 0)
    tile = lambda x: jnp.tile(x, (n,) + (1,) * (x.ndim - 1))
    put = lambda into, x: jax.lax.dynamic_update_slice(into, tile(x), (0,) * into.ndim)
    cache = transformer.KVCache(constrain(tuple(map(put, cache.k, prefilled.k))),
                                constrain(tuple(map(put, cache.v, prefilled.v))),
                                put(cache.segment_ids, prefilled.segment_ids))
    logits_BV = tile(transformer.unembed(cfg, params, h_UPD[:, -1:])[:, 0])
  prompt_len_B = segment_ids_BP.sum(-1).astype(jnp.int32)

  def cond(carry):
    i, _, _, done_B, _ = carry
    return (i < N) & ~jnp.all(done_B)

  def body(carry):
    i, logits_BV, out_BN, done_B, cache = carry
    tok_B = sample_token(key, i, logits_BV, scfg)
    tok_B = jnp.where(done_B, scfg.pad_id, tok_B)
    out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, tok_B[:, None], i, 1)
    done_B = done_B | _is_stop(tok_B, scfg)
    h_B1D, cache = run(tok_B[:, None], (prompt_len_B + i)[:, None], jnp.ones((B, 1), jnp.int32),
                       cache, P + i)
    logits_BV = transformer.unembed(cfg, params, h_B1D)[:, 0]
    return i + 1, logits_BV, out_BN, done_B, cache

  out_BN = jnp.full((B, N), scfg.pad_id, jnp.int32)
  carry = (jnp.int32(0), logits_BV, out_BN, jnp.zeros((B,), bool), cache)
  _, _, out_BN, done_B, _ = jax.lax.while_loop(cond, body, carry)
  first_eos_B = jnp.argmax(_is_stop(out_BN, scfg), axis=-1)
  lengths = jnp.where(done_B, first_eos_B + 1, N).astype(jnp.int32)
  return Samples(out_BN, lengths, done_B)


def _unstacked(cfg: ModelConfig, params, adapter: transformer.Adapter | None):
  """The weights (and LoRA factors) with their layers sliced apart once, before the decode loop
  (`transformer.unstack_layers`): the loop then reads each layer's arrays as they are instead
  of copying them out of the stacked arrays at every step. The slicing is one copy of the
  weights per call (transient); a caller sampling one frozen base many times can pass
  `params["layers"]` already unstacked (a tuple), which is used as it is."""
  if not isinstance(params["layers"], tuple):
    params = {**params, "layers": transformer.unstack_layers(params["layers"], cfg.n_layers)}
  if adapter is not None and adapter.lora and not isinstance(adapter.lora["layers"], tuple):
    layers = transformer.unstack_layers(adapter.lora["layers"], cfg.n_layers)
    adapter = dataclasses.replace(adapter, lora={**adapter.lora, "layers": layers})
  return params, adapter


def _is_stop(tokens, scfg: SamplingConfig):
  return jnp.isin(tokens, jnp.asarray((scfg.eos_id, *scfg.stop_ids), jnp.int32))


_CACHE_AXES = ("batch", "kv_heads", "seq", None)  # one layer's keys or values, [B, C, S, lanes]


def completions(samples: Samples) -> list[list[int]]:
  """Host-side list of each row's generated ids (EOS included where emitted)."""
  tokens, lengths = jax.device_get((samples.tokens, samples.lengths))
  return [list(map(int, t[:n])) for t, n in zip(tokens, lengths)]

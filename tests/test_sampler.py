"""Sampler: KV-cache decoding against full recomputation, filters against numpy, EOS, batching."""


import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import LoraConfig, ModelConfig
from models import lora as lora_lib
from models import sampler, sharding, transformer

CFG = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=64, init_std=0.3)
PAD, BOS, EOS = 36, 37, 39          # EOS sits above vocab_limit, so it is never sampled unless set
LIMIT = 38
N = 10
PROMPTS = [[BOS, 3, 4, 5], [BOS, 7], [BOS, 1, 2, 3, 4, 5, 6, 7, 8], [BOS, 9, 9], [BOS, 11, 12, 1],
           [BOS], [BOS, 20, 21, 22, 23, 24, 25], [BOS, 30, 2]]


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh("data:-1")


@pytest.fixture(scope="module")
def params(mesh):
  return transformer.init(CFG, jax.random.key(0), mesh)


def _scfg(**kw):
  base = dict(max_new_tokens=N, eos_id=EOS, pad_id=PAD, temperature=0.0, vocab_limit=LIMIT,
              banned_ids=(PAD, BOS))
  return sampler.SamplingConfig(**{**base, **kw})


def _generate(params, prompts, scfg, key=0, lora=None, lora_scale=1.0, multiple=1):
  tokens, segments = sampler.left_pad(prompts, PAD, multiple)
  adapter = None if lora is None else transformer.Adapter(lora, lora_scale)
  out = sampler.generate(CFG, scfg, params, sampler.Prompts(jnp.asarray(tokens),
                                                            jnp.asarray(segments)),
                         jax.random.key(key), adapter)
  return jax.device_get(out)


def _greedy_by_recompute(params, prompt, n, lora=None, lora_scale=1.0):
  """Greedy decoding by running the full (uncached) forward over the whole sequence each step."""
  T = len(prompt) + n
  seq = list(prompt)
  adapter = None if lora is None else transformer.Adapter(lora, lora_scale)
  fwd = jax.jit(lambda t, p, s: transformer.forward(CFG, params, transformer.Inputs(t, p, s),
                                                    adapter))
  for _ in range(n):
    tokens = np.full((1, T), PAD, np.int32)
    tokens[0, :len(seq)] = seq
    segments = (np.arange(T) < len(seq)).astype(np.int32)[None]
    positions = np.arange(T, dtype=np.int32)[None]
    logits = np.array(fwd(tokens, positions, segments))[0, len(seq) - 1]
    logits[LIMIT:] = -np.inf
    logits[[PAD, BOS]] = -np.inf
    seq.append(int(np.argmax(logits)))
  return seq[len(prompt):]


@pytest.mark.slow
def test_cached_greedy_matches_full_recompute(params):
  out = _generate(params, PROMPTS, _scfg())
  for b, prompt in enumerate(PROMPTS):
    assert out.tokens[b].tolist() == _greedy_by_recompute(params, prompt, N), b
  assert out.lengths.tolist() == [N] * len(PROMPTS)
  assert not out.finished.any()
  # A random model must not collapse to one token, or the comparison says little.
  assert len(np.unique(out.tokens)) > 5


def test_lora_policy_matches_merged_weights(params, mesh):
  lcfg = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_targets=("q", "v", "up"))
  lora = lora_lib.init(CFG, lcfg, jax.random.key(1), mesh)
  lora = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(2), x.shape), lora)
  # The policy's weights and factors passed already sliced per layer (as a caller sampling a
  # frozen base many times may); the merged weights stacked, as training holds them.
  unstack = lambda tree: {**tree, "layers": transformer.unstack_layers(tree["layers"], 2)}
  out = _generate(unstack(params), PROMPTS, _scfg(), lora=unstack(lora), lora_scale=lcfg.scale)
  merged = _generate(lora_lib.merge(params, lora, lcfg), PROMPTS, _scfg())
  base = _generate(params, PROMPTS, _scfg())
  np.testing.assert_array_equal(out.tokens, merged.tokens)
  assert (out.tokens != base.tokens).any()  # the adapter is actually applied


@pytest.mark.slow
def test_prompt_in_mixed_batch_matches_alone(params):
  batch = _generate(params, PROMPTS, _scfg(), multiple=8)
  for b, prompt in enumerate(PROMPTS):
    alone = _generate(params, [prompt], _scfg())
    np.testing.assert_array_equal(batch.tokens[b], alone.tokens[0])


def test_eos_stops_row_others_continue(params):
  free = _generate(params, PROMPTS, _scfg())
  eos = int(free.tokens[0, 2])
  out = _generate(params, PROMPTS, _scfg(eos_id=eos))
  for b in range(len(PROMPTS)):
    row = free.tokens[b].tolist()
    stop = row.index(eos) + 1 if eos in row else N
    expected = row[:stop] + [PAD] * (N - stop)
    assert out.tokens[b].tolist() == expected, b
    assert out.lengths[b] == stop
    assert bool(out.finished[b]) == (eos in row)
  assert out.lengths[0] <= 3 and out.finished[0]
  assert (~out.finished).any()  # at least one row went on to max_new_tokens


def test_top_k_1_equals_greedy(params):
  greedy = _generate(params, PROMPTS, _scfg())
  topk1 = _generate(params, PROMPTS, _scfg(temperature=1.3, top_k=1), key=5)
  tiny_p = _generate(params, PROMPTS, _scfg(temperature=0.7, top_p=1e-6), key=6)
  np.testing.assert_array_equal(topk1.tokens, greedy.tokens)
  np.testing.assert_array_equal(tiny_p.tokens, greedy.tokens)


def test_sampling_deterministic_given_seed(params):
  a = _generate(params, PROMPTS, _scfg(temperature=1.0), key=3)
  b = _generate(params, PROMPTS, _scfg(temperature=1.0), key=3)
  c = _generate(params, PROMPTS, _scfg(temperature=1.0), key=4)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert (a.tokens != c.tokens).any()


def test_sharded_batch_matches_single_device(params, mesh):
  tokens, segments = sampler.left_pad(PROMPTS, PAD)
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.RULES["batch"]))
  t_sh, s_sh = jax.device_put(tokens, spec), jax.device_put(segments, spec)
  scfg = _scfg(temperature=1.0)
  sharded = sampler.generate(CFG, scfg, params, sampler.Prompts(t_sh, s_sh), jax.random.key(9))
  one = jax.devices()[0]
  local = jax.device_put(params, one)
  single = sampler.generate(CFG, scfg, local, sampler.Prompts(jax.device_put(tokens, one),
                                                              jax.device_put(segments, one)),
                            jax.random.key(9))
  np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(single.tokens))


def test_decode_loop_copies_no_weights_or_cache(params):
  """The compiled sampler slices no layer's weights and copies no layer's KV cache per step:
  no dynamic-slice anywhere (a layer scan over the stacked weights or cache would slice them at
  every step), and no copy whose shape is a weight's or a layer's cache."""
  tokens, segments = sampler.left_pad(PROMPTS, PAD, multiple=8)
  prompts = sampler.Prompts(jnp.asarray(tokens), jnp.asarray(segments))
  hlo = sampler.generate.lower(CFG, _scfg(), params, prompts,
                               jax.random.key(0)).compile().as_text()
  assert "dynamic-slice(" not in hlo
  B, P = tokens.shape
  shapes = {s.shape[1:] for s in transformer.param_specs(CFG)["layers"].values()}
  shapes |= {s.shape for s in transformer.param_specs(CFG)["layers"].values()}
  shapes.add(jax.eval_shape(lambda: transformer.init_cache(CFG, B, P + N)).k[0].shape)
  copied = {tuple(map(int, m.split(","))) for m in re.findall(r"= f32\[([\d,]+)\]\S* copy\(", hlo)}
  assert not copied & shapes, copied & shapes


def _numpy_filter(logits, temperature, top_k, top_p):
  """Independent reference: the set of kept ids and their renormalised probabilities."""
  z = logits.astype(np.float64) / temperature
  order = np.argsort(-z, kind="stable")
  keep = np.zeros_like(z, bool)
  keep[order[:top_k] if top_k else order] = True
  z = np.where(keep, z, -np.inf)
  p = np.exp(z - z.max()); p /= p.sum()
  cum = 0.0
  nucleus = np.zeros_like(keep)
  for i in np.argsort(-p, kind="stable"):
    if cum >= top_p:
      break
    nucleus[i] = True
    cum += p[i]
  p = np.where(nucleus, p, 0.0)
  return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0),
                                                     (1.5, 0, 0.8), (1.0, 8, 0.6)])
def test_filter_matches_numpy(temperature, top_k, top_p):
  logits = np.asarray(jax.random.normal(jax.random.key(0), (3, 40))) * 2.0
  scfg = sampler.SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=0, temperature=temperature,
                                top_k=top_k, top_p=top_p)
  got = np.asarray(jax.nn.softmax(sampler.filter_logits(jnp.asarray(logits), scfg), axis=-1))
  for b in range(3):
    np.testing.assert_allclose(got[b], _numpy_filter(logits[b], temperature, top_k, top_p),
                               atol=1e-6)


def test_sample_frequencies_match_filtered_distribution():
  logits = np.asarray(jax.random.normal(jax.random.key(1), (1, 12))) * 1.5
  scfg = sampler.SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=0, temperature=0.8, top_k=6,
                                top_p=0.9)
  n = 20000
  draws = jax.jit(lambda k: jax.vmap(lambda s: sampler.sample_token(k, s, jnp.asarray(logits),
                                                                    scfg))(jnp.arange(n)))
  counts = np.bincount(np.asarray(draws(jax.random.key(2)))[:, 0], minlength=12)
  p = _numpy_filter(logits[0], 0.8, 6, 0.9)
  assert counts[p == 0].sum() == 0
  # Within 5 binomial standard deviations for every token.
  np.testing.assert_array_less(np.abs(counts - n * p), 5 * np.sqrt(n * p * (1 - p)) + 1)


def test_left_pad_rejects_empty_prompt():
  with pytest.raises(ValueError, match="at least one token"):
    sampler.left_pad([[BOS], []], PAD)


@pytest.mark.parametrize("n,temperature", [(4, 1.0), (2, 0.0), (3, 0.7)])
def test_shared_prefill_samples_what_the_tiled_prompts_sample(params, mesh, n, temperature):
  """samples_per_prompt=n (GRPO's groups, online DPO's pairs): the prompts prefilled once, their
  cache copied to each prompt's n rows, give the same samples, lengths and ends as the n copies
  prefilled each, under the same key; on the sharded mesh too. Misused (rows that are not n
  copies of the same prompts) it is refused when it cannot divide them."""
  U = 8 if n == 3 else 4  # the distinct prompts; n * U rows divide over the 8 devices
  prompts = PROMPTS[:U] * n  # row j * U + b is prompt b
  tokens, segments = sampler.left_pad(prompts, PAD)
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(sharding.RULES["batch"]))
  batch = sampler.Prompts(jax.device_put(tokens, spec), jax.device_put(segments, spec))
  scfg = _scfg(temperature=temperature, max_new_tokens=16)
  run = lambda k: jax.device_get(sampler.generate(CFG, scfg, params, batch, jax.random.key(5),
                                                  samples_per_prompt=k))
  shared, unshared = run(n), run(1)
  np.testing.assert_array_equal(shared.tokens, unshared.tokens)
  np.testing.assert_array_equal(shared.lengths, unshared.lengths)
  np.testing.assert_array_equal(shared.finished, unshared.finished)
  if temperature:  # the n samples of a prompt differ (the keys are per row)
    assert len({tuple(shared.tokens[j * U]) for j in range(n)}) > 1
  with pytest.raises(ValueError, match=rf"{n * U} prompt rows are not 5 copies"):
    sampler.generate(CFG, scfg, params, sampler.Prompts(jnp.asarray(tokens), jnp.asarray(segments)),
                     jax.random.key(5), samples_per_prompt=5)


def test_a_group_samples_completions_past_a_thousand_tokens(params):
  """Reasoning completions run long: 1,040 new tokens a row (nothing stops a row: no EOS id is
  in the sampled range), each prompt prefilled once for its 2 samples, the samples those of the
  prompts prefilled each."""
  prompts = PROMPTS[:2] * 2
  tokens, segments = sampler.left_pad(prompts, PAD)
  batch = sampler.Prompts(jnp.asarray(tokens), jnp.asarray(segments))
  scfg = _scfg(temperature=1.0, max_new_tokens=1040)
  shared, unshared = (jax.device_get(sampler.generate(CFG, scfg, params, batch, jax.random.key(2),
                                                      samples_per_prompt=k)) for k in (2, 1))
  assert shared.tokens.shape == (4, 1040) and (shared.lengths == 1040).all()
  np.testing.assert_array_equal(shared.tokens, unshared.tokens)

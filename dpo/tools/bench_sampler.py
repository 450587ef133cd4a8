"""Our jitted KV-cache sampler beside transformers' `generate` on the same Llama: tokens/s,
the ratio, and whether the greedy tokens are equal.

    python -m dpo.tools.bench_sampler                  # a random ~33M Llama (bench-small's shape)
    python -m dpo.tools.bench_sampler --batch=32
    python -m dpo.tools.bench_sampler --hf_dir=DIR     # a folder of models/archs.py's families
    python -m dpo.tools.bench_sampler --preset=llama3.2-1b --batch=32   # ours alone (a TPU)

Without `--hf_dir` a random-weight `LlamaForCausalLM` of the flags' size is built from a config
object (transformers' own initialiser, `torch.manual_seed(--seed)`) and saved with
`save_pretrained` in a temporary folder; either way the folder is imported with `models.hf.load`
and both sides run greedy decoding in float32 on the same `--batch` prompts (lengths drawn from
a seeded RNG in [--min_prompt_len, --max_prompt_len], random ids), each left-padded as it needs
(ours to a multiple of 8, as evaluation pads; transformers to the longest prompt, with an
attention mask), for exactly `--new_tokens` tokens: the EOS id given to both is the vocabulary
size, which no row can emit.

  * ours: `models.sampler.generate` (one prefill, then the jitted decode loop). The first call
    traces, compiles and runs; `compile` is it less the median run.
  * transformers: `model.generate(..., do_sample=False, use_cache=True)` with torch on the CPU,
    once for each `torch.set_num_threads` of `--threads` (default: the cores this process may
    use, then 1: with other processes on the cores, torch's OpenMP threads wait on each other
    and two threads can be many times slower than one); one untimed call first.
The `--repeats` timed calls alternate (ours, theirs at each thread count, ours, ...), so a
neighbour's load slows every side alike; each reports its median, and the ratio is given
against each thread count and against transformers' fastest. tokens/s counts the new tokens
(batch x new tokens) over a whole call, prefill included. With `--breakdown` both sides also
run with one new token, which splits a call into the prefill (and first token) and the
per-step decode time (the difference of two medians: noisy when the call is short).

`--preset=NAME` times our sampler alone (no torch, as on a TPU host) on a preset's model shape
(configs.py) with random weights in our own format, stored as a run stores them (float32) and
computed in the preset's dtype, prefill and decode split as above. A decode step reads every
weight matrix (in the compute dtype: the float32 weights are converted once, outside the decode
loop) and the whole KV cache (its attention is over all `prompt + new` slots): their bytes over
the step's time are its HBM bandwidth use, shown against the chip's nominal
bandwidth (`NOMINAL_HBM`) on an accelerator.

`--bucketed` then samples a batch of each prompt length 3..40 with `left_pad(multiple=8)` and
counts the executables `generate` compiled for them (its jit cache): one per padded length, so
no prompt length compiles its own.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import configs
from dpo import autotune
from dpo.tools import profile
from models import hf, sampler, sharding, transformer

FLAGS = flags.FLAGS

# Nominal HBM bandwidth (bytes/s) by JAX device kind: the published chip figures.
NOMINAL_HBM = {"TPU v5 lite": 819e9, "TPU v4": 1228e9, "TPU v5p": 2765e9, "TPU v6 lite": 1640e9}


def random_llama(vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, mlp_dim: int, seed: int = 0):
  """A float32 `LlamaForCausalLM` with transformers' random initialisation, from a config object."""
  import torch
  import transformers
  config = transformers.LlamaConfig(
      vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers,
      num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim,
      intermediate_size=mlp_dim, max_position_embeddings=4096, rms_norm_eps=1e-5,
      tie_word_embeddings=False)
  torch.manual_seed(seed)
  return transformers.LlamaForCausalLM(config).float().eval()


def random_prompts(rng: np.random.Generator, batch: int, lengths: tuple[int, int],
                   vocab_size: int, pad_id: int) -> list[list[int]]:
  """`batch` prompts of random ids (never `pad_id`), lengths uniform in [lo, hi]."""
  out = []
  for n in rng.integers(lengths[0], lengths[1] + 1, batch):
    ids = rng.integers(0, vocab_size - 1, n)
    out.append((ids + (ids >= pad_id)).tolist())  # skip pad_id
  return out


def greedy_config(new_tokens: int, vocab_size: int, pad_id: int) -> sampler.SamplingConfig:
  """Greedy, exactly `new_tokens` tokens: the EOS id is the vocabulary size, never emitted."""
  return sampler.SamplingConfig(max_new_tokens=new_tokens, eos_id=vocab_size, pad_id=pad_id,
                                temperature=0.0)


def ours_fn(cfg, params, prompts: list[list[int]], scfg: sampler.SamplingConfig,
            samples_per_prompt: int = 1):
  """A call of our sampler on `prompts` (padded to a multiple of 8; `samples_per_prompt` n:
  the rows are prompts tiled n times, each prefilled once): () -> [B, N] numpy ids."""
  tokens, segments = sampler.left_pad(prompts, scfg.pad_id, multiple=8)
  batch = sampler.Prompts(jnp.asarray(tokens), jnp.asarray(segments))
  key = jax.random.key(0)

  def call():
    out = sampler.generate(cfg, scfg, params, batch, key, samples_per_prompt=samples_per_prompt)
    return np.asarray(jax.block_until_ready(out.tokens))
  return call


def theirs_fn(model, prompts: list[list[int]], new_tokens: int, pad_id: int):
  """A call of transformers' greedy `generate` on `prompts`, left-padded to the longest with an
  attention mask: () -> [B, N] numpy ids (the new tokens only)."""
  import torch
  P = max(len(p) for p in prompts)
  ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
  mask = torch.zeros((len(prompts), P), dtype=torch.long)
  for i, p in enumerate(prompts):
    ids[i, P - len(p):] = torch.tensor(p)
    mask[i, P - len(p):] = 1
  eos = model.config.vocab_size  # outside the vocabulary: every row runs to new_tokens

  def call():
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         use_cache=True, pad_token_id=pad_id, eos_token_id=eos)
    if out.shape[1] != P + new_tokens:
      raise RuntimeError(f"transformers generated {out.shape[1] - P} tokens, not {new_tokens}")
    return out[:, P:].numpy()
  return call


def first_difference(a: np.ndarray, b: np.ndarray) -> tuple[int, tuple[int, int] | None]:
  """(rows of [B, N] ids that differ, (row, position) of the first difference in row order)."""
  differ = (a != b)
  rows = np.flatnonzero(differ.any(-1))
  if not rows.size:
    return 0, None
  r = int(rows[0])
  return int(rows.size), (r, int(np.argmax(differ[r])))


def timed(fns: dict, repeats: int) -> dict[str, list[float]]:
  """Seconds of each of `repeats` calls of every function, the functions alternating."""
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t)
  return times


def bucketed_check(cfg, params, lengths: range, batch: int, new_tokens: int, pad_id: int,
                   rng: np.random.Generator) -> dict:
  """Samples a batch of each prompt length with `left_pad(multiple=8)`: the padded lengths seen
  and the executables `generate` compiled meanwhile (its jit cache's growth)."""
  scfg = greedy_config(new_tokens, cfg.vocab_size, pad_id)
  before = sampler.generate._cache_size()
  padded = []
  t = time.perf_counter()
  for n in lengths:
    prompts = random_prompts(rng, batch, (n, n), cfg.vocab_size, pad_id)
    padded.append(sampler.left_pad(prompts, pad_id, multiple=8)[0].shape[1])
    ours_fn(cfg, params, prompts, scfg)()
  return {"lengths": len(lengths), "padded": sorted(set(padded)),
          "compiled": sampler.generate._cache_size() - before,
          "seconds": time.perf_counter() - t}


def _thread_counts() -> list[int]:
  """--threads as torch thread counts, 0 read as the cores this process may use, duplicates
  dropped."""
  cores = len(os.sched_getaffinity(0))
  return list(dict.fromkeys(int(t) or cores for t in FLAGS.threads))


def _with_threads(fn, threads: int):
  import torch

  def call():
    torch.set_num_threads(threads)
    return fn()
  return call


def decode_bytes(cfg, params, batch: int, slots: int) -> tuple[int, int]:
  """(weight bytes, KV-cache bytes) one decode step reads: every parameter but the embedding
  table (a step gathers B of its rows; a tied table is read whole as the LM head), in the
  compute dtype where it is narrower than the stored one (XLA converts the float32 weights
  once, outside the decode loop: counted at 4 bytes, the 1B step on a v5e would read 120% of
  the chip's nominal bandwidth), and the keys and values of all `slots` cache slots of every
  layer."""
  width = jnp.dtype(cfg.compute_dtype).itemsize
  read = lambda tree: sum(x.size * min(x.dtype.itemsize, width) for x in jax.tree.leaves(tree))
  weights = read(params)
  if not cfg.tie_embeddings:
    weights -= read(params["embed"])
  cache = jax.eval_shape(lambda: transformer.init_cache(cfg, batch, slots))
  return weights, transformer.nbytes(cache)


def preset_main() -> None:
  """Our sampler alone on a preset's shape: tokens/s, prefill and decode step, HBM traffic."""
  cfg = configs.get_config(FLAGS.preset).model
  mesh = sharding.make_mesh("data:-1")
  params = transformer.init(cfg, jax.random.key(FLAGS.seed), mesh)
  rng = np.random.default_rng(FLAGS.seed)
  prompts = random_prompts(rng, FLAGS.batch, (FLAGS.min_prompt_len, FLAGS.max_prompt_len),
                           cfg.vocab_size, FLAGS.pad_id)
  N = FLAGS.new_tokens
  if N < 2:
    raise app.UsageError("--preset: --new_tokens must be at least 2 (a decode step is the "
                         "difference of N and 1 new tokens)")
  device = jax.devices()[0]
  print(f"{jax.device_count()} x {device.platform} ({device.device_kind}); CPU "
        f"{autotune.cpu_model()}; jax {jax.__version__}")
  print(f"model: {FLAGS.preset} shape, random, {transformer.num_params(params) / 1e9:.2f}B "
        f"parameters stored float32, computed in {cfg.compute_dtype}; greedy; batch "
        f"{FLAGS.batch}, prompts of {FLAGS.min_prompt_len}-{FLAGS.max_prompt_len} tokens, {N} "
        f"new each")
  calls = {n: ours_fn(cfg, params, prompts, greedy_config(n, cfg.vocab_size, FLAGS.pad_id))
           for n in (N, 1)}
  t = time.perf_counter()
  calls[N]()
  first = time.perf_counter() - t
  calls[1]()
  med = {n: statistics.median(v) for n, v in timed(calls, FLAGS.repeats).items()}
  step = (med[N] - med[1]) / (N - 1)
  print(f"ours: compile {first - med[N]:.2f} s; median {med[N]:.3f} s a call, "
        f"{FLAGS.batch * N / med[N]:.1f} tokens/s (prefill included); prefill + first token "
        f"{med[1] * 1e3:.1f} ms, then {step * 1e3:.2f} ms a decode step, "
        f"{FLAGS.batch / step:.0f} tokens/s decoding")
  padded = sampler.left_pad(prompts, FLAGS.pad_id, multiple=8)[0].shape[1]
  weights, cache = decode_bytes(cfg, params, FLAGS.batch, padded + N)
  rate = (weights + cache) / step
  peak = NOMINAL_HBM.get(device.device_kind)
  print(f"a decode step reads {weights / 2**30:.2f} GiB of weights and {cache / 2**30:.2f} GiB "
        f"of KV cache ({padded + N} slots): {rate / 1e9:.0f} GB/s"
        + ("" if peak is None else f", {rate / peak:.0%} of the chip's nominal "
           f"{peak / 1e9:.0f} GB/s"))
  if FLAGS.profile_dir:  # after the timing, so the trace never changes a figure
    trace_call(cfg, params, prompts, greedy_config(N, cfg.vocab_size, FLAGS.pad_id), calls[N])
  if FLAGS.samples_per_prompt > 1:
    shared_prefill(cfg, params, rng, N)


def trace_call(cfg, params, prompts, scfg, call) -> None:
  """--profile_dir: the compiled call's HLO (`sampler.hlo.txt`) and one traced call, its device
  time summed by XLA op (`top_ops.txt`, dpo/tools/profile.py); the decode loop's ops appear once
  per step in the count column."""
  os.makedirs(FLAGS.profile_dir, exist_ok=True)
  tokens, segments = sampler.left_pad(prompts, scfg.pad_id, multiple=8)
  compiled = sampler.generate.lower(cfg, scfg, params, sampler.Prompts(tokens, segments),
                                    jax.random.key(0)).compile()
  with open(os.path.join(FLAGS.profile_dir, "sampler.hlo.txt"), "w") as f:
    f.write(compiled.as_text())
  xplane = profile.trace(call, 1, FLAGS.profile_dir)
  lines = profile.table(profile.op_times(xplane))
  with open(os.path.join(FLAGS.profile_dir, "top_ops.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"one call traced in {xplane}:", *lines, sep="\n")


def shared_prefill(cfg, params, rng: np.random.Generator, N: int) -> None:
  """--samples_per_prompt=n: a GRPO generation batch, --batch / n prompts of n samples each,
  sampled at temperature 1 with each prompt prefilled once against the same rows prefilled each
  (n copies), the calls alternating: their medians, the ratio, the prefills (one new token) and
  whether the samples are the same."""
  n = FLAGS.samples_per_prompt
  if FLAGS.batch % n:
    raise app.UsageError(f"--samples_per_prompt={n} must divide --batch={FLAGS.batch}")
  distinct = random_prompts(rng, FLAGS.batch // n, (FLAGS.min_prompt_len, FLAGS.max_prompt_len),
                            cfg.vocab_size, FLAGS.pad_id)
  rows = distinct * n  # row j * B / n + b is prompt b, GRPO's layout
  config = lambda new: dataclasses.replace(greedy_config(new, cfg.vocab_size, FLAGS.pad_id),
                                           temperature=1.0)
  calls = {(k, new): ours_fn(cfg, params, rows, config(new), k) for k in (n, 1) for new in (N, 1)}
  for call in calls.values():
    call()  # compiles
  med = {k: statistics.median(v) for k, v in timed(calls, FLAGS.repeats).items()}
  same = np.array_equal(calls[(n, N)](), calls[(1, N)]())
  print(f"{FLAGS.batch // n} prompts x {n} samples, {N} new tokens, temperature 1: shared "
        f"prefill {med[(n, N)]:.3f} s a call (prefill + first token {med[(n, 1)] * 1e3:.1f} ms), "
        f"unshared {med[(1, N)]:.3f} s ({med[(1, 1)] * 1e3:.1f} ms): "
        f"{med[(1, N)] / med[(n, N)]:.2f}x the call, {med[(1, 1)] / med[(n, 1)]:.2f}x the "
        f"prefill; samples {'the same' if same else 'DIFFER'}")


def main(argv):
  del argv
  if FLAGS.preset:
    given = [f"--{n}" for n in ("hf_dir", "threads", "vocab_size", "d_model", "n_layers",
                                "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "breakdown",
                                "bucketed", "bucket_lengths", "bucket_new_tokens")
             if FLAGS[n].present]
    if given:
      raise app.UsageError(f"{', '.join(given)}: --preset times our sampler alone on the "
                           "preset's shape; drop them")
    return preset_main()
  if FLAGS.profile_dir:
    raise app.UsageError("--profile_dir traces our sampler alone: give --preset")
  import torch
  import transformers
  threads = _thread_counts()
  with tempfile.TemporaryDirectory(prefix="bench_sampler_") as tmp:
    if FLAGS.hf_dir:
      folder = FLAGS.hf_dir
      model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
      model = model.eval()
    else:
      folder = tmp
      model = random_llama(FLAGS.vocab_size, FLAGS.d_model, FLAGS.n_layers, FLAGS.n_heads,
                           FLAGS.n_kv_heads, FLAGS.head_dim, FLAGS.mlp_dim, FLAGS.seed)
      model.save_pretrained(folder)
    cfg, params = hf.load(folder, sharding.make_mesh("data:-1"))
  pad_id = FLAGS.pad_id
  rng = np.random.default_rng(FLAGS.seed)
  prompts = random_prompts(rng, FLAGS.batch, (FLAGS.min_prompt_len, FLAGS.max_prompt_len),
                           cfg.vocab_size, pad_id)
  N = FLAGS.new_tokens
  n_params = sum(p.numel() for p in model.parameters())
  print(f"CPU: {autotune.cpu_model()}, {os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable); "
        f"jax {jax.__version__} ({jax.device_count()} x {jax.devices()[0].platform}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}), torch {torch.__version__}, "
        f"transformers {transformers.__version__}")
  print(f"model: {FLAGS.hf_dir or 'random Llama'}, {n_params / 1e6:.1f}M parameters "
        f"(d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.vocab_size}), float32, "
        f"greedy")
  print(f"batch {FLAGS.batch}, prompt lengths {sorted(len(p) for p in prompts)}, "
        f"{N} new tokens each; {FLAGS.repeats} timed calls a side, alternating")

  def sides(new_tokens: int) -> dict:
    scfg = greedy_config(new_tokens, cfg.vocab_size, pad_id)
    fns = {"ours": ours_fn(cfg, params, prompts, scfg)}
    for t in threads:
      fns[t] = _with_threads(theirs_fn(model, prompts, new_tokens, pad_id), t)
    return fns

  fns = sides(N)
  t = time.perf_counter()
  tokens = {"ours": fns["ours"]()}
  first_call = time.perf_counter() - t
  tokens.update({t: fns[t]() for t in threads})  # untimed warm-up calls
  med = {k: statistics.median(v) for k, v in timed(fns, FLAGS.repeats).items()}
  new = FLAGS.batch * N
  label = {"ours": "ours", **{t: f"transformers, torch {t} thread{'s' * (t > 1)}"
                              for t in threads}}
  print(f"ours: compile {first_call - med['ours']:.2f} s (first call {first_call:.2f} s); "
        f"median {med['ours']:.3f} s, {new / med['ours']:.1f} tokens/s")
  for t in threads:
    rows, first = first_difference(tokens["ours"], tokens[t])
    same = "equal" if not rows else (
        f"DIFFER in {rows} of {FLAGS.batch} rows, first at row {first[0]} new token {first[1]} "
        f"(ours {tokens['ours'][first]}, transformers {tokens[t][first]})")
    print(f"{label[t]}: median {med[t]:.3f} s, {new / med[t]:.1f} tokens/s; "
          f"ours / transformers {med[t] / med['ours']:.2f}x; greedy tokens {same}")
  best = min(threads, key=lambda t: med[t])
  print(f"ours / transformers' fastest ({best} thread{'s' * (best > 1)}): "
        f"{med[best] / med['ours']:.2f}x tokens/s")

  if FLAGS.breakdown and N > 1:
    one = sides(1)
    for fn in one.values():
      fn()
    one_med = {k: statistics.median(v) for k, v in timed(one, FLAGS.repeats).items()}
    for k in one:
      step = (med[k] - one_med[k]) / (N - 1)
      print(f"{label[k]}: prefill + first token {one_med[k] * 1e3:.1f} ms, then "
            f"{step * 1e3:.2f} ms per decode step ({N - 1} steps, "
            f"{(N - 1) * step / med[k]:.0%} of the call)")

  if FLAGS.bucketed:
    lo, hi = map(int, FLAGS.bucket_lengths)
    r = bucketed_check(cfg, params, range(lo, hi + 1), FLAGS.batch, FLAGS.bucket_new_tokens,
                       pad_id, rng)
    print(f"bucketed: {r['lengths']} prompt lengths {lo}..{hi} padded to {r['padded']}: "
          f"{r['compiled']} executables compiled ({r['seconds']:.1f} s)")
    if r["compiled"] > len(r["padded"]):
      print("bucketed: MORE compiles than padded lengths: something else in the call retraces")


if __name__ == "__main__":
  flags.DEFINE_string("hf_dir", "", "A Hugging Face folder of a family models.hf imports; "
                      "empty: a random Llama of the size flags below, in a temporary folder.")
  flags.DEFINE_string("preset", "", "A preset's model shape (configs.py, e.g. llama3.2-1b), "
                      "random weights: our sampler alone (no torch), its decode step's HBM "
                      "bandwidth use.")
  flags.DEFINE_integer("vocab_size", 8192, "Random Llama: vocabulary.", lower_bound=2)
  flags.DEFINE_integer("d_model", 512, "Random Llama: hidden size.", lower_bound=1)
  flags.DEFINE_integer("n_layers", 8, "Random Llama: layers.", lower_bound=1)
  flags.DEFINE_integer("n_heads", 8, "Random Llama: query heads.", lower_bound=1)
  flags.DEFINE_integer("n_kv_heads", 4, "Random Llama: key/value heads.", lower_bound=1)
  flags.DEFINE_integer("head_dim", 64, "Random Llama: width of a head.", lower_bound=1)
  flags.DEFINE_integer("mlp_dim", 1536, "Random Llama: MLP width.", lower_bound=1)
  flags.DEFINE_integer("seed", 0, "Seeds the random weights and the prompts.")
  flags.DEFINE_integer("batch", 8, "Prompts sampled together.", lower_bound=1)
  flags.DEFINE_integer("min_prompt_len", 4, "Shortest prompt (tokens).", lower_bound=1)
  flags.DEFINE_integer("max_prompt_len", 48, "Longest prompt (tokens).", lower_bound=1)
  flags.DEFINE_integer("new_tokens", 64, "Tokens generated after each prompt (no EOS stop).",
                       lower_bound=1)
  flags.DEFINE_integer("pad_id", 0, "Padding id of both sides (masked out; prompts avoid it).",
                       lower_bound=0)
  flags.DEFINE_integer("samples_per_prompt", 1, "--preset: also time a GRPO generation batch "
                       "of --batch / N prompts x N samples, each prompt prefilled once against "
                       "prefilled N times.", lower_bound=1)
  flags.DEFINE_string("profile_dir", "", "--preset: after the timing, trace one call of "
                      "--new_tokens into this folder and print where the device time goes "
                      "(dpo/tools/profile.py), with the compiled HLO beside it.")
  flags.DEFINE_integer("repeats", 3, "Timed calls of each side; the median is reported.",
                       lower_bound=1)
  flags.DEFINE_list("threads", ["0", "1"], "torch.set_num_threads of each transformers run; "
                    "0: the cores this process may use. One thread shows what OpenMP's spinning "
                    "threads lose when other processes share the cores.")
  flags.DEFINE_bool("breakdown", True, "Also time one new token on each side: prefill against "
                    "the per-step decode time.")
  flags.DEFINE_bool("bucketed", True, "Sample a batch of each length of --bucket_lengths and "
                    "count the executables compiled for them.")
  flags.DEFINE_list("bucket_lengths", ["3", "40"], "Shortest and longest prompt of --bucketed.")
  flags.DEFINE_integer("bucket_new_tokens", 8, "New tokens of each --bucketed call.",
                       lower_bound=1)
  flags.register_validator("threads", lambda v: all(t.isdigit() for t in v),
                           "thread counts >= 0 (0: the cores)")
  flags.register_validator("bucket_lengths", lambda v: len(v) == 2 and
                           0 < int(v[0]) <= int(v[1]), "two lengths, 0 < lo <= hi")
  flags.register_multi_flags_validator(
      ["min_prompt_len", "max_prompt_len"], lambda f: f["min_prompt_len"] <= f["max_prompt_len"],
      "--max_prompt_len must be >= --min_prompt_len")
  app.run(main)

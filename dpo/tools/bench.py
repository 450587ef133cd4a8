"""Benchmark the jitted DPO step beside the plain JAX step: pairs/s, utilisation, memory.

    python -m dpo.tools.bench                # bench-small: LoRA, full FT; unshared, shared, blocks
    python -m dpo.tools.bench --variants=lora --layouts=shared --rounds_of_processes=1
    python -m dpo.tools.bench --workload=hh-rlhf --variants=lora --layouts=unshared,shared,packed

Our processes run as launch.py's does (dpo/hostmem.py: glibc's huge-page tunable, the heap
trimmed after each compile); the plain step runs in this command's environment as it is.

Every variant (LoRA or full fine-tuning x the unshared pair rows, shared-prefix rows, shared
rows with blockwise attention, or packed rows) runs in its own process, so each peak RSS is that
variant's alone (with --autotune=on, its choice is made first in one more process, so the peak
is the timed step's, not the tuning's); with `--plain_dir` present (default ../shared/bench)
and the bench-small workload, its plain JAX step (`plain_jax_dpo.py`) runs as one more process
per variant, and every row prints our pairs/s over its pairs/s. `--rounds_of_processes`
(default 3) repeats the whole set of processes, interleaved (ours, plain, ours, plain, ...),
and reports each variant's median round, so a noisy neighbour slows both sides alike and one
slow process moves no row (on a virtual machine whose host takes back freed huge pages, an
occasional process faults its temporaries in from host-reclaimed memory for its whole run:
`python -m dpo.tools.refault`, docs/benchmarks.md).

Every config flag applies (--config defaults to bench-small here). The step is the one a run
jits (`train.jit_step`: sharded over --mesh, state donated), built from the run's initial trees
(`train.initial_trainable` / `initial_frozen`, the base quantized with --base_quant); shared
rows come from `packing.shared_prefix` and packed rows from `packing.Packer`, as in a run (the
one batch packed into the fewest rows that hold it). The hh-rlhf workload takes 16 pairs a step
unless --global_batch_size says otherwise, so packing has pairs to pack.

A probe process reads the platform first (the parent never opens a device: one process at a time
can hold a TPU). On an accelerator the plain step is `plain_jax_dpo_at_scale.py` at the
config's shape (--plain_pairs, --plain_remat), and the utilisations divide by the chip's nominal
bfloat16 peak (MFU; `NOMINAL_PEAK`). On a CPU, two utilisations, both over the float32
--matmul_size^3 matmul peak the probe measures:
  * model: the nominal FLOPs of shared/BENCHMARKS.md, the same for every layout and system,
        6 * N * T + 12 * n_layers * seq_len^2 * d_model * sequences
    (N the layer matrices plus the LM head, T the pair tokens, sequences = 2 * pairs);
  * executed: the matmul FLOPs the step runs (`executed_flops`): reference forward, policy
    forward and backward (LoRA: activation gradients and the factors' gradients only), the
    attention over every slot pair of a row (masked ones too; with query blocks, only the keys
    up to each block's last slot), the LM head where it runs.
`temp MiB` is the compiler's temporary-buffer figure for the step (`memory_analysis`).
`slots` counts the positions the model runs per step (rows x row length) and `fill` the share of
them that hold a token; tokens/s counts the real (non-padding) tokens of the pair rows;
`x unshared` is a row's pairs/s over the unshared layout's. Below the table, each of our timed
processes' step time with the CPU it used a step (user, system, page faults) and the machine's
steal time, and each plain step process's time: a slow process shows whether it computed,
faulted or waited on a virtual machine's host.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import configs
from dpo import autotune, batches, cli, hostmem, logprobs, packing, prepare, train
from dpo import tokenizer as tokenizer_lib
from dpo.tools import profile
from models import quant, sharding, transformer

FLAGS = flags.FLAGS


def matmul_peak(n: int, reps: int = 20, dtype=jnp.float32) -> float:
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  best = math.inf
  for _ in range(3):
    t = time.perf_counter()
    for _ in range(reps):
      out = f(a, a)
    out.block_until_ready()
    best = min(best, (time.perf_counter() - t) / reps)
  return 2 * n ** 3 / best


# Nominal dense bfloat16 peaks per chip (the vendor's figures: Cloud TPU system architecture
# pages), over which the bench reports model FLOP utilisation (MFU) on an accelerator.
NOMINAL_PEAK = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
                "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12}


def probe(matmul_size: int) -> dict:
  """What the workers will run on, measured in a process of its own (a TPU can be held by one
  process at a time, so the parent never opens it): platform, device kind and count, the
  measured matmul peak (float32 --matmul_size^3 on a CPU; bfloat16 8192^3 on an accelerator)
  and the peak the utilisations divide by (a CPU's measured one; an accelerator's nominal)."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    peak = matmul_peak(matmul_size)
    return {"platform": "cpu", "kind": autotune.cpu_model(), "devices": jax.device_count(),
            "matmul": f"float32 {matmul_size}^3", "measured": peak, "peak": peak}
  if device.device_kind not in NOMINAL_PEAK:
    raise ValueError(f"no nominal peak known for {device.device_kind!r}; known: "
                     f"{', '.join(sorted(NOMINAL_PEAK))}")
  return {"platform": device.platform, "kind": device.device_kind,
          "devices": jax.device_count(), "matmul": "bfloat16 8192^3",
          "measured": matmul_peak(8192, dtype=jnp.bfloat16),
          "peak": NOMINAL_PEAK[device.device_kind] * jax.device_count()}


def _layer_matrix_params(m) -> int:
  return m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.mlp_dim


def model_flops(cfg, pairs: int, seq_len: int) -> float:
  m = cfg.model
  n = m.n_layers * _layer_matrix_params(m) + m.d_model * m.vocab_size
  tokens = 2 * pairs * seq_len
  return 6 * n * tokens + 12 * m.n_layers * seq_len ** 2 * m.d_model * 2 * pairs


def executed_flops(cfg, rows: int, slots: int, head_rows: int, reference: bool = True) -> float:
  """Matmul FLOPs of one step over `rows` rows of `slots` slots, the LM head on `head_rows`
  hidden states. Forward: dense 2 * P per slot, attention 4 * slots^2 * H * head_dim per row and
  layer. Backward: twice the forward with full fine-tuning; with LoRA the activation gradients
  (once the dense forward, twice the attention) plus the factors' forward, input and weight
  gradients. The reference adds one forward; --remat the layers' forward once more. With
  --attention_block each query block scores only the keys up to its last slot."""
  m, lc = cfg.model, cfg.lora
  dense = 2 * m.n_layers * _layer_matrix_params(m) * rows * slots
  b = m.attention_block if 0 < m.attention_block < slots else slots
  scored = sum(min(b, slots - s) * min(s + b, slots) for s in range(0, slots, b))
  attn = 4 * m.n_layers * rows * scored * m.n_heads * m.head_dim
  head = 2 * m.d_model * m.vocab_size * head_rows
  fwd = dense + attn + head
  remat = (dense + attn) if m.remat else 0  # the layers' forward again, in the backward pass
  if not lc.enabled:
    return fwd * (3 + reference) + remat
  specs = train.trainable_specs(m, lc)
  # Each factor is applied once per slot; its forward, input gradient and weight gradient.
  lora = 2 * 3 * sum(math.prod(x.shape[1:]) for x in jax.tree.leaves(
      transformer.abstract(specs))) * rows * slots
  return fwd * (1 + reference) + dense + 2 * attn + head + lora + remat


def synthetic_batch(cfg, pairs: int, rng):
  P, C = cfg.data.max_prompt_length, cfg.data.max_target_length
  T = P + C
  tokens = rng.integers(0, cfg.model.vocab_size, (pairs, 2, T)).astype(np.int32)
  tokens[:, 1, :P] = tokens[:, 0, :P]  # shared prompt
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (pairs, 2, T)).copy()
  loss_mask = np.zeros((pairs, 2, T), np.float32)
  loss_mask[:, :, P:] = 1.0
  return {"tokens": tokens, "positions": positions,
          "segment_ids": np.ones((pairs, 2, T), np.int32), "loss_mask": loss_mask}


def hh_batch(cfg, pairs: int, rng) -> dict:
  """`pairs` HH-RLHF pairs (--hh_data) tokenised with --hh_tokenizer and truncated to the
  config's lengths, ids folded into the model's vocabulary: real lengths, real shared prompts.
  The rows are cut to the batch's longest pair (rounded up to 8), as a run's loader would."""
  tok = tokenizer_lib.load_tokenizer(FLAGS.hh_tokenizer)
  arrays = prepare.prepare_pairs(FLAGS.hh_data, prepare.Preparation(
      tok, max_prompt_length=cfg.data.max_prompt_length,
      max_target_length=cfg.data.max_target_length)).train
  rows = np.sort(rng.choice(len(arrays["tokens"]), pairs, replace=False))
  batch = {k: v[rows] for k, v in arrays.items()}
  T = packing.round_up(int(batch["segment_ids"].sum(-1).max()), 8)
  batch = {k: v[..., :T] for k, v in batch.items()}
  batch["tokens"] = batch["tokens"] % cfg.model.vocab_size
  return batch


def time_config(cfg) -> dict:
  """Median step time of the jitted, sharded DPO step a run uses, from the run's initial trees."""
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  pairs = cfg.optim.global_batch_size
  key = jax.random.key(cfg.run.seed)
  # Born quantized with --base_quant (never a whole float32 copy: an 8B base would not fit).
  base = transformer.init_base(cfg.model, jax.random.fold_in(key, 0), mesh)
  spec = train.StepConfig.dpo(cfg)
  opt, _ = spec.optimizer()
  frozen = train.initial_frozen(base)
  fresh = lambda: train.init_state(train.initial_trainable(
      cfg.model, cfg.lora, base, jax.random.fold_in(key, 1), mesh), opt, cfg.run.seed, mesh)
  state = fresh()
  make = hh_batch if FLAGS.workload == "hh-rlhf" else synthetic_batch
  arrays = make(cfg, pairs, np.random.default_rng(0))
  T = arrays["tokens"].shape[-1]
  tokens = filled = int(arrays["segment_ids"].sum())  # real tokens of the pair rows
  rows, slots = 2 * pairs, T
  head_rows = 2 * pairs * logprobs.head_slots(T, spec.score_slots, spec.kl)
  if cfg.model.prefix_sharing:
    shared, note = packing.shared_prefix(arrays)
    if shared is None:
      raise ValueError(note)
    filled = int((shared["shared_segment_ids"] != 0).sum())
    if cfg.model.packing:
      k = cfg.optim.gradient_accumulation_steps
      packer = packing.Packer(shared, pairs, 1, k, sharding.batch_shards(mesh) * k)
      packer.fit(np.arange(pairs)[None])
      shared = packer.pack(np.arange(pairs))
    arrays = {**arrays, **shared}
    (rows, slots), head_rows = shared["shared_tokens"].shape, shared["score_from"].size
  batch = train.device_batch(mesh, batches.PairBatch.of(arrays))
  tuning = {}
  if cfg.run.autotune == "on":  # as a run's DPO stage would (dpo/program.py), cache included
    step_of = lambda setting: train.jit_step(
        train.dpo_step, train.StepConfig.dpo(cfg.replace(**setting)), mesh, state, frozen)
    # As in a run, the candidates train this state (donated, not copied, so the peak RSS is a
    # run's), and the timed one is built again after, only if the cache had no choice.
    time_steps = autotune.interleaved(step_of, state, frozen, batch, FLAGS.timed_steps)
    shapes = {k: tuple(v.shape) for k, v in arrays.items()}
    tuning = autotune.measured(cfg, autotune.Trial("dpo", shapes, slots, time_steps,
                                                   blocks=False))  # the layout's query block
    if FLAGS.worker_tune_only:
      return {"autotune": tuning, "peak_rss_mib": _peak_rss_mib()}
    if tuning["from"] is None:  # measured here after all (the cache lost the tuning's entry)
      del time_steps  # it holds the candidates' trained state
      state = fresh()
    cfg = cfg.replace(**tuning["choice"])
    spec = train.StepConfig.dpo(cfg)
  step = train.jit_step(train.dpo_step, spec, mesh, state, frozen)
  compiled = step.lower(state, frozen, batch).compile()
  mem = compiled.memory_analysis()
  rounds = []
  first_loss = None
  cpu = []
  for _ in range(FLAGS.rounds):
    for _ in range(FLAGS.warmup_steps):
      state, m = step(state, frozen, batch)
      if first_loss is None:
        first_loss = float(m["loss"])
    jax.block_until_ready(state)
    times, start = [], _cpu_use()
    for _ in range(FLAGS.timed_steps):
      t = time.perf_counter()
      state, m = step(state, frozen, batch)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t)
    rounds.append(statistics.median(times))
    cpu.append(_cpu_use(start, FLAGS.timed_steps))
  step_time = statistics.median(rounds)
  if FLAGS.profile_dir:  # after the timing, so the trace never changes a figure
    os.makedirs(FLAGS.profile_dir, exist_ok=True)
    with open(os.path.join(FLAGS.profile_dir, "step.hlo.txt"), "w") as f:
      f.write(compiled.as_text())
    holder = [state]

    def one_step():
      holder[0], m = step(holder[0], frozen, batch)
      jax.block_until_ready(m)

    xplane = profile.trace(one_step, FLAGS.profile_steps, FLAGS.profile_dir)
    lines = profile.table(profile.op_times(xplane))
    with open(os.path.join(FLAGS.profile_dir, "top_ops.txt"), "w") as f:
      f.write("\n".join(lines) + "\n")
    print(f"{FLAGS.profile_steps} steps traced in {xplane}:", *lines, sep="\n")
  median_round = sorted(range(len(rounds)), key=rounds.__getitem__)[len(rounds) // 2]
  return {"lora": cfg.lora.enabled, "shared": cfg.model.prefix_sharing, "step_time": step_time,
          "pairs_per_s": pairs / step_time, "tokens_per_s": tokens / step_time,
          "model_flops": model_flops(cfg, pairs, T), "pair_slots": 2 * pairs * T,
          "slots": rows * slots, "fill": filled / (rows * slots),
          "executed_flops": executed_flops(cfg, rows, slots, head_rows),
          "temp_bytes": getattr(mem, "temp_size_in_bytes", None), "first_loss": first_loss,
          "setting": autotune.describe({f: getattr(cfg.model, f) for f in autotune.FIELDS}),
          "autotune": tuning or None,
          "cpu_per_step": cpu[median_round],  # the CPU use of the (upper) median round
          "peak_rss_mib": _peak_rss_mib()}


def _cpu_use(start: dict | None = None, steps: int = 1) -> dict:
  """This process's CPU seconds (user and system, each summed over its threads), minor page
  faults and the machine's steal time (CPU seconds, summed over the machine's cores, that a
  virtual machine's host ran elsewhere: Linux's /proc/stat; None where absent): the running
  totals, or with `start` the use per step since then. Read with a process's step time, they
  tell a slow process that computed more (user) from one that faulted (system, faults) or
  waited on the host (steal)."""
  use = resource.getrusage(resource.RUSAGE_SELF)
  now = {"user": use.ru_utime, "system": use.ru_stime, "faults": use.ru_minflt, "steal": None}
  try:
    with open("/proc/stat") as f:  # cpu user nice system idle iowait irq softirq steal ...
      now["steal"] = int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
  except (OSError, IndexError, ValueError):
    pass
  if start is None:
    return now
  return {k: None if now[k] is None or start[k] is None else (now[k] - start[k]) / steps
          for k in now}


def _peak_rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _plain_applies(cfg) -> bool:
  """The plain step is written for bench-small's shapes; it runs beside ours only there."""
  ref = configs.get_config("bench-small")
  same = lambda a, b, names: all(getattr(a, n) == getattr(b, n) for n in names)
  model = [f.name for f in dataclasses.fields(ref.model)
           if f.name not in ("prefix_sharing", "packing", "logits_chunk", "attention_block",
                             "scan_unroll", "matmul_backward")]
  return (FLAGS.workload == "bench-small" and same(cfg.model, ref.model, model)
          and same(cfg.data, ref.data, ("max_prompt_length", "max_target_length"))
          and same(cfg.optim, ref.optim, ("global_batch_size", "learning_rate"))
          and same(cfg.lora, ref.lora, ("lora_alpha", "lora_dropout", "lora_targets"))
          and cfg.lora.lora_rank in (0, ref.lora.lora_rank) and cfg.loss == ref.loss)


def _plain_command(cfg, info: dict):
  """variant -> the plain JAX step's command beside ours, or None where none applies: on a CPU
  `plain_jax_dpo.py` on the bench-small workload; on an accelerator
  `plain_jax_dpo_at_scale.py` when it has the config's shape (its SHAPES table), at
  --plain_pairs pairs with or without per-layer remat (--plain_remat)."""
  if info["platform"] == "cpu":
    script = os.path.join(FLAGS.plain_dir, "plain_jax_dpo.py")
    if not (os.path.exists(script) and _plain_applies(cfg)):
      return None
    return lambda v: [sys.executable, script, "--variant", v]
  script = os.path.join(FLAGS.plain_dir, "plain_jax_dpo_at_scale.py")
  if not os.path.exists(script) or FLAGS.workload != "bench-small":
    return None
  module = importlib.util.module_from_spec(
      spec := importlib.util.spec_from_file_location("plain_at_scale", script))
  spec.loader.exec_module(module)
  m = cfg.model
  shape = (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.mlp_dim)
  names = [name for name, s in module.SHAPES.items() if tuple(s) == shape]
  if not names:
    return None
  return lambda v: [sys.executable, script, f"--shape={names[0]}", f"--variant={v}",
                    f"--pairs={FLAGS.plain_pairs or cfg.optim.global_batch_size}",
                    f"--prompt={cfg.data.max_prompt_length}",
                    f"--completion={cfg.data.max_target_length}", f"--steps={FLAGS.timed_steps}",
                    f"--dtype={m.compute_dtype}", f"--peak_tflops={info['peak'] / 1e12:g}",
                    *(["--remat"] if FLAGS.plain_remat else [])]


def _run_plain(cmd: list[str], out: str) -> dict:
  """The plain step's figures in the bench-small plain step's keys; a plain step that does not
  fit (at scale) is a row that says so, not a failed bench."""
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode != 0:
    lines = (done.stderr or done.stdout).strip().splitlines()
    if "--shape" not in " ".join(cmd):
      raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    oom = [x for x in lines if "RESOURCE_EXHAUSTED" in x or "out of memory" in x.lower()]
    return {"failed": (oom or lines or ["no output"])[-1][:300]}
  with open(out) as f:
    res = json.load(f)
  if "step_s" not in res:  # bench-small's plain step
    return res
  tokens = 2 * res["pairs"] * res["T"]
  return {"median_step_s": res["step_s"], "pairs": res["pairs"],
          "tokens_per_s": tokens / res["step_s"], "losses": [None],
          "model_gflop_per_step": res["model_tflops"] * res["step_s"] * 1e3,
          "temp_bytes": res["temp_gib"] * 2 ** 30}


def _run(cmd: list[str], out: str, what: str, ours: bool = True) -> dict:
  """Run one worker; ours run as launch.py's process does (`hostmem.reexec_with_huge_pages`),
  the plain step in this command's environment as it is."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
  env = hostmem.environment(env) if ours else env
  done = subprocess.run(cmd, capture_output=True, text=True, env=env)
  if done.returncode != 0:
    raise RuntimeError(f"{what} exited {done.returncode}:\n{done.stdout[-2000:]}\n"
                       f"{done.stderr[-4000:]}")
  with open(out) as f:
    return json.load(f)


def _tool_argv() -> list[str]:
  """This command's config flags, to pass on to the worker processes."""
  own = ("--variants", "--layouts", "--query_block", "--plain_dir", "--worker_json",
         "--worker_tune_only", "--worker_probe", "--plain_pairs", "--plain_remat",
         "--matmul_size", "--rounds_of_processes")
  return [a for a in sys.argv[1:] if not a.startswith(own)]


LAYOUTS = ("unshared", "shared", "blocks", "packed")


def _layout_flags(cfg, layout: str) -> list[str]:
  """The config flags of one layout: unshared pair rows; shared-prefix rows; shared rows with
  attention in query blocks of --query_block slots; packed shared rows. Every layout but blocks
  keeps the config's --attention_block."""
  block = FLAGS.query_block if layout == "blocks" else cfg.model.attention_block
  return [f"--prefix_sharing={layout != 'unshared'}", f"--packing={layout == 'packed'}",
          f"--attention_block={block}"]


def _run_processes(cfg, variants: list[str], plain) -> tuple[dict, dict]:
  """({(variant, layout): [figures of each round]}, {(variant, layout): its tuning}): every
  layout of every variant in its own process, with the plain JAX step (`plain(variant)`, its
  command, when given) as one more per variant. With --autotune=on each layout's choice is made
  first, in a process of its own (`--worker_tune_only`: measured, or read from the cache), so
  the timed processes find it cached and their peak RSS is the step's, not the tuning's (every
  candidate's compiled step and temporary buffers)."""
  tmp = tempfile.mkdtemp(prefix="dpo_bench_")
  results: dict[tuple[str, str], list[dict]] = {}
  tunings: dict[tuple[str, str], dict] = {}
  for r in range(FLAGS.rounds_of_processes):
    for v in variants:
      jobs = [(layout, [sys.executable, "-m", "dpo.tools.bench", *_tool_argv(),
                        f"--lora_rank={cfg.lora.lora_rank if v == 'lora' else 0}",
                        *_layout_flags(cfg, layout)]) for layout in FLAGS.layouts]
      if plain:
        jobs.append(("plain JAX", plain(v)))
      for layout, cmd in jobs:
        out = os.path.join(tmp, f"{v}_{layout.replace(' ', '_')}_{r}.json")
        if r == 0 and layout != "plain JAX" and cfg.run.autotune == "on":
          tune = [*cmd, f"--worker_json={out}.tune", "--worker_tune_only"]
          tunings[(v, layout)] = _run(tune, f"{out}.tune", " ".join(tune))
        if layout == "plain JAX":
          results.setdefault((v, layout), []).append(_run_plain(cmd + ["--out", out], out))
          continue
        cmd = cmd + [f"--worker_json={out}"]
        results.setdefault((v, layout), []).append(_run(cmd, out, " ".join(cmd)))
  return results, tunings


def _print_table(cfg, variants: list[str], results: dict, plain: bool, peak: float) -> None:
  """One row per variant and layout: the median round's rate, utilisations, memory, ratios."""
  print(f"workload {FLAGS.workload}, {cfg.optim.global_batch_size} pairs per step (ours)")
  print(f"{'variant':<8} {'layout':<10} {'slots':>6} {'fill':>5} {'step s':>7} {'pairs/s':>8} "
        f"{'tokens/s':>8} {'exec GF':>8} {'exec util':>9} {'model util':>10} {'temp MiB':>8} "
        f"{'RSS MiB':>8} "
        f"{'loss@1':>9} {'x plain':>7} {'x unshared':>10}")
  fmt = lambda x, f: "-" if x is None else f.format(x)
  batch = cfg.optim.global_batch_size
  for v in variants:
    rate, pairs = {}, {}
    for layout, rs in results.items():
      ok = [x for x in rs if "failed" not in x]
      if layout[0] == v and ok:
        key = "median_step_s" if layout[1] == "plain JAX" else "step_time"
        pairs[layout[1]] = ok[0].get("pairs", batch)
        rate[layout[1]] = pairs[layout[1]] / statistics.median(x[key] for x in ok)
    for layout in FLAGS.layouts + (["plain JAX"] if plain else []):
      rs = results[(v, layout)]
      if layout not in rate:
        print(f"{'LoRA' if v == 'lora' else 'full FT':<8} {layout:<10} {rs[0]['failed']}")
        continue
      if layout == "plain JAX":
        rs = [x for x in rs if "failed" not in x]
        row = {"executed_flops": None, "temp_bytes": rs[0].get("temp_bytes"),
               "first_loss": rs[0]["losses"][0],
               "model_flops": rs[0]["model_gflop_per_step"] * 1e9,
               "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs)}
      else:
        row = {**rs[0], "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs)}
      step_time = pairs[layout] / rate[layout]
      rss = max((x["peak_rss_mib"] for x in rs if "peak_rss_mib" in x), default=None)
      exec_util = None if row["executed_flops"] is None else row["executed_flops"] / step_time / peak
      print(f"{'LoRA' if v == 'lora' else 'full FT':<8} {layout:<10} "
            f"{fmt(row.get('slots'), '{:6d}'):>6} {fmt(row.get('fill'), '{:5.0%}'):>5} "
            f"{step_time:7.3f} "
            f"{rate[layout]:8.3f} {row['tokens_per_s']:8.0f} "
            f"{fmt(row['executed_flops'] and row['executed_flops'] / 1e9, '{:8.3f}'):>8} "
            f"{fmt(exec_util and 100 * exec_util, '{:8.1f}%'):>9} "
            f"{100 * row['model_flops'] / step_time / peak:9.1f}% "
            f"{fmt(row['temp_bytes'] and row['temp_bytes'] / 2 ** 20, '{:8.0f}'):>8} "
            f"{fmt(rss, '{:8.0f}'):>8} "
            f"{fmt(row['first_loss'], '{:9.6f}'):>9} "
            f"{fmt(rate.get('plain JAX') and rate[layout] / rate['plain JAX'], '{:6.2f}x'):>7} "
            f"{fmt(rate.get('unshared') and rate[layout] / rate['unshared'], '{:9.2f}x'):>10}")


def autotune_lines(tuning: dict | None) -> list[str]:
  """What --autotune did in one process (`autotune.measured`'s entry; None: off): each
  candidate's median where this process measured it, else where the choice was read from and
  when it was measured there (its seconds are that run's, not this one's)."""
  if not tuning:
    return []
  if tuning["from"]:
    return [f"  autotune: {autotune.describe(tuning['choice'])} from {tuning['from']} (key "
            f"{tuning['key']}, measured {tuning.get('when', 'at an unrecorded time')} under load "
            f"{tuning.get('load', '?')}); nothing timed in this process"]
  return [f"  autotune {setting} {seconds:.3f} s per step{note}"
          for part, note in (("seconds", ""), ("query_block", " (beside its other query block)"))
          for setting, seconds in tuning.get(part, {}).items()]


def main(argv):
  del argv
  unknown = set(FLAGS.layouts) - set(LAYOUTS)
  if unknown:
    raise app.UsageError(f"--layouts: unknown {sorted(unknown)}; give {', '.join(LAYOUTS)}")
  if FLAGS.workload == "hh-rlhf" and importlib.util.find_spec("tokenizers") is None:
    raise app.UsageError("--workload=hh-rlhf tokenises with GPT-2's tokenizer, which needs the "
                         "`tokenizers` package: pip install -e '.[hf]'")
  if FLAGS.workload == "hh-rlhf" and FLAGS.global_batch_size is None:
    FLAGS.global_batch_size = 16  # enough pairs a step for packing to pack
  if not (FLAGS.worker_json or FLAGS.worker_probe):
    # This process only starts the workers: an accelerator (one process at a time can hold a
    # TPU) is left to them.
    jax.config.update("jax_platforms", "cpu")
  hostmem.trim_after_compiles()  # as a run's process does (launch.py)
  cfg = cli.from_flags()
  if FLAGS.worker_tune_only and not (FLAGS.worker_json and cfg.run.autotune == "on"):
    raise app.UsageError("--worker_tune_only makes a --worker_json process's --autotune choice: "
                         "give both, with --autotune=on")
  if FLAGS.profile_dir and not FLAGS.worker_json:
    raise app.UsageError("--profile_dir traces the step of one --worker_json process: give both")
  if FLAGS["profile_steps"].present and not FLAGS.profile_dir:
    raise app.UsageError("--profile_steps: the steps --profile_dir traces; give --profile_dir")
  if FLAGS.worker_probe:
    with open(FLAGS.worker_probe, "w") as f:
      json.dump(probe(FLAGS.matmul_size), f)
    return
  if FLAGS.worker_json:
    with open(FLAGS.worker_json, "w") as f:
      json.dump(time_config(cfg), f)
    return
  variants = [v for v in FLAGS.variants if v != "full" or cfg.model.base_quant == "none"]
  if len(variants) < len(FLAGS.variants):
    print(f"no full fine-tuning variant: --base_quant={cfg.model.base_quant} needs LoRA")
  out = os.path.join(tempfile.mkdtemp(prefix="dpo_bench_"), "probe.json")
  cmd = [sys.executable, "-m", "dpo.tools.bench", *_tool_argv(), f"--worker_probe={out}",
         f"--matmul_size={FLAGS.matmul_size}"]
  info = _run(cmd, out, " ".join(cmd))
  peak = info["peak"]
  given = [f"--{n}" for n in ("plain_pairs", "plain_remat") if FLAGS[n].present]
  if info["platform"] == "cpu" and given:
    raise app.UsageError(f"{', '.join(given)}: the plain step at scale runs on an accelerator "
                         "only; on a CPU the plain step is bench-small's")
  plain = _plain_command(cfg, info)
  print(f"CPU: {autotune.cpu_model()}; devices: {info['devices']} x {info['platform']} "
        f"({info['kind']}); {info['matmul']} matmul peak {info['measured'] / 1e12:.3f} TFLOP/s"
        f"{'' if info['platform'] == 'cpu' else f', nominal {peak / 1e12:.0f} TFLOP/s'}; the "
        f"utilisations are over the {'measured' if info['platform'] == 'cpu' else 'nominal'} "
        f"peak; plain JAX step: "
        f"{' '.join(plain('lora')[1:]) if plain else 'not run (absent, or another shape)'}")
  tunables = hostmem.environment()["GLIBC_TUNABLES"]
  print(f"our processes: GLIBC_TUNABLES={tunables} (as launch.py runs; dpo/hostmem.py); the plain "
        f"step: GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")
  results, tunings = _run_processes(cfg, variants, plain)
  _print_table(cfg, variants, results, plain is not None, peak)
  for (v, layout), rs in results.items():
    if layout == "plain JAX":
      print(f"{v} plain JAX: processes " + ", ".join(
          r["failed"] if "failed" in r else f"{r['median_step_s']:.3f} s" for r in rs))
      continue
    print(f"{v} {layout}: {', '.join(sorted({x['setting'] for x in rs}))}")
    tuning = tunings.get((v, layout))
    if tuning:
      print("  autotune in its own process first: " + (
          "read from the cache" if tuning["autotune"]["from"] else
          f"peak RSS {tuning['peak_rss_mib']:.0f} MiB"))
    for line in autotune_lines(tuning and tuning["autotune"]):
      print(line)
    print("  processes: " + ", ".join(
        f"{r['step_time']:.3f} s (a step: CPU user {c['user']:.2f} s, system {c['system']:.2f} "
        f"s, {c['faults']:.0f} page faults; machine steal "
        f"{'-' if c['steal'] is None else format(c['steal'], '.2f') + ' s'})"
        for r in rs for c in [r["cpu_per_step"]]))
    for r in rs:  # a timed process that measured after all: its RSS row includes the tuning
      if r["autotune"] and not r["autotune"]["from"]:
        print("  the timed process measured too (the cache lost the entry); its peak RSS "
              "includes the tuning")
        for line in autotune_lines(r["autotune"]):
          print(line)


if __name__ == "__main__":
  cli.define_flags()
  FLAGS.set_default("config", "bench-small")
  flags.DEFINE_list("variants", ["lora", "full"], "lora (the config's LoRA) and/or full (every "
                    "weight trains, frozen reference copy).")
  flags.DEFINE_list("layouts", ["unshared", "shared", "blocks"], "unshared ([B, 2, T] pair "
                    "rows), shared (prompt | chosen | rejected rows, --prefix_sharing), blocks "
                    "(shared rows, attention in query blocks that skip the keys above the "
                    "diagonal, --query_block) and/or packed (several shared rows a row, "
                    "--packing).")
  flags.DEFINE_integer("query_block", 64, "--attention_block of the blocks layout.",
                       lower_bound=1)
  flags.DEFINE_string("plain_dir", "../shared/bench", "Folder of the plain JAX step "
                      "(plain_jax_dpo.py); skipped when absent or not the bench-small workload.")
  flags.DEFINE_integer("rounds_of_processes", 3, "Times the whole set of variant processes runs, "
                       "interleaved; each variant reports its median, so one slow process "
                       "(docs/benchmarks.md: a virtual machine's host taking back freed huge "
                       "pages) moves no row.", lower_bound=1)
  flags.DEFINE_enum("workload", "bench-small", ["bench-small", "hh-rlhf"], "bench-small: "
                    "synthetic pairs of max_prompt_length + max_target_length tokens; hh-rlhf: "
                    "--hh_data's lengths and shared prompts.")
  flags.DEFINE_string("hh_data", "../shared/data/hh-rlhf/harmless-base-test.jsonl.gz",
                      "Preference file whose lengths the hh-rlhf workload takes.")
  flags.DEFINE_string("hh_tokenizer", "../shared/data/tokenizers/gpt2/tokenizer.json",
                      "tokenizer.json that tokenises --hh_data.")
  flags.DEFINE_string("worker_json", "", "Internal: time this one configuration in this "
                      "process and write its figures here.")
  flags.DEFINE_string("worker_probe", "", "Internal: write what the workers run on (platform, "
                      "device kind, matmul peak) here and exit.")
  flags.DEFINE_integer("plain_pairs", 0, "On an accelerator: pairs a step of the plain step "
                       "at scale (its best batch that fits); 0 = the config's.", lower_bound=0)
  flags.DEFINE_bool("plain_remat", True, "On an accelerator: the plain step at scale with "
                    "per-layer remat (without it, it does not fit at a real shape).")
  flags.DEFINE_bool("worker_tune_only", False, "Internal: with --worker_json, only make this "
                    "configuration's --autotune choice (measured, or read from the cache) and "
                    "write it with this process's peak RSS.")
  flags.DEFINE_string("profile_dir", "", "With --worker_json: after the timing, trace "
                      "--profile_steps steps into this folder and print where the device time "
                      "goes (dpo/tools/profile.py), with the compiled HLO beside it.")
  flags.DEFINE_integer("profile_steps", 2, "Steps traced with --profile_dir.", lower_bound=1)
  flags.DEFINE_integer("timed_steps", 10, "Timed steps per round (after the warm-up steps).",
                       lower_bound=1)
  flags.DEFINE_integer("warmup_steps", 3, "Untimed steps per round (the first gives loss@1).",
                       lower_bound=1)
  flags.DEFINE_integer("rounds", 1, "Rounds inside each of our processes; the median round is "
                       "reported.", lower_bound=1)
  flags.DEFINE_integer("matmul_size", 2048, "n of the n x n x n float32 matmul timed as the peak.",
                       lower_bound=1)
  app.run(main)

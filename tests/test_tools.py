"""The tools of dpo/tools/: the compile-only check in process, and each tool run once as a user
runs it (`python -m dpo.tools.NAME`, tiny settings).

Compile-only check: the compiler's own per-device argument size must equal what the sharding
rules predict, which verifies that weights, LoRA factors and optimizer state really are split as
the rules say.
"""

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest

import configs
from dpo import autotune, hostmem, train
from dpo.tools import bench, compile_check, profile
from models import sharding, transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _expected_argument_bytes(cfg, mesh, seq_len):
  est = train.memory_estimate(train.StepConfig.dpo(cfg), mesh)
  rows = cfg.optim.global_batch_size // math.prod(mesh.shape[a] for a in sharding.RULES["batch"])
  batch = 4 * rows * 2 * seq_len * 4  # tokens, positions, segment ids (int32), loss mask (f32)
  scalars = 4 + 8 + 4 + 4  # step, rng key data (2 x uint32), lr_scale, skipped
  return est, est["total"] + batch + scalars


@pytest.mark.slow
def test_bench_small_compiles_abstractly_with_predicted_per_device_memory():
  cfg = configs.get_config("bench-small").replace(global_batch_size=8)
  mesh = sharding.make_mesh("fsdp:4,tensor:2")
  seq_len = 64
  compiled = compile_check.compile_dpo_step(cfg, mesh, seq_len)
  rep = compile_check.memory_report(compiled)
  est, expected = _expected_argument_bytes(cfg, mesh, seq_len)
  assert rep["arguments"] == expected
  # The whole train state is donated: its buffers are reused for the new state.
  assert rep["aliased"] >= est["trainable"] + est["optimizer"]
  # Every matrix is split 8 ways (fsdp x tensor); only norms are replicated.
  specs = transformer.param_specs(cfg.model)
  full = 4 * transformer.num_params(transformer.abstract(specs))
  assert full / 8 <= est["frozen"] < full / 8 * 1.01
  assert rep["temporaries"] > 0


def test_llama3_8b_preset_is_the_published_shape():
  m = configs.get_config("llama3-8b").model
  n = transformer.num_params(transformer.abstract(transformer.param_specs(m)))
  # Llama 3.1 8B: 8,030,261,248 parameters (Meta's model card: "8B"); computed independently
  # from the published dimensions: embed + lm_head + 32 x (attention + MLP + 2 norms) + norm.
  per_layer = 4096 * (32 * 128 + 2 * 8 * 128) + 32 * 128 * 4096 + 3 * 4096 * 14336 + 2 * 4096
  assert n == 2 * 128256 * 4096 + 32 * per_layer + 4096 == 8_030_261_248


def _imports(path: str):
  """Every module an `import` statement in the file names (for `from a import b`: a and a.b)."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield node.module
      yield from (f"{node.module}.{a.name}" for a in node.names)


def test_library_never_imports_the_launcher_or_the_tools():
  offenders = []
  for package in ("dpo", "models"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
      in_tools = os.path.relpath(dirpath, ROOT).startswith(os.path.join("dpo", "tools"))
      for path in (os.path.join(dirpath, f) for f in files if f.endswith(".py")):
        offenders += [f"{path}: {m}" for m in _imports(path) if m.split(".")[0] == "launch"
                      or (m.startswith("dpo.tools") and not in_tools)]
  assert not offenders


def _module_files() -> dict[str, str]:
  """{dotted name: path} of the library, its tools, configs.py and launch.py."""
  out = {"configs": os.path.join(ROOT, "configs.py"), "launch": os.path.join(ROOT, "launch.py")}
  for package in ("dpo", "models"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
      for f in files:
        if f.endswith(".py"):
          name = os.path.relpath(os.path.join(dirpath, f[:-3]), ROOT).replace(os.sep, ".")
          out[name.removesuffix(".__init__")] = os.path.join(dirpath, f)
  return out


def _runtime_imports(path: str, modules) -> tuple[set[str], list[str]]:
  """(the project modules the file imports at run time, anywhere in it but under `if
  TYPE_CHECKING:`; the private names it takes from another project module: `from m import _x` or
  `m._x` with m an imported project module)."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
  found, private, aliases = set(), [], {}
  for node in ast.walk(tree):
    if id(node) in typing_only:
      continue
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name in modules:
          found.add(a.name)
          aliases[a.asname or a.name] = a.name
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        full = f"{node.module}.{a.name}"
        if full in modules:
          found.add(full)
          aliases[a.asname or a.name] = full
        elif node.module in modules:
          found.add(node.module)
          if a.name.startswith("_"):
            private.append(f"{path}: from {node.module} import {a.name}")
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      private.append(f"{path}: {aliases[node.value.id]}.{node.attr}")
  return found, private


def test_no_import_circles_and_no_private_names_across_modules():
  """The library, its tools, configs.py and launch.py: no circle among the imports that run (a
  function's own imports included), and no module reads another's private name."""
  modules = _module_files()
  graph, private = {}, []
  for name, path in modules.items():
    found, bad = _runtime_imports(path, modules)
    graph[name] = found - {name}
    private += bad
  assert not private
  circles, state = [], {}

  def visit(name, trail):
    state[name] = "open"
    for dep in sorted(graph[name]):
      if state.get(dep) == "open":
        circles.append(" -> ".join(trail[trail.index(dep):] + [dep]))
      elif dep not in state:
        visit(dep, trail + [dep])
    state[name] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])
  assert not circles
  # The check sees what it must: the package that registers the algorithms imports each one.
  assert {"dpo.algorithms.dpo", "dpo.algorithms.rm"} <= graph["dpo.algorithms"]
  assert "dpo.registry" in graph["dpo.algorithms.rm"] and "dpo.reward_model" in graph["dpo.judges"]


# --- each tool as a user runs it -------------------------------------------------------------------

TINY_MODEL = ["--d_model=32", "--n_layers=1", "--n_heads=2", "--n_kv_heads=1", "--head_dim=16",
              "--mlp_dim=64"]
TINY_TASK = ["--task_train_pairs=16", "--task_sft_examples=8", "--task_eval_pairs=8",
             "--task_eval_prompts=4", "--eval_batch_size=4", "--eval_max_new_tokens=4",
             "--eval_show=0", "--global_batch_size=4"]


def _tool_commands(out: str) -> dict[str, tuple[int, list[str]]]:
  """{tool: (fake CPU devices, arguments)}: tiny settings that run in seconds."""
  return {
      "bench": (1, ["--config=bench-small", *TINY_MODEL, "--vocab_size=512",
                    "--max_prompt_length=8", "--max_target_length=8", "--timed_steps=2",
                    "--warmup_steps=1", "--rounds=1", "--matmul_size=128", "--query_block=8",
                    "--rounds_of_processes=1"]),
      "bench_precompute_ref": (2, [*TINY_MODEL, *TINY_TASK, "--timed_steps=3",
                                   "--learning_rate=0.05", "--warmup_ratio=0"]),
      "compare_losses": (1, [*TINY_MODEL, *TINY_TASK, "--steps=2", "--sft_steps=2",
                             "--losses=sigmoid,ipo", f"--output_dir={out}/compare_losses"]),
      "compile_check": (2, ["--config=bench-small", "--lora_rank=0", *TINY_MODEL,
                            "--vocab_size=512", "--mesh=fsdp:2", "--fake_devices=2",
                            "--global_batch_size=2", "--max_prompt_length=8",
                            "--max_target_length=8"]),
      "base_memory": (1, []),
      "refault": (1, ["--mib=8", "--gaps=0,0.1", "--repeats=2"]),
      "flash_check": (1, ["--rows=1", "--slots=256", "--heads=4", "--kv_heads=2", "--tile=128",
                          "--repeats=1", "--cases=packed,branches,window,softcap"]),
  }


@pytest.fixture(scope="module")
def tool_output(tmp_path_factory):
  """Every tool started at once (their compiles overlap on the CPU cores); the fixture's value
  waits for one tool, asserts it exited 0 and returns its stdout lines."""
  out = tmp_path_factory.mktemp("tools")
  procs = {}
  for name, (devices, args) in _tool_commands(str(out)).items():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DPO_JAX_CACHE": str(out / "cache"),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    with open(out / f"{name}.stdout", "w") as so, open(out / f"{name}.stderr", "w") as se:
      procs[name] = subprocess.Popen([sys.executable, "-m", f"dpo.tools.{name}", *args],
                                     cwd=ROOT, env=env, stdout=so, stderr=se)

  def output(name: str) -> list[str]:
    rc = procs[name].wait(timeout=600)  # the bench runs 12 processes on the shared cores
    stdout, stderr = ((out / f"{name}.{s}").read_text() for s in ("stdout", "stderr"))
    assert rc == 0, f"dpo.tools.{name} exited {rc}:\n{stdout}\n{stderr[-4000:]}"
    return stdout.splitlines()

  output.dir = str(out)
  yield output
  for p in procs.values():
    if p.poll() is None:
      p.kill()
      p.wait()


def test_bench_prints_measured_seconds_only_where_it_measured(tmp_path, monkeypatch):
  """A process that measured prints each candidate's seconds; one whose choice came from the
  cache prints where from, the key and when it was measured there, and no seconds as its own."""
  monkeypatch.setenv("DPO_JAX_CACHE", str(tmp_path))
  cfg = configs.get_config("bench-small")
  trial = autotune.Trial("dpo", {"tokens": (4, 2, 16)}, 16, lambda settings: [
      {"autodiff": 0.5}.get(s["matmul_backward"], 1.0) for s in settings], blocks=False)
  assert bench.autotune_lines(autotune.measured(cfg, trial)) == [
      f"  autotune {autotune.describe(c)} {0.5 if c['matmul_backward'] == 'autodiff' else 1:.3f}"
      f" s per step" for c in autotune.candidates(cfg.model)]
  entry = autotune.measured(cfg, trial)
  (cached,) = bench.autotune_lines(entry)
  assert cached == (f"  autotune: {autotune.describe(entry['choice'])} from "
                    f"{tmp_path / 'autotune.json'} (key {entry['key']}, measured "
                    f"{entry['when']} under load {entry['load']}); nothing timed in this process")
  assert bench.autotune_lines(None) == []


@pytest.mark.slow
def test_bench_prints_a_row_per_variant_and_layout_with_loss_log2_at_the_first_step(tool_output):
  lines = tool_output("bench")
  # The platform comes from a probe process (the parent never opens an accelerator).
  assert lines[0].startswith(f"CPU: {autotune.cpu_model()}; devices: 1 x cpu "
                             f"({autotune.cpu_model()}); float32 128^3 matmul peak ")
  assert "the utilisations are over the measured peak" in lines[0]
  assert "plain JAX step: not run" in lines[0]  # a tiny model is not the plain step's workload
  # Our workers run as launch.py's process does (dpo/hostmem.py), the plain step as given.
  assert lines[1].startswith("our processes: GLIBC_TUNABLES=") and hostmem.HUGE_PAGES in lines[1]
  assert lines[2] == "workload bench-small, 4 pairs per step (ours)"
  assert lines[3].split() == ["variant", "layout", "slots", "fill", "step", "s", "pairs/s",
                              "tokens/s", "exec", "GF", "exec", "util", "model", "util", "temp",
                              "MiB", "RSS", "MiB", "loss@1", "x", "plain", "x", "unshared"]
  rows = [l.replace("full FT", "full").split() for l in lines[4:10]]
  assert [r[:2] for r in rows] == [[v, l] for v in ("LoRA", "full")
                                   for l in ("unshared", "shared", "blocks")]
  for r in rows:
    assert float(r[4]) > 0 and r[8].endswith("%") and float(r[11]) > 0  # step s, util, RSS
    assert r[3] == "100%"  # synthetic pairs fill every slot of either layout
    # The policy starts equal to the reference (LoRA B = 0, or a copy): sigmoid loss = log 2.
    assert float(r[-3]) == pytest.approx(math.log(2), abs=1e-6)
    assert r[-2] == "-" and r[-1].endswith("x")
  assert float(rows[0][-1][:-1]) == 1.0
  # bench-small tunes each variant's step (--autotune=on) on a fresh cache: one rolled layer, so
  # each backward measured once, the layout's query block kept; the setting it ran with.
  rest = lines[10:]
  for v in ("lora", "full"):
    for layout, block in (("unshared", 0), ("shared", 0), ("blocks", 8)):
      (i,) = [i for i, l in enumerate(rest) if l.startswith(f"{v} {layout}: --scan_unroll=1 ")]
      assert rest[i].endswith(f" --attention_block={block}")
      # measured in a process of its own first, so the timed one reads the cache
      assert rest[i + 1].startswith("  autotune in its own process first: peak RSS ")
      assert [l.split()[2] for l in rest[i + 2:i + 4]] == [
          "--matmul_backward=explicit", "--matmul_backward=autodiff"]
      assert not any(l.startswith("  autotune") for l in rest[i + 4:i + 5])  # nor the timed one
      # each timed process's step time, with the CPU it used a step (to tell a slow one's cause)
      (proc,) = rest[i + 4].removeprefix("  processes: ").split("), ")  # one round of processes
      seconds, use = proc.split(" s (a step: CPU user ")
      user, system = float(use.split(" s, ")[0]), float(use.split("system ")[1].split(" s,")[0])
      assert float(seconds) > 0 and user >= 0 and system >= 0
      assert int(use.split(" s, ")[2].split(" page faults")[0]) >= 0
      steal = use.split("machine steal ")[1].rstrip(")")
      assert steal == "-" or float(steal.removesuffix(" s")) >= 0
  # Shared rows run fewer slots and FLOPs than the unshared pair rows: 4 rows of 8 + 8 + 8
  # slots instead of 8 rows of 16; query blocks of 8 skip the keys above the diagonal.
  assert [int(r[2]) for r in rows] == [128, 96, 96, 128, 96, 96]
  for v in (0, 3):
    assert float(rows[v][7]) > float(rows[v + 1][7]) > float(rows[v + 2][7])


def test_bench_probe_and_a_plain_step_that_does_not_fit(tmp_path):
  """The probe reads a CPU's measured peak as the one the utilisations divide by; a plain step at
  scale that runs out of memory is a row saying so, not a failed bench (a TPU's limit)."""
  info = bench.probe(64)
  assert info["platform"] == "cpu" and info["peak"] == info["measured"] > 0
  script = tmp_path / "plain_jax_dpo_at_scale.py"
  script.write_text("import sys\nprint('jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out "
                    "of memory on HBM (21.9G)', file=sys.stderr)\nsys.exit(1)\n")
  row = bench._run_plain([sys.executable, str(script), "--shape=llama3.2-1b"], "unused")
  assert row == {"failed": "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory "
                           "on HBM (21.9G)"}
  with pytest.raises(RuntimeError, match="exited 1"):  # bench-small's plain step must run
    bench._run_plain([sys.executable, str(script), "--variant", "lora"], "unused")


def test_bench_refuses_the_accelerator_plain_step_flags_on_a_cpu():
  done = subprocess.run([sys.executable, "-m", "dpo.tools.bench", "--plain_pairs=8"], cwd=ROOT,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode != 0 and "Traceback" not in done.stderr
  assert "--plain_pairs: the plain step at scale runs on an accelerator only" in done.stderr


def test_bench_profile_sums_each_ops_own_time_and_the_tool_reads_it_back(tmp_path):
  """A worker with --profile_dir traces its step after the timing: the compiled HLO and a table
  of ops whose own times (enclosing loops less what ran inside them) sum to at most the traced
  wall time; `python -m dpo.tools.profile DIR` prints the same table from the trace. Without a
  worker the flag is refused in one line."""
  env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
  out, prof = tmp_path / "w.json", tmp_path / "prof"
  done = subprocess.run(
      [sys.executable, "-m", "dpo.tools.bench", "--variants=lora", "--autotune=off",
       "--timed_steps=1", "--warmup_steps=1", "--steps=4", f"--worker_json={out}",
       f"--profile_dir={prof}", "--profile_steps=2"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  step_s = json.loads(out.read_text())["step_time"]
  assert "HloModule" in (prof / "step.hlo.txt").read_text()
  table = (prof / "top_ops.txt").read_text().splitlines()
  assert table[0] == profile.HEADER and table[1].startswith("(all ops) | ")
  whole_ms = float(table[1].split(" | ")[1])
  ops = [line.split(" | ") for line in table[2:]]
  assert len(ops) >= 10 and all(float(o[1]) <= whole_ms for o in ops)
  # Own times do not count a nested op twice: all ops together ran within the two traced
  # steps (with room for a slower step under the profiler).
  assert 0 < whole_ms / 1e3 < 2 * 3 * step_s
  again = subprocess.run([sys.executable, "-m", "dpo.tools.profile", str(prof)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and again.stdout.splitlines()[:2] == table[:2]
  refused = subprocess.run([sys.executable, "-m", "dpo.tools.bench", f"--profile_dir={prof}"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert refused.returncode != 0 and "Traceback" not in refused.stderr
  assert "--profile_dir traces the step of one --worker_json process" in refused.stderr
  refused = subprocess.run([sys.executable, "-m", "dpo.tools.bench", f"--worker_json={out}",
                            "--profile_steps=3"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
  assert refused.returncode != 0 and "Traceback" not in refused.stderr
  assert "--profile_steps: the steps --profile_dir traces; give --profile_dir" in refused.stderr


def test_profile_own_times_subtract_the_ops_inside():
  """A loop op of 10 ns that ran two ops of 3 ns keeps 4 ns of its own; ops after it keep all."""
  class E:
    def __init__(self, name, start, dur):
      self.name, self.start_ns, self.duration_ns, self.stats = name, start, dur, []
  own = {n: t for n, t, _ in profile._self_times(
      [E("while", 0, 10), E("a", 1, 3), E("b", 5, 3), E("c", 10, 2)])}
  assert own == {"while": 4, "a": 3, "b": 3, "c": 2}


def test_bench_cpu_use_is_per_step_and_reads_steal_where_linux_counts_it():
  start = bench._cpu_use()
  t = time.process_time()
  while time.process_time() - t < 0.3:  # burn 0.3 CPU seconds in this process
    pass
  one, two = bench._cpu_use(start), bench._cpu_use(start, steps=2)
  assert one["user"] + one["system"] >= 0.25
  assert two["user"] == pytest.approx(one["user"] / 2, abs=0.02)  # per step: over the steps
  assert one["faults"] >= 0
  if os.path.exists("/proc/stat"):
    assert one["steal"] is not None and one["steal"] >= 0
  else:
    assert one["steal"] is None


def test_bench_precompute_ref_times_both_variants_to_the_same_loss(tool_output):
  lines = tool_output("bench_precompute_ref")
  assert lines[0].startswith("precompute: 16 pairs in ") and lines[0].endswith("(cache miss)")
  assert lines[1].startswith("config=default lora_rank=16 batch=4 ") and "steps=3" in lines[1]
  assert "'data': 2" in lines[1]
  losses = [float(x.split()[-1]) for x in lines[2].split(":", 1)[1].split(",")]
  assert losses[0] == pytest.approx(losses[1], abs=1e-5) and losses[0] != pytest.approx(math.log(2))
  assert lines[3].startswith("in-step reference:") and lines[4].startswith("precomputed:")
  assert lines[5].startswith("saving:")


def test_compare_losses_reports_one_row_per_loss(tool_output):
  lines = tool_output("compare_losses")
  rows = [json.loads(l) for l in lines if l.startswith("{")]
  assert [r["loss_type"] for r in rows] == ["sigmoid", "ipo"]
  for r in rows:
    assert (r["steps"], r["sft_steps"], r["skipped_steps"]) == (2, 2, 0)
    assert 0.0 <= r["reward_accuracy"] <= 1.0 and r["perplexity"] > 1.0
  with open(os.path.join(tool_output.dir, "compare_losses", "results.jsonl")) as f:
    assert [json.loads(l) for l in f] == rows
  assert any(l.startswith("SFT: 2 steps in ") for l in lines)


def test_compile_check_takes_config_flags(tool_output):
  lines = tool_output("compile_check")
  assert lines[0].startswith("config bench-small: ")
  assert "mesh {'data': 1, 'fsdp': 2, 'tensor': 1}" in lines[0] and "LoRA rank 0" in lines[0]
  assert "batch 2 pairs x 2 x 16 tokens" in lines[0]
  assert lines[-2].startswith("estimate per device: frozen ")
  assert lines[-1].startswith("compiler per device: arguments ")


def test_compile_check_names_a_tpu_slice_it_cannot_describe_in_one_line():
  """--topology compiles for a TPU slice ahead of time where libtpu is; on a CPU-only install it
  says so in one line, and refuses --fake_devices beside it."""
  if importlib.util.find_spec("libtpu") is not None:
    pytest.skip("libtpu is installed: the slice can be described here")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  run = lambda *args: subprocess.run([sys.executable, "-m", "dpo.tools.compile_check",
                                      "--config=llama3-8b", *args], cwd=ROOT, env=env,
                                     capture_output=True, text=True, timeout=300)
  done = run("--topology=v5e-16")
  assert done.returncode != 0 and "Traceback" not in done.stderr
  assert "--topology=v5e-16: cannot describe the TPU slice v5e:4x4 here" in done.stderr
  done = run("--topology=v4-8", "--fake_devices=4")
  assert done.returncode != 0 and "--fake_devices: give it or --topology, not both" in done.stderr


def test_base_memory_prints_the_real_size_presets(tool_output):
  lines = tool_output("base_memory")
  assert lines[0].split() == ["preset", "params", "float32", "bf16", "int8", "nf4"]
  rows = {l.split()[0]: l.split()[1:] for l in lines[1:]}
  assert list(rows) == list(configs.REAL_SIZES)
  # Llama 3.1 8B: 8,030,261,248 parameters (see the test above), float32 4 bytes each; bf16 (as
  # --base_quant=bf16 stores it): the 32 layers' 218,103,808 matrix weights 2 bytes each.
  matrices = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
  assert rows["llama3.1-8b"][:3] == ["8.03B", f"{8_030_261_248 * 4 / 2**30:.2f}G",
                                     f"{(8_030_261_248 * 4 - matrices * 2) / 2**30:.2f}G"]
  for params, f32, bf16, int8, nf4 in rows.values():
    assert float(f32[:-1]) > float(bf16[:-1]) > float(int8[:-1]) > float(nf4[:-1])


def test_flash_check_compares_the_kernel_with_the_xla_path(tool_output):
  """`python -m dpo.tools.flash_check` (here in interpret mode): a row per mask asked for, the
  float32 kernel within float32 rounding of the XLA path, the bfloat16 kernel no further from
  the float32 result than the bfloat16 XLA path."""
  lines = tool_output("flash_check")
  assert lines[0].startswith("platform cpu") and "tile 128" in lines[0]
  rows = {l.split()[0]: l.replace("|", " ").split()[1:] for l in lines[2:]}
  assert list(rows) == ["packed", "branches", "window", "softcap"]
  for out, grads, low_kernel, low_xla, *_ in rows.values():
    assert float(out) < 1e-5 and float(grads) < 1e-5
    assert float(low_kernel) <= 1.5 * float(low_xla)


def test_curves_draws_a_run_directory_with_its_rollbacks(tmp_path):
  """`python -m dpo.tools.curves --run_dir=DIR` as a user runs it; a rollback is a pure red
  line (matplotlib's colour cycle has none), so the PNG read back shows whether it is drawn."""
  import json
  import matplotlib.image
  import numpy as np
  records = [{"stage": "sft", "step": s, "loss": 5.0 - s, "grad_norm": 1.0, "learning_rate": 1e-3}
             for s in (1, 2)]
  records += [{"stage": "dpo", "step": s, "loss": 0.7 - 0.01 * s, "rewards/accuracies": 0.5,
               "rewards/margins": 0.1 * s, "rewards/chosen": 0.1, "rewards/rejected": -0.1,
               "kl": 0.01 * s, "grad_norm": 0.5, "learning_rate": 1e-4} for s in (1, 2, 3, 4)]
  records += [{"stage": "eval", "step": 2, "eval/win_rate": 0.6, "eval/perplexity": 3.0,
               "eval/reward_accuracy": 0.7, "eval/reward_margin": 0.2,
               "eval/kl_per_token": 0.02}]
  red = lambda png: int(np.all(matplotlib.image.imread(png)[..., :3] == [1, 0, 0], -1).sum())
  for name, extra in (("calm", []), ("spiky", [{"stage": "dpo", "step": 3, "event": "rollback",
                                                "reason": "kl", "to_step": 2, "lr_scale": 0.1,
                                                "rollbacks": 1}])):
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records + extra))
    proc = subprocess.run([sys.executable, "-m", "dpo.tools.curves", f"--run_dir={run}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(run / "curves.png")
  assert red(tmp_path / "calm" / "curves.png") == 0 < red(tmp_path / "spiky" / "curves.png")


@pytest.mark.skipif(sys.platform != "linux", reason="Linux's mmap advice and page-fault counts")
def test_refault_times_each_touch_with_and_without_huge_pages(tool_output):
  lines = tool_output("refault")
  assert lines[0].startswith("transparent huge pages: ") and "free page reporting: " in lines[0]
  huge = [l for l in lines[1:] if l.startswith("huge pages")]
  small = [l for l in lines[1:] if l.startswith("4 KiB pages")]
  # Huge pages: a row per gap, or one line saying why not (THP never or absent, advice refused).
  assert len(huge) == 2 or (len(huge) == 1 and ("none on this kernel" in huge[0]
                                                 or "madvise refused" in huge[0]))
  assert len(small) == 2
  for row, gap in zip((huge if len(huge) == 2 else []) + small, ["0.0", "0.1"] * 2):
    assert f" gap  {gap} s: touch 8 MiB in " in row
    ms = row.split(" in ")[1].split(" ms (")[0].split(", ")
    faults = [int(x) for x in row.split(" ms (")[1].split(" page faults)")[0].split(", ")]
    assert len(ms) == len(faults) == 2 and all(float(x) >= 0 for x in ms)  # --repeats touches
    if row in small:  # advised against huge pages: every 4 KiB page of 8 MiB faults on its own
      assert all(n >= 2048 for n in faults)
    assert row.split("reported meanwhile ")[1] == "-" or row.endswith(" MiB")

"""Kills one process of a two-process run and times how the other ends (dpo/distributed.py).

    python -m dpo.tools.peer_death                          # 10 trials each: kill 1, kill 0
    python -m dpo.tools.peer_death --when=startup --jitter_s=15   # kills before the first step
    python -m dpo.tools.peer_death --trials=3 --kill=0 --signal=STOP

Each trial launches launch.py twice on localhost (--distributed=explicit, two fake CPU devices
a process, gloo collectives; the tiny DPO run of tests/test_multihost.py), with the default
--heartbeat_timeout_seconds unless --heartbeat_timeout_seconds is given here. Once process 0
has written a metrics record (--when=steps: both are in the step loop) or both processes have
joined the runtime (--when=startup: data, compilation), it waits a random fraction of
--jitter_s, so the kill lands in any phase, sends --signal to the --kill process, and times
the survivor until it exits. A trial passes when the survivor exits with status 4
(distributed.PEER_LOST_EXIT) within --within_s, its log holds the project's one line, and no
line of JAX's own abort ("Terminating process because the JAX distributed service detected
fatal errors"), of a crash report or of C++ error logging (gRPC's). Prints one line a trial
and per killed process the median and maximum time and the exit statuses; exits 1 when any
trial fails. Logs go to --work_dir.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUN = ["--stage=dpo", "--steps=100000", "--log_every=1", "--checkpoint_every=0",
       "--vocab_size=264", "--d_model=32", "--n_layers=1", "--n_heads=2", "--n_kv_heads=2",
       "--head_dim=16", "--mlp_dim=64", "--task_train_pairs=64", "--task_sft_examples=16",
       "--task_eval_pairs=8", "--task_eval_prompts=4", "--max_prompt_length=24",
       "--max_target_length=24", "--global_batch_size=8", "--mesh=fsdp:2,tensor:2"]
PROJECT_LINE = "lost contact with the other processes"
JOINED = "distributed: process"  # dpo/distributed.py's log line once the runtime is up
# What a survivor must not print: JAX's own abort, a crash's report, a C++ error log line (the
# coordination service agent's or gRPC's, "E1205 12:00:00.000000 ...").
ABORTS = ("Terminating process because the JAX distributed service", "Fatal Python error",
          "*** Begin stack trace", "Traceback (most recent call last)")
CPP_ERROR = re.compile(r"^[EF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ", re.M)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(pid: int, port: int, out: str, log: str) -> subprocess.Popen:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  extra = ([f"--heartbeat_timeout_seconds={FLAGS.heartbeat_timeout_seconds}"]
           if FLAGS.heartbeat_timeout_seconds else [])
  cmd = [sys.executable, os.path.join(ROOT, "launch.py"), *RUN, f"--output_dir={out}",
         "--distributed=explicit", f"--coordinator_address=localhost:{port}",
         "--num_processes=2", f"--process_id={pid}", *extra]
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"),
                          stderr=subprocess.STDOUT)


def _started(metrics: str, logs) -> bool:
  """--when=steps: process 0 wrote a metrics record; startup: both joined the runtime."""
  if FLAGS.when == "steps":
    return os.path.exists(metrics) and os.path.getsize(metrics) > 0
  return all(JOINED in open(log, errors="replace").read() for log in logs)


def _wait_for(procs, metrics: str, logs) -> None:
  deadline = time.monotonic() + FLAGS.start_timeout_s
  while not _started(metrics, logs):
    for p, log in zip(procs, logs):
      if p.poll() is not None:
        raise RuntimeError(f"{log}: exited with {p.returncode} before the kill")
    if time.monotonic() > deadline:
      raise RuntimeError(f"not started ({FLAGS.when}) within {FLAGS.start_timeout_s} s")
    time.sleep(0.2)


def trial(victim: int, where: str) -> dict:
  """One two-process run, `victim` killed; the survivor's exit status, seconds and log verdict."""
  out, logs = os.path.join(where, "out"), [os.path.join(where, f"p{i}.log") for i in range(2)]
  port = _free_port()
  procs = [_launch(i, port, out, logs[i]) for i in range(2)]
  survivor = procs[1 - victim]
  try:
    _wait_for(procs, os.path.join(out, "metrics.jsonl"), logs)
    time.sleep(random.uniform(0, FLAGS.jitter_s))
    procs[victim].send_signal(getattr(signal, f"SIG{FLAGS.signal}"))
    killed = time.monotonic()
    try:
      rc = survivor.wait(timeout=FLAGS.give_up_s)
    except subprocess.TimeoutExpired:
      rc = None
    took = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  text = open(logs[1 - victim], errors="replace").read()
  noise = [a for a in ABORTS if a in text] + [m.group(0).strip() + "..." for m in
                                              CPP_ERROR.finditer(text)][:1]
  ok = rc == 4 and took <= FLAGS.within_s and PROJECT_LINE in text and not noise
  return {"rc": rc, "s": took, "line": PROJECT_LINE in text, "noise": noise, "ok": ok}


def main(argv) -> None:
  del argv
  work = FLAGS.work_dir or tempfile.mkdtemp(prefix="peer-death-")
  failed = 0
  for victim in (int(k) for k in FLAGS.kill):
    results = []
    for i in range(FLAGS.trials):
      where = os.path.join(work, f"kill{victim}", f"trial{i:02d}")
      os.makedirs(where, exist_ok=True)
      r = trial(victim, where)
      results.append(r)
      print(f"kill {victim} trial {i + 1:2d}: process {1 - victim} exit {r['rc']} after "
            f"{r['s']:5.1f} s, project line {'yes' if r['line'] else 'NO'}"
            f"{', also ' + '; '.join(r['noise']) if r['noise'] else ''}  "
            f"{'ok' if r['ok'] else 'FAIL'}  ({where})", flush=True)
    times = [r["s"] for r in results]
    codes = sorted({str(r["rc"]) for r in results})
    passed = sum(r["ok"] for r in results)
    failed += len(results) - passed
    print(f"kill {victim} (SIG{FLAGS.signal}): {passed}/{len(results)} ok; survivor exit "
          f"{', '.join(codes)}; seconds to exit: median {statistics.median(times):.1f}, max "
          f"{max(times):.1f} (limit {FLAGS.within_s:g})", flush=True)
  raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
  flags.DEFINE_integer("trials", 10, "Trials per killed process.")
  flags.DEFINE_list("kill", ["1", "0"], "Which process each round of trials kills.")
  flags.DEFINE_enum("signal", "KILL", ["KILL", "TERM", "STOP"], "What the killed process gets "
                    "(STOP: a hung host, its connections open).")
  flags.DEFINE_integer("heartbeat_timeout_seconds", 0, "Passed to both processes; 0 = "
                       "launch.py's default.")
  flags.DEFINE_float("within_s", 15.0, "The survivor must exit within this many seconds.")
  flags.DEFINE_enum("when", "steps", ["steps", "startup"], "steps: the kill comes after "
                    "process 0's first metrics record; startup: after both processes joined the "
                    "distributed runtime (data, compilation, the first steps).")
  flags.DEFINE_float("jitter_s", 2.0, "The kill waits a random fraction of this after --when.")
  flags.DEFINE_float("give_up_s", 180.0, "Stop waiting for the survivor after this long.")
  flags.DEFINE_float("start_timeout_s", 600.0, "Seconds for both processes to reach the "
                     "step loop.")
  flags.DEFINE_string("work_dir", "", "Where each trial's logs and output go; empty = a new "
                      "temporary directory.")
  app.run(main)

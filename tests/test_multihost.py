"""Real multi-process runs of launch.py on localhost (dpo/distributed.py and the launch flags).

Two processes with two fake CPU devices each (gloo collectives) must produce the loss trajectory
of one process with four devices; a killed process must bring the other down with an error
within the heartbeat timeout instead of leaving it hanging.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--stage=dpo", "--vocab_size=264", "--d_model=32", "--n_layers=1", "--n_heads=2",
        "--n_kv_heads=2", "--head_dim=16", "--mlp_dim=64", "--task_train_pairs=64",
        "--task_sft_examples=16", "--task_eval_pairs=8", "--task_eval_prompts=4",
        "--max_prompt_length=24", "--max_target_length=24", "--global_batch_size=8",
        "--learning_rate=1e-2", "--log_every=1", "--mesh=fsdp:2,tensor:2"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _launch(args, devices, log_path):
  return subprocess.Popen([sys.executable, os.path.join(ROOT, "launch.py"), *TINY, *args],
                          cwd=ROOT, env=_env(devices), stdout=open(log_path, "w"),
                          stderr=subprocess.STDOUT)


def _distributed(port, pid, heartbeat=100):
  return ["--distributed=explicit", f"--coordinator_address=localhost:{port}",
          "--num_processes=2", f"--process_id={pid}", f"--heartbeat_timeout_seconds={heartbeat}"]


def _records(out_dir):
  with open(os.path.join(out_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _wait(procs, logs, timeout=420):
  try:
    for p, log in zip(procs, logs):
      rc = p.wait(timeout=timeout)
      assert rc == 0, f"{log} exited {rc}:\n" + open(log).read()[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def test_two_processes_match_one_process_on_four_devices(tmp_path):
  port = _free_port()
  multi, single = tmp_path / "two", tmp_path / "one"
  logs = [tmp_path / "p0.log", tmp_path / "p1.log", tmp_path / "single.log"]
  steps = ["--steps=4"]
  procs = [
      _launch([*steps, f"--output_dir={multi}", *_distributed(port, 0)], 2, logs[0]),
      _launch([*steps, f"--output_dir={multi}", *_distributed(port, 1)], 2, logs[1]),
      _launch([*steps, f"--output_dir={single}"], 4, logs[2]),
  ]
  _wait(procs, logs)

  two, one = _records(multi), _records(single)
  # Only process 0 writes: exactly one record per step plus the eval record, not two.
  assert [r["stage"] for r in two] == ["dpo"] * 4 + ["eval"]
  assert [r["stage"] for r in one] == ["dpo"] * 4 + ["eval"]
  loss_two = np.array([r["loss"] for r in two if r["stage"] == "dpo"])
  loss_one = np.array([r["loss"] for r in one if r["stage"] == "dpo"])
  print("two-process loss:", loss_two.tolist())
  print("one-process loss:", loss_one.tolist())
  assert abs(loss_one[-1] - loss_one[0]) > 1e-3  # training moved the loss
  np.testing.assert_allclose(loss_two, loss_one, rtol=1e-5, atol=1e-6)
  for key in ("grad_norm", "rewards/margins", "rewards/accuracies", "logps/chosen"):
    np.testing.assert_allclose([r[key] for r in two[:4]], [r[key] for r in one[:4]],
                               rtol=1e-5, atol=1e-6, err_msg=key)
  for key in ("eval/reward_accuracy", "eval/reward_margin", "eval/perplexity"):
    np.testing.assert_allclose(two[-1][key], one[-1][key], rtol=1e-5, err_msg=key)
  # Process 1 logged no progress lines (only process 0 logs).
  assert "dpo     1/4" in open(logs[0]).read()
  assert "dpo     1/4" not in open(logs[1]).read()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_dead_process_stops_the_other_within_heartbeat_timeout(tmp_path, how):
  """SIGKILL: the survivor's collective fails at once; SIGSTOP (a hung host, connections
  open): the coordination service's missed heartbeats end it. Either way one line, status 4."""
  port = _free_port()
  heartbeat = 5
  logs = [tmp_path / "p0.log", tmp_path / "p1.log"]
  args = ["--steps=100000", "--log_every=1", f"--output_dir={tmp_path / 'out'}"]
  procs = [_launch([*args, *_distributed(port, i, heartbeat)], 2, logs[i]) for i in range(2)]
  try:
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.stat().st_size > 0):  # both are in the step loop
      assert procs[0].poll() is None and procs[1].poll() is None, open(logs[0]).read()[-3000:]
      assert time.monotonic() < deadline, "runs never reached the training loop"
      time.sleep(0.5)
    procs[1].send_signal(how)
    killed = time.monotonic()
    try:
      rc = procs[0].wait(timeout=120)
    except subprocess.TimeoutExpired:
      pytest.fail("process 0 still running 120 s after process 1 died")
    took = time.monotonic() - killed
    log = open(logs[0]).read()
    print(f"process 0 exited with {rc} {took:.1f} s after process 1 was killed")
    print(log[-1500:])
    # A clean exit: one line naming what was lost, status 4; no abort, no C++ stack dump.
    assert rc == 4, log[-3000:]
    assert "lost contact with the other processes" in log, log[-3000:]
    for noise in ("Fatal Python error", "SIGABRT", "Aborted", "*** Begin stack trace"):
      assert noise not in log, log[-3000:]
    assert took < heartbeat + 30
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()

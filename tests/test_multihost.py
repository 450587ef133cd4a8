"""Real multi-process runs of launch.py on localhost (dpo/distributed.py and the launch flags).

Two processes with two fake CPU devices each (gloo collectives) must produce the loss trajectory
of one process with four devices; a killed process must bring the other down with an error
within the heartbeat timeout instead of leaving it hanging, and rerunning both must resume from
the last checkpoint to the uninterrupted run's records and policy, bit for bit.
"""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from dpo import checkpoint
# By package path: launch.py imports this module for --reward_fn=tests.test_multihost:... with
# the repository root, not tests/, on its path.
from tests import numerics, records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--stage=dpo", "--vocab_size=264", "--d_model=32", "--n_layers=1", "--n_heads=2",
        "--n_kv_heads=2", "--head_dim=16", "--mlp_dim=64", "--task_train_pairs=64",
        "--task_sft_examples=16", "--task_eval_pairs=8", "--task_eval_prompts=4",
        "--max_prompt_length=24", "--max_target_length=24", "--global_batch_size=8",
        "--learning_rate=1e-2", "--log_every=1", "--mesh=fsdp:2,tensor:2"]


def _free_port() -> int:
  """A free port for the coordinator, below the kernel's ephemeral range (32768 and up on Linux),
  so no outgoing connection is given it before the coordinator binds it, and from this pytest-xdist
  worker's own block of 1000 (gw0: 20000-20999, gw1: 21000-21999, ...), so two workers never pick
  the same one; a random start in the block keeps two concurrent runs apart."""
  worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
  block = 20000 + 1000 * (worker % 10)
  start = random.randrange(1000)
  for i in range(1000):
    port = block + (start + i) % 1000
    with socket.socket() as s:
      try:
        s.bind(("localhost", port))
      except OSError:
        continue
      return port
  raise RuntimeError(f"no free port in {block}-{block + 999}")


def _env(devices: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _launch(args, devices, log_path, kill=()):
  """launch.py, or with `kill` = (WHEN, STEP) tests/launch_with_kill.py (a SIGKILL at that
  checkpoint)."""
  script = [os.path.join(ROOT, "tests", "launch_with_kill.py"), *map(str, kill)] if kill else [
      os.path.join(ROOT, "launch.py")]
  return subprocess.Popen([sys.executable, *script, *TINY, *args],
                          cwd=ROOT, env=_env(devices), stdout=open(log_path, "w"),
                          stderr=subprocess.STDOUT)


def _distributed(port, pid, heartbeat=100):
  return ["--distributed=explicit", f"--coordinator_address=localhost:{port}",
          "--num_processes=2", f"--process_id={pid}", f"--heartbeat_timeout_seconds={heartbeat}"]


def _records(out_dir):
  """metrics.jsonl's records without their wall-clock fields (tests/records.py)."""
  return records.metrics(out_dir)


def _wait(procs, logs, timeout=420):
  try:
    for p, log in zip(procs, logs):
      rc = p.wait(timeout=timeout)
      assert rc == 0, f"{log} exited {rc}:\n" + open(log).read()[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


# Four steps with checkpoints at 2 and 4: the runs below, and the killed-peer run's rerun.
STEPS = ["--steps=4", "--checkpoint_every=2"]


def _no_abort(log: str) -> None:
  """A clean exit: no abort, no C++ stack dump."""
  for noise in ("Fatal Python error", "SIGABRT", "Aborted", "*** Begin stack trace"):
    assert noise not in log, log[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The 4-step run as two processes with two devices each and as one process with four,
  launched together: (two-process output, one-process output, logs)."""
  tmp = tmp_path_factory.mktemp("uninterrupted")
  port = _free_port()
  multi, single = tmp / "two", tmp / "one"
  logs = [tmp / "p0.log", tmp / "p1.log", tmp / "single.log"]
  procs = [
      _launch([*STEPS, f"--output_dir={multi}", *_distributed(port, 0)], 2, logs[0]),
      _launch([*STEPS, f"--output_dir={multi}", *_distributed(port, 1)], 2, logs[1]),
      _launch([*STEPS, f"--output_dir={single}"], 4, logs[2]),
  ]
  _wait(procs, logs)
  return multi, single, logs


@pytest.mark.slow
def test_two_processes_match_one_process_on_four_devices(uninterrupted):
  multi, single, logs = uninterrupted
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


@pytest.mark.slow
def test_two_processes_pack_their_own_blocks_to_the_unpacked_losses(tmp_path, varied_pairs):
  """--packing on pairs of varied lengths: each process packs only its block of the batch, and
  the metrics equal one process's unpacked run (dropout off: the layouts draw other masks) within
  tests/numerics.py's bounds; two processes that each pack process 0's block miss them by orders
  of magnitude."""
  args = ["--steps=4", "--checkpoint_every=0", f"--train_data={varied_pairs}", "--eval_split=0.1",
          "--max_target_length=40", "--lora_dropout=0", "--eval_max_new_tokens=4"]
  port = _free_port()
  wrong_port = next(p for p in iter(_free_port, None) if p != port)
  multi, single, wrong = tmp_path / "two", tmp_path / "one", tmp_path / "wrong"
  logs = [tmp_path / f"{name}.log" for name in ("p0", "p1", "single", "wrong0", "wrong1")]
  packed = lambda out, p, i, kill=(): _launch(
      [*args, "--packing", f"--output_dir={out}", *_distributed(p, i)], 2, logs[i], kill)
  _wait([packed(multi, port, 0), packed(multi, port, 1),
         _launch([*args, f"--output_dir={single}"], 4, logs[2]),
         *(_launch([*args, "--packing", f"--output_dir={wrong}", *_distributed(wrong_port, i)], 2,
                   logs[3 + i], ("pack-block-0",)) for i in range(2))], logs)
  two, one, bad = ([r for r in _records(out) if r["stage"] == "dpo"]
                   for out in (multi, single, wrong))
  log = open(logs[0]).read()
  assert "packing: 8 pairs a step" in log
  assert float(re.search(r"batches ([\d.]+) rows a step", log).group(1)) < 8  # pairs share rows
  assert all(r["fill_rate"] > 0 for r in two)
  assert "fault: every process packs block 0" in open(logs[4]).read()
  # Step 1: both layouts compute the same function of the same weights, their sums in another
  # order, so every figure is within the reordering bound tau of its longest sums: the weight
  # gradients' over the batch's tokens (at most 8 pairs x 2 rows x 64 slots) through the layer's
  # contractions forward and back. (The step-1 margins are rounding noise around 0 in both.)
  tau = numerics.reorder_tol(8 * 2 * (24 + 40), numerics.backprop_depth(1))
  first = lambda rows: {k: np.float64(rows[0][k]) for k in ("loss", "grad_norm", "logps/chosen")}
  # Steps 2-4: AdamW turns the gradients' relative error tau into weights whose displacements
  # differ by up to adam_tol(tau) (elements with gradients near zero may flip their update), and
  # every later figure is a function of those weights.
  later = lambda rows: {k: np.array([r[k] for r in rows[1:]]) for k in (
      "loss", "grad_norm", "rewards/margins", "logps/chosen")}
  numerics.assert_close({"step 1": (first(two), first(one), tau),
                         "steps 2-4": (later(two), later(one), numerics.adam_tol(tau))})
  numerics.assert_mistake_caught({"step 1": (first(bad), first(one), tau)},
                                 "every process packing process 0's block")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.slow
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
    _no_abort(log)
    assert took < heartbeat + 30
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


@pytest.mark.slow
def test_killed_peer_then_the_rerun_resumes_to_the_uninterrupted_run(tmp_path, uninterrupted):
  """Process 1 is SIGKILLed right after the step-2 checkpoint: process 0 exits with one line and
  status 4 within the heartbeat bound; rerunning both resumes from step 2, and the records and
  the policy equal the uninterrupted two-process run's bit for bit (the same mesh, the same
  executables, gloo's fixed reduction order)."""
  heartbeat, out = 10, tmp_path / "out"
  args = [*STEPS, f"--output_dir={out}"]
  logs = [tmp_path / "p0.log", tmp_path / "p1.log"]
  port = _free_port()
  procs = [_launch([*args, *_distributed(port, 0, heartbeat)], 2, logs[0]),
           _launch([*args, *_distributed(port, 1, heartbeat)], 2, logs[1], kill=("after", 2))]
  try:
    assert procs[1].wait(timeout=420) == -signal.SIGKILL, open(logs[1]).read()[-3000:]
    killed = time.monotonic()
    rc = procs[0].wait(timeout=heartbeat + 60)
    took = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  log = open(logs[0]).read()
  print(f"process 0 exited with {rc} {took:.1f} s after process 1 was killed")
  assert rc == 4 and "lost contact with the other processes" in log, log[-3000:]
  _no_abort(log)
  assert took < heartbeat + 30
  dpo_dir = out / "checkpoints" / "dpo"
  assert sorted(os.listdir(dpo_dir)) == ["step_00000002"]  # nothing half-written beside it
  assert [r["step"] for r in _records(out)] == [1, 2]

  port = _free_port()
  reruns = [tmp_path / "rerun0.log", tmp_path / "rerun1.log"]
  _wait([_launch([*args, *_distributed(port, i)], 2, reruns[i]) for i in range(2)], reruns)
  rerun = open(reruns[0]).read()
  assert "dpo: resumed from" in rerun and "(step 2 of 4)" in rerun, rerun[-3000:]
  multi = uninterrupted[0]
  assert _records(out) == _records(multi)
  for name in ("policy", "dpo/step_00000004"):  # every array file's sha256 (the manifests')
    assert (checkpoint.digest(str(out / "checkpoints" / name)) ==
            checkpoint.digest(str(multi / "checkpoints" / name))), name


def length_reward(prompt, completion):
  """A judge that tells a random model's samples apart (the embedded task's reward is 0 on them),
  so the labels, advantages and updates depend on what was sampled."""
  return float(len(completion))


# The online stages on the embedded task from a random init, 2 processes x 2 devices against
# 1 x 4: a few steps, no checkpoints, a short final evaluation.
ONLINE = ["--checkpoint_every=0", "--eval_max_new_tokens=4"]
LENGTH = "--reward_fn=tests.test_multihost:length_reward"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [
    # the judge a reward model on the mesh: the run's own rm stage, on half the pairs
    ["--stage=rm,online_dpo", "--online_steps=2", "--judge=rm", "--rm_split=0.5",
     "--rm_steps=2", "--online_max_new_tokens=8"],
    ["--stage=grpo", "--grpo_steps=2", "--num_iterations=2", "--num_generations=4",
     "--max_completion_length=8", "--grpo_beta=0.04", LENGTH],
    ["--stage=iterative_dpo", "--iterative_rounds=2", "--iterative_steps_per_round=1", LENGTH,
     "--online_max_new_tokens=8"],
], ids=["online_dpo", "grpo", "iterative_dpo"])
def test_online_stage_in_two_processes_is_the_one_process_run(tmp_path, stage):
  """Every process samples the whole batch on the global mesh, judges every sample and trains on
  its block of the rows (iterative DPO: of the round file process 0 wrote): the records and the
  policy equal one process's on the same mesh bit for bit (the same executables; gloo's two-way
  sums are exact in either order)."""
  args = [*ONLINE, *stage]
  port = _free_port()
  multi, single = tmp_path / "two", tmp_path / "one"
  logs = [tmp_path / "p0.log", tmp_path / "p1.log", tmp_path / "single.log"]
  _wait([_launch([*args, f"--output_dir={multi}", *_distributed(port, i)], 2, logs[i])
         for i in range(2)] + [_launch([*args, f"--output_dir={single}"], 4, logs[2])], logs)
  name = stage[0].split(",")[-1].removeprefix("--stage=")
  # The rm judge's name holds its run's output directory.
  named = lambda out: [{k: v.replace(str(out), "OUT") if isinstance(v, str) else v
                        for k, v in r.items()} for r in _records(out)]
  two, one = named(multi), named(single)
  assert [r["stage"] for r in one if r["stage"] != "rm"] == [name] * 2 + ["eval"]
  trained = [r for r in one if r["stage"] == name]
  if name == "grpo":  # the samples' rewards differ, so the advantages and the update are not 0
    assert all(r["reward_std"] > 0 for r in trained)
  else:  # the judge chose between different samples
    assert all(r["objective/scores_margin"] > 0 for r in trained)
  assert two == one
  if name == "iterative_dpo":  # process 0 wrote each round file; all trained on it
    for r in range(2):
      path = os.path.join("iterative", f"round_{r}.jsonl")
      assert open(multi / path).read() == open(single / path).read()
  assert (checkpoint.digest(str(multi / "checkpoints" / "policy")) ==
          checkpoint.digest(str(single / "checkpoints" / "policy")))


# --- how a survivor sees a death at once (dpo/distributed.py), without a second process --------

@pytest.fixture
def losses(monkeypatch):
  """distributed's module state afresh, and `_peer_lost` recording its reason instead of exiting."""
  import threading
  from dpo import distributed
  seen = []
  monkeypatch.setattr(distributed, "_peer_lost", seen.append)
  for name in ("_JOINED", "_FINISHED"):
    monkeypatch.setattr(distributed, name, threading.Event())
  monkeypatch.setattr(distributed, "_DONE", set())
  monkeypatch.setattr(distributed, "_STOPPED", set())
  monkeypatch.setattr(distributed, "_LINKS", [])
  monkeypatch.setattr(distributed, "_READERS", [])
  monkeypatch.setattr(distributed, "_OWN_EXIT_GRACE_S", 0.5)
  return distributed, seen


def _settle(condition, timeout=5.0):
  deadline = time.monotonic() + timeout
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.01)


def test_a_link_closed_without_goodbye_is_a_loss_and_one_with_it_is_not(losses):
  distributed, seen = losses
  dead, ours = socket.socketpair()
  distributed._watch_link(ours, "process 1")
  dead.close()  # what the kernel does to a killed process's sockets
  _settle(lambda: seen)
  assert seen == ["process 1 closed its connection: it exited or was killed"]
  done, ours = socket.socketpair()
  distributed._watch_link(ours, "process 2")
  done.sendall(distributed._GOODBYE)  # `finished`, then the process exits
  done.close()
  _settle(lambda: "process 2" in distributed._DONE)
  assert distributed._DONE == {"process 2"} and len(seen) == 1


def test_the_relay_carries_the_service_and_reports_its_close_first(losses):
  """Bytes pass both ways; the service's side closing during the run is reported (the relay
  keeps JAX's client from seeing it first); before the run is joined it is not."""
  distributed, seen = losses
  with socket.create_server(("127.0.0.1", 0)) as service:
    relay = distributed._relay(service.getsockname())
    client = socket.create_connection(distributed._split_address(relay))
    upstream, _ = service.accept()
    client.sendall(b"ping")
    assert upstream.recv(4) == b"ping"
    upstream.sendall(b"pong")
    assert client.recv(4) == b"pong"
    distributed._JOINED.set()
    upstream.close()  # process 0, and its service, killed
    _settle(lambda: seen)
    assert seen == [f"{distributed._COORDINATOR} closed the coordination service's connection: "
                    f"it exited or was killed"]
    seen.clear()
    distributed._DONE.add(distributed._COORDINATOR)  # process 0 finished: its close is no loss
    client = socket.create_connection(distributed._split_address(relay))
    upstream, _ = service.accept()
    upstream.close()
    assert client.recv(4) == b""  # the close reaches the client
    assert seen == []


def test_a_peer_stopping_on_an_error_is_named_unless_this_process_stops_too(losses):
  """A peer's `failed` (it exits on an error of its own): reported after the grace, unless this
  process finishes meanwhile (it stops on the same error, with its own status)."""
  distributed, seen = losses
  failing, ours = socket.socketpair()
  distributed._watch_link(ours, "process 1")
  failing.sendall(distributed._FAILED)
  _settle(lambda: seen, timeout=3.0)
  assert seen == ["process 1 stopped with an error; its log says which"]
  seen.clear()
  failing, ours = socket.socketpair()
  distributed._watch_link(ours, "process 2")
  failing.sendall(distributed._FAILED)
  distributed._FINISHED.set()  # this process stops too
  failing.close()
  distributed._READERS[-1].join(3.0)
  assert seen == [] and "process 2" in distributed._STOPPED


def test_the_relay_does_not_take_its_own_clients_close_for_the_services(losses):
  """This process's JAX client closing its connection (its own exit) is no loss of process 0."""
  distributed, seen = losses
  distributed._JOINED.set()
  with socket.create_server(("127.0.0.1", 0)) as service:
    relay = distributed._relay(service.getsockname())
    client = socket.create_connection(distributed._split_address(relay))
    upstream, _ = service.accept()
    client.close()
    assert upstream.recv(4) == b""  # the close reached the service's side
    time.sleep(0.2)
    assert seen == []


@pytest.mark.slow
@pytest.mark.parametrize("bad", [(0, 1), (1,)], ids=["both", "process 1 alone"])
def test_a_process_stopping_on_an_error_ends_the_run_with_its_status(tmp_path, bad):
  """A missing --train_data given to both processes: each exits 2 with its one line; given to
  process 1 alone: it exits 2, and process 0 says process 1 stopped on an error and exits 4, in
  seconds (not after JAX's exit barrier or a heartbeat timeout), with no abort."""
  port = _free_port()
  logs = [tmp_path / "p0.log", tmp_path / "p1.log"]
  data = lambda i: [f"--train_data={tmp_path / 'missing.jsonl'}"] if i in bad else []
  procs = [_launch([*data(i), "--steps=100000", f"--output_dir={tmp_path / 'out'}",
                    *_distributed(port, i)], 2, logs[i]) for i in range(2)]
  try:
    rcs = [p.wait(timeout=240) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  text = [open(log).read() for log in logs]
  want = [2 if i in bad else 4 for i in range(2)]
  assert rcs == want, text
  for i in range(2):
    _no_abort(text[i])
    line = ("--train_data=" if i in bad else "process 1 stopped with an error")
    assert line in text[i], text[i][-3000:]

"""--autotune: the fastest candidate of fake timings, the cache, the per-run record, off, the log
lines, and a resumed run that keeps its recorded choice (bitwise)."""
import functools
import json
import logging
import os
import threading

import jax
import jax.numpy as jnp
import pytest

import configs
from dpo import autotune, checkpoint, cli, loop
from faults import Crash, SimulatedCrash
from models import sharding
from test_checkpoint import assert_tree_bitwise, records, tiny_cfg

pytestmark = pytest.mark.usefixtures("compile_cache")

SHAPES = {"tokens": (4, 2, 256)}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("DPO_JAX_CACHE", str(tmp_path / "cache"))
  return tmp_path / "cache"


def fake(*passes: dict):
  """A `time_steps` from {setting text: seconds} (default 1.0), one dict per call (the last
  for the calls after), recording what it timed: `calls` the settings, `batches` per call."""
  def time_steps(settings):
    names = [autotune.describe(s) for s in settings]
    seconds = passes[min(len(time_steps.batches), len(passes) - 1)] if passes else {}
    time_steps.calls.extend(names)
    time_steps.batches.append(names)
    return [seconds.get(name, 1.0) for name in names]
  time_steps.calls, time_steps.batches = [], []
  return time_steps


def trial(time_steps, record_dir=None, shapes=SHAPES):
  """The DPO step's tuning on rows of 320 slots (long enough to try the query block)."""
  return autotune.Trial("dpo", shapes, 320, time_steps, record_dir)


def bench(**kw):
  return configs.get_config("bench-small").replace(**{"autotune": "on", **kw})


def test_candidates_start_with_the_config_and_respect_remat():
  cfg = bench()
  options = autotune.candidates(cfg.model)
  assert options[0] == {"scan_unroll": 8, "matmul_backward": "explicit", "attention_block": 0}
  assert {(c["scan_unroll"], c["matmul_backward"]) for c in options} == {
      (1, "autodiff"), (1, "explicit"), (8, "autodiff"), (8, "explicit")}
  assert len(options) == 4
  rolled = autotune.candidates(bench(remat=True, scan_unroll=1).model)
  assert {c["scan_unroll"] for c in rolled} == {1} and len(rolled) == 2


def test_picks_the_fastest_then_times_it_beside_the_query_block_and_logs_each(caplog):
  cfg = bench()
  quick = {"scan_unroll": 1, "matmul_backward": "explicit", "attention_block": 0}
  blocked = {**quick, "attention_block": 64}
  grid = {autotune.describe(quick): 0.5}
  # Under the load of the second pass the winner takes 0.7 s: the query block's 0.6 s is
  # compared with that, not with the winner's 0.5 s of the first pass.
  paired = {autotune.describe(quick): 0.7, autotune.describe(blocked): 0.6}
  time_step = fake(grid, paired)
  with caplog.at_level(logging.INFO):
    best, times = autotune.choose(cfg.model, 320, time_step, "dpo")
  assert best == blocked
  options = [autotune.describe(c) for c in autotune.candidates(cfg.model)]
  assert time_step.batches == [options, [autotune.describe(quick), autotune.describe(blocked)]]
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("autotune dpo: --")]
  assert len(lines) == 6 and all(" s per step" in line for line in lines)
  assert times == {"seconds": {name: grid.get(name, 1.0) for name in options},
                   "query_block": paired}
  # The query block slower beside the winner: whole rows kept; every time equal: the config's.
  assert autotune.choose(cfg.model, 320, fake(grid), "dpo")[0] == quick
  assert autotune.choose(cfg.model, 320, fake({}), "dpo")[0] == autotune.candidates(cfg.model)[0]
  # Rows too short for a block to skip anything: only the four.
  assert autotune.choose(cfg.model, 100, fake({}), "dpo")[1] == {
      "seconds": {name: 1.0 for name in options}}


def test_the_choice_is_cached_recorded_and_reused(tmp_path, cache_dir, caplog):
  cfg = bench()
  slow_default = fake({autotune.describe({"scan_unroll": 8, "matmul_backward": "explicit",
                                          "attention_block": 0}): 3.0,
                       autotune.describe({"scan_unroll": 1, "matmul_backward": "autodiff",
                                          "attention_block": 0}): 0.9})
  tuned = autotune.tuned(cfg, trial(slow_default, str(tmp_path / "run")))
  assert (tuned.model.scan_unroll, tuned.model.matmul_backward) == (1, "autodiff")
  assert tuned.model.attention_block == 0 and tuned.lora == cfg.lora
  with open(cache_dir / "autotune.json") as f:
    (entry,) = json.load(f).values()
  assert entry["choice"] == {"scan_unroll": 1, "matmul_backward": "autodiff", "attention_block": 0}
  assert len(entry["seconds"]) == 4 and len(entry["query_block"]) == 2
  assert entry["cpu"] == autotune.cpu_model()
  assert entry["load"] >= 0
  with open(tmp_path / "run" / "autotune.json") as f:
    assert json.load(f) == {"dpo": entry}
  # Another run on the same machine and shapes reads the cache: nothing is timed.
  again = fake({})
  with caplog.at_level(logging.INFO):
    assert autotune.tuned(cfg, trial(again, str(tmp_path / "other"))) == tuned
  assert again.calls == [] and "from " + str(cache_dir) in caplog.text
  # Other shapes are another key.
  other = fake({})
  autotune.tuned(cfg, trial(other, shapes={"tokens": (8, 2, 256)}))
  assert len(other.calls) == 6


def test_two_runs_measuring_at_once_both_keep_their_cache_entry(cache_dir, monkeypatch):
  """Two runs (threads) measure other shapes at once and both write the cache: each write
  first waits (up to a second) for the other, so without the lock both would write the table
  they read before either wrote, and one entry would be lost."""
  both = threading.Barrier(2, timeout=1.0)
  write = autotune._write

  def meeting_write(path, table):
    try:
      both.wait()  # under the lock the other run waits for the lock instead: the barrier breaks
    except threading.BrokenBarrierError:
      pass
    write(path, table)
  monkeypatch.setattr(autotune, "_write", meeting_write)
  cfg, shapes = bench(), [{"tokens": (4, 2, 256)}, {"tokens": (8, 2, 256)}]
  runs = [threading.Thread(target=autotune.tuned, args=(cfg, trial(fake({}), shapes=s)))
          for s in shapes]
  for run in runs:
    run.start()
  for run in runs:
    run.join()
  keys = {autotune.key(cfg, "dpo", s, autotune.candidates(cfg.model), True) for s in shapes}
  with open(cache_dir / "autotune.json") as f:
    assert set(json.load(f)) == keys and len(keys) == 2


def test_the_run_record_wins_over_the_cache(tmp_path, cache_dir):
  cfg = bench()
  run = str(tmp_path / "run")
  first = autotune.tuned(cfg, trial(fake({}), run))
  assert first == cfg  # every candidate ties: the config's own, first
  # The cache now says otherwise (another run's measurement): a resume keeps its own record.
  with open(cache_dir / "autotune.json") as f:
    cache = json.load(f)
  (k,) = cache
  cache[k]["choice"] = {"scan_unroll": 1, "matmul_backward": "autodiff", "attention_block": 64}
  with open(cache_dir / "autotune.json", "w") as f:
    json.dump(cache, f)
  assert autotune.tuned(cfg, trial(fake({}), run)) == cfg
  assert autotune.tuned(cfg, trial(fake({}))).model.attention_block == 64


def test_a_record_under_another_key_is_kept_and_an_unreadable_one_refused(tmp_path, cache_dir,
                                                                         caplog):
  """A resume on another machine (another key) trains with the recorded choice and leaves the
  record as it is; a record that cannot be read is an error naming it, not a new measurement."""
  cfg = bench()
  run = tmp_path / "run"
  run.mkdir()
  recorded = {"key": "another-machine", "choice": {"scan_unroll": 1, "matmul_backward":
                                                   "autodiff", "attention_block": 64}}
  (run / "autotune.json").write_text(json.dumps({"dpo": recorded}))
  time_step = fake({})
  with caplog.at_level(logging.WARNING):
    got = autotune.tuned(cfg, trial(time_step, str(run)))
  assert (got.model.scan_unroll, got.model.attention_block) == (1, 64) and time_step.calls == []
  assert json.loads((run / "autotune.json").read_text()) == {"dpo": recorded}
  assert "measured under another key" in caplog.text
  (run / "autotune.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"--autotune=on: .*autotune.json cannot be read") as e:
    autotune.tuned(cfg, trial(fake({}), str(run)))
  assert "\n" not in str(e.value)


def test_recorded_is_the_config_a_finished_stage_trained_with(tmp_path):
  """What a stage's saved model is checked against before the stage is tuned again: the
  recorded choice; the config itself with none recorded for that stage, or with off."""
  cfg = bench()
  assert autotune.recorded(cfg, "dpo", str(tmp_path)) == cfg  # no record yet
  choice = {"scan_unroll": 1, "matmul_backward": "autodiff", "attention_block": 64}
  (tmp_path / "autotune.json").write_text(json.dumps({"dpo": {"key": "k", "choice": choice}}))
  assert autotune.recorded(cfg, "dpo", str(tmp_path)) == cfg.replace(**choice)
  assert autotune.recorded(cfg, "sft", str(tmp_path)) == cfg
  off = bench(autotune="off")
  assert autotune.recorded(off, "dpo", str(tmp_path)) is off


def test_a_repeat_trains_with_the_choice_recorded_by_the_run_it_repeats(tmp_path, cache_dir,
                                                                         caplog):
  """--autotune_from (which a run's flags.txt names): each stage recorded there trains with that
  choice, with no cache and nothing timed, and it goes into the repeat's own record; a stage
  not recorded there is measured; the run's own record named (a resume from its flags.txt
  before any choice) is no error; a file that cannot be read is one error line."""
  cfg = bench()
  first = tmp_path / "first"
  quick = {"scan_unroll": 1, "matmul_backward": "autodiff", "attention_block": 64}
  chosen = autotune.tuned(cfg, trial(fake({autotune.describe({**quick, "attention_block": 0}):
                                           0.5, autotune.describe(quick): 0.1}), str(first)))
  assert chosen.model.attention_block == 64
  (cache_dir / "autotune.json").unlink()  # another machine, or the cache deleted
  repeat = cfg.replace(autotune_from=str(first / "autotune.json"))
  time_step = fake({})  # measured now, the config's own would win
  with caplog.at_level(logging.INFO):
    assert autotune.tuned(repeat, trial(time_step, str(tmp_path / "again"))).model == chosen.model
  assert time_step.calls == [] and f"(from {first / 'autotune.json'})" in caplog.text
  assert (json.loads((tmp_path / "again" / "autotune.json").read_text()) ==
          json.loads((first / "autotune.json").read_text()))
  other_stage = autotune.Trial("sft", SHAPES, 320, fake({}), str(tmp_path / "again"))
  with caplog.at_level(logging.INFO):
    assert autotune.tuned(repeat, other_stage).model == cfg.model
  assert len(other_stage.time_steps.calls) == 6
  assert "records no choice for it" in caplog.text
  own = tmp_path / "own"
  autotune.tuned(cfg.replace(autotune_from=str(own / "autotune.json")), trial(fake({}), str(own)))
  for gone in (tmp_path / "none.json", tmp_path / "own"):
    with pytest.raises(ValueError, match=f"--autotune_from={gone}: cannot be read") as e:
      autotune.tuned(cfg.replace(autotune_from=str(gone)), trial(fake({}), str(tmp_path / "x")))
    assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="--autotune_from=.*must go with --autotune=on"):
    bench(autotune="off", autotune_from=str(first / "autotune.json"))


def test_the_key_holds_every_section_a_step_reads():
  """A loss, optimizer or reference setting changes the compiled step, so the key; where the
  run writes does not."""
  cfg = bench()
  k = lambda c: autotune.key(c, "dpo", SHAPES, autotune.candidates(c.model), True)
  assert k(cfg) == k(cfg.replace(output_dir="/elsewhere", seed=7))
  for change in (dict(loss_type=("ipo",)), dict(gradient_accumulation_steps=2),
                 dict(max_grad_norm=0.5), dict(lora_rank=8)):
    assert k(cfg.replace(**change)) != k(cfg), change


def test_off_changes_nothing_and_times_nothing(tmp_path, cache_dir):
  cfg = bench(autotune="off")
  time_step = fake({})
  assert autotune.tuned(cfg, trial(time_step, str(tmp_path))) is cfg
  assert time_step.calls == [] and not os.path.exists(cache_dir)
  assert not os.path.exists(tmp_path / "autotune.json")


def counted_steps(calls: list):
  """`step_of` for `interleaved`: each setting's jitted step (state donated), recording its
  calls by the setting's "add"."""
  def step_of(setting):
    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, frozen, batch):
      return state + setting["add"] + frozen * batch, {"loss": state.sum()}
    def counted(*args):
      calls.append(setting["add"])
      return step(*args)
    return counted
  return step_of


def test_interleaved_compiles_then_times_each_setting_per_round_on_the_donated_state():
  """Each call compiles its settings, then times them round-robin; the steps train the state
  they were given (no copy: a copy would double the state's memory in a run and in the bench's
  peak RSS), across calls."""
  calls = []
  state = jnp.zeros(3)
  time_steps = autotune.interleaved(counted_steps(calls), state, jnp.ones(3), jnp.ones(3),
                                    rounds=2)
  seconds = time_steps([{"add": 1.0}, {"add": 2.0}])
  assert len(seconds) == 2 and all(t > 0 for t in seconds)
  assert calls == [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]  # compile calls, then round-robin rounds
  assert state.is_deleted()  # the first step took the caller's buffer
  assert len(time_steps([{"add": 1.0}])) == 1 and calls[6:] == [1.0] * 3  # the trained state


@pytest.mark.slow
def test_a_run_builds_one_state_to_measure_both_passes(tmp_path, monkeypatch):
  """The query-block pass times on the state the first pass trained: each tuned stage builds
  one fresh state to measure, not one per pass."""
  built = []
  real = autotune.interleaved

  def counting(step_of, state, *args):
    built.append(state)
    return real(step_of, state, *args)

  def two_passes(model, slots, time_steps, label, blocks=True):
    first = autotune.candidates(model)[0]
    seconds = dict(zip([autotune.describe(first)], time_steps([first])))
    time_steps([first])  # as `choose`'s query-block pass calls it again
    return first, {"seconds": seconds}
  monkeypatch.setattr(autotune, "interleaved", counting)
  monkeypatch.setattr(autotune, "choose", two_passes)
  loop.run(tiny_cfg(tmp_path / "run", autotune="on"))
  with open(tmp_path / "run" / "autotune.json") as f:
    assert set(json.load(f)) == {"sft", "dpo"}
  assert len(built) == 2  # one per stage


@pytest.mark.slow
def test_a_resumed_run_keeps_its_recorded_choice_bitwise(tmp_path, monkeypatch, cache_dir):
  """The tiny SFT -> DPO run with --autotune=on measures its candidates for real and records
  the choice; a run crashed in DPO and resumed with neither the cache nor a measurement that
  agrees (the rerun would pick the other backward) keeps the recorded choice and ends as the
  uninterrupted run."""
  ref = tmp_path / "uninterrupted"
  loop.run(tiny_cfg(ref, autotune="on"))
  with open(ref / "autotune.json") as f:
    recorded = json.load(f)
  assert set(recorded) == {"sft", "dpo"}
  for entry in recorded.values():  # one layer: the rolled scan, with each backward
    assert len(entry["seconds"]) == 2 and entry["choice"]["scan_unroll"] == 1
    assert "query_block" not in entry  # rows too short to skip any keys
  cut = tmp_path / "interrupted"
  with pytest.raises(SimulatedCrash):  # the same machine and shapes: the cached choice
    loop.run(tiny_cfg(cut, autotune="on"), extra_hooks={"dpo": [Crash(5)]})
  with open(cut / "autotune.json") as f:
    assert json.load(f) == recorded
  measured = []

  def other(model, slots, time_steps, label, blocks=True):
    measured.append(label)
    flip = {"explicit": "autodiff", "autodiff": "explicit"}
    best = {**recorded[label]["choice"],
            "matmul_backward": flip[recorded[label]["choice"]["matmul_backward"]]}
    return best, {"seconds": {autotune.describe(best): 0.1}}
  monkeypatch.setattr(autotune, "choose", other)
  monkeypatch.setenv("DPO_JAX_CACHE", str(tmp_path / "empty"))
  loop.run(tiny_cfg(cut, autotune="on"))
  assert measured == []  # the run's own record answered
  assert records(cut) == records(ref)
  cfg = tiny_cfg(ref)
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  assert_tree_bitwise(checkpoint.load_params(str(cut / "checkpoints" / "policy"), cfg.model, mesh),
                      checkpoint.load_params(str(ref / "checkpoints" / "policy"), cfg.model, mesh))


@pytest.mark.slow
def test_the_sft_model_and_a_rerun_from_flags_txt_keep_the_tuned_settings(tmp_path, monkeypatch):
  """--autotune=on choosing other settings than the config's: the saved SFT model's fingerprint
  is its stage checkpoints' (the tuned settings), and a rerun in the same folder checks it
  against the recorded choice, so it reuses the model rather than refusing it as another run's.
  flags.txt keeps --autotune=on and names the run's record: `--flagfile=` into another folder,
  with no cache and a measurement that would choose otherwise, trains as the run did."""
  def explicit(model, slots, time_steps, label, blocks=True):
    best = {**autotune.candidates(model)[0], "matmul_backward": "explicit"}
    return best, {"seconds": {autotune.describe(best): 0.1}}
  monkeypatch.setattr(autotune, "choose", explicit)
  out = tmp_path / "run"
  cfg = tiny_cfg(out, autotune="on", stage="sft", matmul_backward="autodiff")
  loop.run(cfg)
  saved = checkpoint.read_meta(str(out / "checkpoints" / "sft_model"))["fingerprint"]
  last = sorted((out / "checkpoints" / "sft").glob("step_*"))[-1]
  assert saved == checkpoint.read_meta(str(last))["fingerprint"]
  assert saved["model.matmul_backward"] == "explicit"
  loop.run(cfg)  # the SFT model is complete and of this run: reused, not refused

  lines = (out / "flags.txt").read_text().split()
  assert "--autotune=on" in lines and f"--autotune_from={out / 'autotune.json'}" in lines
  import launch
  try:
    launch.FLAGS.unparse_flags()
    launch.FLAGS(["launch.py", f"--flagfile={out / 'flags.txt'}",
                  f"--output_dir={tmp_path / 'again'}"])
    again = cli.from_flags()
  finally:
    launch.FLAGS.unparse_flags()
  monkeypatch.setattr(autotune, "choose", lambda *a, **k: pytest.fail("measured again"))
  monkeypatch.setenv("DPO_JAX_CACHE", str(tmp_path / "empty"))
  loop.run(again)
  assert (json.loads((tmp_path / "again" / "autotune.json").read_text()) ==
          json.loads((out / "autotune.json").read_text()))
  assert checkpoint.read_meta(str(tmp_path / "again" / "checkpoints" / "sft_model"))[
      "fingerprint"] == saved

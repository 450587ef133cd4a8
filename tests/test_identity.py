"""Resume means the same run: a rerun that changes what the run computes is refused, naming each
changed value; extending --steps is allowed and logged; --resume=never|must."""

import functools
import json
import logging
import os
import shutil

import jax
import pytest

import configs
from dpo import checkpoint, identity, loop, registry
from models import sharding, transformer

TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
            max_prompt_length=16, max_target_length=16, task_train_pairs=32,
            task_sft_examples=32, task_eval_pairs=0, task_eval_prompts=0, global_batch_size=8,
            log_every=1, stage="dpo", steps=2, sft_steps=2, checkpoint_every=1,
            keep_checkpoints=2)


# A persistent compilation cache for the tiny programs these tests rerun (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("compile_cache")


def tiny_cfg(out, **kw):
  return configs.DEFAULT.replace(**{**TINY, "output_dir": str(out), **kw})


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished --stage=dpo run (checkpoints at steps 1 and 2)."""
  out = tmp_path_factory.mktemp("finished")
  loop.run(tiny_cfg(out))
  return out


def _copy(src, dst):
  shutil.copytree(src, dst)
  return dst


# The silent resume changes (and more): each is refused with both values named.
CHANGES = {"beta": 0.2, "learning_rate": 1e-3, "seed": 1, "global_batch_size": 16,
           "loss_type": ("ipo",), "lora_rank": 4, "lora_alpha": 8.0, "max_grad_norm": 0.5,
           "rpo_alpha": 1.0, "ref_update": "hard", "max_target_length": 12,
           "task_train_pairs": 48}


@pytest.mark.parametrize("name", CHANGES)
@pytest.mark.slow
def test_changed_hyperparameter_refuses_to_resume(tmp_path, finished, name):
  out = _copy(finished, tmp_path / "run")
  before = checkpoint.read_meta(str(out / "checkpoints" / "dpo" / "step_00000002"))
  new = CHANGES[name]
  with pytest.raises(checkpoint.CheckpointError) as e:
    loop.run(tiny_cfg(out, **{name: new}))
  message = str(e.value)
  old = before["fingerprint"][name]
  plain = list(new) if isinstance(new, tuple) else new
  assert f"{name}: {old!r} -> {plain!r}" in message, message
  assert "was written by a different run" in message and "\n" not in message  # dpo_base or step 2


@pytest.mark.slow
def test_changed_data_file_or_initial_model_refuses_changed_source_is_logged(tmp_path, monkeypatch,
                                                                            caplog):
  data = tmp_path / "pairs.jsonl"
  rows = [{"prompt": f"q{i} ", "chosen": "good answer", "rejected": "bad"} for i in range(16)]
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  cfg = tiny_cfg(tmp_path / "init")
  mesh = sharding.make_mesh(cfg.mesh.mesh)
  init = str(tmp_path / "init_model")
  checkpoint.save_params(init, transformer.init(cfg.model, jax.random.key(0), mesh), cfg.model)
  run = lambda: loop.run(tiny_cfg(tmp_path / "run", train_data=str(data), init_from=init,
                                  steps=1))
  run()
  # A fork that edits, adds and removes source files: rerunning the finished run into the same
  # directory is refused in one line naming the files (the new code never trained it), before
  # any work; --resume_changed_code resumes it, logged and recorded in the summary.
  source = dict(identity.source_digests())
  assert "dpo/losses.py" in source and "models/transformer.py" in source
  forked = {**source, "dpo/losses.py": "0123456789abcdef", "dpo/new_algorithm.py": "0" * 16}
  del forked["models/transformer.py"]
  change = "changed dpo/losses.py; added dpo/new_algorithm.py; removed models/transformer.py"
  records = (tmp_path / "run" / "metrics.jsonl").read_text()
  with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
    m.setattr(identity, "source_digests", lambda: forked)
    with pytest.raises(checkpoint.CheckpointError) as e:
      run()
    assert str(e.value).endswith(
        f"was written by other library source ({change}); refusing to resume it onto this "
        f"code: use a fresh --output_dir, or --resume_changed_code to continue the run anyway")
    assert "\n" not in str(e.value)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == records  # nothing ran
    summary = loop.run(tiny_cfg(tmp_path / "run", train_data=str(data), init_from=init, steps=1,
                                resume_changed_code=True))
  assert summary["resumed_onto_changed_code"] == change
  assert (f"was written by other library source ({change}); --resume_changed_code: resuming it"
          in caplog.text)
  rows[3]["chosen"] = "a different answer"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(checkpoint.CheckpointError, match="train_data sha256: '[0-9a-f]{64}' -> "):
    run()
  rows[3]["chosen"] = "good answer"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  run()  # the original content resumes (the finished run does nothing more)
  checkpoint.save_params(init, transformer.init(cfg.model, jax.random.key(1), mesh), cfg.model)
  with pytest.raises(checkpoint.CheckpointError, match="initial model: '[0-9a-f]{64}' -> "):
    run()


@pytest.mark.slow
def test_a_rerun_of_a_finished_run_shows_its_summary_and_runs_nothing(tmp_path, finished, caplog,
                                                                       capsys):
  out = _copy(finished, tmp_path / "run")  # another directory: the same run
  before = json.loads((out / "summary.json").read_text())
  records = (out / "metrics.jsonl").read_text()
  with caplog.at_level(logging.WARNING):
    summary = loop.run(tiny_cfg(out, resume="must"))
  assert summary == before
  assert (out / "metrics.jsonl").read_text() == records  # no step, no evaluation
  assert (f"{out} holds this run finished (summary.json: the same flags, data, models and "
          f"library source)") in caplog.text
  assert "=== evaluation" in capsys.readouterr().out  # its figures and verdicts shown again
  # The same run with other library source is refused (the checkpoints name the files); with
  # another setting it is another run, which resumes the checkpoints and evaluates again.
  source = {**identity.source_digests(), "dpo/losses.py": "0123456789abcdef"}
  with pytest.MonkeyPatch.context() as m:
    m.setattr(identity, "source_digests", lambda: source)
    with pytest.raises(checkpoint.CheckpointError, match=r"changed dpo/losses.py\)"):
      loop.run(tiny_cfg(out))
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    summary = loop.run(tiny_cfg(out, eval_show=1))
  assert summary["run_sha256"] != before["run_sha256"]
  assert "holds this run finished" not in caplog.text


@pytest.mark.slow
def test_steps_below_the_checkpoint_refused_extending_logged(tmp_path, finished, caplog):
  out = _copy(finished, tmp_path / "run")
  with pytest.raises(checkpoint.CheckpointError, match=r"--steps=1 is below the checkpoint "
                                                       r".*step_00000002 \(step 2\)"):
    loop.run(tiny_cfg(out, steps=1))
  with caplog.at_level(logging.WARNING):
    loop.run(tiny_cfg(out, steps=3))
  assert "--steps extended from 2 to 3" in caplog.text
  rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
  assert [r["step"] for r in rows if r["stage"] == "dpo"] == [1, 2, 3]


@pytest.mark.slow
def test_sft_steps_below_the_sft_model_refused(tmp_path):
  out = tmp_path / "run"
  loop.run(tiny_cfg(out, stage="sft"))
  with pytest.raises(checkpoint.CheckpointError, match="--sft_steps=1 is below .*sft_model"):
    loop.run(tiny_cfg(out, stage="sft", sft_steps=1))
  with pytest.raises(checkpoint.CheckpointError, match="sft_learning_rate: 0.003 -> 0.001"):
    loop.run(tiny_cfg(out, stage="sft", sft_learning_rate=1e-3))


@pytest.mark.slow
def test_sft_steps_extended_under_a_started_dpo_stage_refused(tmp_path, caplog):
  """Extending SFT before DPO has started is allowed and logged; once DPO checkpoints exist it
  would replace their initial model, so it is refused before any work, naming both lengths."""
  out = tmp_path / "run"
  loop.run(tiny_cfg(out, stage="sft"))
  with caplog.at_level(logging.WARNING):
    loop.run(tiny_cfg(out, stage="sft,dpo", sft_steps=3, steps=1))
  assert "--sft_steps=3 extends it" in caplog.text
  sft_model = out / "checkpoints" / "sft_model"
  before = checkpoint.read_meta(str(sft_model))
  with pytest.raises(checkpoint.CheckpointError) as e:
    loop.run(tiny_cfg(out, stage="sft,dpo", sft_steps=5, steps=1))
  assert str(e.value) == (f"--sft_steps=5 would extend {sft_model} (step 3), but "
                          f"dpo/step_00000001 was trained from it; give --sft_steps=3 to "
                          f"resume, or a fresh --output_dir")
  assert checkpoint.read_meta(str(sft_model)) == before  # nothing trained, nothing replaced
  with pytest.raises(checkpoint.CheckpointError, match="dpo/step_00000001 was trained from it"):
    loop.run(tiny_cfg(out, stage="sft", sft_steps=5))  # a recipe without the dpo stage too
  assert not os.path.exists(out / "checkpoints" / "sft" / "step_00000005")
  loop.run(tiny_cfg(out, stage="sft,dpo", sft_steps=3, steps=1))  # the original still resumes


def test_resume_policy(tmp_path, finished):
  with pytest.raises(checkpoint.CheckpointError, match="--resume=must but there is no checkpoint"):
    loop.run(tiny_cfg(tmp_path / "fresh", resume="must"))
  assert not os.path.exists(tmp_path / "fresh")  # refused before any work
  out = _copy(finished, tmp_path / "run")
  with pytest.raises(checkpoint.CheckpointError, match="--resume=never but .* holds checkpoints"):
    loop.run(tiny_cfg(out, resume="never"))
  loop.run(tiny_cfg(out, resume="must"))
  with pytest.raises(ValueError, match="--resume='sometimes': must be auto, never or must"):
    tiny_cfg(out, resume="sometimes")


def test_fingerprint_leaves_out_what_does_not_change_the_run():
  cfg = tiny_cfg("/tmp/x")
  of = lambda cfg, a: identity.fingerprint(cfg, a.hyperparameters(cfg), a.data_files, {}, "random")
  dpo, sft = registry.ALGORITHMS["dpo"], registry.ALGORITHMS["sft"]
  fp = of(cfg, dpo)
  other = cfg.replace(output_dir="/tmp/y", log_every=7, checkpoint_every=5, eval_every=3,
                      mesh="data:1", log_kl=False, steps=50, keep_checkpoints=9)
  assert of(other, dpo) == fp
  assert "sft_learning_rate" not in fp and "sft_learning_rate" in of(cfg, sft)
  assert of(cfg.replace(sft_learning_rate=1e-4), dpo) == fp


def test_source_digests_cover_every_library_module_subpackages_included(tmp_path, monkeypatch):
  """The run fingerprint's source covers every module of dpo/ and models/, dpo/algorithms/
  included, and not the tools: an edit of an algorithm's module changes that file's digest
  (the resume then names it: test_changed_data_file_or_initial_model_refuses_changed_source_is_logged)."""
  for part in ("configs.py", "dpo", "models"):
    src = os.path.join(identity.ROOT, part)
    (shutil.copy if os.path.isfile(src) else functools.partial(
        shutil.copytree, ignore=shutil.ignore_patterns("__pycache__")))(src, tmp_path / part)
  monkeypatch.setattr(identity, "ROOT", str(tmp_path))
  digests = identity.source_digests.__wrapped__  # uncached (a run reads its source once)
  before = digests()
  want = {"configs.py"} | {
      os.path.relpath(os.path.join(d, f), tmp_path) for package in ("dpo", "models")
      for d, _, files in os.walk(tmp_path / package) for f in files if f.endswith(".py")}
  want = {f for f in want if not f.startswith("dpo/tools/")}
  assert set(before) == want and "dpo/algorithms/grpo.py" in before
  module = tmp_path / "dpo" / "algorithms" / "dpo.py"
  module.write_text(module.read_text() + "\n# a fork's edit\n")
  after = digests()
  assert {f for f in after if after[f] != before[f]} == {"dpo/algorithms/dpo.py"}

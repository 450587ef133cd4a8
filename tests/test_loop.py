"""End to end: a short default-task run lifts held-out reward accuracy clearly above chance."""

import json
import os

import jax
import pytest

import configs
from dpo import batches, hooks, identity, loop, registry, train
from dpo.program import Start
from models import sharding


@pytest.mark.slow
def test_short_run_learns_preferences(tmp_path):
  out = tmp_path / "run"
  # 60 DPO steps: a higher peak lr than the preset's (tuned for 200 steps); few, short samples.
  cfg = configs.DEFAULT.replace(sft_steps=150, steps=60, log_every=30, output_dir=str(out),
                                task_train_pairs=1024, task_sft_examples=1024,
                                task_eval_pairs=128, learning_rate=1e-3, eval_every=30,
                                task_eval_prompts=16, eval_max_new_tokens=24)
  summary = loop.run(cfg, mesh=sharding.make_mesh("data:2", jax.devices()[:2]))
  assert summary["reward_accuracy"] > 0.75, summary
  assert summary["reward_margin"] > 0
  assert sorted(os.listdir(out)) == ["checkpoints", "config.json", "curves.png", "flags.txt",
                                     "metrics.jsonl", "samples.jsonl", "summary.json", "tb"]
  samples = [json.loads(l) for l in open(out / "samples.jsonl")]
  assert len(samples) == 16 and {"prompt", "policy", "reference", "policy_reward",
                                 "reference_reward", "policy_well_formed",
                                 "reference_well_formed"} <= set(samples[0])
  assert summary["policy_wellformed_rate"] == sum(s["policy_well_formed"] for s in samples) / 16
  assert [v["target"] for v in summary["verdicts"]][0] == "win rate"
  assert set(summary["versions"]) >= {"jax", "jaxlib", "optax", "numpy"}
  assert summary["device_count"] == jax.device_count() and summary["mesh"]["data"] == 2
  assert len(summary["config_sha256"]) == 64
  records = [json.loads(l) for l in open(out / "metrics.jsonl")]
  dpo = [r for r in records if r["stage"] == "dpo"]
  assert [r["step"] for r in dpo] == [30, 60]
  evals = [r for r in records if r["stage"] == "eval"]
  assert [r["step"] for r in evals] == [30, 60]
  for key in ("win_rate", "kl_per_sequence", "kl_per_token", "reward_accuracy", "perplexity",
              "policy_reward", "reference_reward", "policy_distinct_2"):
    assert f"eval/{key}" in evals[-1] and summary[key] is not None, key
  for key in ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen",
              "rewards/rejected", "logps/chosen", "logps/rejected", "grad_norm", "learning_rate"):
    assert key in dpo[0]
  assert json.load(open(out / "summary.json")) == summary


@pytest.mark.slow
def test_dpo_from_hf_checkpoint_with_nf4_base_exports_for_transformers(tmp_path):
  """--init_from=hf:DIR, --base_quant=nf4, --export_hf: transformers loads the trained policy."""
  import numpy as np
  import pytest
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  src = tmp_path / "src"
  torch.manual_seed(0)
  transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
      vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).save_pretrained(src)
  cfg = configs.DEFAULT.replace(
      init_from=f"hf:{src}", stage="dpo", steps=4, log_every=2, base_quant="nf4",
      global_batch_size=4, task_train_pairs=16, task_sft_examples=8, task_eval_pairs=8,
      max_prompt_length=16, max_target_length=16, output_dir=str(tmp_path / "run"),
      export_hf=str(tmp_path / "out"), lora_targets=("q", "v", "down"))
  summary = loop.run(cfg, mesh=sharding.make_mesh("data:2", jax.devices()[:2]))
  assert summary["base_bytes"]["nf4"] < summary["base_bytes"]["float32"]
  assert json.load(open(tmp_path / "run" / "config.json"))["model"]["arch"] == "qwen2"
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  orig = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
  ids = torch.tensor([[257, 72, 105, 33]])
  with torch.no_grad():
    theirs = back(ids).logits.numpy()
    changed = np.abs(theirs - orig(ids).logits.numpy()).max()
  assert np.isfinite(changed) and changed > 0  # quantization + trained LoRA are in the export
  # transformers' logits of the export are our policy's: the NF4 base (dequantized) plus the
  # trained LoRA of the final checkpoint, through our forward pass.
  from dpo import checkpoint
  from models import hf, lora as lora_lib, quant, transformer
  mesh = sharding.make_mesh("data:2", jax.devices()[:2])
  model_cfg, base = hf.load(str(src), mesh, cfg.model)
  base = quant.quantize_params(transformer.param_specs(model_cfg), "nf4", base, mesh)
  like = lora_lib.init(model_cfg, cfg.lora, jax.random.key(0), mesh)
  lora, _ = checkpoint.load(str(tmp_path / "run" / "checkpoints" / "dpo" / "step_00000004"),
                            checkpoint.like_of(like), prefix=".params")
  tokens = np.asarray(ids.numpy(), np.int32)
  ours = transformer.forward(model_cfg, base, transformer.Inputs(tokens, np.arange(4,
      dtype=np.int32)[None], np.ones_like(tokens)), transformer.Adapter(lora, cfg.lora.scale))
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-4)
  base_only = transformer.forward(model_cfg, base, transformer.Inputs(tokens, np.arange(4,
      dtype=np.int32)[None], np.ones_like(tokens)))
  assert np.abs(np.asarray(base_only) - theirs).max() > 1e-3  # the comparison sees the LoRA
  assert os.path.exists(tmp_path / "out" / "adapter" / "adapter_model.safetensors")


# --- the algorithm seam ---------------------------------------------------------------------------

TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
            max_prompt_length=16, max_target_length=16, task_train_pairs=64,
            task_sft_examples=64, task_eval_pairs=0, task_eval_prompts=0, global_batch_size=8,
            log_every=1, sft_steps=3, steps=2, checkpoint_every=2)


def _embed_only_step(spec, state, frozen, batch):
  """The SFT step with every gradient but the embedding's zeroed: a new algorithm's pure step,
  written beside the test that registers it."""
  new, metrics = train.sft_step(spec, state, frozen, batch)
  keep = lambda new, old: {**jax.tree.map(lambda o: o, old), "embed": new["embed"]}
  return new._replace(params=keep(new.params, state.params)), metrics


def _run_embed_only(p, model):
  c = p.cfg
  spec = train.StepConfig.sft(c)
  fresh = lambda: train.init_state(jax.tree.map(lambda x: x.copy(), model.params),
                                   spec.optimizer()[0], c.run.seed, p.mesh)
  start = Start(fresh, None, identity.model_digest(model.path), {"from": model.path})
  stage = p.stage(EMBED_ONLY, start, p.data.sft, [hooks.LogMetrics(c.run.log_every),
                                                  hooks.SaveCheckpoints(2)])
  params = stage.run().params
  p.summary["embed_only_start"] = model.path
  p.summary["embed_only_changed"] = sorted(
      k for k in params if not all(jax.tree.leaves(jax.tree.map(
          lambda a, b: bool((a == b).all()), params[k], model.params[k]))))
  return registry.Model(params, "")


EMBED_ONLY = registry.Algorithm(
    name="embed_only", step=_embed_only_step, batch=batches.Rows.of,
    step_config=train.StepConfig.sft,
    run=_run_embed_only, hyperparameters=lambda cfg: {"lr": cfg.optim.sft_learning_rate},
    data_files=(), steps_flag="--sft_steps")


@pytest.mark.slow
def test_an_algorithm_registered_from_a_test_runs_as_a_stage(tmp_path, monkeypatch):
  """A module that registers an Algorithm is all a new stage needs: the recipe runs it after
  SFT on Program.stage (its own checkpoints and metrics records) and hands it the SFT model."""
  monkeypatch.setitem(registry.ALGORITHMS, EMBED_ONLY.name, EMBED_ONLY)
  out = tmp_path / "run"
  cfg = configs.DEFAULT.replace(**TINY, output_dir=str(out), stage="sft,embed_only")
  summary = loop.run(cfg, mesh=sharding.make_mesh("data:1", jax.devices()[:1]))
  assert summary["embed_only_start"] == str(out / "checkpoints" / "sft_model")
  assert summary["embed_only_changed"] == ["embed"]
  records = [(r["stage"], r["step"]) for r in map(json.loads, open(out / "metrics.jsonl"))]
  assert records == [("sft", 1), ("sft", 2), ("sft", 3), ("embed_only", 1), ("embed_only", 2),
                     ("embed_only", 3)]
  assert "step_00000002" in os.listdir(out / "checkpoints" / "embed_only")
  assert "dpo" not in os.listdir(out / "checkpoints")


def test_an_unknown_stage_is_refused_before_any_work(tmp_path):
  cfg = configs.DEFAULT.replace(**TINY, output_dir=str(tmp_path / "run"), stage="sft,reinforce")
  with pytest.raises(ValueError, match=r"--stage=sft,reinforce: no algorithm named reinforce "
                                       r"\(registered: sft, dpo"):
    loop.run(cfg)
  assert not (tmp_path / "run").exists()


def test_config_hash_is_the_runs_not_its_folders():
  """summary.json's config_sha256: the same run in another output (or cache) directory has
  the same hash; any setting that changes what is computed changes it."""
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  cfg = configs.DEFAULT.replace(**TINY, output_dir="/tmp/a")
  sha = lambda c: loop.provenance(c, mesh)["config_sha256"]
  assert sha(cfg.replace(output_dir="/tmp/b", data_cache_dir="/tmp/c", ref_cache_dir="/tmp/d")) \
      == sha(cfg)
  assert sha(cfg.replace(beta=0.2)) != sha(cfg) and sha(cfg.replace(seed=1)) != sha(cfg)


# --- the log line -----------------------------------------------------------------------------

def _dpo_lines(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.getMessage().startswith("dpo ")]


@pytest.mark.slow
def test_a_run_without_the_exact_kl_logs_no_nan_column(tmp_path, caplog):
  """Without --log_kl / --kl_max the step computes no KL: the DPO log line has no kl column
  (it printed `kl nan` on every line) and no figure reads nan."""
  caplog.set_level("INFO")
  cfg = configs.DEFAULT.replace(**TINY, output_dir=str(tmp_path / "run"), log_kl=False,
                                kl_max=0.0, eval_every=0)
  loop.run(cfg, mesh=sharding.make_mesh("data:1", jax.devices()[:1]))
  lines = _dpo_lines(caplog)
  assert [l.split()[1] for l in lines] == ["1/2", "2/2"], lines
  records = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  assert not any("kl" in r for r in records if r["stage"] == "dpo")  # not computed
  for line in lines:
    assert "nan" not in line.lower() and " kl " not in line, line


def test_the_dpo_log_line_shows_the_kl_only_when_the_step_computed_it(caplog):
  """The column is the step's exact token KL where it is in the metrics, absent where not."""
  import types
  caplog.set_level("INFO")
  written = []
  run = types.SimpleNamespace(name="dpo", step=0, steps=2, tokens=0,
                              writer=types.SimpleNamespace(write=written.append))
  log = hooks.LogMetrics(1)
  log.start(run)
  step = {"loss": 0.69, "rewards/accuracies": 0.5, "rewards/margins": 0.01, "grad_norm": 1.0,
          "learning_rate": 1e-4, "skipped_steps": 0}
  log.metrics(run, 1, {**step, "kl": 0.0123})
  log.metrics(run, 2, step)
  with_kl, without = _dpo_lines(caplog)
  assert "  kl 0.0123  " in with_kl and "margin +0.0100  kl 0.0123  |g| 1.000" in with_kl
  assert " kl " not in without and "nan" not in without
  assert "margin +0.0100  |g| 1.000" in without
  assert "kl" in written[0] and "kl" not in written[1]

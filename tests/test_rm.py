"""dpo/algorithms/rm.py against transformers and TRL 1.16's RewardTrainer, the oracles users
compare with: a tiny random `LlamaForSequenceClassification` (one label), saved and imported
into ours (models/hf.py, with `score.weight`), gives per-sequence rewards equal to its logits,
and TRL's own `compute_loss` on the same batch gives our loss and metrics. TRL's trainer is
built with `object.__new__` and the attributes `compute_loss` reads, as tests/test_losses_trl.py
does for DPO.
"""

import collections
import dataclasses
import json
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl_rm = pytest.importorskip("trl.trainer.reward_trainer")

from dpo import batches, train  # noqa: E402
from dpo import reward_model as reward_lib  # noqa: E402
from dpo.algorithms import rm  # noqa: E402
from models import hf, sharding  # noqa: E402
from test_checkpoint import deny_each, permission_cases, tiny_cfg  # noqa: E402

B, T, PROMPT, V, PAD = 6, 14, 3, 64, 0
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
  """(transformers model, our ModelConfig, our params, our head [D, 1]) of one random Llama."""
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      tie_word_embeddings=True, num_labels=1, pad_token_id=PAD, rms_norm_eps=1e-6)
  model = transformers.LlamaForSequenceClassification(config).float()
  with torch.no_grad():  # a non-trivial head (transformers inits it small)
    model.score.weight.normal_(0.0, 1.0)
  directory = str(tmp_path_factory.mktemp("llama_rm"))
  model.save_pretrained(directory, safe_serialization=True)
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  cfg, params = hf.load(directory, mesh)
  return model, cfg, params, hf.load_score(directory, cfg, mesh)


def pair_rows(seed=0):
  """Right-padded [B, 2, T] pair rows: a shared PROMPT-token prompt, completions of random
  lengths; token ids avoid PAD so transformers' last non-pad token is ours."""
  rng = np.random.default_rng(seed)
  n = rng.integers(2, T - PROMPT + 1, (B, 2))
  tokens = rng.integers(1, V, (B, 2, T)).astype(np.int32)
  tokens[:, 1, :PROMPT] = tokens[:, 0, :PROMPT]
  pos = np.arange(T)
  live = pos < PROMPT + n[..., None]
  tokens = np.where(live, tokens, PAD).astype(np.int32)
  return batches.Rows(tokens, np.broadcast_to(pos, tokens.shape).astype(np.int32),
                      live.astype(np.int32), (live & (pos >= PROMPT)).astype(np.float32))


def transformers_rewards(model, rows, pad=PAD):
  """[B, 2] logits of LlamaForSequenceClassification on TRL's layout (chosen rows, then
  rejected rows)."""
  ids = torch.from_numpy(np.concatenate([rows.tokens[:, 0], rows.tokens[:, 1]]).astype(np.int64))
  with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=(ids != pad).long()).logits[:, 0].numpy()
  return np.stack([logits[:B], logits[B:]], axis=1)


class _Accelerator:
  gather_for_metrics = gather = staticmethod(lambda t: t)


def trl_loss(model, rows, margin=None, center=None):
  """(loss, metrics) of TRL RewardTrainer.compute_loss on the pairs `rows`."""
  t = object.__new__(trl_rm.RewardTrainer)
  t.__dict__.update(model=model, accelerator=_Accelerator(),
                    args=types.SimpleNamespace(center_rewards_coefficient=center),
                    _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0,
                    _tp_size=1)
  model.train()  # compute_loss's mode; the tiny Llama has no dropout
  ids = torch.from_numpy(np.concatenate([rows.tokens[:, 0], rows.tokens[:, 1]]).astype(np.int64))
  inputs = {"input_ids": ids, "attention_mask": (ids != PAD).long()}
  if margin is not None:
    inputs["margin"] = torch.from_numpy(margin)
  with torch.no_grad():
    loss = float(t.compute_loss(model, inputs))
  model.eval()
  metrics = {k: v[-1] for k, v in t._metrics["train"].items() if k != "num_tokens"}
  return loss, metrics


def test_rewards_equal_transformers_logits(reward_model):
  model, cfg, params, score = reward_model
  rows = pair_rows()
  ours = np.asarray(reward_lib.rewards(cfg, params, score, batches.PairBatch(rows)))
  theirs = transformers_rewards(model, rows)
  np.testing.assert_allclose(ours, theirs, **TOL)
  print(f"max |reward ours - transformers| = {np.abs(ours - theirs).max():.2e}")


@pytest.mark.parametrize("margin,center", [(False, None), (True, None), (False, 0.01),
                                           (True, 0.1)])
def test_loss_and_metrics_equal_trl_reward_trainer(reward_model, margin, center):
  model, cfg, params, score = reward_model
  rows = pair_rows(1)
  m = np.random.default_rng(2).uniform(-1, 1, B).astype(np.float32) if margin else None
  batch = batches.PairBatch(rows, margin=m)
  r = reward_lib.rewards(cfg, params, score, batch)
  loss, metrics = rm.bradley_terry(r, None if m is None else jnp.asarray(m), center or 0.0)
  want_loss, want = trl_loss(model, rows, m, center)
  assert set(metrics) == set(want)  # TRL's names: accuracy, margin, min/mean/max_reward
  np.testing.assert_allclose(float(loss), want_loss, **TOL)
  for k in want:
    np.testing.assert_allclose(float(metrics[k]), want[k], **TOL, err_msg=k)


def test_import_of_a_transformers_reward_model_gives_its_scores(tmp_path):
  """A transformers-saved LlamaForSequenceClassification with its own (untied) embeddings and no
  LM head imports with hf.load(reward=True) and scores as transformers does; a causal LM's
  folder has no `score.weight`, which is a one-line error naming the folder."""
  torch.manual_seed(1)
  config = transformers.LlamaConfig(
      vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, num_labels=1,
      pad_token_id=PAD)
  model = transformers.LlamaForSequenceClassification(config).float().eval()
  with torch.no_grad():
    model.score.weight.normal_(0.0, 1.0)
  model.save_pretrained(str(tmp_path / "rm"), safe_serialization=True)
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  cfg, params = hf.load(str(tmp_path / "rm"), mesh, reward=True)
  assert "lm_head" not in params and params["score"].shape == (32, 1)
  rows = pair_rows(7)
  ours = np.asarray(reward_lib.rewards(cfg, params, params["score"], batches.PairBatch(rows)))
  np.testing.assert_allclose(ours, transformers_rewards(model, rows), **TOL)
  transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "lm"))
  with pytest.raises(hf.HFError, match=r"lm: tensor 'score.weight' is missing"):
    hf.load(str(tmp_path / "lm"), mesh, reward=True)


def test_held_out_metrics_are_trl_metrics_over_every_pair(reward_model):
  """The held-out evaluation (batches of 4 over 6 pairs, the last one wrapped) is TRL's loss
  and metrics over all the pairs at once."""
  model, cfg, params, score = reward_model
  rows = pair_rows(9)
  c = types.SimpleNamespace(model=cfg, optim=types.SimpleNamespace(global_batch_size=4),
                            reward=types.SimpleNamespace(center_rewards_coefficient=0.05))
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  got = rm.held_out_metrics(c, mesh, {**params, "score": score}, dict(rows._asdict()))
  want_loss, want = trl_loss(model, rows, None, 0.05)
  assert got["pairs"] == B
  np.testing.assert_allclose(got["loss"], want_loss, **TOL)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], **TOL, err_msg=k)


def test_shared_prefix_rows_give_the_same_rewards(reward_model):
  """Prefix sharing (prompt | chosen | rejected in one row) reads each side's last token."""
  from dpo import packing
  _, cfg, params, score = reward_model
  rows = pair_rows(3)
  arrays = dict(rows._asdict())
  shared, note = packing.shared_prefix(arrays)
  assert shared is not None, note
  plain = reward_lib.rewards(cfg, params, score, batches.PairBatch(rows))
  both = reward_lib.rewards(cfg, params, score, batches.PairBatch.of({**arrays, **shared}))
  np.testing.assert_allclose(np.asarray(both), np.asarray(plain), **TOL)


@pytest.mark.slow
def test_exported_reward_model_loads_in_transformers_with_our_rewards(reward_model, tmp_path):
  """Our own random reward model, exported as a *ForSequenceClassification folder, loads with
  AutoModelForSequenceClassification and scores every pair as we do."""
  from models import transformer
  _, cfg, _, _ = reward_model
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  params = transformer.init(dataclasses.replace(cfg, init_std=0.3), jax.random.key(7), mesh)
  params["score"] = jax.random.normal(jax.random.key(8), (cfg.d_model, 1))
  hf.save_reward_model(str(tmp_path / "rm"), cfg, params, PAD)
  loaded = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"))
  assert type(loaded).__name__ == "LlamaForSequenceClassification"
  assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == PAD
  rows = pair_rows(5)
  ours = np.asarray(reward_lib.rewards(cfg, params, params["score"], batches.PairBatch(rows)))
  theirs = transformers_rewards(loaded.float().eval(), rows)
  np.testing.assert_allclose(ours, theirs, **TOL)
  print(f"max |reward ours - exported in transformers| = {np.abs(ours - theirs).max():.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_step_trains_the_head_and_the_body(reward_model, lora_rank):
  """One jitted reward step: full fine-tuning or LoRA, the head moves either way and the loss
  equals `bradley_terry` of the start's rewards."""
  import configs
  _, mcfg, params, score = reward_model
  cfg = configs.DEFAULT.replace(stage="rm", lora_rank=lora_rank, lora_dropout=0.0, rm_steps=10,
                                rm_learning_rate=1e-2, global_batch_size=B, warmup_ratio=0.0)
  cfg = cfg.replace(**{f.name: getattr(mcfg, f.name) for f in dataclasses.fields(mcfg)})
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  spec = rm.step_config(cfg)
  opt, _ = spec.optimizer()
  trainable = rm.initial_trainable(cfg.model, cfg.lora, params, jax.random.key(0), mesh)
  trainable["score"] = score.copy()  # the state is donated to the step
  state = train.init_state(trainable, opt, 0, mesh)
  frozen = train.Frozen(params) if cfg.lora.enabled else None
  batch = batches.PairBatch(pair_rows(4))
  want, _ = rm.bradley_terry(reward_lib.rewards(cfg.model, params, score, batch), None, 0.0)
  step = train.jit_step(rm.rm_step, spec, mesh, state, frozen)
  new, metrics = step(state, frozen, train.device_batch(mesh, batch))
  np.testing.assert_allclose(float(metrics["loss"]), float(want), **TOL)
  assert np.abs(np.asarray(new.params["score"]) - np.asarray(score)).max() > 0
  assert {"accuracy", "margin", "mean_reward", "min_reward", "max_reward"} <= set(metrics)


@pytest.mark.slow
def test_sft_rm_run_trains_and_writes_the_reward_model(tmp_path):
  """--stage=sft,rm on the embedded task: accuracy on the training pairs rises above chance,
  checkpoints/rm/step_<N> and checkpoints/rm_model are written, the summary names them."""
  import configs
  from dpo import checkpoint, loop
  out = str(tmp_path / "run")
  cfg = configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
      task_train_pairs=64, task_sft_examples=32, task_eval_pairs=8, task_eval_prompts=4,
      global_batch_size=16, sft_steps=2, rm_steps=40, rm_learning_rate=3e-3, log_every=5,
      checkpoint_every=20, stage="sft,rm", output_dir=out, export_rm_hf=str(tmp_path / "hf"),
      rm_lora_targets=("q", "k", "v", "o", "down"))  # its own LoRA, not --lora_targets' q, v
  loop.run(cfg)
  with open(os.path.join(out, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if '"stage": "rm"' in line]
  *records, held = records  # the held-out figures, once at the end, under TRL's eval_ names
  assert [r["step"] for r in records][-1] == 40 and held["step"] == 40
  assert np.mean([r["accuracy"] for r in records[-3:]]) > 0.6, records
  assert os.path.isdir(os.path.join(out, "checkpoints", "rm", "step_00000040"))
  saved = checkpoint.read_meta(os.path.join(out, "checkpoints", "rm_model"))
  assert saved["stage"] == "rm" and saved["step"] == 40
  with open(os.path.join(out, "summary.json")) as f:
    summary = json.load(f)
  assert summary["rm_model"].endswith("rm_model")
  assert summary["rm_eval_pairs"] == 8 and 0 <= summary["rm_eval_accuracy"] <= 1
  assert held["eval_accuracy"] == summary["rm_eval_accuracy"] and held["eval_pairs"] == 8
  # The trained reward model, exported: transformers scores pairs as we do (byte PAD = 256).
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  params = reward_lib.load(summary["rm_model"], cfg.model, mesh)
  loaded = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf"))
  rows = pair_rows(6)
  rows = rows._replace(tokens=np.where(rows.segment_ids != 0, rows.tokens, 256).astype(np.int32))
  ours = np.asarray(reward_lib.rewards(cfg.model, params, params["score"], batches.PairBatch(rows)))
  theirs = transformers_rewards(loaded.float().eval(), rows, pad=256)
  np.testing.assert_allclose(ours, theirs, **TOL)
  # With LoRA, the PEFT adapter over the exported base scores the same.
  peft = pytest.importorskip("peft")
  with open(tmp_path / "hf" / "adapter" / "adapter_config.json") as f:
    assert sorted(json.load(f)["target_modules"]) == [
        "down_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
  base = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf/base"))
  adapted = peft.PeftModel.from_pretrained(base.float(), str(tmp_path / "hf/adapter")).eval()
  np.testing.assert_allclose(transformers_rewards(adapted, rows, pad=256), ours, **TOL)


def _write_jsonl(path, records):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


def test_margin_column_is_read_from_the_data_file(tmp_path):
  """TRL's `margin` column reaches the rm step's batch, aligned with its pair; a record
  without one in a file that has them, or a non-number, is a one-line error naming it."""
  import configs
  from dpo import prepare, tokenizer
  from dpo.data import DataError
  records = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}", "margin": i / 4}
             for i in range(12)]
  _write_jsonl(tmp_path / "m.jsonl", records)
  tok = tokenizer.load_tokenizer(configs.DEFAULT.data.tokenizer)
  how = prepare.Preparation(tok, max_prompt_length=16, max_target_length=16)
  got = prepare.prepare_pairs(str(tmp_path / "m.jsonl"), how, cache_dir=str(tmp_path / "c"))
  again = prepare.prepare_pairs(str(tmp_path / "m.jsonl"), how, cache_dir=str(tmp_path / "c"))
  chosen = [tok.decode(t[m > 0].tolist()) for t, m in zip(got.train["tokens"][:, 0],
                                                          got.train["loss_mask"][:, 0])]
  want = [int(re.search(r"good (\d+)", c).group(1)) / 4 for c in chosen]
  assert batches.PairBatch.of(got.train).margin.shape == (12,)
  np.testing.assert_allclose(got.train["margin"], want)
  np.testing.assert_array_equal(again.train["margin"], got.train["margin"])  # from the cache
  records[3].pop("margin")
  _write_jsonl(tmp_path / "bad.jsonl", records)
  with pytest.raises(DataError, match=r"bad.jsonl:4: field 'margin' is missing"):
    prepare.prepare_pairs(str(tmp_path / "bad.jsonl"), how)
  records[3]["margin"] = "big"
  _write_jsonl(tmp_path / "bad.jsonl", records)
  with pytest.raises(DataError, match=r"bad.jsonl:4: field 'margin' is 'big'"):
    prepare.prepare_pairs(str(tmp_path / "bad.jsonl"), how)


@pytest.mark.slow
def test_rm_run_on_a_file_with_margins(tmp_path):
  """--stage=rm --train_data with a margin column: the step reads each pair's margin (the loss
  of a batch whose margins are all 5 is far above log 2 at the start)."""
  import configs
  from dpo import loop
  records = [{"prompt": f"question {i}?", "chosen": f"yes {i}", "rejected": f"no {i}",
              "margin": 5.0} for i in range(32)]
  _write_jsonl(tmp_path / "m.jsonl", records)
  out = str(tmp_path / "run")
  cfg = configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
      train_data=str(tmp_path / "m.jsonl"), eval_split=0.0, global_batch_size=8, rm_steps=2,
      log_every=1, stage="rm", output_dir=out)
  loop.run(cfg)
  with open(os.path.join(out, "metrics.jsonl")) as f:
    first = [json.loads(line) for line in f if '"stage": "rm"' in line][0]
  assert first["loss"] > 4.0, first  # -log sigmoid(r_c - r_r - 5) with r near 0


@pytest.mark.slow
def test_rm_stage_starts_from_an_imported_reward_model(tmp_path):
  """--stage=rm --init_from=hf:DIR of a transformers reward model: the stage starts from its
  head (a step at a negligible learning rate keeps it); any other recipe from it is refused."""
  import configs
  from dpo import loop
  torch.manual_seed(2)
  config = transformers.LlamaConfig(
      vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
      num_labels=1, pad_token_id=256)
  model = transformers.LlamaForSequenceClassification(config).float()
  model.save_pretrained(str(tmp_path / "rm_in"), safe_serialization=True)
  out = str(tmp_path / "run")
  cfg = configs.DEFAULT.replace(
      init_from=f"hf:{tmp_path / 'rm_in'}", task_train_pairs=16, task_sft_examples=8,
      task_eval_pairs=8, task_eval_prompts=4, global_batch_size=8, rm_steps=1,
      rm_learning_rate=1e-12, warmup_ratio=0.0, stage="rm", output_dir=out,
      export_rm_hf=str(tmp_path / "rm_out"))
  loop.run(cfg)
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  params = reward_lib.load(os.path.join(out, "checkpoints", "rm_model"), loop.initial_params(
      cfg, jax.random.key(0), mesh)[0].model, mesh)
  np.testing.assert_allclose(np.asarray(params["score"])[:, 0],
                             model.score.weight.detach().numpy()[0], atol=1e-6)
  # ... and its export, without an LM head, loads in transformers with the same scores.
  loaded = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm_out"))
  rows = pair_rows(8)
  rows = rows._replace(tokens=np.where(rows.segment_ids != 0, rows.tokens, 256).astype(np.int32))
  np.testing.assert_allclose(transformers_rewards(loaded.float().eval(), rows, pad=256),
                             transformers_rewards(model.eval(), rows, pad=256), **TOL)
  with pytest.raises(ValueError, match=r"--init_from=hf:.*only a reward-model stage starts from it \(--stage=rm\)"):
    loop.run(cfg.replace(stage="sft,rm", output_dir=str(tmp_path / "run2")))


def test_a_fresh_stage_keeps_the_records_of_the_stages_before_it_in_the_recipe(tmp_path):
  """In sft,rm,dpo a DPO stage that starts afresh drops its own and its evaluations' records,
  not the rm stage's; an rm stage that starts afresh drops rm's and DPO's, not SFT's."""
  from dpo.runner import MetricsWriter
  writer = MetricsWriter(str(tmp_path), ("sft", "rm", "dpo"))
  for stage in ("sft", "rm", "dpo", "eval"):
    writer.write({"stage": stage, "step": 1})
  stages = lambda: [json.loads(l)["stage"] for l in open(tmp_path / "metrics.jsonl")]
  writer.rewind_stage("dpo")
  assert stages() == ["sft", "rm"]
  writer.rewind_stage("rm")
  assert stages() == ["sft"] and writer.count == 1


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"])
def test_every_architecture_imports_and_exports_reward_models(arch, tmp_path):
  """Each supported architecture's transformers *ForSequenceClassification (tests/test_hf.py's
  tiny configs, one label, random weights everywhere) imports with its scores, and our export
  of it loads back in AutoModelForSequenceClassification with the same scores."""
  from test_hf import ARCH_CONFIGS
  config = ARCH_CONFIGS[arch]()
  config.num_labels, config.pad_token_id = 1, PAD
  torch.manual_seed(0)
  model = transformers.AutoModelForSequenceClassification.from_config(
      config, attn_implementation="eager").float().eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.15 * torch.randn_like(p))
  model.save_pretrained(str(tmp_path / "in"))
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  cfg, params = hf.load(str(tmp_path / "in"), mesh, reward=True)
  rows = pair_rows(10)
  ours = np.asarray(reward_lib.rewards(cfg, params, params["score"], batches.PairBatch(rows)))
  theirs = transformers_rewards(model, rows)
  np.testing.assert_allclose(ours, theirs, **TOL)
  hf.save_reward_model(str(tmp_path / "out"), cfg, params, PAD, hf.SaveOptions(
      hf.source_config(f"hf:{tmp_path / 'in'}")))
  back = transformers.AutoModelForSequenceClassification.from_pretrained(
      str(tmp_path / "out"), attn_implementation="eager", dtype=torch.float32).eval()
  np.testing.assert_allclose(transformers_rewards(back, rows), theirs, **TOL)
  print(f"{arch}: max |reward ours - transformers| = {np.abs(ours - theirs).max():.2e}")


@pytest.mark.slow
def test_peft_loads_the_reward_adapter_with_our_rewards(reward_model, tmp_path):
  """A LoRA reward model (non-zero factors on every target, a trained head): PEFT loads the
  exported adapter (head as modules_to_save) over the exported base and scores as we do."""
  peft = pytest.importorskip("peft")
  import configs
  from models import lora as lora_lib
  from models import transformer
  _, cfg, params, score = reward_model
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  lcfg = configs.LoraConfig(
      lora_rank=2, lora_alpha=4.0, lora_targets=tuple(lora_lib.TARGETS))
  lora = lora_lib.init(cfg, lcfg, jax.random.key(1), mesh)
  lora = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape), lora)
  head = score + 0.5
  rows = pair_rows(11)
  ours = np.asarray(reward_lib.rewards(cfg, params, head, batches.PairBatch(rows),
                               transformer.Adapter(lora, lcfg.scale)))
  hf.save_reward_model(str(tmp_path / "base"), cfg, {**params, "score": score}, PAD)
  hf.save_peft_reward(str(tmp_path / "adapter"), cfg, lora, lcfg, head, str(tmp_path / "base"))
  base = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "base"))
  model = peft.PeftModel.from_pretrained(base.float(), str(tmp_path / "adapter")).eval()
  theirs = transformers_rewards(model, rows)
  np.testing.assert_allclose(ours, theirs, **TOL)
  print(f"max |reward ours - PEFT| = {np.abs(ours - theirs).max():.2e}")


def test_settings_the_rm_stage_cannot_honour_are_one_line_errors():
  import configs
  for flags, message in (
      (dict(packing=True), r"^--packing=True: the rm stage reads one pair a row"),
      (dict(base_quant="int8"), r"^--base_quant='int8': the rm stage trains on a float base"),
      (dict(rm_steps=0), r"^--rm_steps=0: must be >= 1 with --stage=sft,rm")):
    with pytest.raises(ValueError, match=message):
      configs.DEFAULT.replace(stage="sft,rm", **flags)
  with pytest.raises(ValueError, match=r"^--export_rm_hf='x': must go with an rm stage"):
    configs.DEFAULT.replace(stage="sft,dpo", export_rm_hf="x")
  with pytest.raises(ValueError, match=r"^--rm_lora_targets=q,k: must go with an rm stage"):
    configs.DEFAULT.replace(stage="sft,dpo", rm_lora_targets=("q", "k"))
  with pytest.raises(ValueError, match=r"^--rm_lora_targets=q: the reward model has no LoRA"):
    configs.DEFAULT.replace(stage="sft,rm", lora_rank=0, rm_lora_targets=("q",))
  with pytest.raises(ValueError, match=r"--rm_lora_targets"):
    configs.DEFAULT.replace(stage="sft,rm", rm_lora_targets=("qq",))


@pytest.mark.slow
def test_gradient_accumulation_gives_the_whole_batch_update(reward_model):
  """K = 2 microbatches: the same loss, accuracy, margin, mean reward and update as one batch
  (min and max rewards are the microbatches' mean, as TRL averages them over a window)."""
  import configs
  _, mcfg, params, score = reward_model
  mesh = sharding.make_mesh("data:1", jax.devices()[:1])
  batch = batches.PairBatch(pair_rows(12), margin=np.linspace(-1, 1, B).astype(np.float32))
  out = []
  for k in (1, 2):
    cfg = configs.DEFAULT.replace(stage="rm", lora_rank=4, lora_dropout=0.0, rm_learning_rate=1e-2,
                                  global_batch_size=B, gradient_accumulation_steps=k,
                                  center_rewards_coefficient=0.1, warmup_ratio=0.0)
    cfg = cfg.replace(**{f.name: getattr(mcfg, f.name) for f in dataclasses.fields(mcfg)})
    spec = rm.step_config(cfg)
    trainable = rm.initial_trainable(cfg.model, cfg.lora, params, jax.random.key(0), mesh,
                                     score)
    state = train.init_state(trainable, spec.optimizer()[0], 0, mesh)
    frozen = train.Frozen(params)
    step = train.jit_step(rm.rm_step, spec, mesh, state, frozen)
    new, metrics = step(state, frozen, train.device_batch(mesh, batch))
    out.append((jax.device_get(new.params), jax.device_get(metrics)))
  (p1, m1), (p2, m2) = out
  for name in ("loss", "accuracy", "margin", "mean_reward", "grad_norm"):
    np.testing.assert_allclose(m2[name], m1[name], rtol=1e-5, atol=1e-6, err_msg=name)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p2, p1)


@pytest.mark.slow
def test_a_tokenizer_that_pads_with_its_eos_is_refused_for_a_reward_model():
  """GPT-2's tokenizer pads with <|endoftext|>, its EOS: transformers would read the reward at
  the token before each sequence's EOS, this stage at the EOS, so the run is refused before any
  work, naming --pad_token."""
  import configs
  from dpo import data, loop
  gpt2 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared",
                      "data", "tokenizers", "gpt2", "tokenizer.json")
  if not os.path.exists(gpt2):
    pytest.skip("../shared/data is absent")
  cfg = configs.DEFAULT.replace(stage="sft,rm", tokenizer=gpt2, vocab_size=50304,
                                task_train_pairs=16, task_sft_examples=16, task_eval_pairs=4,
                                global_batch_size=8)
  with pytest.raises(data.DataError, match=r"--stage=sft,rm: this tokenizer pads with its EOS "
                                           r".* give --pad_token="):
    loop.Data(cfg)


def test_the_rm_stage_fingerprints_what_it_reads():
  """A resume of the rm stage is refused for a changed rm_learning_rate or batch, not for the
  DPO stage's --learning_rate, which it does not read."""
  import configs
  hp = rm.RM.hyperparameters(configs.DEFAULT)
  assert {"rm_learning_rate", "global_batch_size", "center_rewards_coefficient",
          "lora_rank"} <= set(hp)
  assert "learning_rate" not in hp and "rm_steps" not in hp
  assert rm.RM.hyperparameters(configs.DEFAULT.replace(learning_rate=1.0)) == hp
  assert rm.RM.hyperparameters(configs.DEFAULT.replace(rm_split=0.5, stage="rm,dpo")) != hp


@pytest.mark.parametrize("real_chmod", permission_cases())
def test_an_unreadable_reward_model_stops_the_rerun_in_one_line(tmp_path, monkeypatch,
                                                                real_chmod):
  """checkpoints/rm_model this process may not read or replace: the rerun, which saves it again,
  stops with one line naming it; nothing is renamed (no rm_model.old) or removed; readable
  again, the rerun finishes."""
  import configs
  from dpo import checkpoint, loop
  out = tmp_path / "run"
  cfg = configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
      task_train_pairs=32, task_sft_examples=16, task_eval_pairs=0, task_eval_prompts=0,
      global_batch_size=8, rm_steps=4, log_every=1, checkpoint_every=2, stage="rm",
      output_dir=str(out))
  loop.run(cfg)
  rm_model = out / "checkpoints" / "rm_model"
  digest, listing = checkpoint.digest(str(rm_model)), sorted(os.listdir(out / "checkpoints"))
  with deny_each(real_chmod)(rm_model, monkeypatch):
    with pytest.raises(checkpoint.CheckpointError) as e:
      loop.run(cfg)
    assert sorted(os.listdir(out / "checkpoints")) == listing
  message = str(e.value)
  assert message.startswith(f"{rm_model}: permission denied") and "\n" not in message
  assert "left in place" in message
  assert checkpoint.digest(str(rm_model)) == digest
  loop.run(cfg)
  assert sorted(os.listdir(out / "checkpoints")) == listing


@pytest.mark.parametrize("real_chmod", permission_cases())
@pytest.mark.slow
def test_an_export_folder_it_may_not_write_stops_the_run_in_one_line(tmp_path, monkeypatch,
                                                                      real_chmod):
  """--export_rm_hf naming a folder this process may not write (an earlier export's adapter/
  behind chmod 000, or the denial simulated where root writes through it): the run stops in one
  line naming the folder before writing any of it; nothing is renamed or removed; writable
  again, the rerun exports."""
  from dpo import checkpoint, loop
  export = tmp_path / "export"
  (export / "adapter").mkdir(parents=True)
  (export / "config.json").write_text("{}")  # an earlier export's
  cfg = tiny_cfg(tmp_path / "run", stage="rm", rm_steps=2, export_rm_hf=str(export))
  with deny_each(real_chmod)(export / "adapter", monkeypatch):
    with pytest.raises(checkpoint.CheckpointError) as e:
      loop.run(cfg)
  message = str(e.value)
  assert message.startswith(f"{export}: permission denied on {export / 'adapter'}")
  assert "\n" not in message and "left in place" in message
  assert sorted(os.listdir(export)) == ["adapter", "config.json"]
  assert (export / "config.json").read_text() == "{}" and not os.listdir(export / "adapter")
  loop.run(cfg)
  assert {"config.json", "model.safetensors"} <= set(os.listdir(export))

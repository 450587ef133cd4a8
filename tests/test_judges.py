"""dpo/judges.py and the judged evaluation: a reward model read from a transformers folder scores
text rendered with its own chat template as transformers scores it (the oracle: the same folder
in `AutoModelForSequenceClassification`, the text from its tokenizer's `apply_chat_template`);
reward functions; the length-controlled win rate against an independent fit (scipy); every bad
judge input a one-line error naming it; a run whose recipe trains its own judge (rm on half
the prompts, SFT and DPO on the other half) ends with a judged win rate and verdict."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import configs
from dpo import evaluate, judges, loop, task
from dpo.data import PreferenceRecord
from dpo.formats import ChatRecord, Message
from models import sharding
from test_checkpoint import deny_each, permission_cases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = os.path.join(ROOT, "..", "shared", "data", "tokenizers", "gpt2", "tokenizer.json")
needs_gpt2 = pytest.mark.skipif(not os.path.exists(GPT2), reason="no ../shared/data")

# ChatML, as Qwen2.5 and SmolLM2 write it (a short form: no default system turn).
CHATML = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def _mesh():
  return sharding.make_mesh("data:1", jax.devices()[:1])


# --- reward functions -----------------------------------------------------------------------------

def bad_value(prompt, completion):
  return "high"


def nan_value(prompt, completion):
  return float("nan")


def length_reward(prompt, completion):
  return len(completion) / (1 + len(prompt if isinstance(prompt, str) else prompt[-1]["content"]))


def test_reward_function_scores_text_and_conversations():
  judge = judges.FunctionJudge("tests.test_judges:length_reward")
  text = PreferenceRecord("Say hi:", " hello", " hello")
  conv = judges.records_of((Message("user", "Hi"),), ["Hello there"])[0]
  np.testing.assert_allclose(judge.score([text, conv]), [6 / 8, 11 / 3])
  assert judges.FunctionJudge("dpo.task:reward").score(
      [PreferenceRecord("p", " great coffee, lovely cake, warm staff.", "")]) == [1.0]


@pytest.mark.parametrize("spec,match", [
    ("nocolon", "give module:function"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("dpo.task:no_such_fn", "has no function 'no_such_fn'"),
])
def test_reward_function_that_cannot_be_imported_is_one_line(spec, match):
  with pytest.raises(judges.JudgeError, match=match) as e:
    judges.FunctionJudge(spec)
  assert str(e.value).startswith(f"--reward_fn={spec}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("fn", ["bad_value", "nan_value"])
def test_reward_function_returning_a_non_number_is_one_line(fn):
  judge = judges.FunctionJudge(f"tests.test_judges:{fn}")
  with pytest.raises(judges.JudgeError, match="record 0 .* a reward function returns a finite "
                     "number") as e:
    judge.score([PreferenceRecord("p", "c", "c")])
  assert str(e.value).startswith(f"--reward_fn=tests.test_judges:{fn}: returned ")


# --- the length-controlled win rate --------------------------------------------------------------

def test_lc_win_rate_is_the_win_rate_when_lengths_are_equal():
  y = np.array([1, 1, 0, 0.5, 1, 0, 1, 1])
  assert evaluate.lc_win_rate(y, np.zeros(8)) == pytest.approx(y.mean(), abs=1e-3)


def test_lc_win_rate_removes_a_preference_for_length():
  """A judge that prefers the longer answer and nothing else: the policy writes longer answers
  70% of the time, so it wins 70%; controlled for length it is even."""
  rng = np.random.default_rng(0)
  d = np.abs(rng.normal(0, 50, 1000)) * np.where(rng.random(1000) < 0.7, 1, -1)
  y = (d > 0).astype(float)
  flip = rng.random(1000) < 0.2  # and some noise, so the fit is not separable
  y[flip] = 1 - y[flip]
  assert evaluate.win_rate(y, np.full(1000, 0.5)) > 0.6
  assert evaluate.lc_win_rate(y, d) == pytest.approx(0.5, abs=0.05)


def test_lc_win_rate_equals_an_independent_fit():
  """scipy's BFGS on the same penalised logistic likelihood gives the same intercept."""
  optimize = pytest.importorskip("scipy.optimize")
  rng = np.random.default_rng(1)
  d = rng.normal(20, 80, 300)
  x = np.tanh(d / d.std())
  y = (rng.random(300) < 1 / (1 + np.exp(-(0.4 + 1.2 * x)))).astype(float)
  y[:10] = 0.5  # ties count half

  def nll(w, l2=1e-3):
    z = w[0] + w[1] * x
    return np.mean(np.logaddexp(0, z) - y * z) + 0.5 * l2 * w @ w

  w = optimize.minimize(nll, np.zeros(2), method="BFGS", options={"gtol": 1e-10}).x
  assert evaluate.lc_win_rate(y, d) == pytest.approx(1 / (1 + np.exp(-w[0])), abs=1e-6)


# --- reward models from transformers folders ------------------------------------------------------

def _hf_judge_folder(directory, chat_template=True, tokenizer=True):
  """A tiny random LlamaForSequenceClassification over GPT-2's tokenizer with ChatML tokens and
  template, saved as transformers saves it."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from tokenizers import AddedToken, Tokenizer
  tok = Tokenizer.from_file(GPT2)
  tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>",
                                                                 "<pad>")])
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
      tie_word_embeddings=False, num_labels=1, pad_token_id=tok.token_to_id("<pad>"),
      rms_norm_eps=1e-6)
  model = transformers.LlamaForSequenceClassification(config).float().eval()
  with torch.no_grad():
    model.score.weight.normal_(0.0, 1.0)
  os.makedirs(directory, exist_ok=True)
  model.save_pretrained(directory, safe_serialization=True)
  if tokenizer:
    tok.save(os.path.join(directory, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
           "pad_token": "<pad>", "bos_token": None}
    if chat_template:
      cfg["chat_template"] = CHATML
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump(cfg, f)
  return model


def _transformers_scores(model, directory, texts_or_convs):
  import torch
  import transformers
  tok = transformers.AutoTokenizer.from_pretrained(directory)
  out = []
  for item in texts_or_convs:
    if isinstance(item, str):
      ids = tok(item, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    else:
      ids = tok.apply_chat_template(item, tokenize=True)
      ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
      out.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
  return np.array(out)


@needs_gpt2
def test_hf_judge_scores_conversations_rendered_its_own_way_as_transformers(tmp_path):
  """A judge with its own tokenizer and ChatML template: each (conversation, response) is
  rendered by the judge's template and scored as transformers scores the text its tokenizer's
  apply_chat_template gives; a text prompt is scored as prompt + response + EOS."""
  d = str(tmp_path / "rm")
  model = _hf_judge_folder(d)
  cfg = configs.DEFAULT.replace(judge=f"hf:{d}", stage="dpo", eval_batch_size=3)
  judge = judges.load(cfg, _mesh(), None, None)
  assert isinstance(judge, judges.RewardModelJudge) and judge.name == f"hf:{d}"
  convs = [((Message("system", "Be brief."), Message("user", "What is France's capital?")),
            "Paris."),
           ((Message("user", "Hi"), Message("assistant", "Hello!"), Message("user", "Bye?")),
            "Goodbye, and café."),
           ((Message("user", "2+2?"),), "4")]
  records = [judges.records_of(p, [r])[0] for p, r in convs]
  records.append(PreferenceRecord("Review the cafe in Oslo:", " warm coffee.", " warm coffee."))
  want = _transformers_scores(model, d, [
      [{"role": m.role, "content": m.content} for m in p] + [{"role": "assistant", "content": r}]
      for p, r in convs] + ["Review the cafe in Oslo: warm coffee."])
  np.testing.assert_allclose(judge.score(records), want, rtol=1e-4, atol=1e-4)
  # Its accuracy on pairs: chosen scored strictly above rejected.
  pairs = [ChatRecord(p, (Message("assistant", "Paris."),), (Message("assistant", "Rome."),))
           for p, _ in convs]
  acc = judges.accuracy(judge, pairs)
  c, r = judge.score(pairs), judge.score([x._replace(chosen=x.rejected) for x in pairs])
  assert acc == pytest.approx(np.mean(c > r))


@needs_gpt2
def test_hf_judge_fits_a_long_conversation_by_whole_turns_as_transformers_renders_them(tmp_path):
  """Over --max_prompt_length, a conversation reaches the judge without its earlier turns (the
  rest rendered again by the template, as its training pairs were fitted), never cut inside a
  turn: its score is transformers' score of the kept turns, not of the whole conversation."""
  import transformers
  d = str(tmp_path / "rm")
  model = _hf_judge_folder(d)
  tok = transformers.AutoTokenizer.from_pretrained(d)
  history = [{"role": "user", "content": "Tell me a long story about a cafe in Oslo."},
             {"role": "assistant", "content": "Once upon a time there was a warm cafe."}]
  last = [{"role": "user", "content": "And then?"}]
  ids = tok.apply_chat_template(last, add_generation_prompt=True, tokenize=True)
  budget = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
  cfg = configs.DEFAULT.replace(judge=f"hf:{d}", stage="dpo", eval_batch_size=2,
                                max_prompt_length=budget)
  judge = judges.load(cfg, _mesh(), None, None)
  prompt = tuple(Message(m["role"], m["content"]) for m in history + last)
  (record,) = judges.records_of(prompt, ["They closed."])
  reply = [{"role": "assistant", "content": "They closed."}]
  kept, whole = _transformers_scores(model, d, [last + reply, history + last + reply])
  got = judge.score([record])[0]
  assert got == pytest.approx(kept, rel=1e-4, abs=1e-4)
  assert abs(got - whole) > 1e-3  # the whole conversation scores otherwise


@needs_gpt2
def test_bad_judge_folders_are_one_line_errors(tmp_path):
  no_tok = str(tmp_path / "no_tok")
  _hf_judge_folder(no_tok, tokenizer=False)
  cases = [(f"hf:{no_tok}", r"has no tokenizer \(tokenizer.json\)"),
           (f"hf:{tmp_path / 'missing'}", "has no config.json"),
           (str(tmp_path / "missing"), "no such directory")]
  policy = str(tmp_path / "policy")
  os.makedirs(policy)
  with open(os.path.join(policy, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"]}, f)
  cases.append((f"hf:{policy}", "names no \\*ForSequenceClassification"))
  for flag, match in cases:
    cfg = configs.DEFAULT.replace(judge=flag, stage="dpo")
    with pytest.raises(judges.JudgeError, match=match) as e:
      judges.check(cfg)
    assert str(e.value).startswith(f"--judge={flag}: ") and "\n" not in str(e.value)


def test_judge_flags_that_cannot_work_together_are_refused():
  with pytest.raises(ValueError, match="give either --judge or --reward_fn"):
    configs.DEFAULT.replace(judge="hf:x", reward_fn="dpo.task:reward")
  with pytest.raises(ValueError, match="--judge=rm: must go with an rm stage before the dpo"):
    configs.DEFAULT.replace(judge="rm")
  with pytest.raises(ValueError, match="--rm_split=0.5: must go with an rm stage and another"):
    configs.DEFAULT.replace(rm_split=0.5, stage="rm")


def test_launch_refuses_an_unimportable_reward_fn_before_any_work(tmp_path):
  res = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch.py"), "--reward_fn=no_such_module_xyz:f",
       f"--output_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT,
      timeout=300)
  assert res.returncode == 2, res.stderr[-2000:]
  last = res.stderr.strip().splitlines()[-1]
  assert last.startswith("error: --reward_fn=no_such_module_xyz:f: cannot import"), last
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


# --- a run that trains its own judge ------------------------------------------------------------

def _small(**kw):
  return configs.DEFAULT.replace(
      d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
      task_train_pairs=128, task_sft_examples=64, task_eval_pairs=16, task_eval_prompts=8,
      global_batch_size=16, sft_steps=20, steps=10, rm_steps=30, rm_learning_rate=3e-3,
      sft_learning_rate=3e-3, learning_rate=1e-3, log_every=5, eval_every=0,
      checkpoint_every=0, eval_max_new_tokens=16, **kw)


def test_rm_split_gives_disjoint_prompts_to_the_rm_stage(tmp_path):
  cfg = _small(stage="rm,sft,dpo", rm_split=0.5, judge="rm", output_dir=str(tmp_path))
  data = loop.Data(cfg)
  prompt = lambda arrays: {tuple(t[:np.argmax(m > 0)]) for t, m in
                           zip(arrays["tokens"][:, 0], arrays["loss_mask"][:, 0])}
  rm_prompts, rest = prompt(data.rm_pairs), prompt(data.pairs)
  assert rm_prompts and rest and not rm_prompts & rest
  assert len(data.rm_pairs["tokens"]) + len(data.pairs["tokens"]) == 128
  assert len(data.sft["tokens"]) == 64  # the embedded task's own SFT set is not split


@pytest.mark.slow
def test_a_run_judged_by_its_own_reward_model(tmp_path):
  """--stage=rm,sft,dpo --rm_split=0.5 --judge=rm: the reward model trained on one half of the
  prompts judges the DPO policy trained on the other: a win rate, a length-controlled win rate,
  reward gain and the judge's held-out accuracy in the summary, the log, metrics.jsonl and a
  measured win-rate verdict; the same checkpoint given as --judge=DIR to another run scores the
  same."""
  out = str(tmp_path / "run")
  cfg = _small(stage="rm,sft,dpo", rm_split=0.5, judge="rm", output_dir=out)
  summary = loop.run(cfg)
  rm_dir = os.path.join(out, "checkpoints", "rm_model")
  assert summary["judge"].startswith("reward model rm (sha256 ")  # no output path
  for k in ("win_rate", "lc_win_rate", "policy_reward", "reference_reward", "reward_gain",
            "judge_accuracy"):
    assert isinstance(summary[k], float), k
  assert 0 <= summary["judge_accuracy"] <= 1 and 0 <= summary["lc_win_rate"] <= 1
  row = summary["verdicts"][0]
  assert row["target"] == "win rate" and row["verdict"] in ("PASS", "FAIL")
  assert row["value"] == summary["win_rate"]
  with open(os.path.join(out, "samples.jsonl")) as f:
    samples = [json.loads(line) for line in f]
  gain = np.mean([s["policy_reward"] - s["reference_reward"] for s in samples])
  assert summary["reward_gain"] == pytest.approx(gain, abs=1e-5)
  with open(os.path.join(out, "metrics.jsonl")) as f:
    evals = [json.loads(line) for line in f if '"stage": "eval"' in line]
  assert evals[-1]["eval/lc_win_rate"] == summary["lc_win_rate"]
  # The same reward model named by its path scores the same samples alike.
  mesh = _mesh()
  data = loop.Data(cfg)
  by_path = judges.load(cfg.replace(judge=rm_dir), mesh, data.tok, data.template)
  by_name = judges.load(cfg, mesh, data.tok, data.template)
  recs = [judges.records_of(s["prompt"], [s["policy"]])[0] for s in samples]
  np.testing.assert_allclose(by_path.score(recs), by_name.score(recs))
  # A run with another tokenizer cannot read with it.
  other = data.tok.__class__()
  other.fingerprint = lambda: "another"
  with pytest.raises(judges.JudgeError, match="another tokenizer or chat template"):
    judges.load(cfg.replace(judge=rm_dir), mesh, other, data.template)


def test_embedded_task_is_judged_by_its_true_reward_by_default():
  cfg = configs.DEFAULT
  judge = judges.load(cfg, _mesh(), None, None)
  assert judge.name == "dpo.task:reward"
  assert judge.score([PreferenceRecord("p", " great coffee, rude staff, warm bread.", "")]) == [
      task.true_reward(" great coffee, rude staff, warm bread.")]
  assert judges.load(cfg.replace(train_data="x.jsonl"), _mesh(), None, None) is None


# --- what a judge is: its content in the fingerprint, no path in the metrics ----------------------

def _fake_rm(path, value):
  """A reward-model checkpoint (the rm stage's meta) whose one array holds `value`."""
  from dpo import checkpoint
  mesh = _mesh()
  tree = {"score": jax.device_put(np.full((4, 1), value, np.float32),
                                  jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))}
  checkpoint.shutil.rmtree(path, ignore_errors=True)
  checkpoint.save(str(path), tree, {"kind": "params", "stage": "rm", "model": {}})


def _judge_fields(cfg):
  """The judge field of the fingerprint of each stage trained on the judge's labels."""
  from dpo.algorithms import grpo, iterative_dpo, online_dpo
  return {a.name: a.hyperparameters(cfg)["judge"]
          for a in (online_dpo.ONLINE_DPO, grpo.GRPO, iterative_dpo.ITERATIVE_DPO)}


def test_a_judge_replaced_at_the_same_path_changes_the_fingerprint(tmp_path):
  """A reward-model checkpoint by its manifest's checksums, an hf: folder by its weights and
  tokenizer, a --reward_fn by its source file: another judge at the same path or under the same
  name is another fingerprint, refused on resume in one line naming the flag; the same judge
  at another path is the same."""
  from dpo import checkpoint
  base = configs.DEFAULT.replace(stage="sft,online_dpo", output_dir=str(tmp_path / "run"))
  refusal = lambda old, new: checkpoint.Manager.check_identity_of(
      "ck", {"fingerprint": {"judge": old}}, {"fingerprint": {"judge": new}})
  # A reward-model checkpoint, replaced by another.
  rm_dir = tmp_path / "rm_model"
  _fake_rm(rm_dir, 1.0)
  first = _judge_fields(base.replace(judge=str(rm_dir)))
  _fake_rm(tmp_path / "moved", 1.0)
  assert _judge_fields(base.replace(judge=str(tmp_path / "moved"))) == first
  _fake_rm(rm_dir, 2.0)
  second = _judge_fields(base.replace(judge=str(rm_dir)))
  assert all(first[k] != second[k] for k in first) and str(tmp_path) not in str(first)
  with pytest.raises(checkpoint.CheckpointError, match=r"judge: '--judge=DIR: reward-model "
                     r"checkpoint sha256 .*use a fresh --output_dir") as e:
    refusal(first["online_dpo"], second["online_dpo"])
  assert "\n" not in str(e.value)
  # An hf: folder: its weights, then its tokenizer.
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  for name, text in (("config.json", "{}"), ("model.safetensors", "weights"),
                     ("tokenizer.json", "{}")):
    (hf_dir / name).write_text(text)
  hf = lambda: _judge_fields(base.replace(judge=f"hf:{hf_dir}"))["online_dpo"]
  before = hf()
  (hf_dir / "model.safetensors").write_text("other weights")
  after_weights = hf()
  (hf_dir / "tokenizer.json").write_text('{"other": 1}')
  assert len({before, after_weights, hf()}) == 3 and before.startswith("--judge=hf:DIR: ")
  # A reward function whose module's source changed.
  module = tmp_path / "judge_module_fp.py"
  module.write_text("def reward(prompt, completion):\n  return 1.0\n")
  sys.path.insert(0, str(tmp_path))
  try:
    fn = lambda: _judge_fields(base.replace(reward_fn="judge_module_fp:reward"))
    one = fn()
    module.write_text("def reward(prompt, completion):\n  return 2.0\n")
    two = fn()
  finally:
    sys.path.remove(str(tmp_path))
  assert all(one[k] != two[k] for k in one)
  assert one["grpo"].startswith("--reward_fn=judge_module_fp:reward: source sha256 ")
  # The library's own functions are the fingerprint's code field (a change is logged there).
  assert _judge_fields(base)["online_dpo"] == "--reward_fn=dpo.task:reward: library source"


def test_the_judge_in_the_metrics_names_no_output_path(tmp_path):
  """--judge=rm in two equal runs in two folders: the same words in eval/judge (the summary's
  judge), naming the judge and its content, never the folder."""
  import dataclasses
  from dpo import chat, checkpoint
  from models import transformer
  mesh = _mesh()
  described = []
  for run in ("a", "b"):
    cfg = _small(stage="sft,rm,dpo", judge="rm", output_dir=str(tmp_path / run))
    data = loop.Data(cfg)
    model = dataclasses.replace(cfg.model)
    params = transformer.init(model, jax.random.key(0), mesh)
    params["score"] = jax.device_put(np.ones((model.d_model, 1), np.float32),
                                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    checkpoint.save_params(os.path.join(cfg.run.output_dir, "checkpoints", "rm_model"), params,
                           model, stage="rm", reads={
                               "tokenizer": data.tok.fingerprint(),
                               "chat_template": chat.template_fingerprint(data.template)})
    described.append(judges.describe(judges.load(cfg, mesh, data.tok, data.template)))
  assert described[0] == described[1]
  assert described[0].startswith("reward model rm (sha256 ") and str(tmp_path) not in described[0]


# --- a reward function's failure: one line, before any work ----------------------------------------

def raising(prompt, completion):
  raise RuntimeError("judge crashed")


NOT_A_FUNCTION = 3


def test_a_reward_function_that_raises_is_one_line_naming_it_and_the_record():
  judge = judges.FunctionJudge("tests.test_judges:raising")
  with pytest.raises(judges.JudgeError) as e:
    judge.score([PreferenceRecord("Write a review of the cafe:", "c", "c")])
  assert str(e.value) == ("--reward_fn=tests.test_judges:raising: raised RuntimeError: judge "
                          "crashed on record 0 (prompt 'Write a review of the cafe:')")


def test_a_reward_function_that_is_not_callable_is_named_so():
  with pytest.raises(judges.JudgeError) as e:
    judges.FunctionJudge("tests.test_judges:NOT_A_FUNCTION")
  assert str(e.value) == ("--reward_fn=tests.test_judges:NOT_A_FUNCTION: "
                          "tests.test_judges.NOT_A_FUNCTION is 3 (int), not a function of "
                          "(prompt, response)")


@pytest.mark.parametrize("real_chmod", permission_cases())
def test_a_judge_folder_it_may_not_read_is_one_line_naming_it(tmp_path, monkeypatch, real_chmod):
  """--judge=hf:DIR behind chmod 000 (or the denial simulated where root reads through it): the
  check before any work, the fingerprint and the load each stop in one line naming the folder,
  never "has no config.json" nor a digest of no files; the folder stays as it was."""
  d = tmp_path / "judge"
  d.mkdir()
  files = {"config.json": json.dumps({"architectures": ["LlamaForSequenceClassification"]}),
           "model.safetensors": "weights", "tokenizer.json": "{}"}
  for name, text in files.items():
    (d / name).write_text(text)
  cfg = configs.DEFAULT.replace(judge=f"hf:{d}", stage="sft,online_dpo")
  judges.check(cfg)
  readable = judges.fingerprint(cfg)
  with deny_each(real_chmod)(d, monkeypatch):
    for call in (judges.check, judges.fingerprint, lambda c: judges.load(c, None, None, None)):
      with pytest.raises(judges.JudgeError) as e:
        call(cfg)
      message = str(e.value)
      assert message.startswith(f"--judge=hf:{d}: permission denied reading ")
      assert "\n" not in message and "left in place" in message
  assert {name: (d / name).read_text() for name in files} == files
  assert judges.fingerprint(cfg) == readable

"""dpo/hub.py: Hub names for models, tokenizers and data sets, resolved from a cache this test
builds in the libraries' own layouts (never the network): a model repo's snapshot in the Hub
cache (`models--ORG--NAME/snapshots/<commit>`, `refs/main`), a data set repo's snapshot there
(what `snapshot_download(repo_type="dataset")` leaves), and a data set `datasets` prepared by
name (`ORG___NAME/<config>/0.0.0/<commit>/`, what an online `load_dataset(name)` leaves, which is
what `load_dataset(name)` reads offline). The oracles: transformers' `from_pretrained(name)` and
`datasets.load_dataset` on the same cache. Offline, datasets 5.2's `load_dataset(name)` reads
only its own prepared cache, so for a Hub-cache snapshot the oracle is `load_dataset` on the
folder huggingface_hub resolves the name to."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import configs
from dpo import checkpoint, data, hub, identity, loop, tokenizer
from models import sharding

datasets = pytest.importorskip("datasets")
huggingface_hub = pytest.importorskip("huggingface_hub")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT, OTHER = "1" * 40, "2" * 40
WORDS = ["<|endoftext|>", "[UNK]"] + [f"{k}{i}" for k in "pcrqa" for i in range(12)] + ["<pad>"]


@pytest.fixture
def home(tmp_path, monkeypatch):
  """An empty HF_HOME, offline, that huggingface_hub, datasets and transformers use."""
  root = tmp_path / "hf"
  for key, value in (("HF_HOME", root), ("HF_HUB_CACHE", root / "hub"),
                     ("HF_DATASETS_CACHE", root / "datasets"), ("HF_HUB_OFFLINE", "1"),
                     ("HF_DATASETS_OFFLINE", "1")):
    monkeypatch.setenv(key, str(value))
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root / "hub"))
  monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets")
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
  hub._model_folder.cache_clear()
  hub.dataset.cache_clear()
  yield root
  hub._model_folder.cache_clear()
  hub.dataset.cache_clear()


def _snapshot(root, kind: str, repo: str, commit: str, ref: str = "main"):
  """The Hub cache's folder of `repo` at `commit`, with refs/<ref> pointing at it."""
  base = root / "hub" / f"{kind}--{repo.replace('/', '--')}"
  (base / "refs").mkdir(parents=True, exist_ok=True)
  (base / "refs" / ref).write_text(commit)
  folder = base / "snapshots" / commit
  folder.mkdir(parents=True, exist_ok=True)
  return folder


def _model_repo(root, repo="org/tiny-llama", commit=COMMIT, seed=0, ref="main"):
  """A random-weight tiny Llama and a word-level tokenizer, saved with save_pretrained into the
  snapshot."""
  folder = _snapshot(root, "models", repo, commit, ref)
  config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=64, tie_word_embeddings=False,
                                    eos_token_id=0, bos_token_id=None, pad_token_id=0)
  torch.manual_seed(seed)
  transformers.LlamaForCausalLM(config).save_pretrained(folder)
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                                         unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                       unk_token="[UNK]").save_pretrained(folder)
  return folder


def _rows(n: int, start: int = 0, kind: str = "p") -> list[dict]:
  return [{"prompt": f"{kind}{i % 12} q{i % 12}", "chosen": f" c{i % 12}",
           "rejected": f" r{(i + 1) % 12}"} for i in range(start, start + n)]


def _dataset_repo(root, repo="org/prefs", commit=COMMIT, ref="main"):
  """A data set repo in the H4 layout: `default` with Parquet train_prefs (two shards) and
  test_prefs, a second subset `other` (datasets takes one file format a repo)."""
  folder = _snapshot(root, "datasets", repo, commit, ref)
  (folder / "data").mkdir(exist_ok=True)
  (folder / "other").mkdir(exist_ok=True)
  pq.write_table(pa.Table.from_pylist(_rows(7)), folder / "data" / "train_prefs-00000.parquet")
  pq.write_table(pa.Table.from_pylist(_rows(5, 7)), folder / "data" / "train_prefs-00001.parquet")
  pq.write_table(pa.Table.from_pylist(_rows(4, 20, "a")), folder / "data" / "test_prefs-00000.parquet")
  pq.write_table(pa.Table.from_pylist(_rows(3, 30, "q")), folder / "other" / "train.parquet")
  (folder / "README.md").write_text(
      "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_prefs\n"
      "    path: data/train_prefs-*\n  - split: test_prefs\n    path: data/test_prefs-*\n"
      "- config_name: other\n  data_files:\n  - split: train\n    path: other/train.parquet\n---\n")
  return folder


def _hh_repo(root, repo="org/hh", commit=COMMIT):
  """A data set repo in HH-RLHF's layout: no card, one folder of gzipped JSONL per subset."""
  folder = _snapshot(root, "datasets", repo, commit)
  for sub, rows in (("harmless-base", _rows(6)), ("helpful-base", _rows(4, 10, "q"))):
    (folder / sub).mkdir(exist_ok=True)
    for split, part in (("train", rows[:4]), ("test", rows[4:])):
      with gzip.open(folder / sub / f"{split}.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in part)
  return folder


def _prepared_by_name(root, tmp_path, repo="org/prefs", commit=COMMIT):
  """The data set as an online `load_dataset(repo)` leaves it in the datasets cache (and nothing
  in the Hub cache): datasets' own builder for the repo's files, prepared under the repo's name
  and commit."""
  source = _dataset_repo(tmp_path / "elsewhere", repo, commit)
  builder = datasets.load_dataset_builder(str(source))
  builder.dataset_name, builder.repo_id, builder.hash = repo.split("/")[1], repo, commit
  builder._cache_dir_root = str(root / "datasets")
  builder._cache_dir = builder._build_cache_dir()
  builder.download_and_prepare()


def _read(value: str) -> list[dict]:
  return [obj for s in data.parse_sources(value) for _, obj in data.iter_objects(s.path)]


# --- models and tokenizers ---------------------------------------------------------------------

def test_a_hub_model_and_tokenizer_resolve_to_what_transformers_reads(home):
  folder = _model_repo(home)
  cfg = hub.resolve(configs.DEFAULT.replace(init_from="hf:org/tiny-llama",
                                            tokenizer="org/tiny-llama"))
  oracle = transformers.AutoModelForCausalLM.from_pretrained("org/tiny-llama")
  where = transformers.utils.cached_file("org/tiny-llama", "config.json")
  assert cfg.checkpoint.init_from == f"hf:{folder}" == f"hf:{os.path.dirname(where)}"
  assert cfg.data.tokenizer == str(folder)
  # The weights the import reads are transformers' (the model's file read by both).
  imported, params = loop.initial_params(cfg, None, sharding.make_mesh("data:-1"))
  state = oracle.state_dict()
  np.testing.assert_array_equal(np.asarray(params["embed"]),
                                state["model.embed_tokens.weight"].numpy())
  np.testing.assert_array_equal(np.asarray(params["lm_head"]).T, state["lm_head.weight"].numpy())
  assert imported.model.n_layers == 2
  text = "p3 q3 c3 zz <|endoftext|>"
  ours = tokenizer.load_tokenizer(cfg.data.tokenizer)
  theirs = transformers.AutoTokenizer.from_pretrained("org/tiny-llama")
  assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
  # The run's identity names the repo and commit; the flags as given keep the name.
  assert hub.identity(cfg) == {"init_from hub": f"org/tiny-llama@{COMMIT}",
                               "tokenizer hub": f"org/tiny-llama@{COMMIT}"}


@pytest.mark.slow
def test_a_hub_reward_model_judges_as_transformers_scores(home):
  """--judge=hf:ORG/NAME: the snapshot of a *ForSequenceClassification repo is the judge, its
  rewards transformers' on the ids it reads."""
  from dpo import judges
  from dpo.data import PreferenceRecord
  folder = _snapshot(home, "models", "org/tiny-rm", COMMIT)
  config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, num_labels=1,
                                    max_position_embeddings=64, pad_token_id=len(WORDS) - 1)
  torch.manual_seed(2)
  model = transformers.LlamaForSequenceClassification(config).float().eval()
  with torch.no_grad():
    model.score.weight.normal_(0.0, 1.0)
  model.save_pretrained(folder)
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                                         unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                       pad_token="<pad>", unk_token="[UNK]").save_pretrained(folder)
  cfg = configs.DEFAULT.replace(judge="hf:org/tiny-rm", stage="dpo")
  with pytest.raises(judges.JudgeError):  # the name as given is no folder: resolve makes it one
    judges.check(cfg)
  cfg = hub.resolve(cfg)
  judges.check(cfg)
  judge = judges.load(cfg, sharding.make_mesh("data:-1"), None, None)
  records = [PreferenceRecord(f"p{i} q{i}", f" c{i}", f" r{i}") for i in range(3)]
  rows = judge.rows(records)
  oracle = transformers.AutoModelForSequenceClassification.from_pretrained("org/tiny-rm").eval()
  with torch.no_grad():
    theirs = [float(oracle(input_ids=torch.tensor(t[s > 0][None])).logits[0, 0])
              for t, s in zip(rows["tokens"], rows["segment_ids"])]
  np.testing.assert_allclose(judge.score(records), theirs, rtol=1e-4, atol=1e-4)
  assert hub.identity(cfg) == {"judge hub": f"org/tiny-rm@{COMMIT}"}


def test_a_revision_picks_its_snapshot_and_another_commit_is_another_run(home):
  first = _model_repo(home)
  second = _model_repo(home, commit=OTHER, seed=1, ref="v2")
  at = lambda name: hub.resolve(configs.DEFAULT.replace(init_from=name)).checkpoint.init_from
  assert at("hf:org/tiny-llama") == f"hf:{first}"
  assert at("hf:org/tiny-llama@v2") == f"hf:{second}"
  assert at(f"hf:org/tiny-llama@{OTHER}") == f"hf:{second}"
  where = transformers.utils.cached_file("org/tiny-llama", "model.safetensors", revision="v2")
  assert os.path.dirname(where) == str(second)
  fp = lambda name: identity.fingerprint(
      hub.resolve(configs.DEFAULT.replace(init_from=name)), {}, (), {},
      identity.model_digest(at(name)))
  old, new = fp("hf:org/tiny-llama"), fp("hf:org/tiny-llama@v2")
  assert new["init_from hub"] == f"org/tiny-llama@{OTHER}"
  with pytest.raises(checkpoint.CheckpointError, match=f"init_from hub: 'org/tiny-llama@{COMMIT}'"
                     f" -> 'org/tiny-llama@{OTHER}'"):
    checkpoint.Manager.check_identity_of("ckpt", old, new)


def test_a_local_folder_of_the_same_name_wins(home, tmp_path, monkeypatch):
  _model_repo(home)
  monkeypatch.chdir(tmp_path)
  (tmp_path / "org" / "tiny-llama").mkdir(parents=True)
  cfg = configs.DEFAULT.replace(init_from="hf:org/tiny-llama")
  assert hub.resolve(cfg) == cfg and hub.identity(cfg) == {}


def test_a_missing_model_offline_is_one_line_naming_the_flag(home):
  _model_repo(home)
  for flag, value in (("init_from", "hf:org/nope"), ("tokenizer", "org/nope"),
                      ("judge", "hf:org/nope"), ("init_from", "hf:org/tiny-llama@v9")):
    with pytest.raises(hub.HubError) as e:
      hub.resolve(configs.DEFAULT.replace(**{flag: value}))
    assert str(e.value).startswith(f"--{flag}={value}: no such local folder, and the Hub model ")
    assert str(e.value).endswith("is not in the Hub cache (HF_HUB_OFFLINE is set)")
    assert "\n" not in str(e.value)


def test_every_model_flag_reads_a_hub_name_in_either_spelling(home, caplog):
  """`hf:ORG/NAME` on every flag that reads a model or tokenizer; a bare `ORG/NAME` on a model
  flag (whose bare value is a dpo-jax checkpoint) read from the Hub cache, logged, since nothing
  else could be meant; `--tokenizer=hf:DIR` as `--tokenizer=DIR`."""
  folder = str(_model_repo(home))
  for flag in ("init_from", "ref_init_from", "judge"):
    for value in ("hf:org/tiny-llama", "org/tiny-llama"):
      with caplog.at_level("WARNING"):
        cfg = hub.resolve(configs.DEFAULT.replace(**{flag: value}))
      assert hub._get(cfg, flag) == f"hf:{folder}", (flag, value)
      assert hub.identity(cfg) == {f"{flag} hub": f"org/tiny-llama@{COMMIT}"}
    assert (f"--{flag}=org/tiny-llama: no such checkpoint directory; read as "
            f"--{flag}=hf:org/tiny-llama, the Hub model in the cache") in caplog.text
  for value in ("hf:org/tiny-llama", "org/tiny-llama", f"hf:{folder}", folder):
    assert hub.resolve(configs.DEFAULT.replace(tokenizer=value)).data.tokenizer == folder, value


def test_a_bare_name_not_in_the_cache_names_the_spelling_that_loads_it(home, monkeypatch):
  """A model flag's bare `ORG/NAME` that is neither a local checkpoint nor in the Hub cache (or
  without huggingface_hub at all): one line giving `--flag=hf:ORG/NAME`; that spelling then says
  what the Hub answered."""
  for flag in ("init_from", "ref_init_from", "judge"):
    with pytest.raises(hub.HubError) as e:
      hub.resolve(configs.DEFAULT.replace(**{flag: "org/nope"}))
    assert str(e.value) == (f"--{flag}=org/nope: no such checkpoint directory; a Hub model is "
                            f"spelled --{flag}=hf:org/nope")
  monkeypatch.setitem(sys.modules, "huggingface_hub", None)
  _model_repo(home)
  with pytest.raises(hub.HubError, match=r"^--init_from=org/tiny-llama: no such checkpoint "
                     r"directory; a Hub model is spelled --init_from=hf:org/tiny-llama$"):
    hub.resolve(configs.DEFAULT.replace(init_from="org/tiny-llama"))


def test_a_data_set_reads_the_same_after_hf(home):
  """`hf:ORG/NAME:SPLIT` on a data flag is `ORG/NAME:SPLIT`, alone or in a mixture; a name that
  does not resolve is one line naming the value as given."""
  _dataset_repo(home)
  assert _read("hf:org/prefs:train_prefs") == _read("org/prefs:train_prefs")
  assert data.parse_sources("hf:org/prefs:train_prefs:0.5,hf:org/prefs:test_prefs:0.5") == (
      data.Source("org/prefs:train_prefs", 0.5), data.Source("org/prefs:test_prefs", 0.5))
  with pytest.raises(ValueError) as e:
    data.check_sources("train_data", "hf:org/nope:train")
  assert str(e.value) == ("--train_data=hf:org/nope:train: no such file, and the Hub data set "
                          "org/nope is not in the cache (HF_HUB_OFFLINE is set)")


def test_a_missing_package_names_the_extra(home, monkeypatch):
  monkeypatch.setitem(sys.modules, "huggingface_hub", None)
  with pytest.raises(hub.HubError, match=r"^--init_from=hf:org/x: a Hub name needs "
                     r"huggingface_hub: pip install 'dpo-jax\[hub\]'$"):
    hub.resolve(configs.DEFAULT.replace(init_from="hf:org/x"))
  monkeypatch.setitem(sys.modules, "datasets", None)
  with pytest.raises(ValueError, match=r"^--train_data=org/x:train: a Hub name needs datasets: "
                     r"pip install 'dpo-jax\[hub\]'$"):
    data.check_sources("train_data", "org/x:train")


# --- data sets ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value,repo,args", [
    ("org/prefs:train_prefs", "org/prefs", dict(split="train_prefs")),
    ("org/prefs:test_prefs", "org/prefs", dict(split="test_prefs")),
    ("org/prefs:other:train", "org/prefs", dict(name="other", split="train")),
    ("org/hh/harmless-base:test", "org/hh", dict(data_dir="harmless-base", split="test")),
    ("org/hh/helpful-base", "org/hh", dict(data_dir="helpful-base", split="train")),
])
def test_a_hub_snapshot_of_a_data_set_reads_as_load_dataset_reads_it(home, value, repo, args):
  _dataset_repo(home)
  _hh_repo(home)
  folder = huggingface_hub.snapshot_download(repo, repo_type="dataset", local_files_only=True)
  oracle = list(datasets.load_dataset(folder, **args))
  assert _read(value) == oracle and len(oracle) > 0
  data.check_sources("train_data", value)  # no error
  d = hub.dataset(value)
  assert (d.repo, d.commit) == (repo, COMMIT)


def test_a_data_set_revision_reads_its_snapshot(home):
  _dataset_repo(home)
  moved = _dataset_repo(home, commit=OTHER, ref="v2")
  pq.write_table(pa.Table.from_pylist(_rows(3, 70)), moved / "data" / "train_prefs-00001.parquet")
  for value, commit in (("org/prefs:train_prefs", COMMIT), ("org/prefs@v2:train_prefs", OTHER),
                        (f"org/prefs@{OTHER}:train_prefs", OTHER)):
    folder = huggingface_hub.snapshot_download("org/prefs", repo_type="dataset",
                                               revision=value.partition("@")[2].split(":")[0]
                                               or None, local_files_only=True)
    assert _read(value) == list(datasets.load_dataset(folder, split="train_prefs"))
    assert hub.dataset(value).commit == commit
  assert len(_read("org/prefs@v2:train_prefs")) == 10 and len(_read("org/prefs:train_prefs")) == 12


def test_a_data_set_datasets_prepared_by_name_reads_as_load_dataset_reads_it(home, tmp_path):
  _prepared_by_name(home, tmp_path)
  for split in ("train_prefs", "test_prefs"):
    oracle = list(datasets.load_dataset("org/prefs", split=split))
    assert _read(f"org/prefs:{split}") == oracle and len(oracle) > 0
  assert hub.dataset("org/prefs:train_prefs").commit == COMMIT
  assert _read(f"org/prefs@{COMMIT}:train_prefs") == _read("org/prefs:train_prefs")
  with pytest.raises(ValueError, match=r"^--train_data=org/prefs@v2:train_prefs: offline, "
                     f"datasets' cache holds org/prefs at commit {COMMIT}, not known to be "
                     r"revision v2 \(offline, a branch or tag resolves through the Hub cache's "
                     r"snapshot only\)$"):
    data.check_sources("train_data", "org/prefs@v2:train_prefs")
  assert not (home / "hub").exists()  # nothing but datasets' cache was read


def test_hub_data_through_the_run_its_identity_and_a_mixture(home, tmp_path):
  _model_repo(home)
  _dataset_repo(home)
  local = tmp_path / "local.jsonl"
  local.write_text("".join(json.dumps(r) + "\n" for r in _rows(6, 40, "q")))
  cfg = configs.DEFAULT.replace(train_data="org/prefs:train_prefs", eval_data="org/prefs:test_prefs",
                                tokenizer="org/tiny-llama", global_batch_size=4,
                                output_dir=str(tmp_path / "run"))
  d = loop.Data(hub.resolve(cfg))
  assert len(d.pairs["tokens"]) == 12 and len(d.held["tokens"]) == 4
  assert "p0 q0 c0" in d.tok.decode(d.pairs["tokens"][0, 0][d.pairs["segment_ids"][0, 0] > 0])
  fp = identity.fingerprint(hub.resolve(cfg), {}, ("train_data",), {})
  assert fp["train_data hub"] == f"org/prefs:train_prefs@{COMMIT}"
  assert fp["eval_data hub"] == f"org/prefs:test_prefs@{COMMIT}"
  # A mixture of a Hub split and a local file: TRL's counts of each, the first rows.
  mixed = f"org/prefs:train_prefs:0.5,{local}:0.5"
  located, report = data.read_sources(mixed, lambda p: data.iter_objects(p), "train_data")
  assert [s["taken"] for s in report] == [6, 6]
  assert [o for _, o in located[:6]] == list(datasets.load_dataset(
      huggingface_hub.snapshot_download("org/prefs", repo_type="dataset", local_files_only=True),
      split="train_prefs"))[:6]
  # The repo moved on: another commit with other rows is another run, named.
  hub.dataset.cache_clear()
  _dataset_repo(home, commit=OTHER)
  moved = identity.fingerprint(hub.resolve(cfg), {}, ("train_data",), {})
  assert moved["train_data hub"] == f"org/prefs:train_prefs@{OTHER}"
  with pytest.raises(checkpoint.CheckpointError, match="train_data hub"):
    checkpoint.Manager.check_identity_of("ckpt", fp, moved)


@pytest.mark.parametrize("value,message", [
    ("org/nope:train", r"no such file, and the Hub data set org/nope is not in the cache "
                       r"\(HF_HUB_OFFLINE is set\)"),
    ("org/prefs:train", r"org/prefs has no split train; its splits: train_prefs, test_prefs"),
    ("org/prefs:nope:train", r"org/prefs has no subset nope; its subsets: default, other"),
])
@pytest.mark.parametrize("flag", data.DATA_FLAGS)
def test_a_data_name_that_does_not_resolve_is_one_line_naming_the_flag(home, flag, value,
                                                                       message):
  _dataset_repo(home)
  with pytest.raises(ValueError, match=f"^--{flag}={value}: {message}$") as e:
    data.check_sources(flag, value)
  assert "\n" not in str(e.value)


def test_a_local_path_of_a_data_name_wins_and_a_missing_file_is_not_a_hub_name(home, tmp_path,
                                                                                monkeypatch):
  _dataset_repo(home)
  monkeypatch.chdir(tmp_path)
  (tmp_path / "org").mkdir()
  (tmp_path / "org" / "prefs").write_text(json.dumps(_rows(2, 50, "q")[0]) + "\n")
  assert _read("org/prefs") == _rows(2, 50, "q")[:1]
  with pytest.raises(ValueError, match=r"^--train_data=org/prefs\.jsonl: no such file"):
    data.check_sources("train_data", "org/prefs.jsonl")


@pytest.mark.slow
def test_launch_reads_hub_names_and_refuses_a_missing_one_in_one_line(home, tmp_path):
  _model_repo(home)
  _dataset_repo(home)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  run = lambda *flags: subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), *flags,
                                       f"--output_dir={tmp_path / 'run'}"], capture_output=True,
                                      text=True, env=env, cwd=tmp_path, timeout=300)
  out = run("--train_data=org/prefs:train_prefs", "--tokenizer=org/tiny-llama",
            "--init_from=hf:org/tiny-llama", "--chat_template=plain", "--inspect_data=3")
  assert out.returncode == 0, out.stderr[-2000:]
  preview = [json.loads(line) for line in open(tmp_path / "run" / "data_preview.jsonl")]
  rows = list(datasets.load_dataset(huggingface_hub.snapshot_download(
      "org/prefs", repo_type="dataset", local_files_only=True), split="train_prefs"))
  assert [p["prompt_text"].split() for p in preview] == [
      ["<|endoftext|>", *r["prompt"].split()] for r in rows[:3]]
  assert f"split train_prefs, commit {COMMIT}: 12 rows" in out.stderr

  out = run("--train_data=org/nope:train_prefs")
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1] == (
      "error: --train_data=org/nope:train_prefs: no such file, and the Hub data set org/nope is "
      "not in the cache (HF_HUB_OFFLINE is set)")


@pytest.mark.slow
@pytest.mark.parametrize("spelling", ["hf:org/tiny-llama", "org/tiny-llama"])
def test_launch_runs_with_one_spelling_on_both_model_flags(home, tmp_path, spelling):
  """The same Hub name on --tokenizer and --init_from, with `hf:` on both or on neither, runs a
  DPO step from the Hub model with its tokenizer; the bare name not in the cache stops in one line
  that gives the spelling that loads it."""
  _model_repo(home)
  _dataset_repo(home)
  run = lambda *flags: subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch.py"), "--train_data=org/prefs:train_prefs",
       "--chat_template=plain", "--max_prompt_length=16", "--max_target_length=16",
       "--task_eval_prompts=0", "--global_batch_size=8", "--stage=dpo", "--steps=1",
       "--checkpoint_every=0", *flags, f"--output_dir={tmp_path / 'run'}"],
      capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=tmp_path,
      timeout=300)
  out = run(f"--tokenizer={spelling}", f"--init_from={spelling}")
  assert out.returncode == 0, out.stderr[-2000:]
  steps = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert [(r["stage"], r["step"]) for r in steps if "loss" in r] == [("dpo", 1)]
  flags = (tmp_path / "run" / "flags.txt").read_text().split("\n")
  assert {f"--tokenizer={spelling}", f"--init_from={spelling}"} <= set(flags)
  meta = checkpoint.read_meta(str(tmp_path / "run" / "checkpoints" / "dpo" / "step_00000001"))
  assert meta["fingerprint"]["init_from hub"] == f"org/tiny-llama@{COMMIT}"
  assert meta["fingerprint"]["tokenizer hub"] == f"org/tiny-llama@{COMMIT}"
  if spelling.startswith("hf:"):
    return
  assert "read as --init_from=hf:org/tiny-llama, the Hub model in the cache" in out.stderr
  out = run("--tokenizer=org/tiny-llama", "--init_from=org/other")
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1] == (
      "error: --init_from=org/other: no such checkpoint directory; a Hub model is spelled "
      "--init_from=hf:org/other")


@pytest.mark.slow
@pytest.mark.usefixtures("compile_cache")
def test_a_run_on_hub_names_keeps_them_and_refuses_a_resume_after_the_repo_moved(home, tmp_path):
  _model_repo(home)
  _dataset_repo(home)
  out = tmp_path / "run"
  cfg = configs.DEFAULT.replace(
      init_from="hf:org/tiny-llama", tokenizer="org/tiny-llama",
      train_data="org/prefs:train_prefs", chat_template="plain", max_prompt_length=16,
      max_target_length=16, task_eval_prompts=0, global_batch_size=8, stage="dpo", steps=1,
      checkpoint_every=1, log_every=1, output_dir=str(out))
  loop.run(cfg)
  flags = (out / "flags.txt").read_text().split("\n")
  assert {"--init_from=hf:org/tiny-llama", "--tokenizer=org/tiny-llama",
          "--train_data=org/prefs:train_prefs"} <= set(flags)
  meta = checkpoint.read_meta(str(out / "checkpoints" / "dpo" / "step_00000001"))
  assert meta["fingerprint"]["init_from hub"] == f"org/tiny-llama@{COMMIT}"
  assert meta["fingerprint"]["train_data hub"] == f"org/prefs:train_prefs@{COMMIT}"
  # The data set repo moved to another commit: the same command is another run, refused.
  hub.dataset.cache_clear()
  moved = _dataset_repo(home, commit=OTHER)
  pq.write_table(pa.Table.from_pylist(_rows(12, 60)), moved / "data" / "train_prefs-00001.parquet")
  with pytest.raises(checkpoint.CheckpointError, match=(
      f"train_data hub: 'org/prefs:train_prefs@{COMMIT}' -> 'org/prefs:train_prefs@{OTHER}'")):
    loop.run(cfg.replace(steps=2))


@pytest.mark.slow
@pytest.mark.usefixtures("compile_cache")
def test_generate_answers_with_a_hub_model_named_by_its_id(home, tmp_path):
  """dpo/tools/generate.py takes --init_from as the launcher does: the Hub model's snapshot, its
  tokenizer, and the answers named after the repo, not the commit."""
  import jax
  from dpo.tools import generate
  _model_repo(home)
  questions = tmp_path / "alpaca_eval.json"
  questions.write_text(json.dumps([{"dataset": "x", "instruction": f"p{i} q{i}", "output": "c1",
                                    "generator": "g"} for i in range(2)]))
  cfg = configs.DEFAULT.replace(init_from="hf:org/tiny-llama", eval_temperature=0.0,
                                eval_max_new_tokens=3, eval_batch_size=2, chat_template="plain")
  out = tmp_path / "model_outputs.json"
  summary = generate.run(cfg, generate.Job(str(questions), str(out)),
                         sharding.make_mesh("data:1", jax.devices()[:1]))
  assert summary["model_id"] == "tiny-llama" and summary["answered"] == 2
  assert {r["generator"] for r in json.loads(out.read_text())} == {"tiny-llama"}

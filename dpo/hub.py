"""Hub names: models, tokenizers and data sets named by their Hugging Face Hub ids, resolved
through `huggingface_hub` and `datasets` as their own users call them (the `hub` extra).

One rule on every flag that can read from the Hub: `hf:NAME` names a Hugging Face source, NAME
a local path or, when no local path of that name exists, a Hub id; a bare value is a local path
first. For a model flag (`--init_from`, `--ref_init_from`, `--judge`) and `--tokenizer`, the Hub
id `ORG/NAME[@REVISION]` is that model repo: `huggingface_hub.snapshot_download` (config,
weights, tokenizer and template files only) gives its snapshot folder in the Hub cache, which
`resolve` puts in the config in its place, so the rest of the program reads it as any `hf:DIR`.
`--tokenizer` takes NAME bare or after `hf:` alike. A model flag's bare value is a dpo-jax
checkpoint, so a bare `ORG/NAME` that is no local path is read as `hf:ORG/NAME` only when the Hub
cache holds that model (unambiguous: nothing else could be meant; logged), and is otherwise
refused in one line that gives the spelling that loads it. A data source (`--train_data`,
`--eval_data`, `--sft_data`, or a part of a mixture), bare or after `hf:`,
`ORG/NAME[@REVISION][/DATA_DIR][:SPLIT]` or `...:SUBSET:SPLIT` that is not a local path is
`datasets.load_dataset(ORG/NAME, SUBSET, data_dir=DATA_DIR, split=SPLIT, revision=REVISION)`
(SPLIT "train" when not given, TRL's `dataset_train_split`); the project reads the Arrow files
`datasets` prepared for it (`dataset(...).files`, `data.source_files`), so its records are the
rows `load_dataset` gives.

The cache and offline mode are the libraries' own: `HF_HOME` / `HF_HUB_CACHE` /
`HF_DATASETS_CACHE`, and `HF_HUB_OFFLINE=1` (or `HF_DATASETS_OFFLINE=1`). Offline, a data set is
read from the Hub cache's snapshot of its repo when there is one (`load_dataset` on the snapshot
folder: what `huggingface-cli download --repo-type dataset` leaves), else from what `datasets`
prepared earlier. A local path of the same name always wins. Every name that does not resolve is
one `HubError` line naming the flag and the name (offline: not in the cache); a wrong split or
subset lists the ones there are. `identity` records what each name resolved to (repo id and
commit), so a resume onto another revision is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import re
import sys
from typing import NamedTuple

INSTALL = "pip install 'dpo-jax[hub]'"
# The files of a model repo the program reads: config, safetensors weights, tokenizer, template.
MODEL_FILES = ("*.json", "*.safetensors", "*.jinja")
_REPO = r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*"
_MODEL = re.compile(rf"^(?P<repo>{_REPO})(?:@(?P<revision>[\w.-]+))?$")
_DATA = re.compile(rf"^(?P<repo>{_REPO})(?:@(?P<revision>[\w.-]+))?(?P<data_dir>(?:/[\w.-]+)*)"
                   r"(?::(?P<first>[\w.-]+))?(?::(?P<second>[\w.-]+))?$")
# A name ending as a file does is a missing file, never a Hub id.
_FILE = re.compile(r"\.(jsonl?|gz|parquet|arrow|csv|txt|safetensors|model|npz)$")
HF = "hf:"  # the prefix of a Hugging Face source, on every flag that can read one
MODEL_FLAGS = ("init_from", "ref_init_from", "judge")  # a bare value: a dpo-jax checkpoint


class HubError(ValueError):
  """A Hub name that does not resolve: one line naming the flag and the name."""


class Dataset(NamedTuple):
  """What a Hub data source resolved to: the `load_dataset` arguments, the commit read and the
  Arrow files `datasets` prepared for the split, in order."""
  repo: str
  revision: str | None
  subset: str | None
  data_dir: str | None
  split: str
  commit: str
  files: tuple[str, ...]


def _module(name: str, what: str):
  try:
    return importlib.import_module(name)
  except ImportError:
    raise HubError(f"{what}: a Hub name needs {name.split('.')[0]}: {INSTALL}") from None


def model_name(value: str) -> re.Match | None:
  """The Hub id in a model flag's folder or --tokenizer value, or None for a local path (one
  that exists, is absolute, or ends as a file does)."""
  if not value or os.path.exists(value) or _FILE.search(value):
    return None
  return _MODEL.match(value)


def data_name(path: str) -> re.Match | None:
  """The parts of a data source that names a Hub data set, or None for a local path."""
  if not path or os.path.exists(path) or _FILE.search(path.split(":")[0]):
    return None
  return _DATA.match(path)


def _line(e: Exception) -> str:
  """An exception's message as one line (huggingface_hub's run over several)."""
  text = " ".join(str(e).split())
  return text[:300] + ("..." if len(text) > 300 else "")


def _offline() -> bool:
  """Whether huggingface_hub (HF_HUB_OFFLINE) or, once imported, datasets (HF_DATASETS_OFFLINE)
  is offline."""
  constants = _module("huggingface_hub.constants", "offline mode")
  datasets_config = sys.modules.get("datasets.config")
  return bool(constants.HF_HUB_OFFLINE or (datasets_config and datasets_config.HF_HUB_OFFLINE))


def model_folder(name: str, named: str) -> str:
  """The snapshot folder of Hub model repo `name` (`ORG/NAME[@REVISION]`): its config, weights,
  tokenizer and template files, downloaded into the Hub cache or (offline) found there; a
  HubError that starts with `named` (`--flag=VALUE` as given)."""
  try:
    return _model_folder(name)
  except HubError as e:
    raise HubError(f"{named}: {str(e).removeprefix(name + ': ')}") from None


@functools.lru_cache(maxsize=64)
def _model_folder(name: str) -> str:
  """`model_folder` once a process for each name (so flags naming one repo read one commit);
  errors start with the name."""
  m = _MODEL.match(name)
  what = name
  hub = _module("huggingface_hub", what)
  errors = _module("huggingface_hub.errors", what)  # a submodule the package does not import
  try:
    folder = hub.snapshot_download(m["repo"], revision=m["revision"], allow_patterns=MODEL_FILES)
  except errors.RevisionNotFoundError:
    raise HubError(f"{what}: no revision {m['revision']} of the Hub model {m['repo']}") from None
  except errors.RepositoryNotFoundError:
    raise HubError(f"{what}: no such local folder, nor a Hub model {m['repo']} this process may "
                   f"read") from None
  except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
    where = "is not in the Hub cache" + (" (HF_HUB_OFFLINE is set)" if _offline() else
                                         f" and the Hub cannot be reached ({_line(e)})")
    raise HubError(f"{what}: no such local folder, and the Hub model {m['repo']}"
                   f"{'@' + m['revision'] if m['revision'] else ''} {where}") from None
  except (errors.HfHubHTTPError, OSError) as e:
    raise HubError(f"{what}: the Hub model {m['repo']}: {_line(e)}") from None
  logging.info("%s: the Hub model %s at commit %s (%s)", name, m["repo"],
               os.path.basename(folder), folder)
  return folder


def _snapshot(hub, repo: str, revision: str | None) -> str | None:
  """The Hub cache's snapshot folder of data set repo `repo`, or None (offline only)."""
  errors = importlib.import_module("huggingface_hub.errors")
  try:
    return hub.snapshot_download(repo, repo_type="dataset", revision=revision,
                                 local_files_only=True)
  except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
    return None


def _load_error(e: Exception, what: str, m: Dataset, cached: bool) -> HubError:
  """A `load_dataset` failure as one line: a wrong split or subset listing the ones there are;
  offline, a name in neither cache (`cached`: the Hub cache holds a snapshot of it)."""
  text = _line(e)
  split = re.match(r'Unknown split "(.*)"\. Should be one of \[(.*)\]', text)
  if split:
    names = ", ".join(s.strip(" '\"") for s in split[2].split(","))
    return HubError(f"{what}: {m.repo} has no split {split[1]}; its splits: {names}")
  config = re.search(r"BuilderConfig '?(.*?)'? not found\. Available: \[(.*)\]", text)
  if config:
    names = ", ".join(s.strip(" '\"") for s in config[2].split(","))
    return HubError(f"{what}: {m.repo} has no subset {config[1]}; its subsets: {names}")
  if _offline() and not cached and isinstance(e, (ConnectionError, FileNotFoundError)):
    return HubError(f"{what}: no such file, and the Hub data set {m.repo} is not in the cache "
                    f"(HF_HUB_OFFLINE is set)")
  if type(e).__name__ == "DatasetNotFoundError":
    return HubError(f"{what}: no such file, nor a Hub data set {m.repo} ({text})")
  return HubError(f"{what}: the Hub data set {m.repo}: {text}")


@functools.lru_cache(maxsize=64)
def dataset(path: str) -> Dataset:
  """A Hub data source (`data_name`) loaded as `datasets.load_dataset` loads it, once a process
  (so the run's identity names the commit it read); errors start with `path`
  (`data.check_sources` puts the flag before it)."""
  what = path
  m = data_name(path)
  subset, split = (m["first"], m["second"]) if m["second"] else (None, m["first"] or "train")
  spec = Dataset(m["repo"], m["revision"], subset, m["data_dir"].lstrip("/") or None, split,
                 "", ())
  datasets = _module("datasets", what)
  hub = _module("huggingface_hub", what)
  args = dict(name=spec.subset, data_dir=spec.data_dir, split=spec.split)
  folder = _snapshot(hub, spec.repo, spec.revision) if _offline() else None
  try:
    ds = (datasets.load_dataset(folder, **args) if folder else
          datasets.load_dataset(spec.repo, revision=spec.revision, **args))
  except Exception as e:  # datasets raises ValueError, FileNotFoundError, ConnectionError, ...
    raise _load_error(e, what, spec, folder is not None) from None
  files = tuple(f["filename"] for f in ds.cache_files)
  if not files:
    raise HubError(f"{what}: datasets holds {spec.repo}'s split {spec.split} in memory, not in "
                   f"its cache; nothing to read")
  # The commit read: the snapshot's folder, or the hash folder datasets prepared it under.
  commit = os.path.basename(folder) if folder else os.path.basename(os.path.dirname(files[0]))
  if spec.revision and commit != spec.revision and folder is None and _offline():
    raise HubError(f"{what}: offline, datasets' cache holds {spec.repo} at commit {commit}, "
                   f"not known to be revision {spec.revision} (offline, a branch or tag "
                   f"resolves through the Hub cache's snapshot only)")
  logging.info("%s: the Hub data set %s%s%s, split %s, commit %s: %d rows", what, spec.repo,
               f"/{spec.data_dir}" if spec.data_dir else "",
               f" subset {spec.subset}" if spec.subset else "", spec.split, commit, len(ds))
  return spec._replace(commit=commit, files=files)


def resolve(cfg):
  """`cfg` with each model flag's and `--tokenizer`'s Hub name replaced by its snapshot folder
  (the module doc's rule; a model flag keeps its `hf:` prefix); the data flags keep their names
  (`data.source_files` reads them)."""
  changes = {}
  for flag in (*MODEL_FLAGS, "tokenizer"):
    value = _get(cfg, flag)
    read = _model_source(flag, value)
    if read != value:
      changes[flag] = read
  return cfg.replace(**changes) if changes else cfg


def _model_source(flag: str, value: str) -> str:
  """What the program reads for model flag or --tokenizer `value`: a Hub name's snapshot folder
  (`hf:FOLDER` on a model flag), or the value as it is."""
  named, name = f"--{flag}={value}", value.removeprefix(HF)
  if flag == "tokenizer":  # a tokenizer.json or its folder, after `hf:` or not
    return model_folder(name, named) if model_name(name) else name
  if value.startswith(HF):
    return HF + model_folder(name, named) if model_name(name) else value
  if not model_name(value):
    return value
  folder = _cached_model(value)
  if folder is None:
    raise HubError(f"{named}: no such checkpoint directory; a Hub model is spelled "
                   f"--{flag}={HF}{value}")
  logging.warning("%s: no such checkpoint directory; read as --%s=%s%s, the Hub model in the "
                  "cache (%s)", named, flag, HF, value, folder)
  return HF + folder


def _cached_model(name: str) -> str | None:
  """The Hub cache's snapshot folder of model repo `name` (`ORG/NAME[@REVISION]`), never from
  the network; None when the cache does not hold it or huggingface_hub is not installed."""
  m = _MODEL.match(name)
  try:
    hub = importlib.import_module("huggingface_hub")
    errors = importlib.import_module("huggingface_hub.errors")
  except ImportError:
    return None
  try:
    return hub.snapshot_download(m["repo"], revision=m["revision"], allow_patterns=MODEL_FILES,
                                 local_files_only=True)
  except (errors.LocalEntryNotFoundError, errors.HfHubHTTPError, OSError, ValueError):
    return None


def _get(cfg, flag: str) -> str:
  """A config field's value by its flag name, whichever section holds it."""
  for section in dataclasses.fields(cfg):
    part = getattr(cfg, section.name)
    if dataclasses.is_dataclass(part) and hasattr(part, flag):
      return getattr(part, flag)
  raise KeyError(flag)


_SNAPSHOT = re.compile(r"(?:^|/)(models|datasets)--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/"
                       r"(?P<commit>[0-9a-f]{40})/?$")


def identity(cfg) -> dict[str, str]:
  """{"<flag> hub": "ORG/NAME@COMMIT"} for each model flag a Hub name resolved to a folder in the
  Hub cache; {} for none. The data flags' are `data.hub_identity`."""
  out = {}
  for flag in (*MODEL_FLAGS, "tokenizer"):
    folder = _get(cfg, flag).removeprefix(HF)
    m = _SNAPSHOT.search(os.path.abspath(folder)) if folder else None
    if m:
      out[f"{flag} hub"] = f"{m['org']}/{m['name']}@{m['commit']}"
  return out

"""What makes a rerun the same run: the fingerprint every checkpoint carries and a resume must match.

A stage's fingerprint is a flat {name: value} of everything its result depends on: the
hyperparameters that change the run (the model, LoRA, optimizer, loss, reference and guard
sections, the seed, the data settings), content hashes of the data (every shard of a glob or a
save_to_disk folder, a mixture's fractions), the tokenizer and the tokenised arrays, the
initial model's content (a checkpoint's manifest digest, or a Hugging Face folder's files), the
repo and commit each Hub name resolved to (`hub.identity`, `data.hub_identity`), and the
library's source (a hash of each file). `checkpoint.Manager` stores it and refuses a checkpoint
whose fingerprint differs, naming each field with its old and new value. A source change is
refused before any work (`check_source`), naming the changed files, since resuming would carry
on a run the new code never trained; `--resume_changed_code` continues it anyway (logged, and
recorded in summary.json as `resumed_onto_changed_code`). A whole run has a digest too
(`run_digest`, summary.json's `run_sha256`): a rerun of a finished run with the same one shows
its summary instead of evaluating it again (`loop._finished`).
Left out, because they do not change what a step computes: the stage's length (`--steps`,
`--sft_steps`: extending is allowed and logged, shortening below a checkpoint refused by the
runner), paths, cadences, evaluation, the mesh (a checkpoint restores onto any mesh), `--log_kl`.

`--resume=auto|never|must` (`check_policy`): resume when there is something to resume (auto),
refuse an output directory that already holds checkpoints (never), or refuse to start afresh
(must).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import logging
import os

import numpy as np

from dpo import checkpoint, data, hub

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESUME = ("auto", "never", "must")

# Fields that do not change what a stage computes (see the module docstring).
_NEVER = {"steps", "sft_steps", "rm_steps", "online_steps", "export_rm_hf", "log_kl", "ref_cache_dir",
          "data_cache_dir", "eval_data", "task_eval_pairs", "task_eval_prompts", "tokenizer",
          "train_data", "sft_data"}


@functools.lru_cache(maxsize=None)
def source_digests() -> dict[str, str]:
  """{path: sha256 (16 hex digits)} of the library's source files: configs.py and every module
  of the dpo/ and models/ packages, subpackages included (dpo/algorithms/ and any a fork adds),
  and a fork's modules elsewhere that registered a loss or a stage (`--imports`); the tools
  (dpo/tools/, which the library never imports) and the tests excluded."""
  library = os.path.basename(os.path.dirname(os.path.abspath(__file__)))  # this package
  tools = os.path.join(ROOT, library, "tools") + os.sep
  files = [os.path.join(ROOT, "configs.py"),
           *(f for package in (library, "models")
             for f in glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True)
             if not f.startswith(tools))]
  digest = lambda f: data.file_sha256(f)[:16]  # hashed once per version of the file
  out = {os.path.relpath(f, ROOT): digest(f) for f in sorted(files)}
  out.update({f"{module} (--imports)": digest(f) for module, f in sorted(_fork_files().items())})
  return out


def _fork_files() -> dict[str, str]:
  """{module: file} of the modules outside dpo/, models/ and tests/ that registered a loss or a
  stage (a fork's `--imports`), keyed by module name so that the fork may move: their source is
  the run's too."""
  import inspect
  import sys

  from dpo import losses, registry
  fns = [l.fn for l in losses.LOSSES.values()] + [a.run for a in registry.ALGORITHMS.values()]
  inside = (os.path.dirname(os.path.abspath(__file__)) + os.sep,  # this package
            *(os.path.join(ROOT, d) + os.sep for d in ("models", "tests")))
  found = {}
  for fn in fns:
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    f = getattr(module, "__file__", None)
    if f and not os.path.abspath(f).startswith(inside) and os.path.abspath(f) != os.path.join(
        ROOT, "configs.py"):
      found[module.__name__] = os.path.abspath(f)
  return found


def file_digest(path: str) -> str:
  """sha256 of a file's content, or of a directory's files (names and contents)."""
  if os.path.isdir(path):
    h = hashlib.sha256()
    for f in sorted(glob.glob(os.path.join(path, "*"))):
      if os.path.isfile(f):
        h.update(f"{os.path.basename(f)}:{file_digest(f)}".encode())
    return h.hexdigest()
  return data.file_sha256(path)


def arrays_digest(arrays: dict) -> str:
  """sha256 over a dict of numpy arrays (names, dtypes, shapes, bytes)."""
  h = hashlib.sha256()
  for k in sorted(arrays):
    a = np.ascontiguousarray(arrays[k])
    h.update(f"{k}:{a.dtype}:{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def model_digest(source: str) -> str:
  """The initial model's content: "" (random init, fixed by seed and model section), a dpo-jax
  checkpoint's manifest digest, or `hf:DIR`'s config and weight files."""
  if not source:
    return "random"
  kind, _, path = source.partition(":")
  if kind == "hf":
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")) +
                   glob.glob(os.path.join(path, "config.json")))
    h = hashlib.sha256()
    for f in files:
      h.update(f"{os.path.basename(f)}:{file_digest(f)}".encode())
    return h.hexdigest()
  return checkpoint.digest(source)


def _plain(value):
  """JSON-stable form (tuples as lists), as a checkpoint's meta.json reads back."""
  return json.loads(json.dumps(value))


def fingerprint(cfg, hyperparameters: dict | None = None, data_files: tuple[str, ...] = (),
                arrays: dict | None = None, initial: str = "") -> dict:
  """The fingerprint of a stage whose result depends on `hyperparameters` (its algorithm's,
  dpo/algorithms) and the files named by the DataConfig fields `data_files`, trained on
  `arrays` from the model whose `model_digest` is `initial`; None `hyperparameters`: a random
  base (the model section and the seed alone)."""
  fp = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items()}
  fp["seed"] = cfg.run.seed
  if hyperparameters is not None:
    d = cfg.data
    fp.update({k: v for k, v in dataclasses.asdict(d).items() if k not in _NEVER})
    for flag in data_files:
      if getattr(d, flag):  # data: every shard, a mixture's fractions (data.source_digest)
        digest = data.source_digest if flag in data.DATA_FLAGS else file_digest
        fp[f"{flag} sha256"] = digest(getattr(d, flag))
    fp["data arrays sha256"] = arrays_digest(arrays)
    fp["initial model"] = initial
    fp.update(hub.identity(cfg))  # what a Hub name resolved to: repo and commit
    fp.update(data.hub_identity(cfg))
    fp.update(hyperparameters)
  fp[checkpoint.SOURCE] = source_digests()
  return _plain(fp)


def sections(cfg, names: tuple[str, ...]) -> dict:
  """The fields of config sections `names` that change what a step computes (not the SFT
  stage's own `sft_*` fields, nor those of `_NEVER`)."""
  return {k: v for section in names for k, v in dataclasses.asdict(getattr(cfg, section)).items()
          if k not in _NEVER and not k.startswith("sft_")}


def _found(checkpoints_dir: str) -> list[str]:
  """The step checkpoints and complete saved models under `checkpoints_dir`, sorted."""
  return sorted(glob.glob(os.path.join(checkpoints_dir, "*", "step_*")) +
                [p for p in glob.glob(os.path.join(checkpoints_dir, "*"))
                 if checkpoint.is_complete(p)])


def check_source(checkpoints_dir: str, changed_ok: bool) -> str:
  """How the library source differs from the one that wrote a checkpoint under
  `checkpoints_dir` ("" when it does not, or there is none): a resume onto changed code would
  carry on a run that the new code never trained, so it is refused in one line naming the files,
  before any work, unless `changed_ok` (--resume_changed_code: logged, and returned for the
  summary)."""
  for path in _found(checkpoints_dir):
    try:
      meta = checkpoint.read_meta(path)
    except checkpoint.CheckpointError:
      continue  # damaged or unreadable: the stage that reads it says so
    recorded = meta.get("fingerprint", {})
    if checkpoint.SOURCE not in recorded:
      continue  # a saved model that carries no fingerprint (the policy, an export)
    change = checkpoint.source_change(recorded[checkpoint.SOURCE], source_digests())
    if not change:
      continue
    where = os.path.relpath(path, os.path.dirname(checkpoints_dir))
    if not changed_ok:
      raise checkpoint.CheckpointError(
          f"{where} was written by other library source ({change}); refusing to resume it onto "
          f"this code: use a fresh --output_dir, or --resume_changed_code to continue the run "
          f"anyway")
    logging.warning("%s was written by other library source (%s); --resume_changed_code: "
                    "resuming it", where, change)
    return change
  return ""


def run_digest(cfg, flag_lines: list[str], judge: str) -> str:
  """sha256 of what a whole run's result depends on, to know a rerun of a finished run: the
  command line as given (`flag_lines`, less the --resume flags, which say how to continue and
  not what), the content of its data files, initial models, tokenizer and chat template, the
  `judge` (`judges.fingerprint`: a checkpoint's, a folder's or the reward functions' source
  content), what each Hub name resolved to, and the library source. Recorded in summary.json
  as `run_sha256`."""
  parts = {"flags": [l for l in flag_lines if not l.startswith("--resume")],
           "source": source_digests(), **hub.identity(cfg), **data.hub_identity(cfg)}
  for flag in data.DATA_FLAGS:
    if getattr(cfg.data, flag):
      parts[flag] = data.source_digest(getattr(cfg.data, flag))
  for name, source in (("init_from", cfg.checkpoint.init_from),
                       ("ref_init_from", cfg.reference.ref_init_from)):
    if source:
      try:
        parts[name] = model_digest(source)
      except (OSError, checkpoint.CheckpointError):
        parts[name] = "unreadable"  # the stage that loads it says why
  for name, path in (("tokenizer", cfg.data.tokenizer), ("chat_template", cfg.data.chat_template)):
    if path and os.path.exists(path):
      parts[name] = file_digest(path)
  parts["judge"] = judge
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def check_policy(resume: str, checkpoints_dir: str) -> None:
  """--resume=never refuses a directory that holds checkpoints; must refuses one that holds none."""
  found = _found(checkpoints_dir)
  if resume == "never" and found:
    raise checkpoint.CheckpointError(
        f"--resume=never but {checkpoints_dir} holds checkpoints of an earlier run "
        f"({', '.join(os.path.relpath(p, checkpoints_dir) for p in found[:3])}"
        f"{', ...' if len(found) > 3 else ''}); use a fresh --output_dir or delete it")
  if resume == "must" and not found:
    raise checkpoint.CheckpointError(f"--resume=must but there is no checkpoint under "
                                     f"{checkpoints_dir} to resume from")


def reusable(path: str, want: dict, step: int | None = None, flag: str = "",
             downstream: str = "") -> bool:
  """Whether the export at `path` (an SFT model, a random base) can be used as it is.

  False when it is absent, damaged (one warning; moved to `<path>.damaged`, so the stage runs
  again from its step checkpoints) or shorter than `step` (the stage is extended, logged).
  Raises CheckpointError when it belongs to another run (`want` differs, each field named), is
  longer than `step`, or is shorter while `downstream` (the step checkpoints of the stage that
  trains from it) holds checkpoints: extending would replace the model those were trained
  from, so it is refused before any work, naming the flag and both lengths.
  """
  if not os.path.exists(path):
    return False
  try:
    meta = checkpoint.verify(path)
  except checkpoint.Damaged as e:
    logging.warning("%s is damaged (%s); moved to %s.damaged, rebuilding it", path,
                    str(e).removeprefix(path + ": "), os.path.basename(path))
    checkpoint.move_aside(path)
    return False
  checkpoint.Manager.check_identity_of(path, meta, want)
  if step is not None and meta.get("step") != step:
    if meta.get("step", 0) > step:
      raise checkpoint.CheckpointError(
          f"{flag}={step} is below {path} (step {meta.get('step')}); give {flag} >= "
          f"{meta.get('step')}, or a fresh --output_dir")
    later = sorted(glob.glob(os.path.join(downstream, "step_*"))) if downstream else []
    if later:
      raise checkpoint.CheckpointError(
          f"{flag}={step} would extend {path} (step {meta.get('step')}), but "
          f"{os.path.relpath(later[-1], os.path.dirname(path))} was trained from it; give "
          f"{flag}={meta.get('step')} to resume, or a fresh --output_dir")
    logging.warning("%s is at step %s; %s=%d extends it", path, meta.get("step"), flag, step)
    return False
  return True

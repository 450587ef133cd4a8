"""Configuration as data: frozen dataclasses by concern, and the named presets.

A `Config` has one section per concern (model, lora, data, optim, loss, reference, guard, eval,
checkpoint, mesh, run) and the sections each training algorithm declares as its own
(registry.Algorithm.sections: reward, online, grpo, ...; with the cross-checks that are its, in
its module under dpo/algorithms/). Every field of every section is an absl flag of the same name
(dpo/cli.py), so a field's name, default and help text are written exactly once. Field names
are unique across sections so flags stay flat (`--beta`, `--lora_rank`). `ModelConfig` and
`LoraConfig` live with the models (models/config.py, with the `option`, `rules` and `check`
every section is written and validated with); the `loss` section, `LossConfig`, lives beside
the loss registry in dpo/losses.py. Jitted functions take as static arguments only the sections
their computation reads (dpo.train.StepConfig), so changing an output path or a cadence never
recompiles a step.

Defaults follow the source recipe (beta 0.1, AdamW lr 1e-5 with cosine decay and warmup
ratio 0.1, grad-norm clip 1.0, global batch 16, max target length 512, LoRA rank 16 /
alpha 32 / dropout 0.05 on q and v). Each preset says in one line why it departs from them;
docs/presets.md has the runs behind its values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dpo import algorithms  # noqa: F401 (importing it registers every algorithm and its sections)
from dpo import data as data_lib
from dpo import registry
from dpo import task as task_lib
from dpo.losses import LossConfig
from models.config import (ARCHS, FINITE_NONNEG, FINITE_POS, FRACTION, LORA_TARGETS, NONNEG, POS,
                           UNIT, LoraConfig, ModelConfig, at_least, check, one_of, option, rules,
                           shown)

__all__ = ["Config", "ModelConfig", "LoraConfig", "DataConfig", "OptimConfig", "LossConfig",
           "ReferenceConfig", "GuardConfig", "EvalConfig", "CheckpointConfig", "MeshConfig",
           "RunConfig", "SECTIONS", "PRESETS", "get_config", "ARCHS", "LORA_TARGETS"]


def _article(name: str) -> str:
  """"an" before a vowel sound: an online, an rm (a short name is spelt out), a kto."""
  return "an" if name[0] in "aeiou" or (len(name) <= 3 and name[0] in "fhlmnrsx") else "a"


def _distinct_names(stage: str) -> bool:
  """--stage: comma-separated names, none empty, none twice."""
  names = stage.split(",")
  return all(names) and len(set(names)) == len(names)


@dataclass(frozen=True)
class DataConfig:
  train_data: str = option("", "Preference data for DPO, unpaired feedback for KTO, or prompts "
                           "for the sampling stages (TRL's prompt-only {prompt, ...extra "
                           "columns}, GSM8K {question, answer}, MATH {problem, solution}; the "
                           "extra columns go to the reward functions): a JSONL or JSON-array "
                           "file (gzip ok), "
                           "a Parquet or Arrow file, a glob of shards ('data/train-*.parquet', "
                           "sorted), a datasets save_to_disk folder, or a mixture "
                           "'a.parquet:0.7,b.jsonl:0.3' (each source read in its own format; "
                           "fractions in (0, 1] are shares of the mixture, normalised, as TRL's "
                           "DatasetMixtureConfig: the largest mixture that repeats no record, "
                           "each source's first records; 'a,b' = all of each; a part is split "
                           "at its last ':' only before a number), or a Hub data set "
                           "[hf:]ORG/NAME[@REVISION][/DATA_DIR][[:SUBSET]:SPLIT] (split train "
                           "when not given; read through datasets.load_dataset, the hub extra; "
                           "a local path of that name wins). Empty = the embedded default task.")
  eval_data: str = option("", "Held-out preference data or prompts (same forms as train_data); "
                          "empty = "
                          "--eval_split of train_data, or the embedded task's held-out pairs.")
  sft_data: str = option("", "SFT data ({prompt, completion}, {messages}, ShareGPT "
                         "{conversations}, in the same files, globs, folders and mixtures as "
                         "train_data; rendered with the --chat_template the preference data "
                         "gets); empty = the chosen responses of train_data (GSM8K's and "
                         "MATH's worked solutions), or the embedded task's SFT data.")
  data_format: str = option("auto", "auto, standard, conversational, implicit, openai, sharegpt or "
                            "columns (see dpo/formats.py).")
  prompt_field: str = option("", "data_format=columns: the field holding the prompt (dotted paths "
                             "reach nested fields: a.b, a.0.b).")
  chosen_field: str = option("", "data_format=columns: the field holding the chosen response.")
  rejected_field: str = option("", "data_format=columns: the field holding the rejected response.")
  chat_template: str = option("auto", "How chat data is rendered: auto (the --tokenizer folder's "
                              "own chat_template, else plain), tokenizer (its own, required), a "
                              ".jinja file, or a hand-written one: plain, llama3, chatml (qwen), "
                              "gemma.")
  skip_bad_records: bool = option(False, "Skip (count and log) records that do not fit the data "
                                  "format or that the chat template refuses, instead of stopping.")
  inspect_data: int = option(0, "Write the first N training pairs as the model sees them to "
                             "<output_dir>/data_preview.jsonl, print a few, and exit without "
                             "training.")
  tokenizer: str = option("", "Hugging Face tokenizer.json (or its directory), or a Hub model "
                          "[hf:]ORG/NAME[@REVISION] (its snapshot, the hub extra; hf: optional); "
                          "empty = bytes.")
  bos_token: str = option("", "BOS token text ('none' = no BOS); empty = tokenizer_config.json or "
                          "GPT-2's <|endoftext|>.")
  eos_token: str = option("", "EOS token text; empty = tokenizer_config.json or <|endoftext|>.")
  pad_token: str = option("", "PAD token text; empty = tokenizer_config.json, else EOS.")
  eval_split: float = option(0.0, "Fraction of train_data prompts held out for evaluation (by "
                             "hash).")
  data_cache_dir: str = option("", "Where tokenised data is cached; empty = "
                               "<output_dir>/data_cache, 'none' = no cache.")
  max_prompt_length: int = option(512, "Prompt tokens kept: a conversation loses whole earlier "
                                  "turns (system message and template framing kept), a text "
                                  "prompt keeps its end.")
  max_target_length: int = option(512, "Completion tokens kept (the start is kept).")
  task: str = option("reviews", "The embedded task, without --train_data: reviews (short reviews, "
                     "a sentiment reward; dpo/task.py) or arithmetic (chain arithmetic with "
                     "worked solutions in <think>...</think> and a verifiable answer reward; "
                     "dpo/reasoning.py).")
  task_difficulty: int = option(4, "Embedded arithmetic task: problems of 1 to N operations.")
  task_train_pairs: int = option(4096, "Embedded task: number of training preference pairs.")
  task_sft_examples: int = option(4096, "Embedded task: number of SFT demonstrations.")
  task_eval_pairs: int = option(256, "Embedded task: held-out preference pairs.")
  task_eval_prompts: int = option(128, "Held-out prompts sampled at each evaluation (the embedded "
                                  "task's, cycled; with --train_data the first distinct prompts of "
                                  "the held-out pairs).")

  def __post_init__(self):
    rules(self, max_prompt_length=(lambda v: v >= 1, ">= 1 (tokens kept of each prompt)"),
          max_target_length=(lambda v: v >= 1, ">= 1 (tokens kept of each completion)"),
          eval_split=UNIT, task=one_of(tuple(task_lib.TASKS)), task_difficulty=at_least(1),
          task_train_pairs=POS, task_sft_examples=POS, task_eval_pairs=NONNEG,
          task_eval_prompts=NONNEG)
    check(not self.train_data or self.task == "reviews",
          f"--task={self.task}: an embedded task, read only without --train_data")
    check(self.task == "arithmetic" or
          self.task_difficulty == self.__dataclass_fields__["task_difficulty"].default,
          f"--task_difficulty={self.task_difficulty}: must go with --task=arithmetic (read "
          f"only there)")
    for name in data_lib.DATA_FLAGS:  # a mixture's syntax and fractions (the files: launch.py)
      value = getattr(self, name)
      try:
        data_lib.parse_sources(value)
      except ValueError as e:
        check(False, f"--{name}={value}: {e}")


@dataclass(frozen=True)
class OptimConfig:
  """Steps, batch and AdamW with warmup + cosine decay, for both stages."""
  steps: int = option(1000, "DPO optimizer steps.")
  sft_steps: int = option(1000, "SFT optimizer steps (stage sft or all).")
  global_batch_size: int = option(16, "Preference pairs (or SFT sequences) per step, all "
                                  "processes.")
  learning_rate: float = option(1e-5, "Peak DPO learning rate (AdamW).")
  sft_learning_rate: float = option(1e-5, "Peak SFT learning rate (AdamW).")
  sft_packing: int = option(0, "SFT rows of this many slots, each holding whole examples one "
                            "after another (best-fit decreasing; positions restart at each and "
                            "none attends to another; the loss the token mean of the unpacked "
                            "rows), as TRL's SFTConfig(packing=True, max_length=N); "
                            "--global_batch_size counts these rows. 0: one example a row.")
  warmup_ratio: float = option(0.1, "Fraction of steps spent in linear warmup before cosine decay.")
  weight_decay: float = option(0.0, "AdamW decoupled weight decay.")
  adam_b1: float = option(0.9, "AdamW beta1.")
  adam_b2: float = option(0.999, "AdamW beta2.")
  max_grad_norm: float = option(1.0, "Global-norm gradient clipping; 0 disables.")
  gradient_accumulation_steps: int = option(1, "Split each global batch into K microbatches, "
                                            "scanned inside the jitted step, with one update on "
                                            "their mean gradient (same result, activation memory "
                                            "of one microbatch). Batch-wide statistics (AOT's "
                                            "sorting, the token-mean NLL without --nll_per_pair) "
                                            "are then per microbatch, as in TRL.")

  def __post_init__(self):
    rules(self, steps=at_least(1), sft_steps=NONNEG, global_batch_size=POS, sft_packing=NONNEG,
          learning_rate=FINITE_POS, sft_learning_rate=FINITE_POS,
          warmup_ratio=(lambda v: 0 <= v <= 1, "in [0, 1]"), weight_decay=FINITE_NONNEG,
          adam_b1=UNIT, adam_b2=UNIT,
          max_grad_norm=(lambda v: 0 <= v < float("inf"), "a finite number >= 0 (0 disables)"))
    k = self.gradient_accumulation_steps
    check(k >= 1 and self.global_batch_size % k == 0,
          f"--gradient_accumulation_steps={k}: must be >= 1 and divide --global_batch_size="
          f"{self.global_batch_size}")


@dataclass(frozen=True)
class ReferenceConfig:
  """How the DPO reference is held: fixed (default), precomputed, or updated (TR-DPO)."""
  ref_update: str = option("none", "TR-DPO reference updates (Gorbatovski et al. 2024): none, soft "
                           "(ref <- a*policy + (1-a)*ref) or hard (ref <- policy).")
  ref_update_alpha: float = option(0.6, "TR-DPO soft-update mixing weight alpha.")
  ref_update_every: int = option(512, "TR-DPO: update the reference every N DPO steps.")
  precompute_ref: bool = option(False, "Compute reference log-probs of the training pairs once "
                                "(cached on disk) and skip the reference forward in each step.")
  ref_cache_dir: str = option("", "Where precomputed reference log-probs live; empty = "
                              "<output_dir>/ref_cache.")
  ref_init_from: str = option("", "A separate reference model (as TRL's ref_model): hf:DIR (or "
                              "hf:ORG/NAME[@REVISION], a Hub model) or a "
                              "dpo-jax params checkpoint with the policy's architecture, held "
                              "frozen, sharded like the policy and quantized with --base_quant; "
                              "the evaluation compares against it too. Empty = the policy's "
                              "initial weights.")

  def __post_init__(self):
    rules(self, ref_update=one_of(("none", "soft", "hard")), ref_update_alpha=FRACTION,
          ref_update_every=at_least(1))
    check(not (self.precompute_ref and self.ref_update != "none"),
          f"--precompute_ref=True: must go with --ref_update='none', not {self.ref_update!r}: "
          f"the reference changes")


@dataclass(frozen=True)
class GuardConfig:
  """The in-step KL measure and the KL-spike guard with its rollback (dpo/guards.py)."""
  log_kl: bool = option(False, "Compute the exact token KL(pi||ref) in every DPO step and log it "
                        "(costs the reference logits in the step; on with --kl_max; the KL guard "
                        "then watches it).")
  kl_max: float = option(0.0, "Roll back if the DPO step's exact token KL(pi||ref) exceeds this; 0 "
                         "= off (needs the reference in the step).")
  kl_spike_factor: float = option(5.0, "Roll back if KL exceeds this multiple of its largest value "
                                  "over the last kl_window steps; 0 = off. It watches the exact "
                                  "token KL with --log_kl or --kl_max, else the policy/reference "
                                  "log-ratio per token (free: the loss computes it), with "
                                  "reference-free losses the drift of the chosen NLL per token "
                                  "(the log says which).")
  kl_window: int = option(20, "Steps in the KL window (the factor test waits for a full window).")
  kl_spike_min: float = option(0.01, "The factor test ignores KL below this (nats per token). 0.01 "
                               "is the low end of the band the recipe expects: in a normal run KL "
                               "grows from 0 by more than kl_spike_factor within a window early "
                               "on, which is no spike.")
  rollback_lr_factor: float = option(0.1, "Learning-rate multiplier applied at each rollback.")
  max_rollbacks: int = option(3, "Stop the run after this many KL-spike rollbacks.")

  def __post_init__(self):
    rules(self, kl_window=at_least(1),
          kl_max=(lambda v: 0 <= v < float("inf"), "a finite number >= 0 (0 = off)"),
          kl_spike_factor=(lambda v: v == 0 or 1 < v < float("inf"),
                           "0 (off) or a finite number > 1 (a factor <= 1 fires on steady KL)"),
          kl_spike_min=FINITE_NONNEG, max_rollbacks=NONNEG, rollback_lr_factor=FRACTION)

  @property
  def enabled(self) -> bool:
    return self.kl_max > 0 or self.kl_spike_factor > 0


@dataclass(frozen=True)
class EvalConfig:
  eval_every: int = option(200, "Run the alignment evaluation every N DPO steps (and at the end); "
                           "0 = only at the end.")
  eval_temperature: float = option(1.0, "Evaluation sampling temperature (0 = greedy).")
  eval_top_k: int = option(0, "Evaluation top-k filter (0 = off).")
  eval_top_p: float = option(1.0, "Evaluation nucleus (top-p) filter (1.0 = off).")
  eval_max_new_tokens: int = option(0, "Tokens sampled per eval response (0 = max_target_length).")
  eval_batch_size: int = option(128, "Prompts per sampling batch during evaluation.")
  eval_samples_per_prompt: int = option(1, "Samples of each held-out prompt at each evaluation "
                                        "(the k of pass@k and majority@k on reasoning data and "
                                        "tasks; --task_eval_prompts prompts, each k times).")
  eval_show: int = option(4, "Sampled responses printed side by side at the end of a run.")
  judge: str = option("", "The judge that scores policy and reference samples (win rate, length-"
                      "controlled win rate, reward gain) and the held-out pairs (its accuracy): a "
                      "reward-model checkpoint (checkpoints/rm_model of an rm stage), hf:DIR (a "
                      "transformers *ForSequenceClassification folder with its tokenizer; "
                      "hf:ORG/NAME[@REVISION]: a Hub model's), or rm "
                      "(this run's rm stage's model); empty = --reward_fn (dpo/judges.py).")
  reward_fn: str = option("", "A judge that is a Python function module:function of (prompt, "
                          "response) returning a number (rule-based or verifiable rewards; one "
                          "with a `completions` parameter is called as TRL calls it, with "
                          "completion_ids and the data's extra columns), a reward function's "
                          "name (accuracy, reasoning_accuracy, think_format, "
                          "soft_overlong_punishment(soft_punish_cache=N), repetition_penalty, "
                          "cosine_scaled: TRL's, dpo/rewards.py), or several comma-separated "
                          "(a:f,think_format), one judge whose reward is their "
                          "sum weighted by --reward_weights; empty = the embedded task's true "
                          "reward on that task (dpo.task:reward, dpo.reasoning:reward with "
                          "--task=arithmetic), no judge on other data.")

  def __post_init__(self):
    rules(self, eval_every=NONNEG, eval_batch_size=POS, eval_max_new_tokens=NONNEG,
          eval_samples_per_prompt=POS,
          eval_temperature=FINITE_NONNEG, eval_top_k=NONNEG, eval_show=NONNEG,
          eval_top_p=FRACTION)


@dataclass(frozen=True)
class CheckpointConfig:
  """What the run starts from, what it saves, and what it exports."""
  checkpoint_every: int = option(100, "Save a checkpoint every N steps (and at the end); 0 = only "
                                 "at the end. Rerunning with the same output_dir resumes.")
  keep_checkpoints: int = option(3, "Newest step checkpoints kept per stage.")
  init_from: str = option("", "Start from a checkpoint instead of random init: a dpo-jax params "
                          "checkpoint (an SFT output or exported policy), or hf:DIR, a Hugging "
                          "Face directory (config.json + *.safetensors) whose config replaces the "
                          "model section, or hf:ORG/NAME[@REVISION], a Hub model (its snapshot in "
                          "the Hub cache, downloaded once; the hub extra; a local DIR of that "
                          "name wins; a bare ORG/NAME that is no local path is read from the Hub "
                          "cache, else refused naming hf:ORG/NAME). For --stage=dpo it is both "
                          "the initial policy and the reference.")
  export_hf: str = option("", "After DPO, write the policy (LoRA merged) as a Hugging Face "
                          "directory here, plus the LoRA factors alone in PEFT layout under "
                          "DIR/adapter.")
  resume: str = option("auto", "auto: resume from output_dir's checkpoints when there are any (the "
                       "rerun must be the same run: hyperparameters, data, tokenizer, initial "
                       "model and library source are fingerprinted); never: refuse an output_dir "
                       "that holds checkpoints; must: refuse to start without one.")
  resume_changed_code: bool = option(False, "Resume checkpoints written by other library source "
                                     "(refused without it, naming the changed files); the "
                                     "change is logged and recorded in summary.json.")

  def __post_init__(self):
    rules(self, checkpoint_every=NONNEG, keep_checkpoints=at_least(1),
          resume=one_of(("auto", "never", "must")))


@dataclass(frozen=True)
class MeshConfig:
  mesh: str = option("data:-1", "Mesh axis sizes, e.g. data:2,fsdp:2,tensor:2 (one may be -1).")


@dataclass(frozen=True)
class RunConfig:
  stage: str = option("sft,dpo", "The recipe: algorithms (dpo/algorithms, registered in "
                      "dpo/registry.py) run in order, comma-separated, e.g. dpo, sft,kto or "
                      "sft,rm,dpo; the default is SFT, then DPO against the SFT model.")
  seed: int = option(0, "Seed for init, data order and dropout.")
  imports: tuple[str, ...] = option((), "Modules of a fork's own losses and stages, imported "
                                    "before the config is built (launch.py reads this flag "
                                    "first), e.g. --imports=my_losses: their flags, sections, "
                                    "help and checks are then a built-in one's.")
  log_every: int = option(10, "Log one line and one metrics.jsonl record every N steps.")
  output_dir: str = option("runs/default", "Everything the run writes goes under this directory "
                           "(a preset's own paths under its output_dir, such as its export, "
                           "move with it unless given).")
  config: str = option("default", "The preset (from configs.py) the run starts from; every other "
                       "flag overrides its value.")
  wandb_project: str = option("", "Also log metrics.jsonl's records to this Weights & Biases "
                              "project (the wandb extra); empty = no W&B.")
  wandb_mode: str = option("online", "W&B mode: online, or offline (files under "
                           "<output_dir>/wandb, synced later with `wandb sync`).")
  autotune: str = option("off", "on: each training stage (not the online ones) first times a few "
                         "settings of --scan_unroll, --matmul_backward and --attention_block on "
                         "its own step and trains with the fastest, recorded in "
                         "<output_dir>/autotune.json and cached by CPU model and shapes "
                         "(dpo/autotune.py); off: the config's settings.")
  autotune_from: str = option("", "With --autotune=on: a run's autotune.json; each stage recorded "
                              "there trains with that choice, nothing timed (a run's flags.txt "
                              "names its own, so --flagfile= repeats it as it trained). Empty: "
                              "the run's own record, the cache, else a measurement.")

  def __post_init__(self):
    rules(self, stage=(_distinct_names, "algorithm names, each at most once, separated by "
                                        "commas"),
          log_every=at_least(1), wandb_mode=one_of(("online", "offline")),
          autotune=one_of(("off", "on")))
    check(self.autotune == "on" or not self.autotune_from,
          f"--autotune_from={self.autotune_from!r}: must go with --autotune=on (read only there)")
    check(self.wandb_mode == "online" or self.wandb_project,
          f"--wandb_mode={self.wandb_mode!r}: must go with --wandb_project (read only there)")

  @property
  def stages(self) -> tuple[str, ...]:
    """The recipe's algorithm names, in order."""
    return tuple(self.stage.split(","))


# The sections every run has; each algorithm adds its own (registry.Algorithm.sections), after
# these, in the order dpo/algorithms/__init__.py imports them.
_CORE = {"model": ModelConfig, "lora": LoraConfig, "data": DataConfig, "optim": OptimConfig,
         "loss": LossConfig, "reference": ReferenceConfig, "guard": GuardConfig,
         "eval": EvalConfig, "checkpoint": CheckpointConfig, "mesh": MeshConfig, "run": RunConfig}
_SECTIONS = {**_CORE, **registry.sections()}
SECTIONS = tuple(_SECTIONS)


def _field_sections(sections: dict[str, type]) -> dict[str, str]:
  """{field name: its section}; a name two sections both use is a TypeError naming it and them
  (a field is its flag, so the name must say which section it sets)."""
  out: dict[str, str] = {}
  for section, kind in sections.items():
    for f in dataclasses.fields(kind):
      if f.name in out:
        raise TypeError(f"config field {f.name!r} is in two sections, {out[f.name]} "
                        f"({sections[out[f.name]].__qualname__}) and {section} "
                        f"({kind.__qualname__}): a flag sets one field; rename one of them")
      out[f.name] = section
  return out


_FIELD_SECTION = _field_sections(_SECTIONS)


class _ConfigMethods:
  """`Config`'s checks and views; `Config` itself is this with one attribute per section."""

  def __post_init__(self):
    """Checks that span sections: the recipe's own here, each algorithm's in its module
    (registry.Algorithm.check)."""
    stages = self.run.stages
    check(not (self.eval.judge and self.eval.reward_fn),
          f"--judge={self.eval.judge!r}: give either --judge or --reward_fn, not both")
    scorer = registry.judge_stage(self.eval.judge)
    judged = [s for s in stages if s in registry.ALGORITHMS and registry.ALGORITHMS[s].judged]
    check(scorer is None or (scorer.name in stages and judged
                             and stages.index(scorer.name) < stages.index(judged[0])),
          f"--judge={self.eval.judge}: must go with an {self.eval.judge} stage before the "
          f"{judged[0] if judged else 'policy'} stage (--stage={self.run.stage})")
    online = self.online_stages
    check(not online or stages.count(online[0]) == 1,
          f"--stage={self.run.stage}: an online stage runs once in a recipe")
    check(not online or not self.reference.precompute_ref,
          f"--precompute_ref=True: the online stage {online[0] if online else ''} trains on "
          f"fresh samples, whose reference log-probs cannot be computed ahead")
    check(not online or not self.model.packing,
          f"--packing=True: the online stage {online[0] if online else ''} trains on one pair a "
          f"row of fresh samples")
    check(not online or bool(self.eval.judge or self.eval.reward_fn or not self.data.train_data),
          f"--stage={self.run.stage}: an online stage needs a judge to label its samples: give "
          f"--judge or --reward_fn")
    for name in [n for n in _SECTIONS if n not in _CORE]:  # in order: the first error is fixed
      section, readers = getattr(self, name), registry.readers(name)
      changed = [f"--{f.name}={shown(getattr(section, f.name))}"
                 for f in dataclasses.fields(section) if getattr(section, f.name) != f.default]
      what = readers[0] if len(readers) == 1 else name  # "an rm stage", "an online stage"
      check(any(s in stages for s in readers) or not changed,
            f"{(changed or [''])[0]}: must go with {_article(what)} {what} stage (--stage="
            f"{self.run.stage} has none)")
    check(not self.model.router_losses or self.model.n_experts or
          self.checkpoint.init_from.startswith("hf:"),  # an import decides; dpo/loop.py checks it
          f"--router_aux_loss_coef={self.model.router_aux_loss_coef}, --router_z_loss_coef="
          f"{self.model.router_z_loss_coef}: a router's losses need experts (--n_experts=0)")
    without = [s for s in stages  # an unknown stage is named by loop.run
               if s in registry.ALGORITHMS and not registry.ALGORITHMS[s].router_losses]
    check(not (self.model.router_losses and without),
          f"--router_aux_loss_coef={self.model.router_aux_loss_coef}, --router_z_loss_coef="
          f"{self.model.router_z_loss_coef}: the {','.join(without)} stage adds no router loss "
          f"to its loss; give 0 for a recipe with it")
    for algorithm in registry.ALGORITHMS.values():
      if algorithm.check is not None:
        algorithm.check(self)
    self._check_reference()

  def _check_reference(self) -> None:
    """The frozen base, the reference and the KL guard."""
    chosen = shown(self.loss.loss_type)
    check(self.model.base_quant == "none" or self.lora.enabled,
          f"--base_quant={self.model.base_quant!r}: must go with LoRA, not --lora_rank=0 (a "
          f"quantized base is frozen)")
    dense_mlp = [t for t in self.lora.lora_targets if t in ("gate", "up", "down")]
    check(not (self.model.n_experts and self.lora.enabled and dense_mlp),
          f"--lora_targets={','.join(self.lora.lora_targets)}: {','.join(dense_mlp)} name the "
          f"dense MLP, which a model of --n_experts={self.model.n_experts} has not (its experts "
          f"take no adapters); adapt the attention projections (q, k, v, o)")
    check(not (self.reference.precompute_ref and self.loss.reference_free),
          f"--precompute_ref=True: must go with a loss that reads the reference, not the "
          f"reference-free --loss_type={chosen}")
    check(not (self.reference.ref_init_from and self.loss.reference_free),
          f"--ref_init_from={self.reference.ref_init_from!r}: must go with a loss that reads the "
          f"reference, not the reference-free --loss_type={chosen}")
    check(not (self.reference.ref_init_from and self.reference.ref_update != "none"
               and self.lora.enabled),
          f"--ref_init_from={self.reference.ref_init_from!r} with --ref_update="
          f"{self.reference.ref_update!r}: must go with full fine-tuning, --lora_rank=0 (TR-DPO "
          f"with LoRA mixes adapters on the policy's own base)")
    check(not self.guard.kl_max or not (self.reference.precompute_ref or self.loss.reference_free),
          f"--kl_max={self.guard.kl_max!r}: must go with the reference in the step, not "
          f"--precompute_ref or a reference-free loss: it bounds the exact token KL of the KL "
          f"guard (the --kl_spike_factor test runs there, on an estimate)")

  @property
  def online_stages(self) -> tuple[str, ...]:
    """The recipe's stages that sample as they train (registry.Algorithm.samples)."""
    return tuple(s for s in self.run.stages
                 if s in registry.ALGORITHMS and registry.ALGORITHMS[s].samples)

  @property
  def kl_estimate(self) -> str:
    """What the KL guard watches (dpo/hooks.py, KLGuard.ESTIMATES): the exact token KL when the
    step computes it, else an estimate from the step's statistics."""
    if self.step_kl:
      return "kl"
    return "nll_drift" if self.loss.reference_free else "logratio"

  @property
  def step_kl(self) -> bool:
    """Whether the DPO step computes the exact token KL (it costs the reference logits
    [B, 2, T, V]): --log_kl or --kl_max asks for it, and the reference runs in the step (not
    precomputed, not reference-free). The spike test alone runs on the free estimate."""
    in_step = not (self.reference.precompute_ref or self.loss.reference_free)
    return in_step and (self.guard.log_kl or self.guard.kl_max > 0)

  def replace(self, **flat) -> "Config":
    """Returns a copy with flat field overrides (flag names) routed to their section."""
    unknown = sorted(set(flat) - set(_FIELD_SECTION))
    check(not unknown, f"unknown config fields {unknown}")
    sections = {s: {} for s in SECTIONS}
    for name, value in flat.items():
      sections[_FIELD_SECTION[name]][name] = value
    return Config(**{s: dataclasses.replace(getattr(self, s), **kw) if kw else getattr(self, s)
                     for s, kw in sections.items()})

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


# One attribute per section, its default the section's defaults: Config(model=..., grpo=...).
Config = dataclasses.make_dataclass(
    "Config", [(name, cls, cls()) for name, cls in _SECTIONS.items()], bases=(_ConfigMethods,),
    frozen=True)
Config.__module__ = __name__
Config.__doc__ = ("A run's configuration: one frozen section per concern (`SECTIONS`), the core "
                  "ones of this file and each registered algorithm's own.")


# --- Presets -----------------------------------------------------------------------------------
# Each says in one line why it departs from the recipe; docs/presets.md has the runs behind it.

# default: the embedded task's byte model, trained from scratch on two CPU cores in minutes; one
# evaluation, at the end (the verdict's). AdamW's beta2 0.95: with 0.999 the SFT model needs twice
# the steps for well-formed samples; layers unrolled with the explicit backward, the faster step
# (docs/presets.md).
DEFAULT = Config().replace(
    max_prompt_length=40, max_target_length=56, steps=150, sft_steps=1200, learning_rate=3e-4,
    rpo_alpha=4.0, sft_learning_rate=3e-3, adam_b2=0.95, global_batch_size=16,
    lora_targets=LORA_TARGETS, scan_unroll=4, matmul_backward="explicit", log_every=20,
    eval_every=0, log_kl=True, task_eval_prompts=512, output_dir="runs/default")

# reasoning: the embedded arithmetic task (dpo/reasoning.py) on the default byte model: SFT on
# worked solutions of mixed quality, then GRPO against the verifiable answer reward, judged by
# held-out pass@1 against the SFT model on 128 problems, 4 samples each (pass@4, maj@4).
REASONING = DEFAULT.replace(
    task="arithmetic", stage="sft,grpo", max_prompt_length=24, max_target_length=64,
    max_completion_length=64, eval_max_new_tokens=64, global_batch_size=64, grpo_steps=150,
    num_generations=8, grpo_beta=0.04, learning_rate=2e-3, task_eval_prompts=128,
    eval_samples_per_prompt=4, output_dir="runs/reasoning")

# moe: the default job with a mixture of experts in place of each layer's MLP (models/moe.py), a
# Mixtral (its export's family: Llama's attention, top-2 weights renormalised): 4 experts of
# half the default's width, 2 a token (the dense MLP's active width), the router's
# load-balancing loss at Qwen3-MoE's and Mixtral's 0.001; DPO trains every weight (the experts
# and the router with them) at lr 1e-4 (docs/moe.md: LoRA on the attention alone, which is what
# LoRA can adapt here, cost the samples' grammar before it won).
MOE = DEFAULT.replace(arch="mixtral", n_experts=4, experts_per_token=2, router_norm_topk=True,
                      mlp_dim=192, router_aux_loss_coef=1e-3, lora_rank=0, learning_rate=1e-4,
                      lora_targets=("q", "k", "v", "o"), output_dir="runs/moe")

# bench-small: the workload of shared/BENCHMARKS.md, its layers unrolled as the plain step's are;
# --autotune on, these settings its first candidate (the best differs by CPU and load).
BENCH_SMALL = Config(
    model=ModelConfig(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4,
                      head_dim=64, mlp_dim=1536, rope_theta=1e4, norm_eps=1e-5,
                      tie_embeddings=False, scan_unroll=8, matmul_backward="explicit"),
    lora=LoraConfig(lora_rank=16, lora_alpha=32.0, lora_dropout=0.0, lora_targets=("q", "v")),
).replace(max_prompt_length=192, max_target_length=64, global_batch_size=4, max_grad_norm=0.0,
          learning_rate=1e-5, output_dir="runs/bench-small", autotune="on")

# Real model shapes, from each model's published config.json; weights come from --init_from=hf:DIR.
LLAMA_3_2_1B = ModelConfig(
    arch="llama", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
    head_dim=64, mlp_dim=8192, rope_theta=500_000.0, norm_eps=1e-5, tie_embeddings=True,
    rope_scaling="llama3", rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
    rope_original_max_len=8192, compute_dtype="bfloat16")
LLAMA_3_1_8B = dataclasses.replace(
    LLAMA_3_2_1B, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
    mlp_dim=14336, tie_embeddings=False, rope_factor=8.0)
QWEN_2_5_0_5B = ModelConfig(
    arch="qwen2", vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
    head_dim=64, mlp_dim=4864, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=True,
    qkv_bias=True, compute_dtype="bfloat16")
QWEN_2_5_7B = dataclasses.replace(
    QWEN_2_5_0_5B, vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
    head_dim=128, mlp_dim=18944, tie_embeddings=False)
GEMMA_2_2B = ModelConfig(
    arch="gemma2", vocab_size=256000, d_model=2304, n_layers=26, n_heads=8, n_kv_heads=4,
    head_dim=256, mlp_dim=9216, rope_theta=10_000.0, norm_eps=1e-6, tie_embeddings=True,
    mlp_act="gelu_tanh", norm_plus_one=True, post_norms=True, embed_scale=True,
    attn_softcap=50.0, final_softcap=30.0, query_scale=256.0, sliding_window=4096,
    sliding_pattern=2, compute_dtype="bfloat16")

# Real-size runs: LoRA on every projection, recipe learning rate, a sequence budget that fits.
def _real(name: str, model: ModelConfig) -> Config:
  return dataclasses.replace(Config(), model=model).replace(
      lora_targets=LORA_TARGETS, max_prompt_length=512, max_target_length=512, stage="dpo",
      output_dir=f"runs/{name}")

# llama3-8b: the Llama 3.1 8B shape for dpo/tools/compile_check.py, with the remat it needs to fit.
LLAMA3_8B = dataclasses.replace(Config(), model=dataclasses.replace(LLAMA_3_1_8B, remat=True)
                                ).replace(output_dir="runs/llama3-8b", mesh="fsdp:-1")

# hh-rlhf-gpt2: a pipeline check on HH-RLHF with GPT-2's tokenizer, sized for two CPU cores.
HH_RLHF_GPT2 = Config().replace(
    vocab_size=50304, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=384,
    tie_embeddings=True, lora_rank=0,
    train_data="../shared/data/hh-rlhf/harmless-base-test.jsonl.gz",
    tokenizer="../shared/data/tokenizers/gpt2/tokenizer.json", max_prompt_length=64,
    max_target_length=32, eval_split=0.1, task_eval_prompts=64, steps=150, sft_steps=300,
    learning_rate=1e-4, sft_learning_rate=3e-3, global_batch_size=8, log_every=25,
    output_dir="runs/hh-rlhf-gpt2")

# hh-rlhf-judged: the same, judged: SFT on half of the training prompts, a reward model started
# from the SFT model on the other half (as InstructGPT starts its reward model from SFT), DPO on
# the SFT half, and the DPO policy judged against the SFT model by that reward model. GPT-2 pads
# with its EOS, which a reward model cannot (dpo/loop.py): PAD is the NUL byte's token instead.
HH_RLHF_JUDGED = HH_RLHF_GPT2.replace(
    stage="sft,rm,dpo", rm_split=0.5, judge="rm", pad_token="\u0100", rm_steps=200,
    rm_learning_rate=1e-3, task_eval_prompts=128, output_dir="runs/hh-rlhf-judged")

# smollm2-hh: a real pretrained chat model, SmolLM2-135M-Instruct (python -m dpo.tools.smollm2
# writes its folder and HH-RLHF as conversations), on HH-RLHF harmless-base with its own ChatML
# template, in minutes on two CPU cores: a LoRA reward model on half the training prompts judges
# DPO (LoRA, beta as the recipe) against the instruction-tuned model itself on the other half;
# 96 tokens a pair and a few steps to fit the time; lr 5e-4 (1e-3 for the reward model's new
# head), as LoRA needs for so few steps. <|endoftext|> pads: a reward model cannot pad with the
# EOS <|im_end|>.
SMOLLM2_HH = Config().replace(
    stage="rm,dpo", rm_split=0.5, judge="rm", init_from="hf:runs/smollm2-135m-instruct",
    tokenizer="runs/smollm2-135m-instruct", pad_token="<|endoftext|>",
    train_data="runs/hh-rlhf-chat.jsonl", eval_split=0.03, max_prompt_length=64,
    max_target_length=32, eval_max_new_tokens=48, steps=20, rm_steps=12, global_batch_size=8,
    learning_rate=5e-4, rm_learning_rate=1e-3, log_every=2, eval_every=0, task_eval_prompts=32,
    eval_batch_size=32, checkpoint_every=0, export_hf="runs/smollm2-hh/export",
    output_dir="runs/smollm2-hh")

# smollm2-hh-tpu: the same recipe at a real budget, for an accelerator (docs/smollm2.md: a TPU
# v5e chip, 6.6 min): every pair of HH-RLHF harmless-base, 512-token conversations (384 prompt
# tokens, whole earlier turns dropped first, 128 response tokens), batch 16 as the recipe; 10% of
# the prompts held out (233, every one sampled and judged, 128 new tokens); the reward model three
# epochs of its half at lr 1e-3 with LoRA on every projection (two epochs at 3e-4 stayed under
# 0.65 held-out accuracy; LoRA on q, v alone judged the same policies as less far ahead), DPO
# four epochs of the other half at lr 1e-4 with the recipe's q, v LoRA (KL 0.081 per token).
SMOLLM2_HH_TPU = SMOLLM2_HH.replace(
    eval_split=0.1, max_prompt_length=384, max_target_length=128, eval_max_new_tokens=128,
    global_batch_size=16, rm_steps=195, rm_learning_rate=1e-3,
    rm_lora_targets=("q", "k", "v", "o", "gate", "up", "down"), steps=260, learning_rate=1e-4,
    log_every=10, task_eval_prompts=256, eval_batch_size=128, remat=True,
    export_hf="runs/smollm2-hh-tpu/export", output_dir="runs/smollm2-hh-tpu")

# The real models' shapes (weights from --init_from=hf:DIR); dpo/tools/base_memory.py sizes each.
REAL_SIZES = {"llama3.2-1b": LLAMA_3_2_1B, "llama3.1-8b": LLAMA_3_1_8B,
              "qwen2.5-0.5b": QWEN_2_5_0_5B, "qwen2.5-7b": QWEN_2_5_7B, "gemma2-2b": GEMMA_2_2B}

PRESETS: dict[str, Config] = {
    "hh-rlhf-gpt2": HH_RLHF_GPT2,
    "hh-rlhf-judged": HH_RLHF_JUDGED,
    "smollm2-hh": SMOLLM2_HH,
    "smollm2-hh-tpu": SMOLLM2_HH_TPU,
    "default": DEFAULT,
    "reasoning": REASONING,
    "moe": MOE,
    "bench-small": BENCH_SMALL,
    "bench-small-full": BENCH_SMALL.replace(lora_rank=0),  # bench-small, every weight trained
    **{name: _real(name, m) for name, m in REAL_SIZES.items()},
    "llama3-8b": LLAMA3_8B,
}
PRESETS = {name: c.replace(config=name) for name, c in PRESETS.items()}  # each knows its name

# Presets whose inputs a tool builds: launch.py calls "module:function"(cfg) before it checks the
# inputs, and the function builds what the run reads and is not there yet (idempotent).
PREPARE = {"smollm2-hh": "dpo.tools.smollm2:prepare", "smollm2-hh-tpu": "dpo.tools.smollm2:prepare"}


def get_config(name: str) -> Config:
  if name not in PRESETS:
    raise ValueError(f"unknown --config {name!r}; presets: {', '.join(sorted(PRESETS))}")
  return PRESETS[name]

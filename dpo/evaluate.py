"""Alignment evaluation: held-out pair metrics and on-policy generation metrics.

Pair metrics (`pair_metrics`) run the same `logprobs.pair_stats` as training, without dropout, over every
held-out pair (the last partial batch is padded with copies and masked out of the averages).

Generation metrics (`Evaluator`) sample one response per held-out prompt from the policy and one
from the reference with models/sampler.py, then report
  * with a judge (dpo/judges.py: a reward model or a reward function; on the embedded task its
    true reward): the win rate of policy over reference (ties count half), each side's mean
    reward and the mean gain, the length-controlled win rate (`lc_win_rate`), and the judge's own
    accuracy on the held-out pairs; None without a judge, with the reason in
    `win_rate_reason` (summary.json, the table and the verdict say it);
  * on-policy KL(policy || reference), estimated as the mean over policy samples y ~ pi(.|x) of
    log pi(y|x) - log pi_ref(y|x) (nats): per sequence, and per token as the sum of those
    differences over the sum of sampled tokens (EOS counted, prompt not);
  * response lengths (tokens, EOS included), the fraction that ended with EOS, and distinct-n
    (unique / total whitespace-word n-grams over all samples, Li et al. 2016);
  * on a reasoning task (dpo/reasoning.py), for policy and reference on the same held-out
    problems and sampler: pass@1, pass@k and majority@k over each problem's k samples, answer
    extraction failures, the format rate and pass@1 per difficulty, the policy's pass@1 gain,
    and one record a problem (`Evaluator.answers`, the run's answers.jsonl).
The KL estimate is exact in expectation only for temperature 1 with no top-k / top-p filter;
with other settings it is the log-ratio on the samples actually drawn.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dpo import data as data_lib
from dpo import judges, logprobs, losses, train
from dpo.batches import PairBatch, Rows
from dpo.formats import distinct_n
from models import sampler, sharding, transformer


class Weights(NamedTuple):
  """A model as evaluated: its params and, with LoRA, the factors on them (None: params alone)."""
  params: Any
  lora: Any = None


class EvalSet(NamedTuple):
  """What a run is evaluated on. `prompts` are encoded by the Evaluator (BOS + text) unless
  `prompt_ids` gives them already tokenized (real data: the held-out pairs' prompts as rendered
  by the chat template), `prompts` then being their decoded text. `held`: the held-out pair
  arrays (pair metrics), `judge` what scores a response (dpo/judges.py; win rate),
  `well_formed_fn(prompt, response)` the task's grammar check; sampling stops at EOS or any of
  `stop_ids`. A judge reads `chats`, each prompt as the data gave it (text, or a conversation
  of Messages: `prompts` by default), and `held_records`, the held-out pairs as read (its
  accuracy). `reasoning`: the task's reasoning evaluation (dpo/reasoning.py: `metrics` of the
  samples, each prompt a problem), None on a task without answers. `columns`: each prompt's
  extra data columns (prompt data), which reward functions read."""
  tok: Any
  prompts: Sequence[str]
  prompt_ids: Sequence[Sequence[int]] | None = None
  held: dict | None = None
  judge: "judges.Judge | None" = None
  well_formed_fn: Callable[[str, str], bool] | None = None
  stop_ids: Sequence[int] = ()
  chats: Sequence | None = None
  held_records: Sequence | None = None
  reasoning: Any = None
  columns: Sequence[dict] | None = None


def _policy_and_reference(score_fn, model, lora_cfg, policy: Weights, ref_params, batch):
  adapter = None if policy.lora is None else transformer.Adapter(policy.lora, lora_cfg.scale)
  return score_fn(model, policy.params, batch, adapter), score_fn(model, ref_params, batch)


@functools.lru_cache(maxsize=8)
def _jitted_scores(score_fn, model, lora_cfg, mesh):
  """score_fn (pair or sequence) of policy and reference, jitted; outputs replicated so that
  every process can read them (multi-host)."""
  fn = functools.partial(_policy_and_reference, score_fn, model, lora_cfg)
  return jax.jit(train.with_mesh(mesh, fn), out_shardings=NamedSharding(mesh, P()))


def _pair_logps(model, params, batch: PairBatch, adapter=None):
  s = logprobs.pair_stats(model, params, batch, adapter)
  return s.logps, s.tokens


def pair_metrics(cfg, mesh, policy: Weights, ref_params, arrays: dict,
                 batch_size: int) -> dict[str, float]:
  """Held-out implicit-reward statistics (`losses.pair_statistics`, the same function the
  training metrics use, over all pairs of `arrays`) and the chosen-token perplexity."""
  fn = _jitted_scores(_pair_logps, cfg.model, cfg.lora, mesh)
  pol, counts, ref, _ = train.in_batches(
      mesh, lambda b: fn(policy, ref_params, b), PairBatch(Rows.of(arrays)), batch_size)
  lp = losses.Logps(pol[:, 0], pol[:, 1], ref[:, 0], ref[:, 1], counts[:, 0], counts[:, 1])
  stats = {k: float(v) for k, v in losses.pair_statistics(lp, cfg.loss.beta).items()}
  return {
      "reward_accuracy": stats["rewards/accuracies"],
      "reward_margin": stats["rewards/margins"],
      "rewards_chosen": stats["rewards/chosen"],
      "rewards_rejected": stats["rewards/rejected"],
      "logps_chosen": stats["logps/chosen"],
      "logps_rejected": stats["logps/rejected"],
      "perplexity": float(np.exp(-pol[:, 0].sum() / counts[:, 0].sum())),
      "pairs": len(pol),
  }


# --- generation metrics --------------------------------------------------------------------------

def win_rate(policy_rewards, reference_rewards) -> float:
  """Mean over prompts of 1 (policy better), 1/2 (tie), 0 (reference better)."""
  p, r = np.asarray(policy_rewards, np.float64), np.asarray(reference_rewards, np.float64)
  if p.shape != r.shape or p.size == 0:
    raise ValueError(f"need equal, non-empty reward arrays, got {p.shape} and {r.shape}")
  return float(np.mean((p > r) + 0.5 * (p == r)))


def lc_win_rate(preferences, length_diffs, l2: float = 1e-3, iters: int = 50) -> float:
  """The length-controlled win rate (Dubois et al. 2024, AlpacaEval 2): a logistic regression
  of the preference for the policy (1 win, 1/2 tie, 0 loss) on tanh(d / std(d)), d the
  policy's response length minus the reference's, read at d = 0: sigmoid of the intercept.
  Fitted by Newton's method on the mean log-likelihood with a small L2 penalty (`l2`, also on
  the intercept) that keeps it finite when one side wins every comparison. Equal lengths give
  (up to that penalty) the plain win rate."""
  y = np.asarray(preferences, np.float64)
  d = np.asarray(length_diffs, np.float64)
  if y.shape != d.shape or y.size == 0:
    raise ValueError(f"need equal, non-empty arrays, got {y.shape} and {d.shape}")
  scale = d.std()
  x = np.tanh(d / scale) if scale > 0 else np.zeros_like(d)
  X = np.stack([np.ones_like(x), x], axis=1)
  w = np.zeros(2)
  for _ in range(iters):
    p = 1.0 / (1.0 + np.exp(-X @ w))
    grad = X.T @ (p - y) / len(y) + l2 * w
    hess = (X.T * (p * (1 - p))) @ X / len(y) + l2 * np.eye(2)
    step = np.linalg.solve(hess, grad)
    w -= step
    if np.abs(step).max() < 1e-10:
      break
  return float(1.0 / (1.0 + np.exp(-w[0])))


def sampling_config(cfg, tok, stop_ids: Sequence[int] = ()) -> sampler.SamplingConfig:
  t = cfg.eval
  return sampler.SamplingConfig(
      max_new_tokens=t.eval_max_new_tokens or cfg.data.max_target_length,
      eos_id=tok.eos_id, pad_id=tok.pad_id,
      stop_ids=tuple(i for i in stop_ids if i != tok.eos_id), temperature=t.eval_temperature,
      top_k=t.eval_top_k, top_p=t.eval_top_p, vocab_limit=tok.vocab_size,
      banned_ids=tuple(i for i in (tok.pad_id, tok.bos_id) if i is not None))


def sample(cfg, mesh, scfg: sampler.SamplingConfig, weights: Weights,
           prompts: Sequence[Sequence[int]], key: jax.Array) -> list[list[int]]:
  """One completion (token ids, EOS included if emitted) per prompt, in batches.

  Chunk c (rows c * eval_batch_size onward) samples with fold_in(key, its first row), so
  results are reproducible given the key and eval_batch_size, whatever the device count.
  Every chunk has one shape (the longest prompt of all, the batch padded with repeated rows),
  so the sampler compiles once per weights, not once per chunk's longest prompt; a chunk of
  short prompts then decodes over the longest one's padding (masked), a small cost beside a
  compile.
  """
  bs = min(cfg.eval.eval_batch_size, len(prompts))
  bs += -bs % sharding.batch_shards(mesh)  # rows that split over the devices
  longest = max((len(p) for p in prompts), default=0)
  out: list[list[int]] = []
  for start in range(0, len(prompts), cfg.eval.eval_batch_size):
    chunk = list(prompts[start:start + cfg.eval.eval_batch_size])
    n = len(chunk)
    chunk += [chunk[-1]] * (bs - n)
    tokens, segments = sampler.left_pad(chunk, scfg.pad_id, multiple=8, length=longest)
    # Every process holds all prompts, so each passes the whole batch.
    batch = train.device_batch(mesh, sampler.Prompts(tokens, segments), len(chunk))
    adapter = None if weights.lora is None else transformer.Adapter(weights.lora, cfg.lora.scale)
    samples = sampler.generate(cfg.model, scfg, weights.params, batch,
                               jax.random.fold_in(key, start), adapter)
    out += sampler.completions(_replicated(mesh, samples))[:n]
  return out


def _replicated(mesh, tree):
  """A copy every process can read in full (multi-host): resharded to replicated on the mesh."""
  return jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)


def completion_logps(cfg, mesh, policy: Weights, ref_params,
                     pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int):
  """(log pi(y|x) [n], log pi_ref(y|x) [n], completion token counts [n]), summed nats, of the
  (prompt ids, completion ids) `pairs`."""
  rows = [(list(p), list(c)) for p, c in pairs]
  seq_len = -(-max(len(p) + len(c) for p, c in rows) // 8) * 8
  arrays = data_lib.pack_rows(rows, seq_len, pad_id)
  bs = cfg.eval.eval_batch_size + (-cfg.eval.eval_batch_size % sharding.batch_shards(mesh))
  fn = _jitted_scores(logprobs.sequence_logps, cfg.model, cfg.lora, mesh)
  pol, counts, ref, _ = train.in_batches(mesh, lambda b: fn(policy, ref_params, b),
                                    Rows.of(arrays), bs)
  return pol, ref, counts


def _length_stats(prefix: str, comps: Sequence[Sequence[int]], texts: Sequence[str],
                  eos_id: int) -> dict[str, float]:
  lens = np.array([len(c) for c in comps], np.float64)
  return {
      f"{prefix}_length_mean": float(lens.mean()),
      f"{prefix}_length_min": float(lens.min()),
      f"{prefix}_length_max": float(lens.max()),
      f"{prefix}_eos_rate": float(np.mean([bool(c) and c[-1] == eos_id for c in comps])),
      f"{prefix}_distinct_1": distinct_n(texts, 1),
      f"{prefix}_distinct_2": distinct_n(texts, 2),
  }


# Why win rate (and the rewards) are null on data without a judge.
NO_REWARD = ("no judge: give --judge=DIR (a reward model: checkpoints/rm_model, hf:DIR, or rm "
             "with an rm stage) or --reward_fn=module:function; without one this data's "
             "samples are compared by KL, lengths and distinct-n")


class Evaluator:
  """Generation (and, given held-out pairs, pair) metrics of a policy against its reference.

  The reference is fixed for a run, so its samples and their true rewards are drawn once and
  reused at every evaluation. All evaluations use the same key (common random numbers), so
  differences between evaluation steps come from the policy, not from sampling noise.
  """

  def __init__(self, cfg, mesh, data: EvalSet, ref_params):
    tok, prompt_ids = data.tok, data.prompt_ids
    self.cfg, self.mesh, self.tok, self.ref_params = cfg, mesh, tok, ref_params
    self.prompt_texts = list(data.prompts)
    if prompt_ids is None:
      stats = data_lib.TruncationStats(examples=len(self.prompt_texts))
      prompt_ids = [data_lib.encode_prompt(tok, p, cfg.data.max_prompt_length, stats)
                    for p in self.prompt_texts]
    if len(prompt_ids) != len(self.prompt_texts):
      raise ValueError(f"{len(prompt_ids)} prompt id lists for {len(self.prompt_texts)} prompts")
    self.prompt_ids = [list(p) for p in prompt_ids]
    self.held, self.judge_, self.well_formed_fn = data.held, data.judge, data.well_formed_fn
    self.chats = list(data.chats) if data.chats is not None else list(self.prompt_texts)
    if len(self.chats) != len(self.prompt_texts):
      raise ValueError(f"{len(self.chats)} judge prompts for {len(self.prompt_texts)} prompts")
    self.held_records, self.columns = data.held_records, data.columns
    self.reasoning, self.answers = data.reasoning, []
    self._judge_accuracy = None
    self.scfg = sampling_config(cfg, tok, data.stop_ids)
    key = jax.random.fold_in(jax.random.key(cfg.run.seed), 7)
    self.policy_key, self.ref_key = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    self._ref = None

  def _reference(self):
    if self._ref is None and self.prompt_ids:
      comps = sample(self.cfg, self.mesh, self.scfg, Weights(self.ref_params), self.prompt_ids,
                     self.ref_key)
      self._ref = (comps, *self.judge(comps))
    return self._ref

  def _strip_stop(self, comp):
    stops = (self.scfg.eos_id, *self.scfg.stop_ids)
    return comp[:-1] if comp and comp[-1] in stops else comp

  def judge(self, comps):
    """(texts, the judge's rewards or None, well-formed flags or None) of sampled completions,
    one per prompt."""
    texts = [self.tok.decode(self._strip_stop(c)) for c in comps]
    rewards = None
    if self.judge_ is not None:
      context = {}  # reward functions: the ids as sampled (TRL's), the prompts' columns
      if isinstance(self.judge_, (judges.FunctionJudge, judges.RewardFunctions)):
        context = {"ids": comps, "columns": self.columns}
      rewards = self.judge_.score([judges.records_of(p, [t])[0]
                                   for p, t in zip(self.chats, texts)], **context)
    formed = (None if self.well_formed_fn is None else
              np.array([self.well_formed_fn(p, t) for p, t in zip(self.prompt_texts, texts)]))
    return texts, rewards, formed

  def _reasoning(self, texts, ref_texts) -> dict:
    """The reasoning figures of policy and reference samples (the reference's prefixed
    `reference_`) and the pass@1 gain; one record a problem into `self.answers`."""
    mine, rows = self.reasoning.metrics(self.prompt_texts, texts, "")
    theirs, ref_rows = self.reasoning.metrics(self.prompt_texts, ref_texts, "reference_")
    self.answers = [{**r, **{f"reference_{k}": s[k] for k in ("answers", "correct", "majority",
                                                              "pass@1")}}
                    for r, s in zip(rows, ref_rows)]
    gain = (None if mine["pass@1"] is None or theirs["reference_pass@1"] is None else
            mine["pass@1"] - theirs["reference_pass@1"])
    return {**mine, **theirs, "pass@1_gain": gain}

  def judge_accuracy(self) -> float | None:
    """The judge's accuracy on the held-out pairs (computed once; None without them)."""
    if self._judge_accuracy is None and self.held_records:
      self._judge_accuracy = judges.accuracy(self.judge_, self.held_records)
    return self._judge_accuracy

  def __call__(self, policy: Weights) -> tuple[dict, list[dict]]:
    """(metrics, samples): one record per sampling prompt (prompt, both responses, their true
    rewards and well-formedness where the task defines them). Unavailable metrics are None."""
    m: dict = {}
    if self.held is not None:
      m.update(pair_metrics(self.cfg, self.mesh, policy, self.ref_params, self.held,
                            self.cfg.optim.global_batch_size))
    else:
      m.update(reward_accuracy=None, reward_margin=None, perplexity=None)
    if not self.prompt_ids:
      m.update(win_rate=None, lc_win_rate=None, policy_reward=None, reference_reward=None,
               reward_gain=None, judge_accuracy=None, kl_per_sequence=None, kl_per_token=None, policy_wellformed_rate=None,
               reference_wellformed_rate=None, win_rate_reason="no prompts to sample from")
      return m, []
    ref_comps, ref_texts, ref_rewards, ref_formed = self._reference()
    comps = sample(self.cfg, self.mesh, self.scfg, policy, self.prompt_ids, self.policy_key)
    texts, rewards, formed = self.judge(comps)
    pol, ref, counts = completion_logps(self.cfg, self.mesh, policy, self.ref_params,
                                        list(zip(self.prompt_ids, comps)), self.tok.pad_id)
    m["kl_per_sequence"] = float(np.mean(pol - ref))
    m["kl_per_token"] = float(np.sum(pol - ref) / max(np.sum(counts), 1.0))
    m["policy_logp_per_token"] = float(np.sum(pol) / max(np.sum(counts), 1.0))
    m["judge"] = judges.describe(self.judge_)
    if rewards is None:
      m.update(win_rate=None, lc_win_rate=None, policy_reward=None, reference_reward=None,
               reward_gain=None, judge_accuracy=None, win_rate_reason=NO_REWARD)
    else:
      m["win_rate"] = win_rate(rewards, ref_rewards)
      chars = lambda ts: np.array([len(t) for t in ts], np.float64)
      m["lc_win_rate"] = lc_win_rate((rewards > ref_rewards) + 0.5 * (rewards == ref_rewards),
                                     chars(texts) - chars(ref_texts))
      m["policy_reward"] = float(rewards.mean())
      m["reference_reward"] = float(ref_rewards.mean())
      m["reward_gain"] = float((rewards - ref_rewards).mean())
      m["judge_accuracy"] = self.judge_accuracy()
    m["policy_wellformed_rate"] = None if formed is None else float(formed.mean())
    m["reference_wellformed_rate"] = None if ref_formed is None else float(ref_formed.mean())
    if self.reasoning is not None:
      m.update(self._reasoning(texts, ref_texts))
    m.update(_length_stats("policy", comps, texts, self.tok.eos_id))
    m.update(_length_stats("reference", ref_comps, ref_texts, self.tok.eos_id))
    m["eval_prompts"] = len(self.prompt_ids)
    value = lambda a, i: None if a is None else a[i].item()
    samples = [{"prompt": prompt, "policy": texts[i], "reference": ref_texts[i],
                "policy_reward": value(rewards, i), "reference_reward": value(ref_rewards, i),
                "policy_well_formed": value(formed, i),
                "reference_well_formed": value(ref_formed, i),
                "log_ratio": float(pol[i] - ref[i]), "policy_tokens": len(comps[i]),
                "reference_tokens": len(ref_comps[i])}
               for i, prompt in enumerate(self.prompt_texts)]
    return m, samples


# The recipe's targets (the defaults of DEVELOPERS' source article): win rate above 70%, KL
# between 0.01 and 0.1 nats per token; and two that keep the alignment honest: the policy's
# held-out perplexity within 1.5x the reference's, and (where the task can tell) well-formed
# samples, so that a reward won by breaking the language does not pass.
WIN_RATE_MIN = 0.7
KL_PER_TOKEN_BAND = (0.01, 0.1)
PERPLEXITY_RATIO_MAX = 1.5
WELLFORMED_MIN = 0.95
# On a reasoning task the reward is a 0/1 answer check, so most comparisons tie and the win rate
# says little: the target is the policy's held-out pass@1 above its reference's (the SFT model's,
# same problems, same sampler) by this much; well-formed is then the format rate.
PASS_AT_1_GAIN_MIN = 0.15


def verdicts(metrics: dict, reference_perplexity: float | None) -> list[dict]:
  """PASS / FAIL per recipe target, with the measured value; a target whose figure the run
  cannot measure (no judge, no held-out pairs) is "n/a", never a PASS."""
  lo, hi = KL_PER_TOKEN_BAND
  ppl, ratio = metrics.get("perplexity"), None
  if ppl is not None and reference_perplexity:
    ratio = ppl / reference_perplexity
  reasoning = "pass@1_gain" in metrics
  checks = [
      ("pass@1 gain", f">= {PASS_AT_1_GAIN_MIN}", metrics.get("pass@1_gain"),
       lambda v: v >= PASS_AT_1_GAIN_MIN) if reasoning else
      ("win rate", f">= {WIN_RATE_MIN}", metrics.get("win_rate"), lambda v: v >= WIN_RATE_MIN),
      ("KL per token (nats)", f"in [{lo}, {hi}]", metrics.get("kl_per_token"),
       lambda v: lo <= v <= hi),
      ("perplexity / reference's", f"<= {PERPLEXITY_RATIO_MAX}", ratio,
       lambda v: v <= PERPLEXITY_RATIO_MAX),
      ("well-formed: policy", f">= {WELLFORMED_MIN}", metrics.get("policy_wellformed_rate"),
       lambda v: v >= WELLFORMED_MIN),
      ("well-formed: reference", f">= {WELLFORMED_MIN}",
       metrics.get("reference_wellformed_rate"), lambda v: v >= WELLFORMED_MIN),
  ]
  out = [{"target": name, "want": want, "value": value,
          "verdict": "n/a" if value is None else ("PASS" if ok(value) else "FAIL")}
         for name, want, value, ok in checks]
  for v in out:  # the win-rate row says why it could not be measured
    if v["target"] == "win rate" and v["value"] is None and metrics.get("win_rate_reason"):
      v["reason"] = metrics["win_rate_reason"]
  return out


def _fmt(v) -> str:
  if v is None:
    return "n/a"
  return f"{v:.4f}" if isinstance(v, float) else str(v)


def report(metrics: dict, samples: Sequence[dict], show: int,
           verdict_rows: Sequence[dict] = ()) -> str:
  """A short terminal table of the main figures, `show` side-by-side samples and the verdicts."""
  rows = [
      ("judge", "judge"),
      ("win rate (policy vs reference)", "win_rate"),
      ("length-controlled win rate", "lc_win_rate"),
      ("mean reward: policy / reference", ("policy_reward", "reference_reward")),
      ("mean reward gain (policy - reference)", "reward_gain"),
      ("judge accuracy on held-out pairs", "judge_accuracy"),
      ("KL(policy||ref) per sequence (nats)", "kl_per_sequence"),
      ("KL(policy||ref) per token (nats)", "kl_per_token"),
      ("held-out implicit reward accuracy", "reward_accuracy"),
      ("held-out implicit reward margin", "reward_margin"),
      ("chosen perplexity under policy", "perplexity"),
      ("well-formed samples: policy / reference",
       ("policy_wellformed_rate", "reference_wellformed_rate")),
      ("response length: policy (mean)", "policy_length_mean"),
      ("response length: reference (mean)", "reference_length_mean"),
      ("distinct-1 / distinct-2: policy", ("policy_distinct_1", "policy_distinct_2")),
      ("distinct-1 / distinct-2: reference", ("reference_distinct_1", "reference_distinct_2")),
  ]
  if "pass@1" in metrics:  # a reasoning task's figures, policy / reference
    ks = sorted(k for k in metrics if k.startswith(("pass@", "maj@")) and "/" not in k
                and k != "pass@1_gain")
    rows[1:1] = [*((f"{k}: policy / reference", (k, f"reference_{k}")) for k in ks),
                 ("pass@1 gain (policy - reference)", "pass@1_gain"),
                 ("answer extraction failures: policy / reference",
                  ("extraction_failure_rate", "reference_extraction_failure_rate"))]
    if "unscorable_problems" in metrics:  # real data's solutions (reasoning.Solutions)
      rows[1:1] = [("think format: policy / reference", ("format_rate", "reference_format_rate")),
                   ("problems whose solution does not parse", "unscorable_problems")]
  width = max(len(r[0]) for r in rows)
  lines = ["", "=== evaluation " + "=" * (width - 3)]
  for label, key in rows:
    keys = key if isinstance(key, tuple) else (key,)
    lines.append(f"{label:<{width}}  " + " / ".join(_fmt(metrics.get(k)) for k in keys))
    if key == "win_rate" and metrics.get("win_rate") is None and metrics.get("win_rate_reason"):
      lines[-1] += f" ({metrics['win_rate_reason']})"
  if samples and show:
    lines.append("")
    lines.append("--- samples (same prompt): policy | reference ---")
    for s in samples[:show]:
      lines.append(f"{s['prompt']}")
      lines.append(f"  policy:    {s['policy']!r}")
      lines.append(f"  reference: {s['reference']!r}")
  if verdict_rows:
    lines.append("")
    lines.append("=== verdict " + "=" * width)
    for v in verdict_rows:
      lines.append(f"{v['verdict']:<5} {v['target']:<26} {v['want']:<16} {_fmt(v['value'])}")
    failed = sum(v["verdict"] == "FAIL" for v in verdict_rows)
    unmeasured = sum(v["verdict"] == "n/a" for v in verdict_rows)
    lines.append(f"{'all measured targets met' if not failed else f'{failed} target(s) failed'}"
                 + (f" ({unmeasured} not measurable on this data)" if unmeasured else ""))
  return "\n".join(lines)

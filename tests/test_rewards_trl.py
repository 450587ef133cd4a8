"""dpo/rewards.py's reward functions by name against TRL 1.16's `trl.rewards`, the oracle: the
same completions (text or one assistant message), solutions and token ids into TRL's function
and into the judge that `--reward_fn=NAME` builds give the same rewards, None where TRL gives
None; the named functions' parameters and their one-line errors."""

import numpy as np
import pytest

import configs
from dpo import judges, rewards
from dpo.data import PreferenceRecord
from dpo.formats import ChatRecord, Message

trl_rewards = pytest.importorskip("trl.rewards")
pytest.importorskip("math_verify")

# Completions that exercise each function's branches: boxed answers right and wrong, fractions,
# units, no LaTeX anchor, reasoning blocks closed, unclosed, nested or missing, empty text.
COMPLETIONS = [
    r"<think>2 + 3 = 5</think> The answer is \boxed{5}.",
    r"<think>2 + 3 = 6</think> The answer is \boxed{6}.",
    r"<think>half of two thirds</think> \boxed{\frac{1}{3}}",
    r"\boxed{0.5}",
    r"<think>no closing tag, \boxed{5}",
    r"<think>a<think>b</think> \boxed{5}",
    "The answer is 5",
    "",
    r"<think>\boxed{5} early</think> then \boxed{7}",
    r"<think>x</think>\n$12\,\text{cm}$",
    r"</think> \boxed{42}",
    r"<think>\n\nlines\n</think>\n\n$\frac{3}{4}$ done",
]
SOLUTIONS = ["5", "5", r"\frac{1}{3}", r"\frac{1}{2}", "5", "5", "5", "5", "7", "12",
             "not math at all", r"$\frac{3}{4}$"]
RNG = np.random.default_rng(0)
IDS = [list(RNG.integers(0, 6 if i % 2 else 50, int(n)))
       for i, n in enumerate(RNG.integers(0, 40, len(COMPLETIONS)))]
IDS[0] = [7, 7, 7, 7, 7, 7]  # fully repetitive
IDS[1] = [1, 2]  # shorter than any n-gram
IDS[2] = list(range(45))  # past every max length here


def _conversational(texts):
  return [[{"role": "assistant", "content": t}] for t in texts]


def ours(spec, texts=COMPLETIONS, ids=IDS, solutions=SOLUTIONS, chat=True, length=None):
  """The judge --reward_fn=spec builds, on the completions of a conversation's prompt (or a
  text prompt), as the GRPO stage calls it: rewards with None as NaN."""
  judge = judges.FunctionJudge(spec, completion_length=length)
  if chat:
    records = [ChatRecord((Message("user", "q"),), (Message("assistant", t),), ())
               for t in texts]
  else:
    records = [PreferenceRecord("q", t, "") for t in texts]
  return judge.score(records, allow_none=True, ids=ids,
                     columns=[{"solution": s} for s in solutions])


def same(mine, theirs):
  theirs = np.array([np.nan if r is None else r for r in theirs], np.float64)
  np.testing.assert_array_equal(np.isnan(mine), np.isnan(theirs))
  np.testing.assert_allclose(mine[~np.isnan(mine)], theirs[~np.isnan(theirs)], rtol=0,
                             atol=1e-12)


def test_accuracy_is_trls():
  theirs = trl_rewards.accuracy_reward(_conversational(COMPLETIONS), SOLUTIONS)
  assert sorted({r for r in theirs if r is not None}) == [0.0, 1.0] and None in theirs
  same(ours("accuracy"), theirs)
  same(ours("accuracy", chat=False), theirs)  # text completions of a text prompt, the same


def test_reasoning_accuracy_is_trls():
  theirs = trl_rewards.reasoning_accuracy_reward(_conversational(COMPLETIONS), SOLUTIONS)
  assert 0.0 in theirs and 1.0 in theirs
  same(ours("reasoning_accuracy"), theirs)
  delimiters = ["</think>", "then"]
  theirs = trl_rewards.reasoning_accuracy_reward(_conversational(COMPLETIONS), SOLUTIONS,
                                                 reasoning_delimiters=delimiters)
  same(ours("reasoning_accuracy(reasoning_delimiters=('</think>', 'then'))"), theirs)


def test_think_format_is_trls():
  theirs = trl_rewards.think_format_reward(_conversational(COMPLETIONS))
  assert 0.0 in theirs and 1.0 in theirs
  same(ours("think_format"), theirs)


@pytest.mark.parametrize("max_len,cache", [(30, 10), (40, 40), (16, 1), (20, 0)])
def test_soft_overlong_punishment_is_trls(max_len, cache):
  theirs = trl_rewards.get_soft_overlong_punishment(max_len, cache)(completion_ids=IDS)
  assert {0.0, -1.0} <= set(theirs) and (cache <= 1 or any(-1 < r < 0 for r in theirs))
  same(ours(f"soft_overlong_punishment(max_completion_len={max_len},soft_punish_cache={cache})"),
       theirs)


def test_soft_overlong_punishment_reads_the_stages_completion_length():
  theirs = trl_rewards.get_soft_overlong_punishment(24, 8)(completion_ids=IDS)
  same(ours("soft_overlong_punishment(soft_punish_cache=8)", length=24), theirs)
  cfg = configs.DEFAULT.replace(stage="sft,grpo", max_completion_length=24,
                                reward_fn="soft_overlong_punishment(soft_punish_cache=8)")
  assert judges.completion_length(cfg) == 24


@pytest.mark.parametrize("n,penalty", [(3, -1.0), (1, -0.5), (2, 0.0)])
def test_repetition_penalty_is_trls(n, penalty):
  theirs = trl_rewards.get_repetition_penalty_reward(n, penalty)(completion_ids=IDS)
  same(ours(f"repetition_penalty(ngram_size={n},max_penalty={penalty})"), theirs)


@pytest.mark.parametrize("max_len", [10, 25])
def test_cosine_scaled_is_trls(max_len):
  theirs = trl_rewards.get_cosine_scaled_reward(max_len)(_conversational(COMPLETIONS), SOLUTIONS,
                                                         IDS)
  assert None in theirs and len(set(theirs)) > 3
  same(ours(f"cosine_scaled(max_len={max_len})"), theirs)
  kw = dict(min_value_wrong=-2.0, max_value_wrong=-0.1, min_value_correct=0.2,
            max_value_correct=3.0)
  theirs = trl_rewards.get_cosine_scaled_reward(max_len, **kw)(_conversational(COMPLETIONS),
                                                               SOLUTIONS, IDS)
  spec = ",".join(f"{k}={v}" for k, v in kw.items())
  same(ours(f"cosine_scaled(max_len={max_len},{spec})"), theirs)


def test_several_named_functions_with_weights_split_at_the_top_level_commas():
  cfg = configs.DEFAULT.replace(
      stage="sft,grpo", reward_fn="accuracy,soft_overlong_punishment(max_completion_len=30,"
      "soft_punish_cache=10),think_format", reward_weights=(1.0, 0.5, 0.25))
  judge = judges.load(cfg, None, None, None)
  assert judge.names == ["accuracy", "soft_overlong_punishment", "think_format"]
  chat = _conversational(COMPLETIONS)
  each = judge.each([ChatRecord((Message("user", "q"),), (Message("assistant", t),), ())
                     for t in COMPLETIONS], ids=IDS,
                    columns=[{"solution": s} for s in SOLUTIONS])
  same(each[:, 0], trl_rewards.accuracy_reward(chat, SOLUTIONS))
  same(each[:, 1], trl_rewards.get_soft_overlong_punishment(30, 10)(completion_ids=IDS))
  same(each[:, 2], trl_rewards.think_format_reward(chat))


def test_a_users_function_in_trls_convention_gets_the_columns_and_ids():
  """A --reward_fn=module:function with a `completions` parameter is called as TRL calls it:
  once a batch, with prompts, completions, completion_ids and the extra columns; TRL's own
  think_format_reward works so."""
  seen = {}

  def fn(prompts, completions, completion_ids, solution, **kwargs):
    seen.update(prompts=prompts, completions=completions, ids=completion_ids,
                solution=solution, extra=sorted(kwargs))
    return [float(len(c)) for c in completion_ids]

  judge = judges.FunctionJudge.wrap(fn)
  records = [PreferenceRecord("q1", "a", ""), PreferenceRecord("q2", "bb", "")]
  out = judge.score(records, ids=[[1], [2, 3]], columns=[{"solution": "1", "level": 2},
                                                         {"solution": "2", "level": 5}])
  assert out.tolist() == [1.0, 2.0]
  assert seen == dict(prompts=["q1", "q2"], completions=["a", "bb"], ids=[[1], [2, 3]],
                      solution=["1", "2"], extra=["level"])
  trl_judge = judges.FunctionJudge("trl.rewards:think_format_reward")
  assert trl_judge.batch
  chats = [ChatRecord((Message("user", "q"),), (Message("assistant", t),), ())
           for t in COMPLETIONS]
  same(trl_judge.score(chats), trl_rewards.think_format_reward(_conversational(COMPLETIONS)))


@pytest.mark.parametrize("spec,message", [
    ("soft_overlong_punishment", "--reward_fn=soft_overlong_punishment: give "
     "soft_overlong_punishment's soft_punish_cache"),
    ("soft_overlong_punishment(soft_punish_cache=-1)", "soft_punish_cache=-1 must be in [0, "
     "max_completion_len=64]"),
    ("repetition_penalty(ngram=2)", "repetition_penalty takes no 'ngram'; its parameters are "
     "ngram_size, max_penalty"),
    ("repetition_penalty(max_penalty=0.5)", "max_penalty=0.5 must be a number <= 0"),
    ("repetition_penalty(3)", "parameters are key=value literals"),
    ("cosine_scaled(max_len=0)", "max_len must be an integer >= 1"),
    ("think_format(x=1", "close the parameters with ')'"),
])
def test_bad_parameters_are_one_line_errors(spec, message):
  with pytest.raises(judges.JudgeError, match="^" + "--reward_fn=" + r"[^\n]*") as e:
    judges.FunctionJudge(spec, completion_length=64)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_a_missing_column_or_ids_is_a_one_line_error():
  records = [PreferenceRecord("q", r"\boxed{1}", "")]
  with pytest.raises(judges.JudgeError, match=r"^--reward_fn=accuracy: needs the data's "
                     r"'solution' column, missing from record 0 \(prompt 'q'\) "
                     r"\(extra columns: level\)$"):
    judges.FunctionJudge("accuracy").score(records, columns=[{"level": 1}])
  with pytest.raises(judges.JudgeError, match=r"^--reward_fn=repetition_penalty: needs the "
                     r"completions' token ids"):
    judges.FunctionJudge("repetition_penalty").score(records)
  # With the run's tokenizer, texts without ids are tokenised and end with the EOS, as a sample
  # that ended does (the held-out pairs' responses are whole).
  import types
  judge = judges.FunctionJudge("soft_overlong_punishment(max_completion_len=4,soft_punish_cache=2)")
  judge.tok = types.SimpleNamespace(encode=lambda t: [ord(c) for c in t], eos_id=0)
  theirs = trl_rewards.get_soft_overlong_punishment(4, 2)(completion_ids=[[97, 98, 0]])
  same(judge.score([PreferenceRecord("q", "ab", "")]), theirs)
  assert theirs == [-0.5]


def test_split_keeps_commas_inside_parentheses():
  assert rewards.split("a:f, soft_overlong_punishment(max_completion_len=8,soft_punish_cache=2),"
                       "think_format") == [
      "a:f", "soft_overlong_punishment(max_completion_len=8,soft_punish_cache=2)",
      "think_format"]
  assert rewards.split("") == []


def test_the_sampling_stages_hand_ids_with_the_stop_token_and_the_prompts_columns():
  """online_dpo.Sampled.scored (GRPO's, RLOO's, online DPO's) calls a reward function in TRL's
  convention with each completion's ids as sampled (its stop token kept, TRL's completion_ids)
  and its prompt row's extra columns, the prompts repeated per sample as the samples are."""
  import types
  from dpo.algorithms import online_dpo
  seen = {}

  def fn(prompts, completions, completion_ids, solution, **kw):
    seen.update(prompts=prompts, completions=completions, ids=completion_ids, solution=solution)
    return [0.0] * len(completions)

  tok = types.SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))
  scfg = types.SimpleNamespace(eos_id=9, stop_ids=())
  s = online_dpo.Sampled(None, None, tok, judges.FunctionJudge.wrap(fn), ["p0", "p1", "p2"],
                         None, scfg, 16, columns=[{"solution": "a"}, {"solution": "b"},
                                                  {"solution": "c"}])
  batch = {"prompt_index": np.array([2, 0])}
  comps = [[1, 9], [2, 3], [4], [5, 9]]  # sample 0 of prompts 2 and 0, then sample 1
  rewards, ended = s.scored(batch, comps)
  assert ended.tolist() == [True, False, False, True]
  assert seen == dict(prompts=["p2", "p0", "p2", "p0"], completions=["1", "2 3", "4", "5"],
                      ids=comps, solution=["c", "a", "c", "a"])

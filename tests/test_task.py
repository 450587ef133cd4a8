"""The embedded task: reward from text, labelled pairs, disjoint held-out prompts."""

from dpo import task


def test_true_reward_counts_adjectives():
  assert task.true_reward(" great coffee, lovely cake, warm staff.") == 1.0
  assert task.true_reward(" rude staff, cold bread, awful music.") == -1.0
  assert abs(task.true_reward(" great coffee, rude staff, lovely cake.") - 1 / 3) < 1e-9
  assert task.true_reward("nonsense words only") == 0.0
  assert task.true_reward("great " * 10) == 1.0  # clipped


def test_pairs_are_labelled_by_true_reward():
  pairs = task.preference_records(300, seed=0)
  assert all(task.true_reward(p.chosen) > task.true_reward(p.rejected) for p in pairs)


def test_held_out_prompts_are_unseen():
  train = {r.prompt for r in task.sft_records(2000, 0)} | {
      r.prompt for r in task.preference_records(2000, 0)}
  held = set(task.eval_prompts(50)) | {r.prompt for r in task.preference_records(200, 0, True)}
  assert held and not (held & train)


def test_sft_data_is_mixed_quality():
  rewards = [task.true_reward(r.completion) for r in task.sft_records(2000, 0)]
  assert -0.1 < sum(rewards) / len(rewards) < 0.1
  assert min(rewards) == -1.0 and max(rewards) == 1.0


def test_deterministic():
  assert task.preference_records(20, 3) == task.preference_records(20, 3)
  assert task.preference_records(20, 3) != task.preference_records(20, 4)


def test_well_formed_accepts_the_grammar_and_refuses_fragments():
  recs = task.preference_records(300, seed=1) + task.preference_records(100, 1, held_out=True)
  assert all(task.well_formed(r.prompt, t) for r in recs for t in (r.chosen, r.rejected))
  prompt = "Review the cafe in Oslo:"
  assert task.well_formed(prompt, " warm coffee, rude staff, fresh bread.")
  for text in (" lovely staff, lold cake, l, lty bread.",  # fragments (a hacked policy's sample)
               " warm coffee, rude staff, fresh bread",  # no final period
               "warm coffee, rude staff, fresh bread.",  # no leading space
               " warm coffee, rude staff, fresh room.",  # a hotel's noun in a cafe
               " warm coffee, lovely lovely staff, fresh bread.",
               " warm coffee, rude staff, fresh bread, great cake.",  # four clauses
               " warm coffee, rude staff.", ""):
    assert not task.well_formed(prompt, text), text
  assert not task.well_formed("Describe the cafe in Oslo:", " warm coffee, rude staff, fresh bread.")

"""A stage's resampling of the curriculum (agents/mixture.py): the Pruner's labels balanced by repetition, a
dedicated stage's share of the other steps, the same for the same seed, bad settings refused by name."""

from __future__ import annotations

from collections import Counter

import pytest
from test_curriculum import CODE_Q, PAGES, generator_config

from agents.curriculum import AgentCurriculum
from agents.mixture import Mixture
from hkrag.rag.records import QueryTruth

# 10 Pruner examples (3 "yes", 7 "no") and 6 answers; index i is the i-th example.
STEPS = ["pruner"] * 10 + ["answer"] * 6
TARGETS = ["yes", "no", "no", "yes", "no", "no", "no", "yes", "no", "no"] + ["A"] * 6
YES = {0, 3, 7}


def counts(indices: list[int]) -> Counter:
    return Counter((STEPS[i], TARGETS[i] if STEPS[i] == "pruner" else None) for i in indices)


def test_nothing_set_keeps_every_example_in_order():
    assert Mixture().apply(STEPS, TARGETS, seed=0) == list(range(16))


def test_balancing_repeats_the_smaller_label_to_the_larger_ones_count():
    chosen = Mixture(balance_pruner=True).apply(STEPS, TARGETS, seed=0)
    # 7 "no" kept once each; 7 "yes" = the 3 twice over (6) + 1 drawn; the 6 answers untouched: 20 in all.
    assert counts(chosen) == {("pruner", "yes"): 7, ("pruner", "no"): 7, ("answer", None): 6}
    per_index = Counter(chosen)
    assert sorted(per_index[i] for i in YES) == [2, 2, 3]
    assert all(per_index[i] == 1 for i in range(16) if i not in YES)
    assert chosen == sorted(chosen)


def test_the_same_seed_gives_the_same_examples_and_seeds_differ():
    mixture = Mixture(balance_pruner=True, focus=("pruner",), others_share=0.125)
    assert mixture.apply(STEPS, TARGETS, seed=3) == mixture.apply(STEPS, TARGETS, seed=3)
    assert len({tuple(mixture.apply(STEPS, TARGETS, seed=seed)) for seed in range(10)}) > 1


@pytest.mark.parametrize(("share", "others"), [(0.0, 0), (0.125, 2), (0.3, 6)])
def test_a_focused_stage_draws_the_other_steps_to_their_share(share, others):
    chosen = Mixture(balance_pruner=True, focus=("pruner",), others_share=share).apply(STEPS, TARGETS, seed=0)
    # 14 balanced Pruner examples; others = round(share × 14 / (1 − share)): 0, 2, 6, so they are share of the total.
    assert counts(chosen) == Counter({("pruner", "yes"): 7, ("pruner", "no"): 7, ("answer", None): others})
    assert len({i for i in chosen if STEPS[i] == "answer"}) == others  # drawn without replacement


def test_a_focus_without_balancing_keeps_the_labels_as_they_are():
    chosen = Mixture(focus=("answer",), others_share=0.25).apply(STEPS, TARGETS, seed=0)
    assert counts(chosen)[("answer", None)] == 6 and len(chosen) == 8  # round(0.25 × 6 / 0.75) = 2 Pruner examples


def test_a_share_the_curriculum_cannot_fill_is_refused_with_the_counts():
    with pytest.raises(ValueError, match="others_share=0.5 asks for 14 examples of the other steps beside 14 focus "
                                         "examples, but the curriculum has 6"):
        Mixture(balance_pruner=True, focus=("pruner",), others_share=0.5).apply(STEPS, TARGETS, seed=0)


def test_balancing_without_one_label_is_refused():
    with pytest.raises(ValueError, match="the Pruner's 2 examples have no 'yes' target"):
        Mixture(balance_pruner=True).apply(["pruner", "pruner"], ["no", "no"], seed=0)


@pytest.mark.parametrize(("settings", "steps", "message"), [
    ({"balance_pruner": True}, ["answer"], r"balance_pruner=true but generator_training.curriculum.steps=\['answer'\] "
                                           "has no 'pruner' step"),
    ({"focus": ["judge"]}, ["pruner", "answer"], r"focus=\['judge'\] names \['judge'\], not in"),
    ({"focus": ["pruner"], "others_share": 1.0}, ["pruner", "answer"], r"share=1.0: expected a share in \[0, 1\)"),
    ({"focus": ["pruner"], "others_share": -0.1}, ["pruner", "answer"], r"others_share=-0.1: expected a share"),
    ({"others_share": 0.2}, ["pruner", "answer"], "others_share=0.2 needs generator_training.curriculum.focus"),
    ({"focus": ["pruner"], "others_share": 0.2}, ["pruner"], "has no step outside"),
])
def test_bad_settings_are_refused_by_name(settings, steps, message):
    with pytest.raises(ValueError, match=message):
        AgentCurriculum(generator_config(), steps, **settings)


def test_the_curriculum_selects_balanced_pruner_examples():
    far = QueryTruth("q-far", CODE_Q.question, CODE_Q.answers, (PAGES[2].key,), "code")
    curriculum = AgentCurriculum(generator_config(), ["pruner", "answer"], balance_pruner=True)
    examples = [example for query in (CODE_Q, far) for example in curriculum.examples(query, query.question, [PAGES])]
    # CODE_Q (relevant page 2nd): n = 1 "no", n = 2 "yes", an answer on the kept 2 pages and on all 3; far (relevant
    # page 3rd): n = 1, 2 "no", kept = all 3 pages, one answer.
    before = Counter((example.step, example.target) for example in examples)
    assert before == {("pruner", "no"): 3, ("pruner", "yes"): 1, ("answer", "K1"): 3}
    after = Counter((example.step, example.target) for example in curriculum.select(examples, seed=0))
    assert after == {("pruner", "no"): 3, ("pruner", "yes"): 3, ("answer", "K1"): 3}

"""Rule metrics against hand-computed values (hkrag/answer_metrics.py)."""

import pytest

from hkrag.answer_metrics import (
    Number,
    anls,
    exact_match,
    levenshtein,
    parse_number,
    relaxed_accuracy,
    rule_metrics,
    token_f1,
)


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("flaw", "lawn") == 2


def test_anls_similarity_below_threshold():
    # kitten -> sitting: 3 edits, longer string 7 characters: NL = 3/7 < 0.5, score 4/7.
    assert anls("kitten", ["sitting"]) == pytest.approx(4 / 7)


def test_anls_zero_at_and_above_threshold():
    assert anls("ab", ["ax"]) == 0.0  # NL = 1/2 = tau exactly: 0, not 0.5
    assert anls("abcd", ["wxyz"]) == 0.0
    assert anls("ab", ["ax"], threshold=0.6) == pytest.approx(0.5)


def test_anls_takes_best_gold_and_normalises_case_and_spaces():
    # "kitten!" is one insertion away from "kitten": 1 - 1/7.
    assert anls("kitten", ["dog", "sitting", "kitten!"]) == pytest.approx(6 / 7)
    assert anls("  New   YORK ", ["new york"]) == 1.0


def test_exact_match_squad_normalisation():
    assert exact_match("The Eiffel Tower.", ["Louvre", "eiffel   tower"]) == 1.0
    assert exact_match("Eiffel", ["eiffel tower"]) == 0.0


def test_token_f1_max_over_gold():
    # tokens [big, red, apple] vs [red, apple, pie]: overlap 2, P = R = 2/3, F1 = 2/3.
    assert token_f1("the big red apple", ["green", "red apple pie"]) == pytest.approx(2 / 3)
    # [red, red] vs [red]: overlap counts multiplicity once: P = 1/2, R = 1, F1 = 2/3.
    assert token_f1("red red", ["red"]) == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("45%", Number(45.0, percent=True)),
        ("1,234,567", Number(1234567.0)),
        ("12 kg", Number(12.0)),
        ("$3.5", Number(3.5)),
        ("-$3.5", Number(-3.5)),
        ("$-3.5", Number(-3.5)),
        ("\u22127", Number(-7.0)),
        (".5", Number(0.5)),
        ("1,234.5 USD", Number(1234.5)),
        ("3,5", None),
        ("12 and 15", None),
        ("The answer is 4", None),
        ("-+3", None),
        ("", None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("104", ["100"], 1.0),  # 4 % off
        ("106", ["100"], 0.0),  # 6 % off
        ("106", ["200", "100", "105"], 1.0),  # any gold answer, not only the first: 1/105 off the last
        ("45%", ["45"], 1.0),  # the percent sign read as a unit
        ("45%", ["0.45"], 1.0),  # ChartQA's reading: 45 % = 0.45
        ("0.46", ["45%"], 1.0),  # 0.46 vs 0.45: 2.2 % off
        ("45", ["0.45"], 0.0),  # no percent sign, no rescaling
        ("1,234", ["1234"], 1.0),
        ("1,300", ["1,234"], 0.0),  # 66/1234 = 5.3 % off
        ("12 kg", ["12"], 1.0),
        ("$3.5", ["3.50"], 1.0),
        ("-5", ["5"], 0.0),
        ("-5", ["\u22125.1"], 1.0),  # 0.1/5.1 = 2 % off
        ("0", ["0"], 1.0),
        ("0.01", ["0"], 0.0),  # a gold 0 needs an exact 0
        ("Up", ["upward", "up"], 1.0),  # non-numeric: exact match
        ("Paris, France", ["paris"], 0.0),
    ],
)
def test_relaxed_accuracy(prediction, gold, expected):
    assert relaxed_accuracy(prediction, gold) == expected


def test_empty_prediction_scores_zero_against_an_answer():
    assert rule_metrics("", ["Paris"]) == {"anls": 0.0, "relaxed_accuracy": 0.0, "exact_match": 0.0, "f1": 0.0}


def test_empty_gold_means_no_answer_expected():
    expected = {"anls": 1.0, "relaxed_accuracy": 1.0, "exact_match": 1.0, "f1": 1.0}
    assert rule_metrics("", [""]) == expected
    assert rule_metrics(" ", []) == expected  # an empty gold list reads as [""]
    assert rule_metrics("Paris", []) == {"anls": 0.0, "relaxed_accuracy": 0.0, "exact_match": 0.0, "f1": 0.0}
    assert rule_metrics("", ["", "Paris"])["exact_match"] == 1.0


def test_gold_must_be_a_list():
    with pytest.raises(TypeError, match="'Paris'"):
        rule_metrics("Paris", "Paris")

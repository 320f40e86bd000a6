"""Rule metrics against hand-computed values (hkrag/rag/metrics.py)."""

import re
import time

import pytest

from hkrag.rag.metrics import (
    Number,
    anls,
    exact_match,
    levenshtein,
    parse_number,
    relaxed_accuracy,
    relaxed_correctness,
    rule_metrics,
    token_f1,
)

ALL_ZERO = {"anls": 0.0, "relaxed_accuracy": 0.0, "relaxed_correctness": 0.0, "exact_match": 0.0, "f1": 0.0}
ALL_ONE = dict.fromkeys(ALL_ZERO, 1.0)


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
        ("45%", Number(45.0, "%")),
        ("45 percent", Number(45.0, "%")),
        ("1,234,567", Number(1234567.0)),
        ("12 kg", Number(12.0, "kg")),
        ("12 KGs", Number(12.0, "kg")),
        ("$3.5", Number(3.5, "usd")),
        ("-$3.5", Number(-3.5, "usd")),
        ("$-3.5", Number(-3.5, "usd")),
        ("3.5 dollars", Number(3.5, "usd")),
        ("\u22127", Number(-7.0)),
        (".5", Number(0.5)),
        ("1,234.5 USD", Number(1234.5, "usd")),
        ("1e3", Number(1000.0)),
        ("2.5E-2", Number(0.025)),
        ("3.5 million", Number(3.5, "", 1e6)),
        ("$3.5bn", Number(3.5, "usd", 1e9)),
        ("12k", Number(12.0, "", 1e3)),
        ("3.5M", Number(3.5, "", 1e6)),
        ("12 m", Number(12.0, "m")),  # a lowercase m is a metre, not a million
        ("3.5 million people", Number(3.5, "people", 1e6)),
        ("3,5", None),
        ("12 and 15", None),
        ("The answer is 4", None),
        ("-+3", None),
        ("", None),
        ("1" * 200, None),  # too long to be one number
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
        ("12 kg", ["12"], 1.0),  # a unit on one side only: the gold omits the unit the question names
        ("12 kg", ["12 g"], 0.0),  # different units: not a numeric match
        ("12 kg", ["12 kgs"], 1.0),
        ("3.5 million", ["3.5 billion"], 0.0),  # scale words on both sides are multiplied
        ("3.5 million", ["3,500,000"], 1.0),  # a scale word on one side: as written or multiplied
        ("3.5 million", ["3.5"], 1.0),
        ("12k", ["12,400"], 1.0),  # 12,000 vs 12,400: 3.2 % off
        ("1e3", ["1000"], 1.0),
        ("1e3", ["100"], 0.0),
        ("3,5", ["35"], 0.0),  # not a number, and the fallback keeps the comma between digits
        ("3,5", ["3,5"], 1.0),
        ("3-5", ["35"], 0.0),
        ("$3.5", ["3.50"], 1.0),
        ("$3.5", ["3.5 USD"], 1.0),
        ("$3.5", ["\u20ac3.5"], 0.0),  # dollars are not euros
        ("45%", ["45 kg"], 0.0),
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


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        # pix2struct: float() of the raw strings; a trailing % divides by 100; else lower-cased string equality
        ("104", ["100"], 1.0),  # |104 - 100| / 100 = 0.04
        ("106", ["100"], 0.0),
        ("106", ["200", "105"], 1.0),  # max over the gold answers: 1/105 off the second
        ("45%", ["0.45"], 1.0),  # 45 / 100 = 0.45
        ("45%", ["45"], 0.0),  # 0.45 vs 45: no "percent as a unit" reading
        ("45", ["0.45"], 0.0),
        ("1e3", ["1000"], 1.0),  # float("1e3")
        (" 12 ", ["12"], 1.0),  # float() ignores surrounding spaces
        ("1,234", ["1234"], 0.0),  # float("1,234") fails: strings differ
        ("12 kg", ["12"], 0.0),  # units are not numbers: strings differ
        ("$3.5", ["3.5"], 0.0),
        ("3.5 million", ["3.5 billion"], 0.0),
        ("0", ["0"], 1.0),  # a gold 0 is falsy: compared as strings
        ("0.0", ["0"], 0.0),
        ("Up", ["up"], 1.0),
        ("Up ", ["up"], 0.0),  # no strip on the string path
        ("The Eiffel Tower", ["the eiffel tower"], 1.0),
        ("Eiffel Tower.", ["eiffel tower"], 0.0),  # no punctuation removal
    ],
)
def test_relaxed_correctness_is_pix2struct(prediction, gold, expected):
    assert relaxed_correctness(prediction, gold) == expected


def test_empty_prediction_scores_zero_against_an_answer():
    assert rule_metrics("", ["Paris"]) == ALL_ZERO


def test_empty_gold_means_no_answer_expected():
    assert rule_metrics("", [""]) == ALL_ONE
    assert rule_metrics("", []) == ALL_ONE  # an empty gold list reads as [""]
    assert rule_metrics(" ", [])["exact_match"] == 1.0
    assert rule_metrics("Paris", []) == ALL_ZERO
    assert rule_metrics("", ["", "Paris"])["exact_match"] == 1.0


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("Paris", "Paris", TypeError("gold answers must be a list of strings, got str: 'Paris'")),
        ("Paris", None, TypeError("gold answers must be a list of strings, got NoneType: None")),
        ("Paris", b"Paris", TypeError("gold answers must be a list of strings, got bytes: b'Paris'")),
        ("Paris", ["Paris", None], TypeError("gold answer 1 must be a string or a finite number, got NoneType: None")),
        ("Paris", [["Paris"]], TypeError("gold answer 0 must be a string or a finite number, got list: ['Paris']")),
        ("12", [True], TypeError("gold answer 0 must be a string or a finite number, got bool: True")),
        ("12", [float("nan")], TypeError("gold answer 0 must be a string or a finite number, got float: nan")),
        (None, ["Paris"], TypeError("the prediction must be a string, got NoneType: None")),
        (12, ["12"], TypeError("the prediction must be a string, got int: 12")),
        (b"Paris", ["Paris"], TypeError("the prediction must be a string, got bytes: b'Paris'")),
        ("12", [12], {**ALL_ONE}),  # numbers as gold answers are read as str(number)
        ("12.5", [12.5], {**ALL_ONE}),
        ("", ["", ""], {**ALL_ONE}),  # empty strings: no answer expected
        ("Paris", ["", "Paris"], {**ALL_ONE}),
        ("caf\udce9", ["caf\udce9"], {**ALL_ONE}),  # undecodable bytes kept as surrogates (errors="surrogateescape")
        ("caf\udce9", ["cafe"], {**ALL_ZERO, "anls": 0.75, "f1": 0.0}),
        ("x" * 1_000_000, ["Paris"], {**ALL_ZERO}),  # huge answer: ANLS stops at the length bound
        ("x" * 5000, ["y" * 5000], ValueError("strings of 5000 and 5000 characters are too long to compare")),
    ],
    ids=lambda value: repr(value)[:30],
)
def test_odd_answer_data_works_or_names_the_input(prediction, gold, expected):
    start = time.perf_counter()
    if isinstance(expected, Exception):
        with pytest.raises(type(expected), match=re.escape(str(expected))):
            rule_metrics(prediction, gold)
    else:
        assert rule_metrics(prediction, gold) == pytest.approx(expected)
    assert time.perf_counter() - start < 2.0

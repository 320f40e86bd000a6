"""Rule-based answer metrics computed beside the LLM judge (DESIGN §8): ANLS, relaxed accuracy, EM, token F1.

Every metric compares one prediction with a list of gold answers and keeps the best match (max over
the gold answers: the answer is right if it matches *any* of them). Definitions:

* ``anls`` — Average Normalized Levenshtein Similarity with the standard threshold τ = 0.5 (DocVQA,
  Biten et al. 2019). Strings are lowercased, stripped and their whitespace collapsed; NL = Levenshtein
  distance / length of the longer string; the score is 1 − NL when NL < τ, else 0.
* ``exact_match`` — SQuAD normalisation (lowercase, punctuation and the articles a/an/the removed,
  whitespace collapsed), then string equality.
* ``f1`` — SQuAD token F1 over the normalised whitespace tokens (bag of tokens with multiplicity).
* ``relaxed_accuracy`` — ChartQA's relaxed correctness: when both the prediction and a gold answer are
  numbers (:func:`parse_number`), correct iff ``|pred − gold| ≤ 5 % · |gold|`` (a gold of 0 needs an exact
  0); otherwise exact match as above.

Empty strings: a gold answer that is empty after normalisation means "no answer expected", and only an
empty prediction matches it (1.0 on every metric); an empty prediction scores 0 against any non-empty gold
answer. An empty gold *list* is read as ``[""]`` (the SQuAD v2 convention for unanswerable questions).
A failed query's answer is ``""`` and the reports count it wrong whatever its gold answers
(:mod:`hkrag.rag_report`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ANLS_THRESHOLD = 0.5
RELATIVE_TOLERANCE = 0.05

ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = str.maketrans("", "", string.punctuation)
CURRENCY = "$€£¥₹"
NUMBER = re.compile(
    rf"""^(?P<sign>[-+−]?)\s*[{CURRENCY}]?\s*(?P<sign2>[-+−]?)
    (?P<digits>\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)
    \s*(?P<unit>%|[^\W\d_][^\W\d]*(?:\s+[^\W\d_][^\W\d]*){{0,2}})?$""",
    re.VERBOSE,
)


def squad_normalize(text: str) -> str:
    """Lowercase; drop punctuation and the articles a/an/the; collapse whitespace (SQuAD v1.1)."""
    text = text.lower().translate(PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def anls_normalize(text: str) -> str:
    """Lowercase, strip and collapse whitespace: the normalisation of the DocVQA ANLS script."""
    return " ".join(text.lower().split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def anls_single(prediction: str, gold: str, threshold: float = ANLS_THRESHOLD) -> float:
    """1 − NL(prediction, gold) when NL < ``threshold``, else 0; two empty strings score 1."""
    prediction, gold = anls_normalize(prediction), anls_normalize(gold)
    longest = max(len(prediction), len(gold))
    if longest == 0:
        return 1.0
    distance = levenshtein(prediction, gold) / longest
    return 1.0 - distance if distance < threshold else 0.0


def exact_match_single(prediction: str, gold: str) -> float:
    return float(squad_normalize(prediction) == squad_normalize(gold))


def f1_single(prediction: str, gold: str) -> float:
    """SQuAD token F1; when either side has no token it is 1 if both are empty, else 0."""
    pred_tokens, gold_tokens = squad_normalize(prediction).split(), squad_normalize(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class Number:
    """A parsed numeric answer; ``percent`` when it was written with a ``%`` sign."""

    value: float
    percent: bool = False

    def candidates(self) -> tuple[float, ...]:
        """Values it may stand for: "45%" is 45 (the sign read as a unit) or 0.45 (ChartQA's reading)."""
        return (self.value, self.value / 100) if self.percent else (self.value,)


def parse_number(text: str) -> Number | None:
    """The number an answer states, or ``None`` when it is not (only) a number.

    Accepts a sign (``-``, ``+`` or the Unicode minus ``−``), one leading currency symbol (``$3.5``,
    ``-$3.5``, ``$-3.5``), thousands separators in groups of three (``1,234,567``; ``3,5`` is not a number),
    decimals (``.5``), and a trailing ``%`` or unit of up to three words (``12 kg``, ``3.5 million`` — units
    are dropped, never converted: "3.5 million" reads as 3.5). Sentences and several numbers
    ("12 and 15") are not numbers.
    """
    match = NUMBER.match(text.strip())
    if match is None or (match["sign"] and match["sign2"]):
        return None
    value = float(match["digits"].replace(",", ""))
    if (match["sign"] or match["sign2"]) in ("-", "−"):
        value = -value
    return Number(value, percent=match["unit"] == "%")


def numbers_close(prediction: Number, gold: Number, tolerance: float = RELATIVE_TOLERANCE) -> bool:
    """Relative error within ``tolerance`` of the gold value, under any reading of a percentage."""
    return any(
        abs(p - g) <= tolerance * abs(g) if g != 0 else p == 0
        for p in prediction.candidates()
        for g in gold.candidates()
    )


def relaxed_single(prediction: str, gold: str, tolerance: float = RELATIVE_TOLERANCE) -> float:
    """Numeric match within ``tolerance`` when both sides are numbers, else exact match."""
    pred_number, gold_number = parse_number(prediction), parse_number(gold)
    if pred_number is not None and gold_number is not None:
        return float(numbers_close(pred_number, gold_number, tolerance))
    return exact_match_single(prediction, gold)


def best_over_gold(single: Callable[[str, str], float], prediction: str, gold: Sequence[str]) -> float:
    """The best score of ``prediction`` against any gold answer (an empty list reads as ``[""]``)."""
    if isinstance(gold, str):
        raise TypeError(f"gold answers must be a list of strings, got the string {gold!r}")
    return max(single(prediction, answer) for answer in (list(gold) or [""]))


def anls(prediction: str, gold: Sequence[str], threshold: float = ANLS_THRESHOLD) -> float:
    return best_over_gold(lambda p, g: anls_single(p, g, threshold), prediction, gold)


def exact_match(prediction: str, gold: Sequence[str]) -> float:
    return best_over_gold(exact_match_single, prediction, gold)


def token_f1(prediction: str, gold: Sequence[str]) -> float:
    return best_over_gold(f1_single, prediction, gold)


def relaxed_accuracy(prediction: str, gold: Sequence[str], tolerance: float = RELATIVE_TOLERANCE) -> float:
    return best_over_gold(lambda p, g: relaxed_single(p, g, tolerance), prediction, gold)


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "anls": anls,
    "relaxed_accuracy": relaxed_accuracy,
    "exact_match": exact_match,
    "f1": token_f1,
}


def rule_metrics(prediction: str, gold: Sequence[str]) -> dict[str, float]:
    """Every rule metric of one answer: ``{"anls", "relaxed_accuracy", "exact_match", "f1"}``."""
    return {name: metric(prediction, gold) for name, metric in METRICS.items()}

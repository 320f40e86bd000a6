"""Rule-based answer metrics beside the LLM judge (docs/evaluation.md): ANLS, two relaxed accuracies, EM, token F1.

Every metric compares one prediction with a list of gold answers and keeps the best match (max over
the gold answers: the answer is right if it matches *any* of them). Definitions:

* ``anls`` — Average Normalized Levenshtein Similarity with the standard threshold τ = 0.5 (DocVQA,
  Biten et al. 2019). Strings are lowercased, stripped and their whitespace collapsed; NL = Levenshtein
  distance / length of the longer string; the score is 1 − NL when NL < τ, else 0.
* ``exact_match`` — SQuAD normalisation (lowercase, punctuation and the articles a/an/the removed,
  whitespace collapsed), then string equality.
* ``f1`` — SQuAD token F1 over the normalised whitespace tokens (bag of tokens with multiplicity).
* ``relaxed_accuracy`` — our *lenient* reading of ChartQA's relaxed accuracy: answers are read as numbers
  with units (:func:`parse_number`); two numbers whose units agree match when
  ``|pred − gold| ≤ 5 % · |gold|`` (a gold of 0 needs an exact 0); anything else needs an exact match
  under SQuAD normalisation that keeps punctuation between digits ("3,5" ≠ "35").
* ``relaxed_correctness`` — the *strict* ChartQA metric exactly as pix2struct computes it
  (:func:`relaxed_correctness_single`): ``float()`` of the raw strings, no units, no normalisation.

Empty strings: a gold answer that is empty after normalisation means "no answer expected", and only an
empty prediction matches it (1.0 on every metric); an empty prediction scores 0 against any non-empty gold
answer. An empty gold *list* is read as ``[""]`` (the SQuAD v2 convention for unanswerable questions).
A failed query's answer is ``""`` and the reports count it wrong whatever its gold answers
(:mod:`hkrag.rag.report`). Inputs are checked (:func:`check_inputs`): the prediction must be a string, the
gold answers a list of strings or numbers (numbers are read as ``str(number)``); anything else raises a
``TypeError`` naming the input.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ANLS_THRESHOLD = 0.5
RELATIVE_TOLERANCE = 0.05
MAX_NUMBER_CHARS = 80
"""Longer answers are never read as one number (a bound on the regex's work on huge answers)."""
MAX_EDIT_CELLS = 10_000_000
"""Levenshtein table cells at most (about 3 s in Python); a larger comparison raises ``ValueError``."""

ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = str.maketrans("", "", string.punctuation)
STRAY_PUNCTUATION = re.compile(rf"(?<!\d)[{re.escape(string.punctuation)}]|[{re.escape(string.punctuation)}](?!\d)")
CURRENCIES = {"$": "usd", "€": "eur", "£": "gbp", "¥": "¥", "₹": "inr"}
UNIT_ALIASES = {"dollar": "usd", "euro": "eur", "yen": "¥", "yuan": "¥", "jpy": "¥", "cny": "¥", "rmb": "¥",
                "rupee": "inr", "percent": "%", "pct": "%"}
SCALES = {"thousand": 1e3, "million": 1e6, "mn": 1e6, "mln": 1e6, "billion": 1e9, "bn": 1e9,
          "trillion": 1e12, "tn": 1e12}
"""Scale words, matched case-insensitively."""
SCALE_LETTERS = {"k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9}
"""Scale letters, matched case-sensitively: a lowercase ``m`` is a metre and a lowercase ``b`` a unit too."""
NUMBER = re.compile(
    rf"""^(?P<sign>[-+−]?)\s*(?P<currency>[{''.join(CURRENCIES)}]?)\s*(?P<sign2>[-+−]?)
    (?P<digits>\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?P<exponent>[eE][-+]?\d+)?
    \s*(?P<unit>%|[^\W\d_][^\W\d]*(?:\s+[^\W\d_][^\W\d]*){{0,2}})?$""",
    re.VERBOSE,
)


def squad_normalize(text: str) -> str:
    """Lowercase; drop punctuation and the articles a/an/the; collapse whitespace (SQuAD v1.1)."""
    text = text.lower().translate(PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def relaxed_normalize(text: str) -> str:
    """:func:`squad_normalize`, but punctuation between two digits is kept: "3,5" and "3-5" do not read "35"."""
    text = STRAY_PUNCTUATION.sub("", text.lower())
    return " ".join(ARTICLES.sub(" ", text).split())


def anls_normalize(text: str) -> str:
    """Lowercase, strip and collapse whitespace: the normalisation of the DocVQA ANLS script."""
    return " ".join(text.lower().split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    if len(a) * len(b) > MAX_EDIT_CELLS:
        raise ValueError(f"strings of {len(a)} and {len(b)} characters are too long to compare "
                         f"(more than {MAX_EDIT_CELLS} edit cells): {a[:40]!r}… and {b[:40]!r}…")
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def anls_single(prediction: str, gold: str, threshold: float = ANLS_THRESHOLD) -> float:
    """1 − NL(prediction, gold) when NL < ``threshold``, else 0; two empty strings score 1.

    The distance is at least the difference of the lengths, so a pair whose lengths alone put NL at or
    above ``threshold`` scores 0 without computing it (a huge answer against a short gold costs nothing).
    """
    prediction, gold = anls_normalize(prediction), anls_normalize(gold)
    longest = max(len(prediction), len(gold))
    if longest == 0:
        return 1.0
    if abs(len(prediction) - len(gold)) / longest >= threshold:
        return 0.0
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
    """A parsed numeric answer: its value as written, a scale word's factor and its canonical unit.

    ``unit`` is ``""`` (none), ``"%"``, a currency code (``usd``) and/or the unit words ("kg",
    "usd per hour"); ``scale`` is 1 unless a scale word followed the digits ("3.5 million": 3.5, 1e6).
    """

    value: float
    unit: str = ""
    scale: float = 1.0

    def readings(self, other: Number) -> tuple[float, ...]:
        """The values this number may stand for when compared with ``other``.

        A ``%`` or a scale word on this side only is read both ways: "45%" is 45 (the sign read as a unit)
        or 0.45 (ChartQA's reading); "3.5 million" is 3.5 (a chart labelled "in millions") or 3,500,000.
        When both sides carry a scale word, only the multiplied values are compared ("3.5 million" ≠
        "3.5 billion").
        """
        if self.unit == "%" and other.unit != "%":
            return self.value, self.value / 100
        if self.scale != 1 and other.scale == 1:
            return self.value, self.value * self.scale
        return (self.value * self.scale,)


def _unit_word(word: str) -> str:
    """A unit word in canonical form: lowercase, a plural ``s`` dropped ("kgs", "dollars"), aliases mapped."""
    word = word.lower()
    if len(word) > 2 and word.endswith("s"):
        word = word[:-1]
    return UNIT_ALIASES.get(word, word)


def _scale_and_unit(currency: str, unit: str) -> tuple[float, str]:
    """The scale factor of a leading scale word and the canonical unit of what remains."""
    words = unit.split()
    scale = 1.0
    if words and (words[0] in SCALE_LETTERS or words[0].lower() in SCALES):
        scale = SCALE_LETTERS.get(words[0]) or SCALES[words[0].lower()]
        words = words[1:]
    names = [CURRENCIES[currency]] if currency else []
    names += [_unit_word(word) for word in words] if unit != "%" else ["%"]
    return scale, " ".join(dict.fromkeys(names))


def parse_number(text: str) -> Number | None:
    """The number an answer states, or ``None`` when it is not (only) a number.

    Accepts a sign (``-``, ``+`` or the Unicode minus ``−``), one leading currency symbol (``$3.5``,
    ``-$3.5``, ``$-3.5``), thousands separators in groups of three (``1,234,567``; ``3,5`` is not a number),
    decimals (``.5``), an exponent (``1e3``, ``2.5E-4``), and a trailing ``%`` or unit of up to three words
    (``12 kg``, ``3.5 million USD``). A leading scale word (:data:`SCALES`, :data:`SCALE_LETTERS`) becomes
    ``scale``, the rest the unit. Sentences and several numbers ("12 and 15") are not numbers.
    """
    text = text.strip()
    match = NUMBER.match(text) if len(text) <= MAX_NUMBER_CHARS else None
    if match is None or (match["sign"] and match["sign2"]):
        return None
    value = float(match["digits"].replace(",", "") + (match["exponent"] or ""))
    if (match["sign"] or match["sign2"]) in ("-", "−"):
        value = -value
    scale, unit = _scale_and_unit(match["currency"], match["unit"] or "")
    return Number(value, unit, scale)


def units_agree(a: Number, b: Number) -> bool:
    """Equal units, or a unit on one side only (a gold answer often omits the unit the question names)."""
    return not a.unit or not b.unit or a.unit == b.unit


def numbers_close(prediction: Number, gold: Number, tolerance: float = RELATIVE_TOLERANCE) -> bool:
    """Units agree and the relative error is within ``tolerance`` of the gold value under some reading."""
    return units_agree(prediction, gold) and any(
        abs(p - g) <= tolerance * abs(g) if g != 0 else p == 0
        for p in prediction.readings(gold)
        for g in gold.readings(prediction)
    )


def relaxed_single(prediction: str, gold: str, tolerance: float = RELATIVE_TOLERANCE) -> float:
    """Numeric match within ``tolerance`` when both sides are numbers, else exact match keeping digit punctuation."""
    pred_number, gold_number = parse_number(prediction), parse_number(gold)
    if pred_number is not None and gold_number is not None:
        return float(numbers_close(pred_number, gold_number, tolerance))
    return float(relaxed_normalize(prediction) == relaxed_normalize(gold))


def pix2struct_float(text: str) -> float | None:
    """pix2struct's number reading: a text ending in ``%`` loses every trailing ``%`` and is divided by 100;
    the rest goes to Python's ``float()`` as is (so ``" 12 "``, ``"1e3"``, ``"1_000"`` and ``"nan"`` are
    numbers, ``"1,000"`` and ``"$12"`` are not); ``None`` when ``float()`` refuses it."""
    try:
        return float(text.rstrip("%")) / 100 if text.endswith("%") else float(text)
    except ValueError:
        return None


def relaxed_correctness_single(prediction: str, gold: str, tolerance: float = RELATIVE_TOLERANCE) -> float:
    """ChartQA's relaxed correctness exactly as pix2struct's ``metrics.relaxed_correctness`` defines it.

    With ``p = pix2struct_float(prediction)`` and ``g = pix2struct_float(gold)``: when ``p`` is a number
    and ``g`` is a non-zero number (``g`` truthy, so a gold ``0`` is compared as text), correct iff
    ``|p − g| / |g| ≤ tolerance``; otherwise correct iff ``prediction.lower() == gold.lower()`` (no strip,
    no other normalisation). Over several gold answers the best is kept, as pix2struct's
    ``aggregate_metrics`` does with ``max``.
    """
    p, g = pix2struct_float(prediction), pix2struct_float(gold)
    if p is not None and g:
        return float(abs(p - g) / abs(g) <= tolerance)
    return float(prediction.lower() == gold.lower())


def _gold_text(answer: object, index: int) -> str:
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer):
        return str(answer)
    raise TypeError(f"gold answer {index} must be a string or a finite number, got {type(answer).__name__}: "
                    f"{answer!r:.80}")


def check_inputs(prediction: object, gold: object) -> tuple[str, list[str]]:
    """The prediction and gold answers as strings; ``TypeError`` naming the input that is neither."""
    if not isinstance(prediction, str):
        raise TypeError(f"the prediction must be a string, got {type(prediction).__name__}: {prediction!r:.80}")
    if isinstance(gold, (str, bytes)) or not isinstance(gold, Sequence):
        raise TypeError(f"gold answers must be a list of strings, got {type(gold).__name__}: {gold!r:.80}")
    return prediction, [_gold_text(answer, i) for i, answer in enumerate(gold)]


def best_over_gold(single: Callable[[str, str], float], prediction: str, gold: Sequence[str]) -> float:
    """The best score of ``prediction`` against any gold answer (an empty list reads as ``[""]``)."""
    prediction, answers = check_inputs(prediction, gold)
    return max(single(prediction, answer) for answer in (answers or [""]))


def anls(prediction: str, gold: Sequence[str], threshold: float = ANLS_THRESHOLD) -> float:
    return best_over_gold(lambda p, g: anls_single(p, g, threshold), prediction, gold)


def exact_match(prediction: str, gold: Sequence[str]) -> float:
    return best_over_gold(exact_match_single, prediction, gold)


def token_f1(prediction: str, gold: Sequence[str]) -> float:
    return best_over_gold(f1_single, prediction, gold)


def relaxed_accuracy(prediction: str, gold: Sequence[str], tolerance: float = RELATIVE_TOLERANCE) -> float:
    """The lenient reading (units compared, scale words and ``%`` read both ways); see the module docstring."""
    return best_over_gold(lambda p, g: relaxed_single(p, g, tolerance), prediction, gold)


def relaxed_correctness(prediction: str, gold: Sequence[str], tolerance: float = RELATIVE_TOLERANCE) -> float:
    """The strict ChartQA / pix2struct metric (:func:`relaxed_correctness_single`), best over the gold answers."""
    return best_over_gold(lambda p, g: relaxed_correctness_single(p, g, tolerance), prediction, gold)


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "anls": anls,
    "relaxed_accuracy": relaxed_accuracy,
    "relaxed_correctness": relaxed_correctness,
    "exact_match": exact_match,
    "f1": token_f1,
}


def rule_metrics(prediction: str, gold: Sequence[str]) -> dict[str, float]:
    """Every rule metric of one answer: ``{"anls", "relaxed_accuracy", "relaxed_correctness", "exact_match", "f1"}``."""
    return {name: metric(prediction, gold) for name, metric in METRICS.items()}

"""The LLM judge of answer accuracy (paper §4 "Unified evaluation metrics", following ViDoRAG; DESIGN §8).

A text-only request to any :class:`~hkrag.lvlm.base.LVLMBackend` (Qwen-plus through DashScope's
OpenAI-compatible mode in the paper, a vLLM server, or a local model) scores an answer 1–5 against the
gold answers at temperature 0; **correct ⇔ score ≥ 4** (5 = fully correct, 4 = correct but less concise).

Failure handling, so that no sample is ever dropped or loops forever:

* unparseable output (no score, a score outside 1–5, a fractional or several different scores) is asked
  again with a repair turn, at most ``max_attempts`` calls in all; then the sample counts as wrong with
  ``status="unparseable"`` and the parser's reason in ``error``;
* a backend error (an :class:`~hkrag.lvlm.base.LVLMError` left after the backend's own retries, e.g. a
  server answering 500) makes the sample judge-failed: wrong, ``status="backend_error"``, the run goes on;
* an empty answer (a failed query) scores 1 without a call (``status="empty_answer"``).

Every raw judge reply is kept in ``raw``. Verdicts are cached in memory by the request fingerprint
(the same answer to the same question in two pools is judged once); the OpenAI backend also keeps its
replies on disk (``cache_dir``), and a resumed run reads finished verdicts from its trace.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from hkrag.lvlm import build_backend
from hkrag.lvlm.base import GenerationSettings, LVLMBackend, LVLMError, LVLMRequest, Message

logger = logging.getLogger(__name__)

RUBRIC_VERSION = "vidorag-1to5-v1"
CORRECT_AT = 4
SCORES = range(1, 6)

SYSTEM_PROMPT = "You grade answers to questions about documents. You are strict, consistent and brief."

RUBRIC = """Grade the candidate answer against the reference answers.

Question: {question}
Reference answers (matching any one of them is enough):
{gold}
Candidate answer: {answer}

Rubric (an integer from 1 to 5):
5 = fully correct: gives the reference answer or an exact equivalent (same value, entity or list), concisely.
4 = correct but less concise: contains the correct answer with unnecessary extra content.
3 = partially correct: part of the answer is right, or it is imprecise (a rounded value, an incomplete list).
2 = mostly incorrect: on topic, but the essential answer is wrong.
1 = incorrect, unrelated, or no answer.
Grade only the final answer, not any reasoning. Ignore differences of case, punctuation and formatting.

Reply with one line "Score: N" (N from 1 to 5), then at most one sentence of justification."""

REPAIR = 'Your reply could not be read as one score ({reason}). Reply with exactly one line "Score: N", N from 1 to 5.'

NUMBER = r"(-?\d+(?:\.\d+)?)"
SEPARATOR = r"""[\s:=*"'`]"""
LABELLED = re.compile(
    rf"\b(?:score|rating|grade)\b{SEPARATOR}{{0,6}}(?:is\s+|of\s+)?{SEPARATOR}{{0,3}}{NUMBER}(\s*(?:or|to|and|-|–)\s*\d)?",
    re.I,
)
EXPLICIT = (
    re.compile(rf"(?<![\w.]){NUMBER}\s*(?:/\s*5|out\s+of\s+5)\b", re.I),  # 4/5, 4 out of 5
    re.compile(rf"\*\*\s*{NUMBER}\s*\*\*"),  # **4**
)
LEADING = re.compile(rf"^[\s*#>`'\"(\[]*{NUMBER}")


class ScoreParseError(ValueError):
    """A judge reply that holds no single valid score; the message says why."""


def parse_score(text: str) -> int:
    """The 1–5 score a judge reply states.

    Explicit notations are read first: labelled ("Score: 4", "**Score:** 4", JSON ``{"score": 4}``,
    "rating is 4"), "4/5", "4 out of 5" and "**4**"; they must all agree. Failing those, a reply that starts
    with a number ("4", "4. The answer ...") gives that number. Bare numbers inside an explanation are
    never taken. Raises :class:`ScoreParseError` for no score, several different scores ("Score: 4 or 5",
    "Score: 3 ... Score: 5"), fractional or out-of-range scores.
    """
    explicit: list[str] = []
    for match in LABELLED.finditer(text):
        if match[2]:
            raise ScoreParseError(f"a range of scores {match[0].strip()!r}")
        explicit.append(match[1])
    explicit += [m[1] for pattern in EXPLICIT for m in pattern.finditer(text)]
    leading = LEADING.match(text)
    found = explicit or ([leading[1]] if leading else [])
    if not found:
        raise ScoreParseError("no score found")
    values = {float(value) for value in found}
    if len(values) > 1:
        raise ScoreParseError(f"several different scores: {', '.join(sorted(set(found)))}")
    value = values.pop()
    if not value.is_integer() or int(value) not in SCORES:
        raise ScoreParseError(f"score {found[0]} is not an integer from 1 to 5")
    return int(value)


def format_gold(gold: Sequence[str]) -> str:
    return "\n".join(f"- {answer}" for answer in gold) if gold else "- (none: the question has no answer)"


class Judge:
    """Scores answers 1–5 with an LLM through ``backend``; see the module docstring for failure handling.

    Args:
        backend: any LVLM backend; it gets text-only requests at temperature 0.
        max_attempts: calls per sample at most (the first plus repair turns on unparseable output).
        max_new_tokens: the reply budget (a score and one sentence).
    """

    def __init__(self, backend: LVLMBackend, max_attempts: int = 3, max_new_tokens: int = 128) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.backend, self.max_attempts = backend, max_attempts
        self.settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0)
        self.cache: dict[str, dict[str, Any]] = {}

    def describe(self) -> dict[str, Any]:
        """What judged the run, for the report: backend kind, model, rubric version, attempts."""
        return {"backend": self.backend.name, "model": self.backend.model, "rubric": RUBRIC_VERSION,
                "max_attempts": self.max_attempts, "temperature": self.settings.temperature}

    def messages(self, question: str, gold: Sequence[str], answer: str) -> list[Message]:
        prompt = RUBRIC.format(question=question.strip(), gold=format_gold(gold), answer=answer.strip())
        return [Message("system", [SYSTEM_PROMPT]), Message("user", [prompt])]

    def judge(self, question: str, gold: Sequence[str], answer: str) -> dict[str, Any]:
        """``{"score", "correct", "raw", "attempts", "error", "status", "model", "rubric"}`` for one answer.

        ``score`` is ``None`` when no valid score was obtained; ``correct`` is then ``False``.
        """
        if not answer.strip():
            return self._verdict(1, [], 0, "empty_answer")
        messages = self.messages(question, gold, answer)
        key = LVLMRequest(messages, self.settings).fingerprint(self.backend.model)
        if key not in self.cache:
            verdict = self._ask(messages)
            if verdict["status"] == "backend_error":
                return verdict
            self.cache[key] = verdict
        return {**self.cache[key], "raw": list(self.cache[key]["raw"])}

    def _ask(self, messages: list[Message]) -> dict[str, Any]:
        raw: list[str] = []
        reason = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                reply = self.backend(LVLMRequest(messages, self.settings)).text
            except LVLMError as error:
                logger.warning("judge call failed (%s: %s); the sample counts as wrong", type(error).__name__, error)
                return self._verdict(None, raw, attempt, "backend_error", f"{type(error).__name__}: {error}")
            raw.append(reply)
            try:
                return self._verdict(parse_score(reply), raw, attempt, "ok")
            except ScoreParseError as error:
                reason = str(error)
            messages = [*messages, Message("assistant", [reply]), Message("user", [REPAIR.format(reason=reason)])]
        logger.warning("judge output unparseable after %d attempts (%s); the sample counts as wrong", len(raw), reason)
        return self._verdict(None, raw, len(raw), "unparseable", f"unparseable after {len(raw)} attempts: {reason}")

    def _verdict(
        self, score: int | None, raw: list[str], attempts: int, status: str, error: str | None = None
    ) -> dict[str, Any]:
        return {"score": score, "correct": score is not None and score >= CORRECT_AT, "raw": raw,
                "attempts": attempts, "error": error, "status": status, "model": self.backend.model,
                "rubric": RUBRIC_VERSION}


def build_judge(cfg: Mapping[str, Any] | None) -> Judge | None:
    """The judge of config group ``judge`` or ``None`` when disabled (``judge: none``: no ``backend``).

    ``cfg["backend"]`` holds :func:`hkrag.lvlm.build_backend`'s arguments (``kind`` plus the backend's own);
    the other keys are :class:`Judge`'s.
    """
    if not cfg or not cfg.get("backend"):
        return None
    settings = dict(cfg)
    backend = build_backend(**settings.pop("backend"))
    return Judge(backend, **settings)

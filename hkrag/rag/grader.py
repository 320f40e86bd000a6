"""The LLM judge of answer accuracy (paper §4 "Unified evaluation metrics", following ViDoRAG; docs/evaluation.md).

A text-only request to any :class:`~hkrag.lvlm.base.LVLMBackend` (Qwen-plus through DashScope's
OpenAI-compatible mode in the paper, a vLLM server, or a local model) scores an answer 1–5 against the
gold answers at temperature 0; **correct ⇔ score ≥ 4**.

Rubrics (``judge.rubric``):

* ``llamaindex`` (default) — the paper's protocol: ViDoRAG evaluates with LlamaIndex's
  ``CorrectnessEvaluator``, whose templates ``DEFAULT_SYSTEM_TEMPLATE`` / ``DEFAULT_USER_TEMPLATE`` (module
  ``llama_index.core.evaluation.correctness``) are imported from the installed ``llama-index-core`` at run
  time, never re-worded (1 = not relevant; 2–3 relevant with mistakes; 4–5 relevant and fully correct).
  The judge puts the score alone on the first line, possibly fractional (``4.5``): :func:`parse_first_line_score`.
* ``hkrag`` — our own re-worded 1–5 rubric (``Score: N``, integers only): :func:`parse_score`.

Every verdict records the rubric's name and version, and what judging cost (:class:`GraderCost`: calls,
prompt / completion tokens, latency), apart from the generator's cost.

Failure handling, so that no sample is ever dropped or loops forever (ViDoRAG retries until it parses):

* an unusable reply (non-text, longer than ``max_reply_chars``, no score, several scores, a score out of
  range) is asked again with a repair turn, at most ``max_attempts`` calls in all; then the sample counts as
  wrong with ``status="unparseable"`` and the reason in ``error``;
* a backend error (an :class:`~hkrag.lvlm.base.LVLMError` left after the backend's own retries, e.g. a
  server answering 500) makes the sample judge-failed: wrong, ``status="backend_error"``, the run goes on;
* an empty answer (a failed query) scores 1 without a call (``status="empty_answer"``).

Every raw judge reply is kept in ``raw`` (a huge one truncated). Verdicts are cached in memory by the
request fingerprint (the same answer to the same question in two pools is judged once; the second verdict
has ``reused=True`` and zero cost); the OpenAI backend also keeps its replies on disk (``cache_dir``), and a
resumed run reads finished verdicts from its trace.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hkrag.lvlm import build_backend
from hkrag.lvlm.base import GenerationSettings, LVLMBackend, LVLMError, LVLMRequest, Message

logger = logging.getLogger(__name__)

CORRECT_AT = 4
SCORES = range(1, 6)
MAX_REPLY_CHARS = 10_000
DEFAULT_RUBRIC = "llamaindex"
NO_REFERENCE = "(NO REFERENCE ANSWER SUPPLIED)"
"""What LlamaIndex's ``CorrectnessEvaluator`` sends as the reference when it has none (an empty gold list)."""
SEVERAL_REFERENCES = "Any one of these answers is correct:"

HKRAG_VERSION = "hkrag-1to5-v1"
HKRAG_SYSTEM = "You grade answers to questions about documents. You are strict, consistent and brief."
HKRAG_USER = """Grade the candidate answer against the reference answers.

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
HKRAG_REPAIR = ('Your reply could not be read as one score ({reason}). Reply with exactly one line "Score: N", '
                "N from 1 to 5.")
LLAMAINDEX_REPAIR = ("Your reply could not be read ({reason}). Reply again: the score alone on the first line "
                     "(a number from 1 to 5), then your reasoning on a separate line.")

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
FIRST_LINE = re.compile(rf"^(?:score\s*[:=]?\s*)?{NUMBER}$", re.I)
DECORATION = "*#>`'\" \t"


class ScoreParseError(ValueError):
    """A judge reply that holds no single valid score; the message says why."""


def parse_score(text: str) -> int:
    """The 1–5 score of a reply to the ``hkrag`` rubric.

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


def parse_first_line_score(text: str) -> float:
    """The score of a reply to the ``llamaindex`` rubric: a number from 1 to 5 alone on the first non-blank line.

    As the template asks ("a line with only the score", example ``4.0``); LlamaIndex itself reads
    ``float(first line)``. We also accept markdown emphasis around it (``**4.0**``) and a ``Score:`` label.
    Raises :class:`ScoreParseError` for an empty reply, a first line that is not one number ("4 or 5",
    "4. Correct"), a score outside [1, 5], or a later line that states a different labelled score
    ("Score: 5" after a first line of 4).
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ScoreParseError("no score found (empty reply)")
    first = lines[0].strip(DECORATION)
    match = FIRST_LINE.match(first)
    if match is None:
        numbers = re.findall(NUMBER, first)
        if not numbers:
            raise ScoreParseError(f"no score on the first line {first[:60]!r}")
        if len(set(numbers)) > 1:
            raise ScoreParseError(f"several scores on the first line: {', '.join(numbers)}")
        raise ScoreParseError(f"the first line must hold only the score, got {first[:60]!r}")
    score = float(match[1])
    if not 1 <= score <= 5:
        raise ScoreParseError(f"score {match[1]} is outside 1 to 5")
    later = sorted({m[1] for m in LABELLED.finditer("\n".join(lines[1:])) if float(m[1]) != score})
    if later:
        raise ScoreParseError(f"several different scores: {match[1]}, {', '.join(later)}")
    return score


def format_gold(gold: Sequence[str]) -> str:
    return "\n".join(f"- {answer}" for answer in gold) if gold else "- (none: the question has no answer)"


def llamaindex_reference(gold: Sequence[str]) -> str:
    """The ``{reference_answer}`` of the LlamaIndex template: the gold answer itself when there is one;
    several are listed one per line after "Any one of these answers is correct:"; none gives LlamaIndex's
    own ``(NO REFERENCE ANSWER SUPPLIED)``."""
    if not gold:
        return NO_REFERENCE
    if len(gold) == 1:
        return gold[0]
    return SEVERAL_REFERENCES + "\n" + "\n".join(f"- {answer}" for answer in gold)


@dataclass(frozen=True)
class Rubric:
    """A judging protocol: templates, how the question / gold / answer fill them, the reply parser, the repair turn.

    ``system`` is sent verbatim; ``user`` is filled by ``str.format`` with ``fields(question, gold, answer)``.
    """

    name: str
    version: str
    system: str
    user: str
    fields: Callable[[str, Sequence[str], str], dict[str, str]]
    parse: Callable[[str], float]
    repair: str

    def messages(self, question: str, gold: Sequence[str], answer: str) -> list[Message]:
        prompt = self.user.format(**self.fields(question.strip(), [str(g) for g in gold], answer.strip()))
        return [Message("system", [self.system]), Message("user", [prompt])]


def _text_hash(*texts: str) -> str:
    return hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:12]


@functools.cache
def llamaindex_rubric() -> Rubric:
    """The default rubric: LlamaIndex's correctness templates, imported from the installed ``llama-index-core``."""
    try:
        from llama_index.core.evaluation.correctness import DEFAULT_SYSTEM_TEMPLATE, DEFAULT_USER_TEMPLATE
    except ImportError as error:
        raise ImportError(
            "judge.rubric=llamaindex (the default, the paper's protocol) reads its template from the "
            "llama-index-core package, which is not installed: pip install -e '.[judge]' (or "
            "pip install llama-index-core), or choose our own rubric with judge.rubric=hkrag"
        ) from error
    version = (f"llama-index-core=={importlib.metadata.version('llama-index-core')} "
               f"sha256:{_text_hash(DEFAULT_SYSTEM_TEMPLATE, DEFAULT_USER_TEMPLATE)}")
    return Rubric(
        "llamaindex", version, DEFAULT_SYSTEM_TEMPLATE, DEFAULT_USER_TEMPLATE,
        lambda q, g, a: {"query": q, "reference_answer": llamaindex_reference(g), "generated_answer": a},
        parse_first_line_score, LLAMAINDEX_REPAIR,
    )


def hkrag_rubric() -> Rubric:
    """Our re-worded rubric (kept as an option; it moves scores at the 3/4 boundary against the paper's)."""
    return Rubric("hkrag", HKRAG_VERSION, HKRAG_SYSTEM, HKRAG_USER,
                  lambda q, g, a: {"question": q, "gold": format_gold(g), "answer": a}, parse_score, HKRAG_REPAIR)


RUBRICS: dict[str, Callable[[], Rubric]] = {"llamaindex": llamaindex_rubric, "hkrag": hkrag_rubric}


def load_rubric(name: str) -> Rubric:
    if name not in RUBRICS:
        raise ValueError(f"judge.rubric must be one of {sorted(RUBRICS)}, got {name!r}")
    return RUBRICS[name]()


@dataclass
class GraderCost:
    """What judging one sample cost: backend calls (``cached_calls`` of them answered from a disk cache),
    prompt / completion tokens as the backend reports them, and wall seconds spent in calls."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    cached_calls: int = 0

    def add(self, result: object, seconds: float) -> None:
        """Count one call that took ``seconds``; ``result`` is ``None`` for a call that raised."""
        self.calls += 1
        self.latency_s += seconds
        self.prompt_tokens += int(getattr(result, "prompt_tokens", 0) or 0)
        self.completion_tokens += int(getattr(result, "completion_tokens", 0) or 0)
        self.cached_calls += bool(getattr(result, "cached", False))


class Grader:
    """Scores answers 1–5 with an LLM through ``backend``; see the module docstring for failure handling.

    Args:
        backend: any LVLM backend; it gets text-only requests at temperature 0.
        rubric: ``"llamaindex"`` (the paper's protocol, needs ``llama-index-core``) or ``"hkrag"``.
        max_attempts: calls per sample at most (the first plus repair turns on unusable output).
        max_new_tokens: the reply budget (a score and a short justification).
        max_reply_chars: a longer reply is unusable (recorded truncated, then repaired or counted wrong).
    """

    def __init__(
        self, backend: LVLMBackend, rubric: str = DEFAULT_RUBRIC, max_attempts: int = 3, max_new_tokens: int = 128,
        max_reply_chars: int = MAX_REPLY_CHARS,
    ) -> None:
        if max_attempts < 1 or max_reply_chars < 1:
            raise ValueError(f"max_attempts and max_reply_chars must be >= 1, got {max_attempts} and "
                             f"{max_reply_chars}")
        self.backend, self.max_attempts, self.max_reply_chars = backend, max_attempts, max_reply_chars
        self.rubric = load_rubric(rubric)
        self.settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0)
        self.cache: dict[str, dict[str, Any]] = {}

    def describe(self) -> dict[str, Any]:
        """What judged the run, for the report: backend kind, model, rubric and its version, attempts."""
        return {"backend": self.backend.name, "model": self.backend.model, "rubric": self.rubric.name,
                "rubric_version": self.rubric.version, "max_attempts": self.max_attempts,
                "temperature": self.settings.temperature, "correct_at": CORRECT_AT}

    def messages(self, question: str, gold: Sequence[str], answer: str) -> list[Message]:
        return self.rubric.messages(question, gold, answer)

    def judge(self, question: str, gold: Sequence[str], answer: str) -> dict[str, Any]:
        """``{"score", "correct", "raw", "attempts", "error", "status", "model", "rubric", "rubric_version",
        "cost", "reused"}`` for one answer.

        ``score`` is ``None`` when no valid score was obtained; ``correct`` is then ``False``. ``cost`` is
        :class:`GraderCost` as a dict; a verdict reused from the in-memory cache costs nothing.
        """
        if not answer.strip():
            return self._verdict(1, [], 0, "empty_answer", GraderCost())
        messages = self.messages(question, gold, answer)
        key = LVLMRequest(messages, self.settings).fingerprint(self.backend.model)
        cached = self.cache.get(key)
        if cached is not None:
            return {**cached, "raw": list(cached["raw"]), "cost": asdict(GraderCost()), "reused": True}
        verdict = self._ask(messages)
        if verdict["status"] != "backend_error":
            self.cache[key] = verdict
        return {**verdict, "raw": list(verdict["raw"]), "cost": dict(verdict["cost"])}

    def failed_verdict(self, error: str) -> dict[str, Any]:
        """The verdict of a sample whose judging raised unexpectedly: no score, counted wrong, nothing spent."""
        return self._verdict(None, [], 0, "error", GraderCost(), error)

    def _reply(self, result: object) -> tuple[str, str | None]:
        """The reply as recorded in ``raw`` and why it is unusable before parsing (``None`` if it is not)."""
        text = getattr(result, "text", None)
        if not isinstance(text, str):
            return f"<non-text reply: {type(text).__name__}>", f"non-text reply ({type(text).__name__})"
        if len(text) > self.max_reply_chars:
            kept = text[: self.max_reply_chars] + f"… [{len(text) - self.max_reply_chars} more characters]"
            return kept, f"reply of {len(text)} characters exceeds max_reply_chars={self.max_reply_chars}"
        return text, None

    def _score(self, reply: str, problem: str | None) -> tuple[float | None, str]:
        """The rubric's score of a reply, or ``None`` and the reason it has none."""
        if problem:
            return None, problem
        try:
            return self.rubric.parse(reply), ""
        except ScoreParseError as error:
            return None, str(error)

    def _ask(self, messages: list[Message]) -> dict[str, Any]:
        raw: list[str] = []
        cost = GraderCost()
        reason = ""
        for attempt in range(1, self.max_attempts + 1):
            start = time.perf_counter()
            try:
                result = self.backend(LVLMRequest(messages, self.settings))
            except LVLMError as error:
                cost.add(None, time.perf_counter() - start)
                logger.warning("judge call failed (%s: %s); the sample counts as wrong", type(error).__name__, error)
                return self._verdict(None, raw, attempt, "backend_error", cost, f"{type(error).__name__}: {error}")
            cost.add(result, time.perf_counter() - start)
            reply, problem = self._reply(result)
            raw.append(reply)
            score, reason = self._score(reply, problem)
            if score is not None:
                return self._verdict(score, raw, attempt, "ok", cost)
            repair = Message("user", [self.rubric.repair.format(reason=reason)])
            messages = [*messages, Message("assistant", [reply]), repair]
        logger.warning("judge output unparseable after %d attempts (%s); the sample counts as wrong", len(raw), reason)
        error = f"unparseable after {len(raw)} attempts: {reason}"
        return self._verdict(None, raw, len(raw), "unparseable", cost, error)

    def _verdict(
        self, score: float | None, raw: list[str], attempts: int, status: str, cost: GraderCost,
        error: str | None = None,
    ) -> dict[str, Any]:
        return {"score": score, "correct": score is not None and score >= CORRECT_AT, "raw": raw,
                "attempts": attempts, "error": error, "status": status, "model": self.backend.model,
                "rubric": self.rubric.name, "rubric_version": self.rubric.version, "cost": asdict(cost),
                "reused": False}


def build_grader(cfg: Mapping[str, Any] | None) -> Grader | None:
    """The judge of config group ``judge`` or ``None`` when disabled (``judge: none``: no ``backend``).

    ``cfg["backend"]`` is an LVLM config for :func:`hkrag.lvlm.build_backend` (``_target_``, the backend class,
    plus its arguments); the other keys are :class:`Grader`'s (``rubric``, ``max_attempts``, ``max_new_tokens``,
    ``max_reply_chars``).
    """
    if not cfg or not cfg.get("backend"):
        return None
    settings = dict(cfg)
    load_rubric(settings.get("rubric", DEFAULT_RUBRIC))  # a missing package fails before a backend is built
    backend = build_backend(settings.pop("backend"))
    return Grader(backend, **settings)

"""A scripted LVLM: chosen replies with chosen token probabilities, for tests and dry runs.

The agentic generator routes on token probabilities (paper §3.3, Definition 1), and a tiny random model
gives near-uniform ones, so tests and demos that must exercise a given route script the answers instead:
each request's text is matched against rules, the first match picks the reply, and the reply's text is
split into whitespace-led tokens that carry the scripted log-probabilities. Every request is recorded in
:attr:`ScriptedBackend.requests`.

Rules are ``(matcher, reply)`` pairs or one function of the request. A matcher is a substring of the
request's text, a compiled regular expression, or a predicate on the request. A reply is a string (every
token certain, log-probability 0), a :class:`Reply`, a function of the request returning either, or a
mapping with :class:`Reply`'s fields (so YAML can script a backend: ``{match: "yes or no", text: "yes"}``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .base import LVLMBackend, LVLMError, LVLMRequest, LVLMResponseError, LVLMResult, TokenLogprob

TOKEN = re.compile(r"\s*\S+")


@dataclass
class Reply:
    """A scripted answer.

    ``logprobs``: one value for every token, one per token, or ``None`` for a reply without token
    statistics (``tokens == []``, as from a server that returned no ``logprobs``). ``top``: per-token alternatives
    ``[(token, logprob), …]`` (cut to the request's ``top_logprobs``, as servers do). ``entropy``: per-token
    entropies in nats (one value or one per token). ``error``: raised instead of answering.
    """

    text: str = ""
    logprobs: float | Sequence[float] | None = 0.0
    top: Sequence[Sequence[tuple[str, float]]] = ()
    entropy: float | Sequence[float] | None = None
    error: LVLMError | None = None

    def tokens(self) -> list[TokenLogprob]:
        """The reply's tokens with their scripted statistics."""
        texts = TOKEN.findall(self.text)
        if self.logprobs is None:
            return []
        logprobs = per_token(self.logprobs, len(texts), "logprobs")
        entropies = per_token(self.entropy, len(texts), "entropy") if self.entropy is not None else [None] * len(texts)
        tops = [[tuple(alt) for alt in alts] for alts in self.top] + [[] for _ in range(len(texts) - len(self.top))]
        return [TokenLogprob(t, lp, top=top, entropy=e) for t, lp, top, e in zip(texts, logprobs, tops, entropies)]


ReplyLike = str | Reply | Mapping[str, Any] | Callable[[LVLMRequest], str | Reply]
Matcher = str | re.Pattern | Callable[[LVLMRequest], bool]


def per_token(value: float | Sequence[float], count: int, name: str) -> list[float]:
    """``value`` repeated ``count`` times, or the per-token list itself when its length is ``count``."""
    if isinstance(value, (int, float)):
        return [float(value)] * count
    if len(value) != count:
        raise ValueError(f"scripted {name} has {len(value)} values for {count} tokens")
    return [float(v) for v in value]


def request_text(request: LVLMRequest) -> str:
    """All the text of a request's messages, in order (what matchers see)."""
    return "\n".join(message.text for message in request.messages)


def matches(matcher: Matcher, request: LVLMRequest) -> bool:
    if isinstance(matcher, str):
        return matcher in request_text(request)
    if isinstance(matcher, re.Pattern):
        return matcher.search(request_text(request)) is not None
    return bool(matcher(request))


def as_reply(reply: ReplyLike, request: LVLMRequest) -> Reply:
    if isinstance(reply, Mapping):
        return Reply(**reply)
    if callable(reply) and not isinstance(reply, Reply):
        reply = reply(request)
    return Reply(reply) if isinstance(reply, str) else reply


class ScriptedBackend(LVLMBackend):
    """Answers from a script and records every request it got.

    Args:
        rules: ``(matcher, reply)`` pairs (first match wins), mappings ``{match: …, **reply}``, or one
            function ``request -> reply``.
        default: the reply when no rule matches; ``None`` makes an unmatched request an
            :class:`LVLMResponseError` naming its text.
        load_pages: decode every page like the real backends do (a broken page raises
            :class:`hkrag.data.images.ImageError`).
        delay_s: seconds each request takes (to exercise time caps).
        tokens_per_page: prompt tokens a page counts for (text counts one per word).
        vocab_size: reported vocabulary size (the entropy estimators need one).
        exact_entropy: whether the scripted replies' per-token entropies stand for exact ones (the
            ``entropy_exact`` estimator accepts only such a backend).
        model: the name written into results.
    """

    name = "scripted"
    thread_safe = True

    def __init__(
        self,
        rules: Sequence[tuple[Matcher, ReplyLike] | Mapping[str, Any]] | Callable[[LVLMRequest], ReplyLike] = (),
        default: ReplyLike | None = None,
        load_pages: bool = True,
        delay_s: float = 0.0,
        tokens_per_page: int = 100,
        vocab_size: int | None = 32064,
        exact_entropy: bool = False,
        model: str = "scripted",
    ) -> None:
        self.rules = rules if callable(rules) else [self._rule(rule) for rule in rules]
        self.default = default
        self.load_pages = load_pages
        self.delay_s = delay_s
        self.tokens_per_page = tokens_per_page
        self.vocab_size = vocab_size
        self.exact_entropy = exact_entropy
        self.model = model
        self.requests: list[LVLMRequest] = []

    @staticmethod
    def _rule(rule: tuple[Matcher, ReplyLike] | Mapping[str, Any]) -> tuple[Matcher, ReplyLike]:
        if isinstance(rule, Mapping):
            if "match" not in rule:
                raise ValueError(f"a scripted rule mapping needs a 'match' key, got {dict(rule)}")
            return rule["match"], {k: v for k, v in rule.items() if k != "match"}
        matcher, reply = rule
        return matcher, reply

    @property
    def prompts(self) -> list[str]:
        """The text of every request received, in order."""
        return [request_text(r) for r in self.requests]

    def reply_for(self, request: LVLMRequest) -> Reply:
        """The scripted reply to ``request``."""
        if callable(self.rules):
            return as_reply(self.rules(request), request)
        for matcher, reply in self.rules:
            if matches(matcher, request):
                return as_reply(reply, request)
        if self.default is None:
            raise LVLMResponseError(f"no scripted reply matches the request {request_text(request)[:200]!r}")
        return as_reply(self.default, request)

    def generate(self, requests: Sequence[LVLMRequest]) -> list[LVLMResult]:
        return [self._answer(request) for request in requests]

    def _answer(self, request: LVLMRequest) -> LVLMResult:
        start = time.perf_counter()
        self.requests.append(request)
        if self.load_pages:
            for page in request.images:
                page.load()
        reply = self.reply_for(request)
        if self.delay_s:
            time.sleep(self.delay_s)
        if reply.error is not None:
            raise reply.error
        settings = request.settings
        texts = TOKEN.findall(reply.text)
        finish = "length" if len(texts) > settings.max_new_tokens else "stop"
        tokens = reply.tokens()[: settings.max_new_tokens]
        for token in tokens:
            token.top = token.top[: settings.top_logprobs]
        return LVLMResult(
            text="".join(texts[: settings.max_new_tokens]).strip(),
            tokens=tokens,
            prompt_tokens=len(request_text(request).split()) + self.tokens_per_page * len(request.images),
            completion_tokens=min(len(texts), settings.max_new_tokens),
            latency_s=time.perf_counter() - start,
            finish_reason=finish,
            backend=self.name,
            model=self.model,
            vocab_size=self.vocab_size,
        )


__all__ = ["Reply", "ScriptedBackend", "request_text"]

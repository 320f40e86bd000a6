"""The LVLM interface: ask a vision-language model about page images, get text *and* token probabilities.

Paper §3.3, docs/lvlm.md. Every backend (our Phi3V, Qwen2.5-VL, any OpenAI-compatible server, a scripted
one for tests) takes a list of :class:`LVLMRequest` and returns one :class:`LVLMResult` each, batching
where it can. The Judger routes on the per-token log-probabilities, so a backend that cannot return
them raises :class:`LVLMResponseError` instead of returning a silent empty answer.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import numbers
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from PIL import Image

from hkrag.data.images import ImageError, open_image

from .words import normalise

ROLES = ("system", "user", "assistant")

LOGPROB_TOLERANCE = 1e-4
"""The largest positive log-probability taken as rounding of 0 (p = 1): a float32 log-softmax of a peaked
distribution can come out a few ulps above 0 (~1e-6 for logits of size ~30). Values in
``(0, LOGPROB_TOLERANCE]`` count as 0; larger ones (p > 1) make a response malformed."""


def logprob_problem(value: object) -> str | None:
    """Why ``value`` is not a usable log-probability (``"is null"``, ``"is NaN"`` …), or ``None`` when it is.

    Usable: a real number in ``[−inf, LOGPROB_TOLERANCE]``; −inf is p = 0 (a zero term in every estimator).
    """
    if value is None:
        return "is null"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"is not a number (got {type(value).__name__} {str(value)[:40]!r})"
    try:
        number = float(value)
    except OverflowError:
        return f"is out of the float range ({str(value)[:40]}…)"
    if math.isnan(number):
        return "is NaN"
    if number > LOGPROB_TOLERANCE:
        return f"is {number:g}, above 0 beyond the rounding tolerance {LOGPROB_TOLERANCE:g} (a probability above 1)"
    return None


@dataclass(frozen=True)
class PageImage:
    """A page image in a prompt.

    ``image`` is anything :func:`hkrag.data.images.open_image` decodes (PIL image, bytes, path, HF image
    dict); ``key`` names the page (its ``doc_id``): errors cite it, and local backends reuse the page's
    image features across the calls of a query by it.
    """

    image: Any
    key: str

    def load(self) -> Image.Image:
        """The decoded page; :class:`hkrag.data.images.ImageError` naming ``key`` when it cannot be used."""
        return open_image(self.image, self.key)

    def fingerprint(self) -> str:
        """A content hash of the page (for response caches): the key plus a digest of the pixels or bytes."""
        data = self.image
        if isinstance(data, dict):
            data = data.get("bytes") or data.get("path")
        if isinstance(data, Image.Image):
            buffer = io.BytesIO()
            data.save(buffer, format="PNG")
            data = buffer.getvalue()
        if not isinstance(data, (bytes, bytearray)):
            data = str(data).encode()
        return f"{self.key}:{hashlib.sha256(data).hexdigest()[:16]}"


Content = str | PageImage


@dataclass
class Message:
    """One chat turn; ``content`` mixes text and page images in order."""

    role: str
    content: list[Content]

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role must be one of {ROLES}, got {self.role!r}")
        if isinstance(self.content, (str, PageImage)):
            self.content = [self.content]

    @property
    def images(self) -> list[PageImage]:
        return [part for part in self.content if isinstance(part, PageImage)]

    @property
    def text(self) -> str:
        return "".join(part for part in self.content if isinstance(part, str))


@dataclass(frozen=True)
class GenerationSettings:
    """How to generate. ``temperature == 0`` is greedy (the default, and what the paper's agents use).

    ``top_logprobs``: how many alternatives to return per generated token besides the chosen one
    (0 = chosen token only). ``stop``: strings that end generation (not included in the text).
    ``word_mass``: words (e.g. ``("yes", "no")``) whose probability over the *whole* vocabulary a backend that
    knows the full distribution (``exact_word_mass``: the local ones) returns for every generated token, in
    :attr:`TokenLogprob.words`: the log of the summed probability of every token that reads as the word
    (:func:`hkrag.lvlm.words.normalise`). Other backends ignore it.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    seed: int | None = None
    word_mass: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "word_mass", tuple(self.word_mass))
        if bad := [word for word in self.word_mass if not isinstance(word, str) or not normalise(word)]:
            raise ValueError(f"word_mass words must be non-empty words, got {bad!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class LVLMRequest:
    """Chat messages (text and page images) plus generation settings."""

    messages: list[Message]
    settings: GenerationSettings = field(default_factory=GenerationSettings)

    @classmethod
    def user(cls, *content: Content, settings: GenerationSettings | None = None) -> LVLMRequest:
        """A single user turn, e.g. ``LVLMRequest.user(page1, page2, "Question: ...")``."""
        return cls([Message("user", list(content))], settings or GenerationSettings())

    @property
    def images(self) -> list[PageImage]:
        """Every page image of the conversation in order (``<|image_1|>`` … for Phi3V)."""
        return [image for message in self.messages for image in message.images]

    def fingerprint(self, model: str) -> str:
        """SHA-256 of (model, messages with page content hashes, settings): the response-cache key."""
        messages = [
            {"role": m.role, "content": [p if isinstance(p, str) else {"page": p.fingerprint()} for p in m.content]}
            for m in self.messages
        ]
        payload = json.dumps({"model": model, "messages": messages, "settings": asdict(self.settings)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


@dataclass
class TokenLogprob:
    """One generated token: its text, id (when known), log-probability, alternatives, entropy.

    ``top`` holds up to ``top_logprobs`` ``(token, logprob)`` alternatives, best first. ``entropy`` is the
    full next-token distribution's entropy in nats; only local backends know it exactly. ``words`` maps each
    word of the request's ``word_mass`` to the log of its summed probability over the whole vocabulary (−inf: no
    token reads as it), when the backend knows the full distribution; ``None`` otherwise.
    """

    token: str
    logprob: float
    token_id: int | None = None
    top: list[tuple[str, float]] = field(default_factory=list)
    entropy: float | None = None
    words: dict[str, float] | None = None


@dataclass
class LVLMResult:
    """What a backend returns for one request."""

    text: str
    tokens: list[TokenLogprob]
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    finish_reason: str
    backend: str
    model: str
    vocab_size: int | None = None
    cached: bool = False

    @property
    def logprobs(self) -> list[float]:
        return [t.logprob for t in self.tokens]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LVLMResult:
        tokens = [TokenLogprob(**{**t, "top": [tuple(a) for a in t.get("top", [])]}) for t in data["tokens"]]
        return cls(**{**data, "tokens": tokens})


class LVLMError(RuntimeError):
    """An LVLM call that did not produce a usable answer (after any retries)."""


class LVLMTimeoutError(LVLMError):
    """The call exceeded its time limit."""


class LVLMHTTPError(LVLMError):
    """The server answered with an HTTP error status (after any retries)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class LVLMResponseError(LVLMError):
    """The response was malformed or lacked what was asked for (e.g. no ``logprobs``)."""


class LVLMContextError(LVLMError, ValueError):
    """A request that does not fit the model's context: its prompt, or its prompt plus ``max_new_tokens``."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field
        """What to shorten: ``messages`` (the prompt alone fills the context) or ``max_tokens``."""


SURROGATE = re.compile("[\ud800-\udfff]")
"""A lone surrogate: what Python holds for a JSON ``\\ud800`` escape with no pair, or a ``surrogateescape``d byte;
not a character, and no tokenizer encodes it."""


class LVLMTextError(LVLMError, ValueError):
    """A request holding text no tokenizer can encode (a lone surrogate)."""


def check_text(request: LVLMRequest) -> None:
    """:class:`LVLMTextError` naming the message part (``messages[0].content[1]``) and the character, when a text
    part holds a lone surrogate; a local model's tokenizer would fail with an unrelated ``TypeError``."""
    for m, message in enumerate(request.messages):
        for k, part in enumerate(message.content):
            if isinstance(part, str) and (bad := SURROGATE.search(part)):
                raise LVLMTextError(f"messages[{m}].content[{k}] holds a lone surrogate U+{ord(bad.group()):04X} at "
                                    f"character {bad.start()}, which is not a character: send valid Unicode text")


def check_context(prompt_tokens: int, max_new_tokens: int, context: int | None) -> None:
    """:class:`LVLMContextError` when a prompt of ``prompt_tokens`` tokens asking for ``max_new_tokens`` more does
    not fit a context of ``context`` tokens (``None``: unknown, not checked). Refused, never cut: a cut prompt
    loses the question or pages, a capped answer looks complete."""
    if context is None:
        return
    if prompt_tokens >= context:
        raise LVLMContextError(f"the prompt is {prompt_tokens} tokens, over the model's context of {context} tokens; "
                               "send fewer or smaller pages or less text", "messages")
    if prompt_tokens + max_new_tokens > context:
        raise LVLMContextError(f"the prompt is {prompt_tokens} tokens and max_tokens is {max_new_tokens}: "
                               f"{prompt_tokens + max_new_tokens} > the model's context of {context} tokens; ask for "
                               f"at most {context - prompt_tokens}", "max_tokens")


class LVLMBackend(ABC):
    """A vision-language model that returns text with per-token log-probabilities.

    Subclasses set ``name`` (the backend kind) and ``model`` (what produced the answers, written into
    every result and report) and implement :meth:`generate`. ``thread_safe`` backends (HTTP clients)
    may be called from several threads at once, so a run can answer several queries concurrently.

    Capabilities, read before any call (e.g. to check that an uncertainty estimator can run):
    ``vocab_size`` is the model's vocabulary size when known (``None`` otherwise; the entropy estimators
    need it) and ``exact_entropy`` says whether every token carries its full-distribution entropy
    (local backends), which the ``entropy_exact`` estimator needs. ``context_length`` is the model's context
    in tokens and :meth:`count_prompt_tokens` a request's prompt length, when the backend can tell (local
    models); a server refuses a request that does not fit.

    The end-token rule: the token that ends generation (EOS / end-of-turn) is not part of the answer.
    A backend never returns it in ``LVLMResult.tokens`` (it still counts in ``completion_tokens``), so it
    never counts toward H′, whichever backend produced the answer.
    """

    name: str = "lvlm"
    model: str = ""
    thread_safe: bool = False
    vocab_size: int | None = None
    exact_entropy: bool = False
    exact_word_mass: bool = False
    context_length: int | None = None

    def count_prompt_tokens(self, request: LVLMRequest) -> int | None:
        """The prompt's length in tokens, or ``None`` when the backend cannot count it (the default)."""
        return None

    @abstractmethod
    def generate(self, requests: Sequence[LVLMRequest]) -> list[LVLMResult]:
        """One result per request, in order; batched where the backend can."""

    def __call__(self, request: LVLMRequest) -> LVLMResult:
        return self.generate([request])[0]

    def close(self) -> None:
        """Release what the backend holds (threads, connections); the default holds nothing."""
        return None

    def __enter__(self) -> LVLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "Content",
    "GenerationSettings",
    "ImageError",
    "LOGPROB_TOLERANCE",
    "LVLMBackend",
    "LVLMError",
    "LVLMHTTPError",
    "LVLMRequest",
    "LVLMResponseError",
    "LVLMResult",
    "LVLMTimeoutError",
    "Message",
    "PageImage",
    "TokenLogprob",
    "logprob_problem",
]

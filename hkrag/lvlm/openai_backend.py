"""Any OpenAI-compatible chat-completions server (vLLM, SGLang, DashScope, ``hkrag.lvlm.serve``) as an LVLM.

Pages go as ``data:`` URIs under a pixel budget (:mod:`hkrag.lvlm.data_uri`); every call asks for
``logprobs`` (and ``top_logprobs`` when the settings want alternatives) because the Judger routes on
them (paper §3.3, Definition 1), unless the backend is built with ``logprobs=False`` (a judge model that
only needs text). The response body is read as plain JSON and checked field by field: anything missing,
null or of the wrong type — every token's ``token`` and ``logprob`` and each alternative's included — is
an :class:`~hkrag.lvlm.base.LVLMResponseError` naming the field (``choices[0].logprobs.content[3].logprob
is null``). A trailing end token (``<|im_end|>``, or an empty-text special token, when ``finish_reason``
is ``stop``) is dropped from the tokens: the end-token rule of :class:`~hkrag.lvlm.base.LVLMBackend`, so
H′ over HTTP equals H′ in-process. The SDK's own retries are off (``max_retries=0``): this module retries
timeouts, connection errors, 408/429 and 5xx itself — exponential backoff with jitter, ``Retry-After``
honoured up to a cap — so the policy is explicit, bounded and tested. What still fails becomes a typed
:class:`~hkrag.lvlm.base.LVLMError`; a call never hangs past ``(max_retries + 1) * timeout_s`` plus the
waits, and never returns a silent empty answer. The API key is read from an environment variable and
kept out of reprs, logs, cache files and error messages.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import random
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai

from .base import (
    LVLMBackend,
    LVLMError,
    LVLMHTTPError,
    LVLMRequest,
    LVLMResponseError,
    LVLMResult,
    LVLMTimeoutError,
    Message,
    PageImage,
    TokenLogprob,
    logprob_problem,
)
from .data_uri import DEFAULT_MAX_PIXELS, FORMATS, encode_page
from .response_cache import ResponseCache

log = logging.getLogger(__name__)

NO_KEY = "EMPTY"
"""The key sent when ``api_key_env`` is null (local servers that check none)."""

END_TOKENS = (
    "<|end|>", "<|endoftext|>",  # Phi-3 (and Qwen's <|endoftext|>)
    "<|im_end|>",  # Qwen (ChatML)
    "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",  # Llama 3
    "</s>",  # Llama 2, Mistral
    "<end_of_turn>", "<eos>",  # Gemma
)
"""Token texts that end generation. vLLM keeps the end token among the sampled tokens, so its logprobs can
list it when ``finish_reason`` is ``stop``: as its text (``<|im_end|>``) or, detokenised with special
tokens skipped, as ``""``."""


def answer_tokens(
    tokens: list[TokenLogprob], finish_reason: str, end_tokens: Collection[str], generated: int | None = None
) -> list[TokenLogprob]:
    """``tokens`` without the end token that stopped generation (the end-token rule).

    When ``finish_reason`` is ``stop`` the last token is dropped if its text is in ``end_tokens``, or if it
    is empty and the list holds every generated token (``generated``, the server's ``completion_tokens``,
    is at most ``len(tokens)`` or unknown): a server that already left the end token out, like
    :mod:`hkrag.lvlm.serve`, reports one token more than it lists, and its last token is the answer's.
    """
    if finish_reason != "stop" or not tokens:
        return tokens
    last = tokens[-1].token
    if last in end_tokens or (not last and (generated is None or generated <= len(tokens))):
        return tokens[:-1]
    return tokens


def retry_after_seconds(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds a server asked us to wait: ``retry-after-ms``, or ``Retry-After`` as seconds or an HTTP date."""
    if value := headers.get("retry-after-ms"):
        try:
            return max(0.0, float(value) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        date = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, date.timestamp() - (time.time() if now is None else now))


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: ``max_retries`` after the first attempt, waits ``base * 2**attempt`` (capped at
    ``backoff_max_s``) times a jitter in ``[0.5, 1)``, or the server's ``Retry-After`` capped at
    ``retry_after_max_s``."""

    max_retries: int = 3
    backoff_base_s: float = 0.5
    backoff_max_s: float = 20.0
    retry_after_max_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")

    def delay(self, attempt: int, retry_after: float | None = None, rng: random.Random | None = None) -> float:
        """The wait before retry number ``attempt + 1`` (``attempt`` counts from 0)."""
        if retry_after is not None:
            return min(retry_after, self.retry_after_max_s)
        backoff = min(self.backoff_max_s, self.backoff_base_s * 2**attempt)
        return backoff * (0.5 + 0.5 * (rng or random).random())


class _Failure(Exception):
    """One failed attempt: the typed error to raise if it is the last, whether to retry, how long to wait."""

    def __init__(self, error: LVLMError, retryable: bool, retry_after: float | None = None) -> None:
        super().__init__(str(error))
        self.error, self.retryable, self.retry_after = error, retryable, retry_after


def _retryable_status(status: int) -> bool:
    return status in (408, 429) or status >= 500


class OpenAIBackend(LVLMBackend):
    """An OpenAI-compatible chat-completions endpoint at ``base_url`` serving ``model``.

    ``generate`` runs up to ``max_concurrency`` requests at once (order preserved). With ``cache_dir``
    answers are kept on disk (:class:`~hkrag.lvlm.response_cache.ResponseCache`) keyed by the request, the
    model, ``base_url``, the image budget, ``logprobs`` and ``end_tokens``. ``vocab_size`` (servers do not
    report it) enables the ``entropy_topk`` uncertainty estimator. ``logprobs=False`` neither requests nor
    requires log-probabilities (results have no tokens). ``end_tokens``: token texts that end generation
    (default :data:`END_TOKENS`), dropped from the end of an answer's tokens when ``finish_reason`` is
    ``stop``, as is an empty-text token there.
    """

    name = "openai"
    thread_safe = True

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        *,
        api_key_env: str | None = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 20.0,
        retry_after_max_s: float = 60.0,
        max_concurrency: int = 8,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        image_format: str = "png",
        jpeg_quality: int = 90,
        cache_dir: str | os.PathLike | None = None,
        vocab_size: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        logprobs: bool = True,
        end_tokens: Sequence[str] = END_TOKENS,
    ) -> None:
        if not model:
            raise ValueError("OpenAIBackend needs a model name (the server's served model name)")
        if timeout_s <= 0 or max_concurrency < 1:
            raise ValueError(f"need timeout_s > 0 and max_concurrency >= 1, got {timeout_s} and {max_concurrency}")
        if image_format not in FORMATS or max_pixels < 1:
            raise ValueError(f"need image_format in {sorted(FORMATS)} and max_pixels >= 1, got {image_format!r}, "
                             f"{max_pixels}")
        self.model, self.base_url, self.api_key_env = model, base_url, api_key_env
        self.timeout_s, self.max_concurrency = timeout_s, max_concurrency
        self.retry = RetryPolicy(max_retries, backoff_base_s, backoff_max_s, retry_after_max_s)
        self.max_pixels, self.image_format, self.jpeg_quality = max_pixels, image_format, jpeg_quality
        if isinstance(end_tokens, str):
            raise ValueError(f"end_tokens must be a list of token texts, got the string {end_tokens!r}")
        self.vocab_size, self.extra_body = vocab_size, dict(extra_body or {})
        self.logprobs, self.end_tokens = logprobs, tuple(end_tokens)
        self.cache = ResponseCache(cache_dir) if cache_dir is not None else None
        self._secret = _read_key(api_key_env)
        self._client = openai.OpenAI(api_key=self._secret, base_url=base_url, timeout=timeout_s, max_retries=0)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="lvlm-http")
        self._in_flight = threading.BoundedSemaphore(max_concurrency)  # across all callers' threads

    def __repr__(self) -> str:
        return (f"OpenAIBackend(model={self.model!r}, base_url={self.base_url!r}, api_key_env={self.api_key_env!r}, "
                f"max_concurrency={self.max_concurrency}, cache={self.cache!r})")

    def generate(self, requests: Sequence[LVLMRequest]) -> list[LVLMResult]:
        """One result per request, in order; at most ``max_concurrency`` HTTP calls in flight (across all callers).

        Raises the first error in request order (the other requests still run, and are cached).
        """
        if len(requests) <= 1:
            return [self._answer(request) for request in requests]
        return list(self._pool.map(self._answer, requests))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    def cache_key(self, request: LVLMRequest) -> str:
        """The response-cache key: the request, model, server and everything that changes the pixels sent."""
        assert self.cache is not None
        images = {"max_pixels": self.max_pixels, "image_format": self.image_format, "jpeg_quality": self.jpeg_quality}
        answer = {"logprobs": self.logprobs, "end_tokens": self.end_tokens}
        return self.cache.key(request, self.model, base_url=self.base_url, extra_body=self.extra_body, **images,
                              **answer)

    def _answer(self, request: LVLMRequest) -> LVLMResult:
        key = self.cache_key(request) if self.cache is not None else None
        if key is not None and (hit := self.cache.get(key)) is not None:
            return hit
        result = self._with_retries(self.payload(request), request.settings.top_logprobs)
        if key is not None:
            self.cache.put(key, result)
        return result

    def payload(self, request: LVLMRequest) -> dict[str, Any]:
        """The ``chat.completions.create`` arguments for ``request`` (pages as data URIs, logprobs unless off)."""
        s = request.settings
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [self._message(m) for m in request.messages],
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
        }
        if self.logprobs:
            payload["logprobs"] = True
        if self.logprobs and s.top_logprobs:
            payload["top_logprobs"] = s.top_logprobs
        if s.stop:
            payload["stop"] = list(s.stop)
        if s.seed is not None:
            payload["seed"] = s.seed
        if self.extra_body:
            payload["extra_body"] = self.extra_body
        return payload

    def _message(self, message: Message) -> dict[str, Any]:
        if not message.images:
            return {"role": message.role, "content": message.text}
        return {"role": message.role, "content": [self._part(part) for part in message.content]}

    def _part(self, part: str | PageImage) -> dict[str, Any]:
        if isinstance(part, str):
            return {"type": "text", "text": part}
        url = encode_page(part, self.max_pixels, self.image_format, self.jpeg_quality)
        return {"type": "image_url", "image_url": {"url": url}}

    def _with_retries(self, payload: dict[str, Any], top_logprobs: int) -> LVLMResult:
        start = time.perf_counter()
        for attempt in range(self.retry.max_retries + 1):
            try:
                response = self._attempt(payload)
                return self._result(response, top_logprobs, time.perf_counter() - start)
            except _Failure as failure:
                if not failure.retryable or attempt == self.retry.max_retries:
                    if attempt:
                        failure.error.args = (f"{failure.error} (after {attempt + 1} attempts)",)
                    raise failure.error from None
                wait = self.retry.delay(attempt, failure.retry_after)
                log.warning("LVLM call to %s failed: %s; retry %d/%d in %.2f s", self.base_url, failure.error,
                            attempt + 1, self.retry.max_retries, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _attempt(self, payload: dict[str, Any]) -> Any:
        """One HTTP call and its JSON body; every failure becomes a :class:`_Failure` holding a redacted,
        typed error."""
        where = self._where
        try:
            with self._in_flight:
                raw = self._client.chat.completions.with_raw_response.create(**payload)
                body = json.loads(raw.content)
        except openai.APITimeoutError:
            raise _Failure(LVLMTimeoutError(f"{where}: no answer within {self.timeout_s} s"), True) from None
        except openai.APIConnectionError as error:
            raise _Failure(LVLMHTTPError(f"{where}: connection failed ({self._redact(error)})"), True) from None
        except openai.APIStatusError as error:
            status = error.status_code
            message = LVLMHTTPError(f"{where}: HTTP {status}: {self._redact(error.message)[:500]}", status)
            raise _Failure(message, _retryable_status(status), retry_after_seconds(error.response.headers)) from None
        except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deeply
            malformed = LVLMResponseError(f"{where}: malformed JSON response ({self._redact(error)[:200]})")
            raise _Failure(malformed, False) from None
        if not isinstance(body, dict) or "choices" not in body:
            preview = self._redact(repr(body))[:200]
            raise _Failure(LVLMResponseError(f"{where}: response is not a chat completion: {preview}"), False)
        return body

    def _result(self, body: dict[str, Any], top_logprobs: int, latency_s: float) -> LVLMResult:
        """Map a chat-completion body into an :class:`LVLMResult`; anything malformed is a :class:`_Failure`
        holding an :class:`LVLMResponseError` that names the field."""
        try:
            return self._parse(body, top_logprobs, latency_s)
        except LVLMResponseError as error:
            raise _Failure(LVLMResponseError(f"{self._where}: {self._redact(error)}"), False) from None

    def _parse(self, body: dict[str, Any], top_logprobs: int, latency_s: float) -> LVLMResult:
        choices = field(body, "choices", "", list)
        if not choices:
            raise LVLMResponseError("response has no choices")
        choice = json_object(choices[0], "choices[0]")
        message = field(choice, "message", "choices[0]", dict)
        text = field(message, "content", "choices[0].message", str, nullable=True)
        if text is None:
            raise LVLMResponseError("response has no message content")
        finish_reason = field(choice, "finish_reason", "choices[0]", str, nullable=True, optional=True) or "unknown"
        usage = usage_counts(body)
        tokens = self._tokens(choice, finish_reason, top_logprobs, None if usage is None else usage[1])
        if text and self.logprobs and not tokens:
            raise LVLMResponseError("response has text but an empty logprobs list (no answer tokens)")
        prompt_tokens, completion_tokens = usage or (0, len(tokens))
        return LVLMResult(
            text=text,
            tokens=tokens,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            latency_s=latency_s,
            finish_reason=finish_reason,
            backend=self.name,
            model=field(body, "model", "", str, nullable=True, optional=True) or self.model,
            vocab_size=self.vocab_size,
        )

    def _tokens(
        self, choice: dict[str, Any], finish_reason: str, top_logprobs: int, generated: int | None
    ) -> list[TokenLogprob]:
        """The answer's tokens from ``choice.logprobs.content`` (none when logprobs are off), end token dropped
        (:func:`answer_tokens`; ``generated``: the server's ``completion_tokens``)."""
        if not self.logprobs:
            return []
        logprobs = field(choice, "logprobs", "choices[0]", dict, nullable=True, optional=True)
        content = None if logprobs is None else field(logprobs, "content", "choices[0].logprobs", list, nullable=True,
                                                       optional=True)
        if content is None:
            raise LVLMResponseError("response has no logprobs although they were asked for; the server must "
                                    "support logprobs (vLLM, SGLang do)")
        path = "choices[0].logprobs.content"
        tokens = [token_entry(entry, f"{path}[{i}]", top_logprobs) for i, entry in enumerate(content)]
        return answer_tokens(tokens, finish_reason, self.end_tokens, generated)

    @property
    def _where(self) -> str:
        return f"{self.base_url or 'api.openai.com'} (model {self.model!r})"

    def _redact(self, error: object) -> str:
        """``str(error)`` with the API key blanked out (servers may echo request headers)."""
        text = str(error)
        return text.replace(self._secret, "***") if self._secret and self._secret != NO_KEY else text


def _read_key(api_key_env: str | None) -> str:
    """The key in ``$api_key_env``; :data:`NO_KEY` when ``api_key_env`` is null. The error names the variable only."""
    if api_key_env is None:
        return NO_KEY
    key = os.environ.get(api_key_env)
    if not key:
        raise LVLMError(f"environment variable {api_key_env} is not set; export it (EMPTY for a local server "
                        "that checks no key) or set api_key_env: null")
    return key


JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number",
              bool: "a boolean", type(None): "null"}


def json_type(value: Any) -> str:
    return JSON_TYPES.get(type(value), type(value).__name__)


def json_object(value: Any, path: str) -> dict[str, Any]:
    """``value`` when it is a JSON object; :class:`LVLMResponseError` naming ``path`` otherwise."""
    if not isinstance(value, dict):
        raise LVLMResponseError(f"malformed response: {path} is {json_type(value)}, not an object")
    return value


def field(
    data: dict[str, Any],
    key: str,
    path: str,
    kind: type | tuple[type, ...],
    *,
    nullable: bool = False,
    optional: bool = False,
) -> Any:
    """``data[key]`` checked to be a ``kind`` (never a boolean unless asked for); a missing key is ``None`` when
    ``optional``, null is allowed when ``nullable``; :class:`LVLMResponseError` naming ``path.key`` otherwise."""
    name = f"{path}.{key}" if path else key
    if key not in data:
        if optional:
            return None
        raise LVLMResponseError(f"malformed response: {name} is missing")
    value = data[key]
    if value is None and nullable:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(JSON_TYPES[k] for k in kinds)
        raise LVLMResponseError(f"malformed response: {name} is {json_type(value)}, not {expected}")
    return value


def logprob_field(entry: dict[str, Any], path: str) -> float:
    """``entry["logprob"]``: a number in ``[−inf, tolerance]`` (:func:`~hkrag.lvlm.base.logprob_problem`)."""
    if "logprob" not in entry:
        raise LVLMResponseError(f"malformed response: {path}.logprob is missing")
    if problem := logprob_problem(entry["logprob"]):
        raise LVLMResponseError(f"malformed response: {path}.logprob {problem}")
    return float(entry["logprob"])


def token_entry(entry: Any, path: str, top_logprobs: int) -> TokenLogprob:
    """One ``logprobs.content`` entry, its ``token``, ``logprob`` and each ``top_logprobs`` alternative checked;
    at most ``top_logprobs`` alternatives kept."""
    entry = json_object(entry, path)
    alternatives = field(entry, "top_logprobs", path, list, nullable=True, optional=True) or []
    top = []
    for index, alternative in enumerate(alternatives):
        where = f"{path}.top_logprobs[{index}]"
        alternative = json_object(alternative, where)
        top.append((field(alternative, "token", where, str), logprob_field(alternative, where)))
    return TokenLogprob(field(entry, "token", path, str), logprob_field(entry, path), top=top[:top_logprobs])


def usage_counts(body: dict[str, Any]) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` from ``usage``, ``None`` when the server sent none; counts must
    be non-negative integers."""
    usage = field(body, "usage", "", dict, nullable=True, optional=True)
    if usage is None:
        return None
    counts = []
    for key in ("prompt_tokens", "completion_tokens"):
        value = field(usage, key, "usage", int)
        if value < 0:
            raise LVLMResponseError(f"malformed response: usage.{key} is negative ({value})")
        counts.append(value)
    return counts[0], counts[1]

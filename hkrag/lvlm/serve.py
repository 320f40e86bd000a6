"""An OpenAI-compatible chat-completions server over the local LVLM backends, with log-probabilities.

``python -m hkrag.lvlm.serve --config phi3v_tiny --port 8000``: the backend of ``conf/lvlm/phi3v_tiny.yaml``
(a name there or a YAML path; its ``_target_`` names the class), built as ``eval.py`` builds it.

Why our own: ``transformers serve`` rejects ``logprobs`` (HTTP 422) and vLLM does not run on the CPU, yet
the Judger needs per-token probabilities (paper §3.3). Endpoints: ``POST /v1/chat/completions`` (text and
``data:`` URI image parts, ``logprobs``/``top_logprobs`` in OpenAI's format, ``usage``), ``GET /v1/models``
and ``GET /health``.

One model serves every client, so the server protects it (docs/lvlm.md, "Bad input and overload"):
the body is read under a size cap and a deadline, parsed and validated, and its images decoded, all
outside the model's worker thread; every refusal is an OpenAI-style JSON error naming the field
(``{"error": {"message", "type", "param", "code"}}``). At most ``max_queue`` requests are admitted at
once (more get 503 with ``Retry-After`` at once), an admitted request whose generation has not started
within ``queue_timeout_s`` gets 503 too, and ``max_tokens`` is capped per request, so one long request
delays the others by a bounded time and never blocks the event loop. Admitted requests are batched: the
worker thread collects them for up to ``batch_wait_ms`` or ``max_batch_size`` and calls
``backend.generate`` once; each page gets a key hashed from its bytes, so a local backend reuses its
image features across calls.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from hkrag.data.images import ImageError

from . import build_backend
from .base import (
    SURROGATE,
    GenerationSettings,
    LVLMBackend,
    LVLMContextError,
    LVLMRequest,
    LVLMResult,
    Message,
    PageImage,
    check_context,
)
from .data_uri import decode_data_uri

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
MAX_STOP = 4
LOGPROB_FLOOR = -9999.0
"""How a log-probability of −inf (p = 0, e.g. a masked token) is sent: JSON has no infinity, and OpenAI and
vLLM report such tokens as -9999.0 (exp(-9999) is 0.0 in floating point, so the estimators see p = 0)."""


@dataclass(frozen=True)
class Limits:
    """What the server accepts; each limit's refusal names it (docs/lvlm.md has the table).

    ``context_length``: the model's context in tokens (``None``: the backend's own, when it can count a
    prompt's tokens; otherwise prompts are not checked).
    """

    max_body_bytes: int = 32 * 2**20
    body_timeout_s: float = 30.0
    max_image_pixels: int = 4096 * 4096
    max_images: int = 16
    max_tokens: int = 1024
    max_queue: int = 32
    queue_timeout_s: float = 60.0
    context_length: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_image_pixels", "max_images", "max_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("body_timeout_s", "queue_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2 or None, got {self.context_length}")


class APIError(Exception):
    """A request the server refuses: answered with OpenAI's error body and ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, self.status, headers=self.headers)


class BadRequest(APIError, ValueError):
    """HTTP 400: the field ``param`` cannot be served as sent; the message starts with the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(400, f"{param}: {message}" if param else message, param, code)


def overloaded(reason: str, retry_after_s: int) -> APIError:
    """HTTP 503 with ``Retry-After``: the model is busy; the same request may succeed later."""
    return APIError(503, f"server overloaded: {reason}; retry after {retry_after_s} s", None, "server_overloaded",
                    {"Retry-After": str(retry_after_s)})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ImageURL(_Strict):
    url: str


class ContentPart(_Strict):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]


class ChatRequest(_Strict):
    """The subset of OpenAI's chat-completions request we serve; unknown fields are ignored.

    Types are strict (``"5"`` is not a number, ``1`` is not ``true``) and ranges are OpenAI's.
    """

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    seed: int | None = None
    n: int = Field(1, ge=1)
    stream: bool = False


FIELDS = {name for model in (ImageURL, ContentPart, ChatMessage, ChatRequest) for name in model.model_fields}


def field_path(loc: Sequence[str | int]) -> str:
    """``("messages", 0, "content", "list[ContentPart]", 1, "type")`` → ``messages[0].content[1].type``.

    Keeps field names and list indices; drops pydantic's union-member tags and FastAPI's ``body``.
    """
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in FIELDS:
            path += f".{part}" if path else part
    return path


def invalid_fields(errors: Sequence[dict[str, Any]]) -> APIError:
    """One 400 naming every bad field (its ``param`` is the first); a field that only failed as a union
    member whose other member failed deeper down (a ``content`` list with one bad part) is left out."""
    problems: dict[str, list[str]] = {}
    for error in errors:
        problems.setdefault(field_path(error["loc"]), []).append(error["msg"])
    paths = [p for p in problems if not any(o.startswith(p + ".") or o.startswith(p + "[") for o in problems)]
    message = "; ".join(f"{p or 'body'}: {' or '.join(dict.fromkeys(problems[p]))}" for p in paths)
    return APIError(400, message, paths[0] or None, "invalid_value")


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_request(raw: bytes) -> ChatRequest:
    """The validated request in ``raw``; :class:`BadRequest` names the field, or the JSON error's place."""
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except json.JSONDecodeError as error:
        raise BadRequest(f"request body is not valid JSON: {error.msg} at line {error.lineno} column "
                         f"{error.colno}", code="invalid_json") from None
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except UnicodeDecodeError as error:  # invalid UTF-8: inside a string, name its field (below)
        data = _with_undecodable_bytes(raw, error)
    except ValueError as error:  # NaN/Infinity
        raise BadRequest(f"request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got a JSON {type(data).__name__}", code="invalid_json")
    check_body_text(data)
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as error:
        raise invalid_fields(error.errors()) from None


def _with_undecodable_bytes(raw: bytes, error: UnicodeDecodeError) -> Any:
    """The JSON of a body that is not valid UTF-8, its bad bytes kept as lone surrogates (``surrogateescape``) so
    that :func:`check_body_text` names the field holding them; a body that is not JSON even so is ``invalid_json``."""
    try:
        return json.loads(raw.decode("utf-8", errors="surrogateescape"), parse_constant=_no_constants)
    except (ValueError, RecursionError):
        raise BadRequest(f"request body is not valid JSON: {error}", code="invalid_json") from None


def check_body_text(data: Any, path: str = "") -> None:
    """Refuse text no tokenizer can encode: a lone surrogate (``\\ud800`` in the JSON) or an invalid UTF-8 byte,
    anywhere in the body; :class:`BadRequest` names the field (``messages[0].content``) and the character."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        for text, whose in ((key, "its key"), (value, "the text")):
            if isinstance(text, str) and (bad := SURROGATE.search(text)):
                code = ord(bad.group())
                byte = f" (or the byte 0x{code - 0xDC00:02x}: not UTF-8)" if 0xDC80 <= code <= 0xDCFF else ""
                what = f"a lone surrogate U+{code:04X}, which is not a character{byte}"
                raise BadRequest(f"{whose} holds {what} at character {bad.start()}; send valid UTF-8 text", where)
        check_body_text(value, where)


def check_request(body: ChatRequest, model_name: str, limits: Limits) -> None:
    """Refuse what the model cannot serve as asked, naming the field (before any image is decoded)."""
    if body.model != model_name:
        raise APIError(404, f"model {body.model!r} is not served here; this server serves {model_name!r}", "model",
                       "model_not_found")
    if body.n != 1:
        raise BadRequest(f"n={body.n} is not supported; only n=1", "n", "unsupported_value")
    if body.stream:
        raise BadRequest("stream=true is not supported", "stream", "unsupported_value")
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if (asked := body.max_completion_tokens or body.max_tokens or 0) > limits.max_tokens:
        raise BadRequest(f"{asked} is above this server's cap of {limits.max_tokens} tokens (--max-tokens-cap)",
                         param)
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > MAX_STOP or "" in stops:
        raise BadRequest(f"give at most {MAX_STOP} non-empty stop strings, got {stops!r}", "stop")
    images = [f"messages[{i}].content[{j}]" for i, m in enumerate(body.messages) if isinstance(m.content, list)
              for j, part in enumerate(m.content) if part.type == "image_url"]
    if len(images) > limits.max_images:
        raise BadRequest(f"the request has {len(images)} images; this server takes at most {limits.max_images} "
                         "(--max-images)", images[limits.max_images])


def to_lvlm_request(body: ChatRequest, limits: Limits = Limits()) -> LVLMRequest:
    """The :class:`LVLMRequest` of a checked request, its images decoded; :class:`BadRequest` names a bad part."""
    messages = [Message(m.role, _content(m.content, f"messages[{i}].content", limits.max_image_pixels))
                for i, m in enumerate(body.messages)]
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    max_tokens = body.max_completion_tokens or body.max_tokens or min(GenerationSettings.max_new_tokens,
                                                                      limits.max_tokens)
    settings = GenerationSettings(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  stop=stop, top_logprobs=body.top_logprobs or 0, seed=body.seed)
    return LVLMRequest(messages, settings)


def _content(content: str | list[ContentPart], param: str, max_pixels: int) -> list[str | PageImage]:
    if isinstance(content, str):
        return [content]
    parts: list[str | PageImage] = []
    for j, part in enumerate(content):
        if part.type == "text":
            if part.text is None:
                raise BadRequest("a text part needs a string 'text'", f"{param}[{j}].text")
            parts.append(part.text)
        elif part.image_url is None:
            raise BadRequest("an image_url part needs an 'image_url' ({\"url\": \"data:image/...\"})",
                             f"{param}[{j}].image_url")
        elif isinstance(part.image_url, str):
            parts.append(decode_image(part.image_url, f"{param}[{j}].image_url", max_pixels))
        else:
            parts.append(decode_image(part.image_url.url, f"{param}[{j}].image_url.url", max_pixels))
    return parts


def decode_image(url: str, param: str, max_pixels: int) -> PageImage:
    """The page of a ``data:`` URI (:func:`hkrag.lvlm.data_uri.decode_data_uri`); :class:`BadRequest` names
    ``param`` and the problem."""
    try:
        return decode_data_uri(url, max_pixels)
    except ImageError as error:
        raise BadRequest(error.problem, param, "invalid_image") from None


def _logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(token.encode("utf-8"))}


def to_openai_response(result: LVLMResult, model: str, logprobs: bool) -> dict[str, Any]:
    """``result`` as an OpenAI ``chat.completion`` object (``logprobs.content`` only when asked for)."""
    content = [{**_logprob(t.token, t.logprob), "top_logprobs": [_logprob(a, lp) for a, lp in t.top]}
               for t in result.tokens]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": {"content": content} if logprobs else None,
            "finish_reason": result.finish_reason,
        }],
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                  "total_tokens": result.prompt_tokens + result.completion_tokens},
    }


class ContextWindow:
    """The model's context: a request whose prompt plus ``max_tokens`` does not fit is refused (HTTP 400).

    Refused rather than capped, as OpenAI and vLLM do: a silently shorter answer would look complete.
    """

    def __init__(self, length: int, backend: LVLMBackend) -> None:
        self.length, self.backend = length, backend

    def check(self, request: LVLMRequest) -> None:
        """:class:`BadRequest` naming ``messages`` (the prompt alone is too long) or ``max_tokens``."""
        prompt = self.backend.count_prompt_tokens(request)
        if prompt is None:
            return
        try:
            check_context(prompt, request.settings.max_new_tokens, self.length)
        except LVLMContextError as error:
            raise BadRequest(str(error), error.field, "context_length_exceeded") from None

    @classmethod
    def of(cls, backend: LVLMBackend, length: int | None = None) -> ContextWindow | None:
        """The window of ``backend`` (``length`` overrides its ``context_length``); ``None`` when the context is
        unknown (HTTP and scripted backends): their prompts are not checked."""
        length = length or backend.context_length
        return cls(length, backend) if length else None


class Batcher:
    """A worker thread, the only one that calls the model, answering queued requests in batches.

    After the first request of a batch arrives it waits at most ``batch_wait_ms`` for more, up to
    ``max_batch_size``. A request whose future was cancelled while queued (its wait deadline passed) is
    skipped; ``check`` (the context window) refuses a request alone. When a batch fails, its requests are
    answered one by one so that a bad request fails alone.
    """

    def __init__(self, backend: LVLMBackend, max_batch_size: int = 8, batch_wait_ms: float = 10.0,
                 check: Callable[[LVLMRequest], None] | None = None) -> None:
        if max_batch_size < 1 or batch_wait_ms < 0:
            raise ValueError(f"need max_batch_size >= 1 and batch_wait_ms >= 0, got {max_batch_size}, {batch_wait_ms}")
        self.backend, self.max_batch_size, self.wait_s = backend, max_batch_size, batch_wait_ms / 1000
        self.check = check
        self.batch_sizes: list[int] = []
        self.last_batch_s = 0.0
        self._queue: queue.Queue[tuple[LVLMRequest, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="lvlm-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: LVLMRequest) -> Future:
        """A future of ``request``'s result; cancel it to withdraw the request before it starts."""
        future: Future = Future()
        self._queue.put((request, future))
        return future

    def close(self, timeout_s: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            batch, deadline, stop = [first], time.monotonic() + self.wait_s, False
            while len(batch) < self.max_batch_size and (remaining := deadline - time.monotonic()) > 0:
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            start = time.monotonic()
            self._answer(self._start(batch))
            self.last_batch_s = time.monotonic() - start
            if stop:
                return

    def _start(self, batch: list[tuple[LVLMRequest, Future]]) -> list[tuple[LVLMRequest, Future]]:
        """The batch's requests still wanted and fitting the model; the others are skipped or refused."""
        started = [item for item in batch if item[1].set_running_or_notify_cancel()]
        if self.check is None:
            return started
        fitting = []
        for request, future in started:
            try:
                self.check(request)
                fitting.append((request, future))
            except Exception as error:
                future.set_exception(error)
        return fitting

    def _answer(self, batch: list[tuple[LVLMRequest, Future]]) -> None:
        if not batch:
            return
        self.batch_sizes.append(len(batch))
        try:
            results = self.backend.generate([request for request, _ in batch])
        except Exception as error:
            if len(batch) == 1:
                batch[0][1].set_exception(error)
            else:
                for item in batch:
                    self._answer([item])
            return
        for (_, future), result in zip(batch, results):
            future.set_result(result)


class Admission:
    """At most ``limit`` requests inside at once (decoding, queued or generating); the next is refused.

    Used from the event loop's thread only, so a plain counter is safe.
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.inside = limit, 0

    @contextmanager
    def slot(self, retry_after_s: int) -> Iterator[None]:
        if self.inside >= self.limit:
            raise overloaded(f"{self.inside} requests are in progress, the most this server queues (--max-queue)",
                             retry_after_s)
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it (or its declared ``Content-Length``) passes ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    too_large = APIError(413, f"request body is larger than this server's limit of {limit} bytes (--max-body-mb)",
                         None, "body_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_for_result(future: Future, timeout_s: float, retry_after_s: int) -> LVLMResult:
    """The result of a queued request; 503 when its generation has not started within ``timeout_s``."""
    waiting = asyncio.wrap_future(future)
    try:
        return await asyncio.wait_for(asyncio.shield(waiting), timeout_s)
    except TimeoutError:
        if future.cancel():
            raise overloaded(f"the request waited {timeout_s:g} s for the model without starting "
                             "(--queue-timeout-s)", retry_after_s) from None
    return await waiting


def create_app(backend: LVLMBackend, served_model_name: str | None = None, max_batch_size: int = 8,
               batch_wait_ms: float = 10.0, limits: Limits | None = None) -> FastAPI:
    """The FastAPI app serving ``backend`` under ``served_model_name`` (default ``backend.model``)."""
    model_name, limits = served_model_name or backend.model, limits or Limits()
    window = ContextWindow.of(backend, limits.context_length)
    if window is None:
        log.warning("%s cannot count prompt tokens: prompts over the model's context are not refused", backend.name)
    batcher = Batcher(backend, max_batch_size, batch_wait_ms, window.check if window else None)
    admission = Admission(limits.max_queue)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        batcher.close()

    app = FastAPI(title="hkrag LVLM server", lifespan=lifespan)
    app.state.batcher, app.state.admission, app.state.limits = batcher, admission, limits

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return invalid_fields(error.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}",
                        code="not_found" if error.status_code == 404 else None, headers=error.headers).response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "hkrag"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        try:
            return await complete(request)
        except APIError as error:
            return error.response()
        except Exception as error:
            log.exception("unexpected failure")
            return APIError(500, f"internal error: {type(error).__name__}: {error}", code="internal_error").response()

    async def complete(request: Request) -> JSONResponse:
        try:
            raw = await asyncio.wait_for(read_body(request, limits.max_body_bytes), limits.body_timeout_s)
        except TimeoutError:
            raise APIError(408, f"request body not received within {limits.body_timeout_s:g} s (--body-timeout-s)",
                           None, "body_timeout") from None
        except ClientDisconnect:
            raise APIError(400, "the client disconnected before sending the whole body", None,
                           "client_disconnected") from None
        body = await run_in_threadpool(parse_request, raw)
        check_request(body, model_name, limits)
        retry_after = max(1, math.ceil(batcher.last_batch_s))
        with admission.slot(retry_after):
            lvlm_request = await run_in_threadpool(to_lvlm_request, body, limits)
            result = await generate(batcher.submit(lvlm_request), retry_after)
        return JSONResponse(to_openai_response(result, model_name, body.logprobs))

    async def generate(future: Future, retry_after: int) -> LVLMResult:
        try:
            return await wait_for_result(future, limits.queue_timeout_s, retry_after)
        except APIError:
            raise
        except ImageError as error:  # a page the model's processor refuses (e.g. a 500x2 strip)
            raise BadRequest(str(error), "messages", "invalid_image") from None
        except LVLMContextError as error:  # the model's own context, under a larger --context-length
            raise BadRequest(str(error), error.field, "context_length_exceeded") from None
        except Exception as error:
            log.exception("generation failed")
            raise APIError(500, f"generation failed: {type(error).__name__}: {error}", None,
                           "generation_failed") from None

    return app


CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "lvlm"


def config_file(config: str) -> Path:
    """The YAML that ``--config`` names: a path, or the name of a ``conf/lvlm/<name>.yaml``."""
    path = Path(config)
    if path.is_file():
        return path
    named = CONF_DIR / f"{config}.yaml"
    if named.is_file():
        return named
    choices = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
    raise FileNotFoundError(f"--config {config}: no such file, nor a conf/lvlm name (one of {choices})")


def load_backend(config: str, overrides: Sequence[str]) -> LVLMBackend:
    """The backend of an LVLM config (:func:`config_file`) with ``key=value`` overrides, as
    :func:`hkrag.lvlm.build_backend` builds it (``_target_=module.Class`` picks another class)."""
    from omegaconf import OmegaConf

    settings = OmegaConf.merge(OmegaConf.load(config_file(config)), OmegaConf.from_dotlist(list(overrides)))
    return build_backend(OmegaConf.to_container(settings, resolve=True))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hkrag.lvlm.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True,
                        help="a conf/lvlm name (e.g. phi3v_tiny) or a YAML path: _target_ plus the class's arguments")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model name clients must send (default: the backend's)")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--batch-wait-ms", type=float, default=10.0)
    default = Limits()
    parser.add_argument("--max-body-mb", type=float, default=default.max_body_bytes / 2**20,
                        help="largest request body in MiB (HTTP 413 beyond)")
    parser.add_argument("--body-timeout-s", type=float, default=default.body_timeout_s,
                        help="seconds to receive a request body (HTTP 408 beyond)")
    parser.add_argument("--max-image-pixels", type=int, default=default.max_image_pixels,
                        help="largest width*height of an image (HTTP 400 beyond)")
    parser.add_argument("--max-images", type=int, default=default.max_images, help="images per request")
    parser.add_argument("--max-tokens-cap", type=int, default=default.max_tokens, help="largest max_tokens accepted")
    parser.add_argument("--max-queue", type=int, default=default.max_queue,
                        help="requests in progress at once (HTTP 503 beyond)")
    parser.add_argument("--queue-timeout-s", type=float, default=default.queue_timeout_s,
                        help="longest wait for generation to start (HTTP 503 beyond)")
    parser.add_argument("--context-length", type=int, help="the model's context in tokens (default: its config's)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)

    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_file(args.config)
    except FileNotFoundError as error:
        parser.error(str(error))
    try:
        limits = Limits(int(args.max_body_mb * 2**20), args.body_timeout_s, args.max_image_pixels, args.max_images,
                        args.max_tokens_cap, args.max_queue, args.queue_timeout_s, args.context_length)
    except ValueError as error:
        parser.error(str(error))
    if not _is_loopback(args.host):
        log.warning("serving on %s: reachable from other machines, with no authentication", args.host)
    backend = load_backend(str(config), args.set)
    app = create_app(backend, args.served_model_name, args.max_batch_size, args.batch_wait_ms, limits)
    log.info("serving %s (%s) on http://%s:%d/v1", backend.model, backend.name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()

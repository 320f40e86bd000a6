"""An OpenAI-compatible chat-completions server over the local LVLM backends, with log-probabilities.

``python -m hkrag.lvlm.serve --backend phi3v --config conf/lvlm/phi3v_tiny.yaml --port 8000``

Why our own: ``transformers serve`` rejects ``logprobs`` (HTTP 422) and vLLM does not run on the CPU, yet
the Judger needs per-token probabilities (paper §3.3). Endpoints: ``POST /v1/chat/completions`` (text and
``data:`` URI image parts, ``logprobs``/``top_logprobs`` in OpenAI's format, ``usage``), ``GET /v1/models``
and ``GET /health``. Concurrent requests are batched: a worker thread collects them for up to
``batch_wait_ms`` or ``max_batch_size`` and calls ``backend.generate`` once. Each page gets a key hashed
from its bytes, so a local backend reuses its image features across calls. Bad input (including an
undecodable image) is HTTP 400 with the reason; anything else that fails is HTTP 500.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import ipaddress
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from hkrag.data.images import ImageError

from . import BACKENDS, build_backend
from .base import GenerationSettings, LVLMBackend, LVLMRequest, LVLMResult, Message, PageImage
from .images import decode_data_uri

log = logging.getLogger(__name__)


class ImageURL(BaseModel):
    url: str


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart]


class ChatRequest(BaseModel):
    """The subset of OpenAI's chat-completions request we serve; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False


class BadRequest(ValueError):
    """The request cannot be served as asked (HTTP 400)."""


def to_lvlm_request(body: ChatRequest) -> LVLMRequest:
    """The :class:`LVLMRequest` of an OpenAI chat request; :class:`BadRequest`/``ImageError`` name the problem."""
    if body.n != 1:
        raise BadRequest(f"n={body.n} is not supported; only n=1")
    if body.stream:
        raise BadRequest("stream=true is not supported")
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true")
    messages = [Message(m.role, _content(m.content)) for m in body.messages]
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    max_tokens = body.max_completion_tokens or body.max_tokens or GenerationSettings.max_new_tokens
    settings = GenerationSettings(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  stop=stop, top_logprobs=body.top_logprobs or 0, seed=body.seed)
    return LVLMRequest(messages, settings)


def _content(content: str | list[ContentPart]) -> list[str | PageImage]:
    if isinstance(content, str):
        return [content]
    parts: list[str | PageImage] = []
    for part in content:
        if part.type == "text":
            parts.append(part.text or "")
        elif part.image_url is None:
            raise BadRequest("an image_url content part has no image_url")
        else:
            parts.append(decode_data_uri(part.image_url if isinstance(part.image_url, str) else part.image_url.url))
    return parts


def _logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


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


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


class Batcher:
    """A worker thread that answers queued requests in batches of up to ``max_batch_size``.

    After the first request of a batch arrives it waits at most ``batch_wait_ms`` for more. When a batch
    fails, its requests are answered one by one so that a bad request fails alone.
    """

    def __init__(self, backend: LVLMBackend, max_batch_size: int = 8, batch_wait_ms: float = 10.0) -> None:
        if max_batch_size < 1 or batch_wait_ms < 0:
            raise ValueError(f"need max_batch_size >= 1 and batch_wait_ms >= 0, got {max_batch_size}, {batch_wait_ms}")
        self.backend, self.max_batch_size, self.wait_s = backend, max_batch_size, batch_wait_ms / 1000
        self.batch_sizes: list[int] = []
        self._queue: queue.Queue[tuple[LVLMRequest, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="lvlm-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: LVLMRequest) -> Future:
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
            self._answer(batch)
            if stop:
                return

    def _answer(self, batch: list[tuple[LVLMRequest, Future]]) -> None:
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


def create_app(backend: LVLMBackend, served_model_name: str | None = None, max_batch_size: int = 8,
               batch_wait_ms: float = 10.0) -> FastAPI:
    """The FastAPI app serving ``backend`` under ``served_model_name`` (default ``backend.model``)."""
    model_name = served_model_name or backend.model
    batcher = Batcher(backend, max_batch_size, batch_wait_ms)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        batcher.close()

    app = FastAPI(title="hkrag LVLM server", lifespan=lifespan)
    app.state.batcher = batcher

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        return _error(400, f"invalid request: {problems}")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "hkrag"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest) -> JSONResponse:
        if body.model != model_name:
            return _error(404, f"model {body.model!r} is not served here; this server serves {model_name!r}")
        try:
            request = to_lvlm_request(body)
        except ValueError as error:  # BadRequest, ImageError, GenerationSettings' checks
            return _error(400, str(error))
        try:
            result = await asyncio.wrap_future(batcher.submit(request))
        except ImageError as error:
            return _error(400, str(error))
        except Exception as error:
            log.exception("generation failed")
            return _error(500, f"generation failed: {type(error).__name__}: {error}")
        return JSONResponse(to_openai_response(result, model_name, body.logprobs))

    return app


def load_backend(backend: str | None, config: str | None, overrides: Sequence[str]) -> LVLMBackend:
    """A backend from a YAML config (its ``kind`` key names the backend) and ``key=value`` overrides.

    ``backend`` is a :data:`hkrag.lvlm.BACKENDS` name, or ``module:Class`` for any :class:`LVLMBackend`.
    """
    from omegaconf import OmegaConf

    settings = OmegaConf.load(config) if config else OmegaConf.create()
    settings = OmegaConf.to_container(OmegaConf.merge(settings, OmegaConf.from_dotlist(list(overrides))), resolve=True)
    kind = backend or settings.pop("kind", None)
    settings.pop("kind", None)
    if kind is None:
        raise ValueError(f"name a backend with --backend ({sorted(BACKENDS)} or module:Class) or 'kind' in the config")
    if kind in BACKENDS or ":" not in kind:
        return build_backend(kind, **settings)
    module, name = kind.split(":")
    return getattr(importlib.import_module(module), name)(**settings)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hkrag.lvlm.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", help=f"one of {sorted(BACKENDS)} or module:Class (default: the config's kind)")
    parser.add_argument("--config", help="YAML of the backend's constructor arguments, e.g. conf/lvlm/phi3v_tiny.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model name clients must send (default: the backend's)")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--batch-wait-ms", type=float, default=10.0)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)

    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.config and not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file")
    if not _is_loopback(args.host):
        log.warning("serving on %s: reachable from other machines, with no authentication", args.host)
    backend = load_backend(args.backend, args.config, args.set)
    app = create_app(backend, args.served_model_name, args.max_batch_size, args.batch_wait_ms)
    log.info("serving %s (%s) on http://%s:%d/v1", backend.model, backend.name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()

"""Test helpers for the HTTP LVLM code: a deterministic fake backend and a scripted loopback HTTP server.

``FakeBackend`` answers from a hash of the prompt text and the pages' pixels, so an answer proves the
pages arrived intact. ``ScriptedServer`` replays a list of replies (status, headers, body, delay) on
127.0.0.1 and records every request it received.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hkrag.lvlm.base import LVLMBackend, LVLMRequest, LVLMResult, TokenLogprob


class FakeBackend(LVLMBackend):
    """Deterministic text and log-probabilities from the request; a prompt containing ``explode`` raises."""

    name = "fake"

    def __init__(self, model: str = "fake-lvlm", vocab_size: int = 1000) -> None:
        self.model, self.vocab_size = model, vocab_size
        self.calls: list[int] = []

    def generate(self, requests: Sequence[LVLMRequest]) -> list[LVLMResult]:
        self.calls.append(len(requests))
        return [self.answer(request) for request in requests]

    def answer(self, request: LVLMRequest) -> LVLMResult:
        text = "".join(m.text for m in request.messages)
        if "explode" in text:
            raise RuntimeError("the fake model exploded")
        digest = hashlib.sha256(text.encode())
        for page in request.images:
            image = page.load()
            digest.update(f"{image.size}{image.mode}".encode() + image.tobytes())
        hexdigest = digest.hexdigest()
        pieces = ["Ans", "wer", " é", f" {hexdigest[:6]}", "."]
        keep = pieces[: request.settings.max_new_tokens]
        k = request.settings.top_logprobs
        tokens = []
        for i, piece in enumerate(keep):
            logprob = -int(hexdigest[2 * i : 2 * i + 2], 16) / 97.0
            alternatives = [(piece, logprob)] + [(f"alt{j}", logprob - 0.5 - j) for j in range(1, k)]
            tokens.append(TokenLogprob(piece, logprob, token_id=i, top=alternatives[:k]))
        return LVLMResult(
            text="".join(keep),
            tokens=tokens,
            prompt_tokens=len(text.split()) + 10 * len(request.images),
            completion_tokens=len(keep),
            latency_s=0.0,
            finish_reason="stop" if len(keep) == len(pieces) else "length",
            backend=self.name,
            model=self.model,
            vocab_size=self.vocab_size,
        )


def completion(tokens: Sequence[tuple[str, float]] = (("yes", -0.1),), top: int = 0, logprobs: bool = True,
               **extra: Any) -> dict:
    """An OpenAI chat-completion body answering the concatenated ``(token, logprob)`` pairs."""
    content = [{"token": token, "logprob": lp, "bytes": list(token.encode()),
                "top_logprobs": [{"token": f"{token}{j}", "logprob": lp - j, "bytes": None} for j in range(top)]}
               for token, lp in tokens]
    body = {
        "id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": "scripted-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(t for t, _ in tokens)},
                     "logprobs": {"content": content} if logprobs else None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": len(tokens), "total_tokens": 11 + len(tokens)},
    }
    return {**body, **extra}


@dataclass
class Reply:
    """One scripted answer; ``body`` may be a dict (JSON), bytes, or a callable of the request."""

    status: int = 200
    body: dict | bytes | Callable[[dict], dict] = field(default_factory=completion)
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict


class ScriptedServer:
    """An HTTP server on 127.0.0.1 answering POSTs with ``replies`` in turn (the last one repeats)."""

    def __init__(self, replies: Sequence[Reply]) -> None:
        self.replies, self.received = list(replies), []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                request = Received(self.path, {k.lower(): v for k, v in self.headers.items()}, json.loads(raw or b"{}"))
                with server._lock:
                    server.received.append(request)
                    reply = server.replies[min(len(server.received), len(server.replies)) - 1]
                time.sleep(reply.delay_s)
                body = reply.body(request) if callable(reply.body) else reply.body
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                try:
                    self.send_response(reply.status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    for key, value in reply.headers.items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}/v1"

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

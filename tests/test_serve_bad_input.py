"""``python -m hkrag.lvlm.serve`` under bad input and overload (issue 18).

Each family sends bad requests to a real uvicorn server on 127.0.0.1 (an ephemeral port, stopped after
its test) serving the scripted backend, and checks the status, the OpenAI-style error body
``{"error": {"message", "type", "param", "code"}}`` and the field it names, then that a good request still
succeeds. Every client call has a timeout and every wait loop a deadline.
"""

from __future__ import annotations

import base64
import http.client
import io
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn
from PIL import Image

from hkrag.lvlm.scripted import Reply, ScriptedBackend, request_text
from hkrag.lvlm.serve import Limits, create_app

MODEL = "m"
PATH = "/v1/chat/completions"
TIMEOUT = httpx.Timeout(10.0)
CLIENT = httpx.Client(timeout=TIMEOUT)  # one client for every thread: no per-call setup competing for the CPU


class CountingBackend(ScriptedBackend):
    """A scripted model with a 40-token context that counts one token per word (pages: ``tokens_per_page``)."""

    context_length = 40

    def count_prompt_tokens(self, request) -> int:
        return len(request_text(request).split()) + self.tokens_per_page * len(request.images)


@contextmanager
def serving(backend, limits: Limits, **options) -> Iterator[str]:
    """A uvicorn server for ``backend`` on 127.0.0.1 (ephemeral port) in a thread; stopped on exit."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(backend, MODEL, limits=limits, batch_wait_ms=1, **options),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "the server to start")
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.01)


def png(size=(20, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def gradient_png() -> bytes:
    """A 256x256 grey ramp: its pixel data spans many bytes, so half the file is a truncated image."""
    buffer = io.BytesIO()
    Image.linear_gradient("L").save(buffer, format="PNG")
    return buffer.getvalue()


GRADIENT = gradient_png()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def request_body(content="Is it red?", **params) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **params}


def post(url: str, body: dict | bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    kind = {"content": body} if isinstance(body, bytes) else {"json": body}
    return CLIENT.post(url + PATH, headers=headers, **kind)


def assert_error(response: httpx.Response, status: int, param: str | None, fragment: str, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code), error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert fragment in error["message"], error["message"]


def assert_still_serving(url: str, content="Is it red?") -> None:
    response = post(url, request_body(content))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "yes it is"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    limits = Limits(max_image_pixels=1_000_000, max_images=3, max_tokens=64)
    with serving(ScriptedBackend(default="yes it is"), limits) as base_url:
        yield base_url


# --- malformed bodies and JSON ------------------------------------------------------------------------------------

NESTED = b"[" * 100_000


@pytest.mark.parametrize(
    "body,param,fragment,code",
    [
        (b"{not json", None, "not valid JSON: Expecting property name enclosed in double quotes at line 1 column 2",
         "invalid_json"),
        (b"", None, "not valid JSON: Expecting value at line 1 column 1", "invalid_json"),
        (b'\xff{"model": "m"}', None, "not valid JSON: 'utf-8' codec can't decode byte 0xff", "invalid_json"),
        (b"[1, 2]", None, "request body must be a JSON object, got a JSON list", "invalid_json"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None,
         "NaN is not valid JSON", "invalid_json"),
        (NESTED, None, "nested too deeply", "invalid_json"),
        ({"model": MODEL}, "messages", "messages: Field required", "invalid_value"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model", "model: Field required", "invalid_value"),
        ({"model": MODEL, "messages": []}, "messages", "at least 1 item", "invalid_value"),
        ({"model": MODEL, "messages": "hi"}, "messages", "messages: Input should be a valid list", "invalid_value"),
        (request_body(max_tokens="many"), "max_tokens", "max_tokens: Input should be a valid integer",
         "invalid_value"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role",
         "messages[0].role: Input should be 'system', 'user' or 'assistant'", "invalid_value"),
        (request_body(5), "messages[0].content",
         "messages[0].content: Input should be a valid string or Input should be a valid list", "invalid_value"),
        (request_body([{"type": "text", "text": "a"}, {"type": "audio"}]), "messages[0].content[1].type",
         "messages[0].content[1].type: Input should be 'text' or 'image_url'", "invalid_value"),
        (request_body([{"type": "text"}]), "messages[0].content[0].text", "a text part needs a string 'text'",
         "invalid_value"),
        (request_body([{"type": "image_url"}]), "messages[0].content[0].image_url", "needs an 'image_url'",
         "invalid_value"),
        (request_body([{"type": "image_url", "image_url": {"uri": "x"}}]), "messages[0].content[0].image_url.url",
         "messages[0].content[0].image_url.url: Field required", "invalid_value"),
    ],
)
def test_malformed_body_is_400_naming_the_field(url, body, param, fragment, code):
    assert_error(post(url, body), 400, param, fragment, code)
    assert_still_serving(url)


@pytest.mark.parametrize("method,path,status,fragment", [("GET", PATH, 405, "GET /v1/chat/completions: Method Not"),
                                                         ("POST", "/v1/nothing", 404, "/v1/nothing: Not Found")])
def test_unknown_routes_answer_in_the_error_shape(url, method, path, status, fragment):
    response = CLIENT.request(method, url + path)
    assert_error(response, status, None, fragment, "not_found" if status == 404 else None)


# --- bad images and URIs ------------------------------------------------------------------------------------------

IMAGE_PARAM = "messages[0].content[1].image_url.url"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    "parts,param,fragment,code",
    [
        ([image_part("data:image/png;base64,@@@")], IMAGE_PARAM, "invalid base64 payload", "invalid_image"),
        ([image_part("data:image/png;base64,iVBORw0KGgoAAA")], IMAGE_PARAM,
         "invalid base64 payload (Incorrect padding)", "invalid_image"),
        ([image_part(data_uri(GRADIENT[: len(GRADIENT) // 2]))], IMAGE_PARAM, "corrupt or truncated image",
         "invalid_image"),
        ([image_part(data_uri(b"not an image"))], IMAGE_PARAM, "not a recognised image format", "invalid_image"),
        ([image_part(data_uri(png(), "text/plain"))], IMAGE_PARAM,
         f"{IMAGE_PARAM}: the data URI's mime type is 'text/plain', not image/*", "invalid_image"),
        ([image_part("data:image/png,rawbytes")], IMAGE_PARAM, "not base64-encoded", "invalid_image"),
        ([image_part("https://example.com/page.png")], IMAGE_PARAM,
         "https:// image URLs are not fetched by this server", "invalid_image"),
        ([image_part("http://127.0.0.1:9/page.png")], IMAGE_PARAM, "http:// image URLs are not fetched",
         "invalid_image"),
        ([image_part("file:///etc/passwd")], IMAGE_PARAM, "file:// image URLs are not fetched", "invalid_image"),
        ([image_part("page.png")], IMAGE_PARAM, "expected a data:image/...;base64,... URI, got 'page.png'",
         "invalid_image"),
        ([image_part(data_uri(png((1001, 1000))))], IMAGE_PARAM,
         f"{IMAGE_PARAM}: decompression bomb: 1001x1000 = 1001000 pixels > max_pixels=1000000", "invalid_image"),
        ([{"type": "image_url", "image_url": data_uri(b"GIF89a")}], "messages[0].content[1].image_url",
         "messages[0].content[1].image_url: not a recognised image format", "invalid_image"),
        ([image_part(data_uri(png()))] * 4, "messages[0].content[4]",
         "the request has 4 images; this server takes at most 3 (--max-images)", "invalid_value"),
    ],
)
def test_bad_image_is_400_naming_the_part(url, parts, param, fragment, code):
    response = post(url, request_body([{"type": "text", "text": "Look:"}, *parts]))
    assert_error(response, 400, param, fragment, code)
    at_the_cap = [{"type": "text", "text": "Look:"}, image_part(data_uri(png((1250, 800))))]  # 1000000 pixels
    assert_still_serving(url, at_the_cap)


# --- sampling settings and the model name -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params,status,param,fragment,code",
    [
        ({"temperature": -0.1}, 400, "temperature", "temperature: Input should be greater than or equal to 0",
         "invalid_value"),
        ({"temperature": 2.5}, 400, "temperature", "less than or equal to 2", "invalid_value"),
        ({"temperature": "hot"}, 400, "temperature", "temperature: Input should be a valid number", "invalid_value"),
        ({"top_p": 0}, 400, "top_p", "top_p: Input should be greater than 0", "invalid_value"),
        ({"top_p": 1.5}, 400, "top_p", "top_p: Input should be less than or equal to 1", "invalid_value"),
        ({"max_tokens": 0}, 400, "max_tokens", "max_tokens: Input should be greater than or equal to 1",
         "invalid_value"),
        ({"max_tokens": 2.5}, 400, "max_tokens", "max_tokens: Input should be a valid integer", "invalid_value"),
        ({"max_tokens": 65}, 400, "max_tokens", "max_tokens: 65 is above this server's cap of 64 tokens",
         "invalid_value"),
        ({"max_completion_tokens": 1000}, 400, "max_completion_tokens", "1000 is above this server's cap of 64",
         "invalid_value"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "less than or equal to 20", "invalid_value"),
        ({"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs", "greater than or equal to 0", "invalid_value"),
        ({"top_logprobs": 3}, 400, "top_logprobs", "top_logprobs: top_logprobs needs logprobs=true", "invalid_value"),
        ({"logprobs": "yes"}, 400, "logprobs", "logprobs: Input should be a valid boolean", "invalid_value"),
        ({"n": 2}, 400, "n", "n: n=2 is not supported; only n=1", "unsupported_value"),
        ({"n": 0}, 400, "n", "n: Input should be greater than or equal to 1", "invalid_value"),
        ({"stream": True}, 400, "stream", "stream=true is not supported", "unsupported_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 non-empty stop strings", "invalid_value"),
        ({"stop": [""]}, 400, "stop", "at most 4 non-empty stop strings, got ['']", "invalid_value"),
        ({"seed": "x"}, 400, "seed", "seed: Input should be a valid integer", "invalid_value"),
        ({"model": "other"}, 404, "model", "model 'other' is not served here; this server serves 'm'",
         "model_not_found"),
    ],
)
def test_out_of_range_sampling_setting_is_refused_naming_it(url, params, status, param, fragment, code):
    assert_error(post(url, request_body(**params)), status, param, fragment, code)
    answer = post(url, request_body(max_tokens=64, temperature=2, top_p=1, logprobs=True, top_logprobs=20))
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["logprobs"]["content"]) == 3


# --- size limits: the body, its arrival, the model's context ------------------------------------------------------

SMALL = Limits(max_body_bytes=4096, body_timeout_s=0.5, max_tokens=64)


def chunked(url: str) -> httpx.Response:
    """A 8 KiB body without Content-Length: the cap is enforced while reading."""
    return CLIENT.post(url + PATH, content=iter([b" " * 1024] * 8))


def declared(url: str) -> httpx.Response:
    return post(url, request_body("word " * 1000))


def stalled(url: str) -> httpx.Response:
    """Headers announcing 100 bytes, then 8 bytes and silence."""
    connection = http.client.HTTPConnection("127.0.0.1", urlsplit(url).port, timeout=10)
    try:
        connection.putrequest("POST", PATH)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", "100")
        connection.endheaders(b'{"model"')
        reply = connection.getresponse()
        return httpx.Response(reply.status, headers=dict(reply.getheaders()), content=reply.read())
    finally:
        connection.close()


def words(count: int, **params) -> Callable[[str], httpx.Response]:
    return lambda url: post(url, request_body(" ".join(["word"] * count), **params))


@pytest.mark.parametrize(
    "send,status,param,fragment,code",
    [
        (declared, 413, None, "request body is larger than this server's limit of 4096 bytes", "body_too_large"),
        (chunked, 413, None, "request body is larger than this server's limit of 4096 bytes", "body_too_large"),
        (stalled, 408, None, "request body not received within 0.5 s", "body_timeout"),
        (words(45), 400, "messages", "messages: the prompt is 45 tokens, over the model's context of 40 tokens",
         "context_length_exceeded"),
        (words(30, max_tokens=20), 400, "max_tokens",
         "the prompt is 30 tokens and max_tokens is 20: 50 > the model's context of 40 tokens; ask for at most 10",
         "context_length_exceeded"),
    ],
)
def test_size_limits_are_enforced_naming_the_limit(send, status, param, fragment, code):
    backend = CountingBackend(default="yes it is")
    with serving(backend, SMALL) as url:
        started = time.monotonic()
        assert_error(send(url), status, param, fragment, code)
        assert time.monotonic() - started < 5
        assert_still_serving(url)
        assert post(url, request_body(" ".join(["word"] * 30), max_tokens=10)).status_code == 200  # fits exactly
    assert backend.prompts == ["Is it red?", " ".join(["word"] * 30)]  # nothing refused reached the model


# --- concurrency and overload -------------------------------------------------------------------------------------


def timed_post(url: str, body: dict) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = post(url, body)
    return response, time.monotonic() - started


@pytest.mark.parametrize(
    "limits,delay_s,clients,statuses,fragment",
    [
        (Limits(max_queue=2), 1.5, 3, {200: 2, 503: 2},
         "2 requests are in progress, the most this server queues (--max-queue)"),
        (Limits(queue_timeout_s=0.4), 1.5, 3, {200: 1, 503: 3},
         "the request waited 0.4 s for the model without starting (--queue-timeout-s)"),
        (Limits(), 0.02, 16, {200: 17}, None),
    ],
)
def test_overload_is_503_with_retry_after_and_a_long_request_stalls_nothing(limits, delay_s, clients, statuses,
                                                                             fragment):
    backend = ScriptedBackend(default="yes it is", delay_s=delay_s)
    with serving(backend, limits, max_batch_size=1) as url, ThreadPoolExecutor(clients + 1) as pool:
        first = pool.submit(timed_post, url, request_body())
        wait_until(lambda: backend.requests, "the first request to reach the model")
        others = [pool.submit(timed_post, url, request_body()) for _ in range(clients)]
        started = time.monotonic()
        assert CLIENT.get(url + "/health").status_code == 200
        assert_error(post(url, b"{"), 400, None, "not valid JSON", "invalid_json")
        assert time.monotonic() - started < 1.0  # answered while the model is busy
        outcomes = [future.result(timeout=30) for future in [first, *others]]
        assert Counter(response.status_code for response, _ in outcomes) == statuses
        for response, seconds in outcomes:
            if response.status_code == 503:
                assert_error(response, 503, None, fragment, "server_overloaded")
                assert int(response.headers["retry-after"]) >= 1 and seconds < delay_s
        assert len(backend.requests) == statuses[200]  # a withdrawn request never reaches the model
        assert_still_serving(url)


def test_minus_infinity_logprob_is_sent_as_openais_floor():
    """JSON has no infinity: a p = 0 token (log-probability −inf) used to fail the whole answer with a 500."""
    backend = ScriptedBackend(default=Reply("yes no", logprobs=[-0.5, float("-inf")],
                                            top=[[("yes", -0.5), ("no", float("-inf"))], []]))
    with serving(backend, Limits()) as url:
        response = post(url, request_body(logprobs=True, top_logprobs=2))
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["content"]
    assert [t["logprob"] for t in tokens] == [-0.5, -9999.0]
    assert [a["logprob"] for a in tokens[0]["top_logprobs"]] == [-0.5, -9999.0]

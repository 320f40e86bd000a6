"""The OpenAI-compatible backend under faults: bounded retries, typed errors, never a hang or an empty answer.

A scripted HTTP server on 127.0.0.1 plays each fault; backoff waits are ~10 ms so the file runs in seconds.
"""

from __future__ import annotations

import base64
import email.utils
import io
import math
import random
import socket
import time

import pytest
from _lvlm_fake import Reply, ScriptedServer, completion
from PIL import Image

from hkrag.data.images import ImageError
from hkrag.lvlm import (
    GenerationSettings,
    LVLMHTTPError,
    LVLMRequest,
    LVLMResponseError,
    LVLMTimeoutError,
    PageImage,
    uncertainty,
)
from hkrag.lvlm.openai_backend import OpenAIBackend, RetryPolicy, retry_after_seconds

FAST = dict(api_key_env=None, timeout_s=5.0, max_retries=2, backoff_base_s=0.01, backoff_max_s=0.05)


def backend(server: ScriptedServer, **overrides) -> OpenAIBackend:
    return OpenAIBackend("scripted-model", server.base_url, **{**FAST, **overrides})


def ask(client: OpenAIBackend, *content, **settings):
    return client(LVLMRequest.user(*content, "Is it enough?", settings=GenerationSettings(**settings)))


def test_500_then_200_is_retried_and_answered():
    with ScriptedServer([Reply(500, {"error": {"message": "overloaded"}}), Reply()]) as server:
        result = ask(backend(server))
    assert (result.text, result.logprobs, len(server.received)) == ("yes", [-0.1], 2)


def test_persistent_500_ends_in_http_error_after_bounded_retries():
    with ScriptedServer([Reply(503, {"error": {"message": "down"}})]) as server, pytest.raises(LVLMHTTPError) as error:
        ask(backend(server, max_retries=3))
    assert error.value.status == 503 and "down" in str(error.value) and "after 4 attempts" in str(error.value)
    assert len(server.received) == 4


def test_client_error_is_not_retried():
    with ScriptedServer([Reply(400, {"error": {"message": "bad image"}})]) as server:
        with pytest.raises(LVLMHTTPError) as error:
            ask(backend(server))
    assert error.value.status == 400 and "bad image" in str(error.value) and len(server.received) == 1


def test_429_honours_retry_after_seconds():
    replies = [Reply(429, {"error": {"message": "slow down"}}, headers={"Retry-After": "0.3"}), Reply()]
    with ScriptedServer(replies) as server:
        start = time.perf_counter()
        result = ask(backend(server))
        elapsed = time.perf_counter() - start
    assert result.text == "yes" and len(server.received) == 2
    assert elapsed >= 0.3  # backoff alone (<= 0.05 s) could not explain the wait


def test_429_retry_after_is_capped():
    replies = [Reply(429, {"error": {"message": "slow down"}}, headers={"Retry-After": "3600"}), Reply()]
    with ScriptedServer(replies) as server:
        start = time.perf_counter()
        assert ask(backend(server, retry_after_max_s=0.05)).text == "yes"
    assert time.perf_counter() - start < 2


def test_retry_after_parses_seconds_milliseconds_and_http_dates():
    now = 1_700_000_000.0
    assert retry_after_seconds({"retry-after": "7"}, now) == 7
    assert retry_after_seconds({"retry-after-ms": "250", "retry-after": "7"}, now) == 0.25
    assert retry_after_seconds({"retry-after": email.utils.formatdate(now + 30, usegmt=True)}, now) == pytest.approx(30)
    assert retry_after_seconds({"retry-after": email.utils.formatdate(now - 30, usegmt=True)}, now) == 0
    assert retry_after_seconds({"retry-after": "soon"}, now) is None
    assert retry_after_seconds({}, now) is None


def test_backoff_grows_exponentially_with_bounded_jitter():
    policy, rng = RetryPolicy(max_retries=5, backoff_base_s=0.1, backoff_max_s=0.5), random.Random(0)
    for attempt, full in enumerate([0.1, 0.2, 0.4, 0.5, 0.5]):
        waits = [policy.delay(attempt, rng=rng) for _ in range(50)]
        assert all(full / 2 <= w < full for w in waits) and max(waits) - min(waits) > 0
    assert policy.delay(0, retry_after=12.0) == 12.0 and RetryPolicy(retry_after_max_s=5).delay(0, 12.0) == 5


def test_timeout_is_retried_then_raised():
    with ScriptedServer([Reply(delay_s=1.0)]) as server, pytest.raises(LVLMTimeoutError, match="0.2 s"):
        start = time.perf_counter()
        ask(backend(server, timeout_s=0.2, max_retries=1))
    assert len(server.received) == 2 and time.perf_counter() - start < 1.5


def test_timeout_then_answer_succeeds():
    with ScriptedServer([Reply(delay_s=1.0), Reply()]) as server:
        assert ask(backend(server, timeout_s=0.2)).text == "yes"


def test_connection_refused_is_retried_then_raised():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = OpenAIBackend("m", f"http://127.0.0.1:{port}/v1", **FAST)
    start = time.perf_counter()
    with pytest.raises(LVLMHTTPError, match="connection failed.*after 3 attempts") as error:
        ask(client)
    assert error.value.status is None and time.perf_counter() - start < 5


DELETE = object()


def patched(*path, value=DELETE, tokens=(("Ye", -0.2), ("s", -0.05))) -> dict:
    """A valid completion (one alternative per token) with the field at ``path`` set to ``value`` or deleted."""
    body = completion(tokens, top=1)
    *parents, last = path
    target = body
    for key in parents:
        target = target[key]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return body


CONTENT = ("choices", 0, "logprobs", "content")


@pytest.mark.parametrize(
    "body,problem",
    [
        (b"{not json", "malformed JSON"),
        (b"\xff\xfe\x00", "malformed JSON"),
        (b"[1, 2]", "not a chat completion: \\[1, 2\\]"),
        (b'"hello"', "not a chat completion: 'hello'"),
        ({"id": "x", "object": "error"}, "not a chat completion"),
        (completion(choices=[]), "no choices"),
        (completion(choices={"0": {}}), "malformed response: choices is an object, not an array"),
        (completion(choices=["yes"]), "malformed response: choices\\[0\\] is a string, not an object"),
        (patched("choices", 0, "message"), "choices\\[0\\].message is missing"),
        (patched("choices", 0, "message", value="yes"), "choices\\[0\\].message is a string, not an object"),
        (patched("choices", 0, "message", "content", value=None), "no message content"),
        (patched("choices", 0, "message", "content", value=42), "message.content is an integer, not a string"),
        (patched("choices", 0, "finish_reason", value=3), "choices\\[0\\].finish_reason is an integer, not a string"),
        (completion(logprobs=False), "no logprobs although they were asked for"),
        (patched("choices", 0, "logprobs", value=[]), "choices\\[0\\].logprobs is an array, not an object"),
        (patched(*CONTENT, value="Yes"), "choices\\[0\\].logprobs.content is a string, not an array"),
        (patched(*CONTENT, value=[]), "text but an empty logprobs list"),
        (patched(*CONTENT, 1, value=7), "content\\[1\\] is an integer, not an object"),
        (patched(*CONTENT, 1, "token"), "content\\[1\\].token is missing"),
        (patched(*CONTENT, 1, "token", value=5), "content\\[1\\].token is an integer, not a string"),
        (patched(*CONTENT, 1, "top_logprobs", value="s0"), "content\\[1\\].top_logprobs is a string, not an array"),
        (patched(*CONTENT, 1, "top_logprobs", 0, value=None), "top_logprobs\\[0\\] is null, not an object"),
        (patched(*CONTENT, 1, "top_logprobs", 0, "token"), "content\\[1\\].top_logprobs\\[0\\].token is missing"),
        (patched("usage", value="lots"), "malformed response: usage is a string, not an object"),
        (patched("usage", "prompt_tokens"), "usage.prompt_tokens is missing"),
        (patched("usage", "prompt_tokens", value=-3), "usage.prompt_tokens is negative \\(-3\\)"),
        (patched("usage", "prompt_tokens", value=1.5), "usage.prompt_tokens is a number, not an integer"),
        (patched("usage", "completion_tokens", value="7"), "usage.completion_tokens is a string, not an integer"),
        (patched("usage", "completion_tokens", value=True), "usage.completion_tokens is a boolean, not an integer"),
        (patched("model", value=["m"]), "malformed response: model is an array, not a string"),
    ],
)
def test_malformed_responses_are_typed_errors_naming_the_field_without_retry(body, problem):
    with ScriptedServer([Reply(body=body)]) as server, pytest.raises(LVLMResponseError, match=problem) as error:
        ask(backend(server))
    assert len(server.received) == 1 and f"{server.base_url} (model 'scripted-model')" in str(error.value)


@pytest.mark.parametrize(
    "where,value,problem",
    [
        ((1, "logprob"), None, "content\\[1\\].logprob is null"),
        ((1, "logprob"), DELETE, "content\\[1\\].logprob is missing"),
        ((1, "logprob"), math.nan, "content\\[1\\].logprob is NaN"),
        ((1, "logprob"), math.inf, "content\\[1\\].logprob is inf, above 0"),
        ((1, "logprob"), 0.5, "content\\[1\\].logprob is 0.5, above 0 beyond the rounding tolerance 0.0001"),
        ((1, "logprob"), "-0.1", "content\\[1\\].logprob is not a number \\(got str '-0.1'\\)"),
        ((1, "logprob"), True, "content\\[1\\].logprob is not a number \\(got bool 'True'\\)"),
        ((1, "logprob"), -(10**400), "content\\[1\\].logprob is out of the float range"),
        ((0, "top_logprobs", 0, "logprob"), None, "content\\[0\\].top_logprobs\\[0\\].logprob is null"),
        ((0, "top_logprobs", 0, "logprob"), math.nan, "content\\[0\\].top_logprobs\\[0\\].logprob is NaN"),
    ],
)
def test_unusable_log_probabilities_are_response_errors_naming_the_entry(where, value, problem):
    body = patched(*CONTENT, *where, value=value)
    with ScriptedServer([Reply(body=body)]) as server, pytest.raises(LVLMResponseError, match=problem):
        ask(backend(server), top_logprobs=1)
    assert len(server.received) == 1


def test_zero_and_rounding_probabilities_are_accepted():
    tokens = (("Ye", -math.inf), ("s", 3e-6))  # p = 0 (JSON -Infinity) and float32 rounding of p = 1
    with ScriptedServer([Reply(body=completion(tokens))]) as server:
        result = ask(backend(server))
    assert result.logprobs == [-math.inf, 3e-6] and uncertainty(result).value == 0.0


def test_undecodable_page_names_it_before_any_request():
    with ScriptedServer([Reply()]) as server, pytest.raises(ImageError, match="doc-42"):
        ask(backend(server), PageImage(b"\x89PNG not really", "doc-42"))
    assert server.received == []


def sent_images(received) -> list[Image.Image]:
    parts = [p for m in received.body["messages"] if isinstance(m["content"], list) for p in m["content"]]
    urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    return [Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) for url in urls]


def test_long_strip_is_resized_under_the_pixel_budget_keeping_aspect():
    strip = Image.new("RGB", (20000, 300), "white")
    with ScriptedServer([Reply()]) as server:
        assert ask(backend(server, max_pixels=100_000), PageImage(strip, "strip")).text == "yes"
    (image,) = sent_images(server.received[0])
    width, height = image.size
    assert width * height <= 100_000 and width * height > 95_000
    assert width / height == pytest.approx(20000 / 300, rel=0.02)


def test_request_carries_settings_logprobs_and_pages_in_order():
    pages = [PageImage(Image.new("RGB", (30, 20), c), f"p{i}") for i, c in enumerate(["red", "blue"])]
    with ScriptedServer([Reply(body=completion(top=2))]) as server:
        client = backend(server, image_format="jpeg")
        result = ask(client, *pages, max_new_tokens=7, top_logprobs=2, stop=["\n"], seed=3)
    body = server.received[0].body
    assert {k: body[k] for k in ("model", "max_tokens", "temperature", "logprobs", "top_logprobs", "stop", "seed")} == {
        "model": "scripted-model", "max_tokens": 7, "temperature": 0.0, "logprobs": True, "top_logprobs": 2,
        "stop": ["\n"], "seed": 3}
    kinds = [p["type"] for p in body["messages"][0]["content"]]
    assert kinds == ["image_url", "image_url", "text"]
    assert body["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    colours = [image.convert("RGB").getpixel((15, 10)) for image in sent_images(server.received[0])]
    assert colours[0][0] > 200 > colours[0][2] and colours[1][2] > 200 > colours[1][0]
    assert result.tokens[0].top == [("yes0", -0.1), ("yes1", -1.1)]
    assert (result.prompt_tokens, result.completion_tokens, result.finish_reason) == (11, 1, "stop")
    assert result.model == "scripted-model" and result.latency_s > 0 and not result.cached

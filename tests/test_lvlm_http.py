"""The HTTP path: ``hkrag.lvlm.serve`` (in-process and as a real loopback server) and the ``openai`` backend's
cache, concurrency and key hygiene. Offline; every server listens on 127.0.0.1 only."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import httpx
import pytest
from _lvlm_fake import FakeBackend, Reply, ScriptedServer, completion
from fastapi.testclient import TestClient
from PIL import Image

from hkrag.lvlm import (
    GenerationSettings,
    LVLMBackend,
    LVLMError,
    LVLMHTTPError,
    LVLMRequest,
    Message,
    PageImage,
    build_backend,
    uncertainty,
)
from hkrag.lvlm.data_uri import decode_data_uri, encode_page
from hkrag.lvlm.openai_backend import OpenAIBackend
from hkrag.lvlm.serve import Batcher, config_file, create_app, load_backend

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "conf" / "lvlm" / "phi3v_tiny.yaml"


def page(size=(60, 40), colour=(200, 30, 90), key="doc-1") -> PageImage:
    image = Image.new("RGB", size, "white")
    image.paste(colour, (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    return PageImage(image, key)


def image_part(p: PageImage) -> dict:
    return {"type": "image_url", "image_url": {"url": encode_page(p)}}


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(fake):
    with TestClient(create_app(fake, "fake", max_batch_size=4, batch_wait_ms=1)) as test_client:
        yield test_client


def chat(client: TestClient, content, **params):
    body = {"model": "fake", "messages": [{"role": "user", "content": content}], **params}
    return client.post("/v1/chat/completions", json=body)


# --- the server's request/response mapping (in-process) ---------------------------------------------------------


def test_server_maps_images_text_and_logprobs_to_openai_format(client, fake):
    p = page()
    response = chat(client, [image_part(p), {"type": "text", "text": "What is red?"}], max_tokens=4, temperature=0,
                    logprobs=True, top_logprobs=2)
    assert response.status_code == 200, response.text
    expected = fake.answer(LVLMRequest.user(p, "What is red?", settings=GenerationSettings(4, top_logprobs=2)))
    choice = response.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["finish_reason"] == "length" and expected.text.startswith("Answer é ")
    tokens = choice["logprobs"]["content"]
    assert [(t["token"], t["logprob"]) for t in tokens] == [(t.token, t.logprob) for t in expected.tokens]
    assert tokens[2]["bytes"] == [32, 195, 169]  # " é" in UTF-8
    assert [[(a["token"], a["logprob"]) for a in t["top_logprobs"]] for t in tokens] == [t.top for t in expected.tokens]
    assert response.json()["usage"] == {"prompt_tokens": 3 + 10, "completion_tokens": 4, "total_tokens": 17}


def test_logprobs_are_returned_only_when_asked_for(client):
    response = chat(client, "Hello there")
    assert response.status_code == 200 and response.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    "content,params,message",
    [
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}], {},
         "not a recognised image format"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], {}, "invalid base64"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/page.png"}}], {}, "URLs are not fetched"),
        ("hi", {"n": 2}, "n=2"),
        ("hi", {"stream": True}, "stream"),
        ("hi", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("hi", {"max_tokens": "many"}, "max_tokens"),
    ],
)
def test_bad_input_is_400_with_the_reason(client, content, params, message):
    response = chat(client, content, **params)
    assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_bad_role_and_missing_fields_are_400(client):
    assert "role" in client.post("/v1/chat/completions", json={"model": "fake", "messages": [
        {"role": "robot", "content": "hi"}]}).json()["error"]["message"]
    response = client.post("/v1/chat/completions", json={"model": "fake"})
    assert response.status_code == 400 and "messages" in response.json()["error"]["message"]


def test_unknown_model_is_404_and_backend_failure_is_500(client):
    assert chat(client, "hi", model="other").status_code == 404
    response = chat(client, "please explode")
    assert response.status_code == 500 and "the fake model exploded" in response.json()["error"]["message"]


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok", "model": "fake"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fake"]


def test_same_page_bytes_get_the_same_key():
    pages = (page(), page(key="renamed"), page(colour=(0, 0, 0)))
    first, again, other = (decode_data_uri(encode_page(p)) for p in pages)
    assert first.key == again.key != other.key and first.key.startswith("sha256:")
    assert encode_page(page()) == encode_page(page(key="renamed"))  # same bytes every call: a stable prompt prefix
    assert first.image.size == (60, 40)


def test_batcher_batches_concurrent_requests_and_isolates_a_failure(fake):
    batcher = Batcher(fake, max_batch_size=3, batch_wait_ms=300)
    questions = ["one", "two", "please explode", "four"]
    futures = [batcher.submit(LVLMRequest.user(q)) for q in questions]
    outcomes = [f.exception(timeout=10) or f.result().text for f in futures]
    batcher.close()
    assert isinstance(outcomes[2], RuntimeError)
    assert [o for i, o in enumerate(outcomes) if i != 2] == [fake.answer(LVLMRequest.user(q)).text
                                                             for q in ("one", "two", "four")]
    assert fake.calls == [3, 1, 1, 1, 1]  # a failed batch of 3 is retried one by one, then the 4th alone


def test_load_backend_reads_target_from_config_and_overrides(tmp_path):
    config = tmp_path / "fake.yaml"
    config.write_text("_target_: _lvlm_fake.FakeBackend\nmodel: from-config\nvocab_size: 10\n")
    backend = load_backend(str(config), ["vocab_size=77"])
    assert (type(backend).__name__, backend.model, backend.vocab_size) == ("FakeBackend", "from-config", 77)


def test_serve_config_is_a_conf_lvlm_name_or_a_path(tmp_path):
    assert config_file("phi3v_tiny") == TINY_CONFIG
    assert config_file(str(TINY_CONFIG)) == TINY_CONFIG
    with pytest.raises(FileNotFoundError, match=r"--config phi4: no such file, nor a conf/lvlm name \(one of \["):
        config_file("phi4")
    old = tmp_path / "old.yaml"
    old.write_text("kind: scripted\n")
    with pytest.raises(ValueError, match=r"an LVLM config needs _target_, the backend class .*got \['kind'\]"):
        load_backend(str(old), [])


# --- the openai backend: cache, concurrency, key hygiene (scripted loopback server) --------------------------------

FAST = dict(api_key_env=None, timeout_s=5.0, max_retries=1, backoff_base_s=0.01)


def test_second_identical_call_is_served_from_disk(tmp_path):
    request = LVLMRequest.user(page(), "Is it enough?")
    with ScriptedServer([Reply(body=completion((("Ye", -0.2), ("s", -0.05))))]) as server:
        first = OpenAIBackend("m", server.base_url, cache_dir=tmp_path, **FAST)(request)
        again = OpenAIBackend("m", server.base_url, cache_dir=tmp_path, **FAST)(request)  # a re-run
        assert len(server.received) == 1
        assert (first.cached, again.cached) == (False, True)
        assert (again.text, again.logprobs, again.prompt_tokens) == ("Yes", [-0.2, -0.05], 11)
        longer = LVLMRequest.user(page(), "Is it enough?", settings=GenerationSettings(max_new_tokens=9))
        assert not OpenAIBackend("m", server.base_url, cache_dir=tmp_path, **FAST)(longer).cached
        smaller = OpenAIBackend("m", server.base_url, cache_dir=tmp_path, max_pixels=500, **FAST)(request)
        other_model = OpenAIBackend("m2", server.base_url, cache_dir=tmp_path, **FAST)(request)
        assert not smaller.cached and not other_model.cached and len(server.received) == 4
    assert len(list(tmp_path.rglob("*.json"))) == 4


def test_unreadable_cache_entry_is_a_miss_and_is_rewritten(tmp_path, caplog):
    request = LVLMRequest.user("Hi")
    with ScriptedServer([Reply()]) as server:
        backend = OpenAIBackend("m", server.base_url, cache_dir=tmp_path, **FAST)
        backend(request)
        (entry,) = tmp_path.rglob("*.json")
        entry.write_text("{truncated")
        assert not backend(request).cached and len(server.received) == 2 and "unreadable" in caplog.text
        assert backend(request).cached and json.loads(entry.read_text())["result"]["text"] == "yes"


def test_generate_keeps_order_and_bounds_requests_in_flight(tmp_path):
    in_flight, peak, lock = [0], [0], threading.Lock()

    def answer(received):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        question = received.body["messages"][0]["content"]
        time.sleep(0.02 * (8 - int(question[1:])))  # later questions finish first
        with lock:
            in_flight[0] -= 1
        return completion(((question, -0.1),))

    requests = [LVLMRequest.user(f"q{i}") for i in range(8)] + [LVLMRequest.user("q0")] * 4
    with ScriptedServer([Reply(body=answer)]) as server:
        with OpenAIBackend("m", server.base_url, max_concurrency=3, cache_dir=tmp_path, **FAST) as backend:
            results = backend.generate(requests)
    assert [r.text for r in results] == [f"q{i}" for i in range(8)] + ["q0"] * 4
    assert 2 <= peak[0] <= 3


def answered(tokens, finish_reason="stop", text="Yes", generated=None, **options):
    """The result of the openai backend for a server answering ``text`` with ``tokens`` as its logprobs and
    ``generated`` as ``usage.completion_tokens`` (default: one per token)."""
    body = completion(tokens)
    body["choices"][0].update(finish_reason=finish_reason, message={"role": "assistant", "content": text})
    body["usage"]["completion_tokens"] = len(tokens) if generated is None else generated
    with ScriptedServer([Reply(body=body)]) as server:
        return OpenAIBackend("m", server.base_url, **FAST, **options)(LVLMRequest.user("Is it?"))


ANSWER = (("Ye", -0.2), ("s", -0.7))


@pytest.mark.parametrize(
    "end,finish_reason,options,kept",
    [
        ("<|im_end|>", "stop", {}, 2),  # Qwen, as vLLM lists it
        ("<|end|>", "stop", {}, 2),  # Phi-3
        ("<|eot_id|>", "stop", {}, 2),  # Llama 3
        ("", "stop", {}, 2),  # an end token detokenised with special tokens skipped
        ("<END>", "stop", {"end_tokens": ["<END>"]}, 2),  # configured
        ("<|im_end|>", "stop", {"end_tokens": []}, 3),  # not an end token then
        ("", "stop", {"generated": 4}, 3),  # the server left the end token out: the empty token is the answer's
        ("<|im_end|>", "length", {}, 3),  # generation did not end on it
        ("!", "stop", {}, 3),  # a stop string, not an end token
    ],
)
def test_a_trailing_end_token_is_not_part_of_the_answer(end, finish_reason, options, kept):
    result = answered((*ANSWER, (end, -0.05)), finish_reason, **options)
    assert [t.token for t in result.tokens] == [token for token, _ in ANSWER] + [end][: kept - 2]
    assert result.completion_tokens == options.get("generated", 3)  # the server's: the end token is paid for
    without_end = uncertainty(answered(ANSWER))
    assert (uncertainty(result) == without_end) is (kept == 2)


def test_without_logprobs_none_are_requested_or_required(tmp_path):
    plain = Reply(body=completion(logprobs=False))
    with ScriptedServer([plain]) as server:
        backend = OpenAIBackend("judge", server.base_url, logprobs=False, cache_dir=tmp_path, **FAST)
        result = backend(LVLMRequest.user("Grade it.", settings=GenerationSettings(top_logprobs=3)))
        with_logprobs = OpenAIBackend("judge", server.base_url, cache_dir=tmp_path, **FAST)
        with pytest.raises(LVLMError, match="no logprobs although they were asked for"):
            with_logprobs(LVLMRequest.user("Grade it.", settings=GenerationSettings(top_logprobs=3)))  # no cache hit
    assert (result.text, result.tokens, result.completion_tokens) == ("yes", [], 1)
    assert "logprobs" not in server.received[0].body and "top_logprobs" not in server.received[0].body
    assert server.received[1].body["logprobs"] is True and len(server.received) == 2


def test_backends_declare_their_capabilities():
    assert (LVLMBackend.vocab_size, LVLMBackend.exact_entropy) == (None, False)
    http = OpenAIBackend("m", "http://127.0.0.1:9/v1", vocab_size=151_936, **FAST)
    assert (http.vocab_size, http.exact_entropy) == (151_936, False)
    assert (FakeBackend().vocab_size, FakeBackend.exact_entropy) == (1000, False)


SECRET = "sk-hkrag-SECRET-4242"


def test_api_key_never_appears_in_errors_logs_reprs_or_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HKRAG_TEST_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    echo = Reply(500, body=lambda received: {"error": {"message": f"saw {received.headers['authorization']}"}})
    with ScriptedServer([echo, echo, Reply()]) as server:
        backend = OpenAIBackend("m", server.base_url, api_key_env="HKRAG_TEST_KEY", timeout_s=5, max_retries=1,
                                backoff_base_s=0.01, cache_dir=tmp_path)
        with pytest.raises(LVLMHTTPError) as error:
            backend(LVLMRequest.user("Hi"))
        assert backend(LVLMRequest.user("Hi again")).text == "yes"
    assert server.received[0].headers["authorization"] == f"Bearer {SECRET}"  # the echo did carry the key
    assert "saw Bearer ***" in str(error.value)
    shown = [str(error.value), repr(error.value), "".join(traceback.format_exception(error.value)), caplog.text,
             repr(backend), *(p.read_text() for p in tmp_path.rglob("*.json"))]
    assert "retry 1/1" in caplog.text and len(shown) == 6
    assert not [text for text in shown if SECRET in text]


def test_missing_key_variable_is_named():
    with pytest.raises(LVLMError, match="HKRAG_NO_SUCH_KEY is not set"):
        OpenAIBackend("m", "http://127.0.0.1:9/v1", api_key_env="HKRAG_NO_SUCH_KEY")


@pytest.mark.parametrize("name,model,key_env", [("openai", "Qwen/Qwen2.5-VL-7B-Instruct", "OPENAI_API_KEY"),
                                                  ("qwen_plus", "qwen-vl-plus", "DASHSCOPE_API_KEY")])
def test_configs_build_the_openai_backend(monkeypatch, name, model, key_env):
    from omegaconf import OmegaConf

    monkeypatch.setenv(key_env, "test-key")
    backend = build_backend(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "lvlm" / f"{name}.yaml")))
    assert isinstance(backend, OpenAIBackend) and (backend.model, backend.api_key_env) == (model, key_env)


def test_openai_backend_imports_and_builds_without_transformers_or_torch():
    """A client of an LVLM server needs neither: a fresh interpreter with both blocked imports and builds it."""
    code = (
        "import sys\n"
        "sys.modules['transformers'] = sys.modules['torch'] = None\n"
        "import hkrag.lvlm.openai_backend\n"
        "from hkrag.lvlm import build_backend\n"
        "backend = build_backend({'_target_': 'hkrag.lvlm.openai_backend.OpenAIBackend', 'model': 'm',\n"
        "                         'base_url': 'http://127.0.0.1:9/v1', 'api_key_env': None})\n"
        "assert backend.name == 'openai'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


# --- a real server process on loopback serving the tiny Phi3V ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """``python -m hkrag.lvlm.serve`` with conf/lvlm/phi3v_tiny.yaml on a free loopback port (stopped by PID)."""
    port, log_path = free_port(), tmp_path_factory.mktemp("serve") / "server.log"
    command = [sys.executable, "-m", "hkrag.lvlm.serve", "--config", str(TINY_CONFIG), "--port", str(port),
               "--served-model-name", "tiny", "--batch-wait-ms", "5", "--log-level", "warning"]
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server at {url} not healthy after {timeout_s} s")


def test_openai_backend_over_loopback_matches_the_backend_in_process(tiny_server):
    from omegaconf import OmegaConf

    settings = OmegaConf.to_container(OmegaConf.load(TINY_CONFIG))
    direct = build_backend(settings)  # built while the server starts
    process, url = tiny_server
    wait_healthy(process, url)
    ask = GenerationSettings(max_new_tokens=6, top_logprobs=2)
    requests = [
        LVLMRequest.user(page(), "What is on the page?", settings=ask),
        LVLMRequest([Message("system", ["Answer briefly."]),
                     Message("user", [page((90, 50), (10, 200, 30), "doc-2"), page(key="doc-1"), "Compare."])], ask),
        LVLMRequest.user("No pages here.", settings=ask),
    ]
    expected = [direct(request) for request in requests]
    with OpenAIBackend("tiny", f"{url}/v1", api_key_env=None, timeout_s=60, max_retries=0) as client:
        served = client.generate(requests)
    for got, want in zip(served, expected):
        assert [t.token for t in got.tokens] == [t.token for t in want.tokens] and got.tokens
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        for got_token, want_token in zip(got.tokens, want.tokens):
            assert [a for a, _ in got_token.top] == [a for a, _ in want_token.top]
            assert [lp for _, lp in got_token.top] == pytest.approx([lp for _, lp in want_token.top], abs=1e-5)
        assert (got.text, got.prompt_tokens, got.completion_tokens, got.finish_reason) == (
            want.text, want.prompt_tokens, want.completion_tokens, want.finish_reason)
        assert got.model == "tiny" and got.backend == "openai"


def test_agents_run_end_to_end_through_the_http_backend(tiny_server):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from agents import build_generator
    from hkrag.rag.records import Query

    process, url = tiny_server
    wait_healthy(process, url)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        generator = OmegaConf.to_container(compose("eval", ["generator.threshold=0", "generator.caps.max_iters=1",
                                                            "generator.caps.max_new_tokens.notes=4"]).generator)
    query = Query("q1", "What is on the page?", [page(key="doc-1"), page((90, 50), (10, 200, 30), "doc-2")], ["x"])
    with OpenAIBackend("tiny", f"{url}/v1", api_key_env=None, timeout_s=60, max_retries=0) as client:
        outcome = build_generator(generator, client).answer(query)
    assert not outcome.failed, outcome.failure
    assert outcome.route == "HQP" and [c.agent for c in outcome.calls][-1] == "summarizer"
    assert all(c.page_ids for c in outcome.calls) and outcome.calls[1].uncertainty is not None

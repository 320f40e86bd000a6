"""Text RAG (``generator.input=text``): pages reach the generator as their text, never as images.

Checks the prompt format ("Page n:\\n<text>", no image placeholder) on the scripted backend and the tiny
local Phi3V, that image mode is unchanged (golden prompts), the agents' routes on text pages, the missing
text error, the per-page word budget and its context check, and that the two modes never share a trace.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from PIL import Image

from agents import build_generator
from agents.prompts import build_request, shown
from hkrag.data.opendocvqa import load_corpus
from hkrag.lvlm import GenerationSettings, PageImage
from hkrag.lvlm.phi3v import Phi3VBackend, phi3_chat
from hkrag.lvlm.scripted import Reply, ScriptedBackend, request_text
from hkrag.rag.records import PageText, Query
from hkrag.rag.trace import load_trace
from hkrag.tasks import rag as rag_task
from hkrag.tasks import run_eval_task
from hkrag.tasks.common import UNGROUNDED
from hkrag.tasks.validation import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SMALL_DATA = [
    "data.synthetic.n_train=8", "data.synthetic.n_test=16", "data.synthetic.train_groups_per_style=1",
    "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "data.eval_datasets=[synchart]",
]
SETTINGS = GenerationSettings(max_new_tokens=4)
UNCERTAIN = -1.0
"""Every answer token at p = 1/e gives H′ = e·(−p·log p) = 1 > h = 0.8 (HQP); certain tokens give 0 (LQP)."""


def generator_config(**overrides) -> dict:
    config = yaml.safe_load((ROOT / "conf" / "generator" / "hkrag.yaml").read_text())
    return {**config, **overrides}


def text_pages() -> list[PageText]:
    return [PageText("Revenue 2019\nTotal: 42", "d1"), PageText("Footnote: in millions", "d2"),
            PageText("Unrelated page", "d3")]


def image_pages() -> list[PageImage]:
    return [PageImage(Image.new("RGB", (8, 8), (255, 255, 255)), key) for key in ("d1", "d2", "d3")]


def test_text_pages_are_numbered_text_blocks_before_the_prompt_and_no_image_is_sent():
    request = build_request(text_pages()[:2], "Question: total?", SETTINGS)
    assert request.images == []
    assert request.messages[0].content == ["Page 1:\nRevenue 2019\nTotal: 42\n\n", "Page 2:\nFootnote: in millions\n\n",
                                           "Question: total?"]
    chat = phi3_chat(request.messages)
    assert "<|image_" not in chat
    assert chat == ("<|user|>\nPage 1:\nRevenue 2019\nTotal: 42\n\nPage 2:\nFootnote: in millions\n\n"
                    "Question: total?<|end|>\n<|assistant|>\n")
    assert shown(text_pages()[:2], "Q") == "<text:d1>\n<text:d2>\nQ"


def test_image_mode_prompts_are_unchanged():
    pages = image_pages()[:2]
    request = build_request(pages, "Question: total?", SETTINGS)
    assert request.messages[0].content == [*pages, "Question: total?"]
    assert phi3_chat(request.messages) == "<|user|>\n<|image_1|>\n<|image_2|>\nQuestion: total?<|end|>\n<|assistant|>\n"
    assert shown(pages, "Q") == "<page:d1>\n<page:d2>\nQ"


def route_backend(certain: bool) -> ScriptedBackend:
    """Pruner: yes at two pages; answer certain (LQP) or not (HQP); the Decoupler's first restatement answers."""
    return ScriptedBackend([
        ("Do the 1 page", "no"),
        ("Reply with yes or no only.", "yes"),
        ("short answer only (a word", Reply("42", logprobs=0.0 if certain else UNCERTAIN)),
        ("Separate the fine print", "in millions\nAnswers the question: yes"),
        ("Look again at the pages", "in millions"),
        ("Describe the salient content", "a revenue table"),
    ], default="42 million", vocab_size=32064)


@pytest.mark.parametrize(("certain", "route", "steps"), [
    (True, "LQP", ["pruner", "pruner", "answer", "verify"]),
    (False, "HQP", ["pruner", "pruner", "answer", "salient", "fine_print", "decouple", "integrate"]),
])
def test_agents_route_text_pages_end_to_end(certain, route, steps):
    backend = route_backend(certain)
    generator = build_generator(generator_config(input="text"), backend)
    outcome = generator.answer(Query("q1", "What is the total?", text_pages()))

    assert not outcome.failed, outcome.failure
    assert outcome.route == route and [call.step for call in outcome.calls] == steps
    assert outcome.kept == ["d1", "d2"]
    assert all(request.images == [] for request in backend.requests)
    assert all(request_text(r).startswith("Page 1:\nRevenue 2019\nTotal: 42\n\n") for r in backend.requests)
    assert "Page 2:\nFootnote: in millions" in request_text(backend.requests[-1])
    assert outcome.calls[-1].prompt.startswith("<text:d1>\n<text:d2>\n")


def test_image_mode_agentic_trace_is_unchanged():
    backend = route_backend(certain=True)
    outcome = build_generator(generator_config(), backend).answer(Query("q1", "What is the total?", image_pages()))
    assert [c.step for c in outcome.calls] == ["pruner", "pruner", "answer", "verify"]
    assert [c.prompt for c in outcome.calls[:2]] == [
        "<page:d1>\nQuestion: What is the total?\nDo the 1 page(s) above contain enough information to answer the "
        "question? Reply with yes or no only.",
        "<page:d1>\n<page:d2>\nQuestion: What is the total?\nDo the 2 page(s) above contain enough information to "
        "answer the question? Reply with yes or no only.",
    ]
    assert [len(r.images) for r in backend.requests] == [1, 2, 2, 2]


@pytest.mark.parametrize("text", ["", "  \n", None])
def test_a_page_without_text_is_an_error_naming_page_and_column(text):
    with pytest.raises(ValueError, match=r"page 'doc-7' has no text in corpus column 'ocr_text'"):
        PageText(text, "doc-7", "ocr_text")


def test_page_text_is_cut_after_the_budget_of_words():
    page = PageText("alpha  beta\ngamma delta epsilon", "d")
    assert page.truncated(3).text == "alpha  beta\ngamma"
    assert page.truncated(5) is page and page.truncated(9) is page
    assert page.truncated(1).key == "d"


def test_text_pages_must_fit_the_backends_context():
    backend = ScriptedBackend([], default="x")
    backend.context_length = 3 * 1024 + 256 - 1  # top_k pages of max_page_tokens words plus the notes reply
    with pytest.raises(ValueError, match=r"generator.max_page_tokens=1024 .* context_length=3327"):
        build_generator(generator_config(input="text"), backend)
    build_generator(generator_config(input="text", max_page_tokens=1000), backend)
    build_generator(generator_config(), backend)  # image pages are not counted here


@pytest.mark.parametrize(("key", "value", "message"), [
    ("input", "pdf", "generator.input='pdf': expected one of ['image', 'text']"),
    ("max_page_tokens", 0, "generator.max_page_tokens=0: expected an integer >= 1"),
    ("text_column", "", "generator.text_column='': expected a corpus column name"),
])
def test_bad_text_settings_are_named(key, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_generator(generator_config(**{key: value}), ScriptedBackend([], default="x"))


def test_tiny_phi3v_answers_text_pages_without_image_tokens():
    backend = Phi3VBackend(base="tiny", seed=0)
    request = build_request(text_pages()[:2], "Question: total?", SETTINGS)
    result = backend(request)
    assert result.tokens and result.completion_tokens >= 1
    text_only = backend.count_prompt_tokens(build_request([], "".join(p.prompt(n) for n, p in
                                                                      enumerate(text_pages()[:2], 1))
                                                          + "Question: total?", SETTINGS))
    assert backend.count_prompt_tokens(request) == text_only == result.prompt_tokens


# ---- eval.py task=generation generator.input=text on the built-in corpus ----

def config(data_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("eval", [
            f"paths.data_dir={data_dir}", f"paths.output_dir={data_dir / 'out'}", *SMALL_DATA, "rag.max_queries=2",
            "task=generation", "lvlm=scripted", UNGROUNDED, *overrides,
        ])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    data_dir = tmp_path_factory.mktemp("text-rag-data")
    rag_task.prepare_data(config(data_dir).data)
    return data_dir


def test_generation_on_gold_page_text_sends_the_corpus_text_cut_to_the_budget(tmp_path, data, scripted_rag_backend):
    cfg = config(data, "generator.input=text", "generator.max_page_tokens=3")
    report = run_eval_task(cfg, tmp_path / "run")
    corpus = load_corpus(cfg.data.corpus_source, "synchart", "test")
    texts = dict(zip(corpus.doc_ids, corpus.texts()))

    assert report["overall"]["n"] == 2 and report["overall"]["failed"] == 0
    trace = load_trace(tmp_path / "run" / "trace.jsonl")
    first = trace[0].retrieved[0]
    expected = "Page 1:\n" + texts[first][: list(re.finditer(r"\S+", texts[first]))[2].end()] + "\n\n"
    assert request_text(scripted_rag_backend.requests[0]).startswith(expected)
    assert all(request.images == [] for request in scripted_rag_backend.requests)
    assert trace[0].calls[0].prompt.startswith(f"<text:{first}>\n")


def test_a_missing_text_column_stops_the_run_naming_it(tmp_path, data, scripted_rag_backend):
    with pytest.raises(ConfigError, match=r"generator.text_column='ocr_text': corpus .* has no such column"):
        run_eval_task(config(data, "generator.input=text", "generator.text_column=ocr_text"), tmp_path / "run")


def test_image_and_text_runs_never_share_a_trace(tmp_path, data, scripted_rag_backend):
    image, text = config(data), config(data, "generator.input=text")
    rag_task.resolve_retrieval_mode(image), rag_task.resolve_retrieval_mode(text)
    assert rag_task.run_identity(image)["generator"]["input"] == "image"
    assert rag_task.run_identity(text)["generator"]["input"] == "text"
    run_eval_task(image, tmp_path / "run")
    with pytest.raises(ValueError, match=r"other settings \(generator differ\)"):
        run_eval_task(text, tmp_path / "run")


def test_text_rag_with_the_bm25_retriever_reads_the_pages_bm25_ranked(tmp_path, data, scripted_rag_backend):
    cfg = config(data, "task=rag", "retriever=bm25", "generator.input=text", "rag.pools=[single]")
    report = run_eval_task(cfg, tmp_path / "run")

    assert report["overall"]["n"] == 2 and report["overall"]["failed"] == 0
    assert (tmp_path / "run" / "retrieval.md").is_file()
    trace = load_trace(tmp_path / "run" / "trace.jsonl")
    assert all(outcome.retrieved and outcome.pool == "single" for outcome in trace)
    assert trace[0].calls[0].prompt.startswith(f"<text:{trace[0].retrieved[0]}>\n")
    assert rag_task.run_identity(cfg)["retriever"]["name"] == "bm25"

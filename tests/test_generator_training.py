"""Generator fine-tuning (VDocGenerator's recipe, docs/training.md): labels, prompt, learning, training top-k,
and serving the trained adapter through the local backend, the HTTP server and the single-pass baseline."""

from __future__ import annotations

import base64
import io
import itertools
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import datasets
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image

from agents import build_generator
from hkrag.data.generator_pairs import GeneratorPair, read_pairs, sampled_pairs
from hkrag.data.opendocvqa import QUERY_PREFIX, Corpus, QAExample
from hkrag.lvlm import GenerationSettings, LVLMRequest, PageImage
from hkrag.lvlm.phi3v import Phi3VBackend
from hkrag.lvlm.scripted import ScriptedBackend
from hkrag.models.phi3v import tiny_phi3v
from hkrag.rag.records import Query
from hkrag.retrieval.generator_pairs import build_generator_pairs, check_sampling
from hkrag.retriever import LoraSettings, Phi3VRetriever
from hkrag.run_log import RunLogger
from hkrag.tasks.common import save_tiny_base
from hkrag.tasks.rag import question_text
from hkrag.training.generator import (
    IGNORE_INDEX,
    GeneratorCollator,
    GeneratorDataset,
    GeneratorExample,
    GeneratorTrainer,
    GeneratorTrainerConfig,
    causal_lm_lora,
    encode_example,
    single_pass_prompt,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
QUESTION = "What was the revenue in 2019?"


@pytest.fixture(scope="module")
def generator_cfg():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(overrides=["+generator=single_pass"]).generator


def page(i: int) -> Image.Image:
    image = Image.new("RGB", (56, 56), (255, 255, 255))
    image.paste((60 * i % 255, 30 * i % 255, 200), (8 * i % 40, 4, 8 * i % 40 + 16, 40))
    return image


def corpus(n: int = 4) -> Corpus:
    return Corpus(datasets.Dataset.from_dict({"doc_id": [f"d{i}" for i in range(n)],
                                              "image": [page(i) for i in range(n)]}))


def qa() -> list[QAExample]:
    return [QAExample("q0", QUERY_PREFIX + QUESTION, ("42", "forty-two"), ("d2", "d0")),
            QAExample("q1", QUERY_PREFIX + "Which colour is the bar?", ("blue",), ("d1",))]


def test_labels_mask_the_prompt_and_supervise_only_the_target(tiny):
    _, processor = tiny
    tok = processor.tokenizer
    prompt = "<|user|>\n<|image_1|>\nWhat is it?\n Answer briefly.<|end|>\n<|assistant|>\n"
    ids, labels = encode_example(processor, prompt, [5], "42")
    target = tok("42<|end|>\n<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert target[-3:] == tok.convert_tokens_to_ids(["<|end|>", "Ċ", "<|endoftext|>"])
    n_prompt = len(processor.prompt_ids(prompt, [5]))
    assert ids == processor.prompt_ids(prompt, [5]) + target and ids.count(-1) == 5
    assert labels == [IGNORE_INDEX] * n_prompt + target
    assert tok.decode([i for i in labels if i != IGNORE_INDEX]) == "42<|end|>\n<|endoftext|>"


def test_real_phi3_tokenizer_target_ids(reference_phi3v):
    from hkrag.models.phi3v import load_processor

    processor = load_processor(str(reference_phi3v), num_crops=4)
    _, labels = encode_example(processor, "<|user|>\nQ<|end|>\n<|assistant|>\n", [], "42")
    tok = processor.tokenizer
    supervised = [i for i in labels if i != IGNORE_INDEX]
    # as VDocRAG's code tokenises it (SentencePiece puts a "▁" after each special token)
    assert supervised == [29871, 29946, 29906, 32007, 29871, 13, 32000]
    assert tok.convert_ids_to_tokens(supervised) == ["▁", "4", "2", "<|end|>", "▁", "<0x0A>", "<|endoftext|>"]


def test_training_prompt_is_the_single_pass_prompt_byte_for_byte(generator_cfg):
    example = qa()[0]
    pages = [PageImage(page(i), f"d{i}") for i in range(4)]
    script = ScriptedBackend(default="42")
    build_generator(OmegaConf.to_container(generator_cfg, resolve=True), script).answer(
        Query("q0", question_text(example), pages))
    sent = script.requests[0]
    rendered = single_pass_prompt(generator_cfg)(question_text(example), pages[:3])
    assert rendered == Phi3VBackend.prompt(None, sent)
    assert rendered == f"<|user|>\n<|image_1|>\n<|image_2|>\n<|image_3|>\n{QUESTION}\n Answer briefly.<|end|>\n" \
                       "<|assistant|>\n"


def test_collator_pads_right_with_masked_labels(tiny):
    _, processor = tiny
    batch = GeneratorCollator(processor)([GeneratorExample("<|user|>\n<|image_1|>\nA long question here<|end|>\n"
                                                           "<|assistant|>\n", [page(1)], "7"),
                                          GeneratorExample("<|user|>\nQ<|end|>\n<|assistant|>\n", [], "seven")])
    mask, labels = batch["attention_mask"], batch["labels"]
    assert (labels[mask == 0] == IGNORE_INDEX).all() and mask[1, -1] == 0 and mask[0].all()
    assert batch["pixel_values"].shape[0] == 1 and (batch["input_ids"] < 0).sum() == (batch["input_ids"][0] < 0).sum()


def train_tiny(tmp_path: Path, generator_cfg, steps: int) -> tuple[list[float], Path, Path]:
    """Overfit the tiny generator on two examples; returns the losses, the saved base and adapter."""
    model, processor = tiny_phi3v(texts=["42", "blue"], num_crops=4, seed=0)
    base = save_tiny_base(model, processor, tmp_path / "base")
    model = causal_lm_lora(model, LoraSettings(r=8, alpha=16, dropout=0.0, modules_to_save=("lm_head",)))
    pairs = [GeneratorPair(ex.query_id, question_text(ex), ex.answers, ex.relevant_doc_ids[:1]) for ex in qa()]
    dataset = GeneratorDataset(pairs, corpus(), single_pass_prompt(generator_cfg))
    config = GeneratorTrainerConfig(batch_size=2, grad_accum=1, lr=1e-2, scheduler="constant", max_steps=steps,
                                    precision="fp32")
    trainer = GeneratorTrainer(model, processor, dataset, config, tmp_path, RunLogger(tmp_path))
    trainer.fit()
    adapter = trainer.save("final") / "adapter"
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return losses, base, adapter


@pytest.fixture(scope="module")
def trained(tmp_path_factory, generator_cfg):
    return train_tiny(tmp_path_factory.mktemp("generator"), generator_cfg, steps=60)


def test_a_few_steps_overfit_two_examples(trained):
    losses, _, _ = trained
    assert len(losses) == 60 and losses[-1] < 0.2 * losses[0]


def serving(backend):
    import uvicorn

    from hkrag.lvlm.serve import create_app

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(backend, "gen", batch_wait_ms=1), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_trained_adapter_serves_the_same_greedy_answer_everywhere(trained, generator_cfg):
    _, base, adapter = trained
    backend = Phi3VBackend(base=str(base), adapter=str(adapter), device="cpu", dtype="float32")
    example, pages = qa()[0], [PageImage(page(2), "d2")]
    text = f"{question_text(example)}\n Answer briefly."
    local = backend(LVLMRequest.user(*pages, text, settings=GenerationSettings(max_new_tokens=64))).text.strip()
    assert local == "42"
    outcome = build_generator(OmegaConf.to_container(generator_cfg, resolve=True), backend).answer(
        Query("q0", question_text(example), pages))
    assert outcome.answer == local
    buffer = io.BytesIO()
    page(2).save(buffer, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    body = {"model": "gen", "max_tokens": 64, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": uri}},
        {"type": "text", "text": text}]}]}
    server, thread, url = serving(backend)
    try:
        request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
    finally:
        server.should_exit = True
        thread.join(10)
    assert reply["choices"][0]["message"]["content"].strip() == local


def test_training_top_k_is_ranked_by_the_retriever_and_resumes(tmp_path):
    retriever = Phi3VRetriever.tiny(num_crops=4, seed=0)
    pages_corpus, examples = corpus(4), qa()
    identity = {"model": "tiny", "adapter": None}
    calls = []

    def make():
        calls.append(1)
        return retriever

    path = tmp_path / "pairs.jsonl"
    pairs = build_generator_pairs(path, examples, pages_corpus, "retrieved", 3, question_text, make, identity)
    docs = retriever.encode_documents([p.image for p in pages_corpus])
    queries = retriever.encode_queries([ex.query for ex in examples])
    expected = [[f"d{i}" for i in (queries[j] @ docs.T).argsort(descending=True)[:3].tolist()] for j in range(2)]
    assert [list(p.doc_ids) for p in pairs] == expected
    assert pairs[0].question == QUESTION and pairs[0].answers == ("42", "forty-two")
    again = build_generator_pairs(path, examples, pages_corpus, "retrieved", 3, question_text, make, identity)
    assert again == pairs and len(calls) == 1 and read_pairs(path) == pairs
    with pytest.raises(ValueError, match="top_k"):
        build_generator_pairs(path, examples, pages_corpus, "retrieved", 2, question_text, make, identity)


def test_sampled_page_sets_are_distinct_draws_from_the_ranked_top_depth(tmp_path):
    retriever = Phi3VRetriever.tiny(num_crops=4, seed=0)
    pages_corpus, examples = corpus(4), qa()
    identity = {"model": "tiny", "adapter": None}
    sampling = {"depth": 3, "draws": 5, "seed": 7}
    path = tmp_path / "sampled.jsonl"
    pairs = build_generator_pairs(path, examples, pages_corpus, "sampled", 2, question_text, lambda: retriever,
                                  identity, sampling)
    ranked = build_generator_pairs(tmp_path / "top3.jsonl", examples, pages_corpus, "retrieved", 3, question_text,
                                   lambda: retriever, identity)
    for example, top in zip(examples, ranked):
        drawn = [p.doc_ids for p in pairs if p.query_id == example.query_id]
        assert len(drawn) == len(set(drawn)) == 5  # 6 ordered pairs of 3 pages: 5 distinct draws
        assert all(len(ids) == 2 and set(ids) <= set(top.doc_ids) for ids in drawn)
    assert read_pairs(path) == pairs
    again = build_generator_pairs(tmp_path / "again.jsonl", examples[::-1], pages_corpus, "sampled", 2, question_text,
                                  lambda: retriever, identity, sampling)
    assert sorted(again, key=lambda p: (p.query_id, p.doc_ids)) == sorted(pairs, key=lambda p: (p.query_id, p.doc_ids))
    with pytest.raises(ValueError, match="sampling"):
        build_generator_pairs(path, examples, pages_corpus, "sampled", 2, question_text, lambda: retriever, identity,
                              {**sampling, "seed": 8})


def test_sampled_draws_stop_at_the_orders_a_short_ranking_allows():
    pair = GeneratorPair("q", "Q?", ("a",), ("d0", "d1"))
    drawn = sampled_pairs([pair], top_k=3, draws=10, seed=0)
    assert sorted(p.doc_ids for p in drawn) == [("d0", "d1"), ("d1", "d0")]
    assert sampled_pairs([pair], 1, 1, 0) == sampled_pairs([pair], 1, 1, 0) != []
    three = GeneratorPair("r", "R?", ("b",), ("d0", "d1", "d2"))
    every = sampled_pairs([three], top_k=3, draws=6, seed=1)  # all 3! orders, none left out or repeated
    assert sorted(p.doc_ids for p in every) == sorted(itertools.permutations(("d0", "d1", "d2")))
    assert sampled_pairs([GeneratorPair("e", "E?", ("c",), ())], 3, 4, 0) == []
    with pytest.raises(ValueError, match="draws >= 1, got top_k=3, draws=0"):
        sampled_pairs([pair], 3, 0, 0)


def test_sampled_settings_default_where_unset():
    assert check_sampling(None, 3) == {"depth": 10, "draws": 16, "seed": 0}
    assert check_sampling({"draws": 8}, 3) == {"depth": 10, "draws": 8, "seed": 0}


@pytest.mark.parametrize("sampling, message", [
    ({"depth": 10, "draw": 4}, r"unknown keys \['draw'\]"),
    ({"depth": 2}, "sampled.depth=2 is below generator.top_k=3"),
    ({"draws": 0}, "sampled.draws=0"),
    ({"draws": "many"}, "sampled.draws='many': expected an integer"),
    ({"depth": 2.5}, "sampled.depth=2.5: expected an integer"),
    (16, "sampled=16: expected a mapping"),
])
def test_sampled_pages_refuse_settings_that_cannot_draw(tmp_path, sampling, message):
    with pytest.raises(ValueError, match=message):
        build_generator_pairs(tmp_path / "s.jsonl", qa(), corpus(4), "sampled", 3, question_text, None, {}, sampling)


def test_gold_pages_use_the_relevant_doc_ids(tmp_path):
    pairs = build_generator_pairs(tmp_path / "gold.jsonl", qa(), None, "gold", 3, question_text)
    assert [p.doc_ids for p in pairs] == [("d2", "d0"), ("d1",)]
    with pytest.raises(ValueError, match="pages must be"):
        build_generator_pairs(tmp_path / "x.jsonl", qa(), None, "best", 3, question_text)


def test_train_py_dispatches_on_run_target():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        demo = compose(config_name="train")
        generator = compose(config_name="train", overrides=["experiment=generator_tiny"])
        paper = compose(config_name="train", overrides=["experiment=generator_vdocrag"])
    assert demo.run._target_ == "hkrag.tasks.training.run_training"
    assert generator.run._target_ == paper.run._target_ == "hkrag.tasks.generator_training.run_generator_training"
    assert paper.generator.prompts.single_pass == "{question}\n Answer briefly." and paper.generator.top_k == 3
    assert paper.generator_training.optim.batch_size * paper.generator_training.optim.grad_accum == 8
    assert paper.model.base == "microsoft/Phi-3-vision-128k-instruct"


def test_a_killed_generator_run_resumes_to_the_same_adapter(tmp_path):
    from safetensors.torch import load_file

    from hkrag.tasks.generator_training import run_generator_training
    from hkrag.training.checkpoint import CheckpointError

    run = tmp_path / "run"
    settings = [f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={run}", "experiment=generator_tiny",
                "data.synthetic.n_train=16", "data.synthetic.n_test=4", "data.synthetic.train_groups_per_style=1",
                "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "model.num_crops=4",
                "generator_training.max_queries=10", "generator_training.optim.grad_accum=2",
                "generator_training.optim.max_steps=4", "generator_training.optim.save_every=1"]

    def train(*overrides):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return run_generator_training(compose(config_name="train", overrides=[*settings, *overrides]), run)

    def adapter():
        return load_file(run / "checkpoints" / "final" / "adapter" / "adapter_model.safetensors")

    train()  # 10 examples in micro-batches of 2, 2 per step: 2.5 steps per epoch, so step 3 starts epoch 1
    whole = adapter()
    (run / "report.json").unlink()
    resumed = train(f"resume={run / 'checkpoints' / 'step-3'}")
    assert resumed["steps"] == 4
    assert all(torch_equal(whole[name], tensor) for name, tensor in adapter().items())
    with pytest.raises(CheckpointError, match="optim.lr"):
        train(f"resume={run / 'checkpoints' / 'step-2'}", "generator_training.optim.lr=0.5")


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())

"""Bad input, more families (issue 33): each fails naming the input, or is counted in a warning, never silently.

Families: pre-training page texts of other types or encodings, adapters made for another model, page counts below
what a setting asks for, generator examples longer than the model's context, repeated seeds, resumed runs whose
model changed, questions longer than the context, and text the server's tokenizer cannot encode.
"""

import io
import json
import logging
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import tiny_training_overrides
from PIL import Image
from starlette.testclient import TestClient

from hkrag.data.collators import PretrainingCollator, RetrieverCollator
from hkrag.data.generator_pairs import GeneratorPair, gold_pairs, warn_few_pages
from hkrag.data.opendocvqa import Corpus, DataError, QAExample, load_pretraining_corpus
from hkrag.data.pairs import pretraining_pairs, text_problem
from hkrag.lvlm import LVLMContextError, LVLMRequest, LVLMTextError, PageImage
from hkrag.lvlm.base import GenerationSettings
from hkrag.lvlm.phi3v import Phi3VBackend, phi3_chat
from hkrag.lvlm.serve import BadRequest, Limits, create_app, parse_request
from hkrag.models.phi3v import CheckpointNotFoundError, tiny_phi3v
from hkrag.retrieval.ablation import AblationError, load_multirun, load_run, summarize
from hkrag.retriever import AdapterMismatchError, LoraSettings, Phi3VRetriever, load_adapter
from hkrag.run_log import RunLogger
from hkrag.tasks.chain import ChainConfig
from hkrag.tasks.replica import ReplicaConfig, check_seeds
from hkrag.training.checkpoint import CheckpointError
from hkrag.training.generator import GeneratorDataset, GeneratorTrainer, GeneratorTrainerConfig, causal_lm_lora

sys.path.insert(0, str(Path(__file__).parent))
from test_ablation import write_job  # noqa: E402


def page_bytes(size=(56, 56)) -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", size, "white").save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def corpus_with_texts(texts, name="pre[docstruct/train]") -> Corpus:
    ids = [f"p{i}" for i in range(len(texts))]
    data = datasets.Dataset.from_dict({"doc_id": ids, "image": [page_bytes() for _ in ids], "text": texts})
    return Corpus(data.cast_column("image", datasets.Image()), name=name)


# --- pre-training page texts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("texts", "named"), [
    ([7, 8], "row 0 (doc_id 'p0'): int 7, not a string"),
    ([b"ab", b"\xff\xfe"], "row 1 (doc_id 'p1'): bytes b'\\xff\\xfe', not a string"),
    ([["a"], ["b", "c"]], "row 1 (doc_id 'p1'): list ['b', 'c'], not a string"),
])
def test_page_texts_that_are_not_strings_name_the_corpus_column_and_rows(texts, named):
    with pytest.raises(DataError, match="not UTF-8 strings") as error:
        pretraining_pairs(corpus_with_texts(texts), column="query")
    message = str(error.value)
    assert message.startswith("pre[docstruct/train]: column 'query' holds 2 page text(s)") and named in message


def test_page_texts_with_lone_surrogates_are_refused_and_blank_ones_are_counted(monkeypatch, caplog):
    assert text_problem("ok \x00 text") is None and text_problem(None) is None
    assert text_problem("bad \ud800 text") == "not encodable as UTF-8 (surrogates not allowed at character 4)"
    corpus = corpus_with_texts(["one", "two", "three"])
    monkeypatch.setattr(corpus, "texts", lambda: ["one", "tw\udcffo", "three"])  # Arrow cannot hold one; Python can
    with pytest.raises(DataError, match=r"row 1 \(doc_id 'p1'\): not encodable as UTF-8"):
        pretraining_pairs(corpus)
    with caplog.at_level(logging.WARNING):
        pairs = pretraining_pairs(corpus_with_texts([None, "", "  \n", "real text"]), column="query")
    assert [pair.query_id for pair in pairs] == ["p3"]
    assert "3 of 4 pages of pre[docstruct/train] have no text in column 'query' and were skipped" in caplog.text


def test_stored_page_text_that_is_not_utf8_is_named(tmp_path):
    """A parquet string column holding bytes that are not UTF-8 (Arrow does not check on write): datasets loads it,
    and reading the column failed with a bare UnicodeDecodeError naming no row."""
    offsets = pa.array([0, 2, 4], type=pa.int32()).buffers()[1]
    text = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"ok\xff\xfe")])
    images = pa.array([page_bytes()] * 2, type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"query": text, "image": images}), tmp_path / "data" / "train-00000-of-00001.parquet")
    corpus = load_pretraining_corpus(tmp_path, None, "train", "query")
    with pytest.raises(DataError, match=r"column 'query' holds 1 page text\(s\) that are not UTF-8 strings, e.g. row 1 "
                                        r"\(doc_id '1'\): invalid UTF-8: invalid start byte at byte 0"):
        pretraining_pairs(corpus, column="query")


# --- adapters made for another model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_adapter(tmp_path_factory) -> Path:
    """A LoRA adapter (r 4 on qkv_proj and o_proj) of the default tiny model: hidden 64, 2 layers."""
    folder = tmp_path_factory.mktemp("adapter") / "a"
    Phi3VRetriever.tiny(lora=LoraSettings(r=4, alpha=8, target_modules=["qkv_proj", "o_proj"])).model.save_pretrained(
        folder)
    return folder


@pytest.mark.parametrize(("config", "named"), [
    ({"hidden_size": 128, "intermediate_size": 256},
     r"another size \(or its adapter_config.json does not describe its weights\): 8 tensor\(s\) have other "
     r"shapes, e.g. \S+ \[4, 64\] in the adapter vs \[4, 128\] in this model "
     r"\(hidden_size=128\)"),
    ({"num_hidden_layers": 3},
     r"\(3 layers, .*4 LoRA tensor\(s\) of this model have no weight in it \(e.g. \['\S+layers\.2"),
    ({"num_hidden_layers": 1},
     r"\(1 layers, .*4 of its 8 tensor\(s\) have no place in this model \(e.g. \['\S+layers\.1"),
])
def test_an_adapter_of_another_model_size_is_refused_naming_it_and_the_shapes(small_adapter, config, named):
    model, _ = tiny_phi3v(**config)
    with pytest.raises(AdapterMismatchError, match=named) as error:
        load_adapter(model, small_adapter)
    assert str(small_adapter) in str(error.value) and isinstance(error.value, CheckpointNotFoundError)


def test_an_adapter_for_other_module_names_is_refused_by_the_generator_backend_too(small_adapter, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    for path in small_adapter.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "v_proj"]}))
    with pytest.raises(AdapterMismatchError, match=r"target_modules \['q_proj', 'v_proj'\]\): 8 of its 8 tensor"):
        Phi3VBackend(base="tiny", adapter=str(other), device="cpu")
    Phi3VBackend(base="tiny", adapter=str(small_adapter), device="cpu", seed=0)  # its own base takes it


# --- page counts --------------------------------------------------------------------------------------------------


def test_fewer_pages_than_top_k_are_counted_in_one_warning(caplog):
    qa = [QAExample("q1", "a?", ("x",), ("p1", "p2", "p3")), QAExample("q2", "b?", ("y",), ("p4",)),
          QAExample("q3", "c?", ("z",), ("p5", "p6"))]
    with caplog.at_level(logging.WARNING):
        pairs = gold_pairs(qa, 3, lambda ex: ex.query)
    assert [len(pair.doc_ids) for pair in pairs] == [3, 1, 2]
    assert ("2 of 3 queries have fewer than generator.top_k=3 pages (query q2 has 1): trained on the relevant pages "
            "they have (pages=gold)") in caplog.text
    assert warn_few_pages({"a": 5, "b": 5}, 5, "rag.top_k", "") == 0


# --- generator examples longer than the context -------------------------------------------------------------------


def test_generator_examples_longer_than_the_context_are_refused_before_training(tmp_path):
    model, processor = tiny_phi3v(texts=["what is it", "the answer"], max_position_embeddings=200,
                                  original_max_position_embeddings=200)
    corpus = corpus_with_texts(["a", "b"])
    pairs = [GeneratorPair("short", "what is it", ("the answer",), ("p0",)),
             GeneratorPair("long", "what is it", (" ".join(["answer"] * 300),), ("p0", "p1"))]
    dataset = GeneratorDataset(pairs, corpus, lambda question, pages: phi3_chat(LVLMRequest.user(*pages, question)
                                                                                .messages))
    peft = causal_lm_lora(model, LoraSettings(r=2, alpha=4, dropout=0.0, target_modules=["o_proj"]))
    config = GeneratorTrainerConfig(batch_size=1, grad_accum=1, precision="fp32")
    with pytest.raises(ValueError, match=r"1 of 2 generator training example\(s\) are longer than the model's context "
                                         r"\(max_position_embeddings=200 tokens\), e.g. query 'long': prompt \d+ \+ "
                                         r"target \d+ tokens"):
        GeneratorTrainer(peft, processor, dataset, config, tmp_path, RunLogger(tmp_path, enabled=False))
    GeneratorTrainer(peft, processor, GeneratorDataset(pairs[:1], corpus, dataset.render), config, tmp_path,
                     RunLogger(tmp_path, enabled=False))


# --- repeated seeds -----------------------------------------------------------------------------------------------


def test_repeated_seeds_and_seed_overrides_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"seeds \[0, 0, 1\] repeat \[0\]"):
        ChainConfig(tmp_path, seeds=(0, 0, 1))
    with pytest.raises(ValueError, match=r"seeds \[2, 1, 2\] repeat \[2\]"):
        ReplicaConfig(tmp_path, seeds=(2, 1, 2))
    with pytest.raises(ValueError, match=r"the override\(s\) \['trainer.seed=3'\] give every run the same seed"):
        ChainConfig(tmp_path, seeds=(0, 1), overrides=("trainer.seed=3",))
    with pytest.raises(ValueError, match=r"\['\+generator_training.optim.seed=5'\]"):
        check_seeds([0, 1], ["model.seed=4", "+generator_training.optim.seed=5"])
    check_seeds([0, 1, 2], ["model.seed=4"])  # the tiny model's initialisation is not the run's seed


def test_the_chain_command_refuses_repeated_seeds_as_a_usage_error(tmp_path, capsys):
    from hkrag.tasks.chain import main

    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path / "chain"), "--seeds", "0", "0", "1"])
    assert exited.value.code == 2 and "error: seeds [0, 0, 1] repeat [0]" in capsys.readouterr().err
    assert not (tmp_path / "chain").exists()  # nothing ran


def test_the_ablation_refuses_one_run_counted_twice(tmp_path):
    folder = tmp_path / "sweep"
    write_job(folder, 0, "infonce", 0)
    write_job(folder, 1, "hkrag", 0)
    write_job(folder, 2, "hkrag", 0)  # trainer.seed=0,0 in the sweep
    with pytest.raises(AblationError, match=r"2 repeats loss=hkrag trainer.seed=0 of \S+/1"):
        load_multirun(folder)
    (folder / "2" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(  # another override, the same setting
        ["experiment=demo", "loss=hkrag", "trainer.seed=0", "loss.alpha=1.0"]))
    settings = {"loss": {"name": "hkrag", "alpha": 1.0}, "trainer": {"seed": 0}}
    for number in (1, 2):
        (folder / str(number) / ".hydra" / "config.yaml").write_text(yaml.safe_dump(settings))
    with pytest.raises(AblationError, match=r"2 ran with the same settings and seed as \S+/1 \(config.yaml equal\)"):
        load_multirun(folder, by="auto")  # conditions loss=hkrag and loss=hkrag,loss.alpha=1.0: not a repeat by name
    runs = [load_run(folder / "0"), load_run(folder / "1")]
    with pytest.raises(AblationError, match="repeats hkrag seed=0"):
        summarize([*runs, runs[1]])  # the replica calls summarize on runs it loaded itself


# --- resumed runs whose model changed -----------------------------------------------------------------------------


def generator_trainer(tmp_path, seed=0, dropout=0.0, texts=("what is it", "the answer")):
    model, processor = tiny_phi3v(texts=texts, seed=seed)
    corpus = corpus_with_texts(["a"])
    pairs = [GeneratorPair("q", "what is it", ("the answer",), ("p0",))]
    dataset = GeneratorDataset(pairs, corpus, lambda question, pages: phi3_chat(LVLMRequest.user(*pages, question)
                                                                                .messages))
    torch.manual_seed(0)
    peft = causal_lm_lora(model, LoraSettings(r=2, alpha=4, dropout=dropout, target_modules=["o_proj"]))
    config = GeneratorTrainerConfig(batch_size=1, grad_accum=1, precision="fp32", max_steps=2)
    return GeneratorTrainer(peft, processor, dataset, config, tmp_path, RunLogger(tmp_path, enabled=False),
                            run_config={"base": str(tmp_path / "base")})


def test_resuming_a_generator_on_another_model_names_the_changed_keys(tmp_path):
    checkpoint = generator_trainer(tmp_path).save()
    generator_trainer(tmp_path).resume(checkpoint)  # the same model resumes
    with pytest.raises(CheckpointError, match=r"model.weights: '\w+' in the checkpoint, '\w+' now"):
        generator_trainer(tmp_path, seed=1).resume(checkpoint)  # another model.seed: another base
    with pytest.raises(CheckpointError, match=r"model.lora.dropout: 0.0 in the checkpoint, 0.3 now"):
        generator_trainer(tmp_path, dropout=0.3).resume(checkpoint)
    state = json.loads((checkpoint / "state.json").read_text())
    del state["config"]["model.weights"]  # a checkpoint written before the key existed still resumes
    (checkpoint / "state.json").write_text(json.dumps(state))
    generator_trainer(tmp_path, seed=1).resume(checkpoint)


def test_a_retriever_resumed_on_another_base_is_refused(tmp_path):
    from accelerate import Accelerator

    from hkrag.data.pairs import TrainingPair
    from hkrag.losses import HybridMaskLoss
    from hkrag.training.trainer import RetrieverTrainer, TrainerConfig

    corpus = corpus_with_texts(["a", "b", "c", "d"])
    pairs = [TrainingPair(f"q{i}", f"question {i}", (f"p{i}",)) for i in range(4)]

    def trainer(seed):
        retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=2, alpha=4, dropout=0.0), seed=seed)
        return RetrieverTrainer(retriever, HybridMaskLoss(), pairs, corpus, TrainerConfig(global_batch_size=2),
                                Accelerator(cpu=True), tmp_path, RunLogger(tmp_path, enabled=False))

    checkpoint = trainer(0).save()
    with pytest.raises(CheckpointError, match=r"other settings \(model.weights: '\w+' in the checkpoint, '\w+' now\)"):
        trainer(1).resume(checkpoint)


# --- questions longer than the context ----------------------------------------------------------------------------


def test_a_generator_prompt_past_the_context_is_refused_naming_both_lengths():
    backend = Phi3VBackend(base="tiny", device="cpu")
    page = PageImage(Image.new("RGB", (56, 56), "white"), "p")
    settings = GenerationSettings(max_new_tokens=4090)
    with pytest.raises(LVLMContextError, match=r"request 0 of the batch: the prompt is \d+ tokens and max_tokens is "
                                               r"4090: \d+ > the model's context of 4096 tokens; ask for at most \d+"):
        backend.generate([LVLMRequest.user(page, "what is it?", settings=settings)])
    with pytest.raises(LVLMContextError, match=r"the prompt is \d+ tokens, over the model's context of 4096"):
        backend.generate([LVLMRequest.user("word " * 5000)])
    with pytest.raises(LVLMTextError, match=r"messages\[0\].content\[1\] holds a lone surrogate U\+D800 at "
                                            r"character 2"):
        backend.generate([LVLMRequest.user(page, "a \ud800 question")])  # the tokenizer's own error names nothing


def test_over_long_queries_are_cut_counted_and_the_pretraining_query_has_its_own_limit(caplog):
    retriever = Phi3VRetriever.tiny(texts=["one two three four five six"])
    collator = RetrieverCollator(retriever.processor, max_query_length=4)
    with caplog.at_level(logging.WARNING):
        batch = collator.queries(["one two three four five six", "one", "six five four three two one"], ["a", "b", "c"])
    assert batch["input_ids"].shape[1] == 4 and collator.truncated == 2
    assert caplog.text.count("over the model's context of 4: truncated") == 1 and "query a is" in caplog.text
    pretraining = PretrainingCollator(retriever.collator, max_query_length=5, max_target_length=3)
    pages = [Image.new("RGB", (56, 56), "white")] * 2
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        out = pretraining(list(zip(["one two three four five six", "one"], pages)))
    assert out["query"]["input_ids"].shape[1] == 5 and pretraining.truncated_queries == 1
    assert pretraining.truncated_targets == 2  # "one" + <|end|>\n<|endoftext|> is over 3 tokens too
    assert "over loss.max_query_length of 5: truncated" in caplog.text
    assert "RCG target (a page's text) is" in caplog.text and "over loss.max_target_length=3: cut" in caplog.text
    capped = PretrainingCollator(RetrieverCollator(retriever.processor, max_query_length=4), max_query_length=512)
    assert capped._text_collator.max_query_length == 4  # never past the model's context
    retriever.collator.max_query_length = 4
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        retriever.encode_queries(["one two three four five six", "one", "six five four three"], batch_size=1)
    assert "2 of 3 queries were longer than the model's context of 4 tokens and were cut to it" in caplog.text


# --- text the server's tokenizer cannot encode ----------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "named"), [
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800 x"}]}', "messages[0].content",
     "the text holds a lone surrogate U+D800, which is not a character at character 3"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\xff"}]}]}',
     "messages[0].content[0].text", "(or the byte 0xff: not UTF-8) at character 1"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"]}', "stop[0]",
     "lone surrogate U+DC00"),
])
def test_text_no_tokenizer_can_encode_is_a_400_naming_the_field(body, param, named):
    with pytest.raises(BadRequest) as error:
        parse_request(body)
    assert error.value.param == param and error.value.message.startswith(f"{param}: ") and named in error.value.message
    with pytest.raises(BadRequest, match="not valid JSON: 'utf-8' codec can't decode byte 0xff"):
        parse_request(b'\xff{"model": "m"}')  # outside any string: still the body's JSON error


def test_the_server_answers_400_for_surrogates_and_serves_nul():
    app = create_app(Phi3VBackend(base="tiny", device="cpu"), "m", limits=Limits(), batch_wait_ms=1)
    with TestClient(app) as client:
        def post(content: bytes):
            return client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})

        bad = post(b'{"model": "m", "messages": [{"role": "user", "content": "a \\udfff"}], "max_tokens": 2}')
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content"
        assert bad.json()["error"]["code"] == "invalid_value"
        nul = post(b'{"model": "m", "messages": [{"role": "user", "content": "a \\u0000 b"}], "max_tokens": 2}')
        assert nul.status_code == 200  # the tokenizer encodes NUL (Phi-3's as the byte token <0x00>)
        words = json.dumps({"model": "m", "messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 2})
        long = post(words.encode())
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        assert long.json()["error"]["message"].startswith("messages: the prompt is ")


def test_a_refused_resume_of_train_py_leaves_the_runs_base_as_it_was(tmp_path):
    from hydra import compose, initialize_config_dir

    from hkrag.tasks.training import run_training

    run = tmp_path / "run"
    settings = tiny_training_overrides(tmp_path / "data", run)

    def train(*overrides):
        with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "conf"), version_base="1.3"):
            return run_training(compose(config_name="train", overrides=[*settings, *overrides]), run)

    train()
    base = (run / "base" / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match=r"model.seed: 0 in the checkpoint, 1 now; model.weights: '\w+' in the "
                                              r"checkpoint, '\w+' now"):
        train("resume=latest", "model.seed=1")
    assert (run / "base" / "model.safetensors").read_bytes() == base

"""The agents' curriculum (agents/curriculum.py): every step's training request is the request the agents send,
byte for byte; targets come from the drawn items and the qrels; the validation split leaks no page; the per-step
report counts what it says; a curriculum run records its trained steps."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image

from agents import build_generator
from agents.curriculum import AgentCurriculum, holds_answer, notes
from agents.steps import STEPS
from hkrag.data.generator_pairs import read_pairs
from hkrag.data.opendocvqa import QAExample
from hkrag.data.splits import ValidationSplit, page_group
from hkrag.data.synthetic import PageSpec, load_page_items, render_page
from hkrag.io import read_jsonl
from hkrag.lvlm import PageImage
from hkrag.lvlm.phi3v import phi3_chat
from hkrag.lvlm.scripted import ScriptedBackend
from hkrag.rag.records import CallRecord, PageTruth, Query, QueryOutcome, QueryTruth
from hkrag.rag.step_report import calibration, step_markdown, step_report, summary_markdown
from hkrag.tasks import agent_steps

CONF = Path(__file__).resolve().parents[1] / "conf"
ALL_STEPS = list(STEPS)
SPEC = PageSpec(doc_id="synchart-train-d000-p1", style="synchart", title="SALES", label="RED", value=45, source="ALPHA",
                code="K7", year="2019", bars=(30, 40, 50, 60), accent=1, page_no=3)


def generator_config(name: str = "hkrag", **changes) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        config = OmegaConf.to_container(compose(overrides=[f"+generator={name}"]).generator, resolve=True)
    return {**config, **changes}


def page_truth(doc_id: str, n: int) -> PageTruth:
    return PageTruth(doc_id, (f"T{n}", f"{10 + n}%", f"C{n}"), (f"SOURCE: S{n} / 2019", f"REF K{n}  P.{n}"),
                     {"code": f"K{n}"})


PAGES = [PageImage(Image.new("RGB", (28, 28), (40 * n, 90, 200)), f"doc-d00{n}-p1") for n in range(3)]
TRUTH = {page.key: page_truth(page.key, n) for n, page in enumerate(PAGES)}
CODE_Q = QueryTruth("q-code", "What is the reference code of the T1 chart sourced from S1?", ("K1",), (PAGES[1].key,),
                    "code")
VALUE_Q = QueryTruth("q-value", "What is the C1 value on the T1 chart?", ("11%", "11"), (PAGES[1].key,), "value")


def scripted(curriculum: AgentCurriculum, query: QueryTruth) -> tuple[ScriptedBackend, dict]:
    """A backend answering each request with the curriculum's target for the byte-identical request."""
    examples = {}
    for example in curriculum.examples(query, query.question, [PAGES, PAGES[1:2]], TRUTH):
        examples[example.request.fingerprint("m")] = example

    def reply(request):
        example = examples.get(request.fingerprint("m"))
        assert example is not None, f"the agents sent a request the curriculum lacks:\n{phi3_chat(request.messages)}"
        assert phi3_chat(request.messages) == phi3_chat(example.request.messages)
        return example.target

    return ScriptedBackend(reply), examples


@pytest.mark.parametrize("query", [CODE_Q, VALUE_Q], ids=["answered", "capped"])
def test_every_request_the_agents_send_is_a_curriculum_example_byte_for_byte(query):
    curriculum = AgentCurriculum(generator_config(), ALL_STEPS)
    sent_steps = set()
    for name, changes in [("hkrag", {}), ("hkrag", {"threshold": 0.0}), ("no_pruner", {"threshold": 0.0}),
                          ("no_decoupler", {}), ("single_pass", {})]:
        backend, examples = scripted(curriculum, query)
        outcome = build_generator(generator_config(name, **changes), backend).answer(
            Query(query.query_id, query.question, PAGES, list(query.answers)))
        assert not outcome.failed, outcome.failure
        assert outcome.answer == query.answers[0]  # every step answered with its target: the agents end right
        sent_steps |= {call.step for call in outcome.calls}
        for call, request in zip(outcome.calls, backend.requests, strict=True):
            assert examples[request.fingerprint("m")].step == call.step
    assert sent_steps == set(STEPS)  # every step was sent, and each was matched above
    assert agent_steps.STEPS == tuple(STEPS)


def test_the_pruner_learns_the_qrels_on_a_ranked_set():
    curriculum = AgentCurriculum(generator_config(), ["pruner"])

    def labels(relevant: tuple[str, ...]) -> list[tuple[int, str]]:
        query = dataclasses.replace(CODE_Q, relevant=relevant)
        return [(example.iteration, example.target) for example in curriculum.examples(query, "Q?", [PAGES])]

    assert labels((PAGES[1].key,)) == [(1, "no"), (2, "yes")]
    assert labels((PAGES[0].key,)) == [(1, "yes")]  # the Pruner stops at its first yes
    assert labels(("elsewhere",)) == [(1, "no"), (2, "no")]  # no relevant page: keep the buffer
    strict = AgentCurriculum(generator_config(), ALL_STEPS, answer_unanswerable=False)
    unanswerable = dataclasses.replace(CODE_Q, relevant=("elsewhere",))
    assert {ex.step for ex in strict.examples(unanswerable, "Q?", [PAGES], TRUTH)} == {
        "pruner", "salient", "fine_print", "decouple"}  # no answer learnt from pages that cannot hold it
    assert {ex.step for ex in strict.examples(CODE_Q, "Q?", [PAGES], TRUTH)} == set(STEPS)
    both = AgentCurriculum(generator_config(), ["pruner", "answer"], orders=["ranked", "relevant_last"])
    shown = [(ex.step, ex.target, [p.key for p in ex.request.images]) for ex in both.examples(CODE_Q, "Q?", [PAGES])]
    a, b, c = (page.key for page in PAGES)
    assert shown == [("pruner", "no", [a]), ("pruner", "yes", [a, b]), ("answer", "K1", [a, b]),
                     ("answer", "K1", [a, b, c]), ("pruner", "no", [a, c]),  # [a] again: given once
                     ("answer", "K1", [a, c, b])]  # the relevant page last
    first = AgentCurriculum(generator_config(), ["pruner"], orders=["relevant_first"])
    assert [(ex.target, [p.key for p in ex.request.images]) for ex in first.examples(CODE_Q, "Q?", [PAGES])] == [
        ("yes", [b])]


def test_note_targets_are_the_drawn_items_by_hand(tmp_path):
    _, items = render_page(SPEC)
    row = {"split": "train", **dataclasses.asdict(SPEC), "items": [dataclasses.asdict(item) for item in items]}
    (tmp_path / "pages.jsonl").write_text(json.dumps(row) + "\n")
    loaded = load_page_items(tmp_path, "train")[SPEC.doc_id]
    truth = {SPEC.doc_id: PageTruth(SPEC.doc_id, tuple(loaded["salient"]), tuple(loaded["fine_print"]),
                                    loaded["fields"])}
    page = [PageImage(Image.new("RGB", (8, 8)), SPEC.doc_id)]
    assert notes(page, truth, "salient") == "Page 1: SALES; 45%; RED"  # title, then the value above the label
    assert notes(page, truth, "fine_print") == "Page 1: SOURCE: ALPHA / 2019; REF K7  P.3"
    assert loaded["fields"]["code"] == "K7" and loaded["fields"]["page_no"] == "3"
    code = QueryTruth("q", "What is the reference code of the SALES chart sourced from ALPHA?", ("K7",), (SPEC.doc_id,))
    assert holds_answer(page, code, truth)
    assert holds_answer(page, dataclasses.replace(code, answers=("P.3", "3")), truth)  # the page number
    assert not holds_answer(page, dataclasses.replace(code, answers=("45%", "45")), truth)  # a salient value
    assert not holds_answer(page, dataclasses.replace(code, relevant=("other",)), truth)  # not the asked page
    curriculum = AgentCurriculum(generator_config(), ["decouple", "fine_print"])
    targets = {(ex.step, ex.iteration): ex.target for ex in curriculum.examples(code, code.question, [page], truth)}
    assert targets == {("fine_print", 1): "Page 1: SOURCE: ALPHA / 2019; REF K7  P.3",
                       ("decouple", 1): "Page 1: SOURCE: ALPHA / 2019; REF K7  P.3\nAnswers the question: yes"}
    with pytest.raises(FileNotFoundError, match="pages.jsonl"):
        load_page_items(tmp_path / "elsewhere")
    with pytest.raises(KeyError, match="no drawn items"):
        notes(page, {}, "salient")


def test_the_shipped_reader_tokenizer_spells_every_target():
    """generator_agents_tiny starts from weights/reader_tiny, whose byte-level BPE is fixed: every target (notes with
    their layout, the marker line, answers) must tokenise without an unknown token and decode back exactly."""
    from hkrag.models.phi3v.loading import load_processor

    tokenizer = load_processor(str(Path(__file__).resolve().parents[1] / "weights" / "reader_tiny" / "base"),
                               None).tokenizer
    _, items = render_page(SPEC)
    truth = {SPEC.doc_id: PageTruth(SPEC.doc_id, tuple(i.text for i in items if i.kind == "salient"),
                                    tuple(i.text for i in items if i.kind == "fine_print"))}
    query = QueryTruth("q", "What is the reference code of the SALES chart from ALPHA?", ("K7",), (SPEC.doc_id,))
    curriculum = AgentCurriculum(generator_config(), ALL_STEPS)
    page = [PageImage(Image.new("RGB", (8, 8)), SPEC.doc_id)]
    targets = {example.target for example in curriculum.examples(query, query.question, [page], truth)}
    assert {"K7", "Page 1: SALES; 45%; RED"} <= targets and any("Answers the question: yes" in t for t in targets)
    for target in targets | {"Answers the question: no", "P.3", "2019", "PURPLE", "yes", "no"}:
        ids = tokenizer(target, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == target


def test_a_bad_curriculum_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown steps \\['judge'\\]"):
        AgentCurriculum(generator_config(), ["judge"])
    with pytest.raises(ValueError, match="kept"):
        AgentCurriculum(generator_config(), ["answer"], kept=["best"])
    with pytest.raises(ValueError, match="orders"):
        AgentCurriculum(generator_config(), ["answer"], orders=[])
    with pytest.raises(ValueError, match="need the pages' drawn items"):
        AgentCurriculum(generator_config(), ["salient"]).examples(CODE_Q, "Q", [PAGES])


def test_the_validation_split_holds_out_whole_documents():
    qa = [QAExample(f"q{d}-{p}-{kind}", "Q", ("a",), (f"synchart-train-d{d:03d}-p{p}",))
          for d in range(40) for p in range(1, 4) for kind in ("salient", "fine_print")]
    split = ValidationSplit(0.25, seed=3)
    train, validation = split.split(qa)
    assert len(train) + len(validation) == len(qa) and 0 < len(validation) < len(qa) / 2
    groups = {page_group(d) for ex in validation for d in ex.relevant_doc_ids}
    assert groups.isdisjoint(page_group(d) for ex in train for d in ex.relevant_doc_ids)
    assert all(len({split.held_out(f"{group}-p{p}") for p in range(1, 7)}) == 1 for group in groups)
    assert split.split(list(reversed(qa)))[1] == list(reversed(validation))  # order-free, deterministic
    assert page_group("synfine-train-d012-p5") == "synfine-train-d012" and page_group("loose") == "loose"
    straddling = QAExample("q", "Q", ("a",), (sorted(groups)[0] + "-p1", train[0].relevant_doc_ids[0]))
    assert split.split([straddling]) == ([], [])
    with pytest.raises(ValueError, match="fraction"):
        ValidationSplit(1.0)


def call(step: str, pages: list[str], output: str = "", **fields) -> CallRecord:
    return CallRecord(step, "", pages, step=step, output=output, **fields)


def test_the_step_report_counts_by_hand():
    truth = {"q": CODE_Q}
    a, b, c = (page.key for page in PAGES)  # b is relevant
    calls = [call("pruner", [a], decision="yes"), call("pruner", [a], decision="no"),  # FP, TN
             call("pruner", [a, b], output="yes"), call("pruner", [a, b], output="No"),  # TP, FN
             call("fine_print", [a, b], "Page 2: REF K1  P.1", iteration=1),  # code held, strings not all
             call("fine_print", [a, b], "Page 2: SOURCE: S1 / 2019; REF K1  P.1", iteration=1),
             call("fine_print", [a, b], "Page 2: REF K10", iteration=1),  # K10 is not K1
             call("fine_print", [a, b], "K1", iteration=2),  # t > 1: not counted
             call("fine_print", [a], "K0", iteration=1),  # no relevant page: not counted
             call("decouple", [a, b], decision="yes"), call("decouple", [a], decision="yes"),  # right, wrong
             call("answer", [b], "K1", uncertainty=0.1), call("answer", [b], "K2", uncertainty=0.7),
             call("answer", [b], "K1", uncertainty=0.3), call("verify", [b], " K1 "), call("integrate", [b], "x"),
             call("single_pass", [a, b, c], "k1")]
    outcome = QueryOutcome("q", CODE_Q.question, ["K1"], calls=calls, answer="K1")
    report = step_report([outcome], truth, TRUTH)
    pruner = report["pruner"]
    assert pruner["counts"] == {"tp": 1, "fp": 1, "tn": 1, "fn": 1}
    assert pruner["accuracy"]["rate"] == 0.5 and pruner["precision_yes"]["rate"] == 0.5
    assert pruner["recall_yes"]["rate"] == 0.5 and 0 < pruner["accuracy"]["low"] < 0.5 < pruner["accuracy"]["high"]
    assert report["notes"]["fine_print code"] == {**report["notes"]["fine_print code"], "hits": 2, "n": 3}
    assert report["notes"]["fine_print strings"]["hits"] == 1
    assert (report["decouple_marker"]["hits"], report["decouple_marker"]["n"]) == (1, 2)
    answers = {step: (row["hits"], row["n"]) for step, row in report["answers"].items()}
    assert answers == {"answer": (2, 3), "verify": (1, 1), "integrate": (0, 1), "single_pass": (1, 1), "final": (1, 1)}
    table = report["calibration"]
    assert table["auroc_lower_is_right"] == 1.0 and [row["n"] for row in table["bins"]] == [1, 1, 0, 1, 0]
    assert [(row["from"], row["hits"]) for row in table["bins"][:2]] == [(0.0, 1), (0.2, 1)]
    markdown = step_markdown(report)
    assert "| pruner: yes/no accuracy | 50.0 [" in markdown and "| [0.8, 1.0] | 0 | — (n = 0) |" in markdown
    assert "| decouple: \"answers the question\" right | 50.0 [" in summary_markdown({"a": report, "b": report})
    with pytest.raises(KeyError, match="no ground truth"):
        step_report([outcome], {}, TRUTH)


def test_calibration_reads_lower_uncertainty_as_likelier_right():
    mixed = calibration([(0.1, False), (0.9, True), (0.5, True), (0.5, False), (1.0, True)])
    assert mixed["auroc_lower_is_right"] == pytest.approx(0.5 / 6)  # 6 (right, wrong) pairs, one tie: higher H′ right
    assert mixed["bins"][-1]["n"] == 2  # 0.9 and 1.0 (the closed last bin)
    assert calibration([(0.2, True)])["auroc_lower_is_right"] is None


def curriculum_run(tmp_path: Path, *extra: str) -> dict:
    """A two-step training run of the agents' curriculum on a small corpus; its report."""
    from hkrag.tasks.generator_training import run_generator_training

    run = tmp_path / "run"
    overrides = [f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={run}", "experiment=generator_agents_tiny",
                 "data.synthetic.n_train=24", "data.synthetic.n_test=4", "data.synthetic.train_groups_per_style=2",
                 "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "model.num_crops=4",
                 "generator_training.init_from=null", "generator_training.retriever.run_dir=null",
                 "generator_training.validation.fraction=0.3", "generator_training.optim.max_steps=2",
                 "generator_training.optim.batch_size=2", "model.lora.r=4", "model.lora.alpha=4", *extra]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")  # as train.py saves it
    return run_generator_training(cfg, run)


def test_a_curriculum_run_records_its_trained_steps(tmp_path):
    run = tmp_path / "run"
    report = curriculum_run(tmp_path)
    assert report["trained_steps"] == ALL_STEPS and set(report["examples_per_step"]) == set(STEPS)
    held = set(report["validation_queries"])
    assert held and report["queries"] + len(held) <= 24 + 16  # 16 synfine questions; straddlers in neither
    split = ValidationSplit(0.3)
    for source in ("gold", "retrieved"):
        pairs = [json.loads(line) for line in (run / f"generator_pairs_{source}.jsonl").read_text().splitlines()[1:]]
        assert all(split.held_out(pair["doc_ids"][0]) for pair in pairs if pair["query_id"] in held and
                   source == "gold")
    saved = json.loads((run / "report.json").read_text())
    assert saved["trained_steps"] == ALL_STEPS
    checkpoint = json.loads((run / "checkpoints" / "final" / "state.json").read_text())
    assert checkpoint["config"]["trained_steps"] == ALL_STEPS


def test_the_readers_scores_on_a_runs_pruner_calls_reuse_its_shards_and_rank_its_first_page(tmp_path):
    from hkrag.index.shards import load_shards
    from hkrag.io import write_jsonl_gz
    from hkrag.tasks import reader_on_pruner_calls as reader

    run, held = tmp_path / "run", curriculum_run(tmp_path)["validation_queries"]
    calls = [{"query_id": query_id, "n": n, "label": i % 2 == 0, "p_yes": 0.5} for i, query_id in enumerate(held)
             for n in (1, 2)]
    write_jsonl_gz(tmp_path / "calls.jsonl.gz", calls)
    shards = {path.name: path.stat().st_mtime_ns for path in (run / "embeddings-train").iterdir()}
    reader.main([str(run), "--calls", str(tmp_path / "calls.jsonl.gz"), "--out", str(tmp_path / "out")])
    rows = read_jsonl(tmp_path / "out" / "reader_calls.jsonl.gz")
    assert [row["query_id"] for row in rows] == held  # the n = 1 calls, in order
    assert {path.name: path.stat().st_mtime_ns for path in (run / "embeddings-train").iterdir()} == shards
    ids, _ = load_shards(run / "embeddings-train")
    scores = reader.query_scores(run, set(held))
    first = {pair.query_id: pair.doc_ids[0] for pair in read_pairs(run / "generator_pairs_retrieved.jsonl")}
    for row in rows:  # the top cosine is the score of the page the run's ranking put first
        assert row["cosine"] == pytest.approx(float(scores[row["query_id"]][ids.index(first[row["query_id"]])]))
    assert json.loads((tmp_path / "out" / "reader_calls.json").read_text())["summary"]["z"]["n"] == len(held)


def test_a_dedicated_balanced_pruner_stage_trains_what_it_says(tmp_path):
    curriculum = "generator_training.curriculum"
    report = curriculum_run(tmp_path, f"+{curriculum}.balance_pruner=true", f"+{curriculum}.focus=[pruner]",
                            f"+{curriculum}.others_share=0.5", "generator_training.validation=null",
                            f"+{curriculum}.orders=[ranked,relevant_first]")
    targets, per_step = report["pruner_targets"], report["examples_per_step"]
    assert targets["yes"] == targets["no"] and per_step["pruner"] == 2 * targets["yes"] == report["examples"] / 2


def test_the_example_mean_weighs_each_example_once():
    import math

    import torch

    from hkrag.training.generator import IGNORE_INDEX, example_mean_nll

    logits = torch.zeros(2, 4, 3)
    logits[0, 0, 1] = math.log(2)  # p(1) = 2/4 at row 0's first position: its one target costs log 2
    labels = torch.tensor([[IGNORE_INDEX, 1, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX, 0, 0, 0]])  # 1 and 3 targets
    per_row = [math.log(2), math.log(3)]  # uniform over 3 classes for row 1
    assert example_mean_nll(logits, labels).item() == pytest.approx(sum(per_row) / 2)
    token_mean = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 3), labels[:, 1:].reshape(-1))
    assert token_mean.item() == pytest.approx((math.log(2) + 3 * math.log(3)) / 4)  # what loss_mean=token gives


def test_the_fit_check_samples_the_trained_questions_evenly_and_never_a_held_out_one(tmp_path, builtin_data):
    qa_source = str(builtin_data / "qa")
    cfg = OmegaConf.create({"data": {"qa_source": qa_source, "train": {"qa_config": "default"}}})
    qa = agent_steps.load_qa(qa_source, "default", "train")
    held = [ex.query_id for ex in qa[::16]]
    (tmp_path / "report.json").write_text(json.dumps({"validation_queries": held}))
    validation = agent_steps.held_out_queries(tmp_path, cfg, "validation")
    training = agent_steps.held_out_queries(tmp_path, cfg, "training")
    trained = [ex for ex in qa if ex.query_id not in set(held)]
    step = len(trained) // len(held)
    assert [ex.query_id for ex in validation] == held
    assert len(training) == len(held) and step >= 2
    assert [ex.query_id for ex in training] == [ex.query_id for ex in trained[:step * len(held):step]]
    with pytest.raises(ValueError, match="validation and training splits"):
        agent_steps.page_sets(tmp_path, cfg, "test", training, "retrieved")
    (tmp_path / "report.json").write_text(json.dumps({"validation_queries": []}))
    with pytest.raises(ValueError, match="held out no validation queries"):
        agent_steps.held_out_queries(tmp_path, cfg, "training")


def test_the_step_report_overrides_the_generators_keys_and_refuses_an_unknown_one():
    from hydra.errors import ConfigCompositionException

    assert agent_steps.generator_conf("hkrag", ["threshold=0.35"])["threshold"] == 0.35
    assert agent_steps.generator_conf("hkrag")["threshold"] == 0.8
    with pytest.raises(ConfigCompositionException, match="generator.thresh"):
        agent_steps.generator_conf("hkrag", ["thresh=0.35"])

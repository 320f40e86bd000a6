"""The Pruner as a scored classifier and as a visual reranker (docs/agents.md "The Pruner's P(yes)", docs/rerank/).

P(yes) read from the first token (the full vocabulary on local backends, the listed candidates otherwise), recorded
on every call, its NaN refused naming the call; its AUROC with a bootstrap interval over questions and the accuracy
at a validation threshold in the step report; ``retriever=rerank`` reordering a first stage's top k by it.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

from agents import build_generator
from agents.context import Caps
from agents.prompts import Prompts
from agents.pruner import PageScorer, read_yes_no
from hkrag.data.opendocvqa import QAExample
from hkrag.io import read_jsonl
from hkrag.lvlm import GenerationSettings, LVLMBackend, LVLMResult, PageImage, TokenLogprob
from hkrag.lvlm.local import token_statistics
from hkrag.lvlm.scripted import Reply, ScriptedBackend
from hkrag.lvlm.words import vocabulary_word_ids, word_start_ids, word_token_ids
from hkrag.rag.records import CallRecord, Query, QueryOutcome, QueryTruth
from hkrag.rag.step_report import auroc, auroc_interval, best_threshold, step_markdown, step_report
from hkrag.retrieval.baselines import baselines_report
from hkrag.retrieval.evaluation import REPORTED_METRICS
from hkrag.retrieval.metrics import expected_name
from hkrag.retrieval.rerank import RerankRanker
from hkrag.retrieval.rerank_report import per_query_rows
from hkrag.tasks.rankers import bind_ranker, needs_model

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PRUNER = "Reply with yes or no only"


def generator_config() -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_container(compose(overrides=["+generator=hkrag"]).generator, resolve=True)


def result(first: TokenLogprob, text: str | None = None) -> LVLMResult:
    return LVLMResult(first.token if text is None else text, [first], 1, 1, 0.0, "stop", "t", "t")


def pages(n: int) -> list[PageImage]:
    return [PageImage(Image.new("RGB", (8, 8), (40 * i, 0, 0)), f"p{i + 1}") for i in range(n)]


# P(yes) ------------------------------------------------------------------------------------------------------------


def test_p_yes_from_the_full_distribution_wins_over_the_listed_candidates():
    """The full-vocabulary masses (0.2 yes, 0.6 no) decide, not the candidates (only "no" listed)."""
    first = TokenLogprob("no", math.log(0.55), top=[("no", math.log(0.55))],
                         words={"yes": math.log(0.2), "no": math.log(0.6)})
    reading = read_yes_no(result(first))
    assert not reading.yes and reading.source == "full"
    assert (reading.p_yes, reading.p_no, reading.probability) == pytest.approx((0.2, 0.6, 0.25))


def test_p_yes_imputes_the_most_an_unlisted_class_can_hold():
    """Only "no" (0.7) and "maybe" (0.2) listed: "yes" gets min(0.2, 1 − 0.9) = 0.1, so P(yes) = 0.1 / 0.8."""
    first = TokenLogprob("no", math.log(0.7), top=[("no", math.log(0.7)), ("maybe", math.log(0.2))])
    reading = read_yes_no(result(first))
    assert reading.source == "top_k" and (reading.p_yes, reading.p_no) == pytest.approx((0.0, 0.7))
    assert reading.probability == pytest.approx(0.125)


def test_a_nan_p_yes_is_an_error_naming_the_value():
    first = TokenLogprob("no", math.log(0.9), words={"yes": math.nan, "no": math.log(0.9)})
    with pytest.raises(ValueError, match=r"P\(yes\) is NaN: yes mass nan, no mass 0.9.* \(full distribution"):
        read_yes_no(result(first))


class NaNBackend(LVLMBackend):
    """Answers "no" with a NaN yes mass."""

    name = model = "nan"

    def generate(self, requests):
        first = TokenLogprob("no", math.log(0.9), words={"yes": math.nan, "no": math.log(0.9)})
        return [result(first) for _ in requests]


def test_a_nan_p_yes_fails_the_query_naming_the_pruner_call():
    outcome = build_generator(generator_config(), NaNBackend()).answer(Query("q1", "What?", pages(3), gold=["1"]))
    assert outcome.failed
    assert outcome.failure.startswith("pruner: call n=1 on pages ['p1']: P(yes) is NaN: yes mass nan")
    assert outcome.calls[0].error.startswith("call n=1 on pages ['p1']")


def test_pruner_requests_word_masses_and_records_p_yes_in_the_trace():
    top = [("no", math.log(0.6)), ("yes", math.log(0.3))]
    script = ScriptedBackend([(PRUNER, Reply("no", logprobs=math.log(0.6), top=[top]))], default="42")
    outcome = build_generator(generator_config(), script).answer(Query("q1", "What?", pages(3), gold=["42"]))
    pruner = [call for call in outcome.calls if call.step == "pruner"]
    assert [r.settings.word_mass for r in script.requests[:2]] == [("yes", "no")] * 2
    assert script.requests[2].settings.word_mass == ()  # the Judger's answer asks for none
    assert [(c.p_source, c.yes_probability) for c in pruner] == [("top_k", pytest.approx(1 / 3))] * 2
    again = QueryOutcome.from_dict(outcome.to_dict())
    assert again.calls[0].yes_probability == pytest.approx(1 / 3) and again.calls[0].p_source == "top_k"


def test_token_statistics_sum_each_words_mass_over_the_vocabulary():
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
    stats = token_statistics([logits], torch.tensor([[3]]), top_k=1, word_ids=[[0, 2], [3], []])
    assert stats.word_logprobs[0, 0].tolist() == pytest.approx([math.log(0.4), math.log(0.4), -math.inf])


def test_tokens_read_as_words_ignoring_case_markers_and_punctuation():
    assert word_token_ids(["▁Yes", "yes", ".", "No", "nope", "YES!"], ("yes", "no")) == [[0, 1, 5], [3]]


def test_generation_settings_refuse_an_empty_word():
    with pytest.raises(ValueError, match=r"word_mass words must be non-empty words, got \['▁'\]"):
        GenerationSettings(word_mass=("yes", "▁"))


def test_the_shipped_generator_gives_the_full_vocabulary_masses():
    """The local backend answers the Pruner's word_mass from the whole distribution: the classes' masses are at
    least what the listed candidates of each class hold."""
    from hkrag.lvlm.phi3v import Phi3VBackend

    weights = ROOT / "weights" / "generator_agents_tiny"
    backend = Phi3VBackend(base=str(weights / "base"), adapter=str(weights / "checkpoints/final/adapter"),
                           device="cpu", dtype="float32")
    config = generator_config()
    scorer = PageScorer(backend, Prompts.from_config(config["prompts"]), Caps.from_config(config["caps"]), 5)
    [request] = [scorer_request(scorer, "What is the reference code?", pages(1)[0])]
    first = backend(request).tokens[0]
    reading = read_yes_no(result(first))
    listed = [(token.strip().lower(), math.exp(lp)) for token, lp in first.top]
    assert reading.source == "full" and set(first.words) == {"yes", "no"}
    assert reading.p_yes >= sum(p for t, p in listed if t == "yes") - 1e-6
    assert reading.p_no >= sum(p for t, p in listed if t == "no") - 1e-6
    assert scorer("What is the reference code?", pages(1)) == pytest.approx([reading.probability])
    backend.close()


def scorer_request(scorer: PageScorer, question: str, page: PageImage):
    from agents.context import step_request

    return step_request(scorer.prompts, scorer.caps, question, "pruner", [page], scorer.top_logprobs, n="1")[1]


def test_page_scorer_asks_about_each_page_alone():
    top = [("yes", math.log(0.8)), ("no", math.log(0.1))]
    script = ScriptedBackend([(lambda r: r.images[0].key == "p2", Reply("yes", logprobs=math.log(0.8), top=[top])),
                              (PRUNER, Reply("no", logprobs=math.log(0.9), top=[[("no", math.log(0.9))]]))])
    config = generator_config()
    scorer = PageScorer(script, Prompts.from_config(config["prompts"]), Caps.from_config(config["caps"]), 5)
    assert scorer("What?", pages(3)) == pytest.approx([0.1 / 1.0, 0.8 / 0.9, 0.1])
    assert [[page.key for page in r.images] for r in script.requests] == [["p1"], ["p2"], ["p3"]]
    assert all("Do the 1 page(s)" in r.messages[0].text for r in script.requests)
    silent = ScriptedBackend([(PRUNER, Reply("no", logprobs=None))])
    with pytest.raises(ValueError, match="pruner score of page 'p1' for 'What\\?': the scripted backend returned no "
                                         "token probabilities"):
        PageScorer(silent, scorer.prompts, scorer.caps, 5)("What?", pages(1))


# The step report ---------------------------------------------------------------------------------------------------


def test_auroc_by_hand():
    assert auroc([0.9, 0.2, 0.6, 0.4], [True, False, False, True]) == pytest.approx(3 / 4)
    assert auroc([0.5, 0.5], [True, False]) == 0.5
    assert auroc([0.9, 0.2, 0.4], [True, False, True], weights=[1, 1, 2]) == auroc(
        [0.9, 0.2, 0.4, 0.4], [True, False, True, True])
    assert auroc([0.3, 0.4], [True, True]) is None


def test_auroc_interval_resamples_whole_questions():
    scores, labels = [0.9, 0.2, 0.6, 0.4, 0.8, 0.1], [True, False, False, True, True, False]
    found = auroc_interval(scores, labels, ["a", "a", "b", "b", "c", "c"], n_resamples=200)
    assert found["auroc"] == pytest.approx(8 / 9) and found["questions"] == 3 and found["positives"] == 3
    assert found["low"] <= found["auroc"] <= found["high"] <= 1.0 and found["resamples"] <= 200


def test_the_threshold_maximises_accuracy_nearest_one_half():
    rows = [{"p_yes": p, "label": label} for p, label in [(0.1, False), (0.3, True), (0.35, False), (0.8, True)]]
    assert best_threshold(rows) == pytest.approx(0.575)  # 0.2 and 0.575 both give 3 of 4
    assert best_threshold([{"p_yes": None, "label": True}]) is None


def pruner_call(page_ids: list[str], p_yes: float | None) -> CallRecord:
    return CallRecord("pruner", "", page_ids, step="pruner", iteration=len(page_ids), output="no", decision="no",
                      yes_probability=p_yes, p_source=None if p_yes is None else "full")


def test_step_report_gives_the_pruners_auroc_by_pool_and_evidence_and_accuracy_at_a_given_threshold():
    calls = {"q1": [pruner_call(["a"], 0.2), pruner_call(["a", "g1"], 0.7)],
             "q2": [pruner_call(["g2"], 0.6), pruner_call(["g2"], None)], "q3": [pruner_call(["b"], 0.65)]}
    pools = {"q1": "all", "q2": "single", "q3": "all"}
    outcomes = [QueryOutcome(q, "?", ["1"], pool=pools[q], calls=calls[q]) for q in calls]
    truths = {q: QueryTruth(q, "?", ("1",), (f"g{q[1]}",)) for q in ("q1", "q2", "q3")}
    report = step_report(outcomes, truths, evidence={"q1": "salient", "q2": "fine_print", "q3": "salient"},
                         threshold=0.62, threshold_source="validation")
    scores = report["pruner"]["p_yes"]
    assert scores["calls"] == 5 and scores["unscored"] == 1 and scores["sources"] == {"full": 4}
    assert scores["auroc"]["auroc"] == pytest.approx(3 / 4)  # yes {0.7, 0.6} vs no {0.2, 0.65}
    assert scores["by_pool"]["all"]["auroc"] == 1.0 and scores["by_pool"]["single"]["auroc"] is None
    assert scores["by_evidence"]["salient"]["auroc"] == 1.0
    assert scores["threshold"] == {"value": 0.62, "chosen_on": "validation"}
    assert scores["accuracy_at_threshold"]["hits"] == 2 and scores["accuracy_at_threshold"]["n"] == 4
    text = step_markdown(report)
    assert "| all | 0.750 [" in text and "P(yes) ≥ 0.6200 (threshold chosen on validation): 50.0" in text


# The reranker ------------------------------------------------------------------------------------------------------


class FirstStage:
    name = "first"

    def __init__(self, runs: dict) -> None:
        self.runs, self.depths = runs, []

    def rank(self, qa, corpus, depth, corpus_key="corpus"):
        self.depths.append(depth)
        return self.runs


class Corpus(dict):
    def __init__(self, ids) -> None:
        super().__init__({doc_id: SimpleNamespace(image=None) for doc_id in ids})


def example(query_id: str = "q1", relevant: tuple[str, ...] = ("d2",)) -> QAExample:
    return QAExample(query_id, "Query: What?", ("1",), relevant, "fine_print")


def scorer_of(values: dict):
    return lambda ex, shown: [values[page.key] for page in shown]


def test_rerank_orders_the_top_k_by_p_yes_above_the_rest_in_first_stage_order():
    first = FirstStage({"q1": {"d1": 0.9, "d2": 0.8, "d3": 0.7, "d4": 0.6, "d5": 0.5}})
    ranker = RerankRanker(first, scorer_of({"d1": 0.2, "d2": 0.9, "d3": 0.5}), depth=3)
    run = ranker.rank([example()], Corpus(["d1", "d2", "d3", "d4", "d5"]), 5, "all")
    assert run["q1"] == pytest.approx({"d2": 1.9, "d3": 1.5, "d1": 1.2, "d4": 0.5, "d5": 0.0})
    assert first.depths == [5] and ranker.cost["calls"] == 3 and ranker.cost["queries"] == 1
    assert [p["first_rank"] for p in ranker.trace[0]["pages"]] == [1, 2, 3]


def test_rerank_scores_every_page_tied_at_the_depth():
    first = FirstStage({"q1": {"d1": 0.9, "d2": 0.8, "d3": 0.8, "d4": 0.1}})
    ranker = RerankRanker(first, scorer_of({"d1": 0.1, "d2": 0.2, "d3": 0.3}), depth=2)
    ranker.rank([example()], Corpus(["d1", "d2", "d3", "d4"]), 4, "all")
    assert ranker.cost["calls"] == 3 and first.depths == [4]


@pytest.mark.parametrize(("depth", "pool", "message"), [
    (0, 5, "retriever.depth=0: the rerank depth must be an integer from 1 to the pool's pages"),
    (6, 5, "retriever.depth=6: the rerank depth must be an integer from 1 to 5, the pages of pool 'all'"),
])
def test_a_rerank_depth_outside_the_pool_is_an_error(depth, pool, message):
    ids = [f"d{i}" for i in range(pool)]
    with pytest.raises(ValueError, match=re_escape(message)):
        RerankRanker(FirstStage({}), scorer_of({}), depth=depth).rank([example()], Corpus(ids), 5, "all")


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_nan_score_stops_the_reranker_naming_the_page():
    first = FirstStage({"q1": {"d1": 0.9, "d2": 0.8}})
    ranker = RerankRanker(first, scorer_of({"d1": 0.3, "d2": math.nan}), depth=2)
    with pytest.raises(ValueError, match="gave page 'd2' of query 'q1' the score nan: expected a probability"):
        ranker.rank([example()], Corpus(["d1", "d2"]), 2, "all")


def test_the_rerank_report_scores_both_stages_per_query():
    trace = [{"pool": "all", "query_id": "q1", "seconds": 0.5, "pages": [
        {"doc_id": "d1", "first_rank": 1, "first_score": 0.9, "score": 0.1},
        {"doc_id": "d2", "first_rank": 2, "first_score": 0.8, "score": 0.7}]}]
    [row] = per_query_rows(trace, {"q1": example()})
    assert row["first"]["ndcg@5"] == pytest.approx(1 / math.log2(3)) and row["reranked"]["E[ndcg@5]"] == 1.0
    assert row["calls"] == 2 and row["dataset"] == "q1"


def test_a_rerank_trace_of_other_questions_is_refused_naming_them():
    trace = [{"pool": "all", "query_id": "q9", "seconds": 0.5, "pages": []}]
    with pytest.raises(ValueError, match=r"1 reranked queries have no question in the given QA sets, e.g. \['q9'\]"):
        per_query_rows(trace, {"q1": example()})


def test_baselines_table_gives_a_reranked_rows_calls_and_seconds_per_query():
    results = {"all": {name: 0.5 for metric in REPORTED_METRICS for name in (metric, expected_name(metric))},
               "num_queries": 2}
    rows = {"dense": {"results": {"synfine": {"all": results}}},
            "rerank": {"results": {"synfine": {"all": results}}, "rerank": {"calls_per_query": 10.0,
                                                                             "seconds_per_query": 0.3}}}
    report = baselines_report(rows, {"dense": 1.0, "rerank": 3.0})
    assert "| dense | 1.0 | — | — |" in report["table"] and "| rerank | 3.0 | 10.0 | 0.30 |" in report["table"]
    assert report["json"]["rerank"]["rerank"]["calls_per_query"] == 10.0


def test_retriever_rerank_composes_and_binds_its_first_stage_and_scorer():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("eval", ["retriever=rerank", "retriever.depth=7"])
    factory = instantiate(cfg.retriever)
    assert isinstance(factory.keywords["first"], functools.partial) and needs_model({"rerank": factory})
    dense = FirstStage({})
    model = SimpleNamespace(ranker=lambda settings, work_dir: dense)
    ranker = bind_ranker(factory, model, None, Path("."), scorer_of({}))
    assert isinstance(ranker, RerankRanker) and ranker.first is dense and ranker.depth == 7
    with pytest.raises(ValueError, match="retriever=rerank needs a page scorer"):
        bind_ranker(factory, model, None, Path("."))


def test_per_query_rows_are_written_as_reproducible_gzipped_json_lines(tmp_path):
    import gzip

    from hkrag.io import write_jsonl_gz

    rows = [{"query_id": "q1", "p_yes": 0.25, "label": True}, {"query_id": "q2", "p_yes": None, "label": False}]
    first, second = write_jsonl_gz(tmp_path / "a.jsonl.gz", rows), write_jsonl_gz(tmp_path / "b.jsonl.gz", rows)
    assert first.read_bytes() == second.read_bytes()
    assert [json.loads(line) for line in gzip.open(first, "rt")] == rows


def test_rerank_settings_are_checked_before_any_work():
    from hkrag.retrieval.rerank import check_settings

    with pytest.raises(ValueError, match=r"retriever.rerank='bm25': expected one of \['pruner'\]"):
        check_settings("bm25", 10)
    with pytest.raises(ValueError, match="retriever.depth=-1: the rerank depth must be an integer from 1"):
        check_settings("pruner", -1)


def test_the_validation_threshold_is_read_from_either_report_layout(tmp_path):
    import json

    from hkrag.rag.step_report import validation_threshold

    report = {"pruner": {"p_yes": {"threshold": {"value": 0.3516, "chosen_on": "this report"}}}}
    (tmp_path / "run.json").write_text(json.dumps(report))
    (tmp_path / "steps.json").write_text(json.dumps({"reports": {"agents-retrieved": report}}))
    assert validation_threshold(tmp_path / "run.json") == validation_threshold(tmp_path / "steps.json") == 0.3516
    (tmp_path / "none.json").write_text(json.dumps({"pruner": {"p_yes": {"threshold": {"value": None}}}}))
    with pytest.raises(ValueError, match="none.json holds no Pruner P\\(yes\\) threshold"):
        validation_threshold(tmp_path / "none.json")


def test_a_word_spelt_in_several_tokens_counts_the_token_it_starts_with():
    texts = ["y", "e", "s", "n", "o", " ", "No", "Ye"]
    spelled = {"yes": [0, 1, 2], " yes": [5, 0, 1, 2], "Yes": [7, 2], "no": [3, 4], "No": [6], " no": [5, 3, 4]}
    encode = lambda text: spelled.get(text, [5, 5])  # noqa: E731
    # "y" and "Ye" start spellings of yes, "n" one of no; the bare space starts both and reads as neither.
    assert word_start_ids(texts, ("yes", "no"), encode) == [[0, 7], [3]]
    assert vocabulary_word_ids(texts, ("yes", "no"), encode) == [[0, 7], [3, 6]]  # "No" reads as no
    shared = {"no": [3, 4], "not": [3, 4, 1]}
    assert word_start_ids(texts, ("no", "not"), lambda text: shared.get(text, [5, 5])) == [[], []]  # "n" starts both


def test_the_shipped_tiny_tokenizer_spells_yes_and_no_from_y_and_n():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "weights" / "reader_tiny" / "base")
    texts = [tokenizer.decode([token_id]) for token_id in range(len(tokenizer))]
    yes, no = vocabulary_word_ids(texts, ("yes", "no"), lambda t: tokenizer(t, add_special_tokens=False)["input_ids"])
    assert tokenizer("yes", add_special_tokens=False)["input_ids"][0] in yes
    assert tokenizer("no", add_special_tokens=False)["input_ids"][0] in no
    assert {texts[i].strip().lower() for i in yes} <= {"y", "ye", "yes"} and not set(yes) & set(no)


PRUNER_STAGES = Path(__file__).resolve().parents[1] / "docs" / "rerank" / "pruner_stage"


@pytest.mark.parametrize("stage", sorted(p.name for p in PRUNER_STAGES.iterdir() if p.is_dir()))
def test_a_committed_pruner_stage_auroc_re_derives_from_its_calls(stage):
    """docs/rerank/pruner_stage/<stage>: the AUROC of P(yes) in validation_steps.json (and the fit check's in
    training_steps.json, where committed) follows from the committed per-call rows (one row per Pruner call of the
    agents on the reader's top 3)."""
    folder = PRUNER_STAGES / stage
    splits = ["validation"] + ["training"] * (folder / "training_steps.json").is_file()
    for split in splits:
        calls = read_jsonl(folder / f"{split}_pruner_calls.jsonl.gz")
        reported = json.loads((folder / f"{split}_steps.json").read_text())["reports"]["agents-retrieved"]["pruner"]
        found = reported["p_yes"]["auroc"]
        assert found["n"] == len(calls) and found["positives"] == sum(c["label"] for c in calls)
        assert auroc([c["p_yes"] for c in calls], [c["label"] for c in calls]) == pytest.approx(found["auroc"])
        assert reported["counts"]["tp"] + reported["counts"]["fp"] == sum(c["said_yes"] for c in calls)


def test_the_readers_statistics_by_hand():
    from hkrag.tasks.reader_on_pruner_calls import reader_statistics

    found = reader_statistics(np.array([0.1, 0.9, 0.5]))
    spread = np.sqrt((0.4 ** 2 + 0 + 0.4 ** 2) / 3)  # population std of 0.9, 0.5, 0.1 around 0.5
    assert found == pytest.approx({"cosine": 0.9, "margin": 0.4, "z": 0.4 / spread})
    assert reader_statistics(np.array([0.3, 0.3]))["z"] == 0.0
    for bad in (np.array([0.9]), np.array([0.9, np.nan])):
        with pytest.raises(ValueError, match="two or more finite scores"):
            reader_statistics(bad)


def test_the_readers_rows_are_the_first_calls_and_name_a_query_without_scores():
    from hkrag.tasks.reader_on_pruner_calls import reader_rows, summarise

    calls = [{"query_id": "a", "n": 1, "label": True, "p_yes": 0.4}, {"query_id": "a", "n": 2, "label": True,
             "p_yes": 0.1}, {"query_id": "b", "n": 1, "label": False, "p_yes": 0.6}]
    scores = {"a": np.array([0.8, 0.2, 0.1]), "b": np.array([0.5, 0.45, 0.4])}
    rows = reader_rows(calls, scores)
    assert [(row["query_id"], row["label"]) for row in rows] == [("a", True), ("b", False)]
    summary = summarise(rows)
    assert summary["margin"]["auroc"] == 1.0 and summary["p_yes"]["auroc"] == 0.0  # a: 0.6 > b: 0.05; P(yes) reversed
    with pytest.raises(ValueError, match="no reader scores for 1 queries of the calls, e.g. 'b': are the calls"):
        reader_rows(calls, {"a": scores["a"]})


@pytest.mark.parametrize("folder", sorted(PRUNER_STAGES.glob("*/reader_*/")))
def test_committed_reader_figures_re_derive_from_their_rows(folder):
    from hkrag.tasks.reader_on_pruner_calls import summarise

    rows, found = read_jsonl(folder / "reader_calls.jsonl.gz"), json.loads((folder / "reader_calls.json").read_text())
    derived = summarise(rows)
    assert set(found["summary"]) == {"cosine", "margin", "z", "p_yes"} and len(rows) == derived["z"]["n"]
    for name, cell in found["summary"].items():
        assert cell == pytest.approx(derived[name])

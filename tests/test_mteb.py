"""``eval.py task=mteb``: our retriever as an MTEB model, checked offline on a local MTEB task built from the
built-in corpus against ``eval.py task=retrieval`` on the same data and model (both score with trec_eval's
``ndcg_cut``); and the clear failure of hub tasks without hub access (``HF_HUB_OFFLINE=1``)."""

import json
import os
from pathlib import Path

import pytest
from _eval_config import ROOT, tiny_eval_config
from omegaconf import OmegaConf

pytest.importorskip("mteb", reason='MTEB is an extra: pip install -e ".[mteb]" (in the dev extra)')

from hkrag.data.opendocvqa import QUERY_PREFIX, format_query  # noqa: E402
from hkrag.retrieval.evaluation import PER_QUERY_FILE  # noqa: E402
from hkrag.retrieval.metrics import evaluate_run, trec_order  # noqa: E402
from hkrag.retrieval.mteb_adapter import (  # noqa: E402
    KNOWN_MODELS,
    PHI3V,
    known_facts,
    local_task,
    model_meta,
    model_name,
    query_text,
)
from hkrag.retriever import LoraSettings, Phi3VRetriever  # noqa: E402
from hkrag.tasks.mteb import MTEB_DIR, PREDICTIONS_DIR, SUMMARY_FILE, TABLE_FILE, run_mteb  # noqa: E402
from hkrag.tasks.retrieval import run_retrieval_evaluation  # noqa: E402

MODEL = "hkrag/tiny-random"


def config(tmp_path: Path, out: str, *overrides: str):
    return tiny_eval_config(tmp_path, out, *overrides, n_train=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``task=retrieval`` and ``task=mteb benchmark=local`` on the same tiny corpus and tiny random model; the
    number of pages and queries the MTEB run hands the retriever to encode is in ``tmp_path / "encoded.json"``."""
    tmp_path = tmp_path_factory.mktemp("mteb")
    ours = run_retrieval_evaluation(config(tmp_path, "retrieval"), tmp_path / "retrieval")
    overrides = ("task=mteb", "benchmark=local", f"task.model_name={MODEL}")
    encoded = {"pages": 0, "queries": 0}

    def counting(method, what):
        def encode(self, items, *args, **kwargs):
            encoded[what] += len(items)
            return method(self, items, *args, **kwargs)
        return encode

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Phi3VRetriever, "encode_documents", counting(Phi3VRetriever.encode_documents, "pages"))
        patch.setattr(Phi3VRetriever, "encode_queries", counting(Phi3VRetriever.encode_queries, "queries"))
        theirs = run_mteb(config(tmp_path, "mteb", *overrides), tmp_path / "mteb")
    (tmp_path / "encoded.json").write_text(json.dumps(encoded))
    return tmp_path, ours, theirs


def test_local_tasks_encode_each_page_and_query_once(runs):
    """Four tasks (two data sets, each in its own pool and in ``all``) rank 3 + 15 + 3 + 15 pages for 3 + 3 + 3 + 3
    questions (36 pages and 12 queries encoded before); the 15 pages of ``all`` and the 6 questions, once each."""
    from hkrag.data.opendocvqa import load_corpus, load_qa

    tmp_path, _, _ = runs
    source = tmp_path / "data" / "synthetic"
    pages = len(load_corpus(str(source / "corpus"), "all", "test"))
    questions = sum(len(load_qa(str(source / "qa"), name, "test")) for name in ("synchart", "syninfo"))
    assert json.loads((tmp_path / "encoded.json").read_text()) == {"pages": pages, "queries": questions}
    assert pages > max(len(load_corpus(str(source / "corpus"), name, "test")) for name in ("synchart", "syninfo"))


def test_mteb_ndcg_at_5_equals_task_retrieval(runs):
    tmp_path, ours, theirs = runs
    assert set(theirs) == {f"HKRAG-{d}-{p}" for d in ("synchart", "syninfo") for p in ("single", "all")}
    for dataset, by_pool in ours["results"].items():
        for pool, result in by_pool.items():
            mteb_score = theirs[f"HKRAG-{dataset}-{pool}"]
            # MTEB rounds its means to 5 decimals (mteb._evaluators.retrieval_metrics.parse_metrics_from_scores)
            assert mteb_score["ndcg_at_5"] == pytest.approx(result["all"]["ndcg@5"], abs=5e-6 + 1e-12)
            assert mteb_score["main_score"] == mteb_score["ndcg_at_5"]
    assert any(0 < by["ndcg_at_5"] < 1 for by in theirs.values())  # a ranking neither perfect nor empty


def test_mteb_ranks_every_query_as_task_retrieval(runs):
    """Per query, exactly: MTEB's saved predictions give the same top 5 and nDCG@5 as our run."""
    tmp_path, ours, _ = runs
    per_query = json.loads((tmp_path / "retrieval" / PER_QUERY_FILE).read_text())
    for dataset, by_pool in ours["runs"].items():
        for pool, run in by_pool.items():
            predicted = mteb_predictions(tmp_path / "mteb" / MTEB_DIR, f"HKRAG-{dataset}-{pool}")
            assert predicted.keys() == run.keys()
            for query_id, docs in run.items():
                assert trec_order(predicted[query_id])[:5] == trec_order(docs)[:5]
            qrels = {q: {d: 1 for d in rel} for q, rel in qrels_of(tmp_path, dataset).items()}
            mteb_ndcg = evaluate_run(predicted, qrels)["per_query"]
            for query_id, scores in per_query[dataset][pool].items():
                assert mteb_ndcg[query_id]["ndcg@5"] == pytest.approx(scores["ndcg@5"], abs=1e-9)


def test_mteb_writes_a_leaderboard_results_folder_and_our_summary(runs):
    tmp_path, _, theirs = runs
    out = tmp_path / "mteb"
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["model"] == MODEL and len(summary["revision"]) > 0
    folder = out / MTEB_DIR / "results" / MODEL.replace("/", "__") / summary["revision"]
    assert {p.name for p in folder.iterdir()} >= {"model_meta.json", *(f"{task}.json" for task in theirs)}
    stored = json.loads((folder / "HKRAG-synchart-single.json").read_text())
    assert stored["scores"]["test"][0]["ndcg_at_5"] == theirs["HKRAG-synchart-single"]["ndcg_at_5"]
    meta = json.loads((folder / "model_meta.json").read_text())
    assert meta["name"] == MODEL and meta["embed_dim"] == 64 and set(meta["modalities"]) == {"image", "text"}
    table = (out / TABLE_FILE).read_text().splitlines()
    assert table[:2] == ["| MTEB task | main score (x100) |", "|---|---|"] and table[-1].startswith("| Average | ")
    assert f"| HKRAG-synchart-single | {100 * theirs['HKRAG-synchart-single']['main_score']:.1f} |" in table


def test_hub_tasks_without_hub_access_fail_naming_the_task(tmp_path):
    assert os.environ.get("HF_HUB_OFFLINE") == "1" or pytest.skip("needs HF_HUB_OFFLINE=1 (the test environment)")
    cfg = config(tmp_path, "o", "task=mteb", "benchmark=['local',VidoreArxivQARetrieval]")
    with pytest.raises(ConnectionError, match=r"MTEB task VidoreArxivQARetrieval: cannot load its data "
                                              r"mteb/arxivqa_test_subsampled_beir@.*needs hub access"):
        run_mteb(cfg, tmp_path / "o")
    assert not (tmp_path / "o").exists()  # nothing encoded or written


@pytest.mark.parametrize("name, message", [
    ("'ViDoRe(v9)'", r"benchmark='ViDoRe\(v9\)' is neither an MTEB benchmark nor an MTEB task.*ViDoRe\(v3\)"),
    ("[]", r"benchmark=\[\]: name an MTEB benchmark or task"),
    ("null", r"benchmark=None: name an MTEB benchmark or task"),
])
def test_bad_benchmark_names_fail_with_the_name(tmp_path, name, message):
    with pytest.raises(ValueError, match=message):
        run_mteb(config(tmp_path, "o", "task=mteb", f"benchmark={name}"), tmp_path / "o")


def test_query_formatting_and_model_names(tmp_path):
    assert query_text("What is shown?") == format_query("What is shown?") == query_text(format_query("What is shown?"))
    run = tmp_path / "20260101-000000"
    (run / "checkpoints" / "final" / "adapter").mkdir(parents=True)
    assert model_name("microsoft/Phi-3-vision-128k-instruct") == "microsoft/Phi-3-vision-128k-instruct"
    assert model_name("microsoft/Phi-3-vision-128k-instruct", run / "checkpoints/final/adapter") == \
        "hkrag/20260101-000000"
    assert model_name("microsoft/Phi-3-vision-128k-instruct", "NTT-hil-insight/VDocRetriever-Phi3-vision") == \
        "NTT-hil-insight/VDocRetriever-Phi3-vision"
    assert model_name(str(run / "base"), None) == "hkrag/base"


def test_local_task_holds_questions_pages_and_qrels(tmp_path):
    from hkrag.data.opendocvqa import load_corpus, load_qa
    from hkrag.tasks.common import prepare_data

    cfg = config(tmp_path, "o")
    prepare_data(cfg.data)
    qa = load_qa(cfg.data.qa_source, "synchart", "test")
    corpus = load_corpus(cfg.data.corpus_source, "synchart", "test")
    task = local_task(qa, corpus, "Local")
    split = task.dataset["default"]["test"]
    assert split["queries"]["id"] == [ex.query_id for ex in qa]
    assert not any(text.startswith(QUERY_PREFIX) for text in split["queries"]["text"])
    assert split["corpus"]["id"] == list(corpus.doc_ids) and len(split["corpus"]) == len(corpus)
    assert split["relevant_docs"] == {ex.query_id: dict.fromkeys(ex.relevant_doc_ids, 1) for ex in qa}
    with pytest.raises(ValueError, match="local MTEB task 'Empty' needs questions and pages, got 0"):
        local_task([], corpus, "Empty")


def mteb_predictions(mteb_dir: Path, task: str) -> dict[str, dict[str, float]]:
    """MTEB's saved run of ``task`` (``prediction_folder``)."""
    return json.loads((mteb_dir.parent / PREDICTIONS_DIR / f"{task}_predictions.json").read_text())["default"]["test"]


def qrels_of(tmp_path: Path, dataset: str) -> dict[str, list[str]]:
    from hkrag.data.opendocvqa import load_qa

    qa = load_qa(str(tmp_path / "data" / "synthetic" / "qa"), dataset, "test")
    return {ex.query_id: list(ex.relevant_doc_ids) for ex in qa}


@pytest.mark.parametrize("setting, message", [
    ("task.model_name='my model'", r"MTEB model name 'my model' must read 'organisation/model'"),
    ("task.overwrite_strategy=sometimes", r"task.overwrite_strategy='sometimes': expected one of \['always', "),
])
def test_bad_settings_fail_before_any_work(tmp_path, setting, message):
    with pytest.raises(ValueError, match=message):
        run_mteb(config(tmp_path, "o", "task=mteb", "benchmark=local", setting), tmp_path / "o")
    assert not (tmp_path / "data").exists()  # before the corpus is generated or the model loaded


VDOC = "NTT-hil-insight/VDocRetriever-Phi3-vision"


def test_model_meta_says_what_is_known_of_phi3v_vdocretriever_and_our_runs(tmp_path):
    assert known_facts(PHI3V, None) == {"release_date": "2024-05-21", "license": "mit", "open_weights": True,
                                        "reference": f"https://huggingface.co/{PHI3V}", "training_datasets": None}
    vdoc = known_facts(PHI3V, VDOC)
    assert vdoc["adapted_from"] == PHI3V and vdoc["open_weights"] is True and "license" not in vdoc
    assert vdoc["public_training_data"] == "https://huggingface.co/datasets/NTT-hil-insight/OpenDocVQA"
    assert vdoc["training_datasets"] == {"VidoreInfoVQARetrieval"}
    for data, expected in [("synthetic", set()), ("opendocvqa", {"VidoreInfoVQARetrieval"}), (None, None)]:
        run = tmp_path / str(data)
        adapter = run / "checkpoints" / "final" / "adapter"
        adapter.mkdir(parents=True)
        if data:
            (run / ".hydra").mkdir()
            OmegaConf.save({"data": OmegaConf.load(ROOT / "conf" / "data" / f"{data}.yaml")},
                           run / ".hydra" / "config.yaml")  # as train.py with data=<data> saves it
        assert known_facts(PHI3V, adapter) == {"adapted_from": PHI3V, "training_datasets": expected}, data
    assert known_facts(str(tmp_path / "base"), None) == {}  # the tiny random model: nothing known

    retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=2, alpha=4, dropout=0.0))
    meta = model_meta(retriever, "hkrag/vdoc", base=PHI3V, adapter=VDOC)  # MTEB validates the fields
    assert (meta.license, meta.open_weights, meta.adapted_from) == (None, True, PHI3V)
    assert meta.get_training_datasets() >= {"VidoreInfoVQARetrieval"}
    assert model_meta(retriever, "hkrag/phi3v", base=PHI3V).license == "mit" == KNOWN_MODELS[PHI3V]["license"]


@pytest.mark.slow
def test_late_interaction_is_served_through_mtebs_maxsim(tmp_path):
    """model.head=late_interaction: MTEB gets each text's token vectors (model type late-interaction, MaxSim) and
    ranks as task=retrieval's exact MaxSim does."""
    late = ("model.head=late_interaction", "model.late_interaction.dim=16")
    ours = run_retrieval_evaluation(config(tmp_path, "retrieval", *late), tmp_path / "retrieval")
    overrides = ("task=mteb", "benchmark=local", f"task.model_name={MODEL}", *late)
    theirs = run_mteb(config(tmp_path, "mteb", *overrides), tmp_path / "mteb")
    for dataset, by_pool in ours["results"].items():
        for pool, result in by_pool.items():
            expected = result["all"]["ndcg@5"]
            assert theirs[f"HKRAG-{dataset}-{pool}"]["ndcg_at_5"] == pytest.approx(expected, abs=5e-6 + 1e-12)
    assert any(0 < by["ndcg_at_5"] < 1 for by in theirs.values())
    meta = json.loads(next((tmp_path / "mteb" / MTEB_DIR).rglob("model_meta.json")).read_text())
    assert meta["similarity_fn_name"] == "MaxSim" and meta["model_type"] == ["late-interaction"]
    assert meta["embed_dim"] == 16

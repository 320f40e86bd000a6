"""``eval.py task=degradation`` and ``task=retrieval degrade=[...]`` end to end on a tiny built-in corpus: the
degraded-pages study of dense, BM25 over re-OCRed text and hybrid, with the visual model loaded once."""

import json

import pytest
from _eval_config import tiny_eval_config

import hkrag.tasks.rankers as rankers
from hkrag.data.ocr import OcrUnavailable, install_tesseract
from hkrag.retrieval.degradation import STUDY_FILE, STUDY_TABLE, DegradationStudy
from hkrag.tasks.retrieval import run_degradation_study, run_retrieval_evaluation


@pytest.fixture(scope="module")
def tesseract():
    try:
        install_tesseract()
    except OcrUnavailable as reason:
        pytest.skip(str(reason))


@pytest.fixture(scope="module")
def study(tmp_path_factory, tesseract):
    tmp_path = tmp_path_factory.mktemp("degradation")
    loads = []
    build = rankers.build_retriever
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rankers, "build_retriever", lambda *a, **k: loads.append(1) or build(*a, **k))
        cfg = tiny_eval_config(tmp_path, "study", "task=degradation", "degrade=[gaussian_blur:1.5]",
                               "eval.pools=[single]", "degradation.ocr_workers=1")
        result = run_degradation_study(cfg, tmp_path / "study")
    return tmp_path, result, len(loads)


def test_the_study_scores_each_retriever_per_strength_and_evidence(study):
    tmp_path, result, loads = study
    rows = json.loads((tmp_path / "study" / STUDY_FILE).read_text())
    assert rows == result["rows"]
    assert {(r["retriever"], r["strength"]) for r in rows} == {(name, s) for name in ("dense", "bm25", "hybrid")
                                                               for s in (0.0, 1.5)}
    assert {r["evidence"] for r in rows} == {"all", "salient", "fine_print"}
    assert {r["dataset"] for r in rows} == {"synchart", "syninfo"} and {r["pool"] for r in rows} == {"single"}
    assert all(0 <= r["ndcg@5"] <= 1 for r in rows)
    assert loads == 1  # the visual model is loaded once for both points and both rankers that use it
    table = (tmp_path / "study" / STUDY_TABLE).read_text()
    assert "ndcg@5 (x100), gaussian_blur, single pool" in table and "| Retriever | Evidence | 0 | 1.5 |" in table
    assert [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "---" not in line] \
        == ["| Retriever"] + ["| dense"] * 3 + ["| bm25"] * 3 + ["| hybrid"] * 3


def test_clean_pages_give_the_dense_retriever_its_plain_evaluation(study):
    tmp_path, result, _ = study
    plain = run_retrieval_evaluation(tiny_eval_config(tmp_path, "plain", "eval.pools=[single]"), tmp_path / "plain")
    clean = {(r["dataset"], r["evidence"]): r["ndcg@5"] for r in result["rows"]
             if r["retriever"] == "dense" and r["strength"] == 0}
    assert clean == {(ds, ev): values["ndcg@5"] for ds, by_pool in plain["results"].items()
                     for ev, values in by_pool["single"].items() if isinstance(values, dict)}


def test_task_retrieval_with_degrade_studies_its_one_retriever(study, tmp_path):
    data_dir = study[0]  # reuse the generated corpus
    cfg = tiny_eval_config(data_dir, "bm25-study", "retriever=bm25", "degrade=[jpeg:5]", "eval.pools=[single]",
                           "degradation.ocr_workers=1")
    result = run_retrieval_evaluation(cfg, tmp_path / "bm25")
    assert {(r["retriever"], r["degradation"], r["strength"]) for r in result["rows"]} == {
        ("bm25", "jpeg", 0.0), ("bm25", "jpeg", 5.0)}
    assert not any(path.name.startswith("embeddings-") for path in (tmp_path / "bm25").rglob("*"))  # no model


def test_a_bad_degradation_fails_naming_it_before_any_work(tmp_path):
    cfg = tiny_eval_config(tmp_path, "bad", "task=degradation", "degrade=[blur:1]")
    with pytest.raises(ValueError, match=r"bad degradation 'blur:1': unknown degradation 'blur'"):
        run_degradation_study(cfg, tmp_path / "bad")
    assert not (tmp_path / "data").exists()


def test_a_name_alone_stands_for_its_default_strengths():
    study = DegradationStudy.from_specs(["rotate", "jpeg:20", "jpeg:5"], seed=3)
    assert [str(p) for p in study.points()] == ["rotate:0", "rotate:1", "rotate:2", "rotate:5",
                                                "jpeg:0", "jpeg:20", "jpeg:5"]
    assert {p.seed for p in study.points()} == {3}
    for bad, message in [("blur", "expected NAME or NAME:STRENGTH"), ("jpeg:x", "strength 'x' is not a number"),
                         ([], "needs at least one degradation")]:
        with pytest.raises(ValueError, match=message):
            DegradationStudy.from_specs(bad)

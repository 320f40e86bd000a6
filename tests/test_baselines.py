"""``eval.py task=retrieval retriever=bm25|hybrid`` and ``task=baselines`` end to end on a tiny built-in corpus: the
same report files and metrics as the dense retriever, and Table 2's layout with one row per retriever."""

import json
from pathlib import Path

import numpy as np
import pytest
from _eval_config import tiny_eval_config

from hkrag.index.faiss_index import DocumentIndex
from hkrag.retrieval.evaluation import PER_QUERY_FILE, TABLE_FILE, search_with_ties
from hkrag.tasks.retrieval import run_baselines, run_retrieval_evaluation

REPORT = {"retrieval.json", TABLE_FILE, PER_QUERY_FILE}


def config(tmp_path: Path, out: str, *overrides: str):
    return tiny_eval_config(tmp_path, out, *overrides, n_train=8)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("baselines")
    report = run_baselines(config(tmp_path, "run", "task=baselines"), tmp_path / "run")
    return tmp_path, report


def test_baselines_lay_out_table_2_with_one_row_per_retriever(baselines):
    tmp_path, report = baselines
    run = tmp_path / "run"
    table = (run / "baselines.md").read_text()
    assert table.startswith("E[ndcg@5] (x100)\n\n| Method | synchart Single | synchart All | syninfo Single |")
    assert "\n\nndcg@5 (x100)\n\n| Method |" in table  # trec_eval's order beside the tie-aware expectation
    rows = [line.split(" | ")[0].strip("| ") for line in table.splitlines() if line.startswith("| ")]
    assert rows[:4] == ["Method", "bm25", "dense", "hybrid"]
    assert "ndcg@5 (x100), fine_print queries" in table
    assert "| Method | seconds | LVLM calls / query | LVLM seconds / query |" in table
    assert "E[ndcg@5] (x100), fine_print queries" in table
    stored = json.loads((run / "baselines.json").read_text())
    assert list(stored) == ["bm25", "dense", "hybrid"] and all(row["seconds"] > 0 for row in stored.values())
    for row in stored:  # each row is what `task=retrieval retriever=<row>` writes, in its own folder
        assert REPORT <= {path.name for path in (run / row).iterdir()}
        assert json.loads((run / row / "retrieval.json").read_text()) == stored[row]["results"]
    assert not any(path.name.startswith("embeddings-") for path in (run / "bm25").iterdir())  # no model needed


def test_bm25_writes_the_report_the_dense_retriever_writes(baselines):
    tmp_path, _ = baselines
    result = run_retrieval_evaluation(config(tmp_path, "bm25", "retriever=bm25"), tmp_path / "bm25")
    dense = tmp_path / "run" / "dense"
    assert REPORT <= {path.name for path in (tmp_path / "bm25").iterdir()}
    mine, theirs = (json.loads((folder / "retrieval.json").read_text()) for folder in (tmp_path / "bm25", dense))
    assert mine == result["results"] == json.loads((tmp_path / "run" / "bm25" / "retrieval.json").read_text())
    assert _shape(mine) == _shape(theirs)  # same data sets, pools, labels and metrics
    per_query = [json.loads((folder / PER_QUERY_FILE).read_text()) for folder in (tmp_path / "bm25", dense)]
    assert _shape(per_query[0]) == _shape(per_query[1])
    assert [line.split(" | ")[0] for line in (tmp_path / "bm25" / TABLE_FILE).read_text().splitlines()] == \
        [line.split(" | ")[0] for line in (dense / TABLE_FILE).read_text().splitlines()]
    # the built-in corpus's text column holds the exact drawn strings: BM25 finds every page in its own pool
    assert mine["synchart"]["single"]["all"]["recall@10"] == 1.0 == mine["synchart"]["single"]["all"]["E[recall@10]"]
    assert set(mine["synchart"]["all"]["all"]) == {"ndcg@5", "recall@1", "recall@5", "recall@10", "mrr@10",
                                                   "E[ndcg@5]", "E[recall@1]", "E[recall@5]", "E[recall@10]",
                                                   "E[mrr@10]"}


def test_vidore_bm25_runs_from_the_config(tmp_path):
    result = run_retrieval_evaluation(config(tmp_path, "v", "retriever=bm25_vidore"), tmp_path / "v")
    assert (tmp_path / "v" / TABLE_FILE).read_text().startswith("E[ndcg@5] (x100)")
    scores = result["results"]["synchart"]["single"]["all"]
    assert 0 < scores["E[ndcg@5]"] <= 1 and scores["recall@10"] == 1.0  # every page is ranked, score 0 or not
    assert 0 < scores["vidore_mrr@10"] <= 1  # ViDoRe's MRR, ties in corpus order, beside the report's metrics


def test_the_dense_search_keeps_every_page_tied_at_the_depth():
    rows = np.eye(4, dtype=np.float32)
    vectors = np.stack([rows[0], rows[1], rows[1], rows[1], rows[1], rows[1], rows[2], rows[3]])  # p1..p5 identical
    index = DocumentIndex.build([f"p{i}" for i in range(8)], vectors, "flat")
    query = (rows[0] * 0.9 + rows[1] * 0.5)[None]
    run = search_with_ties(index, ["q"], query, 2)["q"]  # FAISS alone would cut the five tied pages after one
    assert list(run) == ["p0", "p5", "p4", "p3", "p2", "p1"] and len({run[f"p{i}"] for i in range(1, 6)}) == 1
    assert list(search_with_ties(index, ["q"], query, 1)["q"]) == ["p0"]
    assert len(search_with_ties(index, ["q"], query, 7)["q"]) == 8  # 7th score ties the 8th page (0): all kept


def test_bad_retriever_settings_fail_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"retriever.b=1.5: expected a number >= 0 and <= 1"):
        run_retrieval_evaluation(config(tmp_path, "o", "retriever=bm25", "retriever.b=1.5"), tmp_path / "o")
    with pytest.raises(ValueError, match=r"retriever.fusion='max': expected one of \['rrf', 'sum'\]"):
        run_retrieval_evaluation(config(tmp_path, "o", "retriever=hybrid", "retriever.fusion=max"), tmp_path / "o")
    assert not (tmp_path / "data").exists()


def _shape(tree):
    """The nested keys of a JSON tree (values dropped)."""
    return {key: _shape(value) for key, value in tree.items()} if isinstance(tree, dict) else None

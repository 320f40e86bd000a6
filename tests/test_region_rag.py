"""``eval.py task=rag`` over region units (SCAN's visual and textual RAG): retrieval scored per page, the generator
reading the top crops, end to end on the built-in corpus's own boxes with the scripted backend."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from hkrag.data.opendocvqa import load_corpus, load_qa
from hkrag.data.region_corpus import build_region_corpus
from hkrag.rag.trace import load_trace
from hkrag.tasks import rag as rag_task
from hkrag.tasks import run_eval_task
from hkrag.tasks.common import UNGROUNDED

ROOT = Path(__file__).resolve().parents[1]
SMALL_DATA = [
    "data.synthetic.n_train=8", "data.synthetic.n_test=16", "data.synthetic.train_groups_per_style=1",
    "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "data.eval_datasets=[synchart]",
]


def config(data_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("eval", [
            f"paths.data_dir={data_dir}", f"paths.output_dir={data_dir / 'out'}", *SMALL_DATA, "rag.max_queries=2",
            "task=rag", "lvlm=scripted", "generator=single_pass", "rag.pools=[single]", "rag.top_k=3",
            UNGROUNDED, *overrides,
        ])


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> Path:
    data_dir = tmp_path_factory.mktemp("region-rag")
    rag_task.prepare_data(config(data_dir).data)
    build_region_corpus(data_dir / "synthetic" / "corpus", data_dir / "units", "all-box", gold=data_dir / "synthetic",
                        splits=["test"])
    return data_dir


@pytest.mark.parametrize("page_input", ["image", "text"])
def test_rag_over_region_units_hands_the_generator_the_top_crops(tmp_path, units, scripted_rag_backend, page_input):
    cfg = config(units, "retriever=regions_bm25", f"data.corpus_source={units / 'units'}",
                 f"generator.input={page_input}")
    report = run_eval_task(cfg, tmp_path / "run")
    assert report["overall"]["n"] == 2 and report["overall"]["failed"] == 0
    # the units BM25 ranks first, in its order: crops of pages, not pages
    qa = {e.query_id: e for e in load_qa(cfg.data.qa_source, "synchart", "test")}
    corpus = load_corpus(units / "units", "synchart", "test")
    bm25 = instantiate(cfg.retriever.inner).rank(list(qa.values()), corpus, 3, "synchart")
    trace = load_trace(tmp_path / "run" / "trace.jsonl")
    for outcome in trace:
        assert outcome.retrieved == sorted(bm25[outcome.query_id], key=lambda u: -bm25[outcome.query_id][u])
        assert all("#" in unit and unit in corpus for unit in outcome.retrieved)
    kind = "page" if page_input == "image" else "text"
    assert trace[0].calls[0].prompt.startswith("".join(f"<{kind}:{unit}>\n" for unit in trace[0].retrieved))
    if page_input == "image":  # the crops themselves reach the backend
        sizes = {corpus[u].image.size for u in trace[0].retrieved}
        assert {image.load().size for image in scripted_rag_backend.requests[0].images} == sizes
    # the retrieval table stays page-level: pages, scored by their best unit
    table = (tmp_path / "run" / "retrieval.md").read_text()
    assert "synchart Single" in table

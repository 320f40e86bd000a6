import io
import logging

import datasets
import pytest
from PIL import Image

from hkrag.data.images import ImageError
from hkrag.data.opendocvqa import (
    CORPUS_FEATURES,
    QA_FEATURES,
    QUERY_PREFIX,
    Corpus,
    QAExample,
    format_query,
    load_corpus,
    load_qa,
    pools,
    qrels,
)
from hkrag.data.pairs import TrainingPair, training_pairs
from hkrag.data.writer import save_split

COLOURS = {"c1": (255, 0, 0), "c2": (0, 255, 0), "c3": (0, 0, 255), "s1": (9, 9, 9)}


def page(doc_id: str) -> dict:
    return {"doc_id": doc_id, "image": Image.new("RGB", (8, 6), COLOURS[doc_id])}


def question(query_id: str, positives: list[str], query: str = "What?") -> dict:
    return {
        "query_id": query_id,
        "query": format_query(query),
        "answers": ["a", "b"],
        "relevant_doc_ids": positives,
        "evidence": None,
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Two local directories in the layout of NTT-hil-insight/OpenDocVQA(-Corpus)."""
    root = tmp_path_factory.mktemp("hub")
    corpus, qa = root / "corpus", root / "qa"
    save_split([page("c1"), page("c2"), page("c3")], corpus, "default", "train", CORPUS_FEATURES)
    save_split([page("s1")], corpus, "chartqa", "test", CORPUS_FEATURES)
    save_split([page("s1"), page("c3")], corpus, "all", "test", CORPUS_FEATURES)
    train = [question("t1", ["c1"]), question("t2", ["gone", "c2"]), question("t3", ["gone", "lost"])]
    save_split(train, qa, "default", "train", QA_FEATURES)
    save_split([question("q1", ["s1"], "How many?")], qa, "chartqa", "test", QA_FEATURES)
    return {"corpus": corpus, "qa": qa, "cache_dir": str(root / "cache")}


def test_layout_loads_with_plain_load_dataset(hub):
    card = (hub["corpus"] / "README.md").read_text()
    assert card.startswith("---\nconfigs:\n- config_name: default\n")
    assert "path: chartqa/test-*.parquet" in card
    rows = datasets.load_dataset(str(hub["qa"]), name="chartqa", split="test", cache_dir=hub["cache_dir"])
    assert rows.column_names == ["query_id", "query", "answers", "relevant_doc_ids", "evidence"]
    default = datasets.load_dataset(str(hub["corpus"]), split="train", cache_dir=hub["cache_dir"])
    assert default["doc_id"][:] == ["c1", "c2", "c3"]


def test_load_qa_rows(hub):
    (example,) = load_qa(hub["qa"], "chartqa", "test", cache_dir=hub["cache_dir"])
    assert example == QAExample(
        "q1",
        "Instruct: I’m looking for an image that answers the question.\nQuery: How many?",
        ("a", "b"),
        ("s1",),
    )
    assert QUERY_PREFIX.endswith("Query: ") and "\u2019" in QUERY_PREFIX


def test_corpus_indexes_by_position_and_id_and_decodes_lazily(hub):
    corpus = load_corpus(hub["corpus"], cache_dir=hub["cache_dir"])
    assert len(corpus) == 3 and corpus.doc_ids == ["c1", "c2", "c3"]
    assert corpus.dataset.features["image"].decode is False
    assert corpus[1].doc_id == "c2" and corpus[1].image.getpixel((0, 0)) == COLOURS["c2"]
    assert corpus["c3"].image.getpixel((7, 5)) == COLOURS["c3"]
    assert "c1" in corpus and "s1" not in corpus
    assert [p.doc_id for p in corpus] == ["c1", "c2", "c3"]
    with pytest.raises(KeyError, match="'s1' is not in .*default/train"):
        corpus["s1"]


def test_pools_are_the_dataset_config_and_all(hub):
    assert pools("chartqa") == {"single": "chartqa", "all": "all"}
    sizes = {
        name: len(load_corpus(hub["corpus"], cfg, "test", cache_dir=hub["cache_dir"]))
        for name, cfg in pools("chartqa").items()
    }
    assert sizes == {"single": 1, "all": 2}


def test_qrels_are_binary_per_query(hub):
    qa = load_qa(hub["qa"], cache_dir=hub["cache_dir"])
    assert qrels(qa) == {"t1": {"c1": 1}, "t2": {"gone": 1, "c2": 1}, "t3": {"gone": 1, "lost": 1}}


def test_training_pairs_skip_missing_positives_with_a_count(hub, caplog):
    corpus = load_corpus(hub["corpus"], cache_dir=hub["cache_dir"])
    qa = load_qa(hub["qa"], cache_dir=hub["cache_dir"])
    with caplog.at_level(logging.WARNING, logger="hkrag.data.pairs"):
        pairs = training_pairs(qa, corpus)
    assert pairs == [TrainingPair("t1", qa[0].query, ("c1",)), TrainingPair("t2", qa[1].query, ("c2",))]
    assert "3 relevant_doc_ids are missing" in caplog.text
    assert "1 queries without any positive were skipped" in caplog.text


def test_multi_positive_pairs_rotate_by_epoch():
    pair = TrainingPair("q", "text", ("a", "b", "c"))
    assert [pair.positive(epoch) for epoch in range(4)] == ["a", "b", "c", "a"]


def test_duplicate_doc_id_is_an_error():
    rows = datasets.Dataset.from_list([page("c1"), page("c2"), page("c1")], features=CORPUS_FEATURES)
    with pytest.raises(ValueError, match=r"duplicate doc_id 'c1' \(rows 0 and 2\)"):
        Corpus(rows)


def test_missing_column_is_an_error():
    with pytest.raises(ValueError, match=r"missing columns \['image'\]"):
        Corpus(datasets.Dataset.from_dict({"doc_id": ["a"]}))


@pytest.mark.parametrize(
    "rows,message",
    [
        ([question("q1", ["a"], "  "), question("q2", ["a"])], "query 'q1' has an empty query"),
        ([question("q2", ["a"]), {**question("q3", ["a"]), "query": ""}], "query 'q3' has an empty query"),
        ([question("q1", ["a"]), question("q1", ["b"])], "duplicate query_id 'q1'"),
    ],
)
def test_broken_qa_sets_are_errors(tmp_path, rows, message):
    save_split(rows, tmp_path / "qa", "default", "train", QA_FEATURES)
    with pytest.raises(ValueError, match=message):
        load_qa(tmp_path / "qa", cache_dir=str(tmp_path / "cache"))


def test_corrupt_page_fails_on_access_naming_it(tmp_path):
    good = io.BytesIO()
    Image.effect_noise((64, 64), 50).save(good, format="PNG")
    rows = [{"doc_id": "ok", "image": {"bytes": good.getvalue(), "path": None}}]
    rows.append({"doc_id": "bad.pdf#p2", "image": {"bytes": good.getvalue()[:2000], "path": None}})
    save_split(rows, tmp_path, "default", "train", CORPUS_FEATURES)
    corpus = load_corpus(tmp_path, cache_dir=str(tmp_path / "cache"))
    assert corpus["ok"].image.mode == "L"
    with pytest.raises(ImageError, match="'bad.pdf#p2': corrupt or truncated"):
        corpus[1]


def test_save_split_replaces_its_split_and_keeps_other_configs(tmp_path):
    save_split([page("c1")], tmp_path, "x", "test", CORPUS_FEATURES, batch_size=1)
    save_split([page("c1"), page("c2"), page("c3")], tmp_path, "default", "train", CORPUS_FEATURES, batch_size=2)
    save_split([page("c2"), page("c3")], tmp_path, "x", "test", CORPUS_FEATURES)
    cache = str(tmp_path / "cache")
    assert load_corpus(tmp_path, "x", "test", cache_dir=cache).doc_ids == ["c2", "c3"]
    assert load_corpus(tmp_path, cache_dir=cache).doc_ids == ["c1", "c2", "c3"]
    assert (tmp_path / "README.md").read_text().count("config_name") == 2


def test_two_local_copies_with_the_same_layout_load_their_own_rows(tmp_path):
    """datasets' own cache key ignores the folder's location: each copy must still load its rows."""
    from hkrag.data.opendocvqa import QA_FEATURES
    from hkrag.data.writer import save_split

    for name, count in (("a", 2), ("b", 3)):
        rows = [
            {"query_id": f"{name}{i}", "query": f"question {i}", "answers": ["x"], "relevant_doc_ids": ["d"],
             "evidence": "salient"}
            for i in range(count)
        ]
        save_split(rows, tmp_path / name / "qa", "default", "train", QA_FEATURES)
    assert [ex.query_id for ex in load_qa(tmp_path / "a" / "qa", "default", "train")] == ["a0", "a1"]
    assert [ex.query_id for ex in load_qa(tmp_path / "b" / "qa", "default", "train")] == ["b0", "b1", "b2"]

import json
import re
import time
from collections import Counter

import pytest

from hkrag.data.opendocvqa import QUERY_PREFIX, load_corpus, load_qa, pools, qrels, training_pairs
from hkrag.data.synthetic import (
    CODES,
    LABELS,
    MIN_FINE_PRINT_PX,
    SOURCES,
    STYLES,
    TITLES,
    SyntheticConfig,
    generate,
    main,
)

SMALL = SyntheticConfig(seed=3, n_train=24, n_test=12, train_groups_per_style=2, test_groups_per_style=1, group_size=3)


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    """The default demo corpus, generated once; its wall time is part of the contract."""
    root = tmp_path_factory.mktemp("synthetic")
    start = time.perf_counter()
    paths = generate(root / "data")
    seconds = time.perf_counter() - start
    pages = [json.loads(line) for line in paths.pages.read_text().splitlines()]
    return {"paths": paths, "seconds": seconds, "pages": {p["doc_id"]: p for p in pages}, "cache": str(root / "cache")}


def words(page: dict, kind: str) -> set[str]:
    return {w for item in page["items"] if item["kind"] == kind for w in item["text"].split()}


def test_same_seed_gives_identical_bytes_and_other_seed_does_not(tmp_path):
    a, b = generate(tmp_path / "a", SMALL), generate(tmp_path / "b", SMALL)
    files = sorted(p.relative_to(a.root) for p in a.root.rglob("*") if p.is_file())
    assert len(files) == 2 + 1 + 1 + 9 + 6  # READMEs, pages.jsonl, synthetic_config.json, QA and corpus parquet
    for name in files:
        assert (a.root / name).read_bytes() == (b.root / name).read_bytes(), name
    c = generate(tmp_path / "c", SyntheticConfig(**{**SMALL.__dict__, "seed": 4}))
    assert c.pages.read_bytes() != a.pages.read_bytes()


def test_default_sizes_and_speed(default):
    assert default["seconds"] < 20
    paths, cache = default["paths"], default["cache"]
    assert len(load_qa(paths.qa, cache_dir=cache)) == 320
    assert len(load_corpus(paths.corpus, cache_dir=cache)) == 4 * 8 * 6
    assert len(load_corpus(paths.corpus, "all", "test", cache_dir=cache)) == 4 * 4 * 6
    test_queries = [q for style in STYLES for q in load_qa(paths.qa, style, "test", cache_dir=cache)]
    assert len(test_queries) == 100
    assert Counter(q.evidence for q in test_queries) == {"fine_print": 50, "salient": 50}


@pytest.mark.parametrize("style", STYLES)
def test_schema_and_pools_through_the_opendocvqa_loader(default, style):
    paths, cache = default["paths"], default["cache"]
    qa = load_qa(paths.qa, style, "test", cache_dir=cache)
    single, everything = (load_corpus(paths.corpus, c, "test", cache_dir=cache) for c in pools(style).values())
    assert set(single.doc_ids) < set(everything.doc_ids)
    assert all(doc_id.startswith(f"{style}-test-") for doc_id in single.doc_ids)
    assert len(training_pairs(qa, single)) == len(qa)
    for ex in qa:
        assert ex.query.startswith("Instruct: I’m looking for an image that answers the question.\nQuery: ")
        assert f" {STYLES[style]}" in ex.query and ex.answers and ex.evidence in {"salient", "fine_print"}
        assert list(qrels([ex]).values()) == [{ex.relevant_doc_ids[0]: 1}]
    page = single[0].image
    assert page.size == (224, 168) and page.mode == "RGB"


def test_answers_are_drawn_on_the_positive_in_the_right_type(default):
    qa = load_qa(default["paths"].qa, cache_dir=default["cache"])
    for ex in qa:
        page = default["pages"][ex.relevant_doc_ids[0]]
        assert ex.answers[0] in words(page, ex.evidence), ex
    for page in default["pages"].values():
        fine = [item for item in page["items"] if item["kind"] == "fine_print"]
        assert len(fine) == 2 and all(item["cap_height"] >= MIN_FINE_PRINT_PX for item in fine)
        salient = [item for item in page["items"] if item["kind"] == "salient"]
        assert min(item["cap_height"] for item in salient) > max(item["cap_height"] for item in fine)


def test_each_query_names_exactly_one_page_of_its_pool_and_fine_print_decides(default):
    """The query's content words (upper case) are drawn on its positive and on no other page of
    the same style; for fine-print queries the salient words alone match the whole title group."""
    pages = default["pages"]
    for style in STYLES:
        qa = load_qa(default["paths"].qa, style, "test", cache_dir=default["cache"])
        pool = [p for p in pages.values() if p["split"] == "test" and p["style"] == style]
        for ex in qa:
            question = ex.query.removeprefix(QUERY_PREFIX)
            asked = {w.rstrip("?") for w in question.split() if re.fullmatch(r"[A-Z0-9%]+\??", w) and len(w) > 1}
            drawn = [p["doc_id"] for p in pool if asked <= words(p, "salient") | words(p, "fine_print")]
            assert drawn == list(ex.relevant_doc_ids), question
            positive = pages[drawn[0]]
            if ex.evidence == "salient":
                assert asked <= words(positive, "salient")
            else:
                salient_asked = asked - words(positive, "fine_print")
                assert salient_asked == {positive["title"]}
                assert sum(salient_asked <= words(p, "salient") for p in pool) == 6


def test_distractors_share_titles_with_positives(default):
    for style in STYLES:
        groups = Counter(p["title"] for p in default["pages"].values() if p["split"] == "test" and p["style"] == style)
        assert set(groups.values()) == {6} and len(groups) == 4


def test_test_pages_are_new_combinations_of_the_train_vocabulary(default):
    pages = list(default["pages"].values())
    key = ("style", "title", "label", "value", "source", "code", "year", "page_no")
    train = {tuple(p[k] for k in key) for p in pages if p["split"] == "train"}
    test = [p for p in pages if p["split"] == "test"]
    assert not any(tuple(p[k] for k in key) in train for p in test)
    train_words = set().union(*(words(p, "fine_print") for p in pages if p["split"] == "train"))
    assert set().union(*(words(p, "fine_print") for p in test)) - train_words <= {f"P.{n}" for n in range(1, 10)}
    assert {p["title"] for p in pages} <= set(TITLES) and {p["label"] for p in pages} <= set(LABELS)
    assert {p["source"] for p in pages} <= set(SOURCES) and {p["code"] for p in pages} <= set(CODES)


def test_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "--n-train" in capsys.readouterr().out
    main(
        [
            "--out",
            str(tmp_path),
            "--seed",
            "3",
            "--n-train",
            "24",
            "--n-test",
            "12",
            "--train-groups-per-style",
            "2",
            "--test-groups-per-style",
            "1",
            "--group-size",
            "3",
        ]
    )
    assert (tmp_path / "pages.jsonl").read_bytes() == generate(tmp_path / "api", SMALL).pages.read_bytes()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"group_size": 9}, "group_size"),
        ({"test_groups_per_style": 0}, "test_groups_per_style"),
        ({"n_test": 999}, "n_test"),
    ],
)
def test_config_is_validated(change, message):
    with pytest.raises(ValueError, match=message):
        SyntheticConfig(**change)

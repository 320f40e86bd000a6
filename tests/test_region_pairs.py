"""A reader's training data on region units (hkrag.data.region_pairs): gold units by hand, held-out documents kept
out of training and forming the validation pools."""

from __future__ import annotations

import json

import datasets
import pytest
from PIL import Image

from hkrag.data.layout import gold_pages
from hkrag.data.opendocvqa import Corpus, DataError, QAExample, format_query, load_corpus, load_qa
from hkrag.data.region_corpus import build_region_corpus
from hkrag.data.region_pairs import gold_units, main, matched_units, page_units, write_region_training
from hkrag.data.splits import ValidationSplit
from hkrag.data.synthetic import SyntheticConfig, generate
from hkrag.io import write_json, write_text
from hkrag.retrieval.metrics import chance_ndcg
from hkrag.tasks.seeds import main as seeds_main

UNITS = {"p": [("p#0", "title", "SALES"), ("p#1", "semantic_box", "43%\nBLUE"),
               ("p#2", "footer", "SOURCE: ALPHA / 2021\nREF Z6  P.9")],
         "q": [("q#0", "title", "SALES"), ("q#1", "semantic_box", "43%\nRED")]}


def ask(question: str, *pages: str) -> QAExample:
    return QAExample("x", format_query(question), (), pages or ("p",))


def test_gold_units_by_hand():
    assert gold_units(ask("What is the BLUE value on the SALES chart?"), UNITS) == ("p#1",)
    assert gold_units(ask("Which colour shows 43% on the SALES chart?"), UNITS) == ("p#1",)  # "43" of "43%"
    assert gold_units(ask("What is the reference code of the SALES chart sourced from ALPHA?"), UNITS) == ("p#2",)
    # the footer holds three of the question's words, the semantic box one
    assert gold_units(ask("Which page has reference Z6 from ALPHA, 43?"), UNITS) == ("p#2",)
    # the title box never counts (its words are every page's of the document): nothing named, every unit ties
    assert gold_units(ask("Which page is the SALES chart?"), UNITS) == ("p#0", "p#1", "p#2")
    # a question on two pages gets each page's best units
    assert gold_units(ask("Where is 43% shown?", "p", "q"), UNITS) == ("p#1", "q#1")
    with pytest.raises(DataError, match="question 'x': its page 'gone' has no units"):
        gold_units(ask("What is BLUE?", "gone"), UNITS)


CONFIG = SyntheticConfig(seed=3, n_train=32, n_test=8, train_groups_per_style=2, test_groups_per_style=1,
                         group_size=2, train_fine_groups=2, test_fine_groups=1)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = generate(tmp_path_factory.mktemp("synthetic"), CONFIG).root
    units = tmp_path_factory.mktemp("units")
    build_region_corpus(root / "corpus", units, "all-box", gold=root, splits=["train"])
    return root, units


def held_seed(fraction: float, configs: list[str]) -> int:
    """A seed holding out a document of each config but not every document (found, not assumed)."""
    for seed in range(100):
        split = ValidationSplit(fraction, seed)
        held = {c: [split.held_out(f"{c}-train-d{g:03d}-p1") for g in range(2)] for c in configs}
        if all(any(h) for h in held.values()) and not all(all(h) for h in held.values()):
            return seed
    raise AssertionError("no seed")


def test_training_set_keeps_held_out_documents_apart(workspace, tmp_path):
    root, units = workspace
    configs = ["synchart", "synfine"]
    seed = held_seed(0.5, configs)
    split = ValidationSplit(0.5, seed)
    counts = write_region_training(root, units, tmp_path, 0.5, seed, configs)
    train = load_qa(tmp_path / "qa", "default", "train")
    unit_corpus = load_corpus(tmp_path / "units", "default", "train")
    page_of = dict(zip(unit_corpus.doc_ids, unit_corpus.dataset["page_id"][:]))
    labels = dict(zip(unit_corpus.doc_ids, unit_corpus.dataset["label"][:]))
    original = {e.query_id: e for e in load_qa(root / "qa", "default", "train")}
    assert counts["qa/default/train"] == len(train) > 0
    for example in train:
        pages = {page_of[u] for u in example.relevant_doc_ids}  # every gold unit is a kept training unit
        assert pages == set(original[example.query_id].relevant_doc_ids)
        assert not any(split.held_out(p) for p in pages)
        # the built-in questions: salient ones on the semantic box, fine-print ones on the footer
        assert [labels[u] for u in example.relevant_doc_ids] == [
            "semantic_box" if example.evidence == "salient" else "footer"]
    assert not any(split.held_out(p) for p in page_of.values())
    held_pages = set()
    for config in configs:
        validation = load_qa(tmp_path / "qa", config, "validation")
        pool = load_corpus(tmp_path / "pages", config, "validation").doc_ids
        pool_units = load_corpus(tmp_path / "units", config, "validation")
        assert validation and all(split.held_out(p) for e in validation for p in e.relevant_doc_ids)
        assert {p for e in validation for p in e.relevant_doc_ids} <= set(pool)
        assert all(p.startswith(config) and split.held_out(p) for p in pool)
        assert set(pool_units.dataset["page_id"][:]) == set(pool)
        assert len(pool_units) == 3 * len(pool)
        held_pages |= set(pool)
    assert set(load_corpus(tmp_path / "pages", "all", "validation").doc_ids) == held_pages
    assert counts["units/all/validation"] == 3 * len(held_pages)


def widened(box, width):
    """``box`` 2 px wider: on the right, or on the left where it reaches the page's right edge, or 2 px taller where
    it spans the page's width (a box stays inside its page: a region corpus refuses one that does not)."""
    x0, y0, x1, y1 = box
    if x1 + 2 <= width:
        return (x0, y0, x1 + 2, y1)
    return (x0 - 2, y0, x1, y1) if x0 >= 2 else (x0, y0, x1, y1 + 2)


@pytest.fixture(scope="module")
def detected(workspace, tmp_path_factory):
    """A region corpus of "detected" boxes of the training pages, written as ``layout detect`` writes them: every
    gold box 2 px wider (IoU below 1, above 0.5), but one kept page's footer moved to the page's
    corner (IoU 0 with its gold box). Returns that page, the corpus and the validation seed."""
    root, units = workspace
    seed = held_seed(0.5, ["synchart", "synfine"])
    split = ValidationSplit(0.5, seed)
    broken = next(e.relevant_doc_ids[0] for e in load_qa(root / "qa", "default", "train")
                  if e.evidence != "salient" and not split.held_out(e.relevant_doc_ids[0]))
    rows = []
    for page in gold_pages(root, "train"):
        boxes = [[*((0, 0, 4, 4) if page.doc_id == broken and r.label == "footer" else widened(r.box, page.size[0])),
                  r.label, 0.9] for r in page.regions]
        rows.append(json.dumps({"doc_id": page.doc_id, "size": list(page.size), "candidates": boxes,
                                "selected": boxes}))
    regions, found = tmp_path_factory.mktemp("regions"), tmp_path_factory.mktemp("found")
    write_text(regions / "default" / "train.jsonl", "\n".join(rows) + "\n")
    build_region_corpus(root / "corpus", found, "all-box", regions=regions, splits=["train"])
    return broken, found, seed


def test_training_on_detected_boxes(workspace, detected, tmp_path):
    root, units = workspace
    broken, found, seed = detected
    split, configs = ValidationSplit(0.5, seed), ["synchart", "synfine"]
    gold = load_corpus(units, "default", "train")
    found_corpus = load_corpus(found, "default", "train")
    page_of = dict(zip(found_corpus.doc_ids, found_corpus.dataset["page_id"][:]))
    gold_label = dict(zip(gold.doc_ids, gold.dataset["label"][:]))
    found_label = dict(zip(found_corpus.doc_ids, found_corpus.dataset["label"][:]))
    by_page = page_units(gold)
    kept = [e for e in split.split(load_qa(root / "qa", "default", "train"))[0]]
    gold_of = {e.query_id: gold_units(e, by_page) for e in kept}
    lost = {q for q, units_ in gold_of.items() if units_ == (f"{broken}#2",)}  # the moved footer: no match
    assert lost and gold_label[f"{broken}#2"] == "footer"
    n_kept_units = sum(not split.held_out(p) for p in set(gold.dataset["page_id"][:])) * 3

    counts = write_region_training(root, units, tmp_path / "det", 0.5, seed, configs, detected=found,
                                   boxes="detected")
    assert counts["qa/unmatched"] == len(lost)
    assert (counts["matched"], counts["gold_units"]) == (n_kept_units - 1, n_kept_units)
    train = load_qa(tmp_path / "det" / "qa", "default", "train")
    assert {e.query_id for e in train} == set(gold_of) - lost
    for example in train:  # each gold unit replaced by the detected unit of its page and class
        (positive,) = example.relevant_doc_ids
        (expected,) = gold_of[example.query_id]
        assert positive in page_of and page_of[positive] == expected.split("#")[0]
        assert found_label[positive] == gold_label[expected]
    trained = load_corpus(tmp_path / "det" / "units", "default", "train")
    assert set(trained.doc_ids) <= set(found_corpus.doc_ids) and "text" not in trained.dataset.column_names
    assert len(trained) == counts["units/default/train"] == n_kept_units
    pool = load_corpus(tmp_path / "det" / "units", "all", "validation")  # validation reads detected crops
    assert set(pool.doc_ids) <= set(found_corpus.doc_ids) and all(split.held_out(page_of[u]) for u in pool.doc_ids)

    counts = write_region_training(root, units, tmp_path / "both", 0.5, seed, configs, detected=found, boxes="both")
    train = {e.query_id: e.relevant_doc_ids for e in load_qa(tmp_path / "both" / "qa", "default", "train")}
    assert set(train) == set(gold_of)  # nobody dropped: the unmatched keep their gold unit alone
    for query, positives in train.items():
        (expected,) = gold_of[query]
        if query in lost:
            assert positives == (expected,)
            continue
        renamed, gold_positive = positives  # the detected unit first, renamed <page>#d<k>
        found_id = renamed.replace("#d", "#")
        assert gold_positive == expected and renamed == f"{found_id.split('#')[0]}#d{found_id.split('#')[1]}"
        assert (page_of[found_id], found_label[found_id]) == (expected.split("#")[0], gold_label[expected])
    both = load_corpus(tmp_path / "both" / "units", "default", "train")
    assert len(both) == counts["units/default/train"] == 2 * n_kept_units
    assert {u for u in both.doc_ids if "#d" not in u} <= set(gold.doc_ids)

    strict = write_region_training(root, units, tmp_path / "strict", 0.5, seed, configs, detected=found,
                                   boxes="detected", match_iou=1.0)  # a wider box never has IoU 1: nothing matches
    assert (strict["matched"], strict["qa/default/train"], strict["qa/unmatched"]) == (0, 0, len(gold_of))


def test_errors_name_the_input(workspace, tmp_path, capsys):
    root, units = workspace
    with pytest.raises(SystemExit) as exit_info:  # no document held out at fraction 0
        main([str(root), "--units", str(units), "--out", str(tmp_path / "o"), "--fraction", "0",
              "--config", "synchart"])
    assert exit_info.value.code == 2
    assert "qa[synchart/train] has no question in a held-out document (--fraction 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a page corpus as the units: no text, no page_id
        main([str(root), "--units", str(root / "corpus"), "--out", str(tmp_path / "o")])
    assert "has no 'page_id' column" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(root), "--units", str(units), "--out", str(tmp_path / "o"), "--boxes", "detected"])
    assert "boxes=detected needs the detected units" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(root), "--units", str(units), "--out", str(tmp_path / "o"), "--detected", str(units)])
    assert "boxes=gold takes no detected units" in capsys.readouterr().err


def test_seed_table_reads_eval_and_train_folders(workspace, tmp_path, capsys):
    root, _ = workspace
    scores = ({"a": 1.0, "b": 0.0}, {"a": 0.5, "b": 0.5})
    folders = [tmp_path / "eval_s0", tmp_path / "train_s1" / "eval-after"]
    for folder, by_query in zip(folders, scores):
        write_json(folder / "per_query.json", {"synchart": {"single": {
            q: {"evidence": "salient", "ndcg@5": v} for q, v in by_query.items()}}})
    seeds_main([str(tmp_path / "eval_s0"), str(tmp_path / "train_s1"), "--corpus", str(root / "corpus"),
                "--out", str(tmp_path / "table")])
    (row,) = json.loads((tmp_path / "table.json").read_text())["rows"]
    assert (row["dataset"], row["pool"], row["mean"], row["seeds"]) == ("synchart", "single", 0.5, [0.5, 0.5])
    assert row["chance"] == chance_ndcg(len(load_corpus(root / "corpus", "synchart", "test")))
    assert 0 <= row["low"] <= 0.5 <= row["high"] <= 1
    assert "| synchart | single |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        seeds_main([str(tmp_path / "gone"), "--corpus", str(root / "corpus")])
    assert f"no such evaluation folder: {tmp_path / 'gone'}" in capsys.readouterr().err


def test_unit_boxes_that_are_no_boxes_are_refused_naming_the_unit():
    def units(boxes, name):
        return Corpus(datasets.Dataset.from_dict({
            "doc_id": [f"p#{k}" for k in range(len(boxes))], "image": [Image.new("RGB", (2, 2))] * len(boxes),
            "page_id": ["p"] * len(boxes), "box": boxes}), name=name)

    gold = units([[0, 0, 10, 10], [0, 10, 10, 20]], "gold")
    assert matched_units(gold, units([[0, 0, 10, 9], [0, 10, 10, 20]], "found")) == {"p#0": "p#0", "p#1": "p#1"}
    for box, message in (([0, 0, float("nan"), 9], r"a box is four finite numbers \(x0, y0, x1, y1\), got \[0"),
                         ([0, 0, float("inf"), 9], "a box is four finite numbers"),
                         ([0, 0, 10], "a box is four finite numbers"),
                         ([], "a box is four finite numbers"),
                         ([5, 5, 5, 9], r"box \(5.0, 5.0, 5.0, 9.0\) has zero area"),
                         ([-3, 0, 10, 9], r"box \(-3.0, 0.0, 10.0, 9.0\) lies outside the page \(a negative "
                                          r"coordinate\)")):
        with pytest.raises(DataError, match=rf"found: unit 'p#1' of page 'p': {message}"):
            matched_units(gold, units([[0, 0, 10, 9], box], "found"))

"""Layout regions (hkrag.data.layout): the built-in corpus's gold boxes by hand, the RT-DETR detector's folder
format and refusals, and the resumable ``detect`` command."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from hkrag.data.layout import (
    CLASS_COLOURS,
    GoldPage,
    LayoutError,
    SelectionSettings,
    class_agreement,
    detect,
    draw_regions,
    evaluate_detector,
    figure,
    fold_of,
    gold_pages,
    load_detector,
    main,
    new_detector,
    reselect,
    ship_detector,
    train_detector,
    write_regions,
)
from hkrag.data.opendocvqa import DataError, load_corpus, text_kinds
from hkrag.data.region_corpus import build_region_corpus, crop, jittered, page_units
from hkrag.data.region_corpus import main as region_corpus_main
from hkrag.data.regions import CLASSES, Region, corpus_matching_iou, select
from hkrag.data.synthetic import PageSpec, SyntheticConfig, generate, page_regions, render_page
from hkrag.io import FileFormatError

TINY = SyntheticConfig(seed=1, n_train=4, n_test=4, train_groups_per_style=1, test_groups_per_style=1, group_size=1)
CHART = PageSpec(doc_id="synchart-test-d000-p1", style="synchart", title="SALES", label="RED", value=42,
                 source="ALPHA", code="K7", year="2020", bars=(40, 60, 80, 20), accent=1, page_no=3)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("synthetic"), TINY).root


def union(*boxes):
    return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))


def test_chart_page_boxes_by_hand():
    _, items = render_page(CHART)
    title, value, label, source, ref = items
    assert (title.text, value.text, label.text) == ("SALES", "42%", "RED")
    # axis: a 1 px line from (10, 120) to (140, 120); bars i = 0..3 span x 16+31i .. 38+31i, from
    # round(120 - 0.85 h) to 119 (both corner pixels filled, so right/bottom edges + 1): the 80 bar (i = 2) is the
    # highest, top 120 - 68 = 52, and the last bar ends at x 38 + 93 = 131 -> 132
    axis, bars = (10, 120, 141, 121), (16, 52, 132, 120)
    assert page_regions(CHART) == [("title", title.box), ("semantic_box", union(axis, bars, value.box, label.box)),
                                   ("footer", union(source.box, ref.box))]
    # the slide's title band (0, 0)-(224, 34), corner pixels included, clipped to the 224 px wide page
    slide = PageSpec(**{**CHART.__dict__, "style": "synslide"})
    assert page_regions(slide)[0] == ("title", (0, 0, 224, 35))


def test_gold_boxes_of_every_page_are_scan_boxes(corpus):
    pages = gold_pages(corpus)
    assert {p.split for p in pages} == {"train", "test"} and len(gold_pages(corpus, "test")) == 4
    for page in pages:
        assert [r.label for r in page.regions] == ["title", "semantic_box", "footer"]
        assert set(r.label for r in page.regions) <= set(CLASSES)
        # gold boxes do not overlap, so SCAN's selection keeps every one of them
        assert select(page.regions, page.size, page=page.doc_id) == list(page.regions)
    ceiling = evaluate_detector(corpus, None)
    assert ceiling["selected"] == {"pooled": 1.0, "page_mean": 1.0, "pages": 4}
    assert ceiling["selected_by_style"] == {"synchart": 1.0, "syninfo": 1.0, "synslide": 1.0, "syntable": 1.0}


def test_gold_pages_refuse_foreign_folders(corpus, tmp_path):
    with pytest.raises(LayoutError, match=r"synthetic_config.json is missing"):
        gold_pages(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "synthetic_config.json").write_text((corpus / "synthetic_config.json").read_text())
    lines = (corpus / "pages.jsonl").read_text().splitlines()
    row = json.loads(lines[1])
    row["items"][0]["text"] = "OTHER"
    (copy / "pages.jsonl").write_text("\n".join([lines[0], json.dumps(row), *lines[2:]]) + "\n")
    with pytest.raises(LayoutError, match=rf"pages.jsonl, line 2 \({row['doc_id']}\): drawing the page again"):
        gold_pages(copy)


@pytest.fixture(scope="module")
def detector(corpus, tmp_path_factory):
    """Two training steps: a detector folder in the library's format (its boxes are not expected to be good)."""
    out = tmp_path_factory.mktemp("layout")
    report = train_detector(corpus, out, steps=2, batch_size=2)
    assert report["steps"] == 2 and report["train_pages"] == 4
    return out / "model"


def test_detector_folder_loads_and_refusals_name_the_file(detector, tmp_path):
    model, processor = load_detector(detector)
    assert [model.config.id2label[i] for i in range(len(CLASSES))] == list(CLASSES)
    with pytest.raises(LayoutError, match=f"{tmp_path} is not a detector folder"):
        load_detector(tmp_path)
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_text((detector / name).read_text())
    (tmp_path / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(LayoutError, match=f"{tmp_path} is not a transformers object detector"):
        load_detector(tmp_path)
    model, processor = new_detector((224, 168))
    model.config.id2label = {**model.config.id2label, 1: "table"}
    model.save_pretrained(tmp_path / "other")
    processor.save_pretrained(tmp_path / "other")
    with pytest.raises(LayoutError, match=r"other: labels \['table'\] are not SCAN's classes"):
        load_detector(tmp_path / "other")
    # weights of another shape are refused by the library itself; missing tensors, which it would start from
    # random values with a warning only, are refused here
    config = json.loads((detector / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "id2label": {"0": "title"}, "label2id": {"title": 0}}))
    (tmp_path / "model.safetensors").write_bytes((detector / "model.safetensors").read_bytes())
    with pytest.raises(LayoutError, match=f"{tmp_path} is not a transformers object detector: RuntimeError"):
        load_detector(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(detector / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "enc_score_head" not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(LayoutError, match=rf"{tmp_path}: its weights do not fit its config.json \(2 tensors"):
        load_detector(tmp_path)


def test_detect_writes_regions_resumes_and_keeps_failures(corpus, detector, tmp_path, capsys):
    out = tmp_path / "regions"
    source = corpus / "corpus"
    args = [str(source), "--model", str(detector), "--out", str(out), "--config", "all", "--threshold", "0"]
    assert main(["detect", *args]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["pages"], first["detected"], first["cached"], first["failed"]) == (4, 4, 0, 0)
    rows = [json.loads(line) for line in (out / "all" / "test.jsonl").read_text().splitlines()]
    assert [r["doc_id"] for r in rows] == [p.doc_id for p in gold_pages(corpus, "test")]
    assert all(r["size"] == [224, 168] and r["selected"] and len(r["candidates"]) >= len(r["selected"]) for r in rows)
    # a rerun reads the cache; a confidence no candidate reaches leaves every page failed, named and kept
    report = write_regions(source, out, detector, SelectionSettings(threshold=1), configs=["all"])
    assert (report["detected"], report["cached"]) == (0, 4)
    failures = json.loads((out / "layout_failures.json").read_text())
    assert [f["doc_id"] for f in failures] == [r["doc_id"] for r in rows]
    assert failures[0]["error"] == "no box at or above confidence 1"
    assert len((out / "all" / "test.jsonl").read_text().splitlines()) == 4


def test_select_reruns_scans_selection_over_stored_candidates_without_the_detector(tmp_path, capsys):
    page = [[0, 0, 100, 50, "title", 0.9], [0, 50, 100, 100, "semantic_box", 0.5], [10, 60, 40, 90, "footer", 0.45]]
    rows = [{"doc_id": "a", "size": [100, 100], "candidates": page, "selected": [page[0]]},
            {"doc_id": "b", "size": [100, 100], "candidates": [page[2]], "selected": [],
             "error": "no box at or above confidence 0.5"},
            {"doc_id": "c", "size": None, "candidates": [], "selected": [], "error": "ImageError: unreadable"}]
    (tmp_path / "det" / "all").mkdir(parents=True)
    (tmp_path / "det" / "all" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["select", str(tmp_path / "det"), "--out", str(tmp_path / "t04"), "--threshold", "0.4"]) == 0
    assert json.loads(capsys.readouterr().out)["failed"] == 1  # only the unreadable page
    again = [json.loads(line) for line in (tmp_path / "t04" / "all" / "test.jsonl").read_text().splitlines()]
    by_hand = [[0, 0, 100, 50, "title", 0.9], [0, 50, 100, 100, "semantic_box", 0.5]]  # the footer lies inside
    assert [r["selected"] for r in again] == [by_hand, [page[2]], []]
    assert again[1].get("error") is None and again[2]["error"] == "ImageError: unreadable"
    reselect(tmp_path / "det", tmp_path / "t06", SelectionSettings(threshold=0.6))
    failures = json.loads((tmp_path / "t06" / "layout_failures.json").read_text())
    assert [(f["doc_id"], f["error"]) for f in failures] == [("b", "no box at or above confidence 0.6"),
                                                             ("c", "ImageError: unreadable")]
    (tmp_path / "det" / "all" / "test.jsonl").write_text('{"doc_id": "a"}\n')
    with pytest.raises(LayoutError, match=r"test.jsonl, line 1 is not a detect row"):
        reselect(tmp_path / "det", tmp_path / "t07")
    with pytest.raises(FileNotFoundError, match="holds no <config>/<split>.jsonl"):
        reselect(tmp_path / "t04" / "all", tmp_path / "t08")


def test_cli_errors_name_the_input(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{tmp_path}/synthetic_config.json is missing" in capsys.readouterr().err


def test_region_corpus_round_trips_through_the_loader(corpus, tmp_path):
    pages = {p.doc_id: p for p in gold_pages(corpus, "test")}
    counts = build_region_corpus(corpus / "corpus", tmp_path / "all", "all-box", gold=corpus, configs=["all"])
    assert counts == {"all/test": 12}
    units = load_corpus(tmp_path / "all", "all", "test")
    rows = units.dataset.select_columns(["doc_id", "page_id", "label", "box", "text"]).to_list()
    first = next(iter(pages.values()))
    assert [(r["doc_id"], r["page_id"], r["label"]) for r in rows[:3]] == [
        (f"{first.doc_id}#0", first.doc_id, "title"), (f"{first.doc_id}#1", first.doc_id, "semantic_box"),
        (f"{first.doc_id}#2", first.doc_id, "footer")]
    title, value, label, source, ref = (i.text for i in first.items)  # a chart page: the strings drawn in order
    assert [r["text"] for r in rows[:3]] == [title, f"{value}\n{label}", f"{source}\n{ref}"]
    for row, unit in zip(rows, units):
        box = tuple(int(v) for v in row["box"])
        assert box in [r.box for r in pages[row["page_id"]].regions]
        assert unit.image.size == (box[2] - box[0], box[3] - box[1])
        assert unit.image.tobytes() == pages[row["page_id"]].image.crop(box).tobytes()
    # a margin widens the crop by page pixels, never past the page; the stored box stays the region's
    title_box = first.regions[0].box
    wide = page_units(first.doc_id, first.image, [first.regions[0]], "all-box", margin=10)[0]
    assert title_box == (8, 11, 105, 26)  # widened to (0, 1, 115, 36): the left edge stops at the page's
    assert wide["image"].size == (115, 35) and wide["box"] == list(title_box)
    semantic = build_region_corpus(corpus / "corpus", tmp_path / "sem", "semantic_box-only", gold=corpus,
                                   configs=["all"])
    assert semantic == {"all/test": 4}
    build_region_corpus(corpus / "corpus", tmp_path / "cat", "concatenation", gold=corpus, configs=["all"])
    concatenated = load_corpus(tmp_path / "cat", "all", "test")
    assert concatenated[0].text == f"{value}\n{label}\n{title}\n{source}\n{ref}"  # semantic, then global boxes
    for unit in concatenated:
        title, body, footer = (r.box for r in pages[unit.doc_id.split("#")[0]].regions)
        heights = sum(b[3] - b[1] for b in (body, title, footer))
        assert unit.image.size == (max(b[2] - b[0] for b in (body, title, footer)), heights)


def test_region_corpus_refuses_pages_without_units(corpus, tmp_path, capsys):
    image = gold_pages(corpus, "test")[0].image
    title = Region((8, 11, 105, 26), "title")
    assert len(page_units("p", image, [title], "all-box")) == 1
    with pytest.raises(DataError, match="page 'p' has no semantic_box: it would have no concatenation unit"):
        page_units("p", image, [title], "concatenation")
    with pytest.raises(DataError, match="page 'p' has no selected box"):
        page_units("p", image, [], "all-box")
    # detected boxes: a page the detect output lacks is named
    (tmp_path / "regions" / "all").mkdir(parents=True)
    (tmp_path / "regions" / "all" / "test.jsonl").write_text(json.dumps(
        {"doc_id": "x", "size": [224, 168], "candidates": [], "selected": [[8, 11, 105, 26, "title", 0.9]]}) + "\n")
    first = gold_pages(corpus, "test")[0].doc_id
    with pytest.raises(DataError, match=f"page '{first}' of .* has no boxes in {tmp_path / 'regions'}"):
        build_region_corpus(corpus / "corpus", tmp_path / "out", "all-box", regions=tmp_path / "regions",
                            configs=["all"])
    with pytest.raises(SystemExit) as exit_info:
        region_corpus_main(["build", str(corpus / "corpus"), "--out", str(tmp_path / "o"), "--mode", "all-box",
                            "--gold", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"error: {tmp_path}/synthetic_config.json is missing" in capsys.readouterr().err


def test_figure_puts_gold_beside_selected_boxes(corpus, detector, tmp_path):
    path = figure(corpus, detector, tmp_path / "pages.png", settings=SelectionSettings(threshold=0))
    with Image.open(path) as sheet:
        assert sheet.size == (2 * 448 + 12, 4 * (336 + 12))  # one row per style, each page drawn twice as large
        first = gold_pages(corpus, "test")[0]
        assert sheet.crop((0, 0, 448, 336)).tobytes() == draw_regions(first.image, first.regions).tobytes()
    box = draw_regions(first.image, [Region((0, 0, 10, 10), "title")])
    assert box.getpixel((0, 0)) == box.getpixel((19, 19)) == CLASS_COLOURS["title"]  # outline at 2x, inside edges


def test_stitch_joins_unit_text_in_reading_order(corpus, tmp_path, capsys):
    build_region_corpus(corpus / "corpus", tmp_path / "units", "all-box", gold=corpus, configs=["all"])
    args = ["stitch", str(corpus / "corpus"), "--units", str(tmp_path / "units"), "--column", "text",
            "--out", str(tmp_path / "pages"), "--config", "all"]
    assert region_corpus_main(args) == 0
    assert json.loads(capsys.readouterr().out) == {"all/test": 4}
    stitched = load_corpus(tmp_path / "pages", "all", "test")
    assert text_kinds(tmp_path / "pages") == {"text": "drawn"}
    for page in stitched:
        gold = next(p for p in gold_pages(corpus, "test") if p.doc_id == page.doc_id)
        # title, then the semantic box's strings, then the footer's: every drawn string once
        assert sorted(page.text.split("\n")) == sorted(i.text for i in gold.items)
        assert page.text.split("\n")[0] == gold.items[0].text
    with pytest.raises(SystemExit):
        region_corpus_main([*args[:5], "ocr_text", *args[6:]])
    assert "has no column ['ocr_text']" in capsys.readouterr().err


def test_region_corpus_build_takes_the_boxes_from_layout_settings(corpus, detector, tmp_path, capsys):
    source = corpus / "corpus"
    build = ["build", str(source), "--mode", "all-box", "--config", "all", "--out"]
    assert region_corpus_main([*build, str(tmp_path / "det"), f"layout.model={detector}", "layout.threshold=0"]) == 0
    assert json.loads(capsys.readouterr().out) == {"all/test": len(load_corpus(tmp_path / "det", "all", "test"))}
    # the same units as detect, then build --regions
    write_regions(source, tmp_path / "regions", detector, SelectionSettings(threshold=0), configs=["all"])
    build_region_corpus(source, tmp_path / "two", "all-box", regions=tmp_path / "regions", configs=["all"])
    columns = ["doc_id", "page_id", "label", "box"]
    one, two = (load_corpus(tmp_path / name, "all", "test").dataset.select_columns(columns).to_list()
                for name in ("det", "two"))
    assert one == two
    report = json.loads((tmp_path / "det" / ".layout" / "layout_report.json").read_text())
    assert (report["detected"], report["threshold"]) == (4, 0.0)
    assert region_corpus_main([*build, str(tmp_path / "det"), f"layout.model={detector}", "layout.threshold=0"]) == 0
    report = json.loads((tmp_path / "det" / ".layout" / "layout_report.json").read_text())
    assert (report["detected"], report["cached"]) == (0, 4)  # a rerun detects nothing again
    # layout=gold: the corpus's own boxes, as --gold
    assert region_corpus_main([*build, str(tmp_path / "gold"), "layout=gold", f"layout.root={corpus}"]) == 0
    build_region_corpus(source, tmp_path / "gold2", "all-box", gold=corpus, configs=["all"])
    assert (load_corpus(tmp_path / "gold", "all", "test").dataset.select_columns(columns).to_list()
            == load_corpus(tmp_path / "gold2", "all", "test").dataset.select_columns(columns).to_list())
    capsys.readouterr()
    for settings, message in ((f"layout.model={tmp_path}", f"error: {tmp_path} is not a detector folder"),
                              (f"layout.model={detector} layout.threshold=1",
                               "page(s) have no box, e.g. '"),
                              ("layout.bogus=1", "error: Could not override 'layout.bogus'")):
        with pytest.raises(SystemExit) as exit_info:
            region_corpus_main([*build, str(tmp_path / "bad"), *settings.split()])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        region_corpus_main([*build, str(tmp_path / "bad"), "--gold", str(corpus), "layout=gold"])
    assert "settings ['layout=gold'] apply only without --regions or --gold" in capsys.readouterr().err


def test_jittered_crops_widen_each_edge_within_bounds_the_same_on_every_build(corpus):
    page = gold_pages(corpus, "test")[0]
    image = Image.new("RGB", (224, 168))
    # one margin per edge (left, top, right, bottom), clipped to the page
    assert crop(image, (8, 11, 105, 26), (1, 2, 3, 4)).size == (97 + 4, 15 + 6)
    assert crop(image, (8, 11, 105, 26), (10, 20, 0, 0)).size == (97 + 8, 15 + 11)
    draws = [jittered(2, 5, f"u#{k}") for k in range(200)]
    assert all(2 <= d <= 7 for edges in draws for d in edges)
    assert {d for edges in draws for d in edges} == set(range(2, 8))  # every width drawn, edges independent
    assert len({edges for edges in draws}) > 100
    assert jittered(2, 5, "u#0") == draws[0]
    first = page_units(page.doc_id, page.image, page.regions, "all-box", jitter=5)
    again = page_units(page.doc_id, page.image, page.regions, "all-box", jitter=5)
    for unit, twin, region in zip(first, again, page.regions):
        assert unit["image"].tobytes() == twin["image"].tobytes()
        expected = crop(page.image, region.box, jittered(0, 5, f"{unit['doc_id']}/0"))
        assert unit["image"].size == expected.size and unit["box"] == list(region.box)


def test_training_runs_by_steps_the_same_on_every_call(corpus, detector, tmp_path, capsys):
    # the fixture's two steps again, from the command line: the same weights, byte for byte
    assert main(["train", str(corpus), "--out", str(tmp_path / "again"), "--steps", "2", "--batch-size", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["steps"], report["seed"], report["train_pages"], report["threads"]) == (2, 0, 4, 1)
    for name in ("model.safetensors", "config.json", "trained_on.json"):
        assert (tmp_path / "again" / "model" / name).read_bytes() == (detector / name).read_bytes()
    assert json.loads((detector / "trained_on.json").read_text()) == sorted(
        p.doc_id for p in gold_pages(corpus, "train"))
    train_detector(corpus, tmp_path / "seed1", steps=2, batch_size=2, seed=1)
    assert (tmp_path / "seed1" / "model" / "model.safetensors").read_bytes() != (
        detector / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit):  # wall-clock budgets are gone: a run is its step count
        main(["train", str(corpus), "--out", str(tmp_path / "m"), "--minutes", "1"])
    for option, value, message in (("--steps", "0", r"steps must be an integer in \[1, "),
                                   ("--steps", "-5", r"steps must be an integer in \[1, "),
                                   ("--batch-size", "0", r"batch size must be an integer in \[1, 4096\], got 0"),
                                   ("--lr", "nan", r"lr must be a number in \(0, 1\], got nan"),
                                   ("--lr", "0", r"lr must be a number in \(0, 1\], got 0.0"),
                                   ("--lr", "inf", r"lr must be a number in \(0, 1\], got inf"),
                                   ("--threads", "0", r"threads must be an integer in \[1, 1024\], got 0")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(["train", str(corpus), "--out", str(tmp_path / "bad"), option, value])
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "bad").exists()
    for settings, message in (({"threshold": 1.5}, r"threshold must be a number in \[0, 1\], got 1.5"),
                              ({"threshold": float("nan")}, "threshold must be a number"),
                              ({"alpha": -0.1}, "alpha must be a number in"),
                              ({"beta": float("inf")}, "beta must be a number in")):
        with pytest.raises(LayoutError, match=message):
            SelectionSettings(**settings)


class FakeProcessor:
    """Stands for an image processor whose post-processing returns fixed boxes in page pixels."""

    def __init__(self, boxes):
        self.boxes = boxes

    def __call__(self, images, return_tensors):
        return {"pixel_values": torch.zeros(len(images), 3, 4, 4)}

    def post_process_object_detection(self, outputs, threshold, target_sizes):
        return [{"scores": torch.tensor([s for s, _, _ in self.boxes]), "labels": torch.tensor([c for _, c, _ in
                 self.boxes]), "boxes": torch.tensor([b for _, _, b in self.boxes], dtype=torch.float64)}
                for _ in target_sizes]


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"id2label": dict(enumerate(CLASSES))})()

    def forward(self, pixel_values):
        return None


def test_detect_rounds_boxes_and_drops_slivers_with_a_count():
    boxes = [(0.9, 0, (10.004, 20.126, 100.0, 80.0)),
             (0.8, 1, (223.997, 40.0, 230.0, 60.0)),  # clipped to x1 224, x0 rounds to 224.0: no area left
             (0.7, 3, (5.0, 150.0, 120.0, 168.004)),  # clipped and rounded to the page's 168
             (0.6, 1, (50.0, -3.0, 60.0, 0.002))]  # clipped to y0 0, y1 rounds to 0.0: dropped
    found, dropped = detect(FakeModel(), FakeProcessor(boxes), [Image.new("RGB", (224, 168))] * 2)
    assert dropped == 4  # two slivers on each of the two pages
    assert found[0] == [Region((10.0, 20.13, 100.0, 80.0), "semantic_box", pytest.approx(0.9)),
                        Region((5.0, 150.0, 120.0, 168.0), "footer", pytest.approx(0.7))]


def test_stored_candidates_that_are_no_regions_are_dropped_and_counted(tmp_path, capsys, caplog):
    good = [[0, 0, 100, 50, "title", 0.9], [0, 50, 100, 100, "semantic_box", 0.5]]
    bad = [[100.0, 40, 100, 60, "title", 0.2],  # the sliver: below the threshold, it crashed every rerun
           [0, 0, float("nan"), 10, "title", 0.9], [90, 90, 120, 95, "footer", 0.9], [0, 0, 10, 10, "table", 0.9],
           [0, 0, 10, 10, "title"], "box", [0, 0, 10, 10, "title", 7], [0, 0, 10, 10, "date", None]]
    rows = [{"doc_id": "a", "size": [100, 100], "candidates": good + bad, "selected": []}]
    (tmp_path / "det" / "all").mkdir(parents=True)
    (tmp_path / "det" / "all" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING"):
        assert main(["select", str(tmp_path / "det"), "--out", str(tmp_path / "sel")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["dropped_boxes"], report["failed"]) == (len(bad), 0)
    assert [r["selected"] for r in map(json.loads, (tmp_path / "sel" / "all" / "test.jsonl").open())] == [good]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == len(bad) and all("all/test a, candidate" in w for w in warnings)
    assert "candidate 2: box (100.0, 40.0, 100.0, 60.0) has zero area" in warnings[0]
    assert "candidate 5: box (0.0, 0.0, 10.0, 10.0) has class 'table', not one of SCAN's" in warnings[3]
    rows[0]["size"] = [100, "x"]
    (tmp_path / "det" / "all" / "test.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(LayoutError, match=r"test.jsonl, line 1 \(a\): size \[100, 'x'\] is not a page's"):
        reselect(tmp_path / "det", tmp_path / "sel2")


def test_a_cached_sliver_no_longer_stops_every_rerun(corpus, detector, tmp_path):
    source, out = corpus / "corpus", tmp_path / "regions"
    write_regions(source, out, detector, SelectionSettings(threshold=0), configs=["all"])
    for cached in (out / ".cache").rglob("*.json"):  # as the unrounded code stored a box clipped at the edge
        entry = json.loads(cached.read_text())
        entry["candidates"].append([224.0, 40.0, 224.0, 60.0, "title", 0.1])
        cached.write_text(json.dumps(entry))
    report = write_regions(source, out, detector, SelectionSettings(threshold=0), configs=["all"])
    assert (report["cached"], report["dropped_boxes"], report["failed"]) == (4, 4, [])


def test_evaluation_selects_the_boxes_detect_writes_and_checks_their_classes(corpus, detector, tmp_path):
    settings = SelectionSettings(threshold=0)
    result = evaluate_detector(corpus, detector, settings=settings)
    write_regions(corpus / "corpus", tmp_path / "r", detector, settings, configs=["all"])
    rows = [json.loads(line) for line in (tmp_path / "r" / "all" / "test.jsonl").read_text().splitlines()]
    pages = gold_pages(corpus, "test")
    written = corpus_matching_iou((p.doc_id, [tuple(b[:4]) for b in r["selected"]], [g.box for g in p.regions])
                                  for p, r in zip(pages, rows))
    assert result["selected"] == written  # the same boxes, to the last digit
    assert result["class_agreement"]["min_iou"] == 0.5 and "dropped_boxes" in result


def test_class_agreement_by_hand():
    title, body, footer = Region((0, 0, 100, 20), "title"), Region((0, 20, 100, 80), "semantic_box"), \
        Region((0, 80, 100, 100), "footer")
    page = GoldPage("p", "test", Image.new("RGB", (100, 100)), (title, body, footer))
    predicted = [Region((0, 0, 100, 18), "title", 0.9),  # IoU 0.9, the same class
                 Region((0, 22, 100, 80), "title", 0.8),  # IoU 58/60 with the semantic box, called a title
                 Region((0, 90, 30, 100), "footer", 0.7)]  # IoU 0.15 with the footer: not matched
    agreement = class_agreement([page], [predicted])
    assert agreement == {"min_iou": 0.5, "pairs": 2, "same_class": 0.5,
                         "confusion": {"title": {"title": 1}, "semantic_box": {"title": 1}}}
    assert class_agreement([page], [[]])["same_class"] is None


def test_cross_fitting_never_detects_a_page_with_a_detector_that_trained_on_it(corpus, tmp_path, capsys):
    runs = tmp_path / "cf"
    report = train_detector(corpus, runs, steps=1, batch_size=2, folds=2)
    folds = json.loads((runs / "folds.json").read_text())
    train = {p.doc_id for p in gold_pages(corpus, "train")}
    assert set(folds["pages"]) == train and set(folds["pages"].values()) == {0, 1}
    assert [r["fold"] for r in report["folds"]] == [0, 1]
    for k in (0, 1):  # fold k's detector trained on every train page but fold k's
        seen = set(json.loads((runs / f"fold-{k}" / "model" / "trained_on.json").read_text()))
        assert seen == {p for p, fold in folds["pages"].items() if fold != k}
    # a document's pages share a fold; the assignment does not depend on the other pages
    assert fold_of("synchart-train-d007-p1", 3) == fold_of("synchart-train-d007-p4", 3)
    args = ["detect", str(corpus / "corpus"), "--out", str(tmp_path / "det"), "--threshold", "0"]
    assert main([*args, "--folds", str(runs), "--config", "default", "--config", "all"]) == 0
    assert json.loads(capsys.readouterr().out)["seen_in_training"] == 0
    rows = [json.loads(line) for path in sorted((tmp_path / "det").glob("*/*.jsonl"))
            for line in path.read_text().splitlines()]
    assert {r["doc_id"] for r in rows} == {p.doc_id for p in gold_pages(corpus)}
    for row in rows:
        trained = json.loads((Path(row["detector"]) / "trained_on.json").read_text())
        assert row["doc_id"] not in trained
        expected = runs / f"fold-{folds['pages'][row['doc_id']]}" / "model" if row["doc_id"] in train else \
            runs / "model"
        assert Path(row["detector"]) == expected
    # region_corpus build cross-fits with layout.folds, the same detections
    build = ["build", str(corpus / "corpus"), "--mode", "all-box", "--config", "default", "--out", str(tmp_path / "u"),
             f"layout.model={runs / 'model'}", f"layout.folds={runs}", "layout.threshold=0"]
    assert region_corpus_main(build) == 0
    built = [json.loads(line) for line in (tmp_path / "u" / ".layout" / "default" / "train.jsonl").open()]
    assert {r["doc_id"]: r["detector"] for r in built} == {r["doc_id"]: r["detector"] for r in rows
                                                           if r["doc_id"] in train}
    # without folds the full detector detects its own training pages: counted and warned about
    plain = write_regions(corpus / "corpus", tmp_path / "plain", runs / "model", SelectionSettings(threshold=0),
                          configs=["default"])
    assert plain["seen_in_training"] == len(train)
    # a folds.json that does not match its detectors is refused, naming the page
    (runs / "folds.json").write_text(json.dumps({**folds, "pages": {p: 1 - k for p, k in folds["pages"].items()}}))
    with pytest.raises(LayoutError, match=r"page '.*-train-.*' would be detected by .*fold-\d/model, which trained "
                                          r"on it"):
        write_regions(corpus / "corpus", tmp_path / "bad", runs / "model", folds=runs, configs=["default"])
    (runs / "folds.json").write_text("{")
    with pytest.raises(LayoutError, match=r"folds.json is not a cross-fitting folder's folds.json"):
        write_regions(corpus / "corpus", tmp_path / "bad", runs / "model", folds=runs, configs=["default"])
    for folds_count, message in ((1, r"needs an integer in \[2, 1000\]"), (-2, "needs an integer"),
                                 (10**6, "needs an integer"), (9, r"fold\(s\) \[")):
        with pytest.raises(LayoutError, match=message):
            train_detector(corpus, tmp_path / "x", steps=1, batch_size=2, folds=folds_count)
        assert not (tmp_path / "x").exists()  # refused before any training


def test_fold_detectors_train_at_once_the_same_and_a_finished_detector_is_kept(corpus, detector, tmp_path, caplog):
    # the full detector copied in (as a shipped one would be) is kept; the two fold detectors train in two processes
    run = tmp_path / "cf"
    shutil.copytree(detector, run / "model")
    shutil.copy(detector.parent / "train_report.json", run / "train_report.json")
    stamp = (run / "model" / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="hkrag.data.layout"):
        report = train_detector(corpus, run, steps=2, batch_size=2, folds=2, jobs=2)
    assert (run / "model" / "model.safetensors").stat().st_mtime_ns == stamp
    assert f"{run} already holds this detector" in caplog.text
    assert [r["fold"] for r in report["folds"]] == [0, 1] and report["train_pages"] == 4
    serial = tmp_path / "serial"
    train_detector(corpus, serial, steps=2, batch_size=2, folds=2)
    for k in (0, 1):  # one process after the other gives the same bytes
        for name in ("model.safetensors", "trained_on.json"):
            assert (run / f"fold-{k}" / "model" / name).read_bytes() == (
                serial / f"fold-{k}" / "model" / name).read_bytes()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hkrag.data.layout"):
        train_detector(corpus, serial, steps=3, batch_size=2)  # another step count: trained again
    assert "already holds" not in caplog.text and json.loads((serial / "train_report.json").read_text())["steps"] == 3
    with pytest.raises(LayoutError, match=r"jobs must be an integer in \[1, 1024\], got 0"):
        train_detector(corpus, tmp_path / "x", steps=1, batch_size=2, jobs=0)


def test_a_shipped_detector_is_checked_against_its_manifest(corpus, detector, tmp_path):
    run = detector.parent
    evaluate = ["evaluate", str(corpus), "--model", str(detector), "--out", str(run / "evaluation.json")]
    assert main(evaluate) == 0
    manifest = ship_detector(run, tmp_path / "shipped", run / "evaluation.json")
    shipped = tmp_path / "shipped"
    assert manifest["command"].startswith(f"python -m hkrag.data.layout train {corpus} --out {run} --steps 2 ")
    assert set(manifest["files"]) == {"model/config.json", "model/model.safetensors", "model/preprocessor_config.json",
                                      "model/trained_on.json", "train_report.json", "evaluation.json"}
    assert json.loads((shipped / "manifest.json").read_text()) == manifest
    assert evaluate_detector(corpus, shipped / "model")["selected"]["pooled"] == manifest["matching_iou"]
    with pytest.raises(LayoutError, match="exists and is not empty: pass --replace"):
        ship_detector(run, shipped, run / "evaluation.json")
    other = json.loads((run / "evaluation.json").read_text()) | {"model": "elsewhere"}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(LayoutError, match="other.json evaluates 'elsewhere'"):
        ship_detector(run, tmp_path / "s2", tmp_path / "other.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(LayoutError, match="broken.json cannot be read as JSON"):
        ship_detector(run, tmp_path / "s3", tmp_path / "broken.json")
    weights = shipped / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(LayoutError, match=r"model.safetensors has sha256 .* but .*manifest.json says sha256"):
        load_detector(shipped / "model")


def test_region_boxes_that_are_no_regions_of_the_page_stop_the_build_naming_page_and_box(corpus, tmp_path):
    page = gold_pages(corpus, "test")[0]
    for region, message in ((Region((200, 100, 230, 120), "title", 0.9), r"box \(200.0, 100.0, 230.0, 120.0\) lies "
                                                                         r"outside the 224x168 page"),
                            (Region((-1, 0, 20, 20), "title", 0.9), "lies outside the 224x168 page"),
                            (Region((10, 10, 10, 20), "title", 0.9), "has zero area"),
                            (Region((10, 10, 20, 9), "title", 0.9), "has zero area"),
                            (Region((10, float("nan"), 20, 30), "title", 0.9), "a box is four finite numbers"),
                            (Region((10, 10, 20, 30), "table", 0.9), "has class 'table', not one of SCAN's"),
                            (Region((10, 10, 20, 30), "semantic_box+global", 0.9), r"has class 'semantic_box\+")):
        for mode in ("all-box", "concatenation"):
            with pytest.raises(DataError, match=rf"page '{page.doc_id}', region 1: .*{message}.*: no unit is cut"):
                page_units(page.doc_id, page.image, [page.regions[1], region], mode)
    # the same from a detect folder: named with its page, never a raw imaging error
    regions = tmp_path / "regions" / "all"
    regions.mkdir(parents=True)
    rows = [{"doc_id": p.doc_id, "size": list(p.size), "candidates": [],
             "selected": [[*r.box, r.label, 1.0] for r in p.regions]} for p in gold_pages(corpus, "test")]
    rows[2]["selected"][0][2] = float("nan")
    (regions / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=rf"page '{rows[2]['doc_id']}', region 0: a box is four finite numbers"):
        build_region_corpus(corpus / "corpus", tmp_path / "out", "all-box", regions=tmp_path / "regions",
                            configs=["all"])
    broken_rows = (({**rows[0], "selected": [[1, 2, 3]]}, DataError, "line 2 is not a detect row with selected boxes"),
                   ({"doc_id": "x"}, FileFormatError, "line 2: record lacks"),
                   ("[1, 2]", FileFormatError, r"line 2: record lacks key\(s\) \['doc_id', 'selected'\]"))
    for broken, error, message in broken_rows:
        (regions / "test.jsonl").write_text(json.dumps(rows[1]) + "\n" + json.dumps(broken) + "\n")
        with pytest.raises(error, match=rf"test.jsonl(, |: ){message}"):
            build_region_corpus(corpus / "corpus", tmp_path / "out", "all-box", regions=tmp_path / "regions",
                                configs=["all"])

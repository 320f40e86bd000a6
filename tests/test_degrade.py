"""Page degradations: deterministic, identity at strength 0, monotone in strength, clear errors; corpus copies."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image, ImageFilter

from hkrag.data.degrade import DEGRADATIONS, DONE_FILE, Degradation, degrade_corpus, fine_print_boxes
from hkrag.data.opendocvqa import load_corpus
from hkrag.data.synthetic import PageSpec, SyntheticConfig, generate, render_page

STRENGTHS = {"gaussian_blur": 1.5, "jpeg": 20, "downscale": 2, "salt_pepper": 0.05, "rotate": 3,
             "fine_print_blur": 1.5}
SPEC = PageSpec(doc_id="synchart-test-d000-p1", style="synchart", title="SALES", label="RED", value=42, source="ALPHA",
                code="K7", year="2020", bars=(30, 50, 70, 40), accent=1, page_no=3)


@pytest.fixture(scope="module")
def page() -> tuple[Image.Image, list[tuple[int, int, int, int]]]:
    image, items = render_page(SPEC)
    return image, [item.box for item in items if item.kind == "fine_print"]


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def high_frequency(image: Image.Image) -> float:
    """Mean squared Laplacian response: what blur removes."""
    return float(np.square(np.asarray(image.convert("L").filter(ImageFilter.FIND_EDGES), dtype=float)).mean())


def difference(a: Image.Image, b: Image.Image) -> float:
    return float(np.abs(np.asarray(a, dtype=float) - np.asarray(b.convert("RGB"), dtype=float)).mean())


@pytest.mark.parametrize("name", DEGRADATIONS)
def test_deterministic_and_changes_the_page(page, name):
    image, boxes = page
    spec = Degradation.parse(f"{name}:{STRENGTHS[name]}")
    first, second = spec.apply(image, SPEC.doc_id, boxes), spec.apply(image.copy(), SPEC.doc_id, boxes)
    assert png(first) == png(second)
    assert first.size == image.size and first.mode == "RGB"
    assert first.tobytes() != image.tobytes()


@pytest.mark.parametrize("name", DEGRADATIONS)
def test_zero_strength_is_identity(page, name):
    image, boxes = page
    out = Degradation(name, 0).apply(image, SPEC.doc_id, boxes)
    assert png(out) == png(image)
    assert Degradation(name, 0).is_identity and str(Degradation(name, 0)) == f"{name}:0"


def test_downscale_by_one_is_identity(page):
    assert Degradation("downscale", 1).apply(page[0]) is page[0]


def test_blur_removes_high_frequencies_monotonically(page):
    energy = [high_frequency(Degradation("gaussian_blur", s).apply(page[0])) for s in (0, 0.5, 1, 2, 4)]
    assert energy == sorted(energy, reverse=True) and energy[-1] < energy[0] / 4


@pytest.mark.parametrize("name, strengths", [("jpeg", (90, 40, 10, 2)), ("downscale", (1.5, 2, 4, 8)),
                                             ("salt_pepper", (0.01, 0.05, 0.2)), ("rotate", (1, 3, 8))])
def test_stronger_means_further_from_the_page(page, name, strengths):
    distances = [difference(page[0], Degradation(name, s).apply(page[0], SPEC.doc_id)) for s in strengths]
    assert distances == sorted(distances) and distances[0] > 0


def test_salt_pepper_hits_the_fraction_and_is_seeded_by_page_and_seed():
    white = Image.new("RGB", (200, 100), "white")
    noisy = np.asarray(Degradation("salt_pepper", 0.1).apply(white, "a"))
    assert abs((noisy != 255).any(axis=2).mean() - 0.05) < 0.01  # half of the hit pixels are salt (white)
    assert set(np.unique(noisy)) == {0, 255}
    same = Degradation("salt_pepper", 0.1).apply(white, "a").tobytes()
    assert same == noisy.tobytes()
    assert Degradation("salt_pepper", 0.1).apply(white, "b").tobytes() != same
    assert Degradation("salt_pepper", 0.1, seed=1).apply(white, "a").tobytes() != same


def test_rotate_fills_white_and_keeps_size():
    black = Image.new("RGB", (100, 100), "black")
    rotated = np.asarray(Degradation("rotate", 10).apply(black))
    assert rotated.shape == (100, 100, 3) and tuple(rotated[0, 0]) == (255, 255, 255)


def test_fine_print_blur_touches_only_fine_print(page):
    image, boxes = page
    out = np.asarray(Degradation("fine_print_blur", 2).apply(image, SPEC.doc_id, boxes), dtype=int)
    inside = np.zeros(out.shape[:2], bool)
    for x0, y0, x1, y1 in boxes:
        inside[max(0, y0 - 2):y1 + 2, max(0, x0 - 2):x1 + 2] = True
    changed = (out != np.asarray(image, dtype=int)).any(axis=2)
    assert changed[inside].any() and not changed[~inside].any()
    with pytest.raises(ValueError, match="no fine-print boxes"):
        Degradation("fine_print_blur", 2).apply(image, "x")


@pytest.mark.parametrize("spec, message", [
    ("blur:1", "unknown degradation 'blur': choose from gaussian_blur, jpeg"),
    ("gaussian_blur", "expected NAME:STRENGTH"),
    ("gaussian_blur:", "expected NAME:STRENGTH"),
    ("gaussian_blur:abc", "strength 'abc' is not a number"),
    ("gaussian_blur:-1", r"must be in \[0, 50\], got -1"),
    ("gaussian_blur:nan", "finite number"),
    ("jpeg:101", r"JPEG quality \(0 = off\)\) must be in \[1, 100\] or 0 \(off\), got 101"),
    ("jpeg:0.5", r"must be in \[1, 100\]"),
    ("downscale:0.5", r"shrink factor .* must be in \[1, 64\] or 0 \(off\), got 0.5"),
    ("salt_pepper:1.5", r"must be in \[0, 1\]"),
    ("rotate:90", r"must be in \[-45, 45\], got 90"),
])
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message) as error:
        Degradation.parse(spec)
    assert repr(spec) in str(error.value)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    config = SyntheticConfig(n_train=4, n_test=4, train_groups_per_style=1, test_groups_per_style=1, group_size=2)
    return generate(tmp_path_factory.mktemp("synthetic"), config)


def stored(root, config, split):
    corpus = load_corpus(root, config, split)
    return corpus.doc_ids, corpus.fingerprints(), corpus


def test_degrade_corpus_keeps_doc_ids_and_changes_pages(synthetic, tmp_path):
    out = degrade_corpus(synthetic.corpus, tmp_path / "blur", "gaussian_blur:1", configs=["all", "synchart"])
    for config in ("all", "synchart"):
        ids, prints, corpus = stored(synthetic.corpus, config, "test")
        new_ids, new_prints, degraded = stored(out, config, "test")
        assert new_ids == ids and all(a != b for a, b in zip(prints, new_prints))
        assert degraded.dataset.column_names == ["doc_id", "image"]
        assert degraded[0].image.size == corpus[0].image.size
    record = json.loads((out / DONE_FILE).read_text())
    assert record["degradation"] == "gaussian_blur:1" and record["done"] == ["all/test", "synchart/test"]


def test_degrade_corpus_at_zero_strength_copies_the_stored_bytes(synthetic, tmp_path):
    out = degrade_corpus(synthetic.corpus, tmp_path / "none", Degradation("jpeg", 0), configs=["all"])
    assert stored(out, "all", "test")[:2] == stored(synthetic.corpus, "all", "test")[:2]


def test_degrade_corpus_resumes_and_redoes_on_a_new_spec(synthetic, tmp_path, monkeypatch):
    import hkrag.data.degrade as degrade

    written = []
    save = degrade.save_split
    monkeypatch.setattr(degrade, "save_split", lambda rows, root, config, split, features:
                        written.append(config) or save(rows, root, config, split, features))
    degrade_corpus(synthetic.corpus, tmp_path / "d", "salt_pepper:0.1", configs=["all", "syntable"])
    degrade_corpus(synthetic.corpus, tmp_path / "d", "salt_pepper:0.1", configs=["all", "syntable", "syninfo"])
    assert written == ["all", "syntable", "syninfo"]
    degrade_corpus(synthetic.corpus, tmp_path / "d", "salt_pepper:0.2", configs=["all"])
    assert written[-1] == "all" and json.loads((tmp_path / "d" / DONE_FILE).read_text())["done"] == ["all/test"]


def test_degrade_corpus_blurs_fine_print_from_the_pages_file(synthetic, tmp_path):
    boxes = fine_print_boxes(synthetic.pages)
    out = degrade_corpus(synthetic.corpus, tmp_path / "fine", "fine_print_blur:2", configs=["synslide"])
    source, degraded = load_corpus(synthetic.corpus, "synslide", "test"), load_corpus(out, "synslide", "test")
    page = source.doc_ids[0]
    expected = Degradation("fine_print_blur", 2).apply(source[page].image, page, boxes[page])
    assert degraded[page].image.tobytes() == expected.tobytes()
    with pytest.raises(ValueError, match="does not exist"):
        degrade_corpus(synthetic.corpus, tmp_path / "x", "fine_print_blur:2", boxes=tmp_path / "missing.jsonl")


def test_degrade_corpus_refuses_its_source_and_unknown_configs(synthetic, tmp_path):
    with pytest.raises(ValueError, match="is the source corpus"):
        degrade_corpus(synthetic.corpus, synthetic.corpus, "jpeg:10")
    with pytest.raises(ValueError, match=r"no config \['nope'\]"):
        degrade_corpus(synthetic.corpus, tmp_path / "x", "jpeg:10", configs=["nope"])


def test_degradation_study_ranks_each_strength_and_resumes(tmp_path):
    from hkrag.data.ocr import OcrUnavailable, install_tesseract
    from hkrag.retrieval.bm25 import BM25Ranker
    from hkrag.retrieval.degradation import STUDY_TABLE, DegradationStudy, run_study
    from hkrag.retrieval.evaluation import RetrievalEvalConfig

    try:
        install_tesseract()
    except OcrUnavailable as reason:
        pytest.skip(str(reason))
    data = generate(tmp_path / "data", SyntheticConfig(n_train=4, n_test=16, train_groups_per_style=1,
                                                       test_groups_per_style=1, group_size=2))
    cfg = RetrievalEvalConfig(qa_source=str(data.qa), corpus_source=str(data.corpus), datasets=["synchart"],
                              pools=["single"])
    built = []

    def rankers(point_dir):
        built.append(point_dir.name)
        return {"bm25": BM25Ranker(allow_empty=True)}

    study = DegradationStudy(["gaussian_blur", "jpeg"], {"gaussian_blur": [1], "jpeg": [5]})
    result = run_study(study, rankers, cfg, tmp_path / "study")
    assert built == ["clean", "gaussian_blur-1", "jpeg-5"]  # strength 0 evaluated once for both
    rows = {(r["degradation"], r["strength"], r["evidence"]): r["ndcg@5"] for r in result["rows"]}
    assert set(rows) == {(d, s, e) for d, s in [("gaussian_blur", 0), ("gaussian_blur", 1), ("jpeg", 0), ("jpeg", 5)]
                         for e in ("all", "salient", "fine_print")}
    assert rows["gaussian_blur", 0, "all"] == rows["jpeg", 0, "all"] > rows["gaussian_blur", 1, "all"]
    clean = load_corpus(tmp_path / "study" / "corpora" / "clean" / "text", "synchart", "test")
    assert clean.fingerprints() == load_corpus(data.corpus, "synchart", "test").fingerprints()
    assert all(title in text for title, text in zip([t.split()[0] for t in load_corpus(
        data.corpus, "synchart", "test").texts()], clean.texts()))  # BM25 read the OCR text, not the drawn text
    table = (tmp_path / "study" / STUDY_TABLE).read_text()
    assert "ndcg@5 (x100), gaussian_blur, single pool" in table and "| Retriever | Evidence | 0 | 1 |" in table
    assert run_study(study, rankers, cfg, tmp_path / "study")["rows"] == result["rows"] and len(built) == 3


def test_study_points_run_mildest_first_and_the_table_averages_data_sets():
    from hkrag.retrieval.degradation import DegradationStudy, study_table

    study = DegradationStudy(["jpeg", "rotate"], {"jpeg": [5, 20], "rotate": [-3, 1]})
    assert [str(p) for p in study.points()] == ["jpeg:0", "jpeg:20", "jpeg:5", "rotate:0", "rotate:1", "rotate:-3"]
    with pytest.raises(ValueError, match="unknown degradation 'blurr'"):
        DegradationStudy(["blurr"], [1]).points()
    rows = [{"degradation": "jpeg", "strength": s, "retriever": "bm25", "dataset": d, "pool": "all", "evidence": "all",
             "ndcg@5": v} for s, d, v in [(0, "a", 0.8), (0, "b", 0.6), (20, "a", 0.5), (20, "b", 0.2)]]
    assert study_table(rows) == ("ndcg@5 (x100), jpeg, all pool\n\n| Retriever | Evidence | 0 | 20 |\n"
                                 "|---|---|---|---|\n| bm25 | all | 70.0 | 35.0 |")


def test_cli_writes_a_copy_and_names_a_bad_spec(synthetic, tmp_path, capsys):
    from hkrag.data.degrade import main

    assert main([str(synthetic.corpus), "rotate:-2", "--out", str(tmp_path / "r"), "--config", "syninfo"]) == 0
    assert load_corpus(tmp_path / "r", "syninfo", "test").doc_ids == load_corpus(synthetic.corpus, "syninfo",
                                                                                "test").doc_ids
    with pytest.raises(SystemExit) as exit_:
        main([str(synthetic.corpus), "blur:1", "--out", str(tmp_path / "x")])
    assert exit_.value.code == 2 and "unknown degradation 'blur'" in capsys.readouterr().err

"""Page text by the real Tesseract: salient words read, cached, resumable, failures named, a PDF's text layer
taken, the synthetic corpus's drawn strings never taken for one, the page's id and image never overwritten."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import datasets
import pytest
import yaml

import hkrag.data.ocr as ocr
from hkrag.data.ocr import (
    FAILURES_FILE,
    REPORT_FILE,
    OcrSettings,
    OcrUnavailable,
    add_page_text,
    character_accuracy,
    debian_packages,
    install_tesseract,
    ocr_image,
)
from hkrag.data.opendocvqa import CORPUS_FEATURES, DataError, load_corpus, read_card, text_kinds
from hkrag.data.pdf import ingest
from hkrag.data.synthetic import PageSpec, SyntheticConfig, generate, render_page
from hkrag.data.writer import save_split

SPEC = PageSpec(doc_id="synchart-test-d000-p1", style="synchart", title="ENERGY", label="GREEN", value=57,
                source="KILO", code="R4", year="2019", bars=(30, 50, 70, 40), accent=1, page_no=3)


@pytest.fixture(scope="session")
def tesseract() -> str:
    """Tesseract's version; installs Debian's packages when missing (as root), else skips saying why."""
    try:
        return install_tesseract("eng")
    except OcrUnavailable as reason:
        pytest.skip(str(reason))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, tesseract):
    """A small built-in corpus where the README's commands look for it: ``<root>/data/synthetic``."""
    config = SyntheticConfig(n_train=4, n_test=4, train_groups_per_style=1, test_groups_per_style=1, group_size=2)
    return generate(tmp_path_factory.mktemp("project") / "data" / "synthetic", config)


def readme_ocr_command() -> list[str]:
    """The arguments of the README's ``python -m hkrag.data.ocr`` line, as written (comment dropped)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    [line] = [line for line in readme.splitlines() if line.startswith("python -m hkrag.data.ocr ")]
    return shlex.split(line, comments=True)[3:]


REAL_OCR = ocr.ocr_image


class Counting:
    """``ocr_image`` that counts its calls and can stop the run (an interruption) at a given call."""

    def __init__(self, stop_at: int | None = None):
        self.calls, self.stop_at = 0, stop_at

    def __call__(self, image, settings):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return REAL_OCR(image, settings)


@pytest.fixture
def counting(monkeypatch):
    """Replaces ``ocr_image`` (in this process: workers=1) by a fresh :class:`Counting` on each call."""
    def install(stop_at: int | None = None) -> Counting:
        counter = Counting(stop_at)
        monkeypatch.setattr(ocr, "ocr_image", counter)
        return counter

    return install


def test_reads_the_salient_words_of_a_rendered_page(tesseract):
    image, items = render_page(SPEC)
    text = ocr_image(image)
    for word in ("ENERGY", "57%", "GREEN", "KILO", "2019"):
        assert word in text
    assert character_accuracy(text, "\n".join(item.text for item in items)) > 0.7


def test_character_accuracy_is_one_minus_the_edit_rate():
    assert character_accuracy("SALES\n42%", "SALES 42%") == 1.0
    assert character_accuracy("SALFS 42", "SALES 42%") == pytest.approx(1 - 2 / 9)
    assert character_accuracy("", "ab") == 0.0 and character_accuracy("", " ") == 1.0
    assert character_accuracy("x" * 50, "ab") == 0.0


def test_corpus_gets_an_ocr_column_then_reruns_from_the_cache(synthetic, tmp_path, counting):
    out = tmp_path / "ocr"
    report = ocr.main([str(synthetic.corpus), "--out", str(out), "--config", "synchart", "--config", "syninfo",
                       "--column", "ocr_text", "--text-layer", "none", "--workers", "2"])
    assert report == 0
    for config in ("synchart", "syninfo"):
        source, corpus = load_corpus(synthetic.corpus, config, "test"), load_corpus(out, config, "test")
        assert corpus.doc_ids == source.doc_ids and corpus.fingerprints() == source.fingerprints()
        texts = corpus.dataset["ocr_text"][:]
        assert corpus.texts() == source.texts()  # the drawn strings are kept
        for text, drawn in zip(texts, source.texts()):
            assert drawn.splitlines()[0] in text  # the title
    assert json.loads((out / FAILURES_FILE).read_text()) == []
    counter = counting()
    again = add_page_text(synthetic.corpus, out, "ocr_text", text_layer=None, configs=["synchart", "syninfo"])
    assert counter.calls == 0 and (again.cached, again.ocr, again.pages) == (4, 0, 4)
    assert load_corpus(out, "syninfo", "test").dataset["ocr_text"][:] == texts
    other = add_page_text(synthetic.corpus, out, "ocr_text", OcrSettings(upscale=2), None, ["synchart"],
                          overwrite=True)
    assert other.ocr == 2  # other settings, other cache entries


def test_the_readmes_command_ocrs_every_page_of_the_built_in_corpus(synthetic, monkeypatch, capsys):
    """The README line runs as written; the drawn strings are ground truth, not a text layer, so every page is read."""
    args = readme_ocr_command()
    out, column = Path(args[args.index("--out") + 1]), args[args.index("--column") + 1]
    assert text_kinds(synthetic.corpus) == {"text": "drawn"}
    monkeypatch.chdir(synthetic.root.parent.parent)
    assert ocr.main(args) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    splits = {(s["config"], s["split"]): s for s in report["splits"]}
    assert sorted(splits) == [("all", "test"), ("default", "train"), *((c, "test") for c in sorted(synthetic_sets()))]
    for (config, split), record in splits.items():
        source = load_corpus(synthetic.corpus, config, split)
        assert record["ocr"] == source.doc_ids and record["text_layer"] == record["failed"] == []
    assert (report["kind"], report["text_layer_column"], report["from_text_layer"]) == ("ocr", None, 0)
    assert report["pages"] == report["ocr"] == sum(len(s["ocr"]) for s in report["splits"])
    corpus = load_corpus(out, "all", "test")
    texts, drawn = corpus.dataset[column][:], corpus.texts()
    accuracy = [character_accuracy(text, exact) for text, exact in zip(texts, drawn)]  # Tesseract's, not a copy
    assert sum(a < 1 for a in accuracy) > len(drawn) / 2 and 0.5 < sum(accuracy) / len(drawn) < 0.95, accuracy
    assert sum(exact.splitlines()[0] in text for text, exact in zip(texts, drawn)) > len(drawn) / 2  # titles read
    assert text_kinds(out) == {"text": "drawn", column: "ocr"}
    printed = capsys.readouterr().out
    assert f"{column} of {report['pages']} pages -> {out}: {report['pages']} OCRed by Tesseract" in printed
    assert "0 from a text layer" in printed and "declares {text: drawn}, no text layer" in printed


def synthetic_sets() -> list[str]:
    from hkrag.data.synthetic import data_sets

    return data_sets(SyntheticConfig(n_train=4, n_test=4, train_groups_per_style=1, test_groups_per_style=1,
                                     group_size=2))


def test_a_corpus_whose_card_declares_nothing_is_ocred(synthetic, tmp_path, counting):
    """Older corpora and OpenDocVQA declare no text columns: the safe default reads every page."""
    source = tmp_path / "old"
    rows = load_corpus(synthetic.corpus, "synchart", "test").dataset
    save_split(rows, source, "synchart", "test", rows.features)  # a text column, no declaration
    assert "text_columns" not in read_card(source / "README.md")[0]
    counter = counting()
    report = add_page_text(source, tmp_path / "out", "ocr_text")
    assert (report.layer, report.text_layer, report.ocr, counter.calls) == (None, 0, 2, 2)
    assert report.why == "every page OCRed: the corpus card declares no text layer"
    assert text_kinds(tmp_path / "out") == {"ocr_text": "ocr"}


def test_a_column_forced_as_the_layer_is_copied_with_a_warning(synthetic, tmp_path, counting, caplog):
    counter = counting()
    with caplog.at_level(logging.WARNING):
        report = add_page_text(synthetic.corpus, tmp_path / "out", "copy", text_layer="text", configs=["synchart"])
    assert "declares 'text' drawn, not a text layer" in caplog.text
    corpus = load_corpus(tmp_path / "out", "synchart", "test")
    assert corpus.dataset["copy"][:] == corpus.texts() and (counter.calls, report.text_layer) == (0, 2)
    assert text_kinds(tmp_path / "out") == {"text": "drawn", "copy": "drawn"}  # never declared OCR


def test_an_interrupted_run_resumes_where_it_stopped(synthetic, tmp_path, counting):
    out = tmp_path / "resume"
    counting(stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        add_page_text(synthetic.corpus, out, "ocr_text", text_layer=None, configs=["all"], batch_size=2,
                      overwrite=True)
    assert not (out / "all").exists() or not list((out / "all").glob("*.parquet"))
    counter = counting()
    report = add_page_text(synthetic.corpus, out, "ocr_text", text_layer=None, configs=["all"], batch_size=2)
    pages = len(load_corpus(synthetic.corpus, "all", "test"))
    assert (report.cached, report.ocr, counter.calls) == (2, pages - 2, pages - 2)


def test_a_page_that_fails_is_named_and_kept(tesseract, tmp_path, caplog):
    image, _ = render_page(SPEC)
    rows = [{"doc_id": "good", "image": image}, {"doc_id": "broken", "image": {"bytes": b"not a png", "path": None}}]
    save_split(rows, tmp_path / "src", "default", "train", CORPUS_FEATURES)
    with caplog.at_level(logging.WARNING):
        report = add_page_text(tmp_path / "src", tmp_path / "out")
    corpus = load_corpus(tmp_path / "out", max_pixels=None)
    assert corpus.doc_ids == ["good", "broken"] and corpus.texts()[1] == "" and "ENERGY" in corpus.texts()[0]
    assert [f["doc_id"] for f in report.failed] == ["broken"] and "ImageError" in report.failed[0]["error"]
    assert json.loads((tmp_path / "out" / FAILURES_FILE).read_text())[0]["doc_id"] == "broken"
    [split] = json.loads((tmp_path / "out" / REPORT_FILE).read_text())["splits"]
    assert (split["ocr"], split["failed"], split["text_layer"]) == (["good"], ["broken"], [])
    assert "default/train:broken" in caplog.text and "1 pages could not be read" in caplog.text


def test_the_command_fails_when_no_page_was_ocred(tesseract, tmp_path, capsys):
    image, _ = render_page(SPEC)
    broken = {"bytes": b"not a png", "path": None}
    save_split([{"doc_id": "a", "image": broken}, {"doc_id": "b", "image": broken}], tmp_path / "bad", "default",
               "train", CORPUS_FEATURES)
    assert ocr.main([str(tmp_path / "bad"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "error: no page was OCRed: all 2 pages that needed OCR failed" in err and FAILURES_FILE in err
    assert len(json.loads((tmp_path / "out" / FAILURES_FILE).read_text())) == 2  # the copy and its record are kept
    save_split([{"doc_id": "good", "image": image}, {"doc_id": "c", "image": broken}], tmp_path / "half", "default",
               "train", CORPUS_FEATURES)
    assert ocr.main([str(tmp_path / "half"), "--out", str(tmp_path / "out2")]) == 0  # one page read: a warning only
    assert "no page was OCRed" not in capsys.readouterr().err


def test_pdf_text_layer_is_preferred_over_ocr(tesseract, tmp_path, counting):
    from matplotlib.backends.backend_pdf import PdfPages
    from matplotlib.figure import Figure

    with PdfPages(tmp_path / "born_digital.pdf") as pdf:
        figure = Figure(figsize=(3, 1))
        figure.text(0.1, 0.5, "LAYER WORDS 2024")
        pdf.savefig(figure)
    render_page(SPEC)[0].save(tmp_path / "scan.pdf", "PDF", resolution=72)
    ingest([tmp_path / "born_digital.pdf", tmp_path / "scan.pdf"], tmp_path / "src", dpi=72)
    assert text_kinds(tmp_path / "src") == {"text": "text_layer"}
    with pytest.raises(ValueError, match="already has a 'text' column: pass overwrite"):
        add_page_text(tmp_path / "src", tmp_path / "out")
    counter = counting()
    report = add_page_text(tmp_path / "src", tmp_path / "out", overwrite=True)
    texts = dict(zip(*[load_corpus(tmp_path / "out").dataset[c][:] for c in ("doc_id", "text")]))
    assert texts["born_digital.pdf#p1"].strip() == "LAYER WORDS 2024"
    assert "ENERGY" in texts["scan.pdf#p1"]
    assert (report.text_layer, report.ocr, counter.calls) == (1, 1, 1)
    saved = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    assert (saved["text_layer_column"], saved["kind"]) == ("text", "text_layer+ocr")
    assert (saved["splits"][0]["text_layer"], saved["splits"][0]["ocr"]) == (["born_digital.pdf#p1"], ["scan.pdf#p1"])
    assert text_kinds(tmp_path / "out") == {"text": "text_layer+ocr"}  # a rerun OCRs the scans' text again
    assert add_page_text(tmp_path / "out", tmp_path / "again", "ocr_text").layer is None


def test_settings_and_packages_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        ocr.main([str(tmp_path), "--out", str(tmp_path / "x"), "--psm", "20"])
    assert exit_.value.code == 2 and "psm must be a Tesseract page segmentation mode" in capsys.readouterr().err
    assert debian_packages("eng+chi_sim") == ["tesseract-ocr", "tesseract-ocr-eng", "tesseract-ocr-chi-sim"]
    for bad, message in [({"psm": 14}, "psm"), ({"upscale": 0}, "upscale"), ({"lang": "eng; rm"}, "lang")]:
        with pytest.raises(ValueError, match=message):
            OcrSettings(**bad)


@pytest.mark.parametrize("column", ["doc_id", "image"])
def test_the_pages_id_and_image_are_never_overwritten(synthetic, tmp_path, capsys, column):
    with pytest.raises(SystemExit) as exit_:
        ocr.main(["--source", str(synthetic.corpus), "--out", str(tmp_path / "out"), "--column", column,
                  "--overwrite"])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and f"--column {column}: {column!r} identifies or holds the page" in error
    assert "--column ocr_text" in error and not (tmp_path / "out").exists()


def test_a_column_that_is_not_text_is_never_overwritten_or_read_as_a_layer(tesseract, tmp_path):
    features = datasets.Features({**CORPUS_FEATURES, "page_no": datasets.Value("int32")})
    save_split([{"doc_id": "a", "image": render_page(SPEC)[0], "page_no": 3}], tmp_path / "src", "default", "train",
               features)
    with pytest.raises(ValueError, match=r"--column page_no: 'page_no' is not a text column \(Value\('int32'"):
        add_page_text(tmp_path / "src", tmp_path / "out", "page_no", overwrite=True)
    with pytest.raises(ValueError, match="--text-layer page_no: 'page_no' is not a text column"):
        add_page_text(tmp_path / "src", tmp_path / "out", "ocr_text", text_layer="page_no")
    assert not (tmp_path / "out").exists()


def test_the_source_is_given_once(tmp_path, capsys):
    for argv, message in [([], "give the corpus to read: SOURCE or --source SOURCE"),
                          (["a", "--source", "b"], "two sources given: a and --source b")]:
        with pytest.raises(SystemExit) as exit_:
            ocr.main([*argv, "--out", str(tmp_path / "x")])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_malformed_declaration_names_the_card(synthetic, tmp_path):
    card = tmp_path / "README.md"
    meta, body = read_card(synthetic.corpus / "README.md")
    card.write_text("---\n" + yaml.safe_dump({**meta, "text_columns": {"text": "handwritten"}}) + "---\n" + body)
    with pytest.raises(DataError, match=rf"{card}: text_columns must map column names to one of"):
        text_kinds(tmp_path)


def test_bad_requests_are_refused(synthetic, tmp_path):
    with pytest.raises(ValueError, match="is the source corpus"):
        add_page_text(synthetic.corpus, synthetic.corpus, "ocr_text")
    with pytest.raises(ValueError, match=r"no split \['dev'\]"):
        add_page_text(synthetic.corpus, tmp_path / "x", "ocr_text", splits=["dev"])
    with pytest.raises(ValueError, match="not a corpus folder"):
        add_page_text(tmp_path, tmp_path / "x", "ocr_text")
    with pytest.raises(ValueError, match="neither a corpus folder nor a loadable hub data set"):
        add_page_text(tmp_path / "missing", tmp_path / "x", "ocr_text")

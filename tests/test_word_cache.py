"""The disk cache of Tesseract's word boxes that text grounding reads (hkrag.data.ocr.WordBoxCache): a page read
once is never read again with the same settings and Tesseract, another setting or Tesseract misses, a damaged entry
is read again with a warning, and the cached boxes are the fresh ones.

Most tests stand a fake Tesseract in for pytesseract (its boxes worked out by hand below); one reads a rendered page
with the real one."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
from PIL import Image

import hkrag.data.ocr as ocr
from hkrag.data.ocr import OcrSettings, OcrUnavailable, WordBoxCache, install_tesseract, ocr_words
from hkrag.data.synthetic import PageSpec, render_page
from hkrag.rag.evidence import Grounder, GroundingConfig, PageView
from hkrag.rag.grounding import TextSource
from hkrag.rag.records import QueryOutcome

SETTINGS = OcrSettings(psm=11, upscale=2.0)
# Tesseract's boxes on the page upscaled 2x (left, top, width, height), and so in page pixels:
# TOTAL (20, 10, 40, 16) / 2 -> (10, 5, 30, 13); 42 (60, 10, 18, 16) / 2 -> (30, 5, 39, 13); the blank is dropped.
DATA = {"text": ["TOTAL", " ", "42"], "left": [20, 0, 60], "top": [10, 0, 10], "width": [40, 0, 18],
        "height": [16, 0, 16]}
WORDS = [("TOTAL", (10.0, 5.0, 30.0, 13.0)), ("42", (30.0, 5.0, 39.0, 13.0))]


class FakeTesseract:
    """pytesseract's calls that OCR makes, counting ``image_to_data``; ``version`` is what it reports."""

    class Output:
        DICT = "dict"

    class TesseractNotFoundError(OSError):
        pass

    def __init__(self) -> None:
        self.version, self.calls = "5.3.0", []

    def get_tesseract_version(self) -> str:
        return self.version

    def get_languages(self, config: str = "") -> list[str]:
        return ["eng", "deu", "osd"]

    def image_to_data(self, image: Image.Image, lang: str, config: str, output_type: str) -> dict:
        self.calls.append((image.size, lang, config))
        return DATA


@pytest.fixture
def tesseract(monkeypatch) -> FakeTesseract:
    fake = FakeTesseract()
    monkeypatch.setattr(ocr, "_pytesseract", lambda: fake)
    return fake


def page(colour: int = 255) -> Image.Image:
    return Image.new("RGB", (50, 20), (colour, colour, colour))


def entries(root: Path) -> list[Path]:
    return sorted(root.rglob("*.words.json"))


def test_a_page_is_read_once_and_the_cached_boxes_are_the_fresh_ones(tesseract, tmp_path):
    cache = WordBoxCache(tmp_path)
    assert ocr_words(page(), SETTINGS, cache) == WORDS
    assert ocr_words(page(), SETTINGS, cache) == WORDS
    assert WordBoxCache(tmp_path).get(cache.key(page(), SETTINGS)) == WORDS  # from disk, as another run reads it
    assert tesseract.calls == [((100, 40), "eng", "--psm 11")]
    [entry] = entries(tmp_path)
    assert entry.parent.name == entry.name[:2] and entry.name == f"{cache.key(page(), SETTINGS)}.words.json"
    assert json.loads(entry.read_text())["words"] == [["TOTAL", 10.0, 5.0, 30.0, 13.0], ["42", 30.0, 5.0, 39.0, 13.0]]


def test_a_second_grounding_of_the_page_runs_no_tesseract(tesseract, tmp_path):
    def grounded(cache: WordBoxCache | None) -> QueryOutcome:
        grounder = Grounder(TextSource(), lambda doc_id: PageView(page(), doc_id), ocr=SETTINGS, cache=cache)
        return grounder.annotate(QueryOutcome("q", "Total?", ["42"], kept=["p1"], answer="42"))

    first = grounded(WordBoxCache(tmp_path))
    assert first.evidence == [{"page_id": "p1", "box": [30.0, 5.0, 39.0, 13.0], "source": "text", "score": 1.0}]
    assert len(tesseract.calls) == 1
    assert grounded(WordBoxCache(tmp_path)).evidence == first.evidence  # a new run, the same cache folder
    assert len(tesseract.calls) == 1
    assert grounded(None).evidence == first.evidence and len(tesseract.calls) == 2  # no cache: read again


@pytest.mark.parametrize("other", [OcrSettings(psm=6, upscale=2.0), OcrSettings(psm=11, upscale=3.0),
                                   OcrSettings(lang="deu", psm=11, upscale=2.0)], ids=["psm", "upscale", "lang"])
def test_another_setting_misses(tesseract, tmp_path, other):
    cache = WordBoxCache(tmp_path)
    ocr_words(page(), SETTINGS, cache)
    ocr_words(page(), other, cache)
    assert len(tesseract.calls) == 2 and len(entries(tmp_path)) == 2
    assert cache.key(page(), other) != cache.key(page(), SETTINGS)


def test_another_tesseract_or_another_page_misses(tesseract, tmp_path):
    ocr_words(page(), SETTINGS, WordBoxCache(tmp_path))
    tesseract.version = "5.4.1"
    ocr_words(page(), SETTINGS, WordBoxCache(tmp_path))
    assert len(tesseract.calls) == 2
    ocr_words(page(254), SETTINGS, WordBoxCache(tmp_path))  # every pixel one level darker
    assert len(tesseract.calls) == 3 and len(entries(tmp_path)) == 3


def test_the_key_is_the_pixels_tesseract_reads_not_the_image_object(tesseract, tmp_path):
    cache = WordBoxCache(tmp_path)
    assert cache.key(page(), SETTINGS) == cache.key(page().convert("RGBA"), SETTINGS)  # OCR reads RGB either way
    assert cache.key(page(), SETTINGS) != cache.key(page().resize((20, 50)), SETTINGS)
    assert cache.key(Image.new("RGB", (10, 100)), SETTINGS) != cache.key(Image.new("RGB", (100, 10)), SETTINGS)


@pytest.mark.parametrize("damage", [b'{"key": "', b"\xff\xfe", b"[]", b'{"key": "0", "words": []}',
                                    b'{"key": "K", "words": [["TOTAL", 10, 5, 30]]}',
                                    b'{"key": "K", "words": [["TOTAL", 10, 5, 30, NaN]]}'],
                         ids=["truncated", "not UTF-8", "not an entry", "another key", "short box", "NaN"])
def test_a_damaged_entry_is_read_again_with_a_warning(tesseract, tmp_path, caplog, damage):
    cache = WordBoxCache(tmp_path)
    key = cache.key(page(), SETTINGS)
    cache.path(key).parent.mkdir(parents=True)
    cache.path(key).write_bytes(damage.replace(b'"K"', json.dumps(key).encode()))
    with caplog.at_level(logging.WARNING):
        assert ocr_words(page(), SETTINGS, cache) == WORDS
    assert len(tesseract.calls) == 1
    assert f"OCR cache entry {cache.path(key)} cannot be read" in caplog.text
    assert "reading the page again" in caplog.text
    assert ocr_words(page(), SETTINGS, cache) == WORDS and len(tesseract.calls) == 1  # repaired


def test_an_entry_that_cannot_be_written_or_read_never_stops_the_reading(tesseract, tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    cache = WordBoxCache(blocked)
    with caplog.at_level(logging.WARNING):
        assert ocr_words(page(), SETTINGS, cache) == WORDS
        assert ocr_words(page(), SETTINGS, cache) == WORDS
    assert len(tesseract.calls) == 2 and f"could not write {blocked}" in caplog.text
    assert "OCR word boxes not cached" in caplog.text


def test_writers_of_one_entry_at_once_leave_it_whole(tesseract, tmp_path):
    cache = WordBoxCache(tmp_path)
    key = cache.key(page(), SETTINGS)
    threads = [threading.Thread(target=cache.put, args=(key, WORDS)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.get(key) == WORDS
    assert {p.name for p in tmp_path.rglob("*")} == {key[:2], cache.path(key).name}  # no temporary file left


def test_the_cache_folder_and_the_setting_that_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HKRAG_CACHE", str(tmp_path / "home"))
    assert GroundingConfig().word_cache().root == tmp_path / "home" / "ocr"
    assert GroundingConfig(cache=str(tmp_path / "elsewhere")).word_cache().root == tmp_path / "elsewhere"
    assert GroundingConfig(cache=False).word_cache() is None
    monkeypatch.delenv("HKRAG_CACHE")
    assert WordBoxCache().root == Path.home() / ".cache" / "hkrag" / "ocr"
    assert GroundingConfig.problems({"cache": None}) == [
        "rag.grounding.cache must be true, false or a folder, got None"]
    assert GroundingConfig.problems({"cache": ""}) == ["rag.grounding.cache must be true, false or a folder, got ''"]
    assert GroundingConfig.problems({"cache": "outputs/ocr-cache"}) == []


def test_the_real_tesseract_reads_a_page_once(monkeypatch, tmp_path):
    try:
        install_tesseract("eng")
    except OcrUnavailable as reason:
        pytest.skip(str(reason))
    spec = PageSpec(doc_id="synchart-test-d000-p1", style="synchart", title="ENERGY", label="GREEN", value=57,
                    source="KILO", code="R4", year="2019", bars=(30, 50, 70, 40), accent=1, page_no=3)
    image, _ = render_page(spec)
    settings = OcrSettings(psm=11, upscale=1.5)
    fresh = ocr_words(image, settings, WordBoxCache(tmp_path))  # read by Tesseract, then stored
    assert "ENERGY" in [text for text, _ in fresh]
    real = ocr._pytesseract()

    def no_tesseract(*_args, **_kwargs):
        raise AssertionError("Tesseract ran on a cached page")

    monkeypatch.setattr(real, "image_to_data", no_tesseract)
    assert ocr_words(image, settings, WordBoxCache(tmp_path)) == fresh

"""Answer grounding: pixel-level scores by hand, the sources, gold evidence from the drawn items."""

import json
from dataclasses import asdict

import pytest
from omegaconf import OmegaConf
from PIL import Image

from hkrag.data.region_corpus import page_units
from hkrag.data.regions import Region
from hkrag.data.synthetic import SyntheticConfig, generate
from hkrag.io import FileFormatError
from hkrag.rag import evidence
from hkrag.rag.evidence import GroundingConfig
from hkrag.rag.gold_evidence import answer_span, gold_evidence, load_gold, span_box, write_evidence
from hkrag.rag.grounding import (
    TEXT_THRESHOLD,
    Evidence,
    GroundingError,
    GroundingPage,
    ModelSource,
    RegionSource,
    TextSource,
    Word,
    at_threshold,
    check_evidence_box,
    grounding_score,
    make_source,
    overlap_area,
    parse_model_boxes,
    without_boxes,
)
from hkrag.rag.records import QueryOutcome
from hkrag.tasks.common import CONF_DIR


def ev(box, page="p1", score=1.0):
    return Evidence(page, box, "test", score)


def test_overlap_of_unions_by_hand():
    a = [(0, 0, 10, 10), (5, 0, 15, 10)]  # union 150
    b = [(10, 0, 20, 10)]  # overlap with the union: x 10..15 -> 50
    assert overlap_area(a, b) == pytest.approx(50.0)
    assert overlap_area(a, []) == 0.0


def test_score_single_box_half_inside():
    # predicted 10x10 at (0,0); gold 10x10 at (5,0): overlap 50, P = R = F1 = 0.5; IoU 50/150 < 0.5: no hit
    score = grounding_score([ev((0, 0, 10, 10))], [ev((5, 0, 15, 10))])
    assert (score.precision, score.recall, score.f1, score.hit, score.wrong_page) == (0.5, 0.5, 0.5, False, False)


def test_score_several_gold_boxes_and_overlapping_predictions():
    gold = [ev((0, 0, 10, 10)), ev((20, 0, 30, 10))]  # area 200
    predicted = [ev((0, 0, 10, 10)), ev((5, 0, 10, 10))]  # union 100, all inside gold
    score = grounding_score(predicted, gold)
    assert score.precision == pytest.approx(1.0)
    assert score.recall == pytest.approx(0.5)
    assert score.f1 == pytest.approx(2 / 3)
    assert score.hit  # the best (first) box equals a gold box


def test_score_wrong_page_is_zero_and_counts_against_precision():
    gold = [ev((0, 0, 10, 10), "p1")]
    wrong = grounding_score([ev((0, 0, 10, 10), "p2")], gold)
    assert (wrong.f1, wrong.hit, wrong.wrong_page) == (0.0, False, True)
    mixed = grounding_score([ev((0, 0, 10, 10), "p2"), ev((0, 0, 10, 10), "p1")], gold)
    assert (mixed.precision, mixed.recall, mixed.wrong_page) == (0.5, 1.0, False)
    assert not mixed.hit  # the best box is the one on the wrong page


def test_score_empty_prediction_and_no_gold():
    empty = grounding_score([], [ev((0, 0, 10, 10))])
    assert (empty.precision, empty.recall, empty.f1, empty.hit, empty.wrong_page) == (0.0, 0.0, 0.0, False, False)
    assert grounding_score([ev((0, 0, 1, 1))], []) is None


@pytest.mark.parametrize("box, problem", [
    ((0, 0, 0, 5), "zero area"), ((5, 0, 3, 5), "zero area"), ((0, 0, 101, 5), "outside"),
    ((-1, 0, 5, 5), "outside"), ((0, float("nan"), 5, 5), "finite"), ((0, 0, 5), "four"), ("abcd", "four numbers"),
])
def test_bad_boxes_are_named(box, problem):
    with pytest.raises(GroundingError, match=problem):
        check_evidence_box(box, (100, 50), "page p1, box 0")


def words(*items):
    return [Word(text, box) for text, box in items]


PAGE = GroundingPage("p1", (200, 100), words(("REF", (10, 80, 30, 90)), ("WS", (35, 80, 50, 90)),
                                             ("P.3", (55, 80, 70, 90)), ("SOURCE:", (10, 60, 50, 70)),
                                             ("KILO", (55, 60, 80, 70)), ("/", (82, 60, 84, 70)),
                                             ("2021", (86, 60, 110, 70))))


def test_text_source_exact_fuzzy_and_absent():
    strict = TextSource(threshold=0.75)
    assert strict.locate("2021", [PAGE]) == [Evidence("p1", (86, 60, 110, 70), "text", 1.0)]
    assert strict.locate("p.3", [PAGE])[0].box == (55, 80, 70, 90)
    # "W3" read "WS": similarity 0.5 (Indel: 2 edits over 4 characters), below the default 0.6 (chosen on generated
    # validation answers: at 0.5 a wrong page number "P.7" is boxed on "P.3" just as this right code is on "WS")
    assert strict.locate("W3", [PAGE]) == [] == TextSource().locate("W3", [PAGE])
    assert TextSource(threshold=0.5).locate("W3", [PAGE]) == [Evidence("p1", (35, 80, 50, 90), "text", 0.5)]
    assert TextSource().locate("ZEBRA", [PAGE]) == []
    split = GroundingPage("p3", (200, 100), words(("P.", (10, 0, 20, 10)), ("3", (22, 0, 30, 10))))
    assert TextSource().locate("P.3", [split])[0].box == (10, 0, 30, 10)  # OCR split one word in two
    merged = GroundingPage("p4", (200, 100), words(("REFX8", (10, 0, 60, 10)),))
    assert TextSource().locate("X8", [merged])[0].box == (40, 0, 60, 10)  # and merged two: the answer's share
    assert TextSource().locate("...", [PAGE]) == []


def test_text_source_multiword_and_page_order():
    located = TextSource().locate("kilo / 2021", [PAGE])  # "/" normalises away: two words
    assert located[0].box == (55, 60, 110, 70)
    twin = GroundingPage("p2", (200, 100), PAGE.words)
    assert TextSource().locate("2021", [twin, PAGE])[0].page_id == "p2"  # a tie goes to the earlier page


def test_text_source_refuses_unread_pages_and_bad_threshold():
    with pytest.raises(GroundingError, match="'p9' has no word boxes"):
        TextSource().locate("2021", [GroundingPage("p9", (10, 10))])
    for threshold in (0, -1, 1.5, float("nan")):
        with pytest.raises(GroundingError, match=r"\(0, 1\]"):
            TextSource(threshold=threshold)



def test_a_higher_threshold_from_a_finished_run_by_hand():
    # "P.7" against the word "P.3": "p7" / "p3", Indel 1 - 2/4 = 0.5, boxed at 0.5 on the wrong page number
    run = TextSource(threshold=0.5).locate("P.7", [PAGE])
    assert run == [Evidence("p1", (55, 80, 70, 90), "text", 0.5)]
    assert at_threshold(run, 0.5, 0.5) == run
    assert at_threshold(run, 0.6, 0.5) == [] == TextSource(threshold=0.6).locate("P.7", [PAGE])
    exact = TextSource(threshold=0.5).locate("2021", [PAGE])  # similarity 1: kept up to 1.0
    assert at_threshold(exact, 1.0, 0.5) == exact == TextSource(threshold=1.0).locate("2021", [PAGE])
    with pytest.raises(GroundingError, match="grounded at threshold 0.75 .* cannot give threshold 0.5"):
        at_threshold(run, 0.5, 0.75)
    with pytest.raises(GroundingError, match=r"\(0, 1\]"):
        at_threshold(run, 1.5, 0.5)
    with pytest.raises(GroundingError, match=r"only the text source.*\['region'\]"):
        at_threshold([Evidence("p1", (0, 0, 5, 5), "region")], 0.6, 0.5)


def test_region_source():
    page = GroundingPage("p1", (100, 100), regions=[("r0", (0, 0, 50, 50)), ("r1", (50, 50, 100, 100))])
    assert RegionSource().locate("x", [GroundingPage("p0", (10, 10)), page]) == [
        Evidence("p1", (0, 0, 50, 50), "region", 1.0)]
    with pytest.raises(GroundingError, match="no page .* has region units"):
        RegionSource().locate("x", [GroundingPage("p0", (10, 10))])


def test_model_boxes_parse_and_refuse():
    pages = [GroundingPage("a", (100, 50)), GroundingPage("b", (100, 50))]
    out = "K7 <box page=2>10, 5, 30, 20</box> and <BOX page=1>0,0,1,1</BOX>"
    assert parse_model_boxes(out, pages) == [Evidence("b", (10, 5, 30, 20), "model", 1.0),
                                             Evidence("a", (0, 0, 1, 1), "model", 1.0)]
    assert parse_model_boxes("no boxes", pages) == []
    for bad, problem in (("<box page=3>0,0,1,1</box>", "not among the 2 pages"),
                         ("<box page=1>0,0,x,1</box>", "expected <box"),
                         ("<box page=1>0,0,200,1</box>", "outside"),
                         ("<box page=1>0,0,1</box>", "four")):
        with pytest.raises(GroundingError, match=problem):
            parse_model_boxes(bad, pages)
    with pytest.raises(GroundingError, match="phi3v does not write evidence boxes"):
        ModelSource(backend="phi3v").locate("x", pages, out)
    assert ModelSource(writes_boxes=True).locate("x", pages, out)[0].page_id == "b"
    assert without_boxes(out) == "K7 and"
    assert without_boxes("1987<box page=1>0,0,1,1</box>\n") == "1987" and without_boxes("no box") == "no box"


def test_make_source_names_the_choices():
    assert isinstance(make_source("text", threshold=0.9), TextSource)
    with pytest.raises(GroundingError, match=r"one of \['model', 'region', 'text'\], got 'ocr'"):
        make_source("ocr")


def test_evidence_round_trip_and_bad_row():
    item = Evidence("p1", (1.0, 2.0, 3.0, 4.0), "text", 0.8)
    assert Evidence.from_dict(json.loads(json.dumps(item.to_dict()))) == item
    with pytest.raises(GroundingError, match="needs page_id, box"):
        Evidence.from_dict({"page_id": "p1", "source": "text"})


@pytest.mark.parametrize("answer, text, span", [
    ("K7", "REF K7  P.3", (4, 6)), ("P.3", "REF K7  P.3", (8, 11)), ("3", "REF K7  P.3", None),
    ("2021", "SOURCE: KILO / 2021", (15, 19)), ("kilo", "SOURCE: KILO / 2021", (8, 12)), ("", "x", None),
])
def test_answer_span_whole_words(answer, text, span):
    assert answer_span(answer, text) == span


def test_gold_span_box_lies_inside_the_item_and_first_answer_wins():
    item = {"text": "REF K7  P.3", "kind": "fine_print", "font_size": 14, "cap_height": 10, "box": [8, 152, 84, 162]}
    x0, y0, x1, y1 = span_box(item, answer_span("K7", item["text"]))
    assert 8 < x0 < x1 < 84 and (y0, y1) == (152, 162)
    boxes = gold_evidence(["P.3", "3"], "p1", [item])
    assert len(boxes) == 1 and boxes[0].box[0] > x1
    assert gold_evidence(["ZZ"], "p1", [item]) == []


def test_gold_evidence_of_the_built_in_corpus(tmp_path):
    root = generate(tmp_path / "data", SyntheticConfig(n_train=4, n_test=8, train_groups_per_style=1,
                                                       test_groups_per_style=1, group_size=2, test_fine_groups=1)).root
    path = write_evidence(root)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows and all(row["drawn"] for row in rows)  # every built-in answer is drawn on its page
    gold = load_gold(root)
    assert len(gold) == len(rows)
    for line in (root / "pages.jsonl").read_text().splitlines():
        for item in json.loads(line)["items"]:  # a span of the whole text is the drawn item's box
            assert span_box(item, (0, len(item["text"]))) == pytest.approx(item["box"], abs=1)


@pytest.mark.parametrize("name, reader, non_utf8, lacking, missing", [
    ("pages.jsonl", write_evidence, b'{"doc_id": "p1", "items": []}\n{"doc_id": "p2", "items": ["caf\xe9"]}\n',
     '{"doc_id": "p1"}\n', "items"),
    ("evidence.jsonl", load_gold, b'{"query_id": "q1", "dataset": "synchart", "evidence": []}\n\x93q2\x94\n',
     '{"query_id": "q1", "evidence": []}\n', "dataset"),
])
def test_non_utf8_or_damaged_gold_evidence_inputs_name_the_file_and_line(tmp_path, name, reader, non_utf8, lacking,
                                                                         missing):
    path = tmp_path / name
    path.write_bytes(non_utf8)
    with pytest.raises(FileFormatError, match=rf"{name}: line 2 is not UTF-8"):
        reader(tmp_path)
    path.write_text(lacking)
    with pytest.raises(FileFormatError, match=rf"{name}: line 1: record lacks key\(s\) \['{missing}'\]"):
        reader(tmp_path)


def test_an_answer_on_none_of_the_pages_has_no_evidence_and_says_so(monkeypatch):
    monkeypatch.setattr(evidence, "ocr_words", lambda *_: [("REF", (10.0, 40.0, 30.0, 48.0)),
                                                           ("K7", (34.0, 40.0, 48.0, 48.0))])
    page = Image.new("RGB", (100, 60), "white")
    gold = {("synfine", "q"): [Evidence("p1", (34.0, 40.0, 48.0, 48.0), "gold", 1.0)]}
    grounder = evidence.Grounder(TextSource(), lambda doc_id: evidence.PageView(page, doc_id), gold)
    outcome = grounder.annotate(QueryOutcome("q", "Code?", ["K7"], dataset="synfine", kept=["p1"],
                                             answer="QUETZALCOATL"))
    assert outcome.evidence == [] and outcome.grounding["note"] == evidence.NOT_FOUND
    assert outcome.grounding["note"] == "the answer is on none of the pages the generator read"
    assert outcome.grounding["drawn"] is True  # the question's answer is drawn: a miss, scored 0
    assert outcome.grounding["score"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "hit": False,
                                          "wrong_page": False}
    found = grounder.annotate(QueryOutcome("q", "Code?", ["K7"], dataset="synfine", kept=["p1"], answer="K7"))
    assert found.evidence[0]["box"] == [34.0, 40.0, 48.0, 48.0] and found.grounding["note"] is None


def test_a_pdf_page_is_grounded_on_its_text_layer_without_ocr(tmp_path, monkeypatch):
    from matplotlib.backends.backend_pdf import PdfPages
    from matplotlib.figure import Figure

    import hkrag.rag.evidence as evidence
    from hkrag.data.opendocvqa import load_corpus
    from hkrag.data.pdf import WORDS_COLUMN, ingest
    from hkrag.lvlm import PageImage
    from hkrag.rag.records import QueryOutcome

    with PdfPages(tmp_path / "born_digital.pdf") as pdf:
        figure = Figure(figsize=(3, 1))
        figure.text(0.1, 0.5, "LAYER WORDS 2024")
        pdf.savefig(figure)
    ingest([tmp_path / "born_digital.pdf"], tmp_path / "corpus", dpi=144)
    corpus = load_corpus(tmp_path / "corpus")
    row = corpus.dataset[0]
    words = json.loads(row[WORDS_COLUMN])
    assert [w[0] for w in words] == ["LAYER", "WORDS", "2024"]
    image = PageImage(row["image"], row["doc_id"]).load()
    assert image.size == (432, 144)
    for _, x0, y0, x1, y1 in words:  # at 144 dpi the 3x1 inch page is 432x144 pixels; the baseline at half height
        assert 0 <= x0 < x1 <= image.width and 0 <= y0 < y1 and y1 == pytest.approx(72, abs=1.5)
    assert words[0][1] == pytest.approx(0.1 * 432, abs=3)  # figure.text's x = 0.1 of the width

    def no_ocr(*_):
        raise AssertionError("OCR ran on a page with a text layer")

    monkeypatch.setattr(evidence, "ocr_words", no_ocr)
    grounder = evidence.Grounder(TextSource(), lambda doc_id: evidence.unit_view(row, doc_id, image))
    outcome = QueryOutcome("q", "When?", ["2024"], kept=[row["doc_id"]], answer="2024")
    grounder.annotate(outcome)
    assert outcome.evidence == [Evidence(row["doc_id"], tuple(words[2][1:]), "text", 1.0).to_dict()]
    with pytest.raises(GroundingError, match="its words column is not"):
        evidence.unit_view({**row, WORDS_COLUMN: '[["x", 1, 2]]'}, row["doc_id"], image)


def test_words_read_on_a_unit_crop_with_a_margin_land_on_the_page(monkeypatch):
    page = Image.new("RGB", (200, 100), "white")
    footer, title = Region((20.5, 30.2, 80.0, 50.0), "footer"), Region((4.0, 2.0, 60.0, 10.0), "title")
    [_, row] = page_units("p1", page, [footer, title], "all-box", margin=8)
    assert (row["box"], row["crop"]) == ([20.5, 30.2, 80.0, 50.0], [12, 22, 88, 58])  # floor(20.5) - 8, ceil(50) + 8
    assert row["image"].size == (76, 36)
    read = {"words": [("P.3", (10.0, 10.0, 30.0, 20.0)), ("REF", (1.0, 40.0, 20.0, 48.0))]}  # crop pixels
    monkeypatch.setattr(evidence, "ocr_words", lambda *_: read["words"])

    def located(unit: dict) -> list[dict]:
        grounder = evidence.Grounder(TextSource(), lambda doc_id: evidence.unit_view(unit, doc_id, unit["image"]))
        return grounder.annotate(QueryOutcome("q", "Page?", ["P.3"], kept=["p1#0"], answer="P.3")).evidence

    assert located(row)[0]["box"] == [22.0, 32.0, 42.0, 42.0]  # moved by the crop's corner (12, 22), not the box's
    assert located({**row, "crop": None})[0]["box"] == [30.5, 40.2, 50.5, 50.2]  # a corpus built before the column
    read["words"] = [("P.3", (1.0, 40.0, 20.0, 48.0))]  # below the unit's own 36-pixel crop
    assert located(row)[0]["box"] == [13.0, 62.0, 32.0, 70.0]
    assert located({**row, "label": "semantic_box+global"}) == []  # there, an appended global crop: left out


def test_the_configured_grounding_is_the_code_default():
    configured = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "rag" / "default.yaml").grounding)
    assert configured == asdict(GroundingConfig()) and configured["threshold"] == TEXT_THRESHOLD == 0.6

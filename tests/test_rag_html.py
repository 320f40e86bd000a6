"""The static HTML page of a trace: self-contained, escaped, thumbnails, rendered by headless Chromium."""

import base64
import io
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image, ImageDraw

from hkrag.rag.html import render_html, write_html
from hkrag.rag.records import ROUTES, CallRecord, QueryOutcome

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INJECTION = "<script>alert('x')</script>"


@pytest.fixture(scope="session")
def chromium():
    """Path of a Chromium binary; installs Debian's package when missing (as root), else skips saying why."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.skip("chromium is not installed and installing Debian's package needs root")
    install = "apt-get update && apt-get install -y --no-install-recommends chromium"
    result = subprocess.run(["bash", "-c", install], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if result.returncode != 0 or not shutil.which("chromium"):
        pytest.skip(f"could not install chromium: {result.stderr.strip()[-300:]}")
    return shutil.which("chromium")


def page(colour, label):
    image = Image.new("RGB", (400, 560), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((20, 20, 380, 120), fill=colour)
    for y in range(160, 540, 24):
        draw.line((30, y, 370, y), fill="black", width=3)
    draw.text((30, 130), label, fill="black")
    return image


PAGES = {"doc-a": page("red", "doc-a"), "doc-b": page("blue", "doc-b"), "doc-c": page("green", "doc-c")}


def outcomes():
    calls = [CallRecord("pruner", "Do pages 1..1 suffice?", ["doc-a"], output="no", latency_s=0.4,
                        prompt_tokens=900, completion_tokens=1),
             CallRecord("judger", "Answer the question.", ["doc-a", "doc-b"], output=f"12 {INJECTION}",
                        uncertainty=0.91, latency_s=0.8, prompt_tokens=1500, completion_tokens=4)]
    answered = QueryOutcome(
        query_id="chartqa-7", question="What is the maximum sales of casual bags?", gold=["12721"],
        dataset="ChartQA", pool="single", retrieved=["doc-a", "doc-b", "doc-c"], kept=["doc-a", "doc-b"],
        route="HQP", uncertainty=0.91, estimator="mean_neg_plogp", iterations=2, answer="12721", calls=calls,
        wall_s=2.5, judge={"score": 5, "correct": True, "raw": [f"Score: 5 {INJECTION}"], "attempts": 1,
                           "error": None, "status": "ok", "rubric": "llamaindex",
                           "cost": {"calls": 1, "prompt_tokens": 300, "completion_tokens": 5, "latency_s": 0.4}},
        metrics={"anls": 1.0, "relaxed_accuracy": 1.0, "exact_match": 1.0, "f1": 1.0},
    )
    failed = QueryOutcome(
        query_id="chartqa-8", question="Which year had the lowest volume?", gold=["1995"], dataset="ChartQA",
        pool="single", retrieved=["doc-c", "doc-missing"], route="failed", failed=True,
        failure="LVLMTimeoutError: call exceeded 60 s", wall_s=60.0,
        metrics={"anls": 0.0, "relaxed_accuracy": 0.0, "exact_match": 0.0, "f1": 0.0},
    )
    return [answered, failed]


def test_page_is_self_contained_and_escaped():
    requested = []

    def page_image(doc_id):
        requested.append(doc_id)
        return PAGES.get(doc_id)

    html = render_html(outcomes(), page_image, title="test <run>")
    assert INJECTION not in html and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "<title>test &lt;run&gt;</title>" in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html) and "<link" not in html
    assert sorted(requested) == ["doc-a", "doc-b", "doc-c", "doc-missing"]  # doc-c of both queries: once
    uris = re.findall(r'src="data:image/jpeg;base64,([^"]+)"', html)
    assert len(uris) == 4  # 3 pages of the first query, doc-c again in the second; doc-missing has none
    with Image.open(io.BytesIO(base64.b64decode(uris[0]))) as thumbnail:
        assert thumbnail.format == "JPEG" and thumbnail.size == (160, 224)
    assert html.count('class="dropped"') == 3  # doc-c (first query), doc-c and doc-missing (failed query)
    assert 'class="query failed"' in html and "FAILED: LVLMTimeoutError: call exceeded 60 s" in html
    assert "no image" in html


def test_header_shows_route_shares_and_the_uncertainty_histogram():
    html = re.sub(r'<div class="bar"[^>]*></div>', "", render_html(outcomes(), PAGES.get))
    assert "<th>H′ [0.0, 0.1)</th>" in html and "<th>H′ [0.9, 1.0]</th>" in html
    share = {"HQP": "50.0", "failed": "50.0"}
    shares = "".join(f"<td>{share.get(route, '0.0')}</td>" for route in ROUTES)
    bins = "<td>0</td>" * 9 + "<td>1</td>"  # the answered query's H' = 0.91; the failed one has none
    assert f"<tr><th>ChartQA/single</th>{shares}{bins}<td>1</td><td>0</td></tr>" in html
    assert f"<tr><th>overall</th>{shares}{bins}<td>1</td><td>0</td></tr>" in html
    assert "relaxed correctness (strict)" in html and "judge calls / query<b>0.50</b>" in html
    assert "rubric llamaindex; judge cost 1 call(s), 300 / 5 tokens, 0.40 s" in html


def run_chromium(chromium, tmp_path, *args):
    command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_chromium_renders_the_page(chromium, tmp_path):
    path = write_html(tmp_path / "rag.html", outcomes(), PAGES.get, title="HKRAG trace test")
    screenshot = tmp_path / "shot.png"
    run_chromium(chromium, tmp_path, f"--screenshot={screenshot}", "--window-size=1280,2000", path.as_uri())
    assert screenshot.is_file(), "chromium wrote no screenshot"
    with Image.open(screenshot) as image:
        assert image.size == (1280, 2000)
        pixels = np.asarray(image.convert("RGB"), dtype=float)
    assert pixels.std() > 20  # text, thumbnails and boxes, not one blank colour
    red = (pixels[..., 0] > 230) & (pixels[..., 1] < 40) & (pixels[..., 2] < 40)  # not the #c62828 of failures
    assert red.sum() > 500  # doc-a's red banner: a thumbnail was decoded and drawn
    dom = run_chromium(chromium, tmp_path, "--dump-dom", path.as_uri()).stdout
    assert "What is the maximum sales of casual bags?" in dom
    assert re.search(r'<img src="data:image/jpeg;base64,[^"]+" alt="page doc-a">', dom)
    assert "<script>alert" not in dom


def bounding(mask):
    ys, xs = np.nonzero(mask)
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


def test_evidence_boxes_are_drawn_where_the_trace_places_them(chromium, tmp_path):
    image = Image.new("RGB", (400, 300), "white")
    ImageDraw.Draw(image).rectangle((100, 60, 299, 179), fill=(255, 128, 0))  # pixels 100..299 x 60..179
    gold = {"page_id": "doc-o", "box": [0, 0, 50, 50], "source": "gold", "score": 1.0}
    outcome = QueryOutcome(
        query_id="q-boxes", question="Where?", gold=["x"], dataset="synchart", pool="single", retrieved=["doc-o"],
        kept=["doc-o"], route="LQP", answer="x",
        evidence=[{"page_id": "doc-o", "box": [100, 60, 300, 180], "source": "text", "score": 0.9}],
        grounding={"source": "text", "note": None, "drawn": True, "gold": [gold],
                   "score": {"precision": 0.0, "recall": 0.0, "f1": 0.0, "hit": False, "wrong_page": False}},
        metrics={"anls": 1.0, "relaxed_accuracy": 1.0, "exact_match": 1.0, "f1": 1.0},
    )
    path = write_html(tmp_path / "rag.html", [outcome], {"doc-o": image}.get)
    dom = run_chromium(chromium, tmp_path, "--dump-dom", path.as_uri()).stdout
    assert 'class="box predicted" data-box="100,60,300,180"' in dom and 'class="box gold" data-box="0,0,50,50"' in dom
    assert "F1 0.00" in dom and "Evidence boxes:" in dom
    screenshot = tmp_path / "boxes.png"
    run_chromium(chromium, tmp_path, f"--screenshot={screenshot}", "--window-size=1280,1400", path.as_uri())
    with Image.open(screenshot) as shot:
        pixels = np.asarray(shot.convert("RGB")).astype(int)
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    orange = (r > 230) & (abs(g - 128) < 30) & (b < 40)
    magenta = (r > 230) & (g < 40) & (b > 230)
    left, top, right, bottom = bounding(orange)
    near = np.zeros_like(orange)  # the thumbnail around the rectangle, not the legend's sample box
    near[top - 30:bottom + 30, left - 45:right + 45] = True
    # the predicted box's border traces the orange rectangle (the thumbnail is 160 px: scale 0.4, JPEG fuzz)
    assert np.allclose(bounding(magenta & near), (left, top, right, bottom), atol=2)
    cyan = (r < 40) & (g > 200) & (b > 230)
    cx0, cy0, cx1, cy1 = bounding(cyan & near)
    assert (cx1 - cx0, cy1 - cy0) == pytest.approx((20, 20), abs=2)  # 50 px of the page at scale 0.4
    assert (cx0, cy0) == pytest.approx((left - 40, top - 24), abs=2)  # at the page's corner

"""A static, self-contained HTML page of a RAG trace: what every agent saw, said and cost, query by query.

One file, no server and no external asset: the CSS is inline and each page appears as a small JPEG
thumbnail in a ``data:`` URI (encoded once per page however many queries retrieved it). Per query: the
question and gold answers, the retrieved pages (those the Pruner kept in colour, the others greyed), every
LVLM call (agent, output, latency, tokens, uncertainty), the Judger's uncertainty and route, the final
answer against gold, the rule metrics and the LLM judge's verdict (rubric, cost) with its raw output, and the
answer's evidence: predicted boxes (magenta) and gold boxes (cyan, dashed) drawn over the page thumbnails where
the trace places them (:mod:`hkrag.rag.evidence`), with the grounding scores. The
header summarises the run and, per data set and pool, the route shares and the histogram of the Judger's
uncertainty H′ (:func:`hkrag.rag.report.uncertainty_histogram`). Failed queries are highlighted with their
reason. Every model output and data string is HTML-escaped.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from html import escape
from pathlib import Path
from typing import Any

from PIL import Image

from hkrag.io import write_text
from hkrag.rag.records import CallRecord, QueryOutcome
from hkrag.rag.report import bin_labels, summarize, table_routes

THUMBNAIL_WIDTH = 160
JPEG_QUALITY = 70

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0 auto;max-width:1200px;padding:16px;
color:#1d1d1f;background:#fafafa}
h1{font-size:22px;margin:4px 0 12px}h2{font-size:16px;margin:0 0 8px}
.summary{display:flex;flex-wrap:wrap;gap:8px;margin-bottom:16px}
.stat{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px 10px}
.stat b{display:block;font-size:18px}
.query{background:#fff;border:1px solid #ddd;border-radius:8px;padding:12px 14px;margin:12px 0}
.query.failed{border:2px solid #c62828;background:#fff5f5}
.failure{color:#c62828;font-weight:600;margin:6px 0}
.badge{display:inline-block;border-radius:10px;padding:1px 8px;font-size:12px;margin-left:6px;background:#e0e0e0}
.LQP{background:#c8e6c9}.HQP{background:#ffe0b2}.single_pass{background:#bbdefb}.badge.failed{background:#ffcdd2}
.ok{color:#2e7d32;font-weight:600}.bad{color:#c62828;font-weight:600}
.pages{display:flex;flex-wrap:wrap;gap:8px;margin:8px 0}
figure{margin:0;width:160px;font-size:11px;text-align:center}
figure img{width:160px;border:1px solid #999;display:block}
figure.dropped img,figure.dropped .missing{filter:grayscale(1);opacity:.35}
.missing{width:158px;height:100px;border:1px dashed #999;display:flex;align-items:center;justify-content:center}
table{border-collapse:collapse;font-size:12px;width:100%;margin:6px 0}
td,th{border:1px solid #e0e0e0;padding:3px 6px;text-align:left;vertical-align:top}
pre{white-space:pre-wrap;word-break:break-word;margin:0;font-size:12px}
.answer{display:grid;grid-template-columns:120px 1fr;gap:2px 8px;font-size:14px}.answer pre{font-size:14px}
details{font-size:12px;margin-top:4px}
.calibration td,.calibration th{text-align:right}.calibration{width:auto}
.bar{background:#90caf9;height:6px;margin-top:2px}
.thumb{position:relative;width:160px}
.box{position:absolute;box-sizing:border-box;pointer-events:none}
.box.predicted{border:2px solid #ff00ff}.box.gold{border:2px dashed #00e5ff}
.legend .box{position:static;display:inline-block;width:18px;height:10px;margin:0 4px 0 10px}
"""
BOX_KINDS = ("predicted", "gold")
"""The evidence boxes drawn over a thumbnail: the answer's (``outcome.evidence``) and the gold ones."""


def thumbnail_uri(image: Image.Image, width: int = THUMBNAIL_WIDTH) -> str:
    """A ``width``-pixel-wide JPEG thumbnail as a ``data:`` URI."""
    image = image.convert("RGB")
    height = max(1, round(image.height * width / image.width))
    buffer = io.BytesIO()
    image.resize((width, height), Image.Resampling.LANCZOS).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class Thumbnails:
    """Data URIs of pages by doc id, each page decoded and encoded once; ``None`` for a page that cannot be shown."""

    def __init__(self, page_image: Callable[[str], Image.Image | None]) -> None:
        self.page_image, self.uris, self.sizes = page_image, {}, {}

    def __call__(self, doc_id: str) -> str | None:
        if doc_id not in self.uris:
            image = self.page_image(doc_id)
            self.uris[doc_id] = thumbnail_uri(image) if image is not None else None
            self.sizes[doc_id] = image.size if image is not None else None
        return self.uris[doc_id]


def _number(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def evidence_boxes(outcome: QueryOutcome) -> dict[str, list[dict[str, Any]]]:
    """The outcome's predicted and gold evidence rows (:data:`BOX_KINDS`)."""
    return {"predicted": list(outcome.evidence), "gold": list((outcome.grounding or {}).get("gold") or [])}


def render_boxes(outcome: QueryOutcome, doc_id: str, size: tuple[int, int] | None) -> str:
    """The evidence boxes on page ``doc_id`` as overlays placed in percent of the page's ``size``."""
    if not size:
        return ""
    width, height = size
    spans = []
    for kind, rows in evidence_boxes(outcome).items():
        for row in rows:
            if row.get("page_id") != doc_id:
                continue
            x0, y0, x1, y1 = (float(v) for v in row["box"])
            spans.append(f'<span class="box {kind}" data-box="{x0:g},{y0:g},{x1:g},{y1:g}" '
                         f'style="left:{100 * x0 / width:.3f}%;top:{100 * y0 / height:.3f}%;'
                         f'width:{100 * (x1 - x0) / width:.3f}%;height:{100 * (y1 - y0) / height:.3f}%"></span>')
    return "".join(spans)


def render_grounding(outcome: QueryOutcome) -> str:
    """The evidence row of a query: its source, boxes, scores, or why there is none."""
    grounding = outcome.grounding
    if not grounding:
        return "not grounded"
    boxes = "; ".join(f"{row['page_id']} [{', '.join(f'{float(v):g}' for v in row['box'])}] "
                      f"({float(row.get('score', 1.0)):.2f})" for row in outcome.evidence)
    score = grounding.get("score")
    scored = (f" — F1 {score['f1']:.2f} (P {score['precision']:.2f}, R {score['recall']:.2f}), "
              f"{'hit' if score['hit'] else 'no hit'}{', wrong page' if score['wrong_page'] else ''}" if score
              else " — no drawn gold evidence" if grounding.get("drawn") is False else "")
    note = f" ({grounding['note']})" if grounding.get("note") else ""
    return escape(f"{grounding['source']}: {boxes or 'no box'}{note}{scored}")


def render_pages(outcome: QueryOutcome, thumbnails: Thumbnails) -> str:
    """Retrieved pages in rank order: kept ones in colour, the rest greyed (a kept page not retrieved is added),
    each with the evidence boxes that lie on it."""
    pages = list(dict.fromkeys([*outcome.retrieved, *outcome.kept]))
    if not pages:
        return "<p><i>no page given to the generator</i></p>"
    figures = []
    for rank, doc_id in enumerate(pages, start=1):
        kept = doc_id in outcome.kept
        uri = thumbnails(doc_id)
        picture = (f'<div class="thumb"><img src="{uri}" alt="page {escape(doc_id)}">'
                   f"{render_boxes(outcome, doc_id, thumbnails.sizes.get(doc_id))}</div>"
                   if uri else '<div class="missing">no image</div>')
        state = "kept" if kept else "not kept"
        figures.append(f'<figure class="{"kept" if kept else "dropped"}">{picture}'
                       f"<figcaption>#{rank} {escape(doc_id)} ({state})</figcaption></figure>")
    return f'<div class="pages">{"".join(figures)}</div>'


def render_calls(calls: Sequence[CallRecord]) -> str:
    if not calls:
        return "<p><i>no LVLM call</i></p>"
    rows = "".join(
        f"<tr><td>{i}</td><td>{escape(c.agent)}</td><td><pre>{escape(c.output)}</pre>"
        + (f'<div class="bad">{escape(c.error)}</div>' if c.error else "")
        + f"<details><summary>prompt</summary><pre>{escape(c.prompt)}</pre></details></td>"
        f"<td>{escape(', '.join(c.page_ids))}</td><td>{c.latency_s:.2f}</td>"
        f"<td>{c.prompt_tokens} / {c.completion_tokens}</td><td>{_number(c.uncertainty)}</td></tr>"
        for i, c in enumerate(calls, start=1)
    )
    header = ("<tr><th>#</th><th>agent</th><th>output</th><th>pages</th><th>latency (s)</th>"
              "<th>tokens in / out</th><th>uncertainty</th></tr>")
    return f"<table>{header}{rows}</table>"


def render_verdict(judge: dict[str, Any] | None) -> str:
    if judge is None:
        return "judge: disabled"
    verdict = '<span class="ok">correct</span>' if judge.get("correct") else '<span class="bad">wrong</span>'
    error = f' — <span class="bad">{escape(str(judge["error"]))}</span>' if judge.get("error") else ""
    raw = "".join(f"<pre>{escape(str(r))}</pre><hr>" for r in judge.get("raw", []))
    cost = judge.get("cost") or {}
    spent = (f"; judge cost {cost.get('calls', 0)} call(s), {cost.get('prompt_tokens', 0)} / "
             f"{cost.get('completion_tokens', 0)} tokens, {float(cost.get('latency_s', 0)):.2f} s" if cost else "")
    rubric = f"; rubric {judge['rubric']}" if judge.get("rubric") else ""
    return (f"{verdict}, score {escape(str(judge.get('score')))} ({escape(str(judge.get('status', '')))}, "
            f"{escape(str(judge.get('attempts', 0)))} attempt(s)){escape(rubric + spent)}{error}"
            + (f"<details><summary>raw judge output</summary>{raw}</details>" if raw else ""))


def render_query(outcome: QueryOutcome, thumbnails: Thumbnails) -> str:
    """One query's section."""
    metrics = ", ".join(f"{name} {value:.2f}" for name, value in (outcome.metrics or {}).items()) or "–"
    failure = f'<div class="failure">FAILED: {escape(outcome.failure or "unknown reason")}</div>' if outcome.failed \
        else ""
    gold = " | ".join(escape(g) for g in outcome.gold) or "<i>none</i>"
    route = escape(outcome.route)
    return (
        f'<section class="query{" failed" if outcome.failed else ""}" id="{escape(outcome.query_id)}">'
        f"<h2>{escape(outcome.dataset)}/{escape(outcome.pool)} · {escape(outcome.query_id)}"
        f'<span class="badge {route}">{route}</span></h2>{failure}'
        f'<div class="answer"><b>Question</b><span class="question">{escape(outcome.question)}</span>'
        f"<b>Gold</b><span>{gold}</span>"
        f"<b>Answer</b><span><pre>{escape(outcome.answer) or '<i>(empty)</i>'}</pre></span>"
        f"<b>Judger</b><span>uncertainty {_number(outcome.uncertainty)} ({escape(outcome.estimator or '–')}) → "
        f"{route}; {outcome.iterations} decoupler iteration(s)</span>"
        f"<b>Rule metrics</b><span>{escape(metrics)}</span>"
        f"<b>LLM judge</b><span>{render_verdict(outcome.judge)}</span>"
        f"<b>Evidence</b><span>{render_grounding(outcome)}</span>"
        f"<b>Cost</b><span>{outcome.num_calls} calls, {outcome.prompt_tokens} / {outcome.completion_tokens} tokens, "
        f"{outcome.wall_s:.2f} s</span></div>"
        f"{render_pages(outcome, thumbnails)}{render_calls(outcome.calls)}</section>"
    )


def render_calibration(summary: dict[str, Any]) -> str:
    """Per data set and pool (and overall): the share of queries per route and the H′ histogram (counts)."""
    groups = [(f"{ds}/{pool}", group) for ds, by_pool in summary["results"].items() for pool, group in by_pool.items()]
    groups.append(("overall", summary["overall"]))
    routes = table_routes([group for _, group in groups])
    labels = bin_labels(summary["overall"]["uncertainty_histogram"]["edges"])
    names = ["group", *(f"{r} %" for r in routes), *(f"H′ {label}" for label in labels), "no H′", "H′ ∉ [0, 1]"]
    header = "".join(f"<th>{escape(name)}</th>" for name in names)
    rows = []
    for name, group in groups:
        histogram = group["uncertainty_histogram"]
        peak = max(histogram["counts"]) or 1
        shares = "".join(f"<td>{100 * group['routes'].get(r, 0.0):.1f}</td>" for r in routes)
        bins = "".join(f'<td>{count}<div class="bar" style="width:{100 * count / peak:.0f}%"></div></td>'
                       for count in histogram["counts"])
        rows.append(f"<tr><th>{escape(name)}</th>{shares}{bins}<td>{histogram['missing']}</td>"
                    f"<td>{histogram['out_of_range']}</td></tr>")
    return (f'<h2>Routes and Judger uncertainty H′</h2><table class="calibration"><tr>{header}</tr>'
            f"{''.join(rows)}</table>")


def render_summary(outcomes: Sequence[QueryOutcome]) -> str:
    summary = summarize(outcomes)
    group = summary["overall"]
    accuracy, judge_cost = group["accuracy"], group["judge_cost"]
    stats = {
        "queries": str(group["n"]),
        "failed": str(group["failed"]),
        "judged accuracy": f"{100 * accuracy['value']:.1f}%" if accuracy else "disabled",
        "relaxed accuracy (lenient)": f"{100 * group['metrics']['relaxed_accuracy']:.1f}%",
        "relaxed correctness (strict)": f"{100 * group['metrics']['relaxed_correctness']:.1f}%",
        "ANLS": f"{100 * group['metrics']['anls']:.1f}",
        "LVLM calls / query": f"{group['cost']['lvlm_calls']:.2f}",
        "wall p50 / p95 (s)": f"{group['cost']['wall_s_p50']:.2f} / {group['cost']['wall_s_p95']:.2f}",
        **({"judge calls / query": f"{judge_cost['per_query']['calls']:.2f}",
            "judge tokens in / out per query": f"{judge_cost['per_query']['prompt_tokens']:.0f} / "
                                               f"{judge_cost['per_query']['completion_tokens']:.0f}"}
           if judge_cost else {}),
    }
    cells = "".join(f'<div class="stat">{escape(name)}<b>{escape(value)}</b></div>' for name, value in stats.items())
    failed = "".join(f'<li><a href="#{escape(o.query_id)}">{escape(o.query_id)}</a>: {escape(o.failure or "")}</li>'
                     for o in outcomes if o.failed)
    legend = ('<p class="legend">Evidence boxes: <span class="box predicted"></span>predicted'
              '<span class="box gold"></span>gold</p>' if any(o.grounding for o in outcomes) else "")
    return (f'<div class="summary">{cells}</div>' + legend + render_calibration(summary)
            + (f"<p>Failed queries:</p><ul>{failed}</ul>" if failed else ""))


def render_html(
    outcomes: Sequence[QueryOutcome], page_image: Callable[[str], Image.Image | None], title: str = "HKRAG trace"
) -> str:
    """The whole page as a string (see :func:`write_html`)."""
    thumbnails = Thumbnails(page_image)
    body = render_summary(outcomes) if outcomes else "<p>no query</p>"
    sections = "".join(render_query(outcome, thumbnails) for outcome in outcomes)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head><body><h1>{escape(title)}</h1>{body}{sections}</body></html>\n")


def write_html(
    path: str | Path,
    outcomes: Sequence[QueryOutcome],
    page_image: Callable[[str], Image.Image | None],
    title: str = "HKRAG trace",
) -> Path:
    """Write the trace page to ``path`` (atomically). ``page_image(doc_id)`` returns the page or ``None``."""
    return write_text(path, render_html(outcomes, page_image, title))

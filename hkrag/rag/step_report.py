"""The per-step report: how well each agent step does its own job on held-out questions (docs/evaluation.md).

From traces (:class:`~hkrag.rag.records.QueryOutcome`, each call a :class:`~hkrag.rag.records.CallRecord` with its
``step``, ``decision``, ``output`` and ``page_ids``) and the ground truth (:class:`~hkrag.rag.records.QueryTruth`,
:class:`~hkrag.rag.records.PageTruth`):

- **Pruner** (``pruner`` calls): yes/no accuracy against "pages 1..n hold a relevant page" (qrels), with precision
  and recall of "yes"; and as a scored classifier, its recorded P(yes) (``yes_probability``, docs/agents.md): the
  AUROC for "pages 1..n hold a relevant page" with a 95 % percentile bootstrap interval over questions (every call
  of a drawn question drawn with it), overall, by pool and by evidence label, and the yes/no accuracy of
  "P(yes) ≥ t" at a threshold t chosen on a validation report (or, without one, on this report, labelled so);
- **notes** (``fine_print`` calls at t = 1, ``salient`` calls) whose pages include a relevant page: the share that
  hold the relevant page's reference code (``fields["code"]``, as a whole word), and the share that hold every
  fine-print (salient) string of it;
- **the Decoupler's marker** (``decouple`` calls with a recorded ``decision``): right when it says yes exactly when
  the pages' fine print holds the asked value (:meth:`~hkrag.rag.records.QueryTruth.answered_by`);
- **answers** per step (``answer``, ``verify``, ``integrate``, ``single_pass``, and the final answer): relaxed
  accuracy of the call's reply against the gold answers;
- **calibration of H′**: the Judger's initial answers binned by their uncertainty, each bin's accuracy (a
  reliability table), and the AUROC of −H′ for a right answer (0.5: H′ says nothing; 1: lower H′ is always right).

Every share carries a Wilson 95 % interval (:func:`hkrag.stats.wilson_interval`). A call made on a query missing
from ``truths`` is an error naming it. ``python -m hkrag.rag steps RUN_DIR`` reports a finished ``eval.py`` run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hkrag.data.opendocvqa import QUERY_PREFIX, QAExample, load_qa
from hkrag.data.synthetic import PAGES_FILE, load_page_items, question_field
from hkrag.io import read_json, write_json, write_jsonl_gz, write_text
from hkrag.rag.metrics import relaxed_accuracy
from hkrag.rag.records import CallRecord, PageTruth, QueryOutcome, QueryTruth, words
from hkrag.rag.report import RUN_CONFIG_FILE
from hkrag.rag.trace import MERGED_FILE, load_trace
from hkrag.stats import wilson_interval

ANSWER_STEPS = ("answer", "verify", "integrate", "single_pass")
"""The steps whose reply is an answer to the question."""
BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
"""Edges of the reliability table's H′ bins (H′ is normalised to [0, 1]; the last bin holds 1.0)."""
RESAMPLES = 2000
"""Bootstrap resamples of the Pruner's AUROC interval."""
PRUNER_CALLS_FILE = "pruner_calls.jsonl.gz"
"""Every Pruner call's row (:func:`pruner_rows`: question, pool, evidence, n, label, decision, P(yes), source)."""
THIS_REPORT = "this report (no validation threshold given)"
"""Where a threshold came from when none was handed in."""


def query_truth(example: QAExample) -> QueryTruth:
    """A question's ground truth: answers, qrels and (a built-in question) the field it asks for."""
    question = example.query.removeprefix(QUERY_PREFIX).strip()
    return QueryTruth(example.query_id, question, tuple(example.answers), tuple(example.relevant_doc_ids),
                      question_field(question))


def page_truth(root: str | Path, split: str) -> dict[str, PageTruth]:
    """The drawn items of a split's pages (``<root>/pages.jsonl``: the built-in corpus only)."""
    return {doc_id: PageTruth(row["doc_id"], tuple(row["salient"]), tuple(row["fine_print"]), row["fields"])
            for doc_id, row in load_page_items(root, split).items()}


def share(hits: int, n: int) -> dict[str, Any]:
    """``{"n", "hits", "rate", "low", "high"}``: a proportion, its Wilson 95 % interval (``None`` when n = 0)."""
    low, high = wilson_interval(hits, n) if n else (None, None)
    return {"n": n, "hits": hits, "rate": hits / n if n else None, "low": low, "high": high}


def said_yes(call: CallRecord) -> bool:
    """The call's yes/no: its recorded ``decision``, else the first word of its reply."""
    if call.decision is not None:
        return call.decision == "yes"
    words = call.output.split()
    return bool(words) and words[0].strip(".,:;!*\"'").lower() == "yes"


def step_report(outcomes: Sequence[QueryOutcome], truths: Mapping[str, QueryTruth],
                pages: Mapping[str, PageTruth] | None = None, bins: Sequence[float] = BINS,
                final: bool = True, evidence: Mapping[str, str | None] | None = None,
                threshold: float | None = None, threshold_source: str = THIS_REPORT) -> dict[str, Any]:
    """The per-step figures of ``outcomes`` (see the module docstring); ``pages`` (the pages' items) enables the
    notes rows; ``final=False`` leaves out the final answer (outcomes whose calls were asked one by one);
    ``evidence`` (query id -> label) splits the Pruner's AUROC by evidence; ``threshold`` is the P(yes) threshold
    chosen on validation (``threshold_source`` says where), else one is chosen on these outcomes."""
    missing = sorted({outcome.query_id for outcome in outcomes} - set(truths))
    if missing:
        raise KeyError(f"{len(missing)} traced queries have no ground truth, e.g. {missing[:3]}")
    pruner = {"tp": 0, "fp": 0, "tn": 0, "fn": 0}
    marker = [0, 0]
    notes: dict[str, list[int]] = {"fine_print code": [0, 0], "fine_print strings": [0, 0],
                                   "salient strings": [0, 0]}
    answers: dict[str, list[int]] = {step: [0, 0] for step in (*ANSWER_STEPS, *(("final",) if final else ()))}
    judged: list[tuple[float, bool]] = []
    for outcome in outcomes:
        truth = truths[outcome.query_id]
        if final:
            answers["final"][0] += relaxed_accuracy("" if outcome.failed else outcome.answer, truth.answers) == 1.0
            answers["final"][1] += 1
        for call in outcome.calls:
            if call.error:
                continue
            relevant = [page_id for page_id in call.page_ids if page_id in truth.relevant]
            if call.step == "pruner":
                label, said = bool(relevant), said_yes(call)
                pruner[("t" if said == label else "f") + ("p" if said else "n")] += 1
            elif call.step in ANSWER_STEPS:
                right = relaxed_accuracy(call.output.strip(), truth.answers) == 1.0
                answers[call.step][0] += right
                answers[call.step][1] += 1
                if call.step == "answer" and call.uncertainty is not None:
                    judged.append((call.uncertainty, right))
            elif call.step == "decouple" and pages is not None and call.decision is not None:
                marker[0] += (call.decision == "yes") == truth.answered_by([pages[p] for p in call.page_ids
                                                                             if p in pages])
                marker[1] += 1
            elif pages is not None and relevant and (call.step == "salient" or
                                                     (call.step == "fine_print" and call.iteration == 1)):
                count_notes(notes, call, [pages[page_id] for page_id in relevant if page_id in pages])
    tp, fp, tn, fn = (pruner[key] for key in ("tp", "fp", "tn", "fn"))
    return {
        "queries": len(outcomes),
        "pruner": {"accuracy": share(tp + tn, tp + fp + tn + fn), "precision_yes": share(tp, tp + fp),
                   "recall_yes": share(tp, tp + fn), "counts": pruner,
                   "p_yes": pruner_scores(pruner_rows(outcomes, truths, evidence or {}), threshold, threshold_source)},
        "notes": {name: share(*counts) for name, counts in notes.items()},
        "decouple_marker": share(*marker),
        "answers": {step: share(*counts) for step, counts in answers.items()},
        "calibration": calibration(judged, bins),
    }


def count_notes(notes: dict[str, list[int]], call: CallRecord, relevant: Sequence[PageTruth]) -> None:
    """Add one notes call to the tallies: does its reply hold the relevant pages' code / every string of its kind."""
    if not relevant:
        return
    if call.step == "fine_print" and (named := names_code(call, relevant)) is not None:
        notes["fine_print code"][0] += named
        notes["fine_print code"][1] += 1
    strings = [text for page in relevant for text in getattr(page, call.step)]
    if strings:
        notes[f"{call.step} strings"][0] += all(text in call.output for text in strings)
        notes[f"{call.step} strings"][1] += 1


def names_code(call: CallRecord, relevant: Sequence[PageTruth]) -> bool | None:
    """Whether a note names the reference code of every relevant page (``fields["code"]``) among its whole words;
    ``None`` when no relevant page has a code."""
    codes = [page.fields["code"] for page in relevant if page.fields.get("code")]
    if not codes:
        return None
    said = words(call.output)
    return all(code in said for code in codes)


def calibration(judged: Sequence[tuple[float, bool]], bins: Sequence[float] = BINS) -> dict[str, Any]:
    """The reliability table of (H′, right) pairs over ``bins`` and the AUROC of −H′ for "right" (ties count
    half; ``None`` without both right and wrong answers)."""
    rows = []
    for index, (low, high) in enumerate(zip(bins, bins[1:])):
        last = index == len(bins) - 2
        inside = [right for value, right in judged if low <= value < high or (last and value == high)]
        rows.append({"from": low, "to": high, **share(sum(inside), len(inside))})
    lower_is_right = auroc([-value for value, _ in judged], [ok for _, ok in judged]) if judged else None
    return {"bins": rows, "auroc_lower_is_right": lower_is_right, "n": len(judged)}


def auroc(scores: Sequence[float], labels: Sequence[bool], weights: Sequence[float] | None = None) -> float | None:
    """P(a positive scores above a negative), ties counting half (the Mann–Whitney statistic), each row counted
    ``weights`` times (1 each by default); ``None`` without both a positive and a negative of positive weight."""
    values, inverse = np.unique(np.asarray(scores, dtype=float), return_inverse=True)
    weight = np.ones(len(inverse)) if weights is None else np.asarray(weights, dtype=float)
    label = np.asarray(labels, dtype=bool)
    positive = np.bincount(inverse, weights=weight * label, minlength=len(values))
    negative = np.bincount(inverse, weights=weight * ~label, minlength=len(values))
    if positive.sum() <= 0 or negative.sum() <= 0:
        return None
    below = np.cumsum(negative) - negative
    return float((positive * (below + 0.5 * negative)).sum() / (positive.sum() * negative.sum()))


def auroc_interval(scores: Sequence[float], labels: Sequence[bool], clusters: Sequence[Hashable],
                   n_resamples: int = RESAMPLES, seed: int = 0, confidence: float = 0.95) -> dict[str, Any]:
    """:func:`auroc` with a percentile bootstrap interval that resamples ``clusters`` (questions) whole: each
    resample draws as many clusters as there are, with replacement, every row weighted by its cluster's draws;
    a resample without both classes is skipped. ``auroc``/``low``/``high`` are ``None`` without both classes."""
    index = {key: i for i, key in enumerate(dict.fromkeys(clusters))}
    members = np.array([index[key] for key in clusters], dtype=int)
    value = auroc(scores, labels) if len(members) else None
    found = {"auroc": value, "low": None, "high": None, "n": len(members), "positives": int(sum(labels)),
             "questions": len(index), "resamples": 0}
    if value is None:
        return found
    rng = np.random.default_rng(seed)
    draws = [auroc(scores, labels, np.bincount(rng.integers(0, len(index), len(index)), minlength=len(index))[members])
             for _ in range(n_resamples)]
    kept = [draw for draw in draws if draw is not None]
    alpha = (1 - confidence) / 2
    low, high = np.quantile(kept, [alpha, 1 - alpha])
    return {**found, "low": float(low), "high": float(high), "resamples": len(kept)}


def pruner_rows(outcomes: Sequence[QueryOutcome], truths: Mapping[str, QueryTruth],
                evidence: Mapping[str, str | None]) -> list[dict[str, Any]]:
    """One row per answered Pruner call: query, data set, pool, evidence, n, label (pages 1..n hold a relevant
    page), the decision, P(yes) (``None`` without token statistics) and its source."""
    return [{"query_id": outcome.query_id, "dataset": outcome.dataset, "pool": outcome.pool,
             "evidence": evidence.get(outcome.query_id), "n": call.iteration,
             "label": any(page_id in truths[outcome.query_id].relevant for page_id in call.page_ids),
             "said_yes": said_yes(call), "p_yes": call.yes_probability, "source": call.p_source}
            for outcome in outcomes for call in outcome.calls if call.step == "pruner" and not call.error]


def best_threshold(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The threshold t maximising the accuracy of "yes iff P(yes) ≥ t" over ``rows`` (scored ones), among the
    midpoints between consecutive distinct P(yes) values and the two ends; ties go to the t nearest ½ (the
    likelier-answer rule's). ``None`` without a scored row."""
    values = sorted({row["p_yes"] for row in rows if row["p_yes"] is not None})
    if not values:
        return None
    candidates = [values[0], *[(a + b) / 2 for a, b in zip(values, values[1:])], np.nextafter(values[-1], 2.0)]
    scored = [(row["p_yes"], row["label"]) for row in rows if row["p_yes"] is not None]
    correct = {t: sum((p >= t) == label for p, label in scored) for t in candidates}
    return float(max(candidates, key=lambda t: (correct[t], -abs(t - 0.5))))


def pruner_scores(rows: Sequence[Mapping[str, Any]], threshold: float | None = None,
                  threshold_source: str = THIS_REPORT) -> dict[str, Any]:
    """The Pruner's P(yes) as a classifier: AUROC [bootstrap over questions] overall, by pool and by evidence, and
    the accuracy of "P(yes) ≥ t" at ``threshold`` (chosen on these rows when ``None``)."""
    scored = [row for row in rows if row["p_yes"] is not None]

    def summary(subset: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return auroc_interval([r["p_yes"] for r in subset], [r["label"] for r in subset],
                              [r["query_id"] for r in subset])

    if threshold is None:
        threshold, threshold_source = best_threshold(scored), THIS_REPORT
    hits = sum((row["p_yes"] >= threshold) == row["label"] for row in scored) if threshold is not None else 0
    return {"calls": len(rows), "unscored": len(rows) - len(scored),
            "sources": dict(Counter(row["source"] for row in scored)), "auroc": summary(scored),
            "by_pool": {pool: summary([r for r in scored if r["pool"] == pool])
                        for pool in sorted({r["pool"] for r in scored if r["pool"]})},
            "by_evidence": {label: summary([r for r in scored if r["evidence"] == label])
                            for label in sorted({r["evidence"] for r in scored if r["evidence"]})},
            "threshold": {"value": threshold, "chosen_on": threshold_source},
            "accuracy_at_threshold": share(hits, len(scored) if threshold is not None else 0)}


def _cell(row: Mapping[str, Any]) -> str:
    if row["rate"] is None:
        return "— (n = 0)"
    return f"{100 * row['rate']:.1f} [{100 * row['low']:.1f}, {100 * row['high']:.1f}] ({row['hits']}/{row['n']})"


def _auroc_cell(summary: Mapping[str, Any]) -> str:
    if summary["auroc"] is None:
        return f"— ({summary['n']} calls, {summary['positives']} yes labels)"
    return (f"{summary['auroc']:.3f} [{summary['low']:.3f}, {summary['high']:.3f}] ({summary['n']} calls, "
            f"{summary['positives']} yes labels, {summary['questions']} questions)")


def p_yes_markdown(scores: Mapping[str, Any]) -> list[str]:
    """The Pruner's P(yes) section of :func:`step_markdown`: AUROC rows and the accuracy at the threshold."""
    threshold = scores["threshold"]
    value = "—" if threshold["value"] is None else f"{threshold['value']:.4f}"
    sources = ", ".join(f"{source}: {count}" for source, count in scores["sources"].items()) or "none"
    lines = ["", "The Pruner's P(yes) as a classifier of \"pages 1..n hold a relevant page\" "
             f"({scores['calls']} calls; P(yes) from {sources}; {scores['unscored']} without token statistics). "
             "AUROC with its 95 % percentile bootstrap interval over questions:", "", "| calls | AUROC [95 %] |",
             "|---|---|",
             f"| all | {_auroc_cell(scores['auroc'])} |"]
    lines += [f"| pool {pool} | {_auroc_cell(row)} |" for pool, row in scores["by_pool"].items()]
    lines += [f"| evidence {label} | {_auroc_cell(row)} |" for label, row in scores["by_evidence"].items()]
    return lines + ["", f"Yes/no accuracy of P(yes) ≥ {value} (threshold chosen on {threshold['chosen_on']}): "
                    f"{_cell(scores['accuracy_at_threshold'])}."]


def figures(report: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Every share of a :func:`step_report`, by a row label (``"pruner: yes/no accuracy"`` …), in report order."""
    pruner = report["pruner"]
    rows = {"pruner: yes/no accuracy": pruner["accuracy"], "pruner: precision of yes": pruner["precision_yes"],
            "pruner: recall of yes": pruner["recall_yes"]}
    rows |= {f"{name.split()[0]}: notes hold the relevant page's {name.split()[1]}": row
             for name, row in report["notes"].items()}
    rows["decouple: \"answers the question\" right"] = report["decouple_marker"]
    return rows | {f"{step}: relaxed accuracy": row for step, row in report["answers"].items()}


def summary_markdown(reports: Mapping[str, Mapping[str, Any]]) -> str:
    """One table of several :func:`step_report` s: a row per figure, a column per report (×100 [Wilson 95 %])."""
    names = list(reports)
    table = {name: figures(report) for name, report in reports.items()}
    lines = ["| figure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label in table[names[0]]:
        lines.append(f"| {label} | " + " | ".join(_cell(table[name][label]) for name in names) + " |")
    lines.append("| pruner: AUROC of P(yes) [95 %, questions] | " + " | ".join(
        _auroc_cell(report["pruner"]["p_yes"]["auroc"]) for report in reports.values()) + " |")
    lines.append("| H′: AUROC of −H′ for a right initial answer | " + " | ".join(
        "—" if (auroc := report["calibration"]["auroc_lower_is_right"]) is None else f"{auroc:.3f}"
        for report in reports.values()) + " |")
    return "\n".join(lines) + "\n"


def step_markdown(report: Mapping[str, Any], title: str = "Per-step report") -> str:
    """The report of :func:`step_report` as Markdown tables (×100, Wilson 95 % intervals, hits/n)."""
    lines = [f"## {title}", "", f"{report['queries']} queries.", "", "| step: figure | value ×100 [95 %] |",
             "|---|---|"]
    lines += [f"| {label} | {_cell(row)} |" for label, row in figures(report).items()]
    lines += p_yes_markdown(report["pruner"]["p_yes"])
    table = report["calibration"]
    auroc = table["auroc_lower_is_right"]
    lines += ["", f"Calibration of H′ (the Judger's initial answers, n = {table['n']}; AUROC of −H′ for a right "
              f"answer: {'—' if auroc is None else f'{auroc:.3f}'}):", "", "| H′ | answers | accuracy ×100 [95 %] |",
              "|---|---|---|"]
    lines += [f"| [{row['from']:.1f}, {row['to']:.1f}{']' if i == len(table['bins']) - 1 else ')'} | {row['n']} | "
              f"{_cell(row)} |" for i, row in enumerate(table["bins"])]
    return "\n".join(lines) + "\n"


def validation_threshold(steps_json: str | Path) -> float:
    """The P(yes) threshold a validation report (``steps.json`` of :func:`report_run` or of
    ``hkrag.tasks.agent_steps``, whose reports are keyed by name: its first with a threshold) chose."""
    data = read_json(Path(steps_json))
    reports = data["reports"].values() if "reports" in data else [data]
    found = [r["pruner"]["p_yes"]["threshold"]["value"] for r in reports if r["pruner"].get("p_yes")]
    if not found or found[0] is None:
        raise ValueError(f"{steps_json} holds no Pruner P(yes) threshold (no scored Pruner call)")
    return float(found[0])


def report_run(run_dir: str | Path, threshold_from: str | Path | None = None) -> dict[str, Any]:
    """The per-step report of a finished ``eval.py task=rag|generation`` run, written to ``<run_dir>/steps.{json,md}``:
    its trace, its questions' qrels, answers and evidence labels (the run's ``data.qa_source`` and ``rag.split``,
    from its ``rag_config.json``) and, when the corpus records them (the built-in one), its pages' items; the
    Pruner's P(yes) threshold is the one of ``threshold_from`` (a validation report's ``steps.json``) when given.
    Every Pruner call's row goes to ``<run_dir>/pruner_calls.jsonl.gz``."""
    run_dir = Path(run_dir)
    settings = read_json(run_dir / RUN_CONFIG_FILE)["identity"]
    data, split = settings["data"], settings["rag"]["split"]
    outcomes = load_trace(run_dir / MERGED_FILE)
    examples = [ex for dataset in sorted({o.dataset for o in outcomes})
                for ex in load_qa(data["qa_source"], dataset, split)]
    truths = {ex.query_id: query_truth(ex) for ex in examples}
    items = page_truth(data["root"], split) if data.get("root") and (Path(data["root"]) / PAGES_FILE).is_file() \
        else None
    threshold = {} if threshold_from is None else {"threshold": validation_threshold(threshold_from),
                                                   "threshold_source": str(threshold_from)}
    evidence = {ex.query_id: ex.evidence for ex in examples}
    report = step_report(outcomes, truths, items, evidence=evidence, **threshold)
    write_jsonl_gz(run_dir / PRUNER_CALLS_FILE, pruner_rows(outcomes, truths, evidence))
    write_json(run_dir / "steps.json", report)
    write_text(run_dir / "steps.md", step_markdown(report, f"Per-step report: {run_dir}"))
    return report

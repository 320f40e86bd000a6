"""The per-step report: how well each agent step does its own job on held-out questions (docs/evaluation.md).

From traces (:class:`~hkrag.rag.records.QueryOutcome`, each call a :class:`~hkrag.rag.records.CallRecord` with its
``step``, ``decision``, ``output`` and ``page_ids``) and the ground truth (:class:`~hkrag.rag.records.QueryTruth`,
:class:`~hkrag.rag.records.PageTruth`):

- **Pruner** (``pruner`` calls): yes/no accuracy against "pages 1..n hold a relevant page" (qrels), with precision
  and recall of "yes";
- **notes** (``fine_print`` calls at t = 1, ``salient`` calls) whose pages include a relevant page: the share that
  hold the relevant page's reference code (``fields["code"]``, as a whole word), and the share that hold every
  fine-print (salient) string of it;
- **answers** per step (``answer``, ``verify``, ``integrate``, ``single_pass``, and the final answer): relaxed
  accuracy of the call's reply against the gold answers;
- **calibration of H′**: the Judger's initial answers binned by their uncertainty, each bin's accuracy (a
  reliability table), and the AUROC of −H′ for a right answer (0.5: H′ says nothing; 1: lower H′ is always right).

Every share carries a Wilson 95 % interval (:func:`hkrag.stats.wilson_interval`). A call made on a query missing
from ``truths`` is an error naming it. ``python -m hkrag.rag steps RUN_DIR`` reports a finished ``eval.py`` run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from hkrag.rag.metrics import relaxed_accuracy
from hkrag.rag.records import CallRecord, PageTruth, QueryOutcome, QueryTruth
from hkrag.stats import wilson_interval

ANSWER_STEPS = ("answer", "verify", "integrate", "single_pass")
"""The steps whose reply is an answer to the question."""
BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
"""Edges of the reliability table's H′ bins (H′ is normalised to [0, 1]; the last bin holds 1.0)."""


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


def words(text: str) -> set[str]:
    """The whole words of ``text`` (split at spaces, ``/``, ``;`` and ``,``) to find a code in notes."""
    return set(re.split(r"[\s/;,]+", text))


def step_report(outcomes: Sequence[QueryOutcome], truths: Mapping[str, QueryTruth],
                pages: Mapping[str, PageTruth] | None = None, bins: Sequence[float] = BINS,
                final: bool = True) -> dict[str, Any]:
    """The per-step figures of ``outcomes`` (see the module docstring); ``pages`` (the pages' items) enables the
    notes rows; ``final=False`` leaves out the final answer (outcomes whose calls were asked one by one)."""
    missing = sorted({outcome.query_id for outcome in outcomes} - set(truths))
    if missing:
        raise KeyError(f"{len(missing)} traced queries have no ground truth, e.g. {missing[:3]}")
    pruner = {"tp": 0, "fp": 0, "tn": 0, "fn": 0}
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
            elif pages is not None and relevant and (call.step == "salient" or
                                                     (call.step == "fine_print" and call.iteration == 1)):
                count_notes(notes, call, [pages[page_id] for page_id in relevant if page_id in pages])
    tp, fp, tn, fn = (pruner[key] for key in ("tp", "fp", "tn", "fn"))
    return {
        "queries": len(outcomes),
        "pruner": {"accuracy": share(tp + tn, tp + fp + tn + fn), "precision_yes": share(tp, tp + fp),
                   "recall_yes": share(tp, tp + fn), "counts": pruner},
        "notes": {name: share(*counts) for name, counts in notes.items()},
        "answers": {step: share(*counts) for step, counts in answers.items()},
        "calibration": calibration(judged, bins),
    }


def count_notes(notes: dict[str, list[int]], call: CallRecord, relevant: Sequence[PageTruth]) -> None:
    """Add one notes call to the tallies: does its reply hold the relevant pages' code / every string of its kind."""
    if not relevant:
        return
    said = words(call.output)
    if call.step == "fine_print":
        codes = [page.fields["code"] for page in relevant if page.fields.get("code")]
        if codes:
            notes["fine_print code"][0] += all(code in said for code in codes)
            notes["fine_print code"][1] += 1
    strings = [text for page in relevant for text in getattr(page, call.step)]
    if strings:
        notes[f"{call.step} strings"][0] += all(text in call.output for text in strings)
        notes[f"{call.step} strings"][1] += 1


def calibration(judged: Sequence[tuple[float, bool]], bins: Sequence[float] = BINS) -> dict[str, Any]:
    """The reliability table of (H′, right) pairs over ``bins`` and the AUROC of −H′ for "right" (ties count
    half; ``None`` without both right and wrong answers)."""
    rows = []
    for index, (low, high) in enumerate(zip(bins, bins[1:])):
        last = index == len(bins) - 2
        inside = [right for value, right in judged if low <= value < high or (last and value == high)]
        rows.append({"low": low, "high": high, **share(sum(inside), len(inside))})
    right = [value for value, ok in judged if ok]
    wrong = [value for value, ok in judged if not ok]
    auroc = None
    if right and wrong:
        auroc = sum((r < w) + 0.5 * (r == w) for r in right for w in wrong) / (len(right) * len(wrong))
    return {"bins": rows, "auroc_lower_is_right": auroc, "n": len(judged)}


def _cell(row: Mapping[str, Any]) -> str:
    if row["rate"] is None:
        return "— (n = 0)"
    return f"{100 * row['rate']:.1f} [{100 * row['low']:.1f}, {100 * row['high']:.1f}] ({row['hits']}/{row['n']})"


def step_markdown(report: Mapping[str, Any], title: str = "Per-step report") -> str:
    """The report of :func:`step_report` as Markdown tables (×100, Wilson 95 % intervals, hits/n)."""
    lines = [f"## {title}", "", f"{report['queries']} queries.", "", "| step | figure | value ×100 [95 %] |",
             "|---|---|---|"]
    pruner = report["pruner"]
    lines += [f"| pruner | yes/no accuracy | {_cell(pruner['accuracy'])} |",
              f"| pruner | precision of yes | {_cell(pruner['precision_yes'])} |",
              f"| pruner | recall of yes | {_cell(pruner['recall_yes'])} |"]
    lines += [f"| {name.split()[0]} | notes hold the relevant page's {name.split()[1]} | {_cell(row)} |"
              for name, row in report["notes"].items()]
    lines += [f"| {step} | relaxed accuracy | {_cell(row)} |" for step, row in report["answers"].items()]
    table = report["calibration"]
    auroc = table["auroc_lower_is_right"]
    lines += ["", f"Calibration of H′ (the Judger's initial answers, n = {table['n']}; AUROC of −H′ for a right "
              f"answer: {'—' if auroc is None else f'{auroc:.3f}'}):", "", "| H′ | answers | accuracy ×100 [95 %] |",
              "|---|---|---|"]
    lines += [f"| [{row['low']:.1f}, {row['high']:.1f}{']' if i == len(table['bins']) - 1 else ')'} | {row['n']} | "
              f"{_cell(row)} |" for i, row in enumerate(table["bins"])]
    return "\n".join(lines) + "\n"

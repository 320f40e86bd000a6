"""The per-step report: how well each agent step does its own job on held-out questions (docs/evaluation.md).

From traces (:class:`~hkrag.rag.records.QueryOutcome`, each call a :class:`~hkrag.rag.records.CallRecord` with its
``step``, ``decision``, ``output`` and ``page_ids``) and the ground truth (:class:`~hkrag.rag.records.QueryTruth`,
:class:`~hkrag.rag.records.PageTruth`):

- **Pruner** (``pruner`` calls): yes/no accuracy against "pages 1..n hold a relevant page" (qrels), with precision
  and recall of "yes";
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

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hkrag.data.opendocvqa import QUERY_PREFIX, QAExample, load_qa
from hkrag.data.synthetic import PAGES_FILE, load_page_items, question_field
from hkrag.io import write_json, write_text
from hkrag.rag.metrics import relaxed_accuracy
from hkrag.rag.records import CallRecord, PageTruth, QueryOutcome, QueryTruth, words
from hkrag.rag.trace import MERGED_FILE, load_trace
from hkrag.stats import wilson_interval

ANSWER_STEPS = ("answer", "verify", "integrate", "single_pass")
"""The steps whose reply is an answer to the question."""
BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
"""Edges of the reliability table's H′ bins (H′ is normalised to [0, 1]; the last bin holds 1.0)."""


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
                final: bool = True) -> dict[str, Any]:
    """The per-step figures of ``outcomes`` (see the module docstring); ``pages`` (the pages' items) enables the
    notes rows; ``final=False`` leaves out the final answer (outcomes whose calls were asked one by one)."""
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
                   "recall_yes": share(tp, tp + fn), "counts": pruner},
        "notes": {name: share(*counts) for name, counts in notes.items()},
        "decouple_marker": share(*marker),
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
        rows.append({"from": low, "to": high, **share(sum(inside), len(inside))})
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
    lines.append("| H′: AUROC of −H′ for a right initial answer | " + " | ".join(
        "—" if (auroc := report["calibration"]["auroc_lower_is_right"]) is None else f"{auroc:.3f}"
        for report in reports.values()) + " |")
    return "\n".join(lines) + "\n"


def step_markdown(report: Mapping[str, Any], title: str = "Per-step report") -> str:
    """The report of :func:`step_report` as Markdown tables (×100, Wilson 95 % intervals, hits/n)."""
    lines = [f"## {title}", "", f"{report['queries']} queries.", "", "| step: figure | value ×100 [95 %] |",
             "|---|---|"]
    lines += [f"| {label} | {_cell(row)} |" for label, row in figures(report).items()]
    table = report["calibration"]
    auroc = table["auroc_lower_is_right"]
    lines += ["", f"Calibration of H′ (the Judger's initial answers, n = {table['n']}; AUROC of −H′ for a right "
              f"answer: {'—' if auroc is None else f'{auroc:.3f}'}):", "", "| H′ | answers | accuracy ×100 [95 %] |",
              "|---|---|---|"]
    lines += [f"| [{row['from']:.1f}, {row['to']:.1f}{']' if i == len(table['bins']) - 1 else ')'} | {row['n']} | "
              f"{_cell(row)} |" for i, row in enumerate(table["bins"])]
    return "\n".join(lines) + "\n"


def report_run(run_dir: str | Path) -> dict[str, Any]:
    """The per-step report of a finished ``eval.py task=rag|generation`` run on the built-in corpus, written to
    ``<run_dir>/steps.{json,md}``: its trace, its questions' qrels and answers (``data.qa_source``, ``rag.split``)
    and, when the corpus records them, its pages' items."""
    run_dir = Path(run_dir)
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    outcomes = load_trace(run_dir / MERGED_FILE)
    split = cfg.rag.split
    truths = {ex.query_id: query_truth(ex) for dataset in sorted({o.dataset for o in outcomes})
              for ex in load_qa(cfg.data.qa_source, dataset, split)}
    items = page_truth(cfg.data.root, split) if (Path(cfg.data.root) / PAGES_FILE).is_file() else None
    report = step_report(outcomes, truths, items)
    write_json(run_dir / "steps.json", report)
    write_text(run_dir / "steps.md", step_markdown(report, f"Per-step report: {run_dir}"))
    return report

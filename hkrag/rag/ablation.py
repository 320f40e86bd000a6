"""The paper's Table 6 from finished RAG runs: generator configurations side by side on the same queries.

:func:`generator_ablation` takes one run per configuration (``single_pass``, ``no_pruner``, ``no_decoupler``,
``hkrag``; each the outcomes of ``eval.py task=generation|rag``, all on the same queries and pages) and gives, for a
rule metric (default relaxed accuracy; ``accuracy`` is the judge's verdict):

- each configuration's score with its 95 % interval (:func:`hkrag.rag.report.summarize_group`), its routes and its
  cost per query (LVLM calls, input and output tokens);
- the **paired** difference to the baseline (default ``single_pass``, the paper's "Baseline" row) with a bootstrap
  interval over queries (:func:`hkrag.stats.paired_bootstrap`; one generator, decoded greedily, so queries are the
  only source of variance);
- a verdict on each of the paper's Table 6 claims (:data:`TABLE6_CLAIMS`) whose two configurations ran
  (:func:`hkrag.stats.verdict`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from hkrag.rag.records import QueryOutcome
from hkrag.rag.report import is_correct, metric_value, summarize_group
from hkrag.rag.trace import outcome_key
from hkrag.stats import Claim, paired_bootstrap, verdict

TABLE6_CLAIMS = (
    Claim("HKRAG-Gen beats the baseline", "hkrag", "single_pass"),
    Claim("HKRAG-Gen beats Gen w/o pruner", "hkrag", "no_pruner"),
    Claim("HKRAG-Gen beats Gen w/o decoupler", "hkrag", "no_decoupler"),
    Claim("Gen w/o pruner (the Decoupler alone) beats the baseline", "no_pruner", "single_pass"),
    Claim("Gen w/o decoupler (the Pruner alone) beats the baseline", "no_decoupler", "single_pass"),
)
"""The paper's Table 6 claims in the names of ``conf/generator``."""


def query_values(outcomes: Sequence[QueryOutcome], metric: str) -> dict[str, float]:
    """Each query's score (``accuracy``: the judge's verdict; else a rule metric), by :func:`outcome_key`."""
    score = (lambda o: float(is_correct(o))) if metric == "accuracy" else (lambda o: metric_value(o, metric))
    return {outcome_key(o): score(o) for o in outcomes}


def generator_ablation(
    runs: Mapping[str, Sequence[QueryOutcome]], baseline: str = "single_pass", metric: str = "relaxed_accuracy",
    claims: Sequence[Claim] = TABLE6_CLAIMS, margin: float = 0.01, n_resamples: int = 2000, seed: int = 0,
) -> dict[str, Any]:
    """Scores, paired differences to ``baseline``, verdicts, routes and cost of ``runs`` (module docstring)."""
    if baseline not in runs:
        raise ValueError(f"baseline {baseline!r} is not among the runs {list(runs)}")
    values = {name: query_values(outcomes, metric) for name, outcomes in runs.items()}
    keys = sorted(values[baseline])
    for name, by_query in values.items():
        if sorted(by_query) != keys:
            raise ValueError(f"run {name!r} answered other queries than {baseline!r}: a table compares the same "
                             "queries")

    def compare(better: str, worse: str) -> dict[str, float]:
        return paired_bootstrap([values[better][k] for k in keys], [values[worse][k] for k in keys],
                                n_resamples=n_resamples, seed=seed)

    rows = {}
    for name, outcomes in runs.items():
        group = summarize_group(outcomes)
        ci95 = group["accuracy"]["ci95"] if metric == "accuracy" and group["accuracy"] else group["ci95"][metric]
        rows[name] = {"value": sum(values[name].values()) / len(keys), "ci95": ci95, "routes": group["routes"],
                      "cost": group["cost"], "failed": group["failed"],
                      **({"vs_baseline": compare(name, baseline)} if name != baseline else {})}
    verdicts = []
    for claim in claims:
        if claim.better in runs and claim.worse in runs:
            result = compare(claim.better, claim.worse)
            verdicts.append({**dataclasses.asdict(claim), **result,
                             "verdict": verdict(result["low"], result["high"], margin)})
    return {"metric": metric, "baseline": baseline, "num_queries": len(keys), "margin": margin, "rows": rows,
            "verdicts": verdicts}


def score_rows(summary: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Table 6's rows, unrounded: per generator its score and 95 % interval, the difference to the baseline and its
    interval (``None`` for the baseline), all ×100; its route shares (%) and cost per query. What :func:`markdown`
    and the W&B table show."""
    rows = summary["rows"]
    routes = sorted({route for row in rows.values() for route in row["routes"]})
    columns = ["generator", "score", "low", "high", "vs_baseline", "vs_low", "vs_high", *(f"route {r}" for r in routes),
               "lvlm_calls", "input_tokens", "output_tokens"]
    return columns, [
        [name, *(100 * v for v in (row["value"], *row["ci95"])),
         *((100 * row["vs_baseline"][k] for k in ("diff", "low", "high")) if "vs_baseline" in row else [None] * 3),
         *(100 * row["routes"].get(r, 0.0) for r in routes),
         row["cost"]["lvlm_calls"], row["cost"]["input_tokens"], row["cost"]["output_tokens"]]
        for name, row in rows.items()]


def verdict_rows(summary: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Each judged claim: text, configurations, difference better − worse and its interval (×100), verdict."""
    return ["claim", "better", "worse", "diff", "low", "high", "verdict"], [
        [v["text"], v["better"], v["worse"], 100 * v["diff"], 100 * v["low"], 100 * v["high"], v["verdict"]]
        for v in summary["verdicts"]]


def markdown(summary: Mapping[str, Any], title: str) -> str:
    """The summary as Markdown: scores, differences, routes and cost per query; then the verdicts (x100)."""
    baseline = summary["baseline"]
    columns, rows = score_rows(summary)
    routes = [column for column in columns if column.startswith("route ")]
    lines = [f"### {title}\n", f"{summary['metric']} ×100 on {summary['num_queries']} queries [95% interval]; "
             f"difference to `{baseline}` with a paired bootstrap interval over queries.\n",
             "| generator | score | vs " + baseline + " | " + " | ".join(routes)
             + " | LVLM calls / query | input tok. | output tok. |", "|---" * (6 + len(routes)) + "|"]
    for name, value, low, high, diff, diff_low, diff_high, *shares, calls, inputs, outputs in rows:
        versus = "–" if diff is None else f"{diff:+.1f} [{diff_low:+.1f}, {diff_high:+.1f}]"
        lines.append(f"| {name} | {value:.1f} [{low:.1f}, {high:.1f}] | {versus} | "
                     + " | ".join(f"{share:.0f}%" for share in shares)
                     + f" | {calls:.2f} | {inputs:.0f} | {outputs:.0f} |")
    if summary["verdicts"]:
        lines += ["", "| claim | difference [95%] | verdict |", "|---|---|---|"]
        lines += [f"| {text} (`{better}` vs `{worse}`) | {diff:+.1f} [{low:+.1f}, {high:+.1f}] | **{result}** |"
                  for text, better, worse, diff, low, high, result in verdict_rows(summary)[1]]
    return "\n".join(lines) + "\n"

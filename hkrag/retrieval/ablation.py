"""The Table-5 ablation from a Hydra multirun of ``train.py``: nDCG@5 per loss and evidence type, seeds and intervals.

    python train.py -m experiment=demo loss=hkrag,infonce,no_sin,no_din trainer.seed=0,1,2
    python -m hkrag.retrieval.ablation multirun/train/<stamp>              # writes ablation.{md,json,png} there

Each job folder of the multirun holds ``.hydra/overrides.yaml``, ``eval-after/per_query.json`` (every test
query's nDCG@5 and evidence label, written by :mod:`hkrag.retrieval.evaluation`), ``metrics.jsonl`` (mask statistics
per step) and, with ``trainer.eval_every``, ``eval-step-<n>/per_query.json`` (the learning curve). A job's condition
is the value of its ``--by`` override (default ``loss``; several keys ``--by loss,loss.alpha`` give labels
``loss=hkrag,loss.alpha=2`` of the keys a job sets; ``auto``: every override that varies across the jobs), its
seed that of ``--seed-key`` (default ``trainer.seed``). For every pool and evidence type (``salient``,
``fine_print``, and all queries), the summary gives:

- **mean ± std over seeds** of the run's nDCG@5, averaged over its queries pooled across the data sets;
- **the difference to the baseline** (default ``infonce``, the paper's Eq. 3 baseline) with a **crossed seeds ×
  queries** t interval (:func:`hkrag.stats.crossed_difference`) on the matched seeds: every seed answers the same
  test queries, so seed and query are crossed random factors of the per-seed, per-query differences, and the
  interval holds seed-to-seed variance as well as which queries a loss wins or loses (with 3–5 seeds, where the
  crossed percentile bootstrap under-covers; docs/statistics.md);
- **verdicts** on the paper's Table 5 claims (:data:`TABLE5_CLAIMS`; those whose two conditions ran), by the rule
  of :func:`hkrag.stats.verdict`, which tests the smallest effect of interest ``margin`` (default 1 nDCG@5 point)
  first: *not reproduced* when the interval of A − B lies wholly below the margin, *reproduced* when it lies above
  0 (and reaches the margin), else *inconclusive*; and, over the table's family of verdicts (every claim in every
  pool), Holm-adjusted p-values, Bonferroni-level intervals and the corrected verdicts
  (:func:`hkrag.stats.corrected_verdicts`);
- **learning curves** (mean ± std over seeds per evaluated step) and the change over their last interval, which
  says whether the runs reached a plateau;
- **mask shares** of the positive pairs' hybrid mask (Eq. 2) equal to 1, ½ and 0, averaged over training
  steps and seeds, and their course over training in the plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from hkrag.io import png_bytes, read_json, read_jsonl, write_bytes, write_json, write_text
from hkrag.retrieval.evaluation import AFTER_TRAINING_DIR, BEFORE_TRAINING_DIR, CURVE_DIR, PER_QUERY_FILE
from hkrag.run_log import METRICS_FILE, RunLogger
from hkrag.stats import (
    CORRECTION,
    VERDICT_RULE,
    Claim,
    corrected_verdicts,
    crossed_difference,
    crossed_interval,
    mean_and_std,
)

logger = logging.getLogger(__name__)

METRIC = "ndcg@5"
ALL = "all"
"""The evidence type that stands for every query."""
MASK_SHARES = {"mask/one": "1", "mask/half": "½", "mask/zero": "0"}
"""``metrics.jsonl`` keys logged by :func:`hkrag.losses.mask_statistics` and their mask values."""


class AblationError(ValueError):
    """A multirun folder that cannot be aggregated; the message names the folder or job."""


TABLE5_CLAIMS = (
    Claim("HKRAG-Ret beats the InfoNCE baseline", "hkrag", "infonce"),
    Claim("HKRAG-Ret beats Ret w/o L_SIN", "hkrag", "no_sin"),
    Claim("HKRAG-Ret beats Ret w/o L_DIN", "hkrag", "no_din"),
    Claim("Ret w/o L_SIN (L_DIN alone) beats the baseline", "no_sin", "infonce"),
    Claim("Ret w/o L_DIN (L_SIN alone) beats the baseline", "no_din", "infonce"),
    Claim("L_SIN carries fine print: removing it costs fine-print queries", "hkrag", "no_sin", "fine_print"),
    Claim("L_DIN carries salient content: removing it costs salient queries", "hkrag", "no_din", "salient"),
)
"""The paper's Table 5 claims (and Section 4.3's reading of it) in the condition names of ``loss=``."""


@dataclass
class Run:
    """One finished job of the sweep."""

    path: Path
    condition: str
    seed: int
    scores: dict[str, dict[tuple[str, str], tuple[str | None, float]]]
    """``pool -> (dataset, query_id) -> (evidence, nDCG@5)``."""
    masks: list[dict[str, float]] = field(default_factory=list)
    """``metrics.jsonl`` rows: ``step`` and the three mask shares."""
    curve: dict[int, dict[str, dict[tuple[str, str], tuple[str | None, float]]]] = field(default_factory=dict)
    """``step -> scores`` at every evaluated step (0: before training, when evaluated)."""

    def query_scores(self, pool: str, evidence: str, step: int | None = None) -> dict[tuple[str, str], float]:
        """nDCG@5 of the queries of ``evidence`` (``all``: every query; a data set's name: its queries) in ``pool``,
        after training or at ``step``."""
        scores = self.scores if step is None else self.curve[step]
        return {key: value for key, (label, value) in scores.get(pool, {}).items()
                if evidence in (ALL, label, key[0])}


def overrides(job: Path) -> dict[str, str]:
    """``key=value`` overrides Hydra recorded for a job (``+``/``++`` prefixes dropped)."""
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        raise AblationError(f"{job} has no .hydra/overrides.yaml: is it a job folder of a Hydra multirun?")
    items = yaml.safe_load(path.read_text()) or []
    return dict(item.lstrip("+").split("=", 1) for item in items)


def condition_label(chosen: dict[str, str], by: Sequence[str]) -> str | None:
    """A job's condition: the value of the one ``by`` key, or ``key=value`` of every ``by`` key the job sets."""
    if len(by) == 1:
        return chosen.get(by[0])
    present = [f"{key}={chosen[key]}" for key in by if key in chosen]
    return ",".join(present) or None


def read_scores(per_query: Path) -> dict[str, dict[tuple[str, str], tuple[str | None, float]]]:
    """``pool -> (dataset, query_id) -> (evidence, nDCG@5)`` of a ``per_query.json``."""
    scores: dict[str, dict[tuple[str, str], tuple[str | None, float]]] = {}
    for dataset, by_pool in read_json(per_query).items():
        for pool, by_query in by_pool.items():
            for query_id, entry in by_query.items():
                scores.setdefault(pool, {})[(dataset, query_id)] = (entry["evidence"], float(entry[METRIC]))
    return scores


def read_curve(job: Path) -> dict[int, dict[str, dict[tuple[str, str], tuple[str | None, float]]]]:
    """The job's learning curve: ``eval-step-<n>`` folders (and ``eval-before`` as step 0) that hold scores."""
    prefix = CURVE_DIR.format(step="")
    steps = {path.name[len(prefix):]: path for path in job.glob(f"{prefix}*")}
    folders = {int(step): path for step, path in steps.items() if step.isdigit()}
    if folders:
        folders.setdefault(0, job / BEFORE_TRAINING_DIR)
    return {step: read_scores(folder / PER_QUERY_FILE) for step, folder in sorted(folders.items())
            if (folder / PER_QUERY_FILE).is_file()}


def load_run(job: Path, by: str | Sequence[str] = "loss", seed_key: str = "trainer.seed") -> Run:
    """Read one job folder; raises :class:`AblationError` naming what is missing."""
    chosen = overrides(job)
    keys = [by] if isinstance(by, str) else list(by)
    condition = condition_label(chosen, keys)
    for key, value in ((",".join(keys), condition), (seed_key, chosen.get(seed_key))):
        if value is None:
            raise AblationError(f"{job}: no {key}=... override (overrides: {sorted(chosen)}); pass --by/--seed-key")
    per_query = job / AFTER_TRAINING_DIR / PER_QUERY_FILE
    if not per_query.is_file():
        raise AblationError(f"{job}: {per_query.relative_to(job)} is missing: did the run finish its evaluation?")
    metrics = job / METRICS_FILE
    rows = read_jsonl(metrics) if metrics.is_file() else []
    masks = [{"step": row["step"], **{k: row[k] for k in MASK_SHARES}} for row in rows if "mask/one" in row]
    return Run(job, condition, int(chosen[seed_key]), read_scores(per_query), masks, read_curve(job))


def varying_keys(jobs: Sequence[Path], seed_key: str) -> list[str]:
    """The override keys whose values differ across ``jobs`` (``--by auto``), the seed key left out."""
    chosen = [overrides(job) for job in jobs]
    keys = dict.fromkeys(key for c in chosen for key in c if key != seed_key)
    varying = [key for key in keys if len({c.get(key) for c in chosen}) > 1]
    if not varying:
        raise AblationError(f"{jobs[0].parent}: no override varies across the jobs but {seed_key}: nothing to compare")
    return varying


def load_multirun(
    folder: str | Path, by: str | Sequence[str] = "loss", seed_key: str = "trainer.seed", finished_only: bool = False
) -> list[Run]:
    """Every job folder (``0``, ``1``, …) of a multirun, in job order; ``by``: a key, keys, or ``auto``.

    ``finished_only`` skips (and logs) jobs without ``eval-after/per_query.json``, e.g. of a sweep still
    running; otherwise such a job is an error.
    """
    folder = Path(folder)
    jobs = sorted((p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)) \
        if folder.is_dir() else []
    if finished_only:
        unfinished = [job.name for job in jobs if not (job / AFTER_TRAINING_DIR / PER_QUERY_FILE).is_file()]
        if unfinished:
            logger.warning("%s: skipping %d unfinished job(s): %s", folder, len(unfinished), ", ".join(unfinished))
        jobs = [job for job in jobs if job.name not in unfinished]
    if not jobs:
        raise AblationError(f"{folder} holds no job folders (0/, 1/, …): pass a multirun/<run_name>/<stamp> folder")
    if by == "auto":
        by = varying_keys(jobs, seed_key)
    runs = [load_run(job, by, seed_key) for job in jobs]
    check_distinct(runs, by if isinstance(by, str) else None, seed_key)
    check_settings_distinct(jobs)
    return runs


def check_distinct(runs: Sequence[Run], by: str | None = None, seed_key: str = "seed") -> None:
    """Refuse two runs of one condition with one seed: the intervals would count one run twice as independent
    (``trainer.seed=0,0,1``, or a job folder copied); :class:`AblationError` names both folders."""
    seen: dict[tuple[str, int], Path] = {}
    for run in runs:
        if (run.condition, run.seed) in seen:
            what = f"{by}={run.condition}" if by else run.condition
            raise AblationError(f"{run.path} repeats {what} {seed_key}={run.seed} of "
                                f"{seen[run.condition, run.seed]}: each seed must be one run; drop one of them")
        seen[run.condition, run.seed] = run.path


def check_settings_distinct(jobs: Sequence[Path]) -> None:
    """Refuse two jobs run with the same settings and seed (their ``.hydra/config.yaml`` equal), whatever their
    overrides say (``loss=hkrag`` and ``loss=hkrag loss.alpha=1.0`` are one setting): one run counted twice."""
    seen: dict[str, Path] = {}
    for job in jobs:
        path = job / ".hydra" / "config.yaml"
        if not path.is_file():
            continue
        settings = json.dumps(yaml.safe_load(path.read_text()), sort_keys=True, default=str)
        if settings in seen:
            raise AblationError(f"{job} ran with the same settings and seed as {seen[settings]} ({path.name} equal): "
                                "one run would be counted twice; drop one of them")
        seen[settings] = job


PER_QUERY_LINES = "ablation_per_query.jsonl"
"""Every run's per-query nDCG@5 behind a summary (:func:`per_query_lines`), written beside ``ablation.json``."""


def per_query_lines(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Every run's nDCG@5 on every test query after training, compactly: per pool a header line ``{"pool",
    "queries": [[dataset, query id, evidence], ...]}``, then one line per run ``{"condition", "seed", "pool",
    "ndcg@5": [...]}`` in the header's query order. :func:`load_per_query` reads them back into runs that
    :func:`summarize` turns into the same means, intervals and verdicts (not the learning curves or masks)."""
    lines: list[dict[str, Any]] = []
    for pool in dict.fromkeys(pool for run in runs for pool in run.scores):
        first = next(run for run in runs if pool in run.scores).scores[pool]
        keys = sorted(first)
        lines.append({"pool": pool, "queries": [[*key, first[key][0]] for key in keys]})
        for run in runs:
            scores = run.scores.get(pool, {})
            if scores.keys() != set(keys):
                raise AblationError(f"{run.path} scored other {pool} queries than the first run of that pool")
            lines.append({"condition": run.condition, "seed": run.seed, "pool": pool,
                          METRIC: [scores[key][1] for key in keys]})
    return lines


def write_per_query(path: str | Path, runs: Sequence[Run]) -> Path:
    """:func:`per_query_lines` of ``runs`` into ``path`` (JSON lines, atomically)."""
    return write_text(path, "".join(json.dumps(line) + "\n" for line in per_query_lines(runs)))


def load_per_query(path: str | Path) -> list[Run]:
    """The runs of a :func:`per_query_lines` file (``path`` each run's path), for :func:`summarize`."""
    path = Path(path)
    runs: dict[tuple[str, int], Run] = {}
    queries: dict[str, list] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        row = json.loads(line)
        if "queries" in row:
            queries[row["pool"]] = row["queries"]
            continue
        if row["pool"] not in queries or len(row[METRIC]) != len(queries[row["pool"]]):
            raise AblationError(f"{path}, line {number}: scores without a matching header line of pool {row['pool']}")
        run = runs.setdefault((row["condition"], row["seed"]), Run(path, row["condition"], row["seed"], {}))
        run.scores[row["pool"]] = {(dataset, query): (evidence, score)
                                   for (dataset, query, evidence), score in zip(queries[row["pool"]], row[METRIC])}
    return list(runs.values())


def evidence_types(runs: Sequence[Run]) -> list[str]:
    """``all`` then the evidence labels the queries carry, sorted."""
    labels = {label for run in runs for by_query in run.scores.values() for label, _ in by_query.values() if label}
    return [ALL, *sorted(labels)]


def run_mean(run: Run, pool: str, evidence: str) -> float:
    scores = run.query_scores(pool, evidence)
    return float(np.mean(list(scores.values()))) if scores else float("nan")


def score_matrix(runs: Sequence[Run], pool: str, evidence: str, step: int | None = None) -> tuple[list, np.ndarray]:
    """The query keys and the ``(seeds, queries)`` nDCG@5 matrix of ``runs`` (one condition, in seed order)."""
    per_run = [run.query_scores(pool, evidence, step) for run in runs]
    keys = sorted(per_run[0])
    for run, scores in zip(runs, per_run):
        if scores.keys() != set(keys):
            raise AblationError(f"{run.path} scored other {pool}/{evidence} queries than {runs[0].path}")
    return keys, np.array([[scores[key] for key in keys] for scores in per_run], dtype=float)


def summarize(
    runs: Sequence[Run], baseline: str = "infonce", confidence: float = 0.95,
    claims: Sequence[Claim] = TABLE5_CLAIMS, margin: float = 0.01, datasets: Sequence[str] = (),
) -> dict[str, Any]:
    """Means, stds, intervals, differences to ``baseline``, verdicts on ``claims``, learning curves and mask
    shares (see the module docstring); ``datasets`` adds columns of those data sets' queries alone (e.g. the
    fine-print split ``synfine``) after the evidence types, where the runs scored any."""
    check_distinct(runs)
    conditions = list(dict.fromkeys(run.condition for run in runs))
    if baseline not in conditions:
        raise AblationError(f"baseline {baseline!r} is not among the conditions {conditions}; pass --baseline")
    conditions.remove(baseline)
    conditions.insert(0, baseline)
    by_condition = {c: sorted((r for r in runs if r.condition == c), key=lambda r: r.seed) for c in conditions}
    pools = list(dict.fromkeys(pool for run in runs for pool in run.scores))
    scored = {dataset for run in runs for by_query in run.scores.values() for dataset, _ in by_query}
    evidence = evidence_types(runs) + [name for name in datasets if name in scored]
    summary: dict[str, Any] = {"baseline": baseline, "conditions": conditions, "pools": pools, "evidence": evidence,
                               "seeds": {c: [r.seed for r in rs] for c, rs in by_condition.items()},
                               "confidence": confidence, "margin": margin, "interval": CROSSED_SCHEME,
                               METRIC: {}, "vs_baseline": {}, "curves": {}}
    compare = functools.partial(_versus, confidence=confidence)
    for pool in pools:
        for label in evidence:
            for condition, group in by_condition.items():
                summary[METRIC].setdefault(pool, {}).setdefault(label, {})[condition] = _condition_score(
                    group, pool, label, confidence)
                if condition != baseline:
                    summary["vs_baseline"].setdefault(pool, {}).setdefault(label, {})[condition] = compare(
                        group, by_condition[baseline], pool, label)
            summary["curves"].setdefault(pool, {})[label] = {
                c: curve for c, group in by_condition.items() if (curve := curve_summary(group, pool, label))}
    judged = []
    for claim in claims:
        if claim.better not in by_condition or claim.worse not in by_condition or claim.evidence not in evidence:
            continue  # a claim about conditions this sweep did not run
        if not {r.seed for r in by_condition[claim.better]} & {r.seed for r in by_condition[claim.worse]}:
            logger.warning("claim %r not judged: %s and %s share no seed", claim.text, claim.better, claim.worse)
            continue
        for pool in pools:
            result = compare(by_condition[claim.better], by_condition[claim.worse], pool, claim.evidence)
            judged.append({**dataclasses.asdict(claim), "pool": pool, **result})
    summary["verdicts"] = corrected_verdicts(judged, margin, alpha=1 - confidence)
    summary["masks"] = {c: mask_summary(rs) for c, rs in by_condition.items()}
    return summary


CROSSED_SCHEME = "crossed seeds x queries t interval (two-way random-effects ANOVA, Satterthwaite df)"
"""The interval of every mean and difference here (:func:`hkrag.stats.crossed_interval`), for the reports."""


def _condition_score(runs: Sequence[Run], pool: str, evidence: str, confidence: float) -> dict[str, Any]:
    """Mean ± std over seeds of the runs' query means, and the crossed seeds × queries interval of the mean."""
    keys, matrix = score_matrix(runs, pool, evidence)
    per_seed = [run_mean(run, pool, evidence) for run in runs]
    mean, std = mean_and_std(per_seed)
    interval = crossed_interval(matrix, confidence) if keys else {}
    return {"mean": mean, "std": std, "per_seed": per_seed, "num_queries": len(keys),
            **{k: interval[k] for k in ("low", "high") if k in interval}}


def _versus(runs: Sequence[Run], base: Sequence[Run], pool: str, evidence: str, confidence: float) -> dict[str, Any]:
    """Crossed seeds × queries interval of ``runs`` − ``base`` over the seeds both have and their queries
    (:func:`hkrag.stats.crossed_difference`); a pool's queries are distinct questions, so no clustering is needed."""
    seeds = sorted({r.seed for r in runs} & {r.seed for r in base})
    if not seeds:
        raise AblationError(f"{runs[0].condition} and {base[0].condition} share no seed")
    keys_a, a = score_matrix([r for r in runs if r.seed in seeds], pool, evidence)
    keys_b, b = score_matrix([r for r in base if r.seed in seeds], pool, evidence)
    if keys_a != keys_b:
        raise AblationError(f"{runs[0].condition} and {base[0].condition} scored other {pool}/{evidence} queries")
    result = crossed_difference(a, b, confidence=confidence)
    return {**{k: v for k, v in result.items() if k not in ("seeds", "questions")}, "seeds": seeds,
            "num_queries": len(keys_a)}


def curve_summary(runs: Sequence[Run], pool: str, evidence: str) -> dict[str, Any]:
    """The learning curve of one condition: per step every seed ran, the mean and std over seeds of the run's
    query mean; ``last_change``: the mean's change over the last interval (near 0: a plateau). ``{}`` without one."""
    steps = sorted(set.intersection(*(set(run.curve) for run in runs))) if runs else []
    if len(steps) < 2:
        return {}
    per_step = [[float(np.mean(list(run.query_scores(pool, evidence, step).values()))) for run in runs]
                for step in steps]
    means, stds = zip(*(mean_and_std(values) for values in per_step))
    return {"steps": steps, "mean": list(means), "std": list(stds), "last_change": means[-1] - means[-2]}


def mask_summary(runs: Sequence[Run]) -> dict[str, Any]:
    """Mask shares averaged over steps and seeds, and per step averaged over seeds (the curve)."""
    rows = [row for run in runs for row in run.masks]
    if not rows:
        return {}
    steps = sorted({row["step"] for row in rows})
    curve = {key: [float(np.mean([r[key] for r in rows if r["step"] == step])) for step in steps]
             for key in MASK_SHARES}
    return {"mean": {key: float(np.mean([r[key] for r in rows])) for key in MASK_SHARES}, "steps": steps,
            "curve": curve}


def markdown(summary: dict[str, Any], title: str) -> str:
    """The summary as Markdown tables (values ×100)."""
    evidence, baseline = summary["evidence"], summary["baseline"]
    seeds = ", ".join(f"{c}: {s}" for c, s in summary["seeds"].items())
    lines = [f"# Ablation: {title}\n", f"Seeds per condition: {seeds}. nDCG@5 ×100 averaged over each run's "
             "queries (pooled across data sets); ± is the sample std over seeds.\n"]
    for pool in summary["pools"]:
        lines += [f"## nDCG@5, pool `{pool}`\n", _header(["loss", *evidence])]
        for condition, *values in score_rows(summary, pool)[1]:
            cells = [f"{mean:.1f} ± {std:.1f}" for mean, std in zip(values[::2], values[1::2])]
            lines.append(f"| {condition} | " + " | ".join(cells) + " |")
        counts = ", ".join(f"{e}: {summary[METRIC][pool][e][baseline]['num_queries']}" for e in evidence)
        lines += [f"\nQueries: {counts}.\n"]
        confidence = round(100 * summary["confidence"])
        lines += [f"Difference to `{baseline}` ×100 [{confidence}% {CROSSED_SCHEME}, on matched seeds] (two-sided "
                  "t p):\n", _header(["loss", *evidence])]
        for condition, *values in difference_rows(summary, pool)[1]:
            cells = [f"{diff:+.1f} [{low:+.1f}, {high:+.1f}] (p{'' if p < 1e-4 else '='}{p_text(p)})"
                     for diff, low, high, p in zip(*(values[k::4] for k in range(4)))]
            lines.append(f"| {condition} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += _verdict_lines(summary) + _curve_lines(summary)
    lines += ["## Mask shares of the positive pairs over training (Eq. 2), mean over steps and seeds\n",
              _header(["loss", *(f"M_H = {v}" for v in MASK_SHARES.values())])]
    for condition, masks in summary["masks"].items():
        cells = [f"{masks['mean'][k]:.3f}" for k in MASK_SHARES] if masks else ["–"] * len(MASK_SHARES)
        lines.append(f"| {condition} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


SCORE_STATS = ("mean", "std")
DIFFERENCE_STATS = ("diff", "low", "high", "p_value")


def score_rows(summary: dict[str, Any], pool: str) -> tuple[list[str], list[list[Any]]]:
    """Table 5 of ``pool``: per condition, each evidence type's nDCG@5 mean and std over seeds (×100), unrounded;
    what :func:`markdown` and the W&B table show."""
    table, evidence = summary[METRIC][pool], summary["evidence"]
    return ["loss", *(f"{e} {stat}" for e in evidence for stat in SCORE_STATS)], [
        [condition, *(100 * table[e][condition][stat] for e in evidence for stat in SCORE_STATS)]
        for condition in summary["conditions"]]


def difference_rows(summary: dict[str, Any], pool: str) -> tuple[list[str], list[list[Any]]]:
    """Per condition but the baseline, each evidence type's difference to it, its interval (×100) and p-value."""
    evidence = summary["evidence"]
    return ["loss", *(f"{e} {stat}" for e in evidence for stat in DIFFERENCE_STATS)], [
        [condition, *(summary["vs_baseline"][pool][e][condition][stat] * (1 if stat == "p_value" else 100)
                      for e in evidence for stat in DIFFERENCE_STATS)]
        for condition in summary["conditions"][1:]]


VERDICT_COLUMNS = ("claim", "better", "worse", "evidence", "pool", "diff", "low", "high", "p_value", "verdict",
                   "p_holm", "corrected_low", "corrected_high", "corrected_verdict")


def verdict_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Each judged claim: text, conditions, queries, pool, difference better − worse, its interval (×100), p, the
    verdict, then the family-corrected p (Holm), interval (Bonferroni level, ×100) and verdict."""
    scaled = {"diff", "low", "high", "corrected_low", "corrected_high"}
    return list(VERDICT_COLUMNS), [[v["text"], *(100 * v[k] if k in scaled else v[k] for k in VERDICT_COLUMNS[1:])]
                                   for v in summary["verdicts"]]


def log_summary(run_logger: RunLogger, summary: dict[str, Any], prefix: str = "ablation") -> None:
    """The summary's tables in W&B (no-op without it): per pool the scores and the differences, then the verdicts."""
    for pool in summary["pools"]:
        run_logger.table(f"{prefix}/{pool}/ndcg@5", *score_rows(summary, pool))
        run_logger.table(f"{prefix}/{pool}/vs_baseline", *difference_rows(summary, pool))
    run_logger.table(f"{prefix}/verdicts", *verdict_rows(summary))


def _verdict_lines(summary: dict[str, Any]) -> list[str]:
    if not summary["verdicts"]:
        return []
    first = summary["verdicts"][0]
    confidence, corrected = 100 * summary["confidence"], 100 * first["corrected_confidence"]
    lines = ["## Verdicts on the paper's claims\n",
             f"Difference better − worse ×100 [{confidence:g}% {CROSSED_SCHEME}] and its two-sided t p. Rule: "
             f"{VERDICT_RULE}; margin (smallest effect of interest) {100 * summary['margin']:g} nDCG@5 points. "
             f"Multiple comparisons: {CORRECTION}, over this table's m = {first['family_size']} verdicts "
             f"(alpha {1 - summary['confidence']:g}: corrected intervals at {corrected:.4g}%); the corrected verdict "
             "is the one to quote.\n",
             _header(["claim", "queries", "pool", "difference", "p", "verdict", "Holm p", "corrected interval",
                      "corrected verdict"])]
    for (text, better, worse, evidence, pool, diff, low, high, p, result, p_holm, corrected_low, corrected_high,
         corrected_result) in verdict_rows(summary)[1]:
        lines.append(f"| {text} (`{better}` vs `{worse}`) | {evidence} | {pool} | "
                     f"{diff:+.1f} [{low:+.1f}, {high:+.1f}] | {p_text(p)} | {result} | {p_text(p_holm)} | "
                     f"[{corrected_low:+.1f}, {corrected_high:+.1f}] | **{corrected_result}** |")
    return [*lines, ""]


def p_text(p: float) -> str:
    """A p-value in a table: two significant digits, ``< 1e-4`` below that (a t p-value can be 1e-300)."""
    return f"{p:.2g}" if p >= 1e-4 else "< 1e-4"


def _curve_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for pool, by_evidence in summary["curves"].items():
        curves = by_evidence.get(ALL, {})
        if not curves:
            continue
        lines += [f"## Learning curves, pool `{pool}`, all queries (nDCG@5 ×100, mean ± std over seeds)\n",
                  _header(["loss", "steps", "first", "last", "change over the last interval"])]
        for condition, curve in curves.items():
            lines.append(f"| {condition} | {curve['steps'][0]}–{curve['steps'][-1]} ({len(curve['steps'])} points) | "
                         f"{100 * curve['mean'][0]:.1f} ± {100 * curve['std'][0]:.1f} | "
                         f"{100 * curve['mean'][-1]:.1f} ± {100 * curve['std'][-1]:.1f} | "
                         f"{100 * curve['last_change']:+.1f} |")
        lines.append("")
    return lines


def _header(columns: Sequence[str]) -> str:
    return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)


def plot(summary: dict[str, Any], pool: str = "single") -> bytes:
    """PNG: nDCG@5 (mean ± std over seeds) per evidence type and loss, and the mask shares over training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pool = pool if pool in summary["pools"] else summary["pools"][0]
    conditions, evidence = summary["conditions"], summary["evidence"]
    figure, (bars, curves, learning) = plt.subplots(1, 3, figsize=(16, 4))
    width = 0.8 / len(conditions)
    for i, condition in enumerate(conditions):
        values = [summary[METRIC][pool][e][condition] for e in evidence]
        bars.bar(np.arange(len(evidence)) + i * width, [100 * v["mean"] for v in values], width,
                 yerr=[100 * v["std"] for v in values], capsize=3, label=condition)
    bars.set_xticks(np.arange(len(evidence)) + width * (len(conditions) - 1) / 2, evidence)
    bars.set_ylabel("nDCG@5 ×100 (mean ± std over seeds)")
    bars.set_title(f"test retrieval, pool {pool}")
    bars.legend(fontsize=8)
    styles = dict(zip(MASK_SHARES, ("-", "--", ":")))
    for i, condition in enumerate(conditions):
        masks = summary["masks"][condition]
        for key, label in MASK_SHARES.items():
            if masks:
                curves.plot(masks["steps"], masks["curve"][key], styles[key], color=f"C{i}",
                            label=f"{condition}: M_H={label}")
    curves.set_xlabel("training step")
    curves.set_ylabel("share of mask entries (positive pairs)")
    curves.set_title("hybrid mask over training")
    curves.legend(fontsize=6, ncol=2)
    for i, (condition, curve) in enumerate(summary["curves"].get(pool, {}).get(ALL, {}).items()):
        mean, std = 100 * np.array(curve["mean"]), 100 * np.array(curve["std"])
        learning.plot(curve["steps"], mean, color=f"C{i}", label=condition)
        learning.fill_between(curve["steps"], mean - std, mean + std, color=f"C{i}", alpha=0.2)
    learning.set_xlabel("training step")
    learning.set_ylabel("nDCG@5 ×100 (mean ± std over seeds)")
    learning.set_title(f"learning curves, pool {pool}")
    if summary["curves"].get(pool, {}).get(ALL):
        learning.legend(fontsize=8)
    figure.tight_layout()
    return png_bytes(figure)


def aggregate(folder: str | Path, out_dir: str | Path | None = None, by: str | Sequence[str] = "loss",
              seed_key: str = "trainer.seed", baseline: str = "infonce", finished_only: bool = False,
              margin: float = 0.01, datasets: Sequence[str] = ()) -> dict[str, Any]:
    """Summarise ``folder`` into ``ablation.json``, ``ablation.md``, ``ablation.png`` and the per-query scores
    behind them, ``ablation_per_query.jsonl`` (in ``out_dir``, default ``folder``); returns the summary."""
    runs = load_multirun(folder, by, seed_key, finished_only)
    summary = summarize(runs, baseline, margin=margin, datasets=datasets)
    out = Path(out_dir or folder)
    write_json(out / "ablation.json", summary)
    write_per_query(out / PER_QUERY_LINES, runs)
    text = markdown(summary, str(folder))
    write_text(out / "ablation.md", text)
    write_bytes(out / "ablation.png", plot(summary))
    print(text)
    run_logger = RunLogger.from_defaults(out, f"ablation {Path(folder).name}", {
        "folder": str(folder), "by": by, "seed_key": seed_key, "baseline": baseline,
        "margin": margin, "datasets": list(datasets)})
    log_summary(run_logger, summary)
    run_logger.image("ablation/plot", out / "ablation.png")
    run_logger.artifact("ablation-report", "report", out, ["ablation.json", "ablation.md", "ablation.png",
                                                           PER_QUERY_LINES])
    run_logger.finish()
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a multirun folder: multirun/<run_name>/<stamp>")
    parser.add_argument("--out", type=Path, default=None, help="folder for ablation.{md,json,png} (default: folder)")
    parser.add_argument("--by", default="loss", help="override(s) that name the condition: a key, keys joined by "
                        "commas (loss,loss.alpha), or auto (every override that varies but the seed; default: loss)")
    parser.add_argument("--seed-key", default="trainer.seed", help="override that names the seed")
    parser.add_argument("--baseline", default="infonce", help="condition the others are compared with")
    parser.add_argument("--finished-only", action="store_true", help="skip jobs that have not finished (listed)")
    parser.add_argument("--margin", type=float, default=0.01,
                        help="smallest effect of interest in nDCG@5 for a 'not reproduced' verdict (default: 0.01)")
    parser.add_argument("--dataset", action="append", default=[], dest="datasets", metavar="NAME",
                        help="also a column of this data set's queries alone (repeat), e.g. --dataset synfine")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        by = args.by if args.by == "auto" or "," not in args.by else args.by.split(",")
        aggregate(args.folder, args.out, by, args.seed_key, args.baseline, args.finished_only,
                  args.margin, args.datasets)
    except AblationError as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()

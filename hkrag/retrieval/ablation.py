"""The Table-5 ablation from a Hydra multirun of ``train.py``: nDCG@5 per loss and evidence type, seeds and intervals.

    python train.py -m experiment=demo loss=hkrag,infonce,no_sin,no_din trainer.seed=0,1,2
    python -m hkrag.retrieval.ablation multirun/train/<stamp>              # writes ablation.{md,json,png} there

Each job folder of the multirun holds ``.hydra/overrides.yaml``, ``eval-after/per_query.json`` (every test
query's nDCG@5 and evidence label, written by :mod:`hkrag.retrieval.evaluation`) and ``metrics.jsonl`` (mask statistics
per step). A job's condition is the value of its ``--by`` override (default ``loss``), its seed that of
``--seed-key`` (default ``trainer.seed``). For every pool and evidence type (``salient``, ``fine_print``, and
all queries), the summary gives:

- **mean ± std over seeds** of the run's nDCG@5, averaged over its queries pooled across the data sets;
- **the difference to the baseline** (default ``infonce``, the paper's Eq. 3 baseline) with a **paired
  bootstrap** interval (:func:`hkrag.stats.paired_bootstrap`): queries are the resampled unit, each query's
  score averaged over the seeds both conditions ran (seeds matched), so the interval reflects which queries
  a loss wins or loses;
- **mask shares** of the positive pairs' hybrid mask (Eq. 2) equal to 1, ½ and 0, averaged over training
  steps and seeds, and their course over training in the plot.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from hkrag.io import write_bytes, write_json, write_text
from hkrag.retrieval.evaluation import AFTER_TRAINING_DIR, PER_QUERY_FILE
from hkrag.run_log import METRICS_FILE
from hkrag.stats import mean_and_std, paired_bootstrap

logger = logging.getLogger(__name__)

METRIC = "ndcg@5"
ALL = "all"
"""The evidence type that stands for every query."""
MASK_SHARES = {"mask/one": "1", "mask/half": "½", "mask/zero": "0"}
"""``metrics.jsonl`` keys logged by :func:`hkrag.losses.mask_statistics` and their mask values."""


class AblationError(ValueError):
    """A multirun folder that cannot be aggregated; the message names the folder or job."""


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

    def query_scores(self, pool: str, evidence: str) -> dict[tuple[str, str], float]:
        """nDCG@5 of the queries of ``evidence`` (``all``: every query) in ``pool``."""
        return {key: value for key, (label, value) in self.scores.get(pool, {}).items()
                if evidence == ALL or label == evidence}


def overrides(job: Path) -> dict[str, str]:
    """``key=value`` overrides Hydra recorded for a job (``+``/``++`` prefixes dropped)."""
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        raise AblationError(f"{job} has no .hydra/overrides.yaml: is it a job folder of a Hydra multirun?")
    items = yaml.safe_load(path.read_text()) or []
    return dict(item.lstrip("+").split("=", 1) for item in items)


def load_run(job: Path, by: str = "loss", seed_key: str = "trainer.seed") -> Run:
    """Read one job folder; raises :class:`AblationError` naming what is missing."""
    chosen = overrides(job)
    for key in (by, seed_key):
        if key not in chosen:
            raise AblationError(f"{job}: no {key}=... override (overrides: {sorted(chosen)}); pass --by/--seed-key")
    per_query = job / AFTER_TRAINING_DIR / PER_QUERY_FILE
    if not per_query.is_file():
        raise AblationError(f"{job}: {per_query.relative_to(job)} is missing: did the run finish its evaluation?")
    scores: dict[str, dict[tuple[str, str], tuple[str | None, float]]] = {}
    for dataset, by_pool in json.loads(per_query.read_text()).items():
        for pool, by_query in by_pool.items():
            for query_id, entry in by_query.items():
                scores.setdefault(pool, {})[(dataset, query_id)] = (entry["evidence"], float(entry[METRIC]))
    metrics = job / METRICS_FILE
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    masks = [{"step": row["step"], **{k: row[k] for k in MASK_SHARES}} for row in rows if "mask/one" in row]
    return Run(job, chosen[by], int(chosen[seed_key]), scores, masks)


def load_multirun(
    folder: str | Path, by: str = "loss", seed_key: str = "trainer.seed", finished_only: bool = False
) -> list[Run]:
    """Every job folder (``0``, ``1``, …) of a multirun, in job order.

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
    runs = [load_run(job, by, seed_key) for job in jobs]
    seen: dict[tuple[str, int], Path] = {}
    for run in runs:
        if (run.condition, run.seed) in seen:
            raise AblationError(f"{run.path} repeats {by}={run.condition} {seed_key}={run.seed} of "
                                f"{seen[run.condition, run.seed]}")
        seen[run.condition, run.seed] = run.path
    return runs


def evidence_types(runs: Sequence[Run]) -> list[str]:
    """``all`` then the evidence labels the queries carry, sorted."""
    labels = {label for run in runs for by_query in run.scores.values() for label, _ in by_query.values() if label}
    return [ALL, *sorted(labels)]


def run_mean(run: Run, pool: str, evidence: str) -> float:
    scores = run.query_scores(pool, evidence)
    return float(np.mean(list(scores.values()))) if scores else float("nan")


def seed_averaged(runs: Sequence[Run], pool: str, evidence: str) -> dict[tuple[str, str], float]:
    """Each query's score averaged over ``runs`` (one condition, the matched seeds)."""
    per_run = [run.query_scores(pool, evidence) for run in runs]
    keys = per_run[0].keys()
    for run, scores in zip(runs, per_run):
        if scores.keys() != keys:
            raise AblationError(f"{run.path} scored other {pool}/{evidence} queries than {runs[0].path}")
    return {key: float(np.mean([scores[key] for scores in per_run])) for key in keys}


def summarize(
    runs: Sequence[Run], baseline: str = "infonce", confidence: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """Means, stds, paired-bootstrap differences to ``baseline`` and mask shares (see the module docstring)."""
    conditions = list(dict.fromkeys(run.condition for run in runs))
    if baseline not in conditions:
        raise AblationError(f"baseline {baseline!r} is not among the conditions {conditions}; pass --baseline")
    conditions.remove(baseline)
    conditions.insert(0, baseline)
    by_condition = {c: sorted((r for r in runs if r.condition == c), key=lambda r: r.seed) for c in conditions}
    pools = list(dict.fromkeys(pool for run in runs for pool in run.scores))
    evidence = evidence_types(runs)
    summary: dict[str, Any] = {"baseline": baseline, "conditions": conditions, "pools": pools, "evidence": evidence,
                               "seeds": {c: [r.seed for r in rs] for c, rs in by_condition.items()},
                               "confidence": confidence, "n_resamples": n_resamples, METRIC: {}, "vs_baseline": {}}
    for pool in pools:
        for label in evidence:
            for condition, group in by_condition.items():
                per_seed = [run_mean(run, pool, label) for run in group]
                mean, std = mean_and_std(per_seed)
                summary[METRIC].setdefault(pool, {}).setdefault(label, {})[condition] = {
                    "mean": mean, "std": std, "per_seed": per_seed,
                    "num_queries": len(group[0].query_scores(pool, label))}
                if condition != baseline:
                    summary["vs_baseline"].setdefault(pool, {}).setdefault(label, {})[condition] = _versus(
                        group, by_condition[baseline], pool, label, confidence, n_resamples, seed)
    summary["masks"] = {c: mask_summary(rs) for c, rs in by_condition.items()}
    return summary


def _versus(runs: Sequence[Run], base: Sequence[Run], pool: str, evidence: str, confidence: float,
            n_resamples: int, seed: int) -> dict[str, Any]:
    """Paired bootstrap of ``runs`` against ``base`` over queries, on the seeds both have."""
    seeds = sorted({r.seed for r in runs} & {r.seed for r in base})
    if not seeds:
        raise AblationError(f"{runs[0].condition} and {base[0].condition} share no seed")
    a = seed_averaged([r for r in runs if r.seed in seeds], pool, evidence)
    b = seed_averaged([r for r in base if r.seed in seeds], pool, evidence)
    if a.keys() != b.keys():
        raise AblationError(f"{runs[0].condition} and {base[0].condition} scored other {pool}/{evidence} queries")
    keys = sorted(a)
    result = paired_bootstrap([a[k] for k in keys], [b[k] for k in keys], confidence, n_resamples, seed)
    return {**result, "seeds": seeds, "num_queries": len(keys)}


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
        table = summary[METRIC][pool]
        lines += [f"## nDCG@5, pool `{pool}`\n", _header(["loss", *evidence])]
        for condition in summary["conditions"]:
            cells = [f"{100 * table[e][condition]['mean']:.1f} ± {100 * table[e][condition]['std']:.1f}"
                     for e in evidence]
            lines.append(f"| {condition} | " + " | ".join(cells) + " |")
        counts = ", ".join(f"{e}: {table[e][baseline]['num_queries']}" for e in evidence)
        lines += [f"\nQueries: {counts}.\n"]
        confidence = round(100 * summary["confidence"])
        lines += [f"Difference to `{baseline}` ×100 [paired bootstrap {confidence}% interval over queries, "
                  f"scores averaged over matched seeds] (two-sided bootstrap p):\n", _header(["loss", *evidence])]
        for condition in summary["conditions"][1:]:
            cells = []
            for e in evidence:
                d = summary["vs_baseline"][pool][e][condition]
                cells.append(f"{100 * d['diff']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}] "
                             f"(p={d['p_value']:.2f})")
            lines.append(f"| {condition} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Mask shares of the positive pairs over training (Eq. 2), mean over steps and seeds\n",
              _header(["loss", *(f"M_H = {v}" for v in MASK_SHARES.values())])]
    for condition, masks in summary["masks"].items():
        cells = [f"{masks['mean'][k]:.3f}" for k in MASK_SHARES] if masks else ["–"] * len(MASK_SHARES)
        lines.append(f"| {condition} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _header(columns: Sequence[str]) -> str:
    return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)


def plot(summary: dict[str, Any], pool: str = "single") -> bytes:
    """PNG: nDCG@5 (mean ± std over seeds) per evidence type and loss, and the mask shares over training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pool = pool if pool in summary["pools"] else summary["pools"][0]
    conditions, evidence = summary["conditions"], summary["evidence"]
    figure, (bars, curves) = plt.subplots(1, 2, figsize=(11, 4))
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
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    plt.close(figure)
    return buffer.getvalue()


def aggregate(folder: str | Path, out_dir: str | Path | None = None, by: str = "loss", seed_key: str = "trainer.seed",
              baseline: str = "infonce", n_resamples: int = 2000, finished_only: bool = False) -> dict[str, Any]:
    """Summarise ``folder`` into ``ablation.json``, ``ablation.md`` and ``ablation.png`` (in ``out_dir``, default
    ``folder``); returns the summary."""
    runs = load_multirun(folder, by, seed_key, finished_only)
    summary = summarize(runs, baseline, n_resamples=n_resamples)
    out = Path(out_dir or folder)
    write_json(out / "ablation.json", summary)
    text = markdown(summary, str(folder))
    write_text(out / "ablation.md", text)
    write_bytes(out / "ablation.png", plot(summary))
    print(text)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a multirun folder: multirun/<run_name>/<stamp>")
    parser.add_argument("--out", type=Path, default=None, help="folder for ablation.{md,json,png} (default: folder)")
    parser.add_argument("--by", default="loss", help="override that names the condition (default: loss)")
    parser.add_argument("--seed-key", default="trainer.seed", help="override that names the seed")
    parser.add_argument("--baseline", default="infonce", help="condition the others are compared with")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default: 2000)")
    parser.add_argument("--finished-only", action="store_true", help="skip jobs that have not finished (listed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        aggregate(args.folder, args.out, args.by, args.seed_key, args.baseline, args.resamples, args.finished_only)
    except AblationError as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()

"""The CPU demo (``python train.py``) over seeds and ATen CPU kernel paths: the range the README states.

    python bench/demo_range.py --out outputs/demo_range --seeds 42 0 1 2 3 --kernels native avx2 default
    python bench/demo_range.py --summarize docs/demo_range        # re-derive the table from committed per-query data

Each run is the demo, ``python train.py``, with ``trainer.seed`` and ``ATEN_CPU_CAPABILITY`` set (``native``: unset,
the CPU's best), one at a time; a finished run (its ``report.json``) is kept, so a rerun resumes. The summary
(``demo_range.md`` / ``.json`` in ``--report``) gives, per README demo-table cell
(:func:`hkrag.tasks.training.demo_figures`), the range over every run, over seeds per kernel path and over kernel
paths at the demo's seed 42; where the training losses of two kernel paths part; and the steps where the loss jumps.
Each run's per-query nDCG@5 before and after training is copied (gzipped) beside the summary, and the summary is
computed from those copies alone.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from hkrag.environment import describe, environment
from hkrag.io import write_bytes, write_json, write_text
from hkrag.tasks.training import DEMO_COLUMNS, DEMO_ROWS, demo_cell, demo_figures_from_per_query

ROOT = Path(__file__).resolve().parents[1]
JUMP_FACTOR = 1.5
"""A step's loss "jumps" when it exceeds this factor times the median of the ten steps before it."""


def run_demo(run: Path, seed: int, kernel: str) -> float | None:
    """Train the demo into ``run`` under ``kernel`` unless it is finished; its wall seconds (None when kept)."""
    if (run / "report.json").is_file():
        return None
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if kernel != "native":
        env["ATEN_CPU_CAPABILITY"] = kernel
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "train.py"), f"trainer.seed={seed}", f"hydra.run.dir={run}"],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def losses(run: Path) -> list[float]:
    """The training loss per step from the run's ``metrics.jsonl``."""
    rows = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip())
    return [row["loss"] for row in rows if "loss" in row and "step" in row]


def jumps(values: list[float], factor: float = JUMP_FACTOR) -> list[int]:
    """1-based steps whose loss exceeds ``factor`` times the median of the ten steps before it."""
    return [i + 1 for i in range(10, len(values)) if values[i] > factor * statistics.median(values[i - 10:i])]


def parting_step(a: list[float], b: list[float], tol: float = 1e-4) -> int | None:
    """The first 1-based step where two loss curves differ by more than ``tol`` relative (None: never)."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > tol * max(abs(x), 1e-12)), None)


def collect(runs_dir: Path, report: Path, seeds: Iterable[int], kernels: Iterable[str]) -> None:
    """Copy each finished run's per-query data, environment and loss curve into ``report`` (compact, gzipped)."""
    for kernel in kernels:
        for seed in seeds:
            run = runs_dir / kernel / f"seed{seed}"
            if not (run / "report.json").is_file():
                continue
            record = {"kernel": kernel, "seed": seed,
                      "environment": json.loads((run / "report.json").read_text()).get("environment"),
                      "loss": losses(run),
                      **{when: json.loads((run / f"eval-{when}" / "per_query.json").read_text())
                         for when in ("before", "after")}}
            write_bytes(report / "runs" / f"{kernel}-seed{seed}.json.gz",
                        gzip.compress(json.dumps(record).encode(), mtime=0))


def load_runs(report: Path) -> list[dict]:
    return [json.loads(gzip.decompress(path.read_bytes())) for path in sorted((report / "runs").glob("*.json.gz"))]


def summarize(report: Path) -> dict:
    """The README table's ranges and the loss diagnostics from ``report/runs``; writes demo_range.{json,md}."""
    runs = load_runs(report)
    if not runs:
        raise SystemExit(f"no runs under {report / 'runs'}: run the sweep first")
    for run in runs:
        run["figures"] = {when: demo_figures_from_per_query(run[when]) for when in ("before", "after")}
    kernels = sorted({r["kernel"] for r in runs}, key=lambda k: ("native", "avx2", "default").index(k))
    cells = [(row, col) for row in DEMO_ROWS for col in DEMO_COLUMNS]

    def values(selected: list[dict], row: str, col: str) -> list[float]:
        when, pool = DEMO_COLUMNS[col]
        return [r["figures"][when][pool][row] for r in selected]

    by_seed = {(r["kernel"], r["seed"]): r for r in runs}
    parts = {f"{k} vs native, seed {s}": parting_step(by_seed[("native", s)]["loss"], r["loss"])
             for (k, s), r in by_seed.items() if k != "native" and ("native", s) in by_seed}
    summary = {
        "runs": [{"kernel": r["kernel"], "seed": r["seed"], "environment": r["environment"], "figures": r["figures"],
                  "loss_jumps": jumps(r["loss"]), "final_loss": r["loss"][-1]} for r in runs],
        "range_all": {f"{row} | {col}": demo_cell(values(runs, row, col)) for row, col in cells},
        "range_by_kernel": {k: {f"{row} | {col}": demo_cell(values([r for r in runs if r["kernel"] == k], row, col))
                                for row, col in cells} for k in kernels},
        "loss_parts_at_step": parts,
        "jump_rule": f"loss > {JUMP_FACTOR} x median of the previous 10 steps",
    }
    write_json(report / "demo_range.json", summary)
    write_text(report / "demo_range.md", render(summary, kernels))
    return summary


def render(summary: dict, kernels: list[str]) -> str:
    seeds = ", ".join(str(seed) for seed in dict.fromkeys(r["seed"] for r in summary["runs"]))
    header = "| queries | " + " | ".join(DEMO_COLUMNS) + " |\n" + "|---" * (len(DEMO_COLUMNS) + 1) + "|"
    lines = ["# The CPU demo over seeds and kernel paths", "",
             f"{len(summary['runs'])} runs of the demo, `python train.py`, one per `trainer.seed` ({seeds}) and "
             f"`ATEN_CPU_CAPABILITY` ({', '.join(kernels)}; `native`: unset); nDCG@5 x100, min–max.", "",
             "## Every run", "", header]
    lines += [f"| {row} | " + " | ".join(summary["range_all"][f"{row} | {col}"] for col in DEMO_COLUMNS) + " |"
              for row in DEMO_ROWS]
    for kernel in kernels:
        lines += ["", f"## Kernel path `{kernel}`, over seeds", "", header]
        lines += [f"| {row} | " + " | ".join(summary["range_by_kernel"][kernel][f"{row} | {col}"]
                                             for col in DEMO_COLUMNS) + " |" for row in DEMO_ROWS]
    lines += ["", "## Each run (synfine after training, single / all; loss jumps)", "",
              "| kernel | seed | ATen | synfine after, single | synfine after, all | styles after, single | "
              "final loss | loss jumps at steps |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        after = r["figures"]["after"]
        cap = (r["environment"] or {}).get("cpu_capability", "?")
        lines.append(f"| {r['kernel']} | {r['seed']} | {cap} | {after['single'][DEMO_ROWS[3]]:.1f} | "
                     f"{after['all'][DEMO_ROWS[3]]:.1f} | {after['single'][DEMO_ROWS[2]]:.1f} | "
                     f"{r['final_loss']:.3f} | {', '.join(map(str, r['loss_jumps'])) or 'none'} |")
    lines += ["", "## Where the kernel paths' training losses part (first step, relative difference > 1e-4)", ""]
    lines += [f"- {name}: step {step}" for name, step in summary["loss_parts_at_step"].items()]
    env = next((r["environment"] for r in summary["runs"] if r["kernel"] == "native" and r["environment"]), None)
    lines += ["", f"Machine (`native` runs; each run's ATen kernel path is in the table above): "
              f"{describe(env or environment())}", f"Jump rule: {summary['jump_rule']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/demo_range"), help="run folders: <kernel>/seed<S>")
    parser.add_argument("--report", type=Path, default=ROOT / "docs" / "demo_range", help="summary and per-query data")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 0, 1, 2, 3])
    parser.add_argument("--kernels", nargs="+", default=["native", "avx2", "default"],
                        choices=["native", "avx512", "avx2", "default"], help="ATEN_CPU_CAPABILITY values")
    parser.add_argument("--summarize", type=Path, help="only re-derive the summary from this report folder's runs/")
    args = parser.parse_args()
    if args.summarize:
        summary = summarize(args.summarize)
        print(render(summary, sorted(summary["range_by_kernel"])))
        return
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds repeats a seed: {args.seeds}")
    for kernel in args.kernels:
        for seed in args.seeds:
            seconds = run_demo(args.out / kernel / f"seed{seed}", seed, kernel)
            if seconds is not None:
                print(f"{kernel} seed {seed}: {seconds:.0f} s", flush=True)
    collect(args.out, args.report, args.seeds, args.kernels)
    summary = summarize(args.report)
    print(render(summary, sorted(summary["range_by_kernel"])))


if __name__ == "__main__":
    main()

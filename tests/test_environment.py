"""The machine record beside every report, and the README demo table's figures from a report."""

import json
import os
import subprocess
import sys

import pytest

from hkrag.environment import ENVIRONMENT_FILE, describe, environment, record_environment
from hkrag.tasks.training import DEMO_ROWS, demo_figures, demo_figures_from_per_query


def test_environment_names_kernel_path_and_versions(tmp_path):
    env = record_environment(tmp_path)
    assert json.loads((tmp_path / ENVIRONMENT_FILE).read_text()) == env
    assert env["libraries"]["torch"].startswith("2.")
    assert {"transformers", "peft", "numpy", "faiss-cpu"} <= set(env["libraries"])
    line = describe(env)
    assert f"ATen {env['cpu_capability']}" in line and f"torch {env['libraries']['torch']}" in line


def test_environment_records_the_aten_override():
    code = "import json; from hkrag.environment import environment; print(json.dumps(environment()))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                         capture_output=True, text=True, check=True).stdout
    env = json.loads(out)
    assert env["cpu_capability"] == "DEFAULT" and env["aten_cpu_capability_env"] == "default"
    assert environment()["aten_cpu_capability_env"] == os.environ.get("ATEN_CPU_CAPABILITY")


def _results(values):
    """An evaluation's results: style i has fine-print nDCG@5 values[i], salient values[i] / 2, all their mean."""
    results = {}
    for i, name in enumerate(("synchart", "synslide", "syntable", "syninfo")):
        fine, salient = values[i], values[i] / 2
        pool = {"fine_print": {"ndcg@5": fine}, "salient": {"ndcg@5": salient},
                "all": {"ndcg@5": (fine + salient) / 2}}
        results[name] = {"single": pool, "all": pool}
    results["synfine"] = {"single": {"all": {"ndcg@5": 0.9}}, "all": {"all": {"ndcg@5": 0.25}}}
    return results


def test_demo_figures_average_the_four_styles():
    figures = demo_figures(_results([0.2, 0.4, 0.6, 0.8]))
    assert figures["single"][DEMO_ROWS[0]] == pytest.approx(50.0)  # (20 + 40 + 60 + 80) / 4
    assert figures["single"][DEMO_ROWS[1]] == pytest.approx(25.0)
    assert figures["all"][DEMO_ROWS[2]] == pytest.approx(37.5)
    assert figures["single"][DEMO_ROWS[3]] == pytest.approx(90.0) and figures["all"][DEMO_ROWS[3]] == 25.0


def test_demo_figures_from_per_query_are_query_means():
    rows = {"q1": {"evidence": "fine_print", "ndcg@5": 1.0}, "q2": {"evidence": "fine_print", "ndcg@5": 0.5},
            "q3": {"evidence": "salient", "ndcg@5": 0.0}}
    per_query = {name: {"single": rows, "all": rows} for name in ("synchart", "synslide", "syntable", "syninfo")}
    per_query["synfine"] = {"single": {"f": {"evidence": "fine_print", "ndcg@5": 0.4}},
                            "all": {"f": {"evidence": "fine_print", "ndcg@5": 0.1}}}
    figures = demo_figures_from_per_query(per_query)
    assert figures["single"][DEMO_ROWS[0]] == pytest.approx(75.0)
    assert figures["single"][DEMO_ROWS[1]] == pytest.approx(0.0)
    assert figures["single"][DEMO_ROWS[2]] == pytest.approx(50.0)  # (1 + 0.5 + 0) / 3
    assert figures["all"][DEMO_ROWS[3]] == pytest.approx(10.0)

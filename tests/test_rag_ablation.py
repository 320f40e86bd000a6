"""hkrag.rag.ablation (Table 6) on hand-built outcomes: paired differences, verdicts, routes and cost by hand."""

import pytest

from hkrag.rag.ablation import generator_ablation, markdown
from hkrag.rag.records import QueryOutcome
from hkrag.stats import paired_bootstrap

CORRECT = {  # generator -> which of the four queries it answers right (relaxed accuracy 1 or 0)
    "single_pass": (1, 0, 0, 0),
    "no_pruner": (1, 0, 0, 0),
    "no_decoupler": (1, 1, 0, 0),
    "hkrag": (1, 1, 1, 1),
}


def outcome(name: str, index: int, right: int) -> QueryOutcome:
    return QueryOutcome(query_id=f"q{index}", question="?", gold=["42"], dataset="synchart", pool="gold",
                        route="HQP" if name == "hkrag" and index % 2 else "LQP", answer="42" if right else "7",
                        metrics={"relaxed_accuracy": float(right)})


RUNS = {name: [outcome(name, i, right) for i, right in enumerate(values)] for name, values in CORRECT.items()}


def test_paired_differences_and_verdicts_equal_hand_computed_values():
    summary = generator_ablation(RUNS, n_resamples=500)
    rows = summary["rows"]
    assert summary["num_queries"] == 4 and list(rows) == list(CORRECT)
    assert rows["hkrag"]["value"] == 1.0 and rows["single_pass"]["value"] == 0.25
    assert {k: v for k, v in rows["hkrag"]["routes"].items() if v} == {"HQP": 0.5, "LQP": 0.5}
    assert rows["hkrag"]["vs_baseline"] == paired_bootstrap([1, 1, 1, 1], [1, 0, 0, 0], n_resamples=500)
    assert "vs_baseline" not in rows["single_pass"]
    verdicts = {(v["better"], v["worse"]): v for v in summary["verdicts"]}
    assert verdicts["no_pruner", "single_pass"]["verdict"] == "not reproduced"  # identical answers: [0, 0]
    assert verdicts["hkrag", "no_decoupler"]["diff"] == pytest.approx(0.5)
    # +1 on three queries of four: a resample of the one tie alone has chance 1/256 < 2.5 %, so the interval
    # lies above 0; +1 on two of four: resamples of ties only have chance 1/16 > 2.5 %, the interval reaches 0
    assert verdicts["hkrag", "single_pass"]["verdict"] == "reproduced"
    assert verdicts["hkrag", "no_decoupler"]["verdict"] == "inconclusive"
    text = markdown(summary, "gold pages")
    assert "| hkrag | 100.0 [" in text and "| 50% | 50% |" in text.replace("| 0% ", "") and "**reproduced**" in text


def test_runs_on_other_queries_or_without_the_baseline_are_refused():
    with pytest.raises(ValueError, match="baseline 'single_pass' is not among the runs"):
        generator_ablation({"hkrag": RUNS["hkrag"]})
    with pytest.raises(ValueError, match="run 'hkrag' answered other queries than 'single_pass'"):
        generator_ablation({"single_pass": RUNS["single_pass"], "hkrag": RUNS["hkrag"][:3]})

"""The shipped layout detector (weights/layout_tiny, python -m hkrag.data.layout ship): its files are the ones its
manifest names, its settings are train's defaults, and (slow) its evaluation re-derives from the repository."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hkrag.data.layout import (
    BATCH_SIZE,
    LR,
    STEPS,
    THREADS,
    Detectors,
    evaluate_detector,
    load_detector,
    train_command,
)
from hkrag.data.regions import CLASSES
from hkrag.data.synthetic import DEMO, generate
from hkrag.tasks.ship import file_hashes

SHIPPED = Path(__file__).resolve().parents[1] / "weights" / "layout_tiny"
MANIFEST = json.loads((SHIPPED / "manifest.json").read_text())


def test_the_files_are_the_ones_the_manifest_names_and_small():
    assert file_hashes(SHIPPED) == MANIFEST["files"]
    assert sum((SHIPPED / name).stat().st_size for name in MANIFEST["files"]) < 3 * 2**20


def test_the_manifest_names_the_command_and_settings_of_the_defaults():
    report = json.loads((SHIPPED / "train_report.json").read_text())
    assert MANIFEST["config"] == {"corpus": "data/synthetic", "steps": STEPS, "batch_size": BATCH_SIZE, "lr": LR,
                                  "seed": 0, "threads": THREADS, "folds": 0}
    assert MANIFEST["command"] == train_command(report, "runs/layout") == (
        f"python -m hkrag.data.layout train data/synthetic --out runs/layout --steps {STEPS} --batch-size "
        f"{BATCH_SIZE} --lr {LR} --seed 0 --threads {THREADS}")
    assert report["steps"] == STEPS and report["train_pages"] == 960
    evaluation = json.loads((SHIPPED / "evaluation.json").read_text())
    assert evaluation["selected"]["pooled"] == MANIFEST["matching_iou"]
    assert evaluation["model"] == "weights/layout_tiny/model" and evaluation["split"] == "test"


def test_it_loads_with_scans_classes():
    model, _ = load_detector(SHIPPED / "model")
    assert sorted(model.config.id2label.values()) == sorted(CLASSES)
    assert sum(p.numel() for p in model.parameters()) == json.loads(
        (SHIPPED / "train_report.json").read_text())["parameters"]


def test_the_documented_relative_path_loads_it_from_any_folder(tmp_path, monkeypatch):
    """docs/data.md's `--model weights/layout_tiny/model` works outside the repository (README commands run from
    wherever a user runs them), for loading and for detect's detectors; a folder of that name here wins."""
    monkeypatch.chdir(tmp_path)
    model, _ = load_detector("weights/layout_tiny/model")
    assert sorted(model.config.id2label.values()) == sorted(CLASSES)
    assert Detectors("weights/layout_tiny/model").model == SHIPPED / "model"
    (tmp_path / "weights" / "layout_tiny" / "model").mkdir(parents=True)
    assert Detectors("weights/layout_tiny/model").model == Path("weights/layout_tiny/model")


@pytest.mark.slow
def test_its_evaluation_re_derives_from_the_repository(tmp_path):
    """The demo corpus drawn again (python -m hkrag.data.synthetic's defaults) and the shipped detector evaluated on
    its test split: the figures the manifest holds, to float32 rounding (the manifest's are an AMD EPYC's; an Intel
    Xeon's IoUs differ in the eighth digit), the counts exactly."""
    root = generate(tmp_path / "synthetic", DEMO).root
    shipped = json.loads((SHIPPED / "evaluation.json").read_text())
    result = evaluate_detector(root, SHIPPED / "model", shipped["split"])
    assert result["selected"] == pytest.approx(shipped["selected"], rel=1e-6)
    assert result["class_agreement"] == shipped["class_agreement"]
    assert result["boxes_per_page"] == shipped["boxes_per_page"]

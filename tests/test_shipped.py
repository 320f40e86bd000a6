"""The tiny reader shipped in weights/reader_tiny (python -m hkrag.tasks.ship): its manifest still matches what
train.py composes from the recorded command, its files are the ones the manifest names, and it loads as a run_dir
that scores the fine-print split as it did when it was trained."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from hkrag.tasks.common import CONF_DIR
from hkrag.tasks.retrieval import run_retrieval_evaluation
from hkrag.tasks.ship import MANIFEST_FILE, file_hashes, ship, training_config

SHIPPED = Path(__file__).resolve().parents[1] / "weights" / "reader_tiny"
MANIFEST = json.loads((SHIPPED / MANIFEST_FILE).read_text())


def test_the_manifest_matches_the_config_of_its_command():
    assert MANIFEST["command"] == "python train.py " + " ".join(MANIFEST["overrides"])
    assert "experiment=reader_tiny" in MANIFEST["overrides"]
    assert training_config(MANIFEST["overrides"]) == MANIFEST["config"]  # conf/ changed: retrain and ship again


def test_the_files_are_the_ones_the_manifest_names():
    assert file_hashes(SHIPPED) == MANIFEST["files"]
    assert sum((SHIPPED / name).stat().st_size for name in MANIFEST["files"]) < 10 * 2**20


def test_the_shipped_reader_scores_synfine_as_when_it_was_trained(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={tmp_path / 'eval'}",
                               f"run_dir={SHIPPED}", "data.eval_datasets=[synfine]", "eval.pools=[single]"])
    results = run_retrieval_evaluation(cfg, tmp_path / "eval")["results"]
    trained = MANIFEST["after"]["synfine"]["single"]["all"]["ndcg@5"]
    assert results["synfine"]["single"]["all"]["ndcg@5"] == pytest.approx(trained, abs=1e-6)
    assert trained > 3 * 0.123  # the target: three times random ranking's nDCG@5 in a 24-page pool


def test_shipping_needs_a_finished_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a finished tiny train.py run"):
        ship(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()

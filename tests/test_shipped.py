"""The tiny reader and generator shipped in weights/ (python -m hkrag.tasks.ship): their manifests still match what
train.py composes from the recorded commands, their files are the ones the manifests name, the reader loads as a
run_dir that scores the fine-print split as it did when it was trained, and the generator, served by lvlm=
phi3v_reader_tiny, answers the test questions as it did when it was shipped."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from hkrag.tasks.common import CONF_DIR
from hkrag.tasks.retrieval import run_retrieval_evaluation
from hkrag.tasks.ship import MANIFEST_FILE, file_hashes, ship, training_config

WEIGHTS = Path(__file__).resolve().parents[1] / "weights"
SHIPPED, GENERATOR = WEIGHTS / "reader_tiny", WEIGHTS / "generator_tiny"
MANIFEST = json.loads((SHIPPED / MANIFEST_FILE).read_text())
EXPERIMENTS = {SHIPPED: "reader_tiny", GENERATOR: "generator_reader_tiny"}


@pytest.mark.parametrize("shipped", EXPERIMENTS, ids=lambda path: path.name)
def test_the_manifest_matches_the_config_of_its_command(shipped):
    manifest = json.loads((shipped / MANIFEST_FILE).read_text())
    assert manifest["command"] == "python train.py " + " ".join(manifest["overrides"])
    assert f"experiment={EXPERIMENTS[shipped]}" in manifest["overrides"]
    assert training_config(manifest["overrides"]) == manifest["config"]  # conf/ changed: retrain and ship again


def test_the_files_are_the_ones_the_manifests_name():
    sizes = 0
    for shipped in EXPERIMENTS:
        manifest = json.loads((shipped / MANIFEST_FILE).read_text())
        assert file_hashes(shipped) == manifest["files"]
        sizes += sum((shipped / name).stat().st_size for name in manifest["files"])
    assert sizes < 10 * 2**20  # issue 23: weights and adapters together within 10 MB


def test_the_generator_starts_from_the_shipped_reader():
    config = json.loads((GENERATOR / MANIFEST_FILE).read_text())["config"]
    assert config["generator_training"]["init_from"] == "weights/reader_tiny"


def test_the_shipped_generator_answers_as_when_it_was_shipped(tmp_path):
    from hkrag.rag.trace import MERGED_FILE, load_trace
    from hkrag.tasks import run_eval_task
    from hkrag.tasks.chain import answer_rows

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={tmp_path / 'eval'}",
                               "task=generation", "generator=single_pass", "lvlm=phi3v_reader_tiny",
                               f"lvlm.base={GENERATOR / 'base'}",
                               f"lvlm.adapter={GENERATOR / 'checkpoints' / 'final' / 'adapter'}"])
    run_eval_task(cfg, tmp_path / "eval")
    rows = {r["questions"]: r for r in answer_rows([load_trace(tmp_path / "eval" / MERGED_FILE)], n_resamples=200)}
    shipped = json.loads((GENERATOR / MANIFEST_FILE).read_text())["answers"]["rows"]
    assert {r["questions"]: r["mean"] for r in shipped} == {name: r["mean"] for name, r in rows.items()}
    assert rows["code"]["mean"] > 3 / 8  # it reads reference codes: eight codes, chance 1/8


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

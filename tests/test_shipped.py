"""The tiny reader and generator shipped in weights/ (python -m hkrag.tasks.ship): their manifests still match what
train.py composes from the recorded commands, their files are the ones the manifests name, the reader loads as a
run_dir that scores the fine-print split as it did when it was trained, and the generator, served by lvlm=
phi3v_reader_tiny, answers the test questions as it did when it was shipped. Shipping records the run's own config,
never loses weights (refusals, --replace, an idempotent rerun), and a shipped folder whose files changed is refused
by every loader."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hkrag.models.phi3v.loading import ShippedFileMismatch, file_sha256, load_phi3v, load_processor
from hkrag.retriever import load_adapter
from hkrag.tasks.common import CONF_DIR, UNGROUNDED
from hkrag.tasks.retrieval import run_retrieval_evaluation
from hkrag.tasks.ship import MANIFEST_FILE, ShipRefused, file_hashes, ship, shipped_base_name, training_config

WEIGHTS = Path(__file__).resolve().parents[1] / "weights"
SHIPPED, GENERATOR = WEIGHTS / "reader_tiny", WEIGHTS / "generator_tiny"
AGENTS, DEFAULT = WEIGHTS / "generator_agents_tiny", WEIGHTS / "generator_agents_w128"
MANIFEST = json.loads((SHIPPED / MANIFEST_FILE).read_text())
EXPERIMENTS = {SHIPPED: "reader_tiny", GENERATOR: "generator_reader_tiny", AGENTS: "generator_agents_tiny",
               DEFAULT: "generator_agents_tiny"}


def as_shipped(composed: dict, shipped: dict) -> dict:
    """``composed`` without the settings ``conf/`` gained after ``shipped`` was made that leave a run's training
    unchanged: a model's ``head`` at ``dense`` and the late-interaction head's settings, which only that head reads
    (in ``model`` and in any nested model settings, e.g. the generator's retriever)."""
    out = {}
    for key, value in composed.items():
        if key in ("head", "late_interaction") and key not in shipped and composed.get("head") == "dense":
            continue
        out[key] = as_shipped(value, shipped[key]) if isinstance(value, dict) and isinstance(shipped.get(key), dict) \
            else value
    return out


@pytest.mark.parametrize("shipped", EXPERIMENTS, ids=lambda path: path.name)
def test_the_manifest_matches_the_config_of_its_command(shipped):
    manifest = json.loads((shipped / MANIFEST_FILE).read_text())
    assert manifest["command"] == "python train.py " + " ".join(manifest["overrides"])
    assert f"experiment={EXPERIMENTS[shipped]}" in manifest["overrides"]
    composed = as_shipped(training_config(manifest["overrides"]), manifest["config"])
    assert composed == manifest["config"]  # conf/ changed: retrain and ship again


def test_only_an_unchanged_head_is_read_as_shipped():
    shipped = {"model": {"kind": "tiny"}, "generator_training": {"retriever": {"model": {"kind": "tiny"}}}}
    dense = {"model": {"kind": "tiny", "head": "dense", "late_interaction": {"dim": 128}}, "generator_training": {
        "retriever": {"model": {"kind": "tiny", "head": "dense", "late_interaction": {"dim": 128}}}}}
    assert as_shipped(dense, shipped) == shipped
    late = {"model": {"kind": "tiny", "head": "late_interaction", "late_interaction": {"dim": 128}}}
    assert as_shipped(late, {"model": {"kind": "tiny"}}) == late


def test_the_files_are_the_ones_the_manifests_name():
    sizes = 0
    for shipped in EXPERIMENTS:
        manifest = json.loads((shipped / MANIFEST_FILE).read_text())
        assert file_hashes(shipped) == manifest["files"]
        sizes += sum((shipped / name).stat().st_size for name in manifest["files"])
    assert sizes < 10 * 2**20  # issue 23: weights and adapters together within 10 MB


@pytest.mark.parametrize("folder", EXPERIMENTS, ids=lambda folder: folder.name)
def test_a_shipped_adapter_names_no_base_outside_the_repository(folder):
    """PEFT reads ``base_model_name_or_path`` when it loads an adapter: a training run's own folder there (e.g. a
    stage-1 run under outputs/) is a path no user has, which PEFT warns about at every load."""
    config = json.loads((folder / "checkpoints" / "final" / "adapter" / "adapter_config.json").read_text())
    base = config["base_model_name_or_path"]
    assert base is None or (WEIGHTS.parent / base / "config.json").is_file(), f"{folder.name}: {base!r}"


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
                               f"lvlm.adapter={GENERATOR / 'checkpoints' / 'final' / 'adapter'}", UNGROUNDED])
    run_eval_task(cfg, tmp_path / "eval")
    rows = {r["questions"]: r for r in answer_rows([load_trace(tmp_path / "eval" / MERGED_FILE)])}
    shipped = json.loads((GENERATOR / MANIFEST_FILE).read_text())["answers"]["rows"]
    assert {r["questions"]: r["mean"] for r in shipped} == {name: r["mean"] for name, r in rows.items()}
    assert rows["code"]["mean"] > 3 / 8  # it reads reference codes: eight codes, chance 1/8


@pytest.mark.parametrize(("shipped", "lvlm"), [(AGENTS, "phi3v_agents_tiny"), (DEFAULT, "phi3v_agents_w128")],
                         ids=["generator_agents_tiny", "generator_agents_w128"])
def test_an_agents_generator_was_trained_on_every_step_and_answers_as_when_shipped(tmp_path, shipped, lvlm):
    """weights/generator_agents_tiny (docs/training.md "The agents' curriculum") and the default generator,
    weights/generator_agents_w128 (the ladder's w128-l2 on its 6,000-step reader, seed 0): HKRAG's agents on the
    gold pages, served by their lvlm config, answer the test questions as they did when they were shipped."""
    from agents.steps import STEPS
    from hkrag.rag.trace import MERGED_FILE, load_trace
    from hkrag.tasks import run_eval_task
    from hkrag.tasks.chain import answer_rows

    manifest = json.loads((shipped / MANIFEST_FILE).read_text())
    assert manifest["trained_steps"] == list(STEPS) and manifest["config"]["generator_training"]["curriculum"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={tmp_path / 'eval'}",
                               "task=generation", "generator=hkrag", f"lvlm={lvlm}", UNGROUNDED])
    assert cfg.lvlm.base == f"weights/{shipped.name}/base"
    run_eval_task(cfg, tmp_path / "eval")
    rows = {r["questions"]: r for r in answer_rows([load_trace(tmp_path / "eval" / MERGED_FILE)])}
    assert {r["questions"]: r["mean"] for r in manifest["answers"]["rows"]} == {n: r["mean"] for n, r in rows.items()}
    assert rows["label"]["mean"] > 3 / 8  # both read colours (eight, chance 1/8)


def test_the_width_64_agents_generator_reads_codes_and_the_default_does_not():
    """What the default's change costs (docs/training.md, "The shipped default generator"): on the gold pages the
    width-64 agents generator reads reference codes, the width-128 default at chance (eight codes, 1/8)."""
    def code(shipped: Path) -> float:
        rows = json.loads((shipped / MANIFEST_FILE).read_text())["answers"]["rows"]
        return next(r["mean"] for r in rows if r["questions"] == "code")

    assert code(AGENTS) > 3 / 8 and code(DEFAULT) < 2 / 8


def test_the_default_generator_is_the_ladders_w128_rung():
    """eval.py's default lvlm serves weights/generator_agents_w128, trained by the ladder's w128-l2 recipe on its
    6,000-step reader: the agents' experiment from that rung's stage 1, on the pages that rung's reader ranks."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [])
    assert cfg.lvlm.base == "weights/generator_agents_w128/base"
    overrides = json.loads((DEFAULT / MANIFEST_FILE).read_text())["overrides"]
    assert "generator_training.init_from=outputs/ladder_r6000/runs/w128-l2-stage1-s0" in overrides
    assert json.loads((DEFAULT / "base" / "config.json").read_text())["hidden_size"] == 128


def test_the_shipped_reader_scores_synfine_as_when_it_was_trained(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={tmp_path / 'eval'}",
                               f"run_dir={SHIPPED}", "data.eval_datasets=[synfine]", "eval.pools=[single]"])
    results = run_retrieval_evaluation(cfg, tmp_path / "eval")["results"]
    trained = MANIFEST["after"]["synfine"]["single"]["all"]["ndcg@5"]
    assert results["synfine"]["single"]["all"]["ndcg@5"] == pytest.approx(trained, abs=1e-6)
    assert trained > 3 * 0.123  # the target: three times random ranking's nDCG@5 in a 24-page pool


def test_shipping_needs_a_finished_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a finished tiny train.py run: it lacks base/config.json"):
        ship(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def run_config():
    """What train.py composes for ``experiment=reader_tiny`` (a run's .hydra/config.yaml, as Hydra saves it)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", ["experiment=reader_tiny"])


def fake_run(folder: Path, cfg, weights: bytes = b"weights") -> Path:
    """A finished tiny run as ship reads it: ``cfg`` as its config, ``weights`` standing in for its tensors."""
    for name, data in {"base/config.json": b"{}", "base/model.safetensors": weights, "report.json": b'{"steps": 3}',
                       "checkpoints/final/adapter/adapter_config.json": b"{}",
                       "checkpoints/final/adapter/adapter_model.safetensors": weights + b" adapter",
                       ".hydra/overrides.yaml": yaml.safe_dump(["experiment=reader_tiny"]).encode(),
                       ".hydra/config.yaml": OmegaConf.to_yaml(cfg).encode()}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}


def test_the_manifest_records_the_runs_own_config_not_todays_conf(tmp_path, run_config):
    cfg = run_config.copy()
    cfg.loss.tau = 0.123  # conf/ changed since the run: today it composes 0.05
    manifest = ship(fake_run(tmp_path / "run", cfg), tmp_path / "out")
    assert manifest["config"]["loss"]["tau"] == 0.123
    assert manifest["config"]["trainer"]["max_steps"] == 3000 and set(manifest["config"]) == {
        "model", "loss", "optim", "trainer", "data.synthetic", "data.train"}
    assert json.loads((tmp_path / "out" / MANIFEST_FILE).read_text()) == manifest
    assert manifest["files"] == file_hashes(tmp_path / "out")
    assert manifest["files"]["base/model.safetensors"] == file_sha256(tmp_path / "run" / "base" / "model.safetensors")
    assert set(manifest["files"]) == {"base/config.json", "base/model.safetensors",  # not .hydra/, report.json
                                      "checkpoints/final/adapter/adapter_config.json",
                                      "checkpoints/final/adapter/adapter_model.safetensors"}


def test_shipping_the_same_run_again_changes_nothing(tmp_path, run_config):
    run, out = fake_run(tmp_path / "run", run_config), tmp_path / "out"
    first = ship(run, out)
    before = snapshot(out)
    assert ship(run, out) == first
    assert snapshot(out) == before  # not rewritten: same bytes, same modification times


def test_shipping_refuses_to_overwrite_other_weights_unless_replace(tmp_path, run_config):
    out = tmp_path / "weights" / "reader_tiny"
    ship(fake_run(tmp_path / "a", run_config, b"model A"), out)
    shipped = snapshot(out)
    other = fake_run(tmp_path / "b", run_config, b"model B")
    with pytest.raises(ShipRefused, match=f"--out {out} already holds other weights \\(made by: python train.py "
                       "experiment=reader_tiny; 4 files\\).*Pass --replace"):
        ship(other, out)
    assert snapshot(out) == shipped and not list(out.parent.glob(".reader_tiny*"))  # no temporary folder left
    manifest = ship(other, out, replace=True)
    assert (out / "base" / "model.safetensors").read_bytes() == b"model B" and file_hashes(out) == manifest["files"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["reader_tiny"]


def test_a_damaged_shipment_is_refused_then_repaired_with_replace(tmp_path, run_config):
    run, out = fake_run(tmp_path / "run", run_config), tmp_path / "out"
    ship(run, out)
    (out / "base" / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(ShipRefused, match=f"--out {out} already holds this run's weights, but base/model.safetensors "
                       "no longer match its manifest"):
        ship(run, out)
    assert (out / "base" / "model.safetensors").read_bytes() == b"truncated"
    ship(run, out, replace=True)
    assert (out / "base" / "model.safetensors").read_bytes() == b"weights"


@pytest.mark.parametrize("where", ["the run", "above the run", "inside the run", "another folder", "a file"])
def test_shipping_never_deletes_the_run_or_a_folder_of_another_kind(tmp_path, run_config, where):
    run = fake_run(tmp_path / "runs" / "run", run_config)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("keep me")
    out = {"the run": run, "above the run": run.parent, "inside the run": run / "shipped",
           "another folder": tmp_path / "other", "a file": tmp_path / "file"}[where]
    before = snapshot(tmp_path)
    message = "overlaps the run it ships" if "run" in where else "exists and is not a folder of shipped weights"
    with pytest.raises(ShipRefused, match=f"--out {out} {message}"):
        ship(run, out, replace=True)
    assert snapshot(tmp_path) == before


def test_shipping_into_an_empty_folder(tmp_path, run_config):
    (tmp_path / "out").mkdir()
    manifest = ship(fake_run(tmp_path / "run", run_config), tmp_path / "out")
    assert file_hashes(tmp_path / "out") == manifest["files"]


def test_the_shipped_adapter_names_the_shipped_base_not_the_runs(tmp_path, run_config):
    run = fake_run(tmp_path / "run", run_config)
    (run / "checkpoints/final/adapter/adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(run / "base"), "r": 8}))
    manifest = ship(run, tmp_path / "out")
    config = json.loads((tmp_path / "out/checkpoints/final/adapter/adapter_config.json").read_text())
    assert config == {"base_model_name_or_path": str((tmp_path / "out" / "base").resolve()), "r": 8}
    assert file_hashes(tmp_path / "out") == manifest["files"]
    assert ship(run, tmp_path / "out") == manifest  # shipped intact: nothing to do
    assert shipped_base_name(WEIGHTS / "some_model") == "weights/some_model/base"


@pytest.fixture()
def copy_of_the_reader(tmp_path):
    return Path(shutil.copytree(SHIPPED, tmp_path / "reader_tiny"))


def test_the_shipped_copy_loads_intact(copy_of_the_reader):
    model = load_phi3v(copy_of_the_reader / "base", dtype="float32")
    load_adapter(model, copy_of_the_reader / "checkpoints" / "final" / "adapter")
    load_processor(copy_of_the_reader / "base")


@pytest.mark.parametrize("name", ["base/model.safetensors", "base/tokenizer.json",
                                  "checkpoints/final/adapter/adapter_model.safetensors"])
def test_a_shipped_file_that_changed_is_refused_naming_it_and_both_hashes(copy_of_the_reader, name):
    path = copy_of_the_reader / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    expected = MANIFEST["files"][name]
    actual = file_sha256(path)
    match = f"{path} has sha256 {actual}, but {copy_of_the_reader / MANIFEST_FILE} says sha256 {expected}"
    load = {"base": lambda: load_phi3v(copy_of_the_reader / "base", dtype="float32"),
            "checkpoints": lambda: load_adapter(load_phi3v(SHIPPED / "base", dtype="float32"), path.parent)}
    with pytest.raises(ShippedFileMismatch, match=match.replace("(", "\\(")):
        load[name.split("/")[0]]()
    if name.startswith("base/"):
        with pytest.raises(ShippedFileMismatch, match="git checkout --"):
            load_processor(copy_of_the_reader / "base")


def test_a_changed_shipped_folder_is_refused_as_run_dir_and_as_the_generator(copy_of_the_reader):
    from hkrag.lvlm.phi3v import Phi3VBackend
    from hkrag.tasks.common import build_retriever, evaluated_model

    adapter = copy_of_the_reader / "checkpoints" / "final" / "adapter"
    (adapter / "adapter_config.json").write_text("{}")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [f"run_dir={copy_of_the_reader}"])
    with pytest.raises(ShippedFileMismatch, match="adapter_config.json has sha256"):
        build_retriever(evaluated_model(cfg)[0], trainable=False)
    with pytest.raises(ShippedFileMismatch, match="adapter_config.json has sha256"):
        Phi3VBackend(base=str(copy_of_the_reader / "base"), adapter=str(adapter), device="cpu")


def test_a_refused_shipment_ends_the_command_with_the_reason(tmp_path, run_config, capsys):
    from hkrag.tasks.ship import main

    run, out = fake_run(tmp_path / "run", run_config), tmp_path / "out"
    main([str(run), "--out", str(out)])
    assert f"{out}: 4 files" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=f"--out {run} overlaps the run it ships"):
        main([str(run), "--out", str(run), "--replace"])


def test_a_missing_shipped_file_is_refused(copy_of_the_reader):
    (copy_of_the_reader / "base" / "tokenizer_config.json").unlink()
    with pytest.raises(ShippedFileMismatch, match="tokenizer_config.json is missing, but .* says sha256 8cfcafec"):
        load_processor(copy_of_the_reader / "base")


def test_a_train_py_run_ships_with_the_config_it_ran_with(tmp_path):
    from hkrag.tasks.replica import run_job

    overrides = ["experiment=reader_tiny", f"paths.data_dir={tmp_path / 'data'}", "data.synthetic.n_train=16",
                 "data.synthetic.n_test=8", "data.synthetic.train_groups_per_style=1",
                 "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "model.num_crops=4",
                 "trainer.global_batch_size=8", "trainer.max_steps=1", "eval_before_after=false"]
    run_job(tmp_path / "run", overrides)
    manifest = ship(tmp_path / "run", tmp_path / "out")
    assert manifest["command"] == "python train.py " + " ".join(overrides) and manifest["steps"] == 1
    assert manifest["config"] == training_config(overrides) and manifest["config"]["trainer"]["max_steps"] == 1
    model = load_phi3v(tmp_path / "out" / "base", dtype="float32")
    load_adapter(model, tmp_path / "out" / "checkpoints" / "final" / "adapter")

"""hkrag.tasks.pieces: a save keeps what a later sitting needs (the kept checkpoint, the run's own files, JSON lines
gzipped) and drops the rest; a restore puts it back byte for byte, keeps runs already there, and an interrupted
training run carried this way continues to the weights of an uninterrupted one."""

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch

from hkrag.tasks.pieces import MANIFEST_FILE, main, restore, save


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _checkpoint(run: Path, name: str) -> None:
    _write(run / "checkpoints" / name / "state.json", json.dumps({"step": name}))
    _write(run / "checkpoints" / name / "adapter" / "weights.bin", name)
    _write(run / "checkpoints" / name / "optimizer.pt", name)
    _write(run / "checkpoints" / name / "rng-0.pt", name)


def _ladder(out: Path) -> None:
    """A finished reader (final and two step checkpoints), an unfinished generator (two step checkpoints and a
    half-written temporary), and an answer run with a trace and an HTML view."""
    reader, generator, answers = (out / "runs" / name for name in ("r-reader-s0", "r-generator-s0", "r-gold-s0"))
    for run, steps in ((reader, (500, 1000)), (generator, (500, 1000))):
        for step in steps:
            _checkpoint(run, f"step-{step}")
        _write(run / "base" / "config.json", "{}")
        _write(run / ".hydra" / "overrides.yaml", "- a=1\n")
        _write(run / "pieces.json", "[12.5]")
        _write(run / "metrics.jsonl", '{"step": 1}\n{"step": 2}\n')
    _checkpoint(reader, "final")
    _write(reader / "report.json", "{}")
    _write(generator / "checkpoints" / "step-1500.tmp" / "adapter" / "weights.bin", "half")
    _write(answers / "trace.jsonl", '{"q": 1}\n')
    _write(answers / "rag.json", "{}")
    _write(answers / "rag.html", "<html/>")
    _write(out / "timings.json", "{}")
    _write(out / "ladder.html", "<html/>")


def _tree(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def test_a_save_keeps_the_needed_checkpoint_and_gzips_json_lines(tmp_path):
    _ladder(tmp_path / "out")
    names = save(tmp_path / "out", tmp_path / "saved")
    assert names == ["r-generator-s0", "r-gold-s0", "r-reader-s0"]
    saved = _tree(tmp_path / "saved")
    checkpoints = sorted({name.split("/")[3] for name in saved if "/checkpoints/" in name})
    assert checkpoints == ["final", "step-1000"]  # the reader's final, the generator's latest finished step
    assert "runs/r-reader-s0/checkpoints/final/state.json" in saved
    assert "runs/r-generator-s0/checkpoints/step-1000/adapter/weights.bin" in saved
    step = "runs/r-generator-s0/checkpoints/step-1000"
    assert {f"{step}/optimizer.pt", f"{step}/rng-0.pt"} <= saved.keys()  # what the unfinished run resumes from
    assert not any(name.startswith("runs/r-reader-s0/checkpoints/final/") and name.endswith(".pt") for name in saved)
    assert not any(name.endswith(".html") for name in saved)
    assert gzip.decompress(saved["runs/r-gold-s0/trace.jsonl.gz"]) == b'{"q": 1}\n'
    manifest = json.loads(saved[MANIFEST_FILE])
    assert sorted(manifest["gzipped"]) == ["runs/r-generator-s0/metrics.jsonl.gz", "runs/r-gold-s0/trace.jsonl.gz",
                                           "runs/r-reader-s0/metrics.jsonl.gz"]
    assert saved["timings.json"] == b"{}" and saved["runs/r-generator-s0/pieces.json"] == b"[12.5]"
    save(tmp_path / "out", tmp_path / "again")
    assert _tree(tmp_path / "again") == saved  # reproducible byte for byte (no gzip timestamp)


def test_a_restore_puts_back_what_was_saved_and_keeps_runs_already_there(tmp_path):
    _ladder(tmp_path / "out")
    save(tmp_path / "out", tmp_path / "saved")
    done = restore(tmp_path / "saved", tmp_path / "back")
    assert done == {"restored": ["r-generator-s0", "r-gold-s0", "r-reader-s0"], "kept": []}
    original, back = _tree(tmp_path / "out"), _tree(tmp_path / "back")
    dropped = {name for name in original if name.endswith(".html") or "step-500" in name or ".tmp" in name
               or name.startswith("runs/r-reader-s0/checkpoints/step-")
               or (name.startswith("runs/r-reader-s0/checkpoints/final/") and name.endswith(".pt"))}
    assert back == {name: data for name, data in original.items() if name not in dropped}

    _write(tmp_path / "back" / "runs" / "r-gold-s0" / "rag.json", '{"further": true}')
    shutil.rmtree(tmp_path / "back" / "runs" / "r-reader-s0")
    assert restore(tmp_path / "saved", tmp_path / "back") == {"restored": ["r-reader-s0"],
                                                               "kept": ["r-generator-s0", "r-gold-s0"]}
    assert (tmp_path / "back" / "runs" / "r-gold-s0" / "rag.json").read_text() == '{"further": true}'


def test_the_command_refuses_a_folder_without_runs_and_a_folder_that_is_no_save(tmp_path, capsys):
    (tmp_path / "empty" / "runs").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_:
        main(["save", str(tmp_path / "empty"), str(tmp_path / "saved")])
    assert exit_.value.code == 2 and "holds no runs" in capsys.readouterr().err
    assert not (tmp_path / "saved").exists()
    with pytest.raises(SystemExit):
        main(["restore", str(tmp_path / "empty"), str(tmp_path / "back")])
    assert f"has no {MANIFEST_FILE}" in capsys.readouterr().err


@pytest.mark.parametrize("dest", ["out", "out/runs/saved", ".", "docs"])
def test_a_save_never_replaces_its_own_folder_or_a_folder_that_is_no_save(tmp_path, dest):
    _ladder(tmp_path / "out")
    _write(tmp_path / "docs" / "README.md", "keep me")
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="overlap|not a pieces save"):
        save(tmp_path / "out", tmp_path / dest)
    assert _tree(tmp_path) == before
    save(tmp_path / "out", tmp_path / "saved")
    with pytest.raises(ValueError, match="overlap"):
        restore(tmp_path / "saved", tmp_path / "saved" / "runs")


def test_an_interrupted_run_carried_by_save_and_restore_continues_to_the_uninterrupted_weights(tmp_path):
    from safetensors.torch import load_file

    from hkrag.tasks.common import PIECES_FILE, run_job

    overrides = ["experiment=reader_tiny", f"paths.data_dir={tmp_path / 'data'}", "data.synthetic.n_train=16",
                 "data.synthetic.n_test=8", "data.synthetic.train_groups_per_style=1",
                 "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "model.num_crops=4",
                 "trainer.global_batch_size=8", "trainer.max_steps=4", "trainer.save_every=2",
                 "eval_before_after=false"]
    run_job(tmp_path / "whole", overrides)
    split = tmp_path / "first" / "runs" / "reader-s0"
    run_job(split, overrides)
    for done in ("report.json", "checkpoints/step-4", "checkpoints/final"):  # as if stopped after step 3
        shutil.rmtree(split / done) if (split / done).is_dir() else (split / done).unlink()
    save(tmp_path / "first", tmp_path / "saved")
    restore(tmp_path / "saved", tmp_path / "second")
    carried = tmp_path / "second" / "runs" / "reader-s0"
    run_job(carried, overrides)
    assert len(json.loads((carried / PIECES_FILE).read_text())) == 2
    whole = load_file(tmp_path / "whole" / "checkpoints" / "final" / "trainable.safetensors")
    resumed = load_file(carried / "checkpoints" / "final" / "trainable.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)

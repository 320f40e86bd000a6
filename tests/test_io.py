"""hkrag.io: a failed write leaves the previous file or folder intact and names the path."""

import argparse
import errno
import json
import re
from pathlib import Path

import pytest

from hkrag.cli import existing
from hkrag.io import (
    FileFormatError,
    WriteError,
    atomic_directory,
    atomic_write,
    read_jsonl,
    write_bytes,
    write_json,
    write_jsonl_gz,
    write_text,
)


def disk_full(f):
    f.write("partial")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_writes_land_under_the_real_name_without_leftovers(tmp_path):
    write_text(tmp_path / "a" / "note.txt", "hello")
    write_bytes(tmp_path / "b.bin", b"\x00\x01")
    write_json(tmp_path / "c.json", {"x": [1, 2]})
    assert (tmp_path / "a" / "note.txt").read_text() == "hello"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert json.loads((tmp_path / "c.json").read_text()) == {"x": [1, 2]}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b.bin", "c.json", "note.txt"]


def test_failed_write_keeps_the_previous_file_and_names_the_path(tmp_path):
    path = tmp_path / "corpus.parquet"
    path.write_text("previous")
    with pytest.raises(WriteError, match=f"could not write {path}: No space left on device") as info:
        atomic_write(path, disk_full)
    assert info.value.path == path and info.value.errno == errno.ENOSPC
    assert path.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.parquet"]


def test_a_file_where_the_folder_should_be_is_named_as_a_write_error(tmp_path):
    (tmp_path / "taken").write_text("a file")
    path = tmp_path / "taken" / "sub" / "x.json"
    with pytest.raises(WriteError, match=f"could not write {path}: Not a directory") as info:
        write_json(path, {"v": 1})
    assert info.value.errno == errno.ENOTDIR and (tmp_path / "taken").read_text() == "a file"


def test_non_os_error_propagates_as_is_and_keeps_the_previous_file(tmp_path):
    path = tmp_path / "x.json"
    write_json(path, {"v": 1})
    def bad_row(f):
        f.write('{"v": ')
        raise ValueError("row 3 cannot be encoded")

    with pytest.raises(ValueError, match="row 3"):
        atomic_write(path, bad_row)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_failed_directory_build_keeps_the_previous_folder(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(WriteError, match=f"could not write {target}"):
        with atomic_directory(target) as tmp:
            (tmp / "weights").write_text("v2-partial")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert (target / "weights").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    with atomic_directory(target) as tmp:
        (tmp / "weights").write_text("v2")
    assert (target / "weights").read_text() == "v2"


def test_read_jsonl_reads_what_write_jsonl_gz_wrote_and_names_a_damaged_archive(tmp_path):
    rows = [{"query_id": "q1", "p_yes": 0.25}, {"query_id": "q2", "p_yes": None}]
    path = write_jsonl_gz(tmp_path / "calls.jsonl.gz", rows)
    assert read_jsonl(path) == rows
    (tmp_path / "cut.jsonl.gz").write_bytes(path.read_bytes()[:-8])
    with pytest.raises(FileFormatError, match=r"cut\.jsonl\.gz.*not a readable gzip file"):
        read_jsonl(tmp_path / "cut.jsonl.gz")


def test_an_input_path_is_checked_as_argparse_parses_it(tmp_path):
    """:func:`existing`: the path back when it is there (a folder with what it must hold), else argparse's usage
    error naming the path and what is missing."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("a: 1\n")
    (tmp_path / "calls.jsonl.gz").write_bytes(b"")
    assert existing("dir", (".hydra/config.yaml",))(str(run)) == run
    assert existing()(str(tmp_path / "calls.jsonl.gz")) == tmp_path / "calls.jsonl.gz"
    for check, path, message in [
        (existing(), tmp_path / "nosuch.json", "nosuch.json: no such file"),
        (existing("dir"), tmp_path / "nosuch", "nosuch: no such folder"),
        (existing(), run, "run: a folder, not a file"),
        (existing("dir"), tmp_path / "calls.jsonl.gz", "calls.jsonl.gz: not a folder"),
        (existing("dir", ("rag_config.json", ".hydra/config.yaml"), "an eval.py run"), run,
         "run has no rag_config.json (is it an eval.py run?)"),
        (existing("dir", (Path("checkpoints") / "final" / "adapter",), "a shipped generator"), run,
         "run has no checkpoints/final/adapter (is it a shipped generator?)"),  # holding given as Paths
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            check(str(path))
    with pytest.raises(ValueError, match="kind='folder'"):
        existing("folder")


@pytest.mark.parametrize(("module", "argv", "message"), [
    ("hkrag.tasks.agent_steps", ["{missing}", "--out", "{out}"], "argument run: {missing}: no such folder"),
    ("hkrag.tasks.agent_steps", ["{tmp}", "--out", "{out}"], "argument run: {tmp} has no .hydra/config.yaml"),
    ("hkrag.tasks.reader_on_pruner_calls", ["{missing}", "--calls", "x", "--out", "{out}"],
     "argument run: {missing}: no such folder"),
    ("hkrag.retrieval.rerank_report", ["{missing}", "--qa-source", "q", "--datasets", "d", "--out", "{out}"],
     "argument trace: {missing}: no such file"),
    ("hkrag.rag.__main__", ["steps", "{tmp}"], "argument run_dir: {tmp} has no rag_config.json, trace.jsonl"),
    ("hkrag.rag.__main__", ["compare", "{missing}"], "argument run_dirs: {missing}: no such folder"),
])
def test_a_report_command_refuses_a_missing_input_before_any_work(tmp_path, capsys, module, argv, message):
    """The report commands name the argument and the path (a usage error, exit 2), not a traceback from deep in the
    run (``FileNotFoundError`` on ``.hydra/config.yaml`` after the imports)."""
    import importlib

    values = {"missing": str(tmp_path / "nosuch"), "tmp": str(tmp_path), "out": str(tmp_path / "out")}
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main([arg.format(**values) for arg in argv])
    assert exit_.value.code == 2
    assert message.format(**values) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

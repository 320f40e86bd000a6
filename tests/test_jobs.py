"""hkrag.tasks.common.run_jobs with needs: a chain's next job starts when its own previous one ends (not when a
whole stage does), finished needs are met already, needs naming no job or forming a cycle are refused. The jobs
here sleep instead of training; side by side they run in spawned processes, as the real ones do."""

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from hkrag.tasks.common import run_jobs
from hkrag.tasks.ladder import LadderConfig, needs, plan


def sleeper(folder: Path, overrides: list[str], config: str, done: str) -> float:
    """Sleep ``overrides[0]`` seconds, then until the file ``overrides[1]`` (if given) exists, for at most a minute;
    write the start and end times into the job's done file."""
    start = time.time()
    time.sleep(float(overrides[0]))
    while overrides[1:] and not Path(overrides[1]).exists() and time.time() < start + 60:
        time.sleep(0.05)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / done).write_text(f"{start} {time.time()}")
    return float(overrides[0])


def job(tmp_path: Path, name: str, seconds: float, until: Path | None = None) -> tuple:
    return tmp_path / name, [str(seconds)] + ([str(until)] if until else []), "train", "done"


def times(tmp_path: Path, name: str) -> tuple[float, float]:
    start, end = (tmp_path / name / "done").read_text().split()
    return float(start), float(end)


def test_a_chains_next_job_starts_when_its_own_need_ends(tmp_path):
    """Two chains a1 -> a2 and b1 -> b2, a1 running until b2 has finished: b2 starts as soon as b1 ends, while a1
    still runs; a stage barrier would have held it until a1 ended (a1 would then wait its full minute). No fixed
    sleep races the spawned workers' start-up, which a loaded machine can stretch to seconds."""
    jobs = [job(tmp_path, "a1", 0, until=tmp_path / "b2" / "done"), job(tmp_path, "b1", 0.2),
            job(tmp_path, "a2", 0.2), job(tmp_path, "b2", 0.2)]
    chains = {tmp_path / "a2": [tmp_path / "a1"], tmp_path / "b2": [tmp_path / "b1"]}
    order = [name for name, _ in run_jobs(jobs, workers=2, needs=chains, runner=sleeper)]
    assert order.index("b1") < order.index("b2") and order.index("a1") < order.index("a2")
    assert times(tmp_path, "b2")[1] < times(tmp_path, "a1")[1] < times(tmp_path, "a1")[0] + 60
    assert times(tmp_path, "a2")[0] >= times(tmp_path, "a1")[1] and times(tmp_path, "b2")[0] >= times(tmp_path, "b1")[1]


def test_in_turn_a_job_waits_for_its_needs_whatever_the_order_given(tmp_path):
    jobs = [job(tmp_path, "second", 0), job(tmp_path, "first", 0)]
    order = [name for name, _ in run_jobs(jobs, needs={tmp_path / "second": [tmp_path / "first"]}, runner=sleeper)]
    assert order == ["first", "second"]


def test_a_finished_need_is_met_already(tmp_path):
    (tmp_path / "first").mkdir()
    (tmp_path / "first" / "done").write_text("0 0")
    jobs = [job(tmp_path, "first", 0), job(tmp_path, "second", 0)]
    assert [name for name, _ in run_jobs(jobs, needs={tmp_path / "second": [tmp_path / "first"]},
                                         runner=sleeper)] == ["second"]


def test_needs_naming_no_job_or_forming_a_cycle_are_refused(tmp_path):
    jobs = [job(tmp_path, "a", 0), job(tmp_path, "b", 0)]
    with pytest.raises(ValueError, match="needs name folders that are no job's: .*elsewhere"):
        list(run_jobs(jobs, needs={tmp_path / "a": [tmp_path / "elsewhere"]}, runner=sleeper))
    with pytest.raises(ValueError, match="the jobs' needs form a cycle"):
        list(run_jobs(jobs, needs={tmp_path / "a": [tmp_path / "b"], tmp_path / "b": [tmp_path / "a"]},
                      runner=sleeper))
    assert not (tmp_path / "a").exists()  # refused before any job ran


def test_the_ladders_needs_are_its_chains(tmp_path):
    """Every ladder job but the readers needs its own size-seed's earlier jobs and nothing else: seed 1's reader
    waits for nothing, seed 0's generator for its stage 1 only."""
    config = LadderConfig(tmp_path, sizes=["w64-l2"], seeds=[0, 1], rerank=True)
    found = needs(config)
    folders = {job[0] for stage in plan(config, {"reader": 1, "generator": 1}).values() for job in stage}
    assert set(found) | {config.folder("w64-l2", "reader", s) for s in (0, 1)} == folders
    assert found[config.folder("w64-l2", "generator", 0)] == [config.folder("w64-l2", "stage1", 0)]
    assert found[config.folder("w64-l2", "rerank", 1)] == [config.folder("w64-l2", "generator", 1),
                                                            config.folder("w64-l2", "reader", 1)]
    assert config.folder("w64-l2", "reader", 1) not in found


def test_an_interrupted_training_run_continues_from_its_latest_checkpoint(tmp_path):
    """run_job continues an unfinished train.py run of the same overrides from its latest checkpoint, to the
    weights of an uninterrupted run, and counts both pieces' seconds; other overrides start it again."""
    from safetensors.torch import load_file

    from hkrag.tasks.common import PIECES_FILE, run_job

    overrides = ["experiment=reader_tiny", f"paths.data_dir={tmp_path / 'data'}", "data.synthetic.n_train=16",
                 "data.synthetic.n_test=8", "data.synthetic.train_groups_per_style=1",
                 "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "model.num_crops=4",
                 "trainer.global_batch_size=8", "trainer.max_steps=4", "trainer.save_every=2",
                 "eval_before_after=false"]

    def weights(run: Path) -> dict:
        return load_file(run / "checkpoints" / "final" / "trainable.safetensors")

    run_job(tmp_path / "whole", overrides)
    split = tmp_path / "split"
    first = run_job(split, overrides)
    for done in ("report.json", "checkpoints/step-4", "checkpoints/final"):  # killed after step 3
        shutil.rmtree(split / done) if (split / done).is_dir() else (split / done).unlink()
    total = run_job(split, overrides)
    pieces = json.loads((split / PIECES_FILE).read_text())
    assert len(pieces) == 2 and pieces[0] == pytest.approx(first) and total == pytest.approx(sum(pieces))
    assert "resume: latest" in (split / ".hydra" / "config.yaml").read_text()
    whole = weights(tmp_path / "whole")
    assert whole.keys() == weights(split).keys()
    assert all(torch.equal(whole[name], tensor) for name, tensor in weights(split).items())

    (split / "report.json").unlink()
    run_job(split, [*overrides[:-1], "trainer.log_every=1", "eval_before_after=false"])  # other overrides: anew
    assert len(json.loads((split / PIECES_FILE).read_text())) == 1


STOPPED_RUN = """
import sys, time
from pathlib import Path
from hkrag.tasks.common import run_jobs


def stays(folder, overrides, config, done):
    folder.mkdir(parents=True)
    try:
        time.sleep(60)
    finally:
        (folder / "finally").write_text("ran")
    return 60.0


if __name__ == "__main__":
    out = Path(sys.argv[1])
    list(run_jobs([(out / name, [], "train", "done") for name in ("a", "b")], workers=int(sys.argv[2]),
                  runner=stays))
"""


@pytest.mark.parametrize(("stop", "workers"), [("SIGTERM", 2), ("SIGINT", 1)])  # either signal does either path
def test_a_stop_signal_ends_every_running_job_through_its_finally(tmp_path, stop, workers):
    """Started as a background shell job is (SIGINT ignored), run_jobs stops on SIGTERM or SIGINT sent to the main
    process alone: every running job, in the main process or in a worker, runs its ``finally`` and the command
    ends at once with KeyboardInterrupt (before, SIGINT did nothing and SIGTERM skipped the ``finally``)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "stopped_run.py"
    script.write_text(STOPPED_RUN)
    running = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(workers)], stderr=subprocess.PIPE,
                               text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    started = [tmp_path / name for name in ("a", "b")[:workers]]
    deadline = time.time() + 60
    while not all(folder.is_dir() for folder in started) and time.time() < deadline:
        time.sleep(0.05)
    assert all(folder.is_dir() for folder in started), "the jobs did not start within a minute"
    running.send_signal(getattr(signal, stop))
    _, errors = running.communicate(timeout=30)
    assert running.returncode != 0 and f"KeyboardInterrupt: stopped by {stop}" in errors
    assert all((folder / "finally").read_text() == "ran" for folder in started)
    assert not (tmp_path / "b").exists() or workers == 2  # in turn, the queued job never started

"""Slurm end to end on a real single-node cluster the tests start (tests/slurm_cluster.py; DESIGN §9).

A Hydra submitit sweep and ``slurm/train.sbatch`` (``accelerate launch``, two gloo processes) each finish with their
reports; a job requeued mid-training resumes from its last checkpoint and ends with the adapter of an uninterrupted
run; ``slurm/encode.sbatch`` as a job array gives the shards of an unsharded encode and resumes a lost shard; bad
requests fail at submission with Slurm's own message. Skips where Slurm cannot be started (see the fixture).
Waits last while the jobs make progress (``slurm_cluster.wait_until``), so a loaded machine slows them, not fails them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import slurm_cluster
from safetensors.torch import load_file

slurm = slurm_cluster.slurm  # the session fixture

ROOT = Path(__file__).resolve().parents[1]
SMALL_DATA = [
    "data.synthetic.n_train=16", "data.synthetic.n_test=8", "data.synthetic.train_groups_per_style=1",
    "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=2", "model.num_crops=4",
]
TINY_TRAINING = [*SMALL_DATA, "trainer.global_batch_size=4", "trainer.chunk_size=2", "eval_before_after=false"]
STEPS = 16
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=15"]  # the test node has 2 CPUs and no GPU


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder for the module's runs, holding the small synthetic corpus (generated once, before any job)."""
    from hydra import compose, initialize_config_dir

    from hkrag.tasks.common import prepare_data

    root = tmp_path_factory.mktemp("slurm-runs")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        prepare_data(compose("train", [f"paths.data_dir={root / 'data'}", *SMALL_DATA]).data)
    return root


def job_env(work: Path, **extra: str) -> dict[str, str]:
    """Environment of a submission from this test: the corpus, offline, CPU only, two processes per node."""
    return {"HKRAG_DATA_DIR": str(work / "data"), "HKRAG_OUTPUT_ROOT": str(work), "WANDB_MODE": "disabled",
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
            "ACCELERATE_CONFIG": "conf/accelerate/cpu2.yaml", "PROCS_PER_NODE": "2", **extra}


def submit_training(slurm: slurm_cluster.SlurmCluster, work: Path, *overrides: str) -> int:
    return slurm.sbatch(*CPU_JOB, f"--output={work}/%x-%j.out", "slurm/train.sbatch", *TINY_TRAINING, *overrides,
                        env=job_env(work), cwd=ROOT)


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_adapter(run_dir: Path) -> dict:
    return load_file(run_dir / "checkpoints" / "final" / "adapter" / "adapter_model.safetensors")


def test_waits_last_while_there_is_progress_and_say_what_they_waited_for():
    """No Slurm needed: a wait outlasts its stall limit many times over while its snapshot keeps changing, and
    fails, naming what it waited for and what it last saw, once the snapshot stops changing or the cap is hit."""
    ticks = iter(range(10**6))
    done_at = 40  # polls of 10 ms: 0.4 s, ten times the 40 ms stall limit
    assert slurm_cluster.wait_until(lambda: next(ticks) >= done_at and "done", "a moving job",
                                    lambda: time.monotonic(), stall=0.04, poll=0.01) == "done"
    with pytest.raises(TimeoutError, match=r"for a stuck job \(no progress for 0 s\); last seen: \('RUNNING', 7\)"):
        slurm_cluster.wait_until(lambda: False, "a stuck job", lambda: ("RUNNING", 7), stall=0.05, poll=0.01)
    with pytest.raises(TimeoutError, match=r"for a busy job \(the 0 s cap\)"):
        slurm_cluster.wait_until(lambda: False, "a busy job", time.monotonic, stall=10, cap=0.1, poll=0.01)


def test_bad_requests_fail_at_submission_with_slurms_message(slurm, work):
    bad_partition = slurm.command("sbatch", "--partition=nope", *CPU_JOB, "slurm/train.sbatch", cwd=ROOT, check=False)
    assert bad_partition.returncode != 0
    assert "invalid partition specified: nope" in bad_partition.stderr
    gpus = slurm.command("sbatch", "slurm/train.sbatch", cwd=ROOT, check=False)  # the template asks for 8 GPUs
    assert gpus.returncode != 0 and "Invalid generic resource (gres) specification" in gpus.stderr
    script = slurm.command("sbatch", "slurm/missing.sbatch", cwd=ROOT, check=False)
    assert script.returncode != 0 and "Unable to open file slurm/missing.sbatch" in script.stderr  # no job queued

    setup = work / "nowhere.sh"  # found missing by the job's first line, before anything starts
    job = slurm.sbatch(*CPU_JOB, f"--output={work}/setup-%j.out", "slurm/train.sbatch", cwd=ROOT,
                       env=job_env(work, HKRAG_SETUP=str(setup)))
    assert slurm.wait(job) == ["FAILED"]
    assert f"HKRAG_SETUP={setup} does not exist" in (work / f"setup-{job}.out").read_text()


def test_hydra_sweep_runs_each_point_as_a_slurm_job_and_shows_sbatch_errors(slurm, work):
    def sweep(directory: Path, *overrides: str) -> tuple[int, str]:
        """The sweep's exit status and output, waiting while its jobs make progress (their files under
        ``directory``, the sweep's own output)."""
        command = [sys.executable, "train.py", "-m", "hydra/launcher=slurm_local", f"hydra.sweep.dir={directory}",
                   "trainer.seed=0,1", "trainer.max_steps=2", *TINY_TRAINING, *overrides]
        log = work / f"{directory.name}-sweep.log"
        with open(log, "w") as out:
            process = subprocess.Popen(command, cwd=ROOT, env={**slurm.env, **job_env(work)}, stdout=out,
                                       stderr=subprocess.STDOUT)
        try:
            slurm_cluster.wait_until(lambda: process.poll() is not None, f"the sweep into {directory}",
                                     lambda: slurm_cluster.file_sizes(log, directory), poll=0.5)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        return process.returncode, log.read_text()

    returncode, output = sweep(work / "sweep")
    assert returncode == 0, output[-3000:]
    for num in (0, 1):
        assert (work / "sweep" / str(num) / "report.json").is_file()
        assert steps(work / "sweep" / str(num)) == [1, 2]
    first, second = (final_adapter(work / "sweep" / n) for n in "01")
    assert any(not np.array_equal(first[k].numpy(), second[k].numpy()) for k in first)  # two seeds, two runs

    returncode, output = sweep(work / "bad", "hydra.launcher.partition=nope")
    assert returncode != 0
    assert "sbatch: error: invalid partition specified: nope" in output


def interrupted_training(slurm: slurm_cluster.SlurmCluster, work: Path, *interrupt: str) -> tuple[Path, Path, str]:
    """Two runs of train.sbatch checkpointing every step, the second interrupted by ``interrupt <job id>`` once its
    third checkpoint is written; waits for both and checks that the second resumed to the first's final adapter.
    Returns the run directories and the interrupted job's log."""
    every_step = [f"trainer.max_steps={STEPS}", "trainer.save_every=1"]
    reference, interrupted = (submit_training(slurm, work, *every_step) for _ in range(2))
    run, reference_run = (work / "slurm" / f"hkrag-train-{job}" for job in (interrupted, reference))

    def third_checkpoint() -> bool:
        assert slurm.states(interrupted) != ["FAILED"], slurm_cluster.file_sizes(run)
        return (run / "checkpoints" / "step-3").is_dir()

    slurm_cluster.wait_until(third_checkpoint, f"job {interrupted}'s third checkpoint",
                             lambda: slurm.progress(interrupted, run))
    slurm.command(*interrupt, str(interrupted))
    assert slurm.wait(reference, reference_run) == ["COMPLETED"]
    assert slurm.wait(interrupted, run) == ["COMPLETED"]

    log = (work / f"hkrag-train-{interrupted}.out").read_text()
    resumed = [int(k) for k in re.findall(r"resumed from \S+/step-(\d+) at step \d+", log)]
    assert slurm.job(interrupted)["Restarts"] == "1" and "DUE TO JOB REQUEUE" in log
    assert resumed and 3 <= resumed[0] < STEPS, log[-2000:]
    assert steps(run)[-1] == STEPS and (run / "report.json").is_file()
    assert steps(reference_run) == list(range(1, STEPS + 1))
    expected, got = final_adapter(reference_run), final_adapter(run)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():  # bit-exact: same data order, RNG and gloo reductions
        np.testing.assert_array_equal(got[name].numpy(), tensor.numpy(), err_msg=name)
    return reference_run, run, log


def test_sbatch_training_and_a_requeued_job_resumes_to_the_same_adapter(slurm, work):
    reference_run, _, _ = interrupted_training(slurm, work, "scontrol", "requeue")  # as a pre-emption would
    assert '"processes": 2' in (reference_run / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_time_limit_warning_requeues_the_job_which_resumes(slurm, work):
    # The USR1 that --signal=B:USR1@300 sends the batch shell before the time limit, sent now (Slurm checks time
    # limits about every 30 s, so a real limit cannot be hit at a chosen step).
    _, _, log = interrupted_training(slurm, work, "scancel", "--batch", "--signal=USR1")
    assert "time limit near: requeueing job" in log


def test_encode_array_equals_an_unsharded_encode_and_resumes(slurm, work):
    from hkrag.index.shards import load_shards
    from hkrag.tasks.encode import encode_part, load_config

    overrides = [f"paths.data_dir={work / 'data'}", "model=tiny", *SMALL_DATA, "eval.shard_size=2"]
    encode_part(load_config(overrides), "all", work / "unsharded")
    array = work / "array"

    def submit() -> list[str]:
        job = slurm.sbatch("--array=0-1", *CPU_JOB, f"--output={work}/encode-%A_%a.out", "slurm/encode.sbatch",
                           "--corpus", "all", "--out", str(array), *overrides, env=job_env(work), cwd=ROOT)
        assert slurm.wait(job, array) == ["COMPLETED", "COMPLETED"]
        return [(work / f"encode-{job}_{task}.out").read_text() for task in (0, 1)]

    ids, vectors = load_shards(work / "unsharded")
    shards = list(range((len(ids) + 1) // 2))  # eval.shard_size=2
    assert len(shards) >= 4
    logs = submit()
    assert f"encoded shards {shards[0::2]}" in logs[0] and f"encoded shards {shards[1::2]}" in logs[1]
    array_ids, array_vectors = load_shards(array)
    assert array_ids == ids and np.array_equal(array_vectors, vectors)

    for suffix in ("json", "npy"):  # a shard lost to a failed task: the same array again encodes only it
        (array / f"shard-00001.{suffix}").unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in array.glob("shard-*")}
    logs = submit()
    assert "encoded shards []" in logs[0] and "encoded shards [1]" in logs[1]
    assert {p.name: p.stat().st_mtime_ns for p in array.glob("shard-*") if p.name in kept} == kept
    array_ids, array_vectors = load_shards(array)
    assert array_ids == ids and np.array_equal(array_vectors, vectors)

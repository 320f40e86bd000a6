"""train.py under `accelerate launch` with two CPU processes (gloo) matches one process (DESIGN §9).

Same loss and learning rate at every step of a linear warmup/decay schedule, and an exact ``resume=auto``
in two processes (every rank's RNG state is gathered into the checkpoint).

Slow (two interpreter start-ups, model builds): run with ``pytest -m slow``.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "data.synthetic.n_train=40", "data.synthetic.n_test=12", "data.synthetic.train_groups_per_style=2",
    "data.synthetic.test_groups_per_style=1", "+data.synthetic.group_size=3", "model.num_crops=4",
    "trainer.global_batch_size=8", "trainer.chunk_size=2", "trainer.max_steps=6", "trainer.save_every=3",
    "eval_before_after=false", "model.lora.dropout=0.0", "optim.scheduler=linear", "optim.warmup_ratio=0.5",
]
LINEAR_WARMUP_LRS = [1e-3 / 3, 2e-3 / 3, 1e-3, 2e-3 / 3, 1e-3 / 3, 0.0]  # optim.lr=1e-3 of the demo


def logged(run_dir: Path, key: str) -> list:
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def launch(*args: str, processes: int, env: dict) -> None:
    """Run a script on the CPU in ``processes`` gloo ranks (accelerate's torchrun launcher)."""
    command = [sys.executable, *args] if processes == 1 else [
        "accelerate", "launch", "--config_file", "conf/accelerate/cpu2.yaml", "--num_processes", str(processes), *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate CLI")
def test_two_processes_match_one_in_training_and_evaluation(tmp_path):
    env = {**os.environ, "HKRAG_DATA_DIR": str(tmp_path / "data"), "WANDB_MODE": "disabled", "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1"}
    for n, name in ((1, "one"), (2, "two")):
        launch("train.py", *OVERRIDES, f"hydra.run.dir={tmp_path / name}", processes=n, env=env)
    one, two = tmp_path / "one", tmp_path / "two"
    assert logged(one, "processes") == [1] * 6 and logged(two, "processes") == [2] * 6
    assert logged(one, "lr") == pytest.approx(LINEAR_WARMUP_LRS, abs=1e-12)
    assert logged(two, "lr") == pytest.approx(LINEAR_WARMUP_LRS, abs=1e-12)
    assert logged(two, "loss") == pytest.approx(logged(one, "loss"), rel=1e-5, abs=1e-6)
    final = two / "checkpoints" / "final"
    assert (final / "adapter").is_dir() and (final / "rng-1.pt").is_file()

    resumed = tmp_path / "two-resumed"  # a requeued job: same run directory, killed after step 3
    shutil.copytree(two, resumed, ignore=shutil.ignore_patterns("step-6", "final", "metrics.jsonl"))
    launch("train.py", *OVERRIDES, "resume=auto", f"hydra.run.dir={resumed}", processes=2, env=env)
    assert logged(resumed, "step") == [4, 5, 6]
    assert logged(resumed, "lr") == pytest.approx(LINEAR_WARMUP_LRS[3:], abs=1e-12)
    assert logged(resumed, "loss") == pytest.approx(logged(two, "loss")[3:], rel=1e-5, abs=1e-6)

    evaluation = ["eval.py", f"run_dir={one}", *OVERRIDES[:5], "eval.shard_size=5"]
    for n, name in ((1, "eval-one"), (2, "eval-two")):
        launch(*evaluation, f"hydra.run.dir={tmp_path / name}", processes=n, env=env)
    single = json.loads((tmp_path / "eval-one" / "retrieval.json").read_text())
    double = json.loads((tmp_path / "eval-two" / "retrieval.json").read_text())
    assert flat(double) == pytest.approx(flat(single), abs=1e-6)


def flat(tree: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}/") if isinstance(value, dict) else {prefix + key: value})
    return out

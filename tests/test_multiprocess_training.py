"""train.py under `accelerate launch` with two CPU processes (gloo) matches one process (DESIGN §9).

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
    "trainer.global_batch_size=8", "trainer.chunk_size=2", "trainer.max_steps=3", "trainer.save_every=null",
    "eval_before_after=false", "model.lora.dropout=0.0",
]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate CLI")
def test_two_processes_log_the_losses_of_one(tmp_path):
    env = {**os.environ, "HKRAG_DATA_DIR": str(tmp_path / "data"), "WANDB_MODE": "disabled", "CUDA_VISIBLE_DEVICES": ""}
    single = subprocess.run(
        [sys.executable, "train.py", *OVERRIDES, f"hydra.run.dir={tmp_path / 'one'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    # --multi_gpu picks the torchrun launcher; without CUDA each rank runs on the CPU with gloo.
    double = subprocess.run(
        ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "train.py", *OVERRIDES,
         f"hydra.run.dir={tmp_path / 'two'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert double.returncode == 0, double.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 3
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)
    assert (tmp_path / "two" / "checkpoints" / "final" / "adapter").is_dir()

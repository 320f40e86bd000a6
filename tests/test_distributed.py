"""Cross-device negatives: two gloo ranks match one process on the concatenated batch."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import _dist_worker as worker
import pytest
import torch
import torch.multiprocessing as mp

from hkrag.distributed import gather_with_grad, is_main, rank, world_size

WORLD = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_ranks(out_dir: Path) -> list[dict]:
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ranks")
    mp.spawn(worker.spawned, args=(WORLD, str(out_dir / "rendezvous"), str(out_dir)), nprocs=WORLD)
    return load_ranks(out_dir)


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, the whole batch, no process group."""
    return worker.step(worker.encoder(), *worker.data(), cached=False)


def assert_same_step(result: dict, expected: dict) -> None:
    torch.testing.assert_close(result["loss"], expected["loss"])
    torch.testing.assert_close(result["grads"], expected["grads"], rtol=1e-5, atol=1e-6)


def test_single_process_helpers_are_no_ops():
    x = torch.randn(3, 4, requires_grad=True)
    assert gather_with_grad(x) is x
    assert (rank(), world_size(), is_main()) == (0, 1, True)


@pytest.mark.parametrize("scenario", ["plain", "cached", "uneven"])
def test_two_ranks_match_one_process(spawned, reference, scenario):
    for result in spawned:
        assert_same_step(result[scenario], reference)


@pytest.mark.parametrize("scenario", ["late", "late-cached"])
def test_late_interaction_over_two_ranks_matches_one_process(spawned, scenario):
    """Ragged token counts (per chunk and per rank) padded across ranks, all-gathered, gradient-cached: the same
    MaxSim loss and gradients as one process encoding the whole batch."""
    expected = worker.late_step(worker.encoder(), *worker.token_data(), cached=False)
    for result in spawned:
        assert_same_step(result[scenario], expected)


def test_gradient_caching_with_gather_replays_each_ranks_dropout(spawned):
    for result in spawned:
        assert_same_step(result["dropout-cached"], result["dropout"])
    assert not torch.allclose(spawned[0]["dropout"]["grads"], spawned[0]["plain"]["grads"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate CLI")
def test_two_ranks_under_accelerate_launch_match_one_process(tmp_path, reference):
    # --multi_gpu selects accelerate's torchrun launcher; on a machine without CUDA the worker's
    # Accelerator(cpu=True) then runs DDP over gloo (--cpu alone starts a single process).
    command = [
        "accelerate",
        "launch",
        "--multi_gpu",
        "--num_processes",
        str(WORLD),
        "--num_machines",
        "1",
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        worker.__file__,
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(worker.__file__).parent), *sys.path])}
    subprocess.run(command, check=True, env=env, timeout=300)
    for result in load_ranks(tmp_path):
        for scenario in ("plain", "cached", "uneven"):
            assert_same_step(result[scenario], reference)

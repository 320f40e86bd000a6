"""Training checkpoints: adapter, optimizer, scheduler, RNG and data position, for exact resume.

Layout of ``<output>/checkpoints/step-<N>/``::

    adapter/              peft adapter (what users load; ``Phi3VRetriever.from_pretrained(adapter=...)``)
    trainable.safetensors every trainable tensor by name (what resume loads, strict)
    optimizer.pt, scheduler.pt
    rng-<rank>.pt         python / numpy / torch (/ cuda) generator states of each rank
    state.json            step, epoch, step within epoch, config hash

A checkpoint is written to ``step-<N>.tmp`` and renamed when complete, so a crash mid-write never
leaves something that looks finished. Nothing is written while any trainable tensor is non-finite.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STATE_FILE = "state.json"


@dataclass
class TrainState:
    """Where training is: ``step`` optimizer steps done, ``epoch`` and ``step_in_epoch`` to resume from."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    config_hash: str = ""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message says which file and why."""


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().contiguous().cpu() for name, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    rank: int,
    is_main: bool,
    barrier=lambda: None,
) -> Path:
    """Write a checkpoint of the unwrapped ``model`` (a peft model) atomically; returns its path."""
    tensors = trainable_state(model)
    bad = [name for name, t in tensors.items() if not torch.isfinite(t).all()]
    if bad:
        raise FloatingPointError(f"refusing to checkpoint: non-finite values in {bad[:3]} (and {len(bad) - 3} more)")
    tmp = directory.with_name(directory.name + ".tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp / "adapter")
        save_file(tensors, tmp / "trainable.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    barrier()
    torch.save(rng_state(), tmp / f"rng-{rank}.pt")
    barrier()
    if is_main:
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
    barrier()
    return directory


def load_checkpoint(
    directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, rank: int
) -> TrainState:
    """Restore everything ``save_checkpoint`` wrote; raises :class:`CheckpointError` naming the bad file."""
    directory = Path(directory)
    if not (directory / STATE_FILE).is_file():
        raise CheckpointError(f"{directory} is not a finished checkpoint (no {STATE_FILE}); pick a step-<N> folder")
    state = TrainState(**_read(directory / STATE_FILE, lambda p: json.loads(p.read_text())))
    tensors = _read(directory / "trainable.safetensors", lambda p: load_file(str(p)))
    expected = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if tensors.keys() != expected.keys():
        diff = sorted(set(tensors) ^ set(expected))[:3]
        raise CheckpointError(f"{directory}: trainable tensors do not match this model (e.g. {diff}); same config?")
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(tensors[name])
    optimizer.load_state_dict(_read(directory / "optimizer.pt", torch.load))
    scheduler.load_state_dict(_read(directory / "scheduler.pt", torch.load))
    set_rng_state(_read(directory / f"rng-{rank}.pt", lambda p: torch.load(p, weights_only=False)))
    return state


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The finished checkpoint with the highest step under ``output_dir/checkpoints``, if any."""
    done = [p for p in Path(output_dir, "checkpoints").glob("step-*") if (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def _read(path: Path, reader):
    try:
        return reader(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}") from None
    except Exception as error:
        raise CheckpointError(f"cannot read checkpoint file {path}: {error}") from error

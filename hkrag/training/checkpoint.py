"""Training checkpoints: adapter, optimizer, scheduler, RNG and data position, for exact resume.

Layout of ``<output>/checkpoints/step-<N>/``::

    adapter/              peft adapter (what users load; ``Phi3VRetriever.from_pretrained(adapter=...)``)
    trainable.safetensors every trainable tensor by name (what resume loads, strict)
    optimizer.pt, scheduler.pt
    rng-<rank>.pt         python / numpy / torch (/ cuda) generator states of each rank
    state.json            step, epoch, step within epoch, and the run config with its hash

Rank 0 writes the whole folder (the other ranks' RNG states are gathered to it) through
:func:`hkrag.io.atomic_directory`: it is built under a hidden temporary name and swapped in only when
complete, so a crash mid-write leaves the previous checkpoint of that name intact and nothing that
looks finished. Each file is serialised in memory and written by :mod:`hkrag.io`, so a full disk raises
:class:`~hkrag.io.WriteError` naming the file and saying the disk is full (serialisers writing to disk
themselves fail with unrelated messages, e.g. torch's "unexpected pos"). Nothing is written while any
trainable tensor is non-finite.

Resume refuses a checkpoint written under another run config (the keys that differ are named; only
``extendable`` keys such as ``trainer.max_steps`` may differ), and any file that is missing, truncated
or does not fit the model raises :class:`CheckpointError` naming it; every file is read and checked
before the model, optimizer or scheduler is touched.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import random
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from safetensors.torch import save as tensors_bytes

from hkrag.io import WriteError, atomic_directory, write_bytes, write_json
from hkrag.retriever import weights_fingerprint

CHECKPOINTS_DIR = "checkpoints"
"""The run directory's folder of checkpoints (``step-<N>`` and ``final``)."""
FINAL_CHECKPOINT = "final"
ADAPTER_DIR = "adapter"
"""A checkpoint's LoRA adapter folder (PEFT's ``save_pretrained``)."""
STATE_FILE = "state.json"
TENSORS_FILE = "trainable.safetensors"
CHECKPOINT_NAME = re.compile(r"step-(\d+)")
OPTIONAL_STATE_KEYS = frozenset({"schedule"})
"""``state.json`` keys that checkpoints written before they existed lack."""
LATER_CONFIG_KEYS = frozenset({"model.weights", "model.num_crops", "model.lora.r", "model.lora.alpha",
                               "model.lora.dropout", "model.lora.target_modules", "model.lora.modules_to_save",
                               "loss.max_query_length"})
"""Run-config keys added after some checkpoints were written (``model.weights``, the generator's LoRA settings,
pre-training's ``loss.max_query_length``): compared only when the checkpoint holds them, so such a checkpoint
still resumes on the keys it has."""


@dataclass
class TrainState:
    """Where training is: ``step`` optimizer steps done, ``epoch`` and ``step_in_epoch`` to resume from.

    ``config`` holds the settings that fix the data order and the optimisation (flat, Hydra key names)
    and ``config_hash`` their hash; resume compares them with the new run's. ``schedule`` holds the
    learning-rate schedule's ``warmup_steps`` and ``total_steps``: an extended run keeps its warmup.
    """

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    config_hash: str = ""
    schedule: dict[str, int] = field(default_factory=dict)


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint that cannot be resumed from; the message says which file and why (a ``ValueError`` too, as
    docs/errors.md promises of every error that names bad input)."""


def hash_config(config: Mapping[str, Any]) -> str:
    """Stable short hash of a JSON-able flat config."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().contiguous().cpu() for name, p in model.named_parameters() if p.requires_grad}


def check_finite(model: torch.nn.Module) -> None:
    """Refuse to checkpoint weights holding NaN/inf (call on every rank before :func:`save_checkpoint`)."""
    bad = [name for name, p in model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    if bad:
        raise FloatingPointError(f"refusing to checkpoint: non-finite values in {bad[:3]} ({len(bad)} tensors)")


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
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    rng_states: Sequence[dict[str, Any]],
) -> Path:
    """Write a checkpoint of the unwrapped peft ``model`` atomically (rank 0 only); returns its path.

    ``rng_states`` holds every rank's :func:`rng_state`, in rank order. A file that cannot be written
    raises :class:`~hkrag.io.WriteError` naming it (and a full disk as such); the previous checkpoint
    of that name, if any, is left intact and no partial folder remains.
    """
    directory = Path(directory)
    files: dict[str, Callable[[Path], Any]] = {
        ADAPTER_DIR: model.save_pretrained,
        TENSORS_FILE: lambda path: write_bytes(path, tensors_bytes(trainable_state(model))),
        "optimizer.pt": lambda path: write_bytes(path, _torch_bytes(optimizer.state_dict())),
        "scheduler.pt": lambda path: write_bytes(path, _torch_bytes(scheduler.state_dict())),
        **{f"rng-{rank}.pt": _rng_writer(rng) for rank, rng in enumerate(rng_states)},
        STATE_FILE: lambda path: write_json(path, asdict(state)),
    }
    with atomic_directory(directory) as tmp:
        for name, write in files.items():
            _write(tmp / name, directory / name, write)
    return directory


def _rng_writer(rng: dict[str, Any]) -> Callable[[Path], Any]:
    return lambda path: write_bytes(path, _torch_bytes(rng))


def _torch_bytes(obj: Any) -> bytes:
    """``torch.save`` into memory: written to disk by :mod:`hkrag.io`, whose errors name the file."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write(path: Path, final: Path, write: Callable[[Path], Any]) -> None:
    """``write(path)``; a failure to write raises :class:`WriteError` naming ``final``, the file's place in the
    finished checkpoint, and saying so when the disk is full."""
    try:
        write(path)
    except Exception as error:
        if _disk_full(error):
            full = OSError(errno.ENOSPC, "the disk is full (No space left on device); free space, then resume")
            raise WriteError(final, full) from error
        if isinstance(error, OSError):
            raise WriteError(final, error) from error
        raise


def _disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` or an error it came from is ENOSPC (Rust/C++ serialisers only say it in words)."""
    for _ in range(8):
        if error is None:
            return False
        if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def load_checkpoint(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int,
    config: Mapping[str, Any] | None = None,
    extendable: Collection[str] = (),
) -> TrainState:
    """Restore everything ``save_checkpoint`` wrote; raises :class:`CheckpointError` naming the bad file.

    With ``config`` (the new run's :attr:`TrainState.config`), a checkpoint written under other
    settings (but for ``extendable`` keys) is refused. All files are read and checked before anything is
    restored.
    """
    directory = Path(directory)
    state = checkpoint_state(directory, config, extendable)
    _read(directory / ADAPTER_DIR / "adapter_config.json", json.loads, text=True)
    _read(directory / ADAPTER_DIR / "adapter_model.safetensors", _load_tensors)
    tensors = _read(directory / TENSORS_FILE, _load_tensors)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    check_tensors(directory / TENSORS_FILE, tensors, params)
    optimizer_state = _read(directory / "optimizer.pt", torch.load)
    scheduler_state = _read(directory / "scheduler.pt", torch.load)
    rng = _read(directory / f"rng-{rank}.pt", lambda p: torch.load(p, weights_only=False))
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])
    _apply(directory / "optimizer.pt", optimizer.load_state_dict, optimizer_state)
    _apply(directory / "scheduler.pt", scheduler.load_state_dict, scheduler_state)
    _apply(directory / f"rng-{rank}.pt", set_rng_state, rng)
    return state


def checkpoint_state(
    directory: str | Path, config: Mapping[str, Any] | None = None, extendable: Collection[str] = ()
) -> TrainState:
    """The :class:`TrainState` of a finished checkpoint folder, checked against ``config`` when given
    (keys in ``extendable`` may differ); raises :class:`CheckpointError` naming the problem."""
    directory = Path(directory)
    if not (directory / STATE_FILE).is_file():
        raise CheckpointError(f"{directory} is not a finished checkpoint (no {STATE_FILE}); pick a step-<N> folder")
    state = read_state(directory / STATE_FILE)
    if config is not None:
        check_config(directory / STATE_FILE, state.config, config, extendable)
    return state


def read_state(path: Path) -> TrainState:
    """``state.json`` as a :class:`TrainState`; unknown or missing keys are errors naming the file
    (but for :data:`OPTIONAL_STATE_KEYS`, absent from older checkpoints)."""
    data = _read(path, json.loads, text=True)
    known = {f.name for f in fields(TrainState)}
    if not isinstance(data, dict) or not known - OPTIONAL_STATE_KEYS <= set(data) <= known:
        keys = set(data) if isinstance(data, dict) else set()
        raise CheckpointError(
            f"{path} is not a checkpoint state of this version: unknown keys {sorted(keys - known)}, "
            f"missing keys {sorted(known - OPTIONAL_STATE_KEYS - keys)}"
        )
    return TrainState(**data)


def check_config(
    path: Path, saved: Mapping[str, Any], current: Mapping[str, Any], extendable: Collection[str] = ()
) -> None:
    """Refuse to resume under settings that change the data order or the optimisation.

    Keys in ``extendable`` (the run's length) are left to the caller, which checks them its own way.
    """
    current = json.loads(json.dumps(dict(current), default=str))  # tuples -> lists, as saved
    keys = (saved.keys() | current.keys()) - set(extendable) - (LATER_CONFIG_KEYS - saved.keys())
    differing = sorted(key for key in keys if saved.get(key) != current.get(key))
    if differing:
        details = "; ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {current.get(k)!r} now" for k in differing)
        raise CheckpointError(
            f"{path} was written by a run with other settings ({details}); resume with the checkpoint's settings "
            "or start a new run directory"
        )


def model_identity(model: torch.nn.Module) -> dict[str, Any]:
    """The run-config keys of the model being trained (Hydra key names): its LoRA settings, read from the peft
    model itself, and ``model.weights``, a fingerprint of the frozen base (another ``model.seed``, ``model.config``,
    ``model.base`` or merged ``init_from`` gives another), so a resumed run on another model is refused."""
    identity: dict[str, Any] = {}
    lora = getattr(model, "peft_config", {}).get("default")
    if lora is not None:
        targets = lora.target_modules if isinstance(lora.target_modules, str) else sorted(lora.target_modules or [])
        identity.update({"model.lora.r": lora.r, "model.lora.alpha": lora.lora_alpha,
                         "model.lora.dropout": lora.lora_dropout, "model.lora.target_modules": targets})
        if lora.modules_to_save:  # absent otherwise: runs without them keep their earlier identity
            identity["model.lora.modules_to_save"] = sorted(lora.modules_to_save)
    identity["model.weights"] = weights_fingerprint(model, frozen_only=True)
    return identity


def check_tensors(path: Path, tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
    """The checkpoint's trainable tensors must be exactly the model's, name by name and shape by shape."""
    if tensors.keys() != params.keys():
        diff = sorted(set(tensors) ^ set(params))[:3]
        raise CheckpointError(f"{path}: trainable tensors do not match this model (e.g. {diff}); same config?")
    shapes = [(n, tuple(tensors[n].shape), tuple(p.shape)) for n, p in params.items() if tensors[n].shape != p.shape]
    if shapes:
        name, saved, now = shapes[0]
        raise CheckpointError(
            f"{path}: {len(shapes)} trainable tensors have another shape than this model's, e.g. {name} {saved} "
            f"saved vs {now} now (another LoRA rank?)"
        )


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The finished ``step-<N>`` checkpoint with the highest N under ``output_dir/checkpoints``, if any.

    Temporaries (``.step-N.<pid>-<thread>.tmp``, ``step-N.tmp``) and folders without ``state.json`` are skipped.
    """
    steps = {}
    for path in Path(output_dir, CHECKPOINTS_DIR).glob("step-*"):
        match = CHECKPOINT_NAME.fullmatch(path.name)
        if match and (path / STATE_FILE).is_file():
            steps[int(match.group(1))] = path
    return steps[max(steps)] if steps else None


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint that ``resume`` names: a folder, ``latest`` (must exist) or ``auto`` (if any).

    ``auto`` is for jobs that may be requeued (Slurm): the first attempt starts fresh, the next ones
    continue from the latest finished checkpoint in the same run directory.
    """
    if not resume:
        return None
    if resume in ("latest", "auto"):
        found = latest_checkpoint(output_dir)
        if found is None and resume == "latest":
            raise FileNotFoundError(
                f"resume=latest but {Path(output_dir) / 'checkpoints'} holds no finished checkpoint; "
                "use resume=auto to start fresh when there is none"
            )
        return found
    return Path(resume)


def _read(path: Path, reader: Callable[[Any], Any], text: bool = False):
    try:
        return reader(path.read_text() if text else path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}") from None
    except Exception as error:
        raise CheckpointError(f"cannot read checkpoint file {path}: {error}") from error


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _apply(path: Path, load: Callable[[Any], Any], value: Any) -> None:
    try:
        load(value)
    except Exception as error:
        raise CheckpointError(f"checkpoint file {path} does not fit this run: {error}") from error

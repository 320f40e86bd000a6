"""Loading Phi-3-vision and its processor: the original checkpoint, or a tiny random one offline.

The classes are also registered with transformers' Auto classes (``import hkrag``), so
``AutoModelForCausalLM.from_pretrained(PHI3V_HUB_ID)`` and ``AutoProcessor.from_pretrained(...)`` load ours
without ``trust_remote_code``; the functions here add attention defaults and clearer errors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import cached_file

from hkrag.io import read_json
from hkrag.models.attention import default_attn_implementation

from .configuration_phi3v import Phi3VConfig, tiny_phi3v_config
from .image_processing_phi3v import Phi3VImageProcessor
from .modeling_phi3v import Phi3VForCausalLM
from .processing_phi3v import PREPROCESSOR_FILE, Phi3VProcessor
from .tokenization import build_offline_tokenizer

PHI3V_HUB_ID = "microsoft/Phi-3-vision-128k-instruct"


class CheckpointNotFoundError(OSError):
    """A Phi-3-vision model or processor could not be loaded (offline, missing folder or files)."""


SHIPPED_MANIFEST = "manifest.json"
"""A shipped folder's manifest (``python -m hkrag.tasks.ship``): ``files`` maps each file's path to its sha256."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
_hashes: dict[tuple[str, int, int], str] = {}


class ShippedFileMismatch(CheckpointNotFoundError):
    """A file of a shipped folder is missing or differs from the sha256 its manifest names."""


def file_sha256(path: Path) -> str:
    """sha256 (hex) of the file at ``path``, remembered while its size and modification time stay the same."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _hashes:
        _hashes[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _hashes[key]


def shipped_manifest(folder: Path) -> dict[str, Any] | None:
    """``folder``'s shipped manifest, or None when it has none (or one of another kind: no sha256 by file)."""
    try:
        manifest = read_json(folder / SHIPPED_MANIFEST)
    except (OSError, ValueError):
        return None
    return manifest if _manifest_problem(manifest) is None else None


def _manifest_problem(manifest: Any) -> str | None:
    """Why ``manifest`` lists no sha256 by file (``files``: path -> 64 hex digits), or None."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return "it has no 'files' table"
    bad = [name for name, digest in files.items() if not (isinstance(digest, str) and _SHA256.fullmatch(digest))]
    return f"its 'files' entries {bad[:3]} hold no sha256" if bad else None


def _vouching_manifest(root: Path) -> dict[str, Any]:
    """The shipped manifest of ``root``; :class:`ShippedFileMismatch` when it cannot vouch for the files (damaged,
    truncated, no sha256 table): a shipped folder whose manifest cannot be read is refused, never trusted."""
    path = root / SHIPPED_MANIFEST
    try:
        manifest = read_json(path, keys=("files",))
        problem = _manifest_problem(manifest)
    except (OSError, ValueError) as error:
        problem = str(error)
    if problem:
        raise ShippedFileMismatch(f"{path} cannot vouch for the shipped files ({problem}); restore it (git checkout "
                                  f"-- {path}) or ship the run again (python -m hkrag.tasks.ship)")
    return manifest


def _is_shipped_root(folder: Path) -> bool:
    """Whether ``folder`` holds a shipped manifest, readable or not (another kind of ``manifest.json``, e.g. an
    embedding folder's, is valid JSON without ``files`` and does not count)."""
    path = folder / SHIPPED_MANIFEST
    if not path.is_file():
        return False
    try:
        manifest = read_json(path)
    except (OSError, ValueError):
        return True
    return not isinstance(manifest, dict) or "files" in manifest or "command" in manifest


def verify_shipped(path: str | Path) -> None:
    """Refuse to load a shipped folder whose manifest cannot vouch for every file about to be read.

    When ``path`` (a base or adapter folder about to be loaded) lies in a shipped folder (itself or the nearest
    folder above it with a :data:`SHIPPED_MANIFEST`), the manifest must be readable with a sha256 by file, every
    file under ``path`` must be listed in it, and every file it lists under ``path`` must exist with that hash;
    else :class:`ShippedFileMismatch` naming the file (and both hashes). Hub ids and folders outside a shipped
    one pass unchecked; hashes are remembered, so loading again costs a ``stat``."""
    path = Path(path)
    if not path.exists():
        return
    path = path.resolve()
    root = next((folder for folder in (path, *path.parents) if _is_shipped_root(folder)), None)
    if root is None:
        return
    manifest = _vouching_manifest(root)
    within = path.relative_to(root).parts
    present = [file for file in ([path] if path.is_file() else sorted(path.rglob("*"))) if file.is_file()]
    unlisted = [str(file.relative_to(root)) for file in present
                if file != root / SHIPPED_MANIFEST and str(file.relative_to(root)) not in manifest["files"]]
    if unlisted:
        raise ShippedFileMismatch(
            f"{root / unlisted[0]} is not listed in {root / SHIPPED_MANIFEST} ({len(unlisted)} unlisted file(s) "
            f"under {path}): the loader would read a file the manifest does not vouch for; remove it, restore the "
            f"folder (git checkout -- {root}) or ship the run again (python -m hkrag.tasks.ship)")
    for name, expected in manifest["files"].items():
        file = root / name
        if Path(name).parts[: len(within)] != within:
            continue
        actual = file_sha256(file) if file.is_file() else None
        if actual != expected:
            found = f"has sha256 {actual}" if actual else "is missing"
            raise ShippedFileMismatch(
                f"{file} {found}, but {root / SHIPPED_MANIFEST} says sha256 {expected}: the shipped weights changed "
                f"after shipping (an edit, a partial copy, a Git LFS pointer?); restore them (git checkout -- {root}) "
                "or ship the run again (python -m hkrag.tasks.ship)"
            )


@contextmanager
def _loading(name_or_path: str | Path, what: str, *errors: type[Exception]) -> Iterator[None]:
    """Re-raise loading failures as :class:`CheckpointNotFoundError` naming the source and the ways out."""
    try:
        yield
    except (OSError, *errors) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointNotFoundError(
            f"could not load the Phi-3-vision {what} from {str(name_or_path)!r}: {reason}\n"
            f"Offline, or the files are missing? Set model.base=/local/path to a folder holding a copy of "
            f"{PHI3V_HUB_ID} (config.json, model*.safetensors, tokenizer files, {PREPROCESSOR_FILE}), "
            "or use the tiny random model (model=tiny, or hkrag.models.phi3v.tiny_phi3v())."
        ) from error


def load_phi3v(
    name_or_path: str | Path = PHI3V_HUB_ID,
    dtype: torch.dtype | str = torch.bfloat16,
    attn_implementation: str | None = None,
    **kwargs: Any,
) -> Phi3VForCausalLM:
    """Load the original checkpoint (hub id or local folder) into :class:`Phi3VForCausalLM`.

    The original ``config.json`` is read as is (its ``rope_scaling`` is converted for transformers
    5.x); attention defaults to flash-attn when installed, else SDPA. A shipped folder is checked against its
    manifest first (:func:`verify_shipped`).
    """
    attn = attn_implementation or default_attn_implementation()
    if attn == "flash_attention_2":
        require_flash_attention()
    verify_shipped(name_or_path)
    with _loading(name_or_path, "model"):
        config = Phi3VConfig.from_pretrained(name_or_path)
        return Phi3VForCausalLM.from_pretrained(
            name_or_path, config=config, dtype=dtype, attn_implementation=attn, **kwargs
        )


def require_flash_attention() -> None:
    """Fail loudly (no silent SDPA fallback) when ``flash_attention_2`` is requested but cannot run."""
    missing = [reason for reason, ok in (("flash-attn is not installed", importlib.util.find_spec("flash_attn")),
                                         ("CUDA is not available", torch.cuda.is_available())) if not ok]
    if missing:
        raise ImportError(
            f"attn_implementation='flash_attention_2' was requested but {' and '.join(missing)}: install flash-attn "
            "on a CUDA machine, or override the attention (Hydra: model.attn_implementation=sdpa)"
        )


def read_preprocessor_config(name_or_path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``preprocessor_config.json`` (``num_crops``, mean, std), or ``{}`` if absent."""
    path = cached_file(name_or_path, PREPROCESSOR_FILE, _raise_exceptions_for_missing_entries=False)
    return read_json(path) if path else {}


def image_processor_for(config: Phi3VConfig, num_crops: int = 16, **kwargs: Any) -> Phi3VImageProcessor:
    """An image processor whose crop geometry matches ``config``'s vision tower."""
    return Phi3VImageProcessor(
        num_crops=num_crops, crop_size=config.crop_size, merged_per_side=config.merged_per_side, **kwargs
    )


def load_processor(name_or_path: str | Path = PHI3V_HUB_ID, num_crops: int | None = None) -> Phi3VProcessor:
    """Tokenizer + image processor of a checkpoint; ``num_crops`` overrides the saved value.

    Equals ``AutoProcessor.from_pretrained`` on a complete checkpoint; in addition the crop geometry comes
    from ``config.json`` (so folders saved before ``crop_size`` was written load right) and a missing
    ``preprocessor_config.json`` means the reference defaults.
    """
    verify_shipped(name_or_path)
    with _loading(name_or_path, "processor"):
        config = Phi3VConfig.from_pretrained(name_or_path)
        saved = read_preprocessor_config(name_or_path)
    with _loading(name_or_path, "tokenizer", ValueError):
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "right"
    settings = {**saved, "crop_size": config.crop_size, "merged_per_side": config.merged_per_side}
    if num_crops is not None:
        settings["num_crops"] = num_crops
    return Phi3VProcessor(tokenizer, Phi3VImageProcessor.from_dict(settings))


def save_processor(processor: Phi3VProcessor, directory: str | Path) -> None:
    """Write tokenizer files and a ``preprocessor_config.json`` in the original format (``save_pretrained``)."""
    processor.save_pretrained(directory)


def tiny_phi3v(
    texts: Iterable[str] = (),
    num_crops: int = 4,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **config_overrides: Any,
) -> tuple[Phi3VForCausalLM, Phi3VProcessor]:
    """A random-initialised tiny Phi3V and a matching offline processor (no downloads)."""
    tokenizer = tokenizer or build_offline_tokenizer(texts)
    config = tiny_phi3v_config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    config._attn_implementation = config_overrides.pop("attn_implementation", "sdpa")
    torch.manual_seed(seed)
    model = Phi3VForCausalLM(config)
    return model, Phi3VProcessor(tokenizer, image_processor_for(config, num_crops=num_crops))

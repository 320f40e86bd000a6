"""Ship a finished tiny ``train.py`` run with the repository: its base and final adapter in the run-folder layout
every ``run_dir=`` reads, and a manifest naming the command, the config that made it and the files' hashes.

    python -m hkrag.tasks.ship outputs/replica/warmstart --out weights/reader_tiny
    python -m hkrag.tasks.ship outputs/generator --out weights/generator_tiny --answers outputs/generator_eval

The shipped folder is a ``run_dir`` like any other (``eval.py task=retrieval run_dir=weights/reader_tiny``,
``task=rag``, ``generator_training.retriever.run_dir=``); loading it checks its files against the manifest's sha256
(:func:`hkrag.models.phi3v.loading.verify_shipped`). ``tests/test_shipped.py`` checks that the manifest's config,
the run's own (its ``.hydra/config.yaml``), is still what ``train.py`` composes from its overrides and that the files
are the ones it names (docs/training.md, "A tiny model that reads"). The shipped adapter's config names the shipped
base (``weights/<name>/base``), not the run's folder.

Shipping never loses weights: it builds the folder under a temporary name and renames it into place; it refuses a
``--out`` that exists (naming it and what it holds) unless it holds this very run already shipped intact (nothing
to do) or, with ``--replace``, weights shipped before; a folder that is not shipped weights, and one overlapping
the run, are refused even then.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hkrag.io import atomic_directory, read_json, write_json
from hkrag.models.phi3v.loading import SHIPPED_MANIFEST, file_sha256, shipped_manifest
from hkrag.rag.trace import MERGED_FILE, load_trace
from hkrag.tasks.chain import answer_rows
from hkrag.tasks.common import BASE_DIR, CONF_DIR, FINAL_ADAPTER, RUN_CONFIG

logger = logging.getLogger(__name__)

MANIFEST_FILE = SHIPPED_MANIFEST
"""The config the run itself used, as Hydra (or the replica's ``run_job``) saved it."""
CONFIG_KEYS = ("model", "loss", "optim", "trainer", "data.synthetic", "data.train")
"""The settings that decide a retriever's weights (where the data lives and where the run wrote do not)."""
GENERATOR_CONFIG_KEYS = ("model", "generator_training", "generator.prompts.single_pass", "generator.top_k",
                         "data.synthetic", "data.train")
"""The settings that decide a generator's weights (``run._target_`` names generator training); with the agents'
curriculum (``generator_training.curriculum``), the whole ``generator`` group too."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
ADAPTER_CONFIG = str(FINAL_ADAPTER / ADAPTER_FILES[0])
REPOSITORY = CONF_DIR.parent


class ShipRefused(FileExistsError):
    """Shipping would delete or overwrite something: the run it ships, other weights or a folder of another kind."""


def training_config(overrides: Sequence[str]) -> dict[str, Any]:
    """What ``train.py`` composes today from ``overrides``, resolved, for the keys that decide the weights."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return weight_settings(compose("train", list(overrides)))


def run_config(run: Path) -> dict[str, Any]:
    """The settings that decided ``run``'s weights, from the config it ran with (``.hydra/config.yaml``), resolved."""
    path = Path(run) / RUN_CONFIG
    try:
        return weight_settings(OmegaConf.load(path))
    except (OmegaConfBaseException, yaml.YAMLError) as error:
        raise ValueError(f"{path}: cannot read the run's config ({error}); ship a run train.py wrote") from error


def weight_settings(cfg: DictConfig) -> dict[str, Any]:
    """``cfg``'s values, resolved, for the keys that decide the weights (a generator's or a retriever's)."""
    target = OmegaConf.select(cfg, "run._target_") or ""
    keys = GENERATOR_CONFIG_KEYS if target.endswith("run_generator_training") else CONFIG_KEYS
    if OmegaConf.select(cfg, "generator_training.curriculum"):
        keys = (*keys, "generator")  # the agents' curriculum learns every prompt, under the caps and top_k
    return {key: _resolved(OmegaConf.select(cfg, key)) for key in keys}


def _resolved(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` but the manifest, by path relative to it."""
    return {str(path.relative_to(folder)): file_sha256(path)
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != MANIFEST_FILE}


def shipped_files(run: Path) -> dict[str, Path]:
    """The files a shipment of ``run`` holds (its ``base/`` and final adapter), by path in the shipped folder."""
    files = {str(path.relative_to(run)): path for path in sorted((run / BASE_DIR).rglob("*")) if path.is_file()}
    files.update({str(FINAL_ADAPTER / name): run / FINAL_ADAPTER / name for name in ADAPTER_FILES})
    return dict(sorted(files.items()))


def shipped_base_name(out: Path) -> str:
    """The base a shipped adapter names: ``out``'s ``base/``, relative to the repository when it ships inside it (as
    the repository's configs name it: ``weights/<name>/base``), else absolute. PEFT reads this name when it loads an
    adapter; the run's own base folder (e.g. ``outputs/...``) would be a path no user has."""
    base = (out / BASE_DIR).resolve()
    return str(base.relative_to(REPOSITORY)) if base.is_relative_to(REPOSITORY) else str(base)


def shipped_adapter_config(run: Path, out: Path) -> bytes:
    """``run``'s final adapter config as shipped into ``out``: naming the shipped base (:func:`shipped_base_name`)."""
    config = read_json(run / ADAPTER_CONFIG)
    config["base_model_name_or_path"] = shipped_base_name(out)
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def ship(run: Path, out: Path, answers: dict[str, Any] | None = None, replace: bool = False) -> dict[str, Any]:
    """Ship ``run``'s base and final adapter into ``out`` with its manifest; returns the manifest.

    A retriever's manifest keeps its evaluation after training (``after``); a generator's, ``answers``, what the
    caller measured of it (``--answers``: an ``eval.py`` run of it, summarised by question group). ``out`` is built
    under a temporary name and renamed into place; when it exists, see :func:`check_destination`."""
    run, out = Path(run), Path(out)
    required = [run / BASE_DIR / "config.json", run / "report.json", run / ".hydra" / "overrides.yaml",
                run / RUN_CONFIG, *(run / FINAL_ADAPTER / name for name in ADAPTER_FILES)]
    missing = [str(path.relative_to(run)) for path in required if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"{run} is not a finished tiny train.py run: it lacks {', '.join(missing)} (it needs "
                                f"{BASE_DIR}/, {FINAL_ADAPTER}/, report.json and .hydra/)")
    overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) or []
    report = read_json(run / "report.json")
    sources = shipped_files(run)
    adapter_config = shipped_adapter_config(run, out)
    files = {name: file_sha256(path) for name, path in sources.items()}
    files[ADAPTER_CONFIG] = hashlib.sha256(adapter_config).hexdigest()
    manifest = {"command": " ".join(["python train.py", *overrides]), "overrides": overrides,
                "steps": report["steps"], "config": run_config(run), "after": report.get("after"),
                **({"trained_steps": report["trained_steps"]} if "trained_steps" in report else {}),
                **({"answers": answers} if answers else {}),
                "files": files}
    if check_destination(run, out, manifest, replace):
        return manifest
    with atomic_directory(out) as tmp:
        for name, path in sources.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, tmp / name)
        (tmp / ADAPTER_CONFIG).write_bytes(adapter_config)
        changed = sorted(name for name, digest in file_hashes(tmp).items() if manifest["files"].get(name) != digest)
        if changed:
            raise RuntimeError(f"{run}: {', '.join(changed)} changed while being shipped; {out} is left as it was")
        write_json(tmp / MANIFEST_FILE, manifest)
    return manifest


def check_destination(run: Path, out: Path, manifest: dict[str, Any], replace: bool) -> bool:
    """Whether ``out`` already holds ``manifest``'s shipment intact (nothing to do); :class:`ShipRefused`, naming
    ``out``, where shipping would lose something: ``out`` overlaps ``run``, is not a folder of shipped weights, or
    (unless ``replace``) holds other weights or a damaged copy of these."""
    where, source = out.resolve(), run.resolve()
    if where == source or source in where.parents or where in source.parents:
        raise ShipRefused(f"--out {out} overlaps the run it ships ({run}): shipping there would delete or copy into "
                          "the run; give a folder outside it (e.g. weights/<name>)")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    existing = shipped_manifest(out) if out.is_dir() else None
    if existing is None:
        raise ShipRefused(f"--out {out} exists and is not a folder of shipped weights (no {MANIFEST_FILE} naming its "
                          "files): shipping would delete what it holds; give a new folder, or move it away yourself")
    damaged = sorted(name for name, digest in existing["files"].items()
                     if not (out / name).is_file() or file_sha256(out / name) != digest)
    if existing == manifest and not damaged:
        logger.info("%s already holds this shipment of %s, intact: nothing to do", out, run)
        return True
    if replace:
        return False
    what = (f"this run's weights, but {', '.join(damaged)} no longer match its manifest" if existing == manifest else
            f"other weights (made by: {existing.get('command')}; {len(existing['files'])} files)")
    raise ShipRefused(f"--out {out} already holds {what}; shipping would overwrite them. Pass --replace to replace "
                      "them, or give another --out")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a finished train.py run of the tiny model")
    parser.add_argument("--out", type=Path, required=True, help="the folder to ship into (new, empty, or this run's "
                        "shipment already: nothing to do)")
    parser.add_argument("--replace", action="store_true", help="replace weights shipped in --out before (another "
                        "run's, or a damaged copy); never a folder of another kind")
    parser.add_argument("--answers", type=Path, help="a generator's eval.py task=generation run: its relaxed accuracy "
                        "by question group goes into the manifest")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    answers = None
    if args.answers:
        trace = load_trace(args.answers / MERGED_FILE)
        answers = {"eval_run": str(args.answers), "rows": answer_rows([trace])}
    try:
        manifest = ship(args.run, args.out, answers, replace=args.replace)
    except (ShipRefused, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from error
    if training_config(manifest["overrides"]) != manifest["config"]:
        logger.warning("conf/ now composes other settings from %r than this run used: tests/test_shipped.py will "
                       "fail until conf/ matches the run again", manifest["command"])
    total = sum((args.out / name).stat().st_size for name in manifest["files"])
    print(f"{args.out}: {len(manifest['files'])} files, {total / 2**20:.2f} MiB; made by: {manifest['command']}")


if __name__ == "__main__":
    main()

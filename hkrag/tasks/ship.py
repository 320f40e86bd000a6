"""Ship a finished tiny ``train.py`` run with the repository: its base and final adapter in the run-folder layout
every ``run_dir=`` reads, and a manifest naming the command, the config that made it and the files' hashes.

    python -m hkrag.tasks.ship outputs/replica/warmstart --out weights/reader_tiny
    python -m hkrag.tasks.ship outputs/generator --out weights/generator_tiny --answers outputs/generator_eval

The shipped folder is a ``run_dir`` like any other (``eval.py task=retrieval run_dir=weights/reader_tiny``,
``task=rag``, ``generator_training.retriever.run_dir=``); ``tests/test_shipped.py`` checks that the manifest still
matches what ``train.py`` composes from its overrides and that the files are the ones it names (docs/training.md,
"A tiny model that reads").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hkrag.io import atomic_directory, write_json
from hkrag.rag.trace import MERGED_FILE, load_trace
from hkrag.tasks.chain import answer_rows
from hkrag.tasks.common import BASE_DIR, CONF_DIR, FINAL_ADAPTER

MANIFEST_FILE = "manifest.json"
CONFIG_KEYS = ("model", "loss", "optim", "trainer", "data.synthetic", "data.train")
"""The settings that decide a retriever's weights (where the data lives and where the run wrote do not)."""
GENERATOR_CONFIG_KEYS = ("model", "generator_training", "generator.prompts.single_pass", "generator.top_k",
                         "data.synthetic", "data.train")
"""The settings that decide a generator's weights (``run._target_`` names generator training)."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def training_config(overrides: Sequence[str]) -> dict[str, Any]:
    """What ``train.py`` composes from ``overrides``, resolved, for the keys that decide the weights."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", list(overrides))
    keys = GENERATOR_CONFIG_KEYS if cfg.run._target_.endswith("run_generator_training") else CONFIG_KEYS
    return {key: _resolved(OmegaConf.select(cfg, key)) for key in keys}


def _resolved(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` but the manifest, by path relative to it."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != MANIFEST_FILE}


def ship(run: Path, out: Path, answers: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copy ``run``'s base and final adapter into ``out`` (replaced whole) with its manifest; returns the manifest.

    A retriever's manifest keeps its evaluation after training (``after``); a generator's, ``answers``, what the
    caller measured of it (``--answers``: an ``eval.py`` run of it, summarised by question group)."""
    run, out = Path(run), Path(out)
    overrides_file, report_file = run / ".hydra" / "overrides.yaml", run / "report.json"
    if not (run / BASE_DIR / "config.json").is_file() or not report_file.is_file() or not overrides_file.is_file():
        raise FileNotFoundError(f"{run} is not a finished tiny train.py run: it needs {BASE_DIR}/, report.json and "
                                ".hydra/overrides.yaml")
    overrides = yaml.safe_load(overrides_file.read_text()) or []
    report = json.loads(report_file.read_text())
    with atomic_directory(out) as tmp:
        shutil.copytree(run / BASE_DIR, tmp / BASE_DIR)
        (tmp / FINAL_ADAPTER).mkdir(parents=True)
        for name in ADAPTER_FILES:
            shutil.copy2(run / FINAL_ADAPTER / name, tmp / FINAL_ADAPTER / name)
        manifest = {"command": " ".join(["python train.py", *overrides]), "overrides": overrides,
                    "steps": report["steps"], "config": training_config(overrides), "after": report.get("after"),
                    **({"answers": answers} if answers else {}), "files": file_hashes(tmp)}
        write_json(tmp / MANIFEST_FILE, manifest)
    return manifest


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a finished train.py run of the tiny model")
    parser.add_argument("--out", type=Path, required=True, help="the folder to ship (replaced whole)")
    parser.add_argument("--answers", type=Path, help="a generator's eval.py task=generation run: its relaxed accuracy "
                        "by question group goes into the manifest")
    args = parser.parse_args(argv)
    answers = None
    if args.answers:
        trace = load_trace(args.answers / MERGED_FILE)
        answers = {"eval_run": str(args.answers), "rows": answer_rows([trace], n_resamples=200)}
    manifest = ship(args.run, args.out, answers)
    total = sum((args.out / name).stat().st_size for name in manifest["files"])
    print(f"{args.out}: {len(manifest['files'])} files, {total / 2**20:.2f} MiB; made by: {manifest['command']}")


if __name__ == "__main__":
    main()

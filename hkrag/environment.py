"""The machine and library versions a figure came from, recorded beside every report.

A figure from one CPU is that CPU's: the demo's nDCG@5 moves by several points between ATen's AVX-512, AVX2 and
scalar kernels (README, "What the demo shows"), so every report carries :func:`environment` (``environment.json``
in the run folder, a ``Machine:`` line in the Markdown) and a reader can tell which kernel path and versions
produced it.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from hkrag.io import write_json

ENVIRONMENT_FILE = "environment.json"
"""Written into a run folder by :func:`record_environment`."""
LIBRARIES = ("torch", "transformers", "peft", "accelerate", "numpy", "faiss-cpu", "bm25s", "tokenizers", "pillow")
"""The distributions whose versions can move a figure (kernels, tokenisation, image resampling, search)."""


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str]:
    """Installed versions of ``names`` (absent ones are left out)."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def environment() -> dict[str, Any]:
    """CPU (model, cores, ATen's kernel capability and its ``ATEN_CPU_CAPABILITY`` override), GPU, threads,
    Python and library versions."""
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": sys.platform,
        "libraries": library_versions(),
    }


def describe(env: dict[str, Any] | None = None) -> str:
    """One line for a report: CPU, kernel capability, threads, GPU and the main libraries' versions."""
    env = env or environment()
    libs = ", ".join(f"{name} {version}" for name, version in env["libraries"].items())
    return (f"{env['cpu']} ({env['cpu_count']} cores, ATen {env['cpu_capability']}, {env['torch_threads']} threads); "
            f"{env['gpu'] or 'no GPU'}; Python {env['python']}; {libs}")


def record_environment(directory: str | Path) -> dict[str, Any]:
    """Write :func:`environment` to ``<directory>/environment.json`` (atomically) and return it."""
    env = environment()
    write_json(Path(directory) / ENVIRONMENT_FILE, env)
    return env

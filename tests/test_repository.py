"""The repository's own text files: nothing a merge left unresolved, and what the README and docs say about the
repository itself (the shipped weights' size, the pinned colpali-engine install) true of it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _colpali import INSTALL as COLPALI_INSTALL

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("agents", "bench", "conf", "docs", "hkrag", "scripts", "slurm", "tests")
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg"}
MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.MULTILINE)


def text_files() -> list[Path]:
    """README, pyproject and every text file under the project's folders."""
    found = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in FOLDERS:
        found += [path for path in sorted((ROOT / folder).rglob("*")) if path.suffix in SUFFIXES and path.is_file()]
    return found


def test_no_file_holds_a_merge_conflict_marker():
    files = text_files()
    assert len(files) > 100
    marked = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
              for path in files for text in [path.read_text(errors="replace")] for match in MARKER.finditer(text)]
    assert marked == [], f"unresolved merge conflicts at {marked}"


def tracked_sizes(folder: str) -> list[int]:
    """The sizes in bytes of the files git tracks under ``folder`` (skipped outside a git checkout)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    names = subprocess.run(["git", "ls-files", "-z", folder], cwd=ROOT, capture_output=True, check=True).stdout
    return [(ROOT / name).stat().st_size for name in names.decode().split("\0") if name]


def test_readme_states_the_shipped_weights_size():
    """README's `weights/` figures (MiB, bytes, files) are the tracked files' total, so they cannot go stale."""
    readme = (ROOT / "README.md").read_text()
    sizes = tracked_sizes("weights")
    total = re.search(r"`weights/`, ([\d.]+) MiB in all: ([\d,]+) bytes in (\d+) tracked files", readme)
    assert total, "README's `weights/` size statement is not where this test reads it"
    mib = f"{sum(sizes) / 2**20:.1f}"
    assert (total[1], int(total[2].replace(",", "")), int(total[3])) == (mib, sum(sizes), len(sizes))
    intro = re.search(r"shipped tiny\s+weights are ([\d.]+) MiB in the repository", readme)
    assert intro and intro[1] == mib


def test_docs_install_colpali_engine_at_the_tested_version():
    """Every `pip install colpali-engine` the documents show is the pinned one the comparison tests name."""
    installs = [(path.relative_to(ROOT), match[0].strip()) for path in text_files() if path.suffix == ".md"
                for match in re.finditer(r"pip install colpali[-_]engine[^`\n]*", path.read_text())]
    assert installs, "no document says how to install colpali-engine for the comparison tests"
    assert [(path, text) for path, text in installs if text != COLPALI_INSTALL] == []

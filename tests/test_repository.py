"""The repository's own text files: nothing a merge left unresolved."""

from __future__ import annotations

import re
from pathlib import Path

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

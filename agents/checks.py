"""Value checks of the ``generator`` config group: each problem reads ``key=value: expected …``.

The wording is that of the other groups' checks (``hkrag/tasks/validation.py``), so the one ``ConfigError``
of a run lists every problem alike (docs/errors.md). Each function returns the problem, or ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def number_problem(key: str, value: object, *, integer: bool, low: float, high: float | None = None,
                   low_open: bool = False) -> str | None:
    """``value`` must be a finite number (an integer when ``integer``; never a bool) ``>= low`` (``> low``
    when ``low_open``) and, with ``high``, ``<= high``."""
    numeric = (int,) if integer else (int, float)
    bad = isinstance(value, bool) or not isinstance(value, numeric) or not math.isfinite(value)
    if not bad:
        bad = (value <= low if low_open else value < low) or (high is not None and value > high)
    if not bad:
        return None
    bounds = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
    return f"{key}={value!r}: expected {'an integer' if integer else 'a number'} {bounds}"


def choice_problem(key: str, value: object, choices: Sequence[str]) -> str | None:
    """``value`` must be one of ``choices``."""
    return None if value in choices else f"{key}={value!r}: expected one of {list(choices)}"


def flag_problem(key: str, value: object) -> str | None:
    """``value`` must be ``true`` or ``false`` (a string such as ``yes`` is truthy and would be misread)."""
    return None if isinstance(value, bool) else f"{key}={value!r}: expected true or false"

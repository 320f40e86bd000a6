"""Allowed ranges of numeric settings: one :class:`Rule` per kind of value, checked where the value enters.

The config validator (:mod:`hkrag.tasks.validation`) checks Hydra values against its table of rules; command
line tools take their numbers through :meth:`Rule.arg` (an ``argparse`` ``type=``) and spec parsers through
:meth:`Rule.check`, so ``--processes 0``, ``--k nan`` or ``rerank=-1`` fail at once with the allowed range
instead of crashing deep inside or, worse, being read as "not given". :func:`parse_size` is the one parser of
memory sizes (``80GB``, ``79.6GiB``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

GIB = 2**30
LARGEST_MEMORY = 2**50
"""1 PiB: a memory size above it is a typo (an extra digit, bytes given as GB)."""


@dataclass(frozen=True)
class Rule:
    """An allowed value: ``kind`` ``int`` or ``float`` in ``[low, high]`` (``low_open``: ``> low``, ``high_open``:
    ``< high``), or null."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False

    def problem(self, value: object) -> str | None:
        """Why ``value`` breaks the rule, or ``None``."""
        if value is None:
            return None if self.nullable else f"expected {self.describe()}"
        numeric = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric) or not math.isfinite(value):
            return f"expected {self.describe()}"
        below = value <= self.low if self.low_open else value < self.low if self.low is not None else False
        above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        return f"expected {self.describe()}" if below or above else None

    def describe(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            bounds.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        text = f"{noun} {' and '.join(bounds)}".strip()
        return f"{text} or null" if self.nullable else text

    def check(self, name: str, value: object) -> object:
        """``value`` if it keeps the rule, else a ``ValueError`` naming ``name``, the value and the range."""
        problem = self.problem(value)
        if problem:
            raise ValueError(f"{name}={value!r}: {problem}")
        return value

    def parse(self, name: str, text: str) -> int | float:
        """``text`` read as this rule's kind and checked (``ValueError`` naming ``name`` and the range)."""
        try:
            value = int(text) if self.kind is int else float(text)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={text!r}: {self.problem(None) or 'expected ' + self.describe()}") from None
        return self.check(name, value)

    @property
    def arg(self) -> Callable[[str], int | float]:
        """An ``argparse`` ``type=``: the option's text read and checked; the error says the allowed range."""

        def read(text: str) -> int | float:
            try:
                return self.parse("value", text)
            except ValueError as error:
                raise argparse.ArgumentTypeError(f"{text!r}: expected {self.describe()}") from error

        return read


INTEGER = Rule(int)
"""Any integer: the first reading of a spec's field, before its own rule."""
POSITIVE = Rule(int, low=1)
OPTIONAL_POSITIVE = Rule(int, low=1, nullable=True)
NON_NEGATIVE = Rule(int, low=0)
FRACTION = Rule(float, low=0, high=1)
POSITIVE_NUMBER = Rule(float, low=0, low_open=True)
PROBABILITY = Rule(float, low=0, low_open=True, high=1)
"""A target or confidence level: in (0, 1]."""
PROCESSES = Rule(int, low=1, high=65536)
"""Data-parallel processes: more than 65,536 is a typo."""
CONFIDENCE = Rule(float, low=0.5, high=1, high_open=True)
"""A one-sided confidence level: 0.5 (the mean itself) up to, not including, 1."""
PQ_BITS = Rule(int, low=1, high=16)
"""Bits per product-quantiser code (FAISS trains ``2**nbits`` centroids per sub-quantiser; above 16 it refuses)."""


def parse_size(text: str) -> int:
    """``80GB`` / ``80`` (GB, as GPUs are sold) or ``79.6GiB`` -> bytes; ``ValueError`` unless in (0, 1 PiB]."""
    value = str(text).strip().upper()
    scale = GIB if value.endswith("GIB") else 10**9
    try:
        number = float(value.removesuffix("GIB").removesuffix("GB"))
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and 0 < number * scale <= LARGEST_MEMORY):
        raise ValueError(f"{text!r} is not a memory size: expected a number > 0 of GB (or GiB) up to "
                         f"{LARGEST_MEMORY / 10**12:.0f} TB, e.g. 80GB, 24, 79.6GiB")
    return int(number * scale)


def memory_size(text: str) -> int:
    """``argparse`` ``type=`` of a memory size (:func:`parse_size`)."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None

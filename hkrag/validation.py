"""Config validation: every numeric setting checked once, up front, against one table.

Hydra checks key names; this checks values. ``train.py`` and ``eval.py`` call :func:`validate_config`
before building anything, so ``trainer.global_batch_size=abc`` or ``loss.tau=0`` fails in a second
with every problem listed (key, value, allowed range) instead of a traceback minutes later or, worse,
a run that "succeeds" after 0 steps. Keys absent from the composed config are skipped (each task
composes only the groups it needs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from hkrag.lvlm.uncertainty import ESTIMATORS


class ConfigError(ValueError):
    """One or more config values of the wrong type or out of range; the message lists each key and value."""


@dataclass(frozen=True)
class Rule:
    """An allowed value: ``kind`` ``int`` or ``float`` in ``[low, high]`` (``low_open``: ``> low``), or null."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    nullable: bool = False

    def problem(self, value: object) -> str | None:
        """Why ``value`` breaks the rule, or ``None``."""
        if value is None:
            return None if self.nullable else f"expected {self.describe()}"
        numeric = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric) or not math.isfinite(value):
            return f"expected {self.describe()}"
        below = value <= self.low if self.low_open else value < self.low if self.low is not None else False
        above = self.high is not None and value > self.high
        return f"expected {self.describe()}" if below or above else None

    def describe(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            bounds.append(f"<= {self.high:g}")
        text = f"{noun} {' and '.join(bounds)}".strip()
        return f"{text} or null" if self.nullable else text


POSITIVE = Rule(int, low=1)
OPTIONAL_POSITIVE = Rule(int, low=1, nullable=True)
FRACTION = Rule(float, low=0, high=1)

RULES: dict[str, Rule] = {
    "trainer.global_batch_size": POSITIVE,
    "trainer.chunk_size": OPTIONAL_POSITIVE,
    "trainer.epochs": POSITIVE,
    "trainer.max_steps": OPTIONAL_POSITIVE,
    "trainer.seed": Rule(int, low=0),
    "trainer.log_every": POSITIVE,
    "trainer.save_every": OPTIONAL_POSITIVE,
    "trainer.num_workers": Rule(int, low=0),
    "trainer.num_threads": OPTIONAL_POSITIVE,
    "optim.lr": Rule(float, low=0, low_open=True),
    "optim.weight_decay": Rule(float, low=0),
    "optim.warmup_ratio": FRACTION,
    "optim.max_grad_norm": Rule(float, low=0, low_open=True, nullable=True),
    "loss.tau": Rule(float, low=0, low_open=True),
    "loss.alpha": Rule(float, low=0),
    "loss.beta": Rule(float, low=0),
    "loss.num_sub_masks": POSITIVE,
    "model.num_crops": OPTIONAL_POSITIVE,
    "eval.top_k": POSITIVE,
    "eval.query_batch_size": POSITIVE,
    "eval.doc_batch_size": POSITIVE,
    "eval.shard_size": POSITIVE,
    "rag.top_k": POSITIVE,
    "rag.max_queries": OPTIONAL_POSITIVE,
    "rag.concurrency": POSITIVE,
    "generator.top_k": POSITIVE,
    "generator.threshold": Rule(float, low=0),
    "generator.top_logprobs": Rule(int, low=0, high=20),
    "generator.caps.max_iters": POSITIVE,
    "generator.caps.max_calls": POSITIVE,
    "generator.caps.max_total_tokens": POSITIVE,
    "generator.caps.max_seconds": Rule(float, low=0, low_open=True),
}
"""Config key -> allowed values. Add a row here when a group gains a numeric setting."""

CHOICES: dict[str, tuple[str, ...]] = {
    "eval.dtype": ("float16", "float32"),
    "model.kind": ("tiny", "phi3v"),
    "generator.estimator": ESTIMATORS,
}


def validate_config(cfg: DictConfig) -> None:
    """Check every key of :data:`RULES` / :data:`CHOICES` present in ``cfg``; raise one :class:`ConfigError`."""
    problems = []
    for key, rule in RULES.items():
        present, value = _lookup(cfg, key)
        problem = rule.problem(value) if present else None
        if problem:
            problems.append(f"{key}={value!r}: {problem}")
    for key, allowed in CHOICES.items():
        present, value = _lookup(cfg, key)
        if present and value not in allowed:
            problems.append(f"{key}={value!r}: expected one of {list(allowed)}")
    if problems:
        raise ConfigError("invalid config value(s):\n  " + "\n  ".join(problems))


def _lookup(cfg: DictConfig, key: str) -> tuple[bool, object]:
    sentinel = object()
    value = OmegaConf.select(cfg, key, default=sentinel, throw_on_missing=False)
    return value is not sentinel, value

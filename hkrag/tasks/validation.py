"""Config validation: every numeric setting checked once, up front, against one table.

Hydra checks key names; this checks values. ``train.py`` and ``eval.py`` call :func:`validate_config`
before building anything, so ``trainer.global_batch_size=abc`` or ``loss.tau=0`` fails in a second
with every problem listed (key, value, allowed range) instead of a traceback minutes later or, worse,
a run that "succeeds" after 0 steps. Keys absent from the composed config are skipped (each task
composes only the groups it needs). The ``generator`` group is checked by its own config class, whose
problems ``eval.py task=rag|generation`` hands in as ``extra`` (see :data:`RULES`). For those tasks the
settings that depend on each other are checked too (:func:`rag_problems`): names of data sets and
pools, flags, and ``rag.top_k`` against the Pruner's buffer ``generator.top_k``.
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from hkrag.lvlm import backend_class
from hkrag.ranges import FRACTION, OPTIONAL_POSITIVE, POSITIVE, Rule


class ConfigError(ValueError):
    """One or more config values of the wrong type or out of range; the message lists each key and value."""


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
    "trainer.hard_negatives": Rule(int, low=0),
    "trainer.diagnostics_every": Rule(int, low=0),
    "trainer.eval_every": Rule(int, low=0),
    "optim.lr": Rule(float, low=0, low_open=True),
    "optim.weight_decay": Rule(float, low=0),
    "optim.warmup_ratio": FRACTION,
    "optim.max_grad_norm": Rule(float, low=0, low_open=True, nullable=True),
    "loss.tau": Rule(float, low=0, low_open=True),
    "loss.alpha": Rule(float, low=0),
    "loss.beta": Rule(float, low=0),
    "loss.num_sub_masks": POSITIVE,
    "loss.infonce_weight": Rule(float, low=0, nullable=True),
    "model.num_crops": OPTIONAL_POSITIVE,
    "model.late_interaction.dim": POSITIVE,
    "model.late_interaction.query_augmentation": Rule(int, low=0),
    "eval.top_k": POSITIVE,
    "eval.query_batch_size": POSITIVE,
    "eval.doc_batch_size": POSITIVE,
    "eval.shard_size": POSITIVE,
    "retriever.k1": Rule(float, low=0),
    "retriever.b": FRACTION,
    "retriever.epsilon": Rule(float, low=0),
    "retriever.chunk_chars": OPTIONAL_POSITIVE,
    "retriever.lexical.k1": Rule(float, low=0),
    "retriever.lexical.b": FRACTION,
    "retriever.rrf_k": Rule(float, low=0),
    "retriever.dense_weight": FRACTION,
    "retriever.fusion_depth": POSITIVE,
    "degradation.seed": Rule(int, low=0),
    "degradation.ocr_workers": POSITIVE,
    "degradation.ocr.psm": Rule(int, low=0, high=13),
    "degradation.ocr.upscale": Rule(float, low=0, low_open=True, high=8),
    "rag.top_k": POSITIVE,
    "rag.max_queries": OPTIONAL_POSITIVE,
    "rag.concurrency": POSITIVE,
    "generator_training.max_queries": OPTIONAL_POSITIVE,
    "generator_training.optim.batch_size": POSITIVE,
    "generator_training.optim.grad_accum": POSITIVE,
    "generator_training.optim.lr": Rule(float, low=0, low_open=True),
    "generator_training.optim.weight_decay": Rule(float, low=0),
    "generator_training.optim.warmup_ratio": FRACTION,
    "generator_training.optim.max_grad_norm": Rule(float, low=0, low_open=True, nullable=True),
    "generator_training.optim.epochs": POSITIVE,
    "generator_training.optim.max_steps": OPTIONAL_POSITIVE,
    "generator_training.optim.seed": Rule(int, low=0),
    "generator_training.optim.log_every": POSITIVE,
    "generator_training.optim.save_every": Rule(int, low=0),
    "generator_training.optim.num_workers": Rule(int, low=0),
}
"""Config key -> allowed values. Add a row here when a group gains a numeric setting. The ``generator``
group has no rows: its config class checks it (``agents.pipeline.GeneratorConfig.problems``), and the task
that builds the generator passes those problems in as ``extra`` (``hkrag.tasks`` names ``agents`` only
there, ``hkrag/tasks/rag.py``)."""

CHOICES: dict[str, tuple[str, ...]] = {
    "eval.dtype": ("float16", "float32"),
    "model.kind": ("tiny", "phi3v"),
    "model.head": ("dense", "late_interaction"),
    "retriever.fusion": ("rrf", "sum"),
    "loss.masked_similarity": ("cosine", "dot"),
}

FLAGS = ("rag.resume", "loss.balanced_split", "loss.pairwise", "retriever.allow_empty", "retriever.lower")
"""Keys that take ``true`` or ``false`` only (a string such as ``yes`` is truthy and would be misread)."""

RAG_TASKS = ("rag", "generation")
POOLS = ("single", "all")
BACKEND_KEYS = ("lvlm", "judge.backend")
"""LVLM configs of the RAG tasks; each ``_target_`` must name a backend class (a null ``judge.backend``: no judge)."""


def validate_config(cfg: DictConfig, extra: Sequence[str] = ()) -> None:
    """Check every key of :data:`RULES` / :data:`CHOICES` / :data:`FLAGS` present in ``cfg`` and, for the
    RAG tasks, :func:`rag_problems`; raise one :class:`ConfigError` listing those and the ``extra`` problems."""
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
    for key in FLAGS:
        present, value = _lookup(cfg, key)
        if present and not isinstance(value, bool):
            problems.append(f"{key}={value!r}: expected true or false")
    problems += rag_problems(cfg) + backend_problems(cfg) + list(extra)
    if problems:
        raise ConfigError("invalid config value(s):\n  " + "\n  ".join(problems))


def rag_problems(cfg: DictConfig) -> list[str]:
    """The settings of ``eval.py task=rag|generation`` that a range cannot check (none for other tasks).

    ``rag.datasets`` and ``rag.pools`` must be non-empty lists of distinct names (pools: ``single``,
    ``all``), ``rag.split`` a name, and ``rag.top_k`` at least ``generator.top_k``: the Pruner fills a
    buffer of ``generator.top_k`` pages from the ``rag.top_k`` it is handed, so fewer could never fill it.
    """
    if task_name(cfg) not in RAG_TASKS:
        return []
    problems = [_names_problem(cfg, "rag.datasets"), _names_problem(cfg, "rag.pools", POOLS)]
    present, split = _lookup(cfg, "rag.split")
    if present and not (isinstance(split, str) and split.strip()):
        problems.append(f"rag.split={split!r}: expected the name of a split, e.g. test")
    _, rag_k = _lookup(cfg, "rag.top_k")
    _, generator_k = _lookup(cfg, "generator.top_k")
    numbers = all(isinstance(k, int) and not isinstance(k, bool) for k in (rag_k, generator_k))
    if numbers and cfg.get("retrieval") != "none" and rag_k < generator_k:
        problems.append(f"rag.top_k={rag_k} < generator.top_k={generator_k}: the generator is handed {rag_k} "
                        f"page(s) but keeps up to {generator_k} (the Pruner's buffer could never fill); set "
                        f"rag.top_k >= {generator_k} or generator.top_k <= {rag_k}")
    return [problem for problem in problems if problem]


def backend_problems(cfg: DictConfig) -> list[str]:
    """Why an LVLM config of :data:`BACKEND_KEYS` names no backend class (RAG tasks only; imports its module)."""
    if task_name(cfg) not in RAG_TASKS:
        return []
    problems = []
    for key in BACKEND_KEYS:
        present, value = _lookup(cfg, key)
        if not present or value is None:
            continue
        try:
            backend_class(value.get("_target_") if OmegaConf.is_dict(value) else None)
        except ValueError as error:
            problems.append(f"{key}.{error}")
    return problems


def task_name(cfg: DictConfig) -> str | None:
    """The ``name`` of ``eval.py``'s task (``conf/task``), or ``None`` (``train.py``)."""
    present, name = _lookup(cfg, "task.name")
    return name if present else None


def _names_problem(cfg: DictConfig, key: str, allowed: tuple[str, ...] | None = None) -> str | None:
    """Why the list of names at ``key`` is unusable, or ``None``."""
    present, value = _lookup(cfg, key)
    if not present:
        return None
    names = OmegaConf.to_container(value) if OmegaConf.is_list(value) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
        return f"{key}={names!r}: expected a non-empty list of names"
    if len(set(names)) != len(names):
        return f"{key}={names!r}: a name is listed twice"
    unknown = [n for n in names if allowed is not None and n not in allowed]
    return f"{key}={names!r}: {unknown} not among {list(allowed)}" if unknown else None


def _lookup(cfg: DictConfig, key: str) -> tuple[bool, object]:
    sentinel = object()
    value = OmegaConf.select(cfg, key, default=sentinel, throw_on_missing=False)
    return value is not sentinel, value

"""The rankers an evaluation's ``retriever`` config names, bound to what they need: the visual retriever the
evaluation loads once (:class:`VisualModel`) and, for a reranker (``retriever=rerank``), a page scorer built at
the composition root (:func:`hkrag.tasks.rag.page_scorer`). Shared by ``eval.py task=retrieval|baselines``
(:mod:`hkrag.tasks.retrieval`) and ``task=rag`` (:mod:`hkrag.tasks.rag`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from hkrag.retrieval.evaluation import DenseRanker, Ranker, RetrievalEvalConfig
from hkrag.retrieval.rerank import RerankRanker
from hkrag.retriever import Phi3VRetriever
from hkrag.tasks.common import build_retriever, evaluated_model


def needs_model(factories: dict[str, Any]) -> bool:
    """Whether a ranker needs the visual model: a partial, or a reranker whose first stage is one."""
    return any(isinstance(factory.keywords.get("first"), functools.partial) if reranks(factory)
               else isinstance(factory, functools.partial) for factory in factories.values())


def reranks(factory: Any) -> bool:
    """Whether an instantiated ``retriever`` config is a reranker (``retriever=rerank``)."""
    return isinstance(factory, functools.partial) and factory.func is RerankRanker


class VisualModel:
    """The visual retriever an evaluation names (``model`` / ``run_dir``, :func:`~hkrag.tasks.common.evaluated_model`),
    loaded onto ``device`` on first use and shared by every dense ranker built from it."""

    def __init__(self, cfg: DictConfig, device: torch.device | str):
        self.model_cfg, self.identity = evaluated_model(cfg)
        self.device = device
        self._retriever: Phi3VRetriever | None = None

    def ranker(self, settings: RetrievalEvalConfig, work_dir: Path) -> DenseRanker:
        """A :class:`DenseRanker` of the model, its embedding shards under ``work_dir``."""
        if self._retriever is None:
            self._retriever = build_retriever(self.model_cfg, trainable=False)
            self._retriever.model.to(self.device)
        return DenseRanker(self._retriever, settings, work_dir, self.identity)


def bind_ranker(
    factory: Ranker | functools.partial, model: VisualModel | None, settings: RetrievalEvalConfig, work_dir: Path,
    scorer: Any = None,
) -> Ranker:
    """The ranker of an instantiated ``retriever`` config: itself, or (a partial) given ``model``'s
    :class:`DenseRanker` searching into ``work_dir``: as the ranker (``dense``) or handed to it as ``dense``; a
    reranker (``retriever=rerank``) gets its first stage bound alike and ``scorer``."""
    if reranks(factory):
        if scorer is None:
            raise ValueError("retriever=rerank needs a page scorer (hkrag.tasks.rag.page_scorer)")
        return factory(first=bind_ranker(factory.keywords["first"], model, settings, work_dir), scorer=scorer)
    if not isinstance(factory, functools.partial):
        return factory
    dense = model.ranker(settings, work_dir)
    return dense if factory.func is DenseRanker else factory(dense=dense)

"""Our visual retriever and our corpora in MTEB's terms (``pip install "hkrag[mteb]"``; docs/evaluation.md,
"MTEB / ViDoRe").

:class:`MTEBRetriever` is a :class:`~hkrag.retriever.Phi3VRetriever` as an MTEB encoder: text queries get the
OpenDocVQA retrieval instruction our evaluation uses (:func:`query_text`; MTEB's own task prompts are not used,
since the retriever was trained with ours), documents are page images through the retriever's processor, and
:func:`model_meta` names the model in MTEB's result files. :func:`local_task` turns a QA set and a corpus in our
schema into an MTEB retrieval task, so MTEB's evaluation can be checked offline against
:func:`hkrag.retrieval.evaluation.evaluate_retrieval` on the same data (the built-in corpus in the tests).

MTEB is imported by this module and :mod:`hkrag.tasks.mteb` only, so ``import hkrag`` does not need it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
from tqdm.auto import tqdm

from hkrag.data.opendocvqa import QUERY_PREFIX, Corpus, QAExample, format_query, qrels
from hkrag.retriever import Phi3VRetriever, weights_fingerprint

try:
    from mteb.abstasks.retrieval import AbsTaskRetrieval
    from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
    from mteb.abstasks.task_metadata import TaskMetadata
    from mteb.models.abs_encoder import AbsEncoder
    from mteb.models.model_meta import ModelMeta, ScoringFunction
    from mteb.types import PromptType
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise ImportError('MTEB is not installed: pip install "hkrag[mteb]" (or pip install mteb)') from error

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

ADAPTER_SUFFIX = ("checkpoints", "final", "adapter")
"""The tail of a ``train.py`` run's final adapter path; the run's folder names the model."""
LOCAL_REVISION = "local"
HUB_ID = r"[\w.-]+/[\w.-]+"
"""A model name as MTEB and the hub write it: ``organisation/model``."""


def query_text(text: str) -> str:
    """``text`` with the OpenDocVQA retrieval instruction (:func:`~hkrag.data.opendocvqa.format_query`), once:
    an already formatted query (our own QA sets store them so) is left as is."""
    return text if text.startswith(QUERY_PREFIX) else format_query(text)


def model_name(base: str | Path, adapter: str | Path | None = None) -> str:
    """The model's name in MTEB's results: the adapter's (a hub id as is; a ``train.py`` run's folder name, or
    else the adapter folder's name, under ``hkrag/``), or likewise the base's when there is no adapter."""
    path = Path(adapter if adapter is not None else base)
    if is_hub_id(path):
        return str(path)
    run = path.parents[len(ADAPTER_SUFFIX) - 1] if path.parts[-len(ADAPTER_SUFFIX):] == ADAPTER_SUFFIX else path
    return f"hkrag/{run.resolve().name}"


def is_hub_id(name: str | Path) -> bool:
    """Whether ``name`` reads as a Hugging Face Hub id (``org/model``) rather than a local folder."""
    return bool(re.fullmatch(HUB_ID, str(name))) and not Path(name).exists()


def check_model_name(name: str) -> str:
    """``name`` if MTEB can file results under it (``organisation/model``), else a ``ValueError`` naming it."""
    if not re.fullmatch(HUB_ID, name):
        raise ValueError(f"MTEB model name {name!r} must read 'organisation/model' (letters, digits, '.', '_' or "
                         "'-' around one '/')")
    return name


def model_meta(retriever: Phi3VRetriever, name: str, revision: str | None = None) -> ModelMeta:
    """MTEB's metadata of ``retriever``: ``name`` (``org/model``), ``revision`` (default: a fingerprint of its
    weights, so two checkpoints never share a results folder), parameter count and embedding size."""
    config = retriever.backbone.config
    return ModelMeta(
        loader=None, name=check_model_name(name), revision=revision or weights_fingerprint(retriever),
        release_date=None, languages=["eng-Latn"], n_parameters=sum(p.numel() for p in retriever.model.parameters()),
        memory_usage_mb=None, max_tokens=getattr(config, "max_position_embeddings", None),
        embed_dim=config.hidden_size, license=None, open_weights=None, public_training_code=None,
        public_training_data=None, framework=["PyTorch", "Transformers"], reference=None,
        similarity_fn_name=ScoringFunction.COSINE, use_instructions=True, training_datasets=None,
        modalities=["image", "text"], model_type=["dense"],
    )


class MTEBRetriever(AbsEncoder):
    """A :class:`Phi3VRetriever` as an MTEB encoder: queries are texts (our instruction added), documents are
    page images; embeddings are L2-normalised, so MTEB's cosine similarity is our FAISS inner product."""

    def __init__(self, retriever: Phi3VRetriever, meta: ModelMeta) -> None:
        self.model = retriever
        self.mteb_model_meta = meta

    def encode(
        self,
        inputs: DataLoader,
        *,
        task_metadata: TaskMetadata,
        hf_split: str,
        hf_subset: str,
        prompt_type: PromptType | None = None,
        show_progress_bar: bool = True,
        **kwargs: Any,
    ) -> np.ndarray:
        """Embeddings of the queries (``prompt_type`` query: the ``text`` column) or the pages (else: the
        ``image`` column) of ``inputs``, one batch of MTEB's loader at a time."""
        column = "text" if prompt_type == PromptType.query else "image"
        if column not in inputs.dataset.column_names:
            raise ValueError(f"MTEB task {task_metadata.name} ({hf_subset}/{hf_split}): its "
                             f"{prompt_type or 'document'}s have no {column!r} column (columns: "
                             f"{inputs.dataset.column_names}); this retriever reads text queries and page images")
        encode = self._queries if column == "text" else self._pages
        batches = tqdm(inputs, desc=f"{task_metadata.name} {column}s", disable=not show_progress_bar)
        was_training = self.model.training
        self.model.eval()
        try:
            out = [encode(batch[column]).float().numpy() for batch in batches]
        finally:
            self.model.train(was_training)
        return np.concatenate(out) if out else np.empty((0, self.mteb_model_meta.embed_dim), np.float32)

    def _queries(self, texts: Sequence[str]) -> torch.Tensor:
        return self.model.encode_queries([query_text(text) for text in texts], batch_size=len(texts))

    def _pages(self, images: Sequence[Any]) -> torch.Tensor:
        return self.model.encode_documents([image.convert("RGB") for image in images], batch_size=len(images))


class LocalRetrievalTask(AbsTaskRetrieval):
    """An MTEB retrieval task over data already in memory (:func:`local_task`); ``load_data`` loads nothing."""

    def __init__(self, metadata: TaskMetadata, split: RetrievalSplitData) -> None:
        self.metadata = metadata
        super().__init__()
        self.dataset = {"default": {metadata.eval_splits[0]: split}}
        self.data_loaded = True

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        """The data is given at construction."""


def local_task(qa: Sequence[QAExample], corpus: Corpus, name: str, split: str = "test") -> LocalRetrievalTask:
    """The retrieval task "rank ``corpus``'s pages for ``qa``'s questions" in MTEB's format: queries are the
    questions without our instruction (as MTEB's tasks give them), documents the page images, and qrels our
    ``relevant_doc_ids`` (:func:`hkrag.data.opendocvqa.qrels`). Scored on nDCG@5, as ViDoRe is."""
    if not qa or not len(corpus):
        raise ValueError(f"local MTEB task {name!r} needs questions and pages, got {len(qa)} and {len(corpus)}")
    queries = datasets.Dataset.from_dict({"id": [ex.query_id for ex in qa],
                                          "text": [ex.query.removeprefix(QUERY_PREFIX) for ex in qa]})
    pages = datasets.Dataset.from_dict({"id": list(corpus.doc_ids), "image": [page.image for page in corpus]},
                                       features=datasets.Features({"id": datasets.Value("string"),
                                                                   "image": datasets.Image()}))
    metadata = TaskMetadata(
        name=name, description=f"Retrieve the pages of {corpus.name} that answer each question.",
        dataset={"path": str(corpus.name), "revision": LOCAL_REVISION}, type="DocumentUnderstanding",
        category="t2i", modalities=["text", "image"], eval_splits=[split], eval_langs=["eng-Latn"],
        main_score="ndcg_at_5", task_subtypes=["Image Text Retrieval"],
    )
    return LocalRetrievalTask(metadata, RetrievalSplitData(corpus=pages, queries=queries, relevant_docs=qrels(qa),
                                                           top_ranked=None))

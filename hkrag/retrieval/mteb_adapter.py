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

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
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

PHI3V = "microsoft/Phi-3-vision-128k-instruct"
OPENDOCVQA = "NTT-hil-insight/OpenDocVQA"
OPENDOCVQA_IN_MTEB = frozenset({"VidoreInfoVQARetrieval"})
"""MTEB tasks drawn from a data set OpenDocVQA trains on: InfoVQA (the HKRAG paper's Table 2 marks its InfoVQA test
as having training samples in OpenDocVQA; ChartQA and SlideVQA are zero-shot there). Whether OpenDocVQA also trains
on DocVQA was not checked, so ``VidoreDocVQARetrieval`` is not listed."""
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    # https://huggingface.co/microsoft/Phi-3-vision-128k-instruct: "License: mit"; its commit history shows the files
    # uploaded on 2024-05-20 and the model card published on 2024-05-21 (announced at Microsoft Build that day).
    # Its training data (Phi-3 technical report: public documents, image-text data, synthetic data) holds no MTEB
    # task that is known, hence None (unknown), not an empty set.
    PHI3V: {"release_date": "2024-05-21", "license": "mit", "open_weights": True,
            "reference": f"https://huggingface.co/{PHI3V}", "training_datasets": None},
    # VDocRAG (Tanaka et al., CVPR 2025, arXiv:2504.09795): the VDocRAG model cards on the hub say the models were
    # trained on NTT-hil-insight/OpenDocVQA (with the corpus NTT-hil-insight/OpenDocVQA-Corpus) from Phi-3-vision.
    # Public weights (a peft adapter on the hub); its licence and release date were not found in what we could
    # check, so they stay None.
    "NTT-hil-insight/VDocRetriever-Phi3-vision": {
        "open_weights": True, "reference": "https://huggingface.co/NTT-hil-insight/VDocRetriever-Phi3-vision",
        "adapted_from": PHI3V, "public_training_data": f"https://huggingface.co/datasets/{OPENDOCVQA}",
        "training_datasets": set(OPENDOCVQA_IN_MTEB)},
}
"""What is known of the public models this retriever loads, for :func:`model_meta` (sources in the comments)."""


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


def model_meta(retriever: Phi3VRetriever, name: str, revision: str | None = None, base: str | Path | None = None,
               adapter: str | Path | None = None) -> ModelMeta:
    """MTEB's metadata of ``retriever``: ``name`` (``org/model``), ``revision`` (default: a fingerprint of its
    weights, so two checkpoints never share a results folder), parameter count and embedding size, and what is
    known of the model it loads (:func:`known_facts` of ``base`` and ``adapter``; unknown fields stay None)."""
    config = retriever.backbone.config
    facts = {"release_date": None, "license": None, "open_weights": None, "public_training_data": None,
             "reference": None, "training_datasets": None, **known_facts(base, adapter)}
    if retriever.late_interaction:  # MTEB 2.x's late-interaction interface: token vectors scored by MaxSim
        kind = {"embed_dim": retriever.causal_lm.custom_text_proj.out_features,
                "similarity_fn_name": ScoringFunction.MAX_SIM, "model_type": ["late-interaction"]}
    else:
        kind = {"embed_dim": config.hidden_size, "similarity_fn_name": ScoringFunction.COSINE, "model_type": ["dense"]}
    return ModelMeta(
        loader=None, name=check_model_name(name), revision=revision or weights_fingerprint(retriever),
        languages=["eng-Latn"], n_parameters=sum(p.numel() for p in retriever.model.parameters()),
        memory_usage_mb=None, max_tokens=getattr(config, "max_position_embeddings", None),
        public_training_code=None, framework=["PyTorch", "Transformers"], use_instructions=True,
        modalities=["image", "text"], **kind, **facts,
    )


def known_facts(base: str | Path | None, adapter: str | Path | None) -> dict[str, Any]:
    """:data:`KNOWN_MODELS`' entry of the adapter (or, without one, the base); for a ``train.py`` run's adapter, the
    base it adapts (a hub id) and the MTEB tasks among its training data (:func:`run_training_datasets`)."""
    if adapter is None:
        return dict(KNOWN_MODELS.get(str(base), {}))
    if str(adapter) in KNOWN_MODELS:
        return dict(KNOWN_MODELS[str(adapter)])
    facts: dict[str, Any] = {"adapted_from": str(base)} if base is not None and is_hub_id(base) else {}
    return {**facts, "training_datasets": run_training_datasets(Path(adapter))}


def run_training_datasets(adapter: Path) -> set[str] | None:
    """The MTEB tasks among the training data of the ``train.py`` run whose final adapter is ``adapter``, from its
    ``.hydra/config.yaml``: none for the built-in synthetic corpus, :data:`OPENDOCVQA_IN_MTEB` for OpenDocVQA; None
    (unknown) for another data set or when the run's config cannot be read."""
    if adapter.parts[-len(ADAPTER_SUFFIX):] != ADAPTER_SUFFIX:
        return None
    try:
        config = OmegaConf.load(adapter.parents[len(ADAPTER_SUFFIX) - 1] / ".hydra" / "config.yaml")
        data = OmegaConf.to_container(config, resolve=False).get("data") or {}  # as written: no paths to resolve
    except (OSError, OmegaConfBaseException, AttributeError):
        return None
    return set() if data.get("synthetic") else set(OPENDOCVQA_IN_MTEB) if data.get("qa_source") == OPENDOCVQA else None


class MTEBRetriever(AbsEncoder):
    """A :class:`Phi3VRetriever` as an MTEB encoder: queries are texts (our instruction added), documents are
    page images; embeddings are L2-normalised, so MTEB's cosine similarity is our FAISS inner product. Under the
    late-interaction head each text is a ``(tokens, dim)`` array and the encoder returns their list, which MTEB
    scores with its ``MaxSim`` (a sum over query tokens where ours is their mean: the same ranking per query).

    Each query (by its text) and page (by its pixels) is encoded once per encoder: MTEB encodes every task's corpus
    anew, and the tasks of ``benchmark=local`` share their pages (a data set's own pool lies in the ``all`` pool,
    which every data set's ``all`` task ranks again). The embeddings are kept in memory (``embeddings``)."""

    def __init__(self, retriever: Phi3VRetriever, meta: ModelMeta) -> None:
        self.model = retriever
        self.mteb_model_meta = meta
        self.embeddings: dict[tuple[str, str], np.ndarray] = {}

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
    ) -> np.ndarray | list[np.ndarray]:
        """Embeddings of the queries (``prompt_type`` query: the ``text`` column) or the pages (else: the
        ``image`` column) of ``inputs``, one batch of MTEB's loader at a time (late interaction: a list of
        per-item token arrays)."""
        column = "text" if prompt_type == PromptType.query else "image"
        if column not in inputs.dataset.column_names:
            raise ValueError(f"MTEB task {task_metadata.name} ({hf_subset}/{hf_split}): its "
                             f"{prompt_type or 'document'}s have no {column!r} column (columns: "
                             f"{inputs.dataset.column_names}); this retriever reads text queries and page images")
        batches = tqdm(inputs, desc=f"{task_metadata.name} {column}s", disable=not show_progress_bar)
        was_training = self.model.training
        self.model.eval()
        try:
            out = [self._encode_once(column, batch[column]) for batch in batches]
        finally:
            self.model.train(was_training)
        if self.model.late_interaction:
            return [tokens for batch in out for tokens in batch]
        return np.concatenate(out) if out else np.empty((0, self.mteb_model_meta.embed_dim), np.float32)

    def _encode_once(self, column: str, items: Sequence[Any]) -> np.ndarray | list[np.ndarray]:
        """Embeddings of ``items`` (texts or images), encoding only those not encoded before, each once."""
        keys = [(column, query_text(item)) if column == "text" else (column, image_key(item)) for item in items]
        todo = {key: item for key, item in zip(keys, items) if key not in self.embeddings}
        if todo:
            encode = self._queries if column == "text" else self._pages
            self.embeddings.update(zip(todo, (e.float().numpy() for e in encode(list(todo.values())))))
        vectors = [self.embeddings[key] for key in keys]
        return vectors if self.model.late_interaction else np.stack(vectors)

    def _queries(self, texts: Sequence[str]) -> torch.Tensor:
        return self.model.encode_queries([query_text(text) for text in texts], batch_size=len(texts))

    def _pages(self, images: Sequence[Any]) -> torch.Tensor:
        return self.model.encode_documents([image.convert("RGB") for image in images], batch_size=len(images))


def image_key(image: Any) -> str:
    """A page image's identity for :class:`MTEBRetriever`'s embeddings: its mode, size and pixels' sha256."""
    return f"{image.mode}{image.size}:{hashlib.sha256(image.tobytes()).hexdigest()}"


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

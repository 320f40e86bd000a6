"""Collators for retriever training and encoding, on top of :class:`Phi3VProcessor`.

The prompt formats live here (one EOS convention, docs/training.md): every path that builds retriever
inputs — training, corpus encoding, query encoding, the demo — goes through :class:`RetrieverCollator`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image
from transformers import BatchFeature

from hkrag.models.phi3v import Phi3VProcessor

logger = logging.getLogger(__name__)
DOCUMENT_PROMPT = "<|image_1|>\nWhat is shown in this image?"


def query_prompt(text: str, eos_token: str) -> str:
    """Query text as the encoder sees it: the dataset's text (with its instruction) + EOS."""
    return text + eos_token


def document_prompt(eos_token: str) -> str:
    """Document prompt as the encoder sees it: the image tag, the fixed question, EOS."""
    return DOCUMENT_PROMPT + eos_token


@dataclass
class RetrieverCollator:
    """Builds right-padded query and document batches.

    The number of crops per page is bounded by the processor's ``num_crops`` (config
    ``model.num_crops``); ``max_length`` turns an over-long document prompt into a clear error.
    A query longer than ``max_query_length`` tokens (the model's context) is cut to that length,
    keeping its final EOS token (the pooled one), with a warning naming the first such query.
    """

    processor: Phi3VProcessor
    max_length: int | None = None
    max_query_length: int | None = None
    _warned: bool = field(default=False, repr=False)

    def queries(self, texts: Sequence[str], ids: Sequence[str] | None = None) -> BatchFeature:
        """Query batch; ``ids`` only name queries in the truncation warning."""
        eos = self.processor.eos_token
        tokens = [self.processor.prompt_ids(query_prompt(t, eos), []) for t in texts]
        limit = self.max_query_length
        for row, seq in enumerate(tokens):
            if limit is not None and len(seq) > limit:
                self._warn_truncated(ids[row] if ids is not None else f"#{row} of the batch", len(seq))
                tokens[row] = seq[: limit - 1] + seq[-1:]
        return BatchFeature(self.processor.pad(tokens))

    def _warn_truncated(self, query_id: str, length: int) -> None:
        if not self._warned:
            logger.warning("query %s is %d tokens long, over the model's context of %d: truncated (further "
                           "truncations are not reported)", query_id, length, self.max_query_length)
            self._warned = True

    def documents(self, images: Sequence[Image.Image]) -> BatchFeature:
        prompt = document_prompt(self.processor.eos_token)
        return self.processor([prompt] * len(images), [[im] for im in images], max_length=self.max_length)

    def __call__(self, pairs: Sequence[tuple[str, Image.Image]]) -> dict[str, BatchFeature]:
        """Training batch from ``(query text, positive page)`` pairs: ``{"query": ..., "document": ...}``."""
        texts, images = zip(*pairs)
        return {"query": self.queries(texts), "document": self.documents(images)}

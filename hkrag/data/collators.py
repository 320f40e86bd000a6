"""Collators for retriever training and encoding, on top of :class:`Phi3VProcessor`.

The prompt formats live here (one EOS convention, DESIGN §4): every path that builds retriever
inputs — training, corpus encoding, query encoding, the demo — goes through :class:`RetrieverCollator`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image
from transformers import BatchFeature

from hkrag.models.phi3v import Phi3VProcessor

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
    ``model.num_crops``); ``max_length`` turns an over-long prompt into a clear error.
    """

    processor: Phi3VProcessor
    max_length: int | None = None

    def queries(self, texts: Sequence[str]) -> BatchFeature:
        eos = self.processor.eos_token
        return self.processor([query_prompt(t, eos) for t in texts], max_length=self.max_length)

    def documents(self, images: Sequence[Image.Image]) -> BatchFeature:
        prompt = document_prompt(self.processor.eos_token)
        return self.processor([prompt] * len(images), [[im] for im in images], max_length=self.max_length)

    def __call__(self, pairs: Sequence[tuple[str, Image.Image]]) -> dict[str, BatchFeature]:
        """Training batch from ``(query text, positive page)`` pairs: ``{"query": ..., "document": ...}``."""
        texts, images = zip(*pairs)
        return {"query": self.queries(texts), "document": self.documents(images)}

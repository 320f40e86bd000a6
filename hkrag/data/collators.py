"""Collators for retriever training and encoding, on top of :class:`Phi3VProcessor`.

The prompt formats live here (one EOS convention, docs/training.md): every path that builds retriever
inputs — training, corpus encoding, query encoding, the demo — goes through :class:`RetrieverCollator`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from PIL import Image
from transformers import BatchFeature

from hkrag.models.phi3v import Phi3VProcessor

logger = logging.getLogger(__name__)
DOCUMENT_PROMPT = "<|image_1|>\nWhat is shown in this image?"
GENERATION_SUFFIX = "<|end|>\n<|endoftext|>"
"""What follows the page text in VDocRAG's RCG target (the Phi-3 turn end, then end of text)."""
IGNORE_INDEX = -100
"""Label of a token the causal-LM loss skips (prompt tokens, padding)."""
TrainingItem = tuple[str, Image.Image, Sequence[Image.Image]]
"""A training pair with hard negatives: query text, positive page, the negative pages."""


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
    A query longer than ``max_query_length`` tokens (the model's context, or ``limit_name``) is cut to that
    length, keeping its final EOS token (the pooled one): the first such query is named in a warning and every
    one is counted in ``truncated``. Cut rather than refused: the retriever embeds the query's start, as
    VDocRAG's ``query_max_len`` does, and one long question does not stop an evaluation.
    """

    processor: Phi3VProcessor
    max_length: int | None = None
    max_query_length: int | None = None
    limit_name: str = "the model's context"
    truncated: int = field(default=0, repr=False)
    query_augmentation: int = 0
    """EOS tokens appended to every query, attended (the late-interaction head's query augmentation, ColBERT's and
    ColPali's); they count against ``max_query_length``."""

    def queries(self, texts: Sequence[str], ids: Sequence[str] | None = None) -> BatchFeature:
        """Query batch; ``ids`` only name queries in the truncation warning."""
        eos = self.processor.eos_token
        tokens = [self.processor.prompt_ids(query_prompt(t, eos), []) for t in texts]
        extra = self.query_augmentation
        limit = None if self.max_query_length is None else self.max_query_length - extra
        for row, seq in enumerate(tokens):
            if limit is not None and len(seq) > limit:
                self._warn_truncated(ids[row] if ids is not None else f"#{row} of the batch", len(seq))
                tokens[row] = seq[: limit - 1] + seq[-1:]
        if extra:
            tokens = [seq + seq[-1:] * extra for seq in tokens]
        return BatchFeature(self.processor.pad(tokens))

    def _warn_truncated(self, query_id: str, length: int) -> None:
        if not self.truncated:
            logger.warning("query %s is %d tokens long, over %s of %d: truncated (further truncations are "
                           "counted, not reported one by one)", query_id, length, self.limit_name,
                           self.max_query_length)
        self.truncated += 1

    def documents(self, images: Sequence[Image.Image]) -> BatchFeature:
        prompt = document_prompt(self.processor.eos_token)
        return self.processor([prompt] * len(images), [[im] for im in images], max_length=self.max_length)

    def __call__(self, pairs: Sequence[tuple[str, Image.Image] | TrainingItem]) -> dict[str, BatchFeature]:
        """Training batch from ``(query text, positive page)`` pairs: ``{"query": ..., "document": ...}``.

        A pair may carry a third item, its ``N`` hard-negative pages: the document batch is then the ``B``
        positives followed by the ``B·N`` negatives, query-major (the layout :class:`~hkrag.losses.HybridMaskLoss`
        reads).
        """
        texts, images = zip(*(pair[:2] for pair in pairs))
        negatives = tuple(page for pair in pairs for page in (pair[2] if len(pair) > 2 else ()))
        return {"query": self.queries(texts), "document": self.documents(images + negatives)}


def generation_mask(prompt_lengths: Sequence[int], length: int) -> torch.Tensor:
    """VDocRAG's RCG attention mask, ``(B, 1, L, L)`` bool, ``True`` = may attend (docs/training.md).

    Lower-triangular (causal); a row whose prompt (document prompt + EOS) has ``n`` tokens keeps, for
    every position ``>= n`` (the target and its padding), only the prompt's last token, the EOS:
    ``mask[i, 0, n:, :n - 1] = False``. Prompt tokens attend causally among themselves.
    """
    mask = torch.tril(torch.ones(length, length, dtype=torch.bool)).repeat(len(prompt_lengths), 1, 1)
    for row, n in enumerate(prompt_lengths):
        if not 1 <= n <= length:
            raise ValueError(f"prompt length {n} of row {row} is outside [1, {length}]")
        mask[row, n:, : n - 1] = False
    return mask[:, None]


@dataclass
class PretrainingCollator:
    """Batches for VDocRAG pre-training (RCR + RCG) from ``(page text, page image)`` pairs.

    ``query``: the page text as a query (``text + EOS``, cut to ``max_query_length``, or the model's context when
    shorter, keeping the EOS);
    ``document``: the page as the retriever encodes it; ``generation``: the document prompt's tokens
    (with their EOS) followed by the target ``text<|end|>\\n<|endoftext|>`` (tokenised without special
    tokens, cut to ``max_target_length``), right-padded, ``labels`` −100 on the prompt and the padding,
    ``attention_mask`` the 4-D :func:`generation_mask`, ``position_ids`` 0 .. L−1, and the page's pixels.
    """

    retriever: RetrieverCollator
    max_query_length: int = 512
    max_target_length: int = 512
    truncated_targets: int = field(default=0, repr=False)
    """RCG targets cut to ``max_target_length`` so far (the first one is also logged)."""

    def __post_init__(self) -> None:
        processor, max_length = self.retriever.processor, self.retriever.max_length
        context = self.retriever.max_query_length
        limit = self.max_query_length if context is None else min(self.max_query_length, context)
        name = "loss.max_query_length" if limit == self.max_query_length else "the model's context"
        self._text_collator = RetrieverCollator(processor, max_length, limit, name)

    @property
    def truncated_queries(self) -> int:
        """RCR queries cut to ``max_query_length`` (or the model's context, when shorter) so far."""
        return self._text_collator.truncated

    def generation(self, texts: Sequence[str], document: BatchFeature) -> BatchFeature:
        """The RCG batch of ``texts`` on the pages of ``document`` (a :meth:`RetrieverCollator.documents` batch)."""
        tokenizer = self.retriever.processor.tokenizer
        prompts = [row[mask.bool()].tolist() for row, mask in zip(document["input_ids"], document["attention_mask"])]
        targets = [tokenizer(t + GENERATION_SUFFIX, add_special_tokens=False)["input_ids"] for t in texts]
        for target in targets:
            if len(target) > self.max_target_length:
                if not self.truncated_targets:
                    logger.warning("an RCG target (a page's text) is %d tokens long, over loss.max_target_length=%d: "
                                   "cut (VDocRAG's answer_max_len; further cuts are counted)", len(target),
                                   self.max_target_length)
                self.truncated_targets += 1
        targets = [target[: self.max_target_length] for target in targets]
        length = max(len(p) + len(t) for p, t in zip(prompts, targets))
        pad = tokenizer.pad_token_id or 0
        ids, labels = [], []
        for prompt, target in zip(prompts, targets):
            padding = length - len(prompt) - len(target)
            ids.append(prompt + target + [pad] * padding)
            labels.append([IGNORE_INDEX] * len(prompt) + target + [IGNORE_INDEX] * padding)
        return BatchFeature({
            "input_ids": torch.tensor(ids),
            "labels": torch.tensor(labels),
            "attention_mask": generation_mask([len(p) for p in prompts], length),
            "position_ids": torch.arange(length).repeat(len(ids), 1),
            "pixel_values": document["pixel_values"],
            "image_sizes": document["image_sizes"],
        })

    def __call__(self, pairs: Sequence[tuple[str, Image.Image]]) -> dict[str, BatchFeature]:
        texts, images = zip(*pairs)
        document = self.retriever.documents(images)
        return {"query": self._text_collator.queries(texts), "document": document,
                "generation": self.generation(texts, document)}

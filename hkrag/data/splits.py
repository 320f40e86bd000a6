"""A validation split of the training queries, held out by page group so that no page leaks (docs/training.md).

Recipe choices (steps, batch, what is trained) are made on held-out *training* queries; the test split is read
once per reported figure. Queries are held out by the group (document) of their relevant pages: a group is
held out when a hash of ``seed`` and its name falls below ``fraction``, deterministically and independently of
the order or number of queries. A query whose relevant pages all lie in held-out groups is a validation query;
one whose relevant pages all lie in kept groups trains; one that straddles both is dropped from both. The
caller keeps held-out pages out of every training example too (:meth:`ValidationSplit.held_out`), distractors
included, so no page a validation query is asked about is ever seen in training.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .opendocvqa import QAExample

GROUP_PATTERN = r"(.*-d[0-9]+)-p[0-9]+"
"""The built-in corpus's documents: ``synchart-train-d003-p2`` belongs to ``synchart-train-d003``."""


def page_group(doc_id: str, pattern: str = GROUP_PATTERN) -> str:
    """The group of page ``doc_id``: ``pattern``'s first group when it matches the whole id, else the page itself."""
    match = re.fullmatch(pattern, doc_id)
    return match.group(1) if match else doc_id


@dataclass(frozen=True)
class ValidationSplit:
    """Held-out groups chosen by ``fraction`` of a hash of ``seed`` and the group name (``pattern`` finds it)."""

    fraction: float
    seed: int = 0
    pattern: str = GROUP_PATTERN

    def __post_init__(self) -> None:
        if not 0 <= self.fraction < 1:
            raise ValueError(f"generator_training.validation.fraction={self.fraction!r}: expected a number in [0, 1)")

    def held_out(self, doc_id: str) -> bool:
        """Whether page ``doc_id``'s group is held out."""
        digest = hashlib.sha256(f"{self.seed}:{page_group(doc_id, self.pattern)}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.fraction

    def split(self, qa: Sequence[QAExample]) -> tuple[list[QAExample], list[QAExample]]:
        """``(train, validation)`` in ``qa``'s order; queries straddling kept and held-out groups are in neither."""
        train, validation = [], []
        for example in qa:
            held = {self.held_out(doc_id) for doc_id in example.relevant_doc_ids}
            if held == {True}:
                validation.append(example)
            elif held <= {False}:
                train.append(example)
        return train, validation

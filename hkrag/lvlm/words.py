"""Tokens read as words: the one rule by which a token counts as "yes", "no" or any other short answer word.

A token reads as a word when, with spaces, SentencePiece/BPE markers (``▁``, ``Ġ``) and surrounding punctuation
stripped and lowercased, it *is* the word: ``▁Yes``, ``Yes``, ``yes.`` and ``"YES`` all read as ``yes``. The
agents' yes/no reading (:mod:`agents.pruner`) and the local backends' full-vocabulary word masses
(:attr:`~hkrag.lvlm.base.GenerationSettings.word_mass`) use this rule, so a class's mass sums the same tokens
whichever side computes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

STRIP = " \t\n\r▁Ġ.,:;!?\"'*`()[]"
"""What :func:`normalise` strips from both ends of a token."""


def normalise(token: str) -> str:
    """A token as compared with a word: no spaces, sentencepiece/BPE markers or punctuation; lower case."""
    return token.strip(STRIP).lower()


def word_token_ids(texts: Iterable[str], words: Sequence[str]) -> list[list[int]]:
    """For each of ``words``, the positions in ``texts`` (each vocabulary id's decoded text) that read as it."""
    found: list[list[int]] = [[] for _ in words]
    where = {normalise(word): index for index, word in enumerate(words)}
    for token_id, text in enumerate(texts):
        if (index := where.get(normalise(text))) is not None:
            found[index].append(token_id)
    return found

"""Tokens read as words: the one rule by which a token counts as "yes", "no" or any other short answer word.

A token reads as a word when, with spaces, SentencePiece/BPE markers (``▁``, ``Ġ``) and surrounding punctuation
stripped and lowercased, it *is* the word: ``▁Yes``, ``Yes``, ``yes.`` and ``"YES`` all read as ``yes``. The
agents' yes/no reading (:mod:`agents.pruner`) and the local backends' full-vocabulary word masses
(:attr:`~hkrag.lvlm.base.GenerationSettings.word_mass`) use this rule, so a class's mass sums the same tokens
whichever side computes it.

A small tokenizer may have no token that is the word: the tiny models' byte-level BPE spells ``yes`` as
``y`` ``e`` ``s`` and ``no`` as ``n`` ``o``, so the first answer token is ``y`` or ``n`` and no token reads as
either word. :func:`word_start_ids` adds, for the full-vocabulary masses, the token a tokenizer starts each word's
spelling with (:func:`vocabulary_word_ids` joins both); without it both masses are the few stray tokens that read
as the words, and their ratio says nothing about the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

SPELLINGS: tuple[Callable[[str], str], ...] = (str.lower, str.capitalize, str.upper)
"""The forms of a word whose spelling :func:`word_start_ids` reads, each alone and after a space."""

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


def word_start_ids(texts: Sequence[str], words: Sequence[str],
                   encode: Callable[[str], Sequence[int]]) -> list[list[int]]:
    """For each of ``words``, the ids (positions in ``texts``, each vocabulary id's decoded text) that ``encode``
    (the tokenizer, no special tokens) starts a several-token spelling of the word with (:data:`SPELLINGS`), when
    that first token, :func:`normalise`-d, is a non-empty strict prefix of the word (``y`` of ``yes``; a bare space
    is not). A token that starts two of the words is dropped from both: it cannot tell them apart."""
    found = []
    for word in words:
        ids = set()
        for text in {form(word) for form in SPELLINGS} | {" " + form(word) for form in SPELLINGS}:
            pieces = list(encode(text))
            if len(pieces) > 1 and pieces[0] < len(texts):
                piece = normalise(texts[pieces[0]])
                if piece and piece != normalise(word) and normalise(word).startswith(piece):
                    ids.add(pieces[0])
        found.append(ids)
    shared = {token_id for i, ids in enumerate(found) for other in found[i + 1:] for token_id in ids & other}
    return [sorted(ids - shared) for ids in found]


def vocabulary_word_ids(texts: Sequence[str], words: Sequence[str],
                        encode: Callable[[str], Sequence[int]]) -> list[list[int]]:
    """For each of ``words``, the ids whose text reads as it (:func:`word_token_ids`) or starts its spelling
    (:func:`word_start_ids`): the tokens whose summed probability is the word's mass at a first answer token."""
    reading, starting = word_token_ids(texts, words), word_start_ids(texts, words, encode)
    return [sorted(set(a) | set(b)) for a, b in zip(reading, starting, strict=True)]

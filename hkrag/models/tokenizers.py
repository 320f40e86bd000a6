"""Offline tokenizers for the tiny models: a deterministic byte-level BPE trained on project text.

Tests and the CPU demo cannot download a checkpoint's tokenizer; each tiny model (Phi3V's
:func:`hkrag.models.phi3v.build_offline_tokenizer`, :func:`hkrag.models.qwen2_5_vl.build_qwen_offline_tokenizer`)
trains one here with its own special tokens and conventions.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BASE_TEXT = (
    "What is shown in this image? Instruct: I’m looking for an image that answers the question. Query: "
    "Which chart, slide, table, report or infographic shows the revenue, profit, share, growth, date, "
    "code, footnote, source, caption, legend, title, total, year, month, quarter, percent, value of the "
    "company, region, country, product, segment? Answer the question with a short phrase. Is the document "
    "sufficient to answer? Yes. No. The answer is 0 1 2 3 4 5 6 7 8 9 10 % $ . , : ; - ( ) / # "
    "January February March April May June July August September October November December "
    "red green blue orange purple north south east west alpha beta gamma delta "
)


def train_byte_level_bpe(
    texts: Iterable[str], special_tokens: list[str], vocab_size: int, unk_token: str | None = None
) -> Tokenizer:
    """A deterministic byte-level BPE trained on ``texts`` with ``special_tokens`` first in its vocabulary."""
    tokenizer = Tokenizer(models.BPE(unk_token=unk_token))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return tokenizer

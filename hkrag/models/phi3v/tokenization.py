"""Tokenizers: the checkpoint's own, or a small offline one with Phi-3's special tokens.

The real path loads the checkpoint tokenizer (``AutoTokenizer.from_pretrained``). Tests and the
CPU demo cannot download it, so :func:`build_offline_tokenizer` trains a small byte-level BPE on
project text and gives it the same special tokens and conventions (``<s>`` prepended, ``<|endoftext|>``
as eos and pad, the chat role tokens), so the processor and chat-template code run unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]
"""Phi-3 special tokens (ids 0, 1, 2, 32000, 32001, 32006, 32007, 32010 in the real vocabulary)."""

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


def build_offline_tokenizer(texts: Iterable[str] = (), vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE on ``BASE_TEXT`` plus ``texts`` (no downloads).

    Returns a ``PreTrainedTokenizerFast`` that prepends ``<s>`` like Phi-3's and uses
    ``<|endoftext|>`` as eos and pad. ``len(tokenizer) <= vocab_size``.
    """
    tokenizer = train_byte_level_bpe([BASE_TEXT, *texts], SPECIAL_TOKENS, vocab_size, unk_token="<unk>")
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|assistant|>", "<|system|>", "<|end|>", "<|user|>"],
        padding_side="right",
    )

"""Tokenizers: the checkpoint's own, or a small offline one with Phi-3's special tokens.

The real path loads the checkpoint tokenizer (``AutoTokenizer.from_pretrained``). Tests and the
CPU demo cannot download it, so :func:`build_offline_tokenizer` trains a small byte-level BPE on
project text and gives it the same special tokens and conventions (``<s>`` prepended, ``<|endoftext|>``
as eos and pad, the chat role tokens), so the processor and chat-template code run unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from hkrag.models.tokenizers import BASE_TEXT, train_byte_level_bpe

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]
"""Phi-3 special tokens (ids 0, 1, 2, 32000, 32001, 32006, 32007, 32010 in the real vocabulary)."""


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

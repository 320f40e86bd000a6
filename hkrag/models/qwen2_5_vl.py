"""A tiny random Qwen2.5-VL for tests and CPU demos: config, offline tokenizer and image-only processor.

:func:`tiny_qwen2_5_vl` builds a random-initialised Qwen2.5-VL (2 layers, hidden 64, 2-block vision tower)
with an offline byte-level BPE tokenizer (:mod:`hkrag.models.tokenizers`) carrying Qwen's special tokens
and chat template. The offline processor is image-only (transformers' video processor needs torchvision).
The backend that answers with it is :mod:`hkrag.lvlm.qwen2_5_vl` (docs/lvlm.md).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from hkrag.models.tokenizers import BASE_TEXT, train_byte_level_bpe

IMAGE_TOKEN = "<|image_pad|>"
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", IMAGE_TOKEN, "<|video_pad|>",
]
PATCH_AREA = 28 * 28
"""Pixels per LM token: 14-px patches merged 2×2."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-VL's chat layout (default system turn, image parts in place) for the offline tokenizer."""


class PageProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without the video processor (which needs torchvision); images and text only."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None) -> None:
        self.image_token, self.video_token = IMAGE_TOKEN, "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def build_qwen_offline_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE with Qwen2.5-VL's special tokens and chat template (no downloads)."""
    texts = [BASE_TEXT, "system user assistant You are a helpful assistant."]
    tokenizer = train_byte_level_bpe(texts, SPECIAL_TOKENS, vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
    )


def tiny_qwen2_5_vl_config(tokenizer: PreTrainedTokenizerFast, **text_overrides: Any) -> Qwen2_5_VLConfig:
    """A few-MB Qwen2.5-VL: 2 LM layers (hidden 64, head_dim 16, ``mrope_section`` 2+3+3 = 16/2), and a
    2-block vision tower (hidden 32, 56-px attention windows, the last block full attention)."""
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in [
        ("image_token_id", IMAGE_TOKEN), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
    ]}
    special = dict(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]), **special,
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
    )
    text.update(text_overrides)
    half_head = text["hidden_size"] // text["num_attention_heads"] // 2
    if sum(text["rope_parameters"]["mrope_section"]) != half_head:
        raise ValueError(f"rope_parameters.mrope_section {text['rope_parameters']['mrope_section']} must sum to half "
                         f"the head dimension ({half_head}: hidden_size {text['hidden_size']} / "
                         f"{text['num_attention_heads']} heads / 2)")
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids, **special)


def tiny_qwen2_5_vl(
    seed: int = 0, min_pixels: int = 4 * PATCH_AREA, max_pixels: int = 64 * PATCH_AREA
) -> tuple[Qwen2_5_VLForConditionalGeneration, PageProcessor]:
    """A random-initialised tiny Qwen2.5-VL (SDPA, float32) and its offline processor."""
    tokenizer = build_qwen_offline_tokenizer()
    config = tiny_qwen2_5_vl_config(tokenizer)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    return model, PageProcessor(image_processor, tokenizer, chat_template=CHAT_TEMPLATE)

"""Phi-3-vision processor: prompts + pages -> a right-padded batch for :class:`Phi3VModel`.

Follows the reference processor: the prompt is split at ``<|image_k|>`` tags, every text chunk is
tokenised *with* special tokens (so ``<s>`` opens the prompt and follows each image), and tag k becomes
``num_img_tokens[k]`` copies of the placeholder id ``-k``. Unlike the reference it batches several
prompts, each with its own images, and checks tags against images with errors that name the problem.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from PIL import Image
from transformers import BatchFeature, PreTrainedTokenizerBase

from .image_processing_phi3v import Phi3VImageProcessor

IMAGE_TAG = re.compile(r"<\|image_(\d+)\|>")


def image_tag(k: int) -> str:
    """The prompt tag for the k-th image (1-based)."""
    return f"<|image_{k}|>"


class Phi3VProcessor:
    """Tokenises prompts with image placeholders and processes their pages.

    Args:
        tokenizer: Phi-3's tokenizer (or :func:`build_offline_tokenizer`'s); must prepend ``<s>``.
        image_processor: the HD transform.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_processor: Phi3VImageProcessor) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor

    @property
    def eos_token(self) -> str:
        return self.tokenizer.eos_token

    def prompt_ids(self, text: str, num_img_tokens: Sequence[int]) -> list[int]:
        """Token ids of one prompt with ``-k`` placeholders; checks tags against the images given."""
        tags = [int(k) for k in IMAGE_TAG.findall(text)]
        if tags != list(range(1, len(num_img_tokens) + 1)):
            raise ValueError(
                f"prompt has image tags {[image_tag(k) for k in tags]} but {len(num_img_tokens)} image(s) "
                f"were given; expected {[image_tag(k) for k in range(1, len(num_img_tokens) + 1)]} in order: "
                f"{text[:80]!r}"
            )
        chunks = IMAGE_TAG.split(text)[::2]
        ids: list[int] = []
        for k, chunk in enumerate(chunks):
            if k > 0:
                ids.extend([-k] * num_img_tokens[k - 1])
            ids.extend(self.tokenizer(chunk, add_special_tokens=True)["input_ids"])
        return ids

    def __call__(
        self,
        text: str | Sequence[str],
        images: Sequence[Image.Image] | Sequence[Sequence[Image.Image]] | None = None,
        padding_side: str = "right",
        max_length: int | None = None,
    ) -> BatchFeature:
        """Build ``input_ids``, ``attention_mask``, and when images are given ``pixel_values``, ``image_sizes``.

        ``text`` is one prompt or a list; ``images`` a flat list for one prompt or one list per prompt.
        Pad tokens are ``tokenizer.pad_token_id``; ``padding_side`` is ``right`` (default) or ``left``.
        """
        texts = [text] if isinstance(text, str) else list(text)
        per_prompt = _images_per_prompt(images, len(texts))
        flat = [image for group in per_prompt for image in group]
        vision = self.image_processor(flat)
        tokens, start = [], 0
        for prompt, group in zip(texts, per_prompt):
            counts = vision["num_img_tokens"][start : start + len(group)]
            tokens.append(self.prompt_ids(prompt, counts))
            start += len(group)
        if max_length is not None:
            _check_length(tokens, max_length)
        batch = self.pad(tokens, padding_side)
        if flat:
            batch["pixel_values"] = vision["pixel_values"]
            batch["image_sizes"] = vision["image_sizes"]
        return BatchFeature(batch)

    def pad(self, sequences: Sequence[Sequence[int]], padding_side: str = "right") -> dict[str, torch.Tensor]:
        """Pad token lists to one length; returns ``input_ids`` and ``attention_mask``."""
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        length = max(len(s) for s in sequences)
        pad_id = self.tokenizer.pad_token_id
        input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, seq in enumerate(sequences):
            span = slice(0, len(seq)) if padding_side == "right" else slice(length - len(seq), length)
            input_ids[row, span] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, span] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def decode(self, ids: Sequence[int], **kwargs) -> str:
        return self.tokenizer.decode([i for i in ids if i >= 0], **kwargs)


def _images_per_prompt(images, num_prompts: int) -> list[list[Image.Image]]:
    if images is None:
        return [[] for _ in range(num_prompts)]
    images = list(images)
    if images and isinstance(images[0], Image.Image):
        if num_prompts != 1:
            raise ValueError(f"a flat image list needs exactly one prompt, got {num_prompts}; pass one list per prompt")
        return [images]
    if len(images) != num_prompts:
        raise ValueError(f"got {len(images)} image lists for {num_prompts} prompts")
    return [list(group) for group in images]


def _check_length(tokens: Sequence[Sequence[int]], max_length: int) -> None:
    for row, seq in enumerate(tokens):
        if len(seq) > max_length:
            raise ValueError(
                f"prompt {row} is {len(seq)} tokens long, over max_length={max_length}; "
                "lower num_crops or raise max_length"
            )

"""Phi-3-vision processor: prompts + pages -> a padded batch for :class:`Phi3VModel`.

Follows the reference processor: the prompt is split at ``<|image_k|>`` tags, every text chunk is
tokenised *with* special tokens (so ``<s>`` opens the prompt and follows each image), and tag k becomes
``num_img_tokens[k]`` copies of the placeholder id ``-k``. Unlike the reference it batches several
prompts, each with its own images, and checks tags against images with errors that name the problem.

It is a transformers ``ProcessorMixin``: ``Phi3VProcessor.from_pretrained`` / ``AutoProcessor.from_pretrained``
load the tokenizer and ``preprocessor_config.json`` of the original checkpoint, and ``save_pretrained`` writes
that same layout (tokenizer files + a flat ``preprocessor_config.json`` naming ``processor_class``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image
from transformers import BatchFeature, PreTrainedTokenizerBase, ProcessorMixin
from transformers.utils import PaddingStrategy, TensorType

from hkrag.io import write_json

from .image_processing_phi3v import Phi3VImageProcessor

IMAGE_TAG = re.compile(r"<\|image_(\d+)\|>")
PREPROCESSOR_FILE = "preprocessor_config.json"


def image_tag(k: int) -> str:
    """The prompt tag for the k-th image (1-based)."""
    return f"<|image_{k}|>"


class Phi3VProcessor(ProcessorMixin):
    """Tokenises prompts with image placeholders and processes their pages.

    Args:
        tokenizer: Phi-3's tokenizer (or :func:`build_offline_tokenizer`'s); must prepend ``<s>``.
        image_processor: the HD transform.
        chat_template: defaults to the tokenizer's.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        image_processor: Phi3VImageProcessor,
        chat_template: str | None = None,
    ) -> None:
        super().__init__(tokenizer, image_processor, chat_template=chat_template or tokenizer.chat_template)

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
                ids.extend([-k] * int(num_img_tokens[k - 1]))
            ids.extend(self.tokenizer(chunk, add_special_tokens=True)["input_ids"])
        return ids

    def __call__(
        self,
        text: str | Sequence[str] | None = None,
        images: Image.Image | Sequence[Image.Image] | Sequence[Sequence[Image.Image]] | None = None,
        return_tensors: str | TensorType | None = TensorType.PYTORCH,
        padding: bool | str | PaddingStrategy = True,
        truncation: bool | str | None = None,
        max_length: int | None = None,
        padding_side: str = "right",
    ) -> BatchFeature:
        """Build ``input_ids``, ``attention_mask``, and when images are given ``pixel_values``, ``image_sizes``.

        ``text`` is one prompt or a list; ``images`` one page or a flat list for one prompt, or one list per
        prompt. ``return_tensors`` defaults to ``"pt"`` as in the reference (``None`` gives lists of ids).
        ``padding``: ``True``/``"longest"`` (default), ``"max_length"``, or ``False`` (prompts must then be of
        equal length). A prompt over ``max_length`` is an error unless ``truncation`` is set, which cuts text
        tokens only: a cut through image placeholders is an error. Pad tokens are ``tokenizer.pad_token_id``.
        """
        if text is None:
            raise ValueError("Phi3VProcessor needs text: a prompt with one <|image_k|> tag per image")
        texts = [text] if isinstance(text, str) else list(text)
        per_prompt = _images_per_prompt(images, len(texts))
        flat = [image for group in per_prompt for image in group]
        vision = self.image_processor(flat, return_tensors=return_tensors)
        counts = [int(n) for n in vision["num_img_tokens"]]
        tokens, start = [], 0
        for prompt, group in zip(texts, per_prompt):
            tokens.append(self.prompt_ids(prompt, counts[start : start + len(group)]))
            start += len(group)
        if max_length is not None:
            tokens = _fit_length(tokens, max_length, truncate=truncation not in (None, False, "do_not_truncate"))
        data: dict[str, Any] = self._pad_lists(tokens, _padding_strategy(padding), max_length, padding_side)
        if flat:
            data["pixel_values"] = vision["pixel_values"]
            data["image_sizes"] = vision["image_sizes"]
        return BatchFeature(data, tensor_type=return_tensors)

    def pad(self, sequences: Sequence[Sequence[int]], padding_side: str = "right") -> dict[str, Any]:
        """Pad token lists to the longest; returns ``input_ids`` and ``attention_mask`` tensors."""
        return BatchFeature(
            self._pad_lists(sequences, PaddingStrategy.LONGEST, None, padding_side), tensor_type=TensorType.PYTORCH
        ).data

    def _pad_lists(
        self,
        sequences: Sequence[Sequence[int]],
        strategy: PaddingStrategy,
        max_length: int | None,
        padding_side: str,
    ) -> dict[str, list[list[int]]]:
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        lengths = [len(s) for s in sequences]
        if strategy == PaddingStrategy.MAX_LENGTH:
            if max_length is None:
                raise ValueError("padding='max_length' needs max_length")
            length = max_length
        elif strategy == PaddingStrategy.DO_NOT_PAD and len(set(lengths)) > 1:
            raise ValueError(f"padding=False but the prompts have different lengths {lengths}; pass padding=True")
        else:
            length = max(lengths)
        pad_id = self.tokenizer.pad_token_id
        input_ids, attention_mask = [], []
        for seq in sequences:
            fill = length - len(seq)
            ids, mask = list(seq), [1] * len(seq)
            input_ids.append(ids + [pad_id] * fill if padding_side == "right" else [pad_id] * fill + ids)
            attention_mask.append(mask + [0] * fill if padding_side == "right" else [0] * fill + mask)
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        """Decode one sequence, skipping image placeholders (negative ids)."""
        return self.tokenizer.decode([int(i) for i in ids if i >= 0], **kwargs)

    def batch_decode(self, sequences: Sequence[Sequence[int]], **kwargs: Any) -> list[str]:
        """Decode several sequences, skipping image placeholders (negative ids)."""
        return [self.decode(ids, **kwargs) for ids in sequences]

    @property
    def model_input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", "pixel_values", "image_sizes"]

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> list[str]:
        """Write the tokenizer files and the original-layout ``preprocessor_config.json``.

        The file is the image processor's settings plus ``processor_class``, as in the original checkpoint,
        so ``AutoProcessor.from_pretrained`` and the original remote code both read it. ``push_to_hub`` is
        not supported.
        """
        if kwargs.get("push_to_hub"):
            raise NotImplementedError("Phi3VProcessor.save_pretrained does not push to the hub")
        directory = Path(save_directory)
        self.tokenizer.save_pretrained(directory)
        settings = {**self.image_processor.to_dict(), "processor_class": type(self).__name__}
        return [str(write_json(directory / PREPROCESSOR_FILE, settings))]


def _padding_strategy(padding: bool | str | PaddingStrategy | None) -> PaddingStrategy:
    if padding is True:
        return PaddingStrategy.LONGEST
    if padding is False or padding is None:
        return PaddingStrategy.DO_NOT_PAD
    return PaddingStrategy(padding)


def _images_per_prompt(images, num_prompts: int) -> list[list[Image.Image]]:
    if images is None:
        return [[] for _ in range(num_prompts)]
    images = [images] if isinstance(images, Image.Image) else list(images)
    if images and isinstance(images[0], Image.Image):
        if num_prompts != 1:
            raise ValueError(f"a flat image list needs exactly one prompt, got {num_prompts}; pass one list per prompt")
        return [images]
    if len(images) != num_prompts:
        raise ValueError(f"got {len(images)} image lists for {num_prompts} prompts")
    return [list(group) for group in images]


def _fit_length(tokens: list[list[int]], max_length: int, truncate: bool) -> list[list[int]]:
    """Check (or, with ``truncate``, cut) every prompt to ``max_length``; never cut image placeholders."""
    out = []
    for row, seq in enumerate(tokens):
        if len(seq) > max_length:
            if not truncate:
                raise ValueError(
                    f"prompt {row} is {len(seq)} tokens long, over max_length={max_length}; "
                    "lower num_crops, raise max_length or pass truncation=True (text only)"
                )
            if any(i < 0 for i in seq[max_length:]):
                raise ValueError(
                    f"prompt {row} is {len(seq)} tokens long; truncating to max_length={max_length} would cut "
                    "its image placeholders: lower num_crops or raise max_length"
                )
            seq = seq[:max_length]
        out.append(seq)
    return out

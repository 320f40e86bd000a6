"""Qwen2.5-VL (native in transformers) as an LVLM backend (paper Fig. 4: 3B / 7B / 32B Instruct).

``min_pixels`` / ``max_pixels`` bound each page's resolution (tokens per page = pixels / 28²): cap
``max_pixels`` for document pages, or a tall page costs thousands of tokens. The prompt is the
processor's chat template with one ``<|vision_start|><|image_pad|><|vision_end|>`` per page, each
``<|image_pad|>`` expanded to the page's token count. Page features (vision tower + patch merger) are
computed per page and reused through the backend's LRU cache; they go to ``generate`` as
``mm_encoder_outputs``, transformers' own entry for pre-computed image embeddings, with the page grids
(``image_grid_thw``) for the 3-D rotary positions. Answers end at ``<|im_end|>`` or ``<|endoftext|>``.

``base="tiny"`` builds a random-initialised Qwen2.5-VL with an offline processor
(:func:`hkrag.models.qwen2_5_vl.tiny_qwen2_5_vl`): the same code path for tests and CPU demos; real
checkpoints load their own processor with ``AutoProcessor``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutputWithPooling

from hkrag.models.attention import default_attn_implementation
from hkrag.models.qwen2_5_vl import IMAGE_TOKEN, PATCH_AREA, tiny_qwen2_5_vl

from .base import LVLMRequest, Message, PageImage
from .local import LocalBackend, ModelInputs, resolve_device, resolve_dtype

QWEN2_5_VL_7B = "Qwen/Qwen2.5-VL-7B-Instruct"
END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def qwen_conversation(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages in the processor's chat-template form: ``{"type": "image"}`` parts where the pages are."""
    return [
        {
            "role": message.role,
            "content": [
                {"type": "image"} if isinstance(part, PageImage) else {"type": "text", "text": part}
                for part in message.content
            ],
        }
        for message in messages
    ]


class Qwen2_5_VLBackend(LocalBackend):
    """Qwen2.5-VL answering with per-token probabilities.

    Args:
        base: hub id or folder (``Qwen/Qwen2.5-VL-{3B,7B,32B}-Instruct``), or ``"tiny"``.
        min_pixels, max_pixels: bounds of each page's resized area in pixels (28² pixels per token).
        dtype, attn_implementation, device, batch_size, feature_cache_size, prefix_cache_size, seed, model_name: as for
            :class:`hkrag.lvlm.phi3v.Phi3VBackend`.
    """

    name = "qwen2_5_vl"

    def __init__(
        self,
        base: str = QWEN2_5_VL_7B,
        min_pixels: int = 256 * PATCH_AREA,
        max_pixels: int = 1280 * PATCH_AREA,
        dtype: str = "auto",
        attn_implementation: str | None = None,
        device: str | None = "auto",
        batch_size: int = 4,
        feature_cache_size: int = 32,
        prefix_cache_size: int = 8,
        seed: int = 0,
        model_name: str | None = None,
    ) -> None:
        if not 0 < min_pixels <= max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {min_pixels} and {max_pixels}")
        target = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, target)
        if base == "tiny":
            model, processor = tiny_qwen2_5_vl(seed, min_pixels, max_pixels)
            model = model.to(torch_dtype)
            default_name = f"tiny-qwen2.5-vl-seed{seed}"
        else:
            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                base, dtype=torch_dtype, attn_implementation=attn_implementation or default_attn_implementation()
            )
            processor = AutoProcessor.from_pretrained(base, min_pixels=min_pixels, max_pixels=max_pixels)
            default_name = str(base)
        self.processor = processor
        self.pixels = (min_pixels, max_pixels)
        super().__init__(
            model.to(target),
            processor.tokenizer,
            model_name or default_name,
            END_TOKENS,
            batch_size=batch_size,
            feature_cache_size=feature_cache_size,
            prefix_cache_size=prefix_cache_size,
        )
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    def feature_key(self, page: PageImage) -> Hashable:
        return (page.key, *self.pixels)

    def page_features(self, page: PageImage) -> tuple[torch.Tensor, torch.Tensor]:
        """The page's merged vision tokens (tokens, hidden) and its patch grid ``(t, h, w)``."""
        vision = self.processor.image_processor(images=[page.load().convert("RGB")], return_tensors="pt")
        grid = vision["image_grid_thw"].to(self.device)
        output = self.lm.model.get_image_features(vision["pixel_values"].to(self.device), grid)
        return output.pooler_output[0], grid[0]

    def is_image_token(self, ids: torch.Tensor) -> torch.Tensor:
        return ids == self.image_token_id

    def skip_pages(self, kwargs: dict[str, Any], pages: int, tokens: int) -> None:
        """Also forgets the previous call's rope offsets, so ``generate`` computes this prompt's 3-D positions
        from all its pages (``image_grid_thw`` stays whole) instead of resuming another prompt's."""
        rest = kwargs.pop("mm_encoder_outputs")["image"].pooler_output[pages:]
        if rest:
            kwargs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=rest)}
        self.lm.model.rope_deltas = None

    def prompt(self, request: LVLMRequest) -> str:
        """The chat-template prompt with one ``<|image_pad|>`` per page (before expansion)."""
        return self.processor.apply_chat_template(
            qwen_conversation(request.messages), add_generation_prompt=True, tokenize=False
        )

    def expand(self, prompt: str, pages: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> str:
        """Repeat each page's ``<|image_pad|>`` once per vision token of that page."""
        chunks = prompt.split(IMAGE_TOKEN)
        if len(chunks) - 1 != len(pages):
            raise ValueError(f"prompt holds {len(chunks) - 1} {IMAGE_TOKEN} tokens for {len(pages)} page(s)")
        out = [chunks[0]]
        for (features, _), chunk in zip(pages, chunks[1:]):
            out.extend([IMAGE_TOKEN * len(features), chunk])
        return "".join(out)

    def prepare(self, requests: Sequence[LVLMRequest]) -> ModelInputs:
        pages = [[self.page(page) for page in request.images] for request in requests]
        texts = [self.expand(self.prompt(request), row) for request, row in zip(requests, pages)]
        batch = self.tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
        kwargs: dict[str, Any] = {
            "input_ids": batch["input_ids"].to(self.device),
            "attention_mask": batch["attention_mask"].to(self.device),
        }
        kwargs["mm_token_type_ids"] = (kwargs["input_ids"] == self.image_token_id).int()
        flat = [page for row in pages for page in row]
        if flat:
            kwargs["image_grid_thw"] = torch.stack([grid for _, grid in flat])
            kwargs["mm_encoder_outputs"] = {
                "image": BaseModelOutputWithPooling(pooler_output=tuple(features for features, _ in flat))
            }
        keys = [[(self.feature_key(p), len(f)) for p, (f, _) in zip(r.images, row)] for r, row in zip(requests, pages)]
        return ModelInputs(kwargs, batch["attention_mask"].sum(1).tolist(), keys)

"""Our Phi-3-vision as an LVLM backend, optionally with VDocRAG's generator adapter (paper §3.3, docs/lvlm.md).

The paper keeps "generator settings identical to VDocRAG": Phi-3-vision-128k-instruct with the LoRA
adapter ``NTT-hil-insight/VDocGenerator-Phi3-vision``. The adapter is merged into the weights at load
time (inference only). ``base="tiny"`` builds a random-initialised tiny Phi3V with an offline tokenizer
(same code path, seeded, a fraction of a second) for tests and the CPU demo; ``base`` may also be a
folder holding a saved model and processor (a ``train.py`` run writes its tiny base under ``<run>/base``).

Chat format (the checkpoint's own template): ``<|system|>\\n…<|end|>\\n`` for system turns,
``<|user|>\\n…<|end|>\\n`` and ``<|assistant|>\\n…<|end|>\\n``, then ``<|assistant|>\\n`` to answer.
Page images become ``<|image_1|>\\n`` … ``<|image_k|>\\n``, numbered across the conversation, where the
:class:`PageImage` parts are. Answers end at ``<|end|>`` or ``<|endoftext|>``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from hkrag.models.phi3v import Phi3VForCausalLM, Phi3VProcessor, image_tag
from hkrag.models.phi3v.loading import PHI3V_HUB_ID, load_phi3v, load_processor, tiny_phi3v
from hkrag.retriever import load_adapter

from .base import LVLMRequest, Message, PageImage
from .local import LocalBackend, ModelInputs, resolve_device, resolve_dtype

VDOC_GENERATOR = "NTT-hil-insight/VDocGenerator-Phi3-vision"
END_TOKENS = ("<|end|>", "<|endoftext|>")


def phi3_chat(messages: Sequence[Message]) -> str:
    """The Phi-3 chat prompt of ``messages`` with ``<|image_k|>`` tags where the pages are."""
    parts, k = [], 0
    for message in messages:
        parts.append(f"<|{message.role}|>\n")
        for part in message.content:
            if isinstance(part, PageImage):
                k += 1
                parts.append(f"{image_tag(k)}\n")
            else:
                parts.append(part)
        parts.append("<|end|>\n")
    if not messages or messages[-1].role != "assistant":
        parts.append("<|assistant|>\n")
    return "".join(parts)


class Phi3VBackend(LocalBackend):
    """Phi-3-vision (our native :class:`Phi3VForCausalLM`) answering with per-token probabilities.

    Args:
        base: hub id or folder of the checkpoint, or ``"tiny"`` for a random tiny model.
        adapter: a peft LoRA adapter (hub id or folder) merged into the weights, e.g. :data:`VDOC_GENERATOR`.
        num_crops: HD crops per page; ``None`` keeps the checkpoint's (16), or 4 for ``"tiny"``.
        dtype: ``"auto"`` (bf16 on GPU, fp32 on CPU), ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        attn_implementation: ``None`` picks flash-attn when installed, else SDPA.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        batch_size: requests per ``generate`` call.
        feature_cache_size: pages whose image features are reused across calls (0 disables).
        prefix_cache_size: prompt prefixes (pages first) whose keys and values are reused (0 disables).
        seed: the tiny model's initialisation seed.
        model_name: the name written into results (default: base, plus ``+adapter``).
    """

    name = "phi3v"

    def __init__(
        self,
        base: str = PHI3V_HUB_ID,
        adapter: str | None = None,
        num_crops: int | None = None,
        dtype: str = "auto",
        attn_implementation: str | None = None,
        device: str | None = "auto",
        batch_size: int = 4,
        feature_cache_size: int = 32,
        prefix_cache_size: int = 8,
        seed: int = 0,
        model_name: str | None = None,
    ) -> None:
        target = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, target)
        if base == "tiny":
            model, processor = tiny_phi3v(num_crops=num_crops or 4, seed=seed)
            model = model.to(torch_dtype)
            default_name = f"tiny-phi3v-seed{seed}"
        else:
            model = load_phi3v(base, dtype=torch_dtype, attn_implementation=attn_implementation)
            processor = load_processor(base, num_crops)
            default_name = str(base)
        if adapter is not None:
            model = load_adapter(model, adapter).merge_and_unload()  # one that does not fit is refused
            default_name = f"{default_name}+{adapter}"
        self._attach(model.to(target), processor, model_name or default_name, batch_size, feature_cache_size,
                     prefix_cache_size)

    def _attach(self, model: Phi3VForCausalLM, processor: Phi3VProcessor, model_name: str, batch_size: int,
                feature_cache_size: int, prefix_cache_size: int) -> None:
        self.processor: Phi3VProcessor = processor
        super().__init__(model, processor.tokenizer, model_name, END_TOKENS, batch_size=batch_size,
                         feature_cache_size=feature_cache_size, prefix_cache_size=prefix_cache_size)
        self.lm: Phi3VForCausalLM

    @classmethod
    def from_model(cls, model: Phi3VForCausalLM, processor: Phi3VProcessor, model_name: str, batch_size: int = 4,
                   feature_cache_size: int = 32, prefix_cache_size: int = 8) -> Phi3VBackend:
        """A backend over a model already built (on its device, in its dtype) and its processor: the preflight's
        full-width, reduced-depth rehearsal of a query (``hkrag.tasks.preflight --path query``)."""
        backend = cls.__new__(cls)
        backend._attach(model, processor, model_name, batch_size, feature_cache_size, prefix_cache_size)
        return backend

    @property
    def num_crops(self) -> int:
        return self.processor.image_processor.num_crops

    def feature_key(self, page: PageImage) -> Hashable:
        return (page.key, self.num_crops)

    def page_features(self, page: PageImage) -> torch.Tensor:
        """The page's projected image tokens (HD transform → CLIP → separators → MLP): (tokens, hidden)."""
        vision = self.processor.image_processor([page.load()])
        embedding = self.lm.model.vision_embed_tokens
        return embedding(vision["pixel_values"].to(self.device), vision["image_sizes"].to(self.device))

    def is_image_token(self, ids: torch.Tensor) -> torch.Tensor:
        return ids < 0

    def skip_pages(self, kwargs: dict[str, Any], pages: int, tokens: int) -> None:
        rest = kwargs.pop("image_features")[tokens:]
        if len(rest):
            kwargs["image_features"] = rest

    def prompt(self, request: LVLMRequest) -> str:
        return phi3_chat(request.messages)

    def prepare(self, requests: Sequence[LVLMRequest]) -> ModelInputs:
        features = [[self.page(page) for page in request.images] for request in requests]
        ids = [
            self.processor.prompt_ids(self.prompt(request), [len(f) for f in pages])
            for request, pages in zip(requests, features)
        ]
        batch = self.processor.pad(ids, padding_side="left")
        kwargs = {key: value.to(self.device) for key, value in batch.items()}
        flat = [f for pages in features for f in pages]
        if flat:
            kwargs["image_features"] = torch.cat(flat)
        keys = [[(self.feature_key(p), len(f)) for p, f in zip(r.images, row)] for r, row in zip(requests, features)]
        return ModelInputs(kwargs, [len(row) for row in ids], keys)

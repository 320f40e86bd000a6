"""Phi-3-vision on transformers building blocks: ``CLIPVisionModel`` + ``Phi3Model``.

Module names mirror the original checkpoint so its tensors load unchanged:
``model.vision_embed_tokens.img_processor.vision_model.*`` (CLIP), ``model.vision_embed_tokens.
{img_projection.0, img_projection.2, glb_GN, sub_GN}``, ``model.embed_tokens``, ``model.layers.N.*``,
``model.norm`` and ``lm_head``. Image features are CLIP's penultimate hidden states without CLS,
2x2-merged, laid out as [sub grid + row separators, ``glb_GN``, global grid + row separators] and
projected by Linear -> GELU -> Linear (docs/phi3v_fidelity.md). Every size derives from the vision config.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.phi3.modeling_phi3 import Phi3Model, Phi3PreTrainedModel

from .configuration_phi3v import Phi3VConfig


def positions_from_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """RoPE positions counting only real tokens, so left and right padding give the same numbers."""
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return positions[:, -length:]


class CLIPVisionTower(nn.Module):
    """Holds CLIP as ``vision_model`` so parameter names equal the original checkpoint's
    (transformers 5.x flattened ``CLIPVisionModel``, dropping that level)."""

    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.vision_model = CLIPVisionModel(config)

    def forward(self, pixel_values: torch.Tensor, layer: int) -> torch.Tensor:
        """Hidden states of ``layer`` (e.g. -2, the penultimate) for a batch of crops."""
        return self.vision_model(pixel_values=pixel_values, output_hidden_states=True).hidden_states[layer]


class Phi3VImageEmbedding(nn.Module):
    """CLIP features -> HD layout with learnable separators -> LM-width image tokens."""

    def __init__(self, config: Phi3VConfig) -> None:
        super().__init__()
        self.config = config
        self.img_processor = CLIPVisionTower(config.vision_config)
        dim = config.image_feature_dim
        self.glb_GN = nn.Parameter(torch.zeros(1, 1, dim))
        self.sub_GN = nn.Parameter(torch.zeros(1, 1, 1, dim))
        self.img_projection = nn.Sequential(
            nn.Linear(dim, config.hidden_size), nn.GELU(), nn.Linear(config.hidden_size, config.hidden_size)
        )

    def unreachable_parameters(self) -> list[nn.Parameter]:
        """CLIP parameters the image features never depend on: the layers after ``layer_idx`` and the final norm.

        They get no gradient, so they are frozen wherever the image embedding is trained (DDP refuses trainable
        parameters that no loss reaches)."""
        clip = self.img_processor.vision_model
        layers = clip.encoder.layers
        layer = self.config.img_processor.get("layer_idx", -2)
        used = layer % (len(layers) + 1)  # hidden_states[k] is the output of the first k layers
        return [*(p for block in layers[used:] for p in block.parameters()), *clip.post_layernorm.parameters()]

    def crop_features(self, crops: torch.Tensor) -> torch.Tensor:
        """Penultimate CLIP layer, CLS dropped: (n, 3, s, s) -> (n, patches, vision_hidden)."""
        return self.img_processor(crops, self.config.img_processor.get("layer_idx", -2))[:, 1:]

    def merge_2x2(self, features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """(rows*cols, p*p, c) crop features -> (rows*m, cols*m, 4c) grid, m = p/2, crops row-major."""
        m, c = self.config.merged_per_side, features.shape[-1]
        grid = features.reshape(rows * cols, m, 2, m, 2, c).permute(0, 1, 3, 2, 4, 5)
        grid = grid.reshape(rows, cols, m, m, 4 * c).permute(0, 2, 1, 3, 4)
        return grid.reshape(rows * m, cols * m, 4 * c)

    def with_row_separators(self, grid: torch.Tensor) -> torch.Tensor:
        """Append ``sub_GN`` after every row of a (h, w, d) grid and flatten to (h*(w+1), d)."""
        separators = self.sub_GN.reshape(1, 1, -1).expand(grid.shape[0], 1, -1).to(grid.dtype)
        return torch.cat([grid, separators], dim=1).reshape(-1, grid.shape[-1])

    def forward(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """Image tokens of every image in order, concatenated: (sum of tokens, hidden)."""
        crop = self.config.crop_size
        grids = [(int(h) // crop, int(w) // crop) for h, w in image_sizes.tolist()]
        used = [pixel_values[i, : 1 + rows * cols] for i, (rows, cols) in enumerate(grids)]
        dtype = next(self.img_processor.parameters()).dtype
        features = self.crop_features(torch.cat(used).to(dtype)).split([len(u) for u in used])
        tokens = []
        for (rows, cols), feats in zip(grids, features):
            sub = self.with_row_separators(self.merge_2x2(feats[1:], rows, cols))
            glb = self.with_row_separators(self.merge_2x2(feats[:1], 1, 1))
            tokens.extend([sub, self.glb_GN.reshape(1, -1).to(sub.dtype), glb])
        return self.img_projection(torch.cat(tokens).to(next(self.img_projection.parameters()).dtype))


class Phi3VPreTrainedModel(Phi3PreTrainedModel):
    config_class = Phi3VConfig
    config: Phi3VConfig
    _no_split_modules = ["Phi3DecoderLayer", "CLIPEncoderLayer"]
    _keys_to_ignore_on_load_unexpected = [r"position_ids$"]


class Phi3VModel(Phi3VPreTrainedModel, Phi3Model):
    """Phi-3 decoder whose input embeddings carry image tokens at the negative placeholder ids."""

    def __init__(self, config: Phi3VConfig) -> None:
        Phi3Model.__init__(self, config)
        self.vision_embed_tokens = Phi3VImageEmbedding(config)
        self.embed_dropout = nn.Dropout(config.embd_pdrop)
        self.post_init()

    def embed(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.Tensor | None = None,
        image_sizes: torch.Tensor | None = None,
        image_features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with image features scattered row-major into the ``-k`` placeholders.

        ``image_features`` (sum of image tokens, hidden), as :class:`Phi3VImageEmbedding` returns them,
        replaces ``pixel_values``: callers that reuse a page's features across prompts skip the vision tower.
        ``input_ids`` is read, never written (the reference clamps it in place).
        """
        is_image = input_ids < 0
        embeds = self.embed_tokens(input_ids.clamp(min=0))
        num_placeholders = int(is_image.sum())
        if num_placeholders:
            if image_features is not None:
                features = image_features
            elif pixel_values is None or image_sizes is None:
                raise ValueError(f"input_ids hold {num_placeholders} image placeholders but no pixel_values")
            else:
                features = self.vision_embed_tokens(pixel_values, image_sizes)
            if features.shape[0] != num_placeholders:
                images = "" if image_sizes is None else f" {len(image_sizes)}"
                raise ValueError(
                    f"input_ids hold {num_placeholders} image placeholders but the{images} image(s) "
                    f"give {features.shape[0]} tokens; build inputs with Phi3VProcessor and the same num_crops"
                )
            embeds = embeds.masked_scatter(is_image.unsqueeze(-1), features.to(embeds.dtype))
        return self.embed_dropout(embeds)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_sizes: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        image_features: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass input_ids or inputs_embeds")
            inputs_embeds = self.embed(input_ids, pixel_values, image_sizes, image_features)
        if position_ids is None and attention_mask is not None and attention_mask.dim() == 2:
            position_ids = positions_from_mask(attention_mask, inputs_embeds.shape[1])
        return Phi3Model.forward(
            self, inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )


class Phi3VForCausalLM(Phi3VPreTrainedModel, GenerationMixin):
    """Phi-3-vision with its LM head; ``generate()`` feeds images only at prefill (KV cache after)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Phi3VConfig) -> None:
        super().__init__(config)
        self.model = Phi3VModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_sizes: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        image_features: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            image_sizes=image_sizes,
            attention_mask=attention_mask,
            image_features=image_features,
            **kwargs,
        )
        hidden = outputs.last_hidden_state[:, -logits_to_keep:, :]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)

"""Configuration of Phi-3-vision, compatible with the original ``config.json``.

The original checkpoint (``microsoft/Phi-3-vision-128k-instruct``) stores a flat Phi-3 language-model
config plus ``img_processor`` / ``embd_layer`` dicts naming a fixed CLIP ViT-L/14-336. We keep that
layout so the original file loads unchanged, and add an optional ``vision_config`` (a
``CLIPVisionConfig`` dict) so tiny configs can shrink the vision tower on the same code path.
"""

from __future__ import annotations

from typing import Any

from transformers import CLIPVisionConfig, Phi3Config

CLIP_VIT_L14_336 = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=336,
    patch_size=14,
    projection_dim=768,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    attention_dropout=0.0,
    dropout=0.0,
)
"""The vision tower Phi-3-vision hard-codes (``openai/clip-vit-large-patch14-336``)."""


def _longrope_parameters(
    rope_scaling: dict[str, Any], rope_theta: float, original_max_position_embeddings: int
) -> dict[str, Any]:
    """Translate the 4.x ``rope_scaling`` dict (``type: su``) into transformers 5.x ``rope_parameters``.

    transformers 5.x requires ``original_max_position_embeddings`` inside the rope dict for
    ``longrope``; the original config keeps it at top level, hence this fix-up.
    """
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in ("su", "longrope"):
        rope_type = "longrope"
    params = {k: v for k, v in rope_scaling.items() if k not in ("type", "rope_type")}
    params.update(rope_type=rope_type, rope_theta=rope_theta)
    if rope_type == "longrope":
        params.setdefault("original_max_position_embeddings", original_max_position_embeddings)
    return params


class Phi3VConfig(Phi3Config):
    """Phi-3-vision config: a Phi-3 LM config plus the image-embedding settings.

    Args:
        vision_config: ``CLIPVisionConfig`` kwargs. Defaults to CLIP ViT-L/14-336 as in the reference.
        img_processor: the original dict (``image_dim_out``, ``num_img_tokens``, ``layer_idx``...).
        embd_layer: the original dict (``hd_transform_order``, ``projection_cls``...).
        rope_scaling: legacy 4.x rope dict, converted to ``rope_parameters``.
    """

    model_type = "phi3_v"
    sub_configs = {"vision_config": CLIPVisionConfig}

    def __init__(
        self,
        vision_config: dict[str, Any] | CLIPVisionConfig | None = None,
        img_processor: dict[str, Any] | None = None,
        embd_layer: dict[str, Any] | None = None,
        rope_scaling: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # The original file pins flash_attention_2; attention is chosen at load time instead
        # (`default_attn_implementation`), so a machine without flash-attn still loads it.
        kwargs.pop("_attn_implementation", None)
        # The original file's auto_map points at the hub's remote code, which these classes replace.
        kwargs.pop("auto_map", None)
        if rope_scaling is not None and kwargs.get("rope_parameters") is None:
            kwargs["rope_parameters"] = _longrope_parameters(
                rope_scaling,
                kwargs.get("rope_theta", 10000.0),
                kwargs.get("original_max_position_embeddings", 4096),
            )
        if isinstance(vision_config, CLIPVisionConfig):
            vision_config = vision_config.to_dict()
        self.vision_config = CLIPVisionConfig(**{**CLIP_VIT_L14_336, **(vision_config or {})})
        self.img_processor = {
            "name": "clip_vision_model",
            "model_name": "openai/clip-vit-large-patch14-336",
            "image_dim_out": self.vision_config.hidden_size,
            "num_img_tokens": self.tokens_per_crop,
            "layer_idx": -2,
            "type_feature": "patch",
            **(img_processor or {}),
        }
        self.embd_layer = {
            "embedding_cls": "image",
            "hd_transform_order": "sub_glb",
            "projection_cls": "mlp",
            "use_hd_transform": True,
            "with_learnable_separator": True,
            **(embd_layer or {}),
        }
        super().__init__(**kwargs)
        self._validate_vision()

    @property
    def crop_size(self) -> int:
        """Side of one square crop in pixels (336 in the reference)."""
        return self.vision_config.image_size

    @property
    def patches_per_side(self) -> int:
        """ViT patches along one side of a crop (24 in the reference)."""
        return self.vision_config.image_size // self.vision_config.patch_size

    @property
    def merged_per_side(self) -> int:
        """Tokens along one side of a crop after the 2x2 patch merge (12 in the reference)."""
        return self.patches_per_side // 2

    @property
    def tokens_per_crop(self) -> int:
        """LM tokens one crop becomes (144 in the reference)."""
        return self.merged_per_side**2

    @property
    def image_feature_dim(self) -> int:
        """Channel width after the 2x2 merge (4096 in the reference)."""
        return 4 * self.vision_config.hidden_size

    def _validate_vision(self) -> None:
        vc = self.vision_config
        if vc.image_size % vc.patch_size or self.patches_per_side % 2:
            raise ValueError(
                f"vision_config: image_size {vc.image_size} / patch_size {vc.patch_size} must give an even "
                "number of patches per side (the 2x2 merge needs it)"
            )
        if self.img_processor["image_dim_out"] != vc.hidden_size:
            raise ValueError(
                f"img_processor.image_dim_out={self.img_processor['image_dim_out']} disagrees with "
                f"vision_config.hidden_size={vc.hidden_size}"
            )
        if self.embd_layer["hd_transform_order"] != "sub_glb" or self.embd_layer["projection_cls"] != "mlp":
            raise NotImplementedError(f"only hd_transform_order=sub_glb and projection_cls=mlp: {self.embd_layer}")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["vision_config"] = self.vision_config.to_diff_dict()
        return out


def tiny_phi3v_config(**overrides: Any) -> Phi3VConfig:
    """A few-MB Phi3V with the full architecture: 56-px crops (patch 14), 2 LM layers, hidden 64.

    Same code path as the 4.2B model, smaller numbers; used by the tests, the demo and CPU benches.
    """
    base: dict[str, Any] = dict(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=56,
            patch_size=14,
            projection_dim=32,
        ),
    )
    base.update(overrides)
    return Phi3VConfig(**base)

"""Phi-3-vision, transformers-native (DESIGN §3)."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_phi3v import Phi3VConfig, tiny_phi3v_config
from .image_processing_phi3v import Phi3VImageProcessor, num_image_tokens, to_rgb
from .loading import load_phi3v, load_processor, tiny_phi3v
from .modeling_phi3v import Phi3VForCausalLM, Phi3VModel, default_attn_implementation
from .processing_phi3v import Phi3VProcessor, image_tag
from .tokenization import build_offline_tokenizer

AutoConfig.register("phi3_v", Phi3VConfig, exist_ok=True)
AutoModel.register(Phi3VConfig, Phi3VModel, exist_ok=True)
AutoModelForCausalLM.register(Phi3VConfig, Phi3VForCausalLM, exist_ok=True)

__all__ = [
    "Phi3VConfig",
    "Phi3VForCausalLM",
    "Phi3VImageProcessor",
    "Phi3VModel",
    "Phi3VProcessor",
    "build_offline_tokenizer",
    "default_attn_implementation",
    "image_tag",
    "load_phi3v",
    "load_processor",
    "num_image_tokens",
    "tiny_phi3v",
    "tiny_phi3v_config",
    "to_rgb",
]

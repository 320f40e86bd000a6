"""Phi-3-vision, transformers-native (docs/phi3v_fidelity.md).

Importing this package registers the classes with transformers' Auto classes under the original
``model_type`` ``phi3_v`` and class names, so code written for the hub's remote code
(``AutoModelForCausalLM``, ``AutoProcessor``, ``AutoImageProcessor``) runs on ours without
``trust_remote_code``: transformers prefers a registered class over a checkpoint's ``auto_map``.
"""

from transformers import AutoConfig, AutoImageProcessor, AutoModel, AutoModelForCausalLM, AutoProcessor

from .configuration_phi3v import Phi3VConfig, tiny_phi3v_config
from .image_processing_phi3v import Phi3VImageProcessor, num_image_tokens, to_rgb
from .loading import (
    PHI3V_HUB_ID,
    CheckpointNotFoundError,
    load_phi3v,
    load_processor,
    save_processor,
    tiny_phi3v,
)
from .modeling_phi3v import Phi3VForCausalLM, Phi3VModel
from .processing_phi3v import Phi3VProcessor, image_tag
from .tokenization import build_offline_tokenizer

AutoConfig.register("phi3_v", Phi3VConfig, exist_ok=True)
AutoModel.register(Phi3VConfig, Phi3VModel, exist_ok=True)
AutoModelForCausalLM.register(Phi3VConfig, Phi3VForCausalLM, exist_ok=True)
# One class serves both backends, so no "falling back to pil" warning where torchvision is installed.
AutoImageProcessor.register(
    Phi3VConfig, image_processor_classes={"pil": Phi3VImageProcessor, "torchvision": Phi3VImageProcessor}, exist_ok=True
)
AutoProcessor.register(Phi3VConfig, Phi3VProcessor, exist_ok=True)

__all__ = [
    "PHI3V_HUB_ID",
    "CheckpointNotFoundError",
    "Phi3VConfig",
    "Phi3VForCausalLM",
    "Phi3VImageProcessor",
    "Phi3VModel",
    "Phi3VProcessor",
    "build_offline_tokenizer",
    "image_tag",
    "load_phi3v",
    "load_processor",
    "save_processor",
    "num_image_tokens",
    "tiny_phi3v",
    "tiny_phi3v_config",
    "to_rgb",
]

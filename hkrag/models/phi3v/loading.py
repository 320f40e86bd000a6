"""Loading Phi-3-vision and its processor: the original checkpoint, or a tiny random one offline."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import cached_file

from .configuration_phi3v import Phi3VConfig, tiny_phi3v_config
from .image_processing_phi3v import CLIP_MEAN, CLIP_STD, Phi3VImageProcessor
from .modeling_phi3v import Phi3VForCausalLM, default_attn_implementation
from .processing_phi3v import Phi3VProcessor
from .tokenization import build_offline_tokenizer

PHI3V_HUB_ID = "microsoft/Phi-3-vision-128k-instruct"
PREPROCESSOR_FILE = "preprocessor_config.json"


def load_phi3v(
    name_or_path: str = PHI3V_HUB_ID,
    dtype: torch.dtype | str = torch.bfloat16,
    attn_implementation: str | None = None,
    **kwargs: Any,
) -> Phi3VForCausalLM:
    """Load the original checkpoint (hub id or local folder) into :class:`Phi3VForCausalLM`.

    The original ``config.json`` is read as is (its ``rope_scaling`` is converted for transformers
    5.x); attention defaults to flash-attn when installed, else SDPA.
    """
    attn = attn_implementation or default_attn_implementation()
    config = Phi3VConfig.from_pretrained(name_or_path)
    return Phi3VForCausalLM.from_pretrained(
        name_or_path, config=config, dtype=dtype, attn_implementation=attn, **kwargs
    )


def read_preprocessor_config(name_or_path: str) -> dict[str, Any]:
    """The checkpoint's ``preprocessor_config.json`` (``num_crops``, mean, std), or ``{}`` if absent."""
    path = cached_file(name_or_path, PREPROCESSOR_FILE, _raise_exceptions_for_missing_entries=False)
    return json.loads(Path(path).read_text()) if path else {}


def image_processor_for(config: Phi3VConfig, num_crops: int = 16, **kwargs: Any) -> Phi3VImageProcessor:
    """An image processor whose crop geometry matches ``config``'s vision tower."""
    return Phi3VImageProcessor(
        num_crops=num_crops, crop_size=config.crop_size, merged_per_side=config.merged_per_side, **kwargs
    )


def load_processor(name_or_path: str = PHI3V_HUB_ID, num_crops: int | None = None) -> Phi3VProcessor:
    """Tokenizer + image processor of a checkpoint; ``num_crops`` overrides the saved value."""
    config = Phi3VConfig.from_pretrained(name_or_path)
    saved = read_preprocessor_config(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "right"
    image_processor = image_processor_for(
        config,
        num_crops=num_crops or saved.get("num_crops", 16),
        image_mean=saved.get("image_mean", CLIP_MEAN),
        image_std=saved.get("image_std", CLIP_STD),
    )
    return Phi3VProcessor(tokenizer, image_processor)


def save_processor(processor: Phi3VProcessor, directory: str | Path) -> None:
    """Write tokenizer files and a ``preprocessor_config.json`` in the original format."""
    directory = Path(directory)
    processor.tokenizer.save_pretrained(directory)
    ip = processor.image_processor
    saved = {
        "image_processor_type": "Phi3VImageProcessor",
        "processor_class": "Phi3VProcessor",
        "num_crops": ip.num_crops,
        "num_img_tokens": ip.merged_per_side**2,
        "image_mean": ip.image_mean.flatten().tolist(),
        "image_std": ip.image_std.flatten().tolist(),
    }
    (directory / PREPROCESSOR_FILE).write_text(json.dumps(saved, indent=2))


def tiny_phi3v(
    texts: Iterable[str] = (),
    num_crops: int = 4,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **config_overrides: Any,
) -> tuple[Phi3VForCausalLM, Phi3VProcessor]:
    """A random-initialised tiny Phi3V and a matching offline processor (no downloads)."""
    tokenizer = tokenizer or build_offline_tokenizer(texts)
    config = tiny_phi3v_config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    config._attn_implementation = config_overrides.pop("attn_implementation", "sdpa")
    torch.manual_seed(seed)
    model = Phi3VForCausalLM(config)
    return model, Phi3VProcessor(tokenizer, image_processor_for(config, num_crops=num_crops))

"""Phi-3-vision image processor: the HD transform, in plain PIL + torch.

The reference (``image_processing_phi3_v.py``) hard-codes 336-px crops; here every size derives from
``crop_size`` so a 56-px tiny vision tower runs the same path. Steps (docs/phi3v_fidelity.md):

1. make the page landscape (``Image.TRANSPOSE``, undone at the end);
2. pick the largest ``scale`` with ``scale * ceil(scale / ratio) <= num_crops``;
3. resize (bilinear) to width ``scale * crop`` keeping the ratio;
4. pad the height, centred and white, to a multiple of ``crop``;
5. normalise; the global view is a bicubic ``crop x crop`` resize of the normalised padded image;
6. slot 0 = global view, then the crops row-major, then zero slots up to ``num_crops + 1``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps
from transformers import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor
from transformers.processing_utils import ImagesKwargs
from transformers.utils import TensorType

from hkrag.io import write_text

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200.0


def hd_scale(width: int, height: int, num_crops: int) -> int:
    """Largest ``scale`` with ``scale * ceil(scale / ratio) <= num_crops`` for a landscape page."""
    ratio = width / height
    scale = 1
    while scale * math.ceil(scale / ratio) <= num_crops:
        scale += 1
    return scale - 1


def hd_padded_size(width: int, height: int, num_crops: int, crop: int) -> tuple[int, int]:
    """``(height, width)`` of the padded HD image, i.e. the reference's ``image_sizes`` entry."""
    transposed = width < height
    if transposed:
        width, height = height, width
    new_w = hd_scale(width, height, num_crops) * crop
    new_h = max(1, int(new_w / (width / height)))
    padded_h = math.ceil(new_h / crop) * crop
    return (new_w, padded_h) if transposed else (padded_h, new_w)


def num_image_tokens(height: int, width: int, crop: int, merged: int) -> int:
    """LM tokens for a padded ``height x width`` image: ``(h*w + 1) * m^2 + 1 + (h + 1) * m``.

    ``h, w`` count crops and ``m`` is the merged grid side (12 for 336-px crops), so the sub grid,
    the ``glb_GN`` separator and the global view each contribute one row separator per row.
    """
    h, w = height // crop, width // crop
    return (h * w + 1) * merged * merged + 1 + (h + 1) * merged


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode (RGBA, LA, P, CMYK, I;16, F, 1...) to RGB; transparency goes on white."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        array = np.asarray(image, dtype=np.float64)
        lo, hi = float(array.min()), float(array.max())
        array = (array - lo) / (hi - lo) * 255.0 if hi > lo else np.zeros_like(array)
        return Image.fromarray(array.astype(np.uint8), mode="L").convert("RGB")
    if image.mode == "P" and "transparency" in image.info or image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return image.convert("RGB")


class Phi3VImagesKwargs(ImagesKwargs, total=False):
    """The HD transform's settings, so ``from_pretrained(..., num_crops=4)`` overrides the saved value."""

    num_crops: int
    merged_per_side: int
    num_img_tokens: int


class Phi3VImageProcessor(BaseImageProcessor):
    """Turns pages into ``pixel_values`` (N, num_crops+1, 3, crop, crop) and ``image_sizes`` (N, 2).

    A transformers ``BaseImageProcessor``: ``to_dict``/``from_dict``, ``save_pretrained``/``from_pretrained``
    and ``AutoImageProcessor`` read and write the original ``preprocessor_config.json`` layout
    (``num_crops``, ``num_img_tokens``, ``image_mean``, ``image_std``) plus ``crop_size`` and
    ``merged_per_side``, which the reference hard-codes (336 and 12).

    Args:
        num_crops: maximum number of HD crops per image (16 for Phi-3-vision; 4 is common for speed).
        crop_size: crop side in pixels; must equal the vision tower's ``image_size``.
        merged_per_side: tokens per crop side after the 2x2 merge (``crop_size / patch / 2``). When ``None``,
            the square root of ``num_img_tokens`` (the original file's key), else 12.
        num_img_tokens: tokens per crop, read only when ``merged_per_side`` is not given; always written
            back as ``merged_per_side ** 2``.
    """

    valid_kwargs = Phi3VImagesKwargs
    model_input_names = ["pixel_values", "image_sizes"]

    def __init__(
        self,
        num_crops: int = 16,
        crop_size: int = 336,
        merged_per_side: int | None = None,
        image_mean: Sequence[float] = CLIP_MEAN,
        image_std: Sequence[float] = CLIP_STD,
        num_img_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("auto_map", None)  # the original file points at remote code; these classes replace it
        super().__init__(**kwargs)
        if num_crops < 1:
            raise ValueError(f"num_crops must be >= 1, got {num_crops}")
        if merged_per_side is None:
            merged_per_side = math.isqrt(num_img_tokens) if num_img_tokens else 12
        self.num_crops = num_crops
        self.crop_size = crop_size
        self.merged_per_side = merged_per_side
        self.image_mean = [float(v) for v in image_mean]
        self.image_std = [float(v) for v in image_std]

    def num_image_tokens(self, width: int, height: int) -> int:
        """Tokens the processor will emit for an unprocessed ``width x height`` page."""
        padded_h, padded_w = hd_padded_size(width, height, self.num_crops, self.crop_size)
        return num_image_tokens(padded_h, padded_w, self.crop_size, self.merged_per_side)

    def hd_transform(self, image: Image.Image) -> Image.Image:
        """Resize and pad an RGB page to whole crops (steps 1-4 above)."""
        check_image_size(image)
        transposed = image.width < image.height
        if transposed:
            image = image.transpose(Image.Transpose.TRANSPOSE)
        padded_h, padded_w = hd_padded_size(image.width, image.height, self.num_crops, self.crop_size)
        new_h = max(1, int(padded_w / (image.width / image.height)))
        image = image.resize((padded_w, new_h), Image.Resampling.BILINEAR)
        top = (padded_h - new_h) // 2
        image = ImageOps.expand(image, (0, top, 0, padded_h - new_h - top), fill=(255, 255, 255))
        return image.transpose(Image.Transpose.TRANSPOSE) if transposed else image

    def crops(
        self,
        image: Image.Image,
        image_mean: Sequence[float] | None = None,
        image_std: Sequence[float] | None = None,
    ) -> torch.Tensor:
        """Normalised global view + row-major crops, zero-padded to ``num_crops + 1`` slots."""
        mean = torch.tensor(self.image_mean if image_mean is None else image_mean).view(3, 1, 1)
        std = torch.tensor(self.image_std if image_std is None else image_std).view(3, 1, 1)
        hd = self.hd_transform(to_rgb(image))
        pixels = torch.from_numpy(np.asarray(hd, dtype=np.float32) / 255.0).permute(2, 0, 1)
        pixels = (pixels - mean) / std
        c, s = 3, self.crop_size
        h, w = pixels.shape[1] // s, pixels.shape[2] // s
        global_view = F.interpolate(pixels[None], size=(s, s), mode="bicubic", align_corners=False)
        local = pixels.reshape(c, h, s, w, s).permute(1, 3, 0, 2, 4).reshape(h * w, c, s, s)
        out = torch.zeros(self.num_crops + 1, c, s, s)
        out[0] = global_view[0]
        out[1 : 1 + h * w] = local
        return out

    def preprocess(
        self,
        images: Image.Image | Sequence[Image.Image],
        image_mean: Sequence[float] | None = None,
        image_std: Sequence[float] | None = None,
        return_tensors: str | TensorType | None = None,
    ) -> BatchFeature:
        """Process one page or a flat list of pages into ``pixel_values``, ``image_sizes``, ``num_img_tokens``.

        Like the reference, ``pixel_values`` and ``image_sizes`` are torch tensors whatever
        ``return_tensors`` is; ``"pt"`` also turns ``num_img_tokens`` into a tensor, ``"np"`` makes all arrays.
        """
        images = [images] if isinstance(images, Image.Image) else list(images)
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise TypeError(f"Phi3VImageProcessor takes PIL images; image {i} is a {type(image).__name__}")
        if not images:
            return BatchFeature({"pixel_values": None, "image_sizes": None, "num_img_tokens": []})
        pixel_values = torch.stack([self.crops(image, image_mean, image_std) for image in images])
        sizes = [hd_padded_size(im.width, im.height, self.num_crops, self.crop_size) for im in images]
        tokens = [num_image_tokens(h, w, self.crop_size, self.merged_per_side) for h, w in sizes]
        data = {
            "pixel_values": pixel_values,
            "image_sizes": torch.tensor(sizes, dtype=torch.long),
            "num_img_tokens": tokens,
        }
        return BatchFeature(data, tensor_type=return_tensors)

    def to_dict(self) -> dict[str, Any]:
        """The original ``preprocessor_config.json`` keys plus ``crop_size`` and ``merged_per_side``."""
        out = super().to_dict()
        out["num_img_tokens"] = self.merged_per_side**2
        return out

    def to_json_file(self, json_file_path: str | os.PathLike) -> None:
        """Written atomically (``hkrag.io``), so a failed save keeps the previous file."""
        write_text(json_file_path, self.to_json_string())


def check_image_size(image: Image.Image) -> None:
    """Refuse (``ValueError``) a page the HD transform cannot crop: zero area, or over 200:1. Public so that
    callers knowing the page's ``doc_id`` check it first and name it (the processor sees only images)."""
    if image.width < 1 or image.height < 1:
        raise ValueError(f"image has zero area ({image.width}x{image.height})")
    ratio = max(image.width, image.height) / min(image.width, image.height)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio {ratio:.0f}:1 ({image.width}x{image.height}) exceeds {MAX_ASPECT_RATIO:.0f}:1; "
            "split the page before encoding"
        )

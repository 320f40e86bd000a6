"""Page images on the wire: a page becomes a ``data:`` URI under a pixel budget, and back.

HTTP servers bill (and vLLM reserves) visual tokens by pixel count, so every page is shrunk to at most
``max_pixels`` keeping its aspect ratio — a 20000×300 strip is resized, never rejected. Encoding is
deterministic (same page, same bytes), which keeps the page prefix of the agents' prompts byte-identical
across calls so a server's prefix cache can reuse it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import re

from PIL import Image

from hkrag.data.images import ImageError, open_image

from .base import PageImage

FORMATS = {"png": "PNG", "jpeg": "JPEG"}
DEFAULT_MAX_PIXELS = 1280 * 28 * 28
"""About one megapixel: 1280 visual tokens of 28×28 px for Qwen2.5-VL (its own default reserves 16k)."""

_DATA_URI = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>[^,]*),(?P<data>.*)$", re.DOTALL)


def fit_to_budget(image: Image.Image, max_pixels: int) -> Image.Image:
    """``image`` scaled down (aspect kept, each side >= 1 px) so that ``width * height <= max_pixels``."""
    if max_pixels < 1:
        raise ValueError(f"max_pixels must be >= 1, got {max_pixels}")
    width, height = image.size
    if width * height <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (width * height))
    new_width, new_height = max(1, int(width * scale)), max(1, int(height * scale))
    while new_width * new_height > max_pixels:
        if new_width >= new_height:
            new_width -= 1
        else:
            new_height -= 1
    return image.resize((new_width, new_height), Image.Resampling.BICUBIC)


def encode_page(page: PageImage, max_pixels: int = DEFAULT_MAX_PIXELS, image_format: str = "png",
                jpeg_quality: int = 90) -> str:
    """``page`` as a ``data:image/png|jpeg;base64,...`` URI of at most ``max_pixels`` pixels.

    Raises :class:`hkrag.data.images.ImageError` naming ``page.key`` when the page cannot be decoded.
    """
    if image_format not in FORMATS:
        raise ValueError(f"image_format must be one of {sorted(FORMATS)}, got {image_format!r}")
    image = fit_to_budget(page.load(), max_pixels)
    if image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    buffer = io.BytesIO()
    options = {"quality": jpeg_quality} if image_format == "jpeg" else {}
    image.save(buffer, format=FORMATS[image_format], **options)
    return f"data:image/{image_format};base64,{base64.b64encode(buffer.getvalue()).decode('ascii')}"


def decode_data_uri(uri: str) -> PageImage:
    """The page a ``data:`` URI carries, keyed by a hash of its bytes (so the same page gets the same key).

    Raises :class:`hkrag.data.images.ImageError` for anything that is not a decodable base64 image URI.
    """
    preview = uri[:40] + ("..." if len(uri) > 40 else "")
    match = _DATA_URI.match(uri)
    if match is None or not match["params"].endswith(";base64"):
        raise ImageError(preview, "expected a base64 data URI (data:image/...;base64,...); URLs are not fetched")
    try:
        data = base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(preview, f"invalid base64 payload ({error})") from error
    key = f"sha256:{hashlib.sha256(data).hexdigest()[:16]}"
    return PageImage(open_image(data, key), key)

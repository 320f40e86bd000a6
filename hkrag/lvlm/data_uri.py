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

from PIL import Image

from hkrag.data.images import DEFAULT_MAX_PIXELS as DECODE_MAX_PIXELS
from hkrag.data.images import ImageError, open_image

from .base import PageImage

FORMATS = {"png": "PNG", "jpeg": "JPEG"}
DEFAULT_MAX_PIXELS = 1280 * 28 * 28
"""About one megapixel: 1280 visual tokens of 28×28 px for Qwen2.5-VL (its own default reserves 16k)."""

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


def decode_data_uri(uri: str, max_pixels: int | None = DECODE_MAX_PIXELS) -> PageImage:
    """The page a ``data:image/...;base64,`` URI carries, keyed by a hash of its bytes (so the same page gets the
    same key); URLs are never fetched.

    Raises :class:`hkrag.data.images.ImageError` naming the problem: another scheme, a mime type that is not
    ``image/*``, no base64, a bad payload, an undecodable or truncated image, more than ``max_pixels`` pixels.
    """
    head, comma, payload = uri.partition(",")
    scheme = head.split(":", 1)[0].lower() if ":" in head else ""
    preview = uri[:40] + ("..." if len(uri) > 40 else "")
    if scheme in ("http", "https", "ftp", "file"):
        raise ImageError(preview, f"{scheme}:// image URLs are not fetched by this server (URLs are not fetched); "
                         "send the page inline as data:image/png;base64,...")
    if scheme != "data" or not comma:
        raise ImageError(preview, f"expected a data:image/...;base64,... URI, got {uri[:40]!r}")
    mime, *options = head[len("data:"):].split(";")
    if not mime.lower().startswith("image/"):
        raise ImageError(preview, f"the data URI's mime type is {mime!r}, not image/*")
    if "base64" not in options:
        raise ImageError(preview, "the data URI is not base64-encoded (expected data:image/...;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(preview, f"invalid base64 payload ({error})") from None
    key = f"sha256:{hashlib.sha256(data).hexdigest()[:16]}"
    return PageImage(open_image(data, key, max_pixels=max_pixels), key)

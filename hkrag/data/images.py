"""Decode and validate document images from any source a corpus may hold.

Corpora from the wild hold PNG/JPEG bytes, file paths, HF ``datasets`` image dicts or
already-open PIL images, in every colour mode. ``open_image`` turns all of them into a fully
loaded ``PIL.Image.Image`` and fails with an :class:`ImageError` that names the document,
so a truncated or corrupt page is reported where it is read, never silently dropped.
Colour modes are left alone: the model's image processor converts to RGB.
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

from PIL import Image, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 89_478_485
"""Largest accepted ``width * height`` (Pillow's own default limit, about 9459 x 9459)."""


class ImageError(ValueError):
    """A document image that cannot be used; the message names the document and the problem."""

    def __init__(self, doc_id: str, problem: str):
        super().__init__(f"document {doc_id!r}: {problem}")
        self.doc_id = doc_id
        self.problem = problem


def open_image(data: Any, doc_id: str, *, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode ``data`` (PIL image, bytes, path, or ``{"bytes", "path"}`` dict) and load its pixels.

    Loading here (not lazily in the processor) makes truncated files fail with the doc id.
    Raises :class:`ImageError` for unreadable, truncated, empty or over-large images.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = _open(data, doc_id)
        _check_size(image, doc_id, max_pixels)
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as error:
            raise ImageError(doc_id, f"corrupt or truncated image ({error})") from error
    return image


def _open(data: Any, doc_id: str) -> Image.Image:
    """Open lazily (header only) so the size can be checked before decoding the pixels."""
    if isinstance(data, Image.Image):
        return data
    if isinstance(data, dict):
        if data.get("bytes") is not None:
            return _open(data["bytes"], doc_id)
        if data.get("path"):
            return _open(data["path"], doc_id)
        raise ImageError(doc_id, "image dict has neither 'bytes' nor 'path'")
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) == 0:
            raise ImageError(doc_id, "empty image bytes")
        source: Any = io.BytesIO(bytes(data))
    elif isinstance(data, (str, os.PathLike)):
        if not os.path.isfile(data):
            raise ImageError(doc_id, f"image file not found: {os.fspath(data)}")
        source = data
    else:
        raise ImageError(doc_id, f"unsupported image input of type {type(data).__name__}")
    try:
        return Image.open(source)
    except Image.DecompressionBombError as error:
        raise ImageError(doc_id, f"decompression bomb ({error})") from error
    except UnidentifiedImageError as error:
        raise ImageError(doc_id, "not a recognised image format") from error
    except (OSError, SyntaxError, ValueError) as error:
        raise ImageError(doc_id, f"corrupt or truncated image header ({error})") from error


def _check_size(image: Image.Image, doc_id: str, max_pixels: int | None) -> None:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(doc_id, f"zero-area image ({width}x{height})")
    if max_pixels is not None and width * height > max_pixels:
        pixels = width * height
        raise ImageError(doc_id, f"decompression bomb: {width}x{height} = {pixels} pixels > max_pixels={max_pixels}")

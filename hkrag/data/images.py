"""Decode and validate document images from any source a corpus may hold.

Corpora from the wild hold PNG/JPEG bytes, file paths, HF ``datasets`` image dicts or
already-open PIL images, in every colour mode. ``open_image`` turns all of them into a fully
loaded ``PIL.Image.Image`` and fails with an :class:`ImageError` that names the document,
so a truncated or corrupt page is reported where it is read, never silently dropped.
Colour modes are left alone: the model's image processor converts to RGB. An EXIF orientation
tag is applied (a phone scan stored sideways is returned upright). A file holding several frames
(multi-page TIFF, animated GIF/PNG/WebP) yields its first frame with a warning (logged at WARNING, so
it reaches the console of ``train.py`` / ``eval.py`` runs) that names the document and the frame count:
a page corpus holds one page per row, so split such files first. Writing such an in-memory image into a
corpus keeps only its first frame, with the same warning (:func:`warn_frames`).
"""

from __future__ import annotations

import errno
import io
import logging
import os
import warnings
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError
from PIL.ExifTags import Base

logger = logging.getLogger(__name__)

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
        warn_frames(image, doc_id, "used")
        try:
            image.load()
            return _upright(image)
        except (OSError, SyntaxError, ValueError) as error:
            raise ImageError(doc_id, f"corrupt or truncated image ({error})") from error


def warn_frames(image: Image.Image, doc_id: str, kept: str) -> None:
    """Warn, naming the document and the frame count, when ``image`` holds several frames (pages) of which
    only the first is ``kept`` ("used", "stored")."""
    frames = getattr(image, "n_frames", 1)
    if frames > 1:
        logger.warning("document %r: image has %d frames (multi-page or animated); only the first is %s: split the "
                       "file into one page per row", doc_id, frames, kept)


def _upright(image: Image.Image) -> Image.Image:
    """Apply the EXIF orientation tag, if any (1 = already upright)."""
    if image.getexif().get(Base.Orientation, 1) in (None, 1):
        return image
    return ImageOps.exif_transpose(image)


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
        problem = file_problem(data)
        if problem:
            raise ImageError(doc_id, f"image {problem}: {os.fspath(data)}")
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


def file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a readable regular file (``None`` if it is), in words a user can act on."""
    if os.path.isfile(path):
        return None
    if os.path.isdir(path):
        return "path is a directory, not a file"
    if os.path.islink(path):
        try:
            os.stat(path)
        except OSError as error:
            if error.errno == errno.ELOOP:
                return "path is a symbolic link loop"
        return f"path is a broken symbolic link (to {os.readlink(path)})"
    return "path is not a regular file" if os.path.exists(path) else "file not found"


def _check_size(image: Image.Image, doc_id: str, max_pixels: int | None) -> None:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(doc_id, f"zero-area image ({width}x{height})")
    if max_pixels is not None and width * height > max_pixels:
        pixels = width * height
        raise ImageError(doc_id, f"decompression bomb: {width}x{height} = {pixels} pixels > max_pixels={max_pixels}")


def page_png(image: Image.Image) -> bytes:
    """``image`` as PNG bytes, the lossless form every corpus this project writes stores its pages in."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()

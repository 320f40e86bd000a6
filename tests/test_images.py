import io
import random

import pytest
from PIL import Image

from hkrag.data.images import ImageError, open_image


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def noisy(mode: str = "RGB", size: tuple[int, int] = (64, 48)) -> Image.Image:
    rng = random.Random(0)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3))).convert(mode)


@pytest.mark.parametrize("fmt,mode", [("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "P"), ("PNG", "I;16"), ("JPEG", "CMYK")])
def test_modes_are_decoded_and_kept(fmt, mode):
    image = open_image(encode(noisy(mode), fmt), "doc")
    assert (image.size, image.mode) == ((64, 48), mode)


def test_every_input_kind_gives_the_same_pixels(tmp_path):
    original = noisy()
    data = encode(original, "PNG")
    path = tmp_path / "page.png"
    path.write_bytes(data)
    inputs = [
        original,
        data,
        bytearray(data),
        str(path),
        path,
        {"bytes": data, "path": None},
        {"path": str(path)},
    ]
    for source in inputs:
        assert open_image(source, "doc").tobytes() == original.tobytes()


@pytest.mark.parametrize(
    "data,problem",
    [
        (encode(noisy(), "PNG")[:400], "corrupt or truncated image ("),
        (encode(noisy(), "JPEG")[:1500], "corrupt or truncated image ("),
        (encode(noisy(), "PNG")[:20], "corrupt or truncated image header"),
        (b"definitely not an image" * 10, "not a recognised image format"),
        (b"", "empty image bytes"),
        (Image.new("RGB", (0, 10)), "zero-area image (0x10)"),
        ("/no/such/page.png", "image file not found: /no/such/page.png"),
        ({"bytes": None, "path": None}, "neither 'bytes' nor 'path'"),
        (12, "unsupported image input of type int"),
    ],
    ids=[
        "png-truncated",
        "jpeg-truncated",
        "header-truncated",
        "garbage",
        "empty",
        "zero-area",
        "missing",
        "empty-dict",
        "int",
    ],
)
def test_bad_images_raise_naming_the_document(data, problem):
    with pytest.raises(ImageError, match="report.pdf#p3") as info:
        open_image(data, "report.pdf#p3")
    assert problem in str(info.value)
    assert info.value.doc_id == "report.pdf#p3"
    assert isinstance(info.value, ValueError)


def test_decompression_bomb_is_refused_before_decoding():
    with pytest.raises(ImageError, match=r"'big': decompression bomb: 64x48 = 3072 pixels > max_pixels=3000"):
        open_image(encode(noisy(), "PNG"), "big", max_pixels=3000)
    assert open_image(encode(noisy(), "PNG"), "big", max_pixels=None).size == (64, 48)

"""HD transform and prompt processing against the reference's numbers (DESIGN §3)."""

import io
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from hkrag.models.phi3v import Phi3VImageProcessor, Phi3VProcessor, build_offline_tokenizer, num_image_tokens
from hkrag.models.phi3v.image_processing_phi3v import CLIP_MEAN, CLIP_STD


@pytest.fixture(scope="module")
def tokenizer():
    return build_offline_tokenizer()


def processor(tokenizer, num_crops=16, crop=336):
    return Phi3VProcessor(tokenizer, Phi3VImageProcessor(num_crops, crop, crop // 28))


def test_landscape_page_matches_reference_shapes():
    out = Phi3VImageProcessor(num_crops=16)([Image.new("RGB", (1000, 500), "red")])
    assert out["pixel_values"].shape == (1, 17, 3, 336, 336)
    assert out["image_sizes"].tolist() == [[1008, 1680]]
    assert out["num_img_tokens"] == [2353]


@pytest.mark.parametrize("num_crops, expected", [(16, 2509), (4, 757)])
def test_square_page_token_count(num_crops, expected):
    assert Phi3VImageProcessor(num_crops=num_crops)([Image.new("RGB", (336, 336))])["num_img_tokens"] == [expected]


def test_token_formula_by_hand():
    # 3x5 crops of 12x12 merged tokens: 16 grids * 144 + glb_GN + 4 row separators * 12
    assert num_image_tokens(1008, 1680, 336, 12) == 16 * 144 + 1 + 4 * 12


def test_portrait_page_is_transposed_back():
    out = Phi3VImageProcessor(num_crops=16)([Image.new("RGB", (500, 1000))])
    assert out["image_sizes"].tolist() == [[1680, 1008]]


def test_layout_global_view_then_row_major_crops_with_centred_white_padding():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (500, 1000, 3), dtype=np.uint8))
    ip = Phi3VImageProcessor(num_crops=16)
    pixels = ip([image])["pixel_values"][0]
    padded = torch.from_numpy(np.asarray(ip.hd_transform(image), dtype=np.float32) / 255).permute(2, 0, 1)
    normalised = (padded - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)
    glb = F.interpolate(normalised[None], size=(336, 336), mode="bicubic", align_corners=False)[0]
    torch.testing.assert_close(pixels[0], glb)
    torch.testing.assert_close(pixels[1], normalised[:, :336, :336])  # top-left crop
    torch.testing.assert_close(pixels[2], normalised[:, :336, 336:672])  # its right neighbour
    torch.testing.assert_close(pixels[15], normalised[:, 672:, 1344:])  # bottom-right crop
    assert pixels[16:].abs().sum() == 0  # zero slot (15 crops used of 16)
    white = (1 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    # 1680x840 content padded to 1008: 84 white rows on top, 84 at the bottom
    torch.testing.assert_close(normalised[:, 83, 5], white)
    assert not torch.allclose(normalised[:, 84, 5], white)
    torch.testing.assert_close(normalised[:, 1008 - 84, 5], white)


def test_token_count_agrees_with_processor_for_random_sizes(tokenizer):
    rng = random.Random(0)
    proc = processor(tokenizer, num_crops=rng.choice([4, 9, 16]), crop=56)
    for _ in range(25):
        w, h = rng.randint(1, 900), rng.randint(1, 900)
        batch = proc("<|image_1|>\nx", [Image.new("RGB", (w, h))])
        assert int((batch["input_ids"] < 0).sum()) == proc.image_processor.num_image_tokens(w, h), (w, h)


def test_prompt_layout_bos_before_and_after_each_image(tokenizer):
    proc = processor(tokenizer, num_crops=4, crop=56)
    ids = proc("<|image_1|>\nWhat is shown in this image?", [Image.new("RGB", (80, 60))])["input_ids"][0]
    n = proc.image_processor.num_image_tokens(80, 60)
    assert ids[0] == tokenizer.bos_token_id
    assert (ids[1 : 1 + n] == -1).all()
    assert ids[1 + n] == tokenizer.bos_token_id


def test_two_images_get_their_own_placeholder_ids(tokenizer):
    proc = processor(tokenizer, num_crops=4, crop=56)
    images = [Image.new("RGB", (80, 60)), Image.new("RGB", (200, 60))]
    ids = proc("<|image_1|> a <|image_2|> b", images)["input_ids"][0].tolist()
    assert ids.count(-1) == proc.image_processor.num_image_tokens(80, 60)
    assert ids.count(-2) == proc.image_processor.num_image_tokens(200, 60)


def test_batch_is_right_padded_with_pad_token(tokenizer):
    proc = processor(tokenizer, crop=56)
    batch = proc(["short", "a much longer prompt than the first"])
    lengths = batch["attention_mask"].sum(1)
    assert batch["attention_mask"][0, : lengths[0]].all() and not batch["attention_mask"][0, lengths[0] :].any()
    assert (batch["input_ids"][0, lengths[0] :] == tokenizer.pad_token_id).all()
    left = proc(["short", "a much longer prompt than the first"], padding_side="left")
    assert left["attention_mask"][0, -lengths[0] :].all() and not left["attention_mask"][0, : -lengths[0]].any()


@pytest.mark.parametrize(
    "make",
    [
        lambda: Image.new("RGBA", (90, 70), (10, 20, 30, 0)),
        lambda: Image.new("P", (90, 70), 3),
        lambda: Image.new("CMYK", (90, 70), (0, 50, 100, 0)),
        lambda: Image.fromarray(np.arange(90 * 70, dtype=np.uint16).reshape(70, 90) * 9),
        lambda: Image.new("LA", (90, 70)),
        lambda: Image.new("1", (90, 70)),
        lambda: Image.new("RGB", (1, 1)),
        lambda: Image.new("RGB", (20000, 300)),
    ],
    ids=["rgba", "palette", "cmyk", "16bit", "la", "bilevel", "1x1", "20000x300"],
)
def test_unusual_images_work(tokenizer, make):
    proc = processor(tokenizer, num_crops=4, crop=56)
    image = make()
    batch = proc("<|image_1|>", [image])
    assert batch["pixel_values"].shape == (1, 5, 3, 56, 56)
    assert torch.isfinite(batch["pixel_values"]).all()
    assert int((batch["input_ids"] < 0).sum()) == proc.image_processor.num_image_tokens(*image.size)


def test_transparent_pixels_become_white():
    from hkrag.models.phi3v import to_rgb

    assert to_rgb(Image.new("RGBA", (2, 2), (0, 0, 0, 0))).getpixel((0, 0)) == (255, 255, 255)


def test_zero_area_page_is_rejected():
    with pytest.raises(ValueError, match="zero area"):
        Phi3VImageProcessor(num_crops=4, crop_size=56)([Image.new("RGB", (0, 10))])


def test_extreme_aspect_ratio_is_rejected_by_name():
    with pytest.raises(ValueError, match="aspect ratio"):
        Phi3VImageProcessor(num_crops=4, crop_size=56)([Image.new("RGB", (30000, 10))])


def test_more_image_tags_than_images(tokenizer):
    proc = processor(tokenizer, num_crops=4, crop=56)
    with pytest.raises(ValueError, match=r"image tags .*1 image\(s\)"):
        proc("<|image_1|> and <|image_2|>", [Image.new("RGB", (50, 50))])


def test_tags_out_of_order(tokenizer):
    proc = processor(tokenizer, num_crops=4, crop=56)
    with pytest.raises(ValueError, match="in order"):
        proc("<|image_2|> <|image_1|>", [Image.new("RGB", (50, 50))] * 2)


def test_truncated_file_names_the_problem(tokenizer):
    buffer = io.BytesIO()
    Image.new("RGB", (200, 200), "blue").save(buffer, format="PNG")
    truncated = Image.open(io.BytesIO(buffer.getvalue()[: len(buffer.getvalue()) // 2]))
    with pytest.raises(OSError, match="truncated"):
        processor(tokenizer, num_crops=4, crop=56)("<|image_1|>", [truncated])


def test_corrupt_bytes_name_the_problem():
    with pytest.raises(OSError, match="cannot identify image"):
        Image.open(io.BytesIO(b"not an image at all"))


def test_reference_tokenizer_special_ids(reference_phi3v):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reference_phi3v)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]}
    assert ids == {"<s>": 1, "<|endoftext|>": 32000, "<|assistant|>": 32001, "<|end|>": 32007, "<|user|>": 32010}
    assert tok.eos_token_id == tok.pad_token_id == 32000


def test_reference_processor_document_prompt(reference_phi3v):
    from hkrag.models.phi3v import load_processor

    proc = load_processor(str(reference_phi3v), num_crops=4)
    batch = proc("<|image_1|>\nWhat is shown in this image?<|endoftext|>", [Image.new("RGB", (336, 336))])
    ids = batch["input_ids"][0]
    assert ids[0] == 1 and ids[1 + 757] == 1 and ids[-1] == 32000
    assert int((ids < 0).sum()) == 757

"""Phi3V in transformers' own conventions: Auto classes, from/save_pretrained, processor call (issue 9)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from huggingface_hub.constants import is_offline_mode
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModel, AutoModelForCausalLM, AutoProcessor

from hkrag.models.phi3v import (
    PHI3V_HUB_ID,
    CheckpointNotFoundError,
    Phi3VConfig,
    Phi3VForCausalLM,
    Phi3VImageProcessor,
    Phi3VModel,
    Phi3VProcessor,
    load_phi3v,
    load_processor,
    save_processor,
)

ORIGINAL_AUTO_MAP = {
    "AutoConfig": "configuration_phi3_v.Phi3VConfig",
    "AutoModelForCausalLM": "modeling_phi3_v.Phi3VForCausalLM",
}
LANDSCAPE = (1000, 500)  # 3x5 crops: 2353 tokens, image_sizes [1008, 1680] (test_phi3v_processor.py)


def assert_same_batch(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


@pytest.mark.parametrize("trust_remote_code", [None, False])
def test_auto_config_reads_reference_without_remote_code(reference_phi3v, trust_remote_code):
    config = AutoConfig.from_pretrained(reference_phi3v, trust_remote_code=trust_remote_code)
    assert type(config) is Phi3VConfig
    assert (config.hidden_size, config.num_hidden_layers) == (3072, 32)
    assert (config.crop_size, config.tokens_per_crop) == (336, 144)
    assert config.rope_parameters["rope_type"] == "longrope"
    assert "auto_map" not in config.to_dict()  # the remote-code pointers are not written back


def test_auto_processor_reference_equals_existing_processor(reference_phi3v):
    processor = AutoProcessor.from_pretrained(reference_phi3v, trust_remote_code=False)
    assert type(processor) is Phi3VProcessor and type(processor.image_processor) is Phi3VImageProcessor
    ip = processor.image_processor
    assert (ip.num_crops, ip.crop_size, ip.merged_per_side) == (16, 336, 12)
    assert processor.tokenizer.convert_tokens_to_ids("<|endoftext|>") == processor.tokenizer.pad_token_id == 32000
    page = Image.new("RGB", LANDSCAPE, "red")
    prompt = "<|image_1|>\nWhat is shown in this image?<|endoftext|>"
    batch = processor(prompt, [page], return_tensors="pt")
    assert int((batch["input_ids"] < 0).sum()) == 2353
    assert batch["image_sizes"].tolist() == [[1008, 1680]]
    assert batch["pixel_values"].shape == (1, 17, 3, 336, 336)
    assert_same_batch(batch, load_processor(str(reference_phi3v))(prompt, [page]))


def test_auto_image_processor_reference_accepts_return_tensors(reference_phi3v):
    ip = AutoImageProcessor.from_pretrained(reference_phi3v)
    assert type(ip) is Phi3VImageProcessor
    page = Image.new("RGB", LANDSCAPE)
    pt = ip(page, return_tensors="pt")
    assert torch.equal(pt["num_img_tokens"], torch.tensor([2353]))
    assert pt["image_sizes"].tolist() == [[1008, 1680]] and pt["pixel_values"].shape == (1, 17, 3, 336, 336)
    np_batch = ip([page], return_tensors="np")
    assert isinstance(np_batch["pixel_values"], np.ndarray)
    np.testing.assert_array_equal(np_batch["pixel_values"], pt["pixel_values"].numpy())
    assert ip([page])["num_img_tokens"] == [2353]  # no return_tensors: a list, as before
    four = AutoImageProcessor.from_pretrained(reference_phi3v, num_crops=4)(page)
    assert four["num_img_tokens"] == [(1 * 2 + 1) * 144 + 1 + (1 + 1) * 12]  # scale 2: 1x2 crops


def test_image_processor_save_and_load_in_the_original_layout(tmp_path):
    ip = Phi3VImageProcessor(num_crops=4, crop_size=56, merged_per_side=2)
    ip.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved == {
        "image_processor_type": "Phi3VImageProcessor",
        "num_crops": 4,
        "num_img_tokens": 4,
        "crop_size": 56,
        "merged_per_side": 2,
        "image_mean": list(ip.image_mean),
        "image_std": list(ip.image_std),
    }
    assert Phi3VImageProcessor.from_pretrained(tmp_path).to_dict() == ip.to_dict()
    assert AutoImageProcessor.from_pretrained(tmp_path, num_crops=9).num_crops == 9
    # the original file names tokens per crop only: 144 -> 12 per side
    assert Phi3VImageProcessor.from_dict({"num_crops": 16, "num_img_tokens": 144}).merged_per_side == 12


def test_image_processor_rejects_non_images_by_index():
    with pytest.raises(TypeError, match="image 1 is a ndarray"):
        Phi3VImageProcessor(num_crops=4, crop_size=56, merged_per_side=2)([Image.new("RGB", (9, 9)), np.zeros((9, 9))])


def test_tiny_model_auto_round_trip_is_bit_exact_despite_original_auto_map(tiny, tmp_path):
    model, _ = tiny
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "phi3_v"
    config["auto_map"] = ORIGINAL_AUTO_MAP  # as in the original checkpoint: must not force remote code
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=False)
    assert type(loaded) is Phi3VForCausalLM
    original = model.state_dict()
    assert loaded.state_dict().keys() == original.keys()
    assert all(torch.equal(v, original[k]) for k, v in loaded.state_dict().items())
    backbone = AutoModel.from_pretrained(tmp_path)
    assert type(backbone) is Phi3VModel
    assert all(torch.equal(v, original[f"model.{k}"]) for k, v in backbone.state_dict().items())


def test_saved_processor_loads_with_auto_processor(tiny, pages, tmp_path):
    model, processor = tiny
    save_processor(processor, tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["processor_class"] == "Phi3VProcessor" and saved["image_processor_type"] == "Phi3VImageProcessor"
    assert (saved["num_crops"], saved["crop_size"], saved["num_img_tokens"]) == (4, 56, 4)
    assert not (tmp_path / "processor_config.json").exists()  # one file, the original layout
    prompts = ["<|image_1|>\nWhat is shown in this image?", "<|image_1|> and <|image_2|>"]
    images = [[pages[0]], [pages[1], pages[2]]]
    expected = processor(prompts, images)
    loaded = AutoProcessor.from_pretrained(tmp_path)  # no config.json in the folder
    assert type(loaded) is Phi3VProcessor
    assert_same_batch(loaded(prompts, images, return_tensors="pt"), expected)
    model.config.save_pretrained(tmp_path)
    assert_same_batch(load_processor(tmp_path)(prompts, images), expected)
    assert_same_batch(Phi3VProcessor.from_pretrained(tmp_path)(prompts, images), expected)


def test_processor_call_conventions(tiny, pages):
    _, processor = tiny
    n = processor.image_processor.num_image_tokens(*pages[0].size)
    as_lists = processor("<|image_1|> x", pages[0], return_tensors=None)
    assert isinstance(as_lists["input_ids"][0], list) and as_lists["input_ids"][0].count(-1) == n
    as_numpy = processor(["a", "a longer prompt"], return_tensors="np")
    assert isinstance(as_numpy["input_ids"], np.ndarray) and as_numpy["attention_mask"].dtype == np.int64
    lengths = processor(["a", "a longer prompt"])["attention_mask"].sum(1)
    padded = processor(["a", "a longer prompt"], padding="max_length", max_length=20)
    assert padded["input_ids"].shape == (2, 20) and torch.equal(padded["attention_mask"].sum(1), lengths)
    with pytest.raises(ValueError, match="different lengths"):
        processor(["a", "a longer prompt"], padding=False)
    cut = processor("<|image_1|> what is the revenue of the company", [pages[0]], max_length=n + 3, truncation=True)
    assert cut["input_ids"].shape == (1, n + 3) and int((cut["input_ids"] < 0).sum()) == n
    with pytest.raises(ValueError, match="over max_length"):
        processor("<|image_1|> what is the revenue of the company", [pages[0]], max_length=n + 3)
    with pytest.raises(ValueError, match="cut its image placeholders"):
        processor("<|image_1|> x", [pages[0]], max_length=n, truncation=True)
    with pytest.raises(ValueError, match="needs text"):
        processor(images=[pages[0]])
    ids = processor("<|image_1|>Yes", [pages[0]])["input_ids"][0]
    assert processor.decode(ids, skip_special_tokens=True) == "Yes"
    assert processor.batch_decode([ids], skip_special_tokens=True) == ["Yes"]


def test_missing_folder_names_path_and_ways_out(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    for load in (load_phi3v, load_processor):
        with pytest.raises(CheckpointNotFoundError, match="no-such-checkpoint") as info:
            load(str(missing))
        assert "model.base=/local/path" in str(info.value) and "tiny" in str(info.value)


def test_missing_files_name_what_is_missing(tiny, tmp_path):
    model, _ = tiny
    model.config.save_pretrained(tmp_path)  # config only: no weights, no tokenizer
    with pytest.raises(CheckpointNotFoundError, match=r"model from .*model\.safetensors"):
        load_phi3v(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="tokenizer from"):
        load_processor(str(tmp_path))


@pytest.mark.skipif(not is_offline_mode(), reason="needs HF_HUB_OFFLINE=1 (set by conftest) to avoid the network")
def test_offline_hub_id_is_named():
    with pytest.raises(CheckpointNotFoundError, match=f"(?s)'{PHI3V_HUB_ID}'.*model.base="):
        load_phi3v(PHI3V_HUB_ID)


def test_hkrag_package_imports_the_registering_module():
    import hkrag
    import hkrag.models.phi3v

    assert hkrag.phi3v is hkrag.models.phi3v
    assert AutoModelForCausalLM._model_mapping[Phi3VConfig] is Phi3VForCausalLM


@pytest.mark.slow
def test_import_hkrag_registers_the_auto_classes():
    """A fresh interpreter (about 10 s on 2 shared cores): ``import hkrag`` alone registers ours, though it imports
    neither torch nor transformers (the registration runs when transformers is imported, :mod:`hkrag.import_hook`)."""
    code = (
        "import sys\n"
        "import hkrag\n"
        "assert not {'torch', 'transformers', 'hkrag.models.phi3v'} & set(sys.modules), sorted(sys.modules)\n"
        "from transformers import AutoConfig, AutoProcessor, AutoModelForCausalLM\n"
        "assert 'hkrag.models.phi3v' in sys.modules\n"
        "from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING\n"
        "from hkrag.models import phi3v\n"
        "config = AutoConfig.for_model('phi3_v')\n"
        "assert type(config) is phi3v.Phi3VConfig\n"
        "assert AutoModelForCausalLM._model_mapping[phi3v.Phi3VConfig] is phi3v.Phi3VForCausalLM\n"
        "assert IMAGE_PROCESSOR_MAPPING[phi3v.Phi3VConfig]['pil'] is phi3v.Phi3VImageProcessor\n"
        "from transformers.models.auto.processing_auto import PROCESSOR_MAPPING\n"
        "assert PROCESSOR_MAPPING[phi3v.Phi3VConfig] is phi3v.Phi3VProcessor\n"
        "assert type(AutoModelForCausalLM.from_config(phi3v.tiny_phi3v_config())) is phi3v.Phi3VForCausalLM\n"
        "assert hkrag.phi3v is phi3v\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]

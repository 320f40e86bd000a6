"""Phi3V model: checkpoint layout, image-token layout, generation, input safety (DESIGN §3)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from hkrag.models.phi3v import Phi3VConfig, Phi3VForCausalLM

ORIGINAL_KEYS = [
    "model.vision_embed_tokens.img_processor.vision_model.embeddings.patch_embedding.weight",
    "model.vision_embed_tokens.img_processor.vision_model.encoder.layers.0.self_attn.q_proj.weight",
    "model.vision_embed_tokens.img_processor.vision_model.post_layernorm.weight",
    "model.vision_embed_tokens.img_projection.0.weight",
    "model.vision_embed_tokens.img_projection.2.bias",
    "model.vision_embed_tokens.glb_GN",
    "model.vision_embed_tokens.sub_GN",
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def document_batch(processor, pages):
    return processor(["<|image_1|>\nWhat is shown in this image?"] * len(pages), [[p] for p in pages])


def original_style_config(model) -> dict:
    """The tiny config written like the original config.json: flat LM keys, 4.x ``rope_scaling: su``."""
    config = model.config.to_dict()
    config.pop("rope_parameters")
    half_head = config["hidden_size"] // config["num_attention_heads"] // 2
    config.update(
        rope_scaling={"type": "su", "short_factor": [1.0] * half_head, "long_factor": [2.0] * half_head},
        rope_theta=10000.0,
        original_max_position_embeddings=4096,
        max_position_embeddings=131072,
    )
    return config


def test_original_layout_checkpoint_loads_without_missing_or_unexpected_keys(tiny, tmp_path):
    model, _ = tiny
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert set(ORIGINAL_KEYS) <= set(state)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(original_style_config(model)))
    loaded, info = Phi3VForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert loaded.config.rope_parameters["rope_type"] == "longrope"
    assert loaded.config.rope_parameters["original_max_position_embeddings"] == 4096
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_state_dict_round_trip(tiny, tmp_path):
    model, _ = tiny
    model.save_pretrained(tmp_path)
    loaded = Phi3VForCausalLM.from_pretrained(tmp_path)
    original = model.state_dict()
    assert loaded.state_dict().keys() == original.keys()
    assert all(torch.equal(v, original[k]) for k, v in loaded.state_dict().items())


def test_full_size_architecture_from_reference_config(reference_phi3v):
    config = Phi3VConfig.from_pretrained(reference_phi3v)
    assert (config.tokens_per_crop, config.image_feature_dim, config.crop_size) == (144, 4096, 336)
    assert config.rope_parameters["rope_type"] == "longrope"
    with torch.device("meta"):
        model = Phi3VForCausalLM(config)
    names = dict(model.named_parameters())
    assert set(ORIGINAL_KEYS) <= set(names)
    assert names["model.vision_embed_tokens.img_projection.0.weight"].shape == (3072, 4096)
    assert names["model.layers.0.self_attn.qkv_proj.weight"].shape == (3 * 3072, 3072)
    assert names["model.layers.31.mlp.gate_up_proj.weight"].shape == (2 * 8192, 3072)
    assert 4.1e9 < sum(p.numel() for p in names.values()) < 4.3e9  # "4.2B parameters"


def reference_image_tokens(embedding, pixel_values, image_sizes):
    """Image-token sequence built the reference way, by explicit loops (independent of merge code)."""
    config = embedding.config
    m, p, crop = config.merged_per_side, config.patches_per_side, config.crop_size
    all_crops = embedding.crop_features(pixel_values.flatten(0, 1)).unflatten(0, pixel_values.shape[:2])

    def grid_tokens(crops, rows, cols):
        out = []
        for r in range(rows * m):
            for c in range(cols * m):
                feats = crops[(r // m) * cols + c // m].reshape(p, p, -1)
                y, x = 2 * (r % m), 2 * (c % m)
                out.append(torch.cat([feats[y, x], feats[y, x + 1], feats[y + 1, x], feats[y + 1, x + 1]]))
            out.append(embedding.sub_GN.flatten())
        return out

    tokens = []
    for i, (h, w) in enumerate(image_sizes.tolist()):
        rows, cols = h // crop, w // crop
        tokens += grid_tokens(all_crops[i, 1 : 1 + rows * cols], rows, cols)
        tokens.append(embedding.glb_GN.flatten())
        tokens += grid_tokens(all_crops[i, :1], 1, 1)
    return embedding.img_projection(torch.stack(tokens))


def test_image_token_layout_matches_reference_loops(tiny, pages):
    model, processor = tiny
    embedding = model.model.vision_embed_tokens
    with torch.no_grad():
        embedding.sub_GN.normal_()
        embedding.glb_GN.normal_()
        batch = processor.image_processor(pages)
        ours = embedding(batch["pixel_values"], batch["image_sizes"])
        expected = reference_image_tokens(embedding, batch["pixel_values"], batch["image_sizes"])
    assert ours.shape == (sum(batch["num_img_tokens"]), model.config.hidden_size)
    torch.testing.assert_close(ours, expected)


def test_forward_does_not_mutate_input_ids(tiny, pages):
    model, processor = tiny
    batch = document_batch(processor, pages[:2])
    before = batch["input_ids"].clone()
    model(**batch)
    assert torch.equal(batch["input_ids"], before)


def test_placeholder_count_mismatch_is_explained(tiny, pages):
    model, processor = tiny
    batch = document_batch(processor, pages[:1])
    batch["input_ids"] = batch["input_ids"][:, :-3].clone()
    batch["input_ids"][0, -1] = -1
    batch["attention_mask"] = batch["attention_mask"][:, :-3]
    with pytest.raises(ValueError, match="image placeholders but the 1 image"):
        model(**batch)


def test_placeholders_without_pixels_are_explained(tiny, pages):
    model, processor = tiny
    batch = document_batch(processor, pages[:1])
    with pytest.raises(ValueError, match="no pixel_values"):
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def test_generate_with_and_without_kv_cache_gives_same_greedy_tokens(tiny, pages):
    model, processor = tiny
    batch = processor(["<|image_1|>\nDescribe."], [[pages[1]]], padding_side="left")
    cached = model.generate(**batch, max_new_tokens=8, do_sample=False, use_cache=True)
    uncached = model.generate(**batch, max_new_tokens=8, do_sample=False, use_cache=False)
    assert cached.shape[1] == batch["input_ids"].shape[1] + 8
    assert torch.equal(cached, uncached)


def test_sdpa_and_eager_attention_agree(tiny, pages):
    model, processor = tiny
    batch = document_batch(processor, pages[:2])
    with torch.no_grad():
        sdpa = model.model(**batch).last_hidden_state
        model.set_attn_implementation("eager")
        eager = model.model(**batch).last_hidden_state
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(sdpa[mask], eager[mask], atol=1e-5, rtol=1e-4)


def test_only_real_crops_run_through_clip(tiny, pages):
    """Zero crop slots are skipped; features equal running CLIP on every slot (the reference)."""
    model, processor = tiny
    embedding = model.model.vision_embed_tokens
    batch = processor.image_processor([pages[1]])  # 300x120 page: 1x2 crops + global, of 5 slots
    calls = []
    handle = embedding.img_processor.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    with torch.no_grad():
        embedding(batch["pixel_values"], batch["image_sizes"])
    handle.remove()
    assert calls == [3]

"""The *_vdocrag experiments follow VDocRAG's released code (github.com/nttmdlab-nlp/VDocRAG; DESIGN §11), and the
LoRA target lists match the modules they are meant to on Phi3V's layout."""

import logging
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from hkrag.retriever import (
    PHI3_LORA_TARGETS,
    VDOCRAG_LORA_TARGETS,
    LoraSettings,
    Phi3VRetriever,
    describe_lora_modules,
    lora_modules,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
VDOCRAG_LORA = {"r": 8, "alpha": 64, "dropout": 0.1,
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "up_proj", "gate_proj"]}
"""README.md of VDocRAG, every training command: --lora_target_modules ...; arguments.py: r 8, alpha 64, dropout 0.1."""
CLIP = "model.vision_embed_tokens.img_processor.vision_model.encoder.layers.*.self_attn."


def _config(experiment: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", [f"experiment={experiment}", "paths.output_dir=/tmp/unused"])


@pytest.mark.parametrize("experiment", ["pretrain_vdocrag", "generator_vdocrag"])
def test_vdocrag_experiments_use_the_released_settings(experiment):
    cfg = _config(experiment)
    lora = {key: cfg.model.lora[key] for key in VDOCRAG_LORA}
    assert {**lora, "target_modules": list(lora["target_modules"])} == VDOCRAG_LORA
    assert cfg.model.num_crops is None  # the checkpoint's 16: their drivers load the processor without num_crops
    optim = cfg.generator_training.optim if experiment == "generator_vdocrag" else cfg.optim
    assert (optim.warmup_ratio, optim.lr, optim.scheduler) == (0.1, 1e-4, "linear")


def test_generator_vdocrag_retrieves_at_the_checkpoints_crops():
    assert _config("generator_vdocrag").generator_training.retriever.model.num_crops is None


@pytest.mark.parametrize("experiment", ["hkrag_retriever", "hkrag_retriever_pretrained", "ablation_infonce"])
def test_paper_retriever_keeps_our_named_targets_at_16_crops(experiment):
    cfg = _config(experiment)
    assert list(cfg.model.lora.target_modules) == list(PHI3_LORA_TARGETS) and cfg.model.num_crops is None


def test_vdocrag_targets_match_clip_attention_and_two_lm_projections(caplog):
    with caplog.at_level(logging.INFO, logger="hkrag.retriever"):
        retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=4, target_modules=VDOCRAG_LORA_TARGETS))
    patterns = {re.sub(r"\.\d+\.", ".*.", name.removeprefix("base_model.model."))
                for name in lora_modules(retriever.model)}
    assert patterns == {f"{CLIP}q_proj", f"{CLIP}k_proj", f"{CLIP}v_proj",
                        "model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"}
    assert "LoRA wraps 10 modules" in caplog.text and f"{CLIP}q_proj (2)" in caplog.text


def test_our_targets_match_every_language_model_linear_and_no_vision_module():
    retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=4))
    assert describe_lora_modules(lora_modules(retriever.model)) == (
        "model.layers.*.self_attn.o_proj (2), model.layers.*.self_attn.qkv_proj (2), "
        "model.layers.*.mlp.gate_up_proj (2), model.layers.*.mlp.down_proj (2)")


def test_vdocrag_targets_train_without_parameters_left_out_of_the_gradient(pages):
    retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=4, dropout=0.0, target_modules=VDOCRAG_LORA_TARGETS))
    retriever.train()
    retriever(**retriever.document_inputs(pages[:2])).sum().backward()
    trainable = [n for n, p in retriever.model.named_parameters() if p.requires_grad]
    assert any("vision_model" in n for n in trainable)  # the CLIP attention LoRA before the feature layer
    assert [n for n in trainable if dict(retriever.model.named_parameters())[n].grad is None] == []

"""HKRAG-Ret dual encoder: one EOS convention, padding-safe pooling, LoRA names and round trip."""

import pytest
import torch

from hkrag.data.collators import document_prompt, query_prompt
from hkrag.retriever import (
    PHI3_LORA_TARGETS,
    VDOCRAG_LORA_TARGETS,
    LoraSettings,
    Phi3VRetriever,
    enable_checkpointing,
    last_token_pool,
    lora_module_names,
)

QUERIES = [
    "Instruct: I’m looking for an image that answers the question.\nQuery: What is the total revenue?",
    "Instruct: I’m looking for an image that answers the question.\nQuery: Which code is in the footnote?",
    "Query: year",
]


@pytest.fixture
def retriever():
    r = Phi3VRetriever.tiny(lora=LoraSettings(r=4, alpha=8, dropout=0.0), seed=0)
    with torch.no_grad():
        for name, p in r.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)  # a non-trivial adapter
    return r.eval()


def test_last_token_pool_by_hand():
    hidden = torch.arange(2 * 4 * 1, dtype=torch.float).view(2, 4, 1)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert last_token_pool(hidden, right).flatten().tolist() == [1.0, 7.0]
    assert last_token_pool(hidden, left).flatten().tolist() == [3.0, 7.0]


def test_one_eos_convention_for_queries_and_documents(retriever, pages):
    eos = retriever.processor.tokenizer.eos_token_id
    for batch in (retriever.query_inputs(QUERIES), retriever.document_inputs(pages)):
        last = last_token_pool(batch["input_ids"].unsqueeze(-1), batch["attention_mask"]).flatten()
        assert (last == eos).all()
    assert query_prompt("q", "<E>") == "q<E>"
    assert document_prompt("<E>") == "<|image_1|>\nWhat is shown in this image?<E>"


def test_embeddings_are_unit_norm_and_distinct(retriever, pages):
    docs = retriever.encode_documents(pages)
    assert docs.shape == (len(pages), retriever.backbone.config.hidden_size)
    torch.testing.assert_close(docs.norm(dim=-1), torch.ones(len(pages)))
    assert torch.cdist(docs, docs).triu(1)[torch.triu_indices(4, 4, 1).unbind()].min() > 1e-3


@pytest.mark.parametrize("side", ["right", "left"])
def test_document_alone_equals_padded_mixed_batch(retriever, pages, side):
    prompt = document_prompt(retriever.processor.eos_token)
    with torch.no_grad():
        batch = retriever(**retriever.processor([prompt] * len(pages), [[p] for p in pages], padding_side=side))
        alone = torch.cat([retriever(**retriever.processor(prompt, [p], padding_side=side)) for p in pages])
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=1e-4)


def test_left_and_right_padding_give_the_same_query_embeddings(retriever):
    texts = [query_prompt(q, retriever.processor.eos_token) for q in QUERIES]
    with torch.no_grad():
        right = retriever(**retriever.processor(texts, padding_side="right"))
        left = retriever(**retriever.processor(texts, padding_side="left"))
    torch.testing.assert_close(right, left, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(right, retriever.encode_queries(QUERIES, batch_size=1), atol=1e-5, rtol=1e-4)


def test_lora_targets_phi3_fused_projections(retriever):
    assert lora_module_names(retriever) == set(PHI3_LORA_TARGETS) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    trainable = {n for n, p in retriever.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_saved_adapter_reloads_to_bit_identical_embeddings(retriever, pages, tmp_path):
    before = retriever.encode_documents(pages[:2])
    retriever.save(tmp_path)
    base, processor = Phi3VRetriever.tiny(seed=0).model, retriever.processor
    reloaded = Phi3VRetriever.wrap(base, processor, adapter=tmp_path).eval()
    assert torch.equal(reloaded.encode_documents(pages[:2]), before)
    assert not any(p.requires_grad for p in reloaded.parameters())


def test_existing_adapter_can_keep_training(retriever, tmp_path):
    retriever.save(tmp_path)
    resumed = Phi3VRetriever.wrap(Phi3VRetriever.tiny(seed=0).model, retriever.processor, tmp_path, trainable=True)
    trainable = [n for n, p in resumed.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_embeddings_never_touch_the_lm_head(retriever, pages):
    with torch.no_grad():
        retriever.model.get_base_model().lm_head.weight.fill_(float("nan"))
    assert torch.isfinite(retriever.encode_documents(pages[:1])).all()


def trained_grads(pages, targets, mode):
    """The trainable parameters' gradients of one backward of two pages: ``mode`` plain, checkpointed, or
    checkpointed with transformers' input-embedding hooks back on (what checkpointing did before)."""
    r = Phi3VRetriever.tiny(lora=LoraSettings(r=4, dropout=0.0, target_modules=targets), seed=0)
    if mode != "plain":
        enable_checkpointing(r.model)
    if mode == "hooked":
        r.model.get_base_model().enable_input_require_grads()
    r.train()
    r(**r.document_inputs(pages[:2])).sum().backward()
    return {n: p.grad.clone() for n, p in r.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("targets", [PHI3_LORA_TARGETS, VDOCRAG_LORA_TARGETS])
def test_gradient_checkpointing_gives_the_same_gradients(pages, targets):
    plain = trained_grads(pages, targets, "plain")
    for mode in ("checkpointed", "hooked"):
        grads = trained_grads(pages, targets, mode)
        assert grads.keys() == plain.keys()
        for name in plain:
            torch.testing.assert_close(grads[name], plain[name], msg=f"{mode}: {name}")


def outputs_needing_grad(retriever, pages):
    """Whether CLIP's patch embedding, each CLIP layer and the LM's token embedding put out a tensor that requires
    grad, in one training forward."""
    base = retriever.backbone
    tower = base.vision_embed_tokens.img_processor.vision_model
    modules = {"patch embedding": tower.embeddings.patch_embedding, "token embedding": base.embed_tokens,
               **{f"CLIP layer {i}": layer for i, layer in enumerate(tower.encoder.layers)}}
    seen = {}

    def record(name, output):
        seen.setdefault(name, (output[0] if isinstance(output, tuple) else output).requires_grad)

    hooks = [m.register_forward_hook(lambda _m, _i, out, name=name: record(name, out)) for name, m in modules.items()]
    retriever.train()
    retriever(**retriever.document_inputs(pages[:1]))
    for hook in hooks:
        hook.remove()
    return seen


def test_checkpointing_keeps_a_frozen_vision_tower_and_the_embeddings_out_of_the_graph(pages):
    """transformers' input hooks made CLIP's patch embedding require grad: a frozen tower was back-propagated
    through (each layer recomputed) for no gradient."""
    model, processor = Phi3VRetriever.tiny().model, Phi3VRetriever.tiny().processor
    r = Phi3VRetriever.wrap(model, processor, lora=LoraSettings(r=4), trainable=True, gradient_checkpointing=True)
    assert r.backbone.gradient_checkpointing
    assert not any(outputs_needing_grad(r, pages).values())


def test_checkpointing_a_trained_tower_keeps_it_in_the_graph_through_its_lora(pages):
    model, processor = Phi3VRetriever.tiny().model, Phi3VRetriever.tiny().processor
    r = Phi3VRetriever.wrap(model, processor, lora=LoraSettings(r=4, target_modules=VDOCRAG_LORA_TARGETS),
                            trainable=True, gradient_checkpointing=True)
    seen = outputs_needing_grad(r, pages)
    assert not seen.pop("patch embedding") and not seen.pop("token embedding")
    assert seen and all(seen.values())


def test_a_trained_image_embedding_has_a_gradient_for_every_trainable_parameter(pages):
    lora = LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=["qkv_proj"], modules_to_save=["vision_embed_tokens"])
    retriever = Phi3VRetriever.tiny(lora=lora)
    trained = "vision_embed_tokens.modules_to_save.default.img_processor.vision_model."
    frozen = {name.split(trained)[1] for name, p in retriever.model.named_parameters()
              if trained in name and not p.requires_grad}
    last = len(retriever.backbone.vision_embed_tokens.original_module.img_processor.vision_model.encoder.layers) - 1
    assert frozen and all(n.startswith((f"encoder.layers.{last}.", "post_layernorm.")) for n in frozen)
    retriever(**retriever.document_inputs(pages[:2])).sum().backward()  # DDP needs a gradient for each of them
    missing = [n for n, p in retriever.model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []

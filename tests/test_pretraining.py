"""VDocRAG pre-training, RCR + RCG (docs/training.md "Pre-training"; DESIGN §11)."""

import math
import random
import subprocess
import sys

import datasets
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from PIL import Image

from hkrag.data.collators import IGNORE_INDEX, PretrainingCollator, generation_mask
from hkrag.data.opendocvqa import load_pretraining_corpus
from hkrag.data.pairs import pretraining_pairs
from hkrag.data.synthetic import SyntheticConfig, _page_specs, generate, page_text, render_page
from hkrag.data.writer import save_split
from hkrag.losses import PretrainingLoss, causal_lm_loss
from hkrag.retriever import LoraSettings, Phi3VRetriever, weights_fingerprint
from hkrag.tasks.common import build_retriever

TEXTS = ["HOUSING\n48%\nGREEN", "REF M2 P.2"]


@pytest.fixture(scope="module")
def retriever():
    model = Phi3VRetriever.tiny(lora=LoraSettings(r=4, alpha=8, dropout=0.0), texts=TEXTS)
    return model.eval()


@pytest.fixture(scope="module")
def batch(retriever):
    pages = [Image.new("RGB", (112, 84), colour) for colour in ("white", "navy")]
    return PretrainingCollator(retriever.collator, max_target_length=64)(list(zip(TEXTS, pages)))


def test_generation_mask_equals_the_hand_built_mask():
    one = torch.tensor([[1, 0, 0, 0, 0],
                        [1, 1, 0, 0, 0],
                        [1, 1, 1, 0, 0],   # the prompt's last token (EOS)
                        [0, 0, 1, 1, 0],   # target tokens: the EOS and the target so far
                        [0, 0, 1, 1, 1]], dtype=torch.bool)
    two = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    two[2:, 0] = False
    assert torch.equal(generation_mask([3, 2], 5), torch.stack([one, two])[:, None])
    with pytest.raises(ValueError, match="prompt length 0"):
        generation_mask([0], 5)


def test_labels_mask_every_prompt_token_and_the_target_follows_the_document_prompt(retriever, batch):
    gen, doc = batch["generation"], batch["document"]
    tokenizer = retriever.processor.tokenizer
    for row, text in enumerate(TEXTS):
        prompt = doc["input_ids"][row][doc["attention_mask"][row].bool()]
        n = len(prompt)
        assert prompt[-1] == tokenizer.eos_token_id
        assert torch.equal(gen["input_ids"][row, :n], prompt)
        assert (gen["labels"][row, :n] == IGNORE_INDEX).all()
        target = tokenizer(text + "<|end|>\n<|endoftext|>", add_special_tokens=False)["input_ids"]
        assert gen["labels"][row, n:n + len(target)].tolist() == target
        assert (gen["labels"][row, n + len(target):] == IGNORE_INDEX).all()
        assert torch.equal(gen["attention_mask"][row], generation_mask([n], gen["input_ids"].shape[1])[0])


def _target_logits(retriever, gen, **changes):
    """RCG logits at the target positions, with ``changes`` applied to the batch (or to the input embeddings)."""
    gen = {**gen, **changes}
    dtype = retriever.backbone.embed_tokens.weight.dtype
    additive = torch.zeros(gen["attention_mask"].shape, dtype=dtype).masked_fill(~gen["attention_mask"], -1e9)
    lm = retriever.model.get_base_model()
    with torch.no_grad():
        embeds = retriever.backbone.embed(gen["input_ids"], gen["pixel_values"], gen["image_sizes"])
        embeds = embeds + gen.get("shift", 0)
        logits = lm.lm_head(retriever.backbone(inputs_embeds=embeds, attention_mask=additive,
                                               position_ids=gen["position_ids"]).last_hidden_state)
    return logits[gen["labels"] != IGNORE_INDEX]


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_information_reaches_the_target_only_through_the_eos(kernel):
    """One decoder layer, so a prompt token reaches the target only as the EOS's input (deeper layers pass
    the prompt on through the EOS's own hidden states, which is the point of RCG)."""
    retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=4, alpha=8, dropout=0.0), texts=TEXTS,
                                    num_hidden_layers=1).eval()
    pages = [Image.new("RGB", (112, 84), colour) for colour in ("white", "navy")]
    batch = PretrainingCollator(retriever.collator, max_target_length=64)(list(zip(TEXTS, pages)))
    config = retriever.backbone.config
    before = config._attn_implementation
    config._attn_implementation = kernel
    try:
        gen = batch["generation"]
        base = _target_logits(retriever, gen)
        image = _target_logits(retriever, gen, pixel_values=gen["pixel_values"] + 1.0)
        eos = int(batch["document"]["attention_mask"][0].sum()) - 1
        shift = torch.zeros(*gen["input_ids"].shape, config.hidden_size)
        prompt_token = shift.clone()
        prompt_token[:, eos - 1] = 1.0   # the token before the EOS ("?")
        at_eos = shift.clone()
        at_eos[0, eos] = 1.0
        assert torch.equal(base, image)
        assert torch.equal(base, _target_logits(retriever, gen, shift=prompt_token))
        assert not torch.allclose(base, _target_logits(retriever, gen, shift=at_eos))
        assert not torch.allclose(base, _target_logits(retriever, gen, attention_mask=torch.tril(
            torch.ones_like(gen["attention_mask"])).bool()))  # a plain causal mask lets the image in
    finally:
        config._attn_implementation = before


def test_generation_loss_applies_the_4d_mask(retriever, batch):
    """Phi3Model takes the additive 4-D mask as given: each row's loss equals one computed by hand (the row alone,
    without its padding, under the RCG mask written out from its prompt length, the mean next-token NLL of its
    target) and differs from the loss under a plain causal mask."""
    gen = batch["generation"]
    lm = retriever.model.get_base_model()
    with torch.no_grad():
        losses = retriever(**gen)
        causal = retriever(**{**gen, "attention_mask": torch.tril(torch.ones_like(gen["attention_mask"]))})
        for row, labels in enumerate(gen["labels"]):
            targets = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
            n, end = targets[0], targets[-1] + 1  # the prompt (up to its EOS) and the real tokens
            may_attend = torch.tensor([[j <= i and (i < n or j >= n - 1) for j in range(end)] for i in range(end)])
            additive = torch.zeros(1, 1, end, end).masked_fill(~may_attend, torch.finfo(torch.float32).min)
            logits = lm(input_ids=gen["input_ids"][row:row + 1, :end], attention_mask=additive,
                        position_ids=torch.arange(end)[None], pixel_values=gen["pixel_values"][row:row + 1],
                        image_sizes=gen["image_sizes"][row:row + 1], use_cache=False).logits[0]
            nll = [-torch.log_softmax(logits[t - 1], dim=-1)[labels[t]] for t in targets]  # t-1 predicts t
            assert losses[row].item() == pytest.approx(sum(nll).item() / len(nll), abs=1e-5), row
    assert losses.shape == (2,)
    assert not torch.allclose(losses, causal)


def test_causal_lm_loss_and_rcr_against_hand_computed_values():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]],
                                     [[0.2, 0.2, 0.6], [0.7, 0.2, 0.1], [0.5, 0.5, 0.0 + 1e-9]]]))
    labels = torch.tensor([[IGNORE_INDEX, 1, 2], [IGNORE_INDEX, IGNORE_INDEX, 0]])
    expected = torch.tensor([-(math.log(0.25) + math.log(0.1)) / 2, -math.log(0.7)])
    assert torch.allclose(causal_lm_loss(logits, labels), expected)

    q = F.normalize(torch.tensor([[1.0, 0.0], [0.6, 0.8]]), dim=-1)
    d = F.normalize(torch.tensor([[0.8, 0.6], [0.0, 1.0]]), dim=-1)
    sims = q @ d.T  # [[0.8, 0], [0.96, 0.8]]
    tau = 0.5
    rcr = (-torch.log_softmax(sims / tau, dim=1).diagonal()).mean()
    loss = PretrainingLoss(tau=tau)
    output = PretrainingLoss.combine(loss(q, d), expected.mean())
    assert torch.allclose(output.components["rcr"], rcr)
    assert torch.allclose(output.loss, rcr + expected.mean())
    assert set(output.components) == {"rcr", "rcg"}


def test_flash_attention_is_refused_with_the_reason(retriever, batch):
    config = retriever.backbone.config
    before = config._attn_implementation
    config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="FlashAttention-2 cannot take"):
            retriever(**batch["generation"])
    finally:
        config._attn_implementation = before


def test_synthetic_corpus_records_the_drawn_text(tmp_path):
    config = SyntheticConfig(n_train=4, n_test=4, train_groups_per_style=1, test_groups_per_style=1)
    paths = generate(tmp_path, config)
    corpus = load_pretraining_corpus(paths.corpus, "default", "train", text_column="text")
    pairs = pretraining_pairs(corpus)
    assert len(pairs) == len(corpus) == 24
    spec = _page_specs(random.Random(0), config, "train", taken=set())[0]  # the first page generate drew
    page = corpus[spec.doc_id]
    _, items = render_page(spec, config)
    assert page.text == page_text(items) == "\n".join(i.text for i in sorted(items, key=lambda i: (i.box[1], i.box[0])))
    assert {i.text for i in items} <= set(page.text.split("\n")) and spec.title in page.text
    assert pairs[0].query == corpus[pairs[0].positives[0]].text


def test_docstruct_schema_maps_query_to_text(tmp_path):
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image()})
    rows = [{"query": f"page {i} text", "image": Image.new("RGB", (40, 30), "white")} for i in range(3)]
    rows.append({"query": " ", "image": Image.new("RGB", (40, 30), "white")})
    save_split(rows, tmp_path, "default", "train", features)
    corpus = load_pretraining_corpus(tmp_path, None, "train")
    assert corpus.doc_ids == ["0", "1", "2", "3"] and corpus[1].text == "page 1 text"
    assert [p.query for p in pretraining_pairs(corpus)] == ["page 0 text", "page 1 text", "page 2 text"]


def test_a_pretrained_adapter_continues_like_a_released_one(tmp_path):
    model_cfg = OmegaConf.create({"kind": "tiny", "seed": 0, "num_crops": 4, "adapter": None, "config": {},
                                  "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules":
                                           ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}})
    trained = build_retriever(model_cfg, texts=TEXTS)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.add_(0.01)
    trained.model.save_pretrained(tmp_path / "adapter")
    model_cfg.adapter = str(tmp_path / "adapter")
    continued = build_retriever(model_cfg, texts=TEXTS)
    assert weights_fingerprint(continued) == weights_fingerprint(trained)
    assert any(p.requires_grad for p in continued.parameters())


@pytest.mark.slow
def test_train_py_pretrain_tiny_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "train.py", "experiment=pretrain_tiny", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}",
         f"paths.data_dir={tmp_path / 'data'}"],
        capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "WANDB_MODE": "disabled"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "final" / "adapter" / "adapter_config.json").is_file()
    log = (tmp_path / "metrics.jsonl").read_text()
    assert '"loss/rcr"' in log and '"loss/rcg"' in log

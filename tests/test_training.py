"""Trainer: deterministic batches, exact resume, NaN safety, checkpoint errors (DESIGN §9)."""

import json
import math

import pytest
import torch
from accelerate import Accelerator

from hkrag.data.opendocvqa import TrainingPair, load_corpus, load_qa, training_pairs
from hkrag.data.synthetic import SyntheticConfig, generate
from hkrag.losses import HybridMaskLoss, LossOutput
from hkrag.retriever import LoraSettings, Phi3VRetriever
from hkrag.training.checkpoint import CheckpointError, latest_checkpoint
from hkrag.training.reporting import RunLogger
from hkrag.training.sampler import GlobalBatchSampler
from hkrag.training.trainer import NonFiniteLossError, RetrieverTrainer, TrainerConfig, document_groups

SMALL = SyntheticConfig(n_train=40, n_test=12, train_groups_per_style=2, test_groups_per_style=1, group_size=3)


@pytest.fixture(scope="session")
def synthetic_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    generate(root, SMALL)
    return root


@pytest.fixture(scope="session")
def train_data(synthetic_root):
    qa = load_qa(synthetic_root / "qa", "default", "train")
    corpus = load_corpus(synthetic_root / "corpus", "default", "train")
    return training_pairs(qa, corpus), corpus


def make_trainer(train_data, output_dir, loss_fn=None, **overrides):
    pairs, corpus = train_data
    retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=4, dropout=0.1), num_crops=4, seed=0)
    settings = dict(global_batch_size=8, chunk_size=4, epochs=2, lr=1e-3, seed=3, num_workers=0)
    settings.update(overrides)
    config = TrainerConfig(**settings)
    return RetrieverTrainer(
        retriever, loss_fn or HybridMaskLoss(), pairs, corpus, config, Accelerator(cpu=True), output_dir,
        RunLogger(output_dir),
    )


def losses(trainer):
    seen = []
    trainer.fit(on_log=lambda record: seen.append(record["loss"]))
    return seen


def test_rank_slices_make_up_the_single_process_batch():
    whole = list(GlobalBatchSampler(20, 8, seed=1).batches(epoch=0))
    parts = [list(GlobalBatchSampler(20, 8, rank=r, world_size=2, seed=1).batches(epoch=0)) for r in range(2)]
    assert len(whole) == 2  # 20 // 8, the incomplete batch is dropped
    assert [a + b for a, b in zip(*parts)] == whole
    assert list(GlobalBatchSampler(20, 8, seed=1).batches(epoch=0, start=1)) == whole[1:]
    assert whole != list(GlobalBatchSampler(20, 8, seed=1).batches(epoch=1))


def test_grouped_batches_keep_documents_together():
    groups = [f"doc{i // 4}" for i in range(16)]  # four documents of four pages
    sampler = GlobalBatchSampler(16, 8, seed=0, groups=groups)
    for batch in sampler.batches(epoch=0):
        assert sorted({groups[i] for i in batch}) != [] and len({groups[i] for i in batch}) == 2
    assert sorted(sampler.order(0)) == list(range(16))
    assert sampler.global_batch(0, 1) == list(sampler.batches(0))[1]


def test_document_groups_from_doc_ids():
    pairs = [TrainingPair("q1", "a", ("chart-d001-p2",)), TrainingPair("q2", "b", ("other",))]
    assert document_groups(pairs, r"^(.*)-p\d+$") == ["chart-d001", "other"]


def test_shared_positive_pages_are_not_negatives(train_data, tmp_path):
    pairs, corpus = train_data
    two_pages = [pairs[0], next(p for p in pairs if p.positives != pairs[0].positives)]
    trainer = make_trainer((two_pages * 4, corpus), tmp_path, global_batch_size=8, max_steps=1)
    ignore = trainer.shared_positives()
    assert ignore.shape == (8, 8) and not ignore.diagonal().any()
    assert ignore.sum() == 8 * 3  # each row shares its page with 3 others


def test_sampler_errors_name_the_fix():
    with pytest.raises(ValueError, match="not divisible by 3"):
        GlobalBatchSampler(20, 8, world_size=3)
    with pytest.raises(ValueError, match="lower the batch size"):
        GlobalBatchSampler(5, 8)


def test_resume_reproduces_the_uninterrupted_losses(train_data, tmp_path):
    full = losses(make_trainer(train_data, tmp_path / "full", max_steps=6))
    first = make_trainer(train_data, tmp_path / "split", max_steps=6, save_every=3)
    first.total_steps = 3  # stop after the checkpoint at step 3, as a killed job would
    head = losses(first)
    checkpoint = latest_checkpoint(tmp_path / "split")
    assert checkpoint.name == "step-3"
    resumed = make_trainer(train_data, tmp_path / "split", max_steps=6)
    resumed.resume(checkpoint)
    tail = losses(resumed)
    assert len(full) == 6 and head == full[:3]
    assert tail == full[3:]


def test_training_lowers_the_loss_and_logs_components(train_data, tmp_path):
    trainer = make_trainer(train_data, tmp_path, max_steps=8)
    seen = losses(trainer)
    assert seen[-1] < seen[0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert {"loss/din", "loss/sin", "mask/one", "mask/half", "mask/zero", "lr", "samples_per_s"} <= rows[0].keys()


class NaNAfter(HybridMaskLoss):
    def __init__(self, good_steps: int):
        super().__init__()
        self.calls, self.good_steps = 0, good_steps

    def forward(self, q, d, generator=None, ignore=None) -> LossOutput:
        self.calls += 1
        out = super().forward(q, d, generator, ignore)
        return out if self.calls <= self.good_steps else LossOutput(loss=out.loss * math.nan)


def test_nan_loss_stops_before_the_weights_change(train_data, tmp_path):
    trainer = make_trainer(train_data, tmp_path, loss_fn=NaNAfter(good_steps=1), max_steps=4, chunk_size=None)
    with pytest.raises(NonFiniteLossError, match="loss is nan at step 1"):
        trainer.fit()
    weights = {n: p.detach().clone() for n, p in trainer.retriever.named_parameters() if p.requires_grad}
    assert all(torch.isfinite(w).all() for w in weights.values())
    saved = trainer.save()
    assert (saved / "adapter" / "adapter_model.safetensors").is_file()


def test_corrupt_checkpoint_is_named(train_data, tmp_path):
    trainer = make_trainer(train_data, tmp_path, max_steps=1)
    trainer.fit()
    checkpoint = trainer.save()
    (checkpoint / "optimizer.pt").write_bytes(b"garbage")
    fresh = make_trainer(train_data, tmp_path, max_steps=1)
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        fresh.resume(checkpoint)
    with pytest.raises(CheckpointError, match="not a finished checkpoint"):
        fresh.resume(tmp_path)


def test_checkpoint_of_another_model_is_refused(train_data, tmp_path):
    trainer = make_trainer(train_data, tmp_path, max_steps=1)
    checkpoint = trainer.save()
    other = make_trainer(train_data, tmp_path / "other")
    other.retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=4, target_modules=("qkv_proj",)), num_crops=4)
    with pytest.raises(CheckpointError, match="do not match this model"):
        from hkrag.training.checkpoint import load_checkpoint

        load_checkpoint(checkpoint, other.retriever.model, other.optimizer, other.scheduler, 0)

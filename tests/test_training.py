"""Trainer: deterministic batches, exact resume, NaN safety, checkpoint errors (DESIGN §9)."""

import errno
import json
import math
import re
from pathlib import Path

import peft.peft_model
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from hydra import compose, initialize_config_dir
from safetensors import SafetensorError

import hkrag.io
from hkrag.data.opendocvqa import DataError, load_corpus, load_qa
from hkrag.data.pairs import TrainingPair, field_pairs, training_pairs
from hkrag.data.synthetic import SyntheticConfig, generate, load_page_items
from hkrag.io import WriteError
from hkrag.late_interaction import LateInteractionLoss
from hkrag.losses import HybridMaskLoss, LossOutput
from hkrag.models.phi3v.loading import load_phi3v
from hkrag.retriever import HeadSettings, LoraSettings, Phi3VRetriever
from hkrag.run_log import RunLogger
from hkrag.tasks.training import run_settings
from hkrag.training.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_state, resolve_resume
from hkrag.training.sampler import GlobalBatchSampler
from hkrag.training.trainer import NonFiniteLossError, RetrieverTrainer, TrainerConfig, document_groups

ROOT = Path(__file__).resolve().parents[1]
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


def make_trainer(train_data, output_dir, loss_fn=None, lora_rank=4, head=None, **overrides):
    pairs, corpus = train_data
    retriever = Phi3VRetriever.tiny(lora=LoraSettings(r=lora_rank, dropout=0.1), num_crops=4, seed=0, head=head)
    settings = dict(global_batch_size=8, chunk_size=4, epochs=2, lr=1e-3, seed=3, num_workers=0)
    settings.update(overrides)
    config = TrainerConfig(**settings)
    return RetrieverTrainer(
        retriever, loss_fn or HybridMaskLoss(), pairs, corpus, config, Accelerator(cpu=True), output_dir,
        RunLogger(output_dir),
    )


def losses(trainer, key="loss"):
    seen = []
    trainer.fit(on_log=lambda record: seen.append(record[key]))
    return seen


# Linear schedule, warmup 0.5 over 6 steps, peak 1e-3: the rate after each optimizer step.
LINEAR_WARMUP_LRS = [1e-3 / 3, 2e-3 / 3, 1e-3, 2e-3 / 3, 1e-3 / 3, 0.0]
LINEAR_WARMUP = dict(max_steps=6, lr=1e-3, warmup_ratio=0.5, scheduler="linear")


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
    ignore = trainer.in_batch_positives()
    assert ignore.shape == (8, 8) and not ignore.diagonal().any()
    assert ignore.sum() == 8 * 3  # each row shares its page with 3 others


def test_every_positive_of_a_multi_positive_query_is_excluded(train_data, tmp_path):
    _, corpus = train_data
    pairs = [TrainingPair("a", "qa", ("p1", "p2")), TrainingPair("b", "qb", ("p2",)),
             TrainingPair("c", "qc", ("p3",)), TrainingPair("d", "qd", ("p1",))]
    trainer = make_trainer((pairs * 2, corpus), tmp_path, global_batch_size=8, max_steps=1)
    # Epoch 0: a draws p1, so its rows count for a and d; b's rows (p2) are relevant to a but not to d.
    # Epoch 1: a draws p2, so its rows now count for a and b and no longer for d.
    relevant = [{"a": "abd", "b": "b", "c": "c", "d": "ad"}, {"a": "abd", "b": "ab", "c": "c", "d": "d"}]
    for epoch in (0, 1):
        trainer.state.epoch = epoch
        ids = [(pairs * 2)[i].query_id for i in trainer.sampler.global_batch(epoch, 0)]
        expected = [[i != j and ids[j] in relevant[epoch][ids[i]] for j in range(8)] for i in range(8)]
        ignore = trainer.in_batch_positives()
        assert ignore.tolist() == expected
        assert not torch.equal(ignore, ignore.T)  # a's row ignores b's page, b's row keeps a's (epoch 0) or d's


def test_logged_learning_rate_warms_up_and_decays_once_per_step(train_data, tmp_path):
    trainer = make_trainer(train_data, tmp_path, global_batch_size=4, chunk_size=None, **LINEAR_WARMUP)
    assert losses(trainer, "lr") == pytest.approx(LINEAR_WARMUP_LRS, abs=1e-12)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["lr"] for row in rows] == pytest.approx(LINEAR_WARMUP_LRS, abs=1e-12)


def test_scheduler_steps_once_per_optimizer_step_with_several_processes(train_data, tmp_path, monkeypatch):
    """accelerate's prepared scheduler would step twice per optimizer step here (6.7e-4, 6.7e-4, 0, ...)."""
    trainer = make_trainer(train_data, tmp_path, **LINEAR_WARMUP)
    for state in (PartialState, AcceleratorState):  # what accelerate's scheduler wrapper reads
        monkeypatch.setitem(state._shared_state, "num_processes", 2)
    assert trainer.accelerator.num_processes == 2
    seen = []
    for _ in range(6):
        trainer.optimizer_step(LossOutput(loss=torch.tensor(0.0)))
        seen.append(trainer.scheduler.get_last_lr()[0])
    assert seen == pytest.approx(LINEAR_WARMUP_LRS, abs=1e-12)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [({"max_steps": -1}, "trainer.max_steps=-1"), ({"max_steps": 0}, "trainer.max_steps=0"),
     ({"epochs": 0}, "trainer.epochs=0")],
)
def test_a_run_without_optimizer_steps_is_refused(train_data, tmp_path, overrides, named):
    with pytest.raises(ValueError, match=rf"nothing to train: .*{named}.*40 training pairs.*global_batch_size=8"):
        make_trainer(train_data, tmp_path, **overrides)


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


def test_a_late_interaction_run_resumes_exactly_with_its_projection(train_data, tmp_path):
    """model.head=late_interaction: the checkpoint holds the trained projection (in the adapter and the trainable
    tensors) and a resumed run gives the uninterrupted run's losses (gradient caching over ragged chunks)."""
    head = HeadSettings("late_interaction", dim=16)

    def trainer(folder, **overrides):
        return make_trainer(train_data, tmp_path / folder, LateInteractionLoss(tau=0.1), head=head, max_steps=4,
                            **overrides)

    full = losses(trainer("full"))
    first = trainer("split", save_every=2)
    first.total_steps = 2
    start = losses(first)
    resumed = trainer("split")
    resumed.resume(latest_checkpoint(tmp_path / "split"))
    assert start + losses(resumed) == full
    saved = json.loads((tmp_path / "split" / "checkpoints" / "step-2" / "adapter" / "adapter_config.json").read_text())
    assert saved["modules_to_save"] == ["custom_text_proj"]
    assert resumed.state.config["loss.head"] == "late_interaction"


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


def test_latest_checkpoint_skips_temporaries_and_unfinished_folders(tmp_path):
    for name, finished in (("step-2", True), ("step-10.tmp", True), (".step-11.123.tmp", True), ("step-12", False),
                           ("step-x", True), ("final", True)):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        if finished:
            (tmp_path / "checkpoints" / name / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-2"
    assert resolve_resume("auto", tmp_path) == resolve_resume("latest", tmp_path) == tmp_path / "checkpoints" / "step-2"
    assert resolve_resume("auto", tmp_path / "fresh") is None and resolve_resume(None, tmp_path) is None
    with pytest.raises(FileNotFoundError, match="resume=latest but .*fresh/checkpoints.*resume=auto"):
        resolve_resume("latest", tmp_path / "fresh")


def test_resume_under_other_settings_names_the_keys(train_data, tmp_path):
    checkpoint = make_trainer(train_data, tmp_path, max_steps=2).save()
    other = make_trainer(train_data, tmp_path / "other", max_steps=2, lr=2e-3, global_batch_size=4)
    before = [p.detach().clone() for p in other.retriever.parameters() if p.requires_grad]
    with pytest.raises(CheckpointError, match=r"state.json was written by a run with other settings") as error:
        other.resume(checkpoint)
    assert "optim.lr: 0.001 in the checkpoint, 0.002 now" in str(error.value)
    assert "trainer.global_batch_size: 8 in the checkpoint, 4 now" in str(error.value)
    assert "trainer.seed" not in str(error.value)
    after = [p for p in other.retriever.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing restored
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["config"]["optim.lr"] == 1e-3 and len(state["config_hash"]) == 16


def test_lora_rank_mismatch_is_refused(train_data, tmp_path):
    checkpoint = make_trainer(train_data, tmp_path, max_steps=1).save()
    wider = make_trainer(train_data, tmp_path / "wider", max_steps=1, lora_rank=8)
    with pytest.raises(CheckpointError, match=r"state.json .*model.lora.r: 4 in the checkpoint, 8 now"):
        wider.resume(checkpoint)
    with pytest.raises(CheckpointError, match=r"trainable.safetensors: .* another shape .*\(8, 64\) now"):
        load_checkpoint(checkpoint, wider.retriever.model, wider.optimizer, wider.scheduler, 0)


@pytest.mark.parametrize("name", ["trainable.safetensors", "adapter/adapter_model.safetensors", "state.json"])
def test_truncated_or_unknown_checkpoint_files_are_named(train_data, tmp_path, name):
    trainer = make_trainer(train_data, tmp_path, max_steps=1)
    checkpoint = trainer.save()
    path = checkpoint / name
    if name == "state.json":
        path.write_text(json.dumps({**json.loads(path.read_text()), "surprise": 1}))
    else:
        path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + (".*surprise" if name == "state.json" else "")):
        make_trainer(train_data, tmp_path, max_steps=1).resume(checkpoint)


def full_disk_at(name: str, monkeypatch) -> None:
    """Make writing checkpoint file ``name`` hit a full disk, as each writer reports it."""
    if name == "adapter":  # peft writes through safetensors' Rust code, which only says it in words
        def save_file(*args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(peft.peft_model, "safe_save_file", save_file)
        return
    real = hkrag.io.atomic_write

    def atomic_write(path, write, mode="w"):
        def full(file):
            file.write(b"x" if "b" in mode else "x")
            raise OSError(errno.ENOSPC, "No space left on device")

        return real(path, full if Path(path).name == name else write, mode)

    monkeypatch.setattr(hkrag.io, "atomic_write", atomic_write)


@pytest.mark.parametrize("name", ["adapter", "trainable.safetensors", "optimizer.pt", "rng-0.pt", "state.json"])
def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(train_data, tmp_path, monkeypatch, name):
    trainer = make_trainer(train_data, tmp_path, max_steps=6)
    trainer.total_steps = 1
    trainer.fit()
    previous = trainer.save()
    saved = {n: p.detach().clone() for n, p in trainer.retriever.named_parameters() if p.requires_grad}
    trainer.total_steps = 2
    trainer.fit()
    full_disk_at(name, monkeypatch)
    for step in ("step-2", "step-1"):  # a new step, and overwriting the previous one in place
        target = tmp_path / "checkpoints" / step / name
        with pytest.raises(WriteError, match=rf"could not write {re.escape(str(target))}: the disk is full \(No "
                                             r"space left on device\); free space, then resume; the previous"):
            trainer.save(step)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    assert latest_checkpoint(tmp_path) == previous
    resumed = make_trainer(train_data, tmp_path, max_steps=6)
    resumed.resume(previous)
    assert resumed.state.step == 1
    for name, param in resumed.retriever.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, saved[name])


CONSTANT = dict(scheduler="constant", warmup_ratio=0.0)


def test_a_resumed_run_may_train_longer_and_continues_from_its_step(train_data, tmp_path):
    full = losses(make_trainer(train_data, tmp_path / "full", max_steps=7, **CONSTANT))
    short = make_trainer(train_data, tmp_path / "run", max_steps=4, **CONSTANT)
    head = losses(short)
    checkpoint = short.save("final")
    longer = make_trainer(train_data, tmp_path / "run", max_steps=7, **CONSTANT)
    longer.resume(checkpoint)
    assert (longer.state.step, longer.state.config["trainer.max_steps"]) == (4, 7)
    tail = losses(longer)
    assert len(head) == 4 and head + tail == full  # bit for bit the uninterrupted 7-step run (epoch 0 ends at 5)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 8))
    state = json.loads((longer.save() / "state.json").read_text())
    assert state["config"]["trainer.max_steps"] == 7 and state["schedule"] == {"warmup_steps": 0, "total_steps": 7}


def test_an_extended_run_keeps_its_warmup(train_data, tmp_path):
    warmup = dict(scheduler="constant_with_warmup", warmup_ratio=0.5, lr=1e-3)
    short = make_trainer(train_data, tmp_path, max_steps=4, **warmup)  # warmup: 2 steps
    assert losses(short, "lr") == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])
    checkpoint = short.save()
    older = json.loads((checkpoint / "state.json").read_text())
    del older["schedule"]  # as written before checkpoints stored their schedule
    older_state = tmp_path / "older" / "state.json"
    older_state.parent.mkdir()
    older_state.write_text(json.dumps(older))
    longer = make_trainer(train_data, tmp_path, max_steps=8, **warmup)  # alone: 4 warmup steps
    assert longer.continued_schedule(older_state, read_state(older_state)) == {"warmup_steps": 2, "total_steps": 8}
    longer.resume(checkpoint)
    assert longer.state.schedule == {"warmup_steps": 2, "total_steps": 8}
    assert losses(longer, "lr") == pytest.approx([1e-3] * 4)


@pytest.fixture(scope="module")
def linear_checkpoint(train_data, tmp_path_factory):
    """Four of six steps of a linear schedule with two warmup steps."""
    output = tmp_path_factory.mktemp("linear")
    trainer = make_trainer(train_data, output, **LINEAR_WARMUP | {"warmup_ratio": 1 / 3})
    trainer.total_steps = 4
    trainer.fit()
    return trainer.save()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_steps": 8}, r"from 6 to 8 steps would change the learning rate of step 4 \(0.00075 then, 0.000833 now\) "
                           r"under optim.scheduler=linear"),
        ({"max_steps": 5}, r"this run has 5 optimizer steps, fewer than the checkpoint's run \(6\)"),
        ({"max_steps": 8, "global_batch_size": 4}, r"trainer.global_batch_size: 8 in the checkpoint, 4 now"),
        ({"max_steps": 8, "seed": 4}, r"trainer.seed: 3 in the checkpoint, 4 now"),
        ({"max_steps": 8, "lr": 2e-3}, r"optim.lr: 0.001 in the checkpoint, 0.002 now"),
    ],
    ids=["decay-over-a-longer-total", "shorter", "batch-size", "seed", "lr"],
)
def test_resuming_refuses_a_shorter_run_a_changed_schedule_or_changed_settings(train_data, tmp_path,
                                                                               linear_checkpoint, overrides, message):
    settings = LINEAR_WARMUP | {"warmup_ratio": 1 / 3} | overrides
    with pytest.raises(CheckpointError, match=message):
        make_trainer(train_data, tmp_path, **settings).resume(linear_checkpoint)


def test_resuming_in_warmup_may_extend_a_decaying_schedule(train_data, tmp_path):
    early = make_trainer(train_data, tmp_path, **LINEAR_WARMUP | {"warmup_ratio": 0.5})  # warmup: 3 steps
    early.total_steps = 2
    early.fit()
    longer = make_trainer(train_data, tmp_path, **LINEAR_WARMUP | {"warmup_ratio": 0.5, "max_steps": 9})
    longer.resume(early.save())  # steps 1-3 run 1/3, 2/3, 1 of the peak under both totals; then decay to step 9
    assert losses(longer, "lr") == pytest.approx([1e-3 * k / 6 for k in range(6, -1, -1)], abs=1e-12)


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("experiment", ["hkrag_retriever", "hkrag_retriever_pretrained", "ablation_infonce",
                                        "ablation_no_din", "ablation_no_sin"])
def test_paper_experiments_require_flash_attention(experiment):
    assert composed(f"experiment={experiment}").model.attn_implementation == "flash_attention_2"
    overridden = composed(f"experiment={experiment}", "model.attn_implementation=sdpa")
    assert overridden.model.attn_implementation == "sdpa"


def test_cpu_demo_keeps_the_default_attention():
    cfg = composed()
    assert cfg.model.kind == "tiny" and cfg.model.get("attn_implementation") in (None, "sdpa")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_requested_flash_attention_without_cuda_fails_with_the_override():
    with pytest.raises(ImportError, match=r"flash_attention_2.*CUDA is not available.*model.attn_implementation=sdpa"):
        load_phi3v("not/downloaded", attn_implementation="flash_attention_2")


def test_run_settings_keep_what_fixes_the_run_and_leave_out_the_rest():
    base = run_settings(composed())
    assert base["model.kind"] == "tiny" and base["data.synthetic.n_train"] == 1536 and base["trainer.precision"] == "no"
    assert run_settings(composed("trainer.chunk_size=4", "data.eval_datasets=[synchart]")) == base
    assert run_settings(composed("data.synthetic.n_train=64"))["data.synthetic.n_train"] == 64


def test_field_queries_name_each_training_page_by_its_drawn_fields(synthetic_root):
    corpus = load_corpus(synthetic_root / "corpus", "default", "train")
    items = load_page_items(synthetic_root, "train")
    fields = {doc_id: row["fields"] for doc_id, row in items.items()}
    pairs = field_pairs(fields, ["{title} {value}%"], corpus)
    assert len(pairs) == len(corpus) and {p.positives for p in pairs} == {(doc_id,) for doc_id in corpus.doc_ids}
    first = next(p for p in pairs if p.positives == (sorted(corpus.doc_ids)[0],))
    page = items[first.positives[0]]
    assert first.query == f"{page['fields']['title']} {page['fields']['value']}%"
    assert f"{page['fields']['value']}%" in page["salient"]  # the value as drawn
    with pytest.raises(DataError, match=r"'\{colour\}' names the field 'colour' that page"):
        field_pairs(fields, ["{colour}"], corpus)

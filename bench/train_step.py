"""Optimizer-step throughput of retriever training: samples/s, peak memory and (on GPU) MFU.

    python bench/train_step.py                                   # tiny config on CPU, batch 32
    python bench/train_step.py --size full --batch 64 --chunk 8  # 4.2B architecture, random bf16 weights, GPU

Runs the real :class:`RetrieverTrainer` (gradient caching, hybrid-mask loss, AdamW) on letter-size
random pages held in memory. Model FLOPs per step = 3 x forward FLOPs (forward + backward) plus the
extra no-grad forward of gradient caching; MFU is against a measured bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import io
import resource
import time

import datasets
import numpy as np
import torch
from accelerate import Accelerator
from common import forward_flops, machine, print_mfu, used_crops
from datasets.table import InMemoryTable
from encode import build
from PIL import Image

from hkrag.data.opendocvqa import CORPUS_FEATURES, Corpus
from hkrag.data.pairs import TrainingPair
from hkrag.losses import HybridMaskLoss
from hkrag.models.attention import default_attn_implementation
from hkrag.retriever import LoraSettings, Phi3VRetriever
from hkrag.training.trainer import RetrieverTrainer, TrainerConfig


def corpus(n: int, size: tuple[int, int]) -> Corpus:
    """``n`` random pages; the fingerprint is named, since hashing the table by pickling failed on the H200's
    Python 3.12 (dill: "Can't pickle <class 'MonthDayNano'>")."""
    rng = np.random.default_rng(0)
    rows = {"doc_id": [], "image": []}
    for i in range(n):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(buffer, format="PNG")
        rows["doc_id"].append(f"page-{i}")
        rows["image"].append({"bytes": buffer.getvalue(), "path": None})
    table = InMemoryTable.from_pydict(CORPUS_FEATURES.encode_batch(rows), schema=CORPUS_FEATURES.arrow_schema)
    info = datasets.DatasetInfo(features=CORPUS_FEATURES)
    return Corpus(datasets.Dataset(table, info=info, fingerprint=f"bench-{n}-{size[0]}x{size[1]}"), name="bench")


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--batch", type=int, default=32, help="global contrastive batch")
    parser.add_argument("--chunk", type=int, default=16, help="gradient-cache chunk (rows per forward)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--num-crops", type=int, default=4)
    parser.add_argument("--attn", default=default_attn_implementation())
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
    device = accelerator.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = build(args.size, device, dtype, args.num_crops, args.attn)
    retriever = Phi3VRetriever.wrap(base.model, base.processor, lora=LoraSettings(),
                                    gradient_checkpointing=args.size == "full")
    pages = corpus(args.batch, (850, 1100))
    query = "Instruct: I’m looking for an image that answers the question.\nQuery: what is the total revenue in 2021?"
    pairs = [TrainingPair(f"q{i}", query, (f"page-{i}",)) for i in range(args.batch)]
    config = TrainerConfig(global_batch_size=args.batch, chunk_size=args.chunk, epochs=args.steps + 1)
    trainer = RetrieverTrainer(retriever, HybridMaskLoss(), pairs, pages, config, accelerator, "/tmp/hkrag-bench")
    batch = next(iter(trainer.loader(0, 0)))
    trainer.model.train()  # as RetrieverTrainer.fit: checkpointing acts in train mode only

    def step() -> None:
        trainer.optimizer_step(trainer.step(batch))

    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps

    doc, qry = batch["document"], batch["query"]
    crops = used_crops(doc["image_sizes"], retriever.processor.image_processor.crop_size)
    config_ = retriever.backbone.config
    flops = sum(forward_flops(config_, b["attention_mask"].sum(dim=1), c) * (3 + (args.chunk is not None))
                for b, c in ((doc, crops), (qry, 0)))
    print(f"machine: {machine()}")
    checkpointing = "on" if args.size == "full" else "off"
    print(f"model: {args.size}, {dtype}, attention {config_._attn_implementation}, LoRA r=8, "
          f"batch {args.batch} (chunk {args.chunk}), num_crops {args.num_crops}, checkpointing {checkpointing}")
    print(f"step: {seconds:.3f} s; {args.batch / seconds:.2f} samples/s; peak memory {peak_memory_gib(device):.2f} GiB")
    print_mfu(flops, seconds, device, dtype)


if __name__ == "__main__":
    main()

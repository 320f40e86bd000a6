"""Corpus-encoding throughput of the Phi3V retriever: documents/s, tokens/s and (on GPU) MFU.

    python bench/encode.py                                  # tiny config on CPU
    python bench/encode.py --size full --device cuda        # 4.2B architecture, random bf16 weights

The full-size run needs no weights: the architecture comes from the reference config (or the
built-in defaults, which equal it) with random initialisation. MFU = model FLOPs / measured bf16
matmul peak on the same device.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from common import forward_flops, machine, print_mfu, timed, used_crops
from PIL import Image

from hkrag.models.attention import default_attn_implementation
from hkrag.models.phi3v import Phi3VConfig, Phi3VForCausalLM
from hkrag.models.phi3v.loading import image_processor_for, tiny_phi3v
from hkrag.retriever import Phi3VRetriever

REFERENCE_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "reference" / "phi3v" / "config.json"


def build(size: str, device: torch.device, dtype: torch.dtype, num_crops: int, attn: str) -> Phi3VRetriever:
    _, processor = tiny_phi3v(num_crops=num_crops)
    if size == "tiny":
        model = tiny_phi3v(num_crops=num_crops, tokenizer=processor.tokenizer)[0]
    else:
        overrides = json.loads(REFERENCE_CONFIG.read_text()) if REFERENCE_CONFIG.exists() else {}
        config = Phi3VConfig(**overrides)
        config._attn_implementation = attn
        processor.image_processor = image_processor_for(config, num_crops=num_crops)
        with torch.device(device):
            torch.set_default_dtype(dtype)
            model = Phi3VForCausalLM(config)
            torch.set_default_dtype(torch.float32)
    return Phi3VRetriever(model.to(device=device, dtype=dtype).eval(), processor)


def pages(n: int, seed: int = 0) -> list[Image.Image]:
    """Letter-shaped pages (850x1100) of random content."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (1100, 850, 3), dtype=np.uint8)) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--num-crops", type=int, default=4)
    parser.add_argument("--attn", default=default_attn_implementation())
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    retriever = build(args.size, device, dtype, args.num_crops, args.attn)
    batch = retriever.document_inputs(pages(args.batch_size)).to(device)
    batch["pixel_values"] = batch["pixel_values"].to(dtype)
    tokens = int(batch["attention_mask"].sum())
    crops = used_crops(batch["image_sizes"], retriever.processor.image_processor.crop_size)

    with torch.inference_mode():
        seconds = timed(lambda: retriever(**batch), device, args.batches)
    flops = forward_flops(retriever.backbone.config, batch["attention_mask"].sum(dim=1), crops)
    print(f"machine: {machine()}")
    print(f"model: {args.size} ({sum(p.numel() for p in retriever.parameters()) / 1e6:.1f}M params), {dtype}, "
          f"attention {retriever.backbone.config._attn_implementation}, num_crops {args.num_crops}")
    print(f"batch {args.batch_size} docs, {tokens} tokens, {crops} crops: {seconds * 1e3:.1f} ms/batch")
    print(f"throughput: {args.batch_size / seconds:.2f} docs/s, {tokens / seconds:.0f} tokens/s")
    print_mfu(flops, seconds, device, dtype)


if __name__ == "__main__":
    main()

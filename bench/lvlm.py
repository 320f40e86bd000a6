"""Local LVLM backends: decode speed, per-call latency, and the gain from reusing page features.

    python bench/lvlm.py                       # tiny Phi3V and Qwen2.5-VL on the CPU
    python bench/lvlm.py --device cuda --full  # full-size architectures, random bf16 weights, on a GPU

Per backend: tokens/s and latency of one greedy call (3 pages + a question), then ``--questions``
questions over the same 3 pages, asked one call at a time as the agents do, with feature reuse on and
off; the gain is the ratio of the two wall times. Every figure is the median of ``--repeats`` runs.
``--full`` builds Phi-3-vision-128k / Qwen2.5-VL-3B-sized models from their published sizes with random
weights (no download) and the tiny offline tokenizers, so the decode cost is that of the real model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

from hkrag.lvlm import GenerationSettings, LVLMRequest, PageImage  # noqa: E402
from hkrag.lvlm.local import LocalBackend, context_length  # noqa: E402
from hkrag.lvlm.phi3v import Phi3VBackend  # noqa: E402
from hkrag.lvlm.qwen2_5_vl import Qwen2_5_VLBackend  # noqa: E402

BACKENDS = {backend.name: backend for backend in (Phi3VBackend, Qwen2_5_VLBackend)}
"""--backends: the local backend classes by their ``name``."""
FULL_PHI3V = dict(
    max_position_embeddings=131072,
    hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       image_size=336, patch_size=14),
)
FULL_QWEN_3B = dict(max_position_embeddings=128000,
                    hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                    num_key_value_heads=2, tie_word_embeddings=True,
                    rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24]))
FULL_QWEN_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                        window_size=112, fullatt_block_indexes=[7, 15, 23, 31])


def pages(size: int) -> list[PageImage]:
    """Three synthetic pages of different shapes (``size`` px on the long side)."""
    shapes = [(size, int(size * 1.3)), (int(size * 1.4), size), (size, size)]
    out = []
    for i, (w, h) in enumerate(shapes):
        image = Image.new("RGB", (w, h), (255, 255, 255))
        image.paste((60 * i, 120, 200 - 50 * i), (w // 5, h // 5, w // 2, h // 3))
        out.append(PageImage(image, f"page-{i}"))
    return out


def full_backend(kind: str, device: str) -> LocalBackend:
    """A tiny backend whose model is replaced by a full-size random bf16 one (tokenizer kept)."""
    backend = BACKENDS[kind](base="tiny", device="cpu", dtype="float32")
    if kind == "phi3v":
        from hkrag.models.phi3v import Phi3VForCausalLM, tiny_phi3v_config
        from hkrag.models.phi3v.loading import image_processor_for

        config = tiny_phi3v_config(vocab_size=32064, **FULL_PHI3V)
        config._attn_implementation = "sdpa"
        backend.processor.image_processor = image_processor_for(config, num_crops=16)
        model = Phi3VForCausalLM(config)
    else:
        from transformers import Qwen2_5_VLForConditionalGeneration

        from hkrag.models.qwen2_5_vl import tiny_qwen2_5_vl_config

        config = tiny_qwen2_5_vl_config(backend.tokenizer, **FULL_QWEN_3B)
        config.vision_config.update(FULL_QWEN_VISION)
        config._attn_implementation = "sdpa"
        model = Qwen2_5_VLForConditionalGeneration(config)
    backend.lm = model.to(device=device, dtype=torch.bfloat16).eval()
    backend.model = f"full-size {kind} (random bf16)"
    backend.context_length = context_length(model.config)
    return backend


def timed_calls(backend: LocalBackend, requests: list[LVLMRequest]) -> tuple[float, int]:
    """Wall seconds and generated tokens of the requests asked one call at a time."""
    if backend.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = sum(backend(request).completion_tokens for request in requests)
    if backend.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def bench(kind: str, args: argparse.Namespace) -> None:
    backend = full_backend(kind, args.device) if args.full else BACKENDS[kind](
        base="tiny", device=args.device, dtype="float32" if args.device == "cpu" else "bfloat16"
    )
    doc = pages(args.page_size)
    settings = GenerationSettings(max_new_tokens=args.new_tokens)
    single = LVLMRequest.user(*doc, "Question: what is the total revenue? Answer briefly.", settings=settings)
    questions = [LVLMRequest.user(*doc, f"Question {q}: which year is shown?", settings=settings)
                 for q in range(args.questions)]
    backend.prefixes.capacity = 0  # page-feature reuse alone; bench/generator_cost.py measures prefix reuse
    backend.features.capacity = 0
    backend(single)  # warm-up
    latencies, rates = [], []
    for _ in range(args.repeats):
        seconds, tokens = timed_calls(backend, [single])
        latencies.append(seconds)
        rates.append(tokens / seconds)
    result = backend(single)
    print(f"{kind}: {backend.model}; prompt {result.prompt_tokens} tokens (3 pages), {result.completion_tokens} new")
    print(f"  one call: latency {statistics.median(latencies):.3f} s, {statistics.median(rates):.1f} tokens/s")
    ratios, plain_times, reuse_times = [], [], []
    for _ in range(args.repeats):
        backend.features.capacity = 0
        backend.features.clear()
        plain, _ = timed_calls(backend, questions)
        backend.features.capacity = 32
        backend.features.clear()
        reused, _ = timed_calls(backend, questions)
        plain_times.append(plain)
        reuse_times.append(reused)
        ratios.append(plain / reused)
    print(f"  {args.questions} questions over the same 3 pages: {statistics.median(plain_times):.3f} s without reuse, "
          f"{statistics.median(reuse_times):.3f} s with reuse; speed-up x{statistics.median(ratios):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=list(BACKENDS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full", action="store_true", help="full-size architectures with random bf16 weights")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"machine: {machine()}")
    print(f"command: python bench/lvlm.py {' '.join(sys.argv[1:])}".rstrip())
    for kind in args.backends:
        bench(kind, args)


if __name__ == "__main__":
    main()

"""Which tensors are alive at a measured training step's peak, against the memory model's phases.

    python bench/memory_timeline.py experiment=hkrag_retriever model.num_crops=4 trainer.global_batch_size=4 \\
        trainer.chunk_size=2 --model-config ../shared/reference/phi3v --layers 1 --vision-layers 2

Runs ``python -m hkrag.tasks.preflight --measure``'s step (``measure_one``: the experiment's own trainer, full width,
random weights, CPU) once under ``torch.profiler`` with memory events and Python stacks, replays the step's tensor
allocations (the ``hkrag.measured_step`` range) and prints: the peak of live tensor bytes above those alive when the
step began, the resident-set peak the preflight measures, the model's phases at this depth, and every tensor alive at
the peak grouped by where it was allocated (the nearest modules, the op; forward, or the backward function running).
CPU only: on CUDA, ``torch.cuda.memory._record_memory_history`` is the tool (bench/RESULTS.md's GPU to-do list).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from hkrag.tasks.fit import compose_config
from hkrag.tasks.rehearsal import measure_one, predicted_row
from hkrag.training.memory import STEP_RANGE, cuda_layer_norms, describe_bytes

BACKWARD = "autograd::engine::evaluate_function: "


@dataclass(frozen=True)
class Allocation:
    """One allocation (``size`` > 0) or free (``size`` < 0) of a tensor's storage, and where it happened."""

    time: int
    key: int
    size: int
    site: str


def events(tree: list) -> Iterator:
    """Every event of the profiler's tree, depth first."""
    for event in tree:
        yield event
        yield from events(event.children)


def name(event) -> str:
    """An event's name ("" where the profiler recorded undecodable bytes)."""
    try:
        return event.name
    except UnicodeDecodeError:
        return ""


def site(event) -> str:
    """Where an allocation happened: up to three enclosing modules, the op, and the backward function if any."""
    modules, op, backward = [], None, None
    parent = event.parent
    while parent is not None:
        kind, fields = parent.typed
        if kind == _EventType.PyCall and fields.module is not None and len(modules) < 3:
            modules.append(fields.module.cls_name)
        elif kind == _EventType.TorchOp:
            called = name(parent)
            if op is None and called.startswith("aten::"):
                op = called
            if backward is None and called.startswith(BACKWARD):
                backward = called[len(BACKWARD):]
        parent = parent.parent
    where = " < ".join(modules) or "-"
    return f"{where} | {op or '-'}" + (f" | backward of {backward}" if backward else "")


def step_window(tree: list) -> tuple[int, int]:
    """The start and end (ns) of the last measured step."""
    ranges = [e for e in events(tree) if name(e) == STEP_RANGE]
    if not ranges:
        raise SystemExit(f"no {STEP_RANGE!r} range in the profile: did the measured step run?")
    last = max(ranges, key=lambda e: e.start_time_ns)
    return last.start_time_ns, last.end_time_ns


def allocations(tree: list) -> list[Allocation]:
    """The CPU allocations and frees of the run, in time order."""
    rows = []
    for event in events(tree):
        kind, fields = event.typed
        if kind == _EventType.Allocation and fields.device.type == "cpu":
            rows.append(Allocation(event.start_time_ns, fields.ptr, fields.alloc_size, site(event)))
    return sorted(rows, key=lambda a: a.time)


def live_at_peak(rows: list[Allocation], start: int, end: int,
                 after: str = "") -> tuple[int, int, dict[int, tuple[Allocation, str]]]:
    """Bytes live when the step began, the step's peak above them, and the tensors allocated in the step and alive
    at that peak (by pointer), each with where it was freed (which backward function let it go: its owner). With
    ``after`` (a regular expression), the peak from the first allocation whose site matches it on (a late phase of the
    step, e.g. a trained tower's backward)."""
    live: dict[int, Allocation] = {}
    for row in (r for r in rows if r.time < start):
        if row.size > 0:
            live[row.key] = row
        else:
            live.pop(row.key, None)
    baseline = sum(r.size for r in live.values())
    total, peak, peak_live, peak_time = baseline, baseline, {}, start
    step_keys: dict[int, Allocation] = {}
    window = [r for r in rows if start <= r.time <= end]
    begun = not after
    for row in window:
        begun = begun or bool(re.search(after, row.site))
        if row.size > 0:
            step_keys[row.key] = row
            total += row.size
        else:
            owner = step_keys.pop(row.key, None) or live.pop(row.key, None)
            total -= owner.size if owner else 0
        if begun and total > peak:
            peak, peak_live, peak_time = total, dict(step_keys), row.time
    freed = {r.key: r.site for r in reversed(window) if r.size < 0 and r.time > peak_time and r.key in peak_live}
    return baseline, peak - baseline, {k: (a, freed.get(k, "after the step")) for k, a in peak_live.items()}


def grouped(tensors: dict[int, tuple[Allocation, str]], minimum: int) -> list[tuple[str, int, int, list[int]]]:
    """Tensors by where they were allocated and freed, largest total first: the two sites, count, total bytes and
    sizes (groups under ``minimum`` left out)."""
    sites: dict[str, list[int]] = defaultdict(list)
    for row, freed in tensors.values():
        sites[f"{row.site}  ->  freed in {freed}"].append(row.size)
    rows = [(name, len(sizes), sum(sizes), sorted(sizes, reverse=True)) for name, sizes in sites.items()]
    return sorted((r for r in rows if r[2] >= minimum), key=lambda r: -r[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. experiment=hkrag_retriever")
    parser.add_argument("--model-config", default=None, help="folder with config.json and the tokenizer")
    parser.add_argument("--layers", type=int, default=1, help="LM layers (full width)")
    parser.add_argument("--vision-layers", type=int, default=2, help="CLIP layers")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--min-mib", type=float, default=1.0, help="list sites holding at least this much")
    parser.add_argument("--after", default="", help="the peak from the first allocation whose site matches this "
                        "regular expression on, e.g. 'CLIP.*backward of' (a trained tower's backward, the step's "
                        "last phase); default: the step's peak")
    parser.add_argument("--fp32-layer-norms", action="store_true",
                        help="run F.layer_norm in fp32 as CUDA autocast does (CPU autocast keeps bf16; with "
                             "--dtype bfloat16: the CLIP tower's residual stream as on a GPU)")
    args = parser.parse_args()
    cfg = compose_config(args.overrides)
    norms = cuda_layer_norms() if args.fp32_layer_norms else nullcontext()
    with norms, profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        row = measure_one(cfg, args.layers, args.vision_layers, args.model_config, dtype=args.dtype)
    tree = prof.profiler.kineto_results.experimental_event_tree()
    baseline, peak, alive = live_at_peak(allocations(tree), *step_window(tree), args.after)
    predicted = predicted_row(cfg, row, args.model_config)
    print(f"{row['experiment']} ({row['dtype']}), {args.layers} LM / {args.vision_layers} CLIP layers, CPU "
          f"({torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__})")
    phase = f" after {args.after!r}" if args.after else ""
    print(f"step peak{phase}: resident set {describe_bytes(row['step_peak'])}, live tensors {describe_bytes(peak)} "
          f"(above {describe_bytes(baseline)} live at the step's start); predicted "
          f"{describe_bytes(predicted['predicted_step'])}")
    for name, value in predicted["predicted_phases"].items():
        print(f"  predicted phase: {name}: {describe_bytes(value)}")
    held = sum(a.size for a, _ in alive.values())
    print(f"tensors allocated in the step and alive at its peak ({describe_bytes(held)}), where allocated -> freed:")
    for name, count, total, sizes in grouped(alive, int(args.min_mib * 2**20)):
        shown = ", ".join(f"{s / 2**20:.1f}" for s in sizes[:6]) + (", ..." if len(sizes) > 6 else "")
        print(f"  {total / 2**20:9.1f} MiB  {count:3d} x [{shown}] MiB  {name}")


if __name__ == "__main__":
    main()

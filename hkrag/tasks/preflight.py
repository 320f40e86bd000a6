"""Will this experiment fit my GPU? ``python -m hkrag.tasks.preflight experiment=NAME [overrides] [--gpu-memory 80GB]``

Composes the experiment's Hydra config as ``train.py`` does, builds the memory model of one optimizer step from
the configuration alone (:mod:`hkrag.training.memory`: parameters counted on the ``meta`` device with peft, tokens
per page from the processor), prints its terms and a verdict for 24, 40, 80 and 141 GB (their 10 % fragmentation
and 1.5 GiB CUDA context assumed, not measured; DDP's, not DeepSpeed's), and exits non-zero when ``--gpu-memory`` is
given and the step is predicted not to fit, naming what to change (``trainer.chunk_size``,
``model.gradient_checkpointing``, ``model.num_crops``, ``model.dtype``; the generator's
``generator_training.optim.batch_size``), each re-planned and named only where the model says it then fits, or else
a larger GPU and the least memory the model predicts.

``--measure`` runs one optimizer step of the experiment's own trainer (the retriever's, VDocRAG pre-training's RCR +
RCG, or the generator's causal-LM LoRA fine-tuning) on CPU at full width and reduced depth (``--layers 1 2``, at
each of ``--vision-layers``; random weights and pages, fp32 or ``--dtype bfloat16`` under bf16 autocast as on CUDA)
and prints measured against predicted bytes at the same depth, the step's loss and whether the saved adapter reloads
to equal tensors, and the full depth extrapolated per LM (and CLIP) layer (bench/RESULTS.md "Memory model").
``--measure --path encode`` runs one encoding batch of the experiment's retriever (``--pages`` pages, ``--queries``
queries; its ``model.num_crops``, the real tokenizer), ``--measure --path query`` one query of ``eval.py``'s generator
(``generator=hkrag lvlm=phi3v``) through the Phi3V local backend as ``task=rag`` runs it; each prints parameters,
tokens per page and per prompt, peak memory and seconds, and the full depth extrapolated per LM layer (marked so).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from hkrag.ranges import POSITIVE, PROCESSES, memory_size

API_MODULES = ("hkrag.tasks.fit", "hkrag.tasks.rehearsal")
"""Where the preflight's functions live: the memory plan, verdicts and advice (:mod:`hkrag.tasks.fit`) and the
measured rehearsal (:mod:`hkrag.tasks.rehearsal`). This module is the command line only, and imports them after
its arguments are parsed, so that ``--help`` does not wait for torch, Hydra and peft."""


def __getattr__(name: str) -> Any:
    """``from hkrag.tasks.preflight import plan`` (any name of :data:`API_MODULES`), imported on first use."""
    for module in API_MODULES:
        found = importlib.import_module(module)
        if hasattr(found, name):
            return getattr(found, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def overrides_first(argv: Sequence[str]) -> list[str]:
    """``argv`` with its Hydra overrides (``key=value`` words not starting with ``-``) moved before the options, so
    that they may follow ``--layers 1 2`` (whose ``nargs="+"`` would otherwise take them as depths)."""
    overrides = [word for word in argv if "=" in word and not word.startswith("-")]
    return overrides + [word for word in argv if word not in overrides]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. experiment=hkrag_retriever")
    parser.add_argument("--gpu-memory", type=memory_size,
                        help="refuse (exit 1) unless the step fits this much, e.g. 80GB")
    parser.add_argument("--model-config", help="folder with the model's config.json and tokenizer (default: "
                                               "model.base)")
    parser.add_argument("--processes", type=PROCESSES.arg, default=1,
                        help="data-parallel processes sharing the global batch")
    parser.add_argument("--measure", action="store_true", help="measure --path (default: training) at --layers")
    parser.add_argument("--layers", type=POSITIVE.arg, nargs="+", default=[1, 2])
    parser.add_argument("--vision-layers", type=POSITIVE.arg, nargs="+", default=[24],
                        help="CLIP depths measured (each with every --layers)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="--measure on CPU (fp32, resident "
                        "set) or CUDA (bf16, max_memory_allocated)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="--measure (training): the weights' dtype, "
                        "bf16 under bf16 autocast (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--row", action="store_true", help="print one markdown row (docs/training.md's table)")
    parser.add_argument("--out", help="--measure: also write the measured rows to this JSON file")
    parser.add_argument("--compare", help="print the table of measured rows (a --out file) against the model")
    parser.add_argument("--path", choices=["train", "encode", "query"], default="train",
                        help="--measure: the experiment's training step (train), one encoding batch of its retriever "
                             "(encode), or one query of eval.py's generator through the Phi3V local backend (query: "
                             "the overrides are eval.py's, e.g. generator=hkrag lvlm=phi3v)")
    parser.add_argument("--pages", type=POSITIVE.arg, default=2, help="--path encode: pages in the batch")
    parser.add_argument("--queries", type=POSITIVE.arg, default=2, help="--path encode: queries in the batch")
    parser.add_argument("--full-depth", type=POSITIVE.arg, default=32, help="LM layers extrapolated to")
    parser.add_argument("--full-vision-depth", type=POSITIVE.arg, default=24,
                        help="--path train: CLIP layers extrapolated to (with two CLIP depths measured)")
    parser.add_argument("--measure-one", type=POSITIVE.arg, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(overrides_first(sys.argv[1:] if argv is None else argv))
    from hkrag.tasks import fit, rehearsal  # after parsing: --help answers without them (see API_MODULES)

    cfg = fit.compose_config(args.overrides, "eval" if args.path == "query" else "train")
    if args.measure_one or args.measure or args.compare:
        rehearsal.run(args, cfg)
        return
    p = fit.plan(cfg, args.model_config, args.processes)
    memory = args.gpu_memory
    print(fit.table_row(p, cfg.model.get("num_crops")) if args.row else fit.report(p, memory))
    if memory:
        fit.check(p, memory, cfg)


if __name__ == "__main__":
    main()

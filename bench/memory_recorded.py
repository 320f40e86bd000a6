"""Every recorded memory measurement against the memory model as it stands now.

    python bench/memory_recorded.py [--model-config ../shared/reference/phi3v]

Reads the measured rows under bench/runs/ (``python -m hkrag.tasks.preflight --measure --out`` files, and the rows
of earlier tables kept as JSON with their GiB rounded to 0.01) and prints, for each, the step's peak measured and
predicted by :mod:`hkrag.training.memory` at the row's depth, device and dtype, and the error. Checkpointed rows
measured before ``hkrag.retriever.enable_checkpointing`` removed transformers' input-embedding hooks (2026-11-26)
are marked ``input_hooks`` and carry, as ``input_hooks_bytes``, what that code kept beyond today's step (a frozen
tower in the graph, the embeddings requiring grad): the memory model of commit 7e4fa90, the last to model the hooks
(its ``Workload.input_hooks``), predicted each such row's step with them and without, and the difference is
recorded in the row. Their prediction here is today's model plus that figure (:func:`with_history`), so the model
itself has no branch for code that no longer runs. Nothing here runs a model: it re-reads the evidence after a
change to the model.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hkrag.io import read_json
from hkrag.tasks.fit import compose_config
from hkrag.tasks.rehearsal import predicted_row

RUNS = Path(__file__).resolve().parent / "runs"
RETRIEVER_4_CROPS = ["experiment=hkrag_retriever", "model.num_crops=4", "model.attn_implementation=sdpa",
                     "trainer.global_batch_size=4", "trainer.chunk_size=2"]
PRETRAINING_4_CROPS = ["experiment=pretrain_vdocrag", "model.num_crops=4", "trainer.global_batch_size=2",
                       "trainer.chunk_size=1"]
GENERATOR_ONE_PAGE = ["experiment=generator_vdocrag", "model.num_crops=4", "generator.top_k=1",
                      "generator_training.optim.batch_size=1"]
SOURCES: dict[str, dict[str, Any]] = {
    "2026-11-25-cpu/retriever_no_checkpointing_fp32.json": {},
    "2026-11-25-h200/retriever.json": {},
    "2026-11-26-h200/pre_vdocrag.json": {
        "overrides": ["experiment=pretrain_vdocrag", "model.attn_implementation=sdpa"]},
    "2026-11-26-h200/gen_vdocrag.json": {
        "overrides": ["experiment=generator_vdocrag", "model.attn_implementation=sdpa"]},
    "2026-11-26-cpu/pre_vdocrag_fp32_clip_depths.json": {"overrides": PRETRAINING_4_CROPS},
    "2026-11-26-cpu/pre_vdocrag_bf16.json": {"overrides": PRETRAINING_4_CROPS},
    "2026-11-26-cpu/gen_vdocrag_bf16.json": {"overrides": GENERATOR_ONE_PAGE},
    "2026-11-26-cpu/retriever_pretrained_bf16.json": {"overrides": [
        "experiment=hkrag_retriever_pretrained", "model.num_crops=4", "model.attn_implementation=sdpa",
        "trainer.global_batch_size=2", "trainer.chunk_size=1"]},
    "2026-11-26-cpu/retriever_dense_same_settings_fp32.json": {
        "overrides": [*RETRIEVER_4_CROPS, "model.head=dense"]},
    "2026-11-26-cpu/retriever_late_interaction_fp32.json": {
        "overrides": [*RETRIEVER_4_CROPS, "model.head=late_interaction"]},
    "2026-11-26-cpu/retriever_dense_checkpointing_fp32.json": {"overrides": [*RETRIEVER_4_CROPS, "model.head=dense"]},
    "2026-11-26-cpu/retriever_late_interaction_checkpointing_fp32.json": {
        "overrides": [*RETRIEVER_4_CROPS, "model.head=late_interaction"]},
    "2026-11-26-cpu/pre_vdocrag_checkpointing_fp32.json": {"overrides": PRETRAINING_4_CROPS},
    "2026-11-26-cpu/gen_vdocrag_checkpointing_fp32.json": {"overrides": GENERATOR_ONE_PAGE},
    "2026-11-26-cpu/retriever_pretrained_checkpointing_bf16.json": {"overrides": [
        "experiment=hkrag_retriever_pretrained", "model.num_crops=4", "model.attn_implementation=sdpa",
        "trainer.global_batch_size=2", "trainer.chunk_size=1"]},
}
"""Each file's rows with what its rows do not say themselves: the command's overrides."""


def with_history(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` (with the model's figures) predicted as its code ran: today's step plus what transformers'
    input-embedding hooks kept on top of it, recorded in the row (``input_hooks_bytes``; see the module's text)."""
    return {**row, "predicted_step": row["predicted_step"] + row.get("input_hooks_bytes", 0)}


def recorded(model_config: str | None) -> list[dict[str, Any]]:
    """Every row of :data:`SOURCES` that exists here, with the model's prediction."""
    rows = []
    for name, context in SOURCES.items():
        path = RUNS / name
        if not path.is_file():
            continue
        for row in read_json(path):
            row = {**context, **row, "source": name}
            rows.append(with_history(predicted_row(compose_config(row["overrides"]), row, model_config)))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """One markdown line per row: source, setting, depth, measured and predicted step peak, error."""
    lines = ["| source | setting | LM / CLIP layers | dtype | step peak measured / predicted (GiB) | error |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        setting = " ".join(o for o in row["overrides"] if not o.startswith("experiment="))
        marks = " (input hooks)" if row.get("input_hooks") else ""
        rounded = " (rounded)" if row.get("rounded_gib") else ""
        lines.append(f"| {row['source']} | {row['experiment']} {setting}{marks} | {row['layers']} / "
                     f"{row['vision_layers']} | {row.get('dtype') or 'bfloat16'} | {row['step_peak'] / 2**30:.3f}"
                     f"{rounded} / {row['predicted_step'] / 2**30:.3f} | "
                     f"{row['step_peak'] / row['predicted_step'] - 1:+.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="../shared/reference/phi3v",
                        help="folder with Phi-3-vision's config.json and tokenizer")
    args = parser.parse_args()
    print(table(recorded(args.model_config)))


if __name__ == "__main__":
    main()

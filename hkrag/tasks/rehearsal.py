"""``python -m hkrag.tasks.preflight --measure``: the experiment's own step (or an inference path) run at full width
and reduced depth on random weights, measured, and compared with the memory model at the same depth.

Each depth runs in a fresh process (its own peak, glibc's mmap threshold pinned,
:data:`~hkrag.training.memory.MALLOC_ENV`); two depths give the full depth extrapolated per layer (bench/RESULTS.md
"Memory model and preflight").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hkrag.io import read_json, write_json
from hkrag.lvlm import PageImage
from hkrag.models.phi3v import Phi3VConfig
from hkrag.retriever import HeadSettings
from hkrag.tasks.fit import (
    PAGE_SIZE,
    QUERY,
    Plan,
    is_generator,
    is_pretraining,
    lora_settings,
    model_source,
    plan,
    read_source,
)
from hkrag.training.generator import single_pass_prompt
from hkrag.training.memory import (
    MALLOC_ENV,
    describe_bytes,
    measure_encoding,
    measure_generator_step,
    measure_query,
    measure_step,
    measured_dtype,
    noise_pages,
    projection_parameters,
)
from hkrag.training.objective import make_loss


def measure(overrides: Sequence[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--measure``: each depth in a fresh process (its own peak, glibc pinned); the measured figures."""
    rows = []
    for vision_layers, layers in ((v, n) for v in args.vision_layers for n in args.layers):
        command = [sys.executable, "-m", "hkrag.tasks.preflight", *overrides, "--measure-one", str(layers),
                   "--vision-layers", str(vision_layers), "--device", args.device, "--path", args.path,
                   "--pages", str(args.pages), "--queries", str(args.queries)]
        if args.dtype:
            command += ["--dtype", args.dtype]
        if args.model_config:
            command += ["--model-config", args.model_config]
        done = subprocess.run(command, env={**os.environ, **MALLOC_ENV}, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"preflight --measure at {layers} LM and {vision_layers} CLIP layers failed:\n"
                             f"{done.stderr[-4000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def reduce_depth(config: Phi3VConfig, layers: int, vision_layers: int, attention: str | None) -> Phi3VConfig:
    """``config`` at ``layers`` LM and ``vision_layers`` CLIP layers, full width (attention ``sdpa`` unless set)."""
    config.num_hidden_layers = layers
    config.vision_config.num_hidden_layers = vision_layers
    config._attn_implementation = attention or "sdpa"
    return config


def reduced(cfg: DictConfig, layers: int, vision_layers: int, model_config: str | None,
            device: str = "cpu", dtype: str | None = None) -> tuple[Plan, Any]:
    """``cfg``'s plan at full width and ``layers`` / ``vision_layers`` deep, as measured (``dtype``, by default fp32
    on CPU and bf16 on CUDA, bf16 under autocast; the retriever's gradient cache over the whole global batch), and
    the reduced model's config and processor (attention as ``model.attn_implementation``)."""
    config, processor = model_source(cfg, model_config)
    reduce_depth(config, layers, vision_layers, cfg.model.get("attn_implementation"))
    p = plan(cfg, model_config, source=(config, processor))
    dtype = measured_dtype(device, dtype)
    changes: dict[str, Any] = {"dtype": dtype, "device": device, "autocast": dtype != "float32"}
    if not is_generator(cfg):
        changes["batch"] = int(cfg.trainer.global_batch_size)
    extra = replace(p.extra, **{k: v for k, v in changes.items() if k != "batch"}) if p.extra else None
    return replace(p, work=replace(p.work, **changes), extra=extra, estimate=p.with_work(**changes)), \
        (config, processor)


GENERATOR_QUESTION = "What was the total revenue reported for the fiscal year 2021, and how did it compare to 2020?"
GENERATOR_ANSWER = ("The total revenue in fiscal year 2021 was 4.2 billion dollars, an increase of 12 percent over "
                    "the 3.75 billion dollars reported for 2020.")
"""The measured generator example's question and target (the target about ``ANSWER_TOKENS`` tokens)."""
PAGE_TEXT = " ".join(["The committee reviewed the annual report, the audited financial statements and the notes on "
                      "revenue, operating costs, capital expenditure and cash flow for each business segment."] * 24)
"""The measured pre-training page's text: longer than ``loss.max_query_length`` / ``max_target_length`` (512
tokens), so RCR's query and RCG's target are cut to them as the model assumes."""


def measure_one(cfg: DictConfig, layers: int, vision_layers: int, model_config: str | None,
                device: str = "cpu", dtype: str | None = None) -> dict[str, Any]:
    """One depth measured: one optimizer step (on CUDA the second of two) of the experiment's own trainer — the
    retriever's with its head (the late-interaction projection and MaxSim loss as ``train.py`` builds them),
    VDocRAG pre-training's (its loss and collator as ``train.py`` builds them) or the generator's."""
    p, (config, processor) = reduced(cfg, layers, vision_layers, model_config, device, dtype)
    lora, _ = lora_settings(cfg)
    steps = 1 if device == "cpu" else 2
    if is_generator(cfg):
        measured = measure_generator_step(
            config, processor, lora, p.work.rows, int(cfg.generator.get("top_k", 3)), GENERATOR_QUESTION,
            GENERATOR_ANSWER, single_pass_prompt(cfg.generator), p.work.checkpointing, steps=steps, device=device,
            dtype=p.work.dtype)
    else:
        pretraining = is_pretraining(cfg)
        head = HeadSettings.of(cfg.model)
        measured = measure_step(config, processor, lora, p.work.batch, p.work.rows, p.work.checkpointing,
                                PAGE_TEXT if pretraining else QUERY, steps=steps, device=device,
                                loss=make_loss(cfg.loss, head), dtype=p.work.dtype, head=head)
    return {"experiment": p.name, "layers": layers, "vision_layers": vision_layers, "device": device,
            "dtype": p.work.dtype, **measured.as_dict()}


def measure_encode_one(cfg: DictConfig, layers: int, vision_layers: int, model_config: str | None, pages: int,
                       queries: int, device: str = "cpu") -> dict[str, Any]:
    """One depth of ``--path encode``: one batch of ``pages`` pages and one of ``queries`` queries encoded by the
    experiment's retriever (its ``model.num_crops``, the real tokenizer) at full width, random weights."""
    config, processor = model_source(cfg, model_config)
    reduce_depth(config, layers, vision_layers, cfg.model.get("attn_implementation"))
    measured = measure_encoding(config, processor, pages, queries, QUERY, PAGE_SIZE, device)
    return {"experiment": cfg.get("run_name", "train"), "path": "encode", "layers": layers,
            "vision_layers": vision_layers, "device": device, "num_crops": processor.image_processor.num_crops,
            **measured.as_dict()}


def measure_query_one(cfg: DictConfig, layers: int, vision_layers: int, model_config: str | None,
                      device: str = "cpu") -> dict[str, Any]:
    """One depth of ``--path query``: one query answered by ``eval.py``'s generator (``generator=hkrag``) through
    the Phi3V local backend as ``task=rag`` runs it (:func:`hkrag.tasks.rag.answer_all`), its pages
    ``generator.top_k`` random-noise pages of :data:`PAGE_SIZE` at ``lvlm.num_crops``, random weights (an adapter
    named by ``lvlm.adapter`` is merged into the weights at load time and adds nothing at inference)."""
    from hkrag.rag.records import Query  # the RAG task's types and loop: only this path needs them
    from hkrag.tasks.rag import answer_all

    lvlm = cfg.lvlm
    if not str(lvlm.get("_target_", "")).endswith("Phi3VBackend"):
        raise SystemExit(f"preflight --path query rehearses the Phi3V local backend; lvlm is {lvlm.get('_target_')}"
                         " (pass lvlm=phi3v)")
    config, processor = read_source(model_config or lvlm.base, lvlm.num_crops)
    reduce_depth(config, layers, vision_layers, lvlm.get("attn_implementation"))
    generator = OmegaConf.to_container(cfg.generator, resolve=True)
    images = noise_pages(int(generator.get("top_k", 3)), PAGE_SIZE)
    pages = [PageImage(image, f"page-{i}") for i, image in enumerate(images)]
    query = Query("preflight", GENERATOR_QUESTION, pages, gold=[GENERATOR_ANSWER])
    settings = {key: int(lvlm[key]) for key in ("batch_size", "feature_cache_size", "prefix_cache_size")}
    measured = measure_query(config, processor, settings, images[0],
                             lambda backend: answer_all(generator, backend, [query])[0], device)
    return {"experiment": f"{generator.get('name', 'generator')} on {cfg.lvlm.get('base')}", "path": "query",
            "layers": layers, "vision_layers": vision_layers, "device": device,
            "num_crops": processor.image_processor.num_crops, **measured.as_dict()}


EXTRAPOLATED_KEYS = ("weights", "step_peak", "seconds", "parameters")


def per_layer_slope(rows: Sequence[dict[str, Any]], depth: str, other: str) -> tuple[dict[str, float], int] | None:
    """The change per layer of ``depth`` (``layers`` or ``vision_layers``) of each extrapolated figure, from the two
    deepest rows that differ in it only (same ``other`` depth), and the deepest ``depth`` measured; ``None`` when
    no two rows do."""
    for level in sorted({row[other] for row in rows}, reverse=True):
        same = sorted((row for row in rows if row[other] == level), key=lambda row: row[depth])
        if len(same) >= 2 and same[-1][depth] != same[-2][depth]:
            low, high = same[-2], same[-1]
            return {k: (high[k] - low[k]) / (high[depth] - low[depth]) for k in EXTRAPOLATED_KEYS}, high[depth]
    return None


def extrapolated_depths(rows: Sequence[dict[str, Any]], layers: int, vision_layers: int) -> dict[str, Any] | None:
    """The deepest measured row's figures extrapolated linearly to ``layers`` LM layers (per LM layer, from two LM
    depths at one CLIP depth) and to ``vision_layers`` CLIP layers (per CLIP layer, from two CLIP depths at one LM
    depth; left at the measured CLIP depth without them); ``None`` without two LM depths. A step's peak is one phase,
    which may change with depth: the memory model's figure at full depth is the better guide (bench/RESULTS.md)."""
    lm = per_layer_slope(rows, "layers", "vision_layers")
    if lm is None:
        return None
    clip = per_layer_slope(rows, "vision_layers", "layers")
    base = max(rows, key=lambda row: (row["layers"], row["vision_layers"]))
    target = {"layers": layers, "vision_layers": vision_layers if clip else base["vision_layers"]}
    out = {**base, **target, "extrapolated": True,
           "extrapolated_from": sorted({(row["layers"], row["vision_layers"]) for row in rows})}
    for key in EXTRAPOLATED_KEYS:
        out[key] = base[key] + (layers - base["layers"]) * lm[0][key]
        if clip:
            out[key] += (target["vision_layers"] - base["vision_layers"]) * clip[0][key]
    return out


def extrapolated(rows: Sequence[dict[str, Any]], layers: int) -> dict[str, Any] | None:
    """The two deepest measured rows' figures extrapolated linearly per LM layer to ``layers`` (``None`` with
    fewer than two depths), at the measured CLIP depth: weights, peak, seconds and parameters."""
    return extrapolated_depths(rows, layers, max(row["vision_layers"] for row in rows)) if rows else None


def inference_table(rows: Sequence[dict[str, Any]], full_depth: int) -> str:
    """``--path encode|query``: the measured depths and, from the two deepest, the full depth extrapolated per
    LM layer (marked so; the CLIP depth stays the measured one)."""
    lines = ["| path | LM layers | CLIP layers | crops | parameters | tokens/page | tokens/prompt | frozen model "
             "| peak above it | s | detail |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    extra = extrapolated(rows, full_depth)
    for row in [*rows, *([extra] if extra else [])]:
        depth = f"{row['layers']} (extrapolated)" if row.get("extrapolated") else str(row["layers"])
        detail = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row["detail"].items()
                           if v is not None and not row.get("extrapolated"))
        lines.append(f"| {row['path']} | {depth} | {row['vision_layers']} | {row['num_crops']} | "
                     f"{row['parameters']:,.0f} | {row['page_tokens']} | {row['prompt_tokens']} | "
                     f"{describe_bytes(row['weights'])} | {describe_bytes(row['step_peak'])} | {row['seconds']:.0f} | "
                     f"{detail or 'extrapolated per LM layer from the two deepest rows'} |")
    return "\n".join(lines)


def predicted_row(cfg: DictConfig, row: dict[str, Any], model_config: str | None) -> dict[str, Any]:
    """``row`` (a measurement) with the memory model's figures at its depth; the late-interaction projection's two
    copies (built with the model, before the step) counted with the frozen model as measured."""
    p, _ = reduced(cfg, row["layers"], row["vision_layers"], model_config, row.get("device", "cpu"),
                   row.get("dtype"))
    frozen = p.estimate.terms[f"frozen weights ({p.work.dtype})"] + p.estimate.terms["LoRA adapter (fp32)"]
    head = 0  # the late-interaction projection's frozen original and trained copy, built with the model
    if late := p.work.late_interaction:
        head = 2 * projection_parameters(p.arch.hidden, late.dim)
        frozen += head * p.work.bytes
    return {**row, "predicted_weights": frozen, "predicted_step": p.estimate.peak - frozen,
            "predicted_phases": p.estimate.phases, "predicted_parameters": p.params.total + head,
            "predicted_trainable": p.params.trainable, "predicted_page_tokens": p.work.page_tokens}


def measurement_table(rows: Sequence[dict[str, Any]]) -> str:
    """Measured against predicted, per depth (bytes as GiB; error of the step's peak above the frozen model; the
    step's loss and whether the saved adapter reloads to equal tensors); a row marked ``extrapolated`` (from
    :func:`extrapolated_depths`, with the model's prediction at its depth) names the measured depths it came from."""
    lines = ["| experiment | LM layers | CLIP layers | parameters | tokens/row | frozen model measured / predicted "
             "| step peak measured / predicted | error | s/step | loss | adapter saved, round trip |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        error = row["step_peak"] / row["predicted_step"] - 1
        name = row.get("experiment", "") + (f" ({row['dtype']})" if row.get("dtype") else "")
        if row.get("extrapolated"):
            depths = ", ".join(f"{lm}/{clip}" for lm, clip in row["extrapolated_from"])
            lines.append(f"| *{name}, extrapolated from LM/CLIP layers {depths}* | *{row['layers']}* | "
                         f"*{row['vision_layers']}* | *{row['parameters']:,.0f} (predicted "
                         f"{row['predicted_parameters']:,})* | {row['page_tokens']} | "
                         f"*{describe_bytes(row['weights'])} / {describe_bytes(row['predicted_weights'])}* | "
                         f"*{describe_bytes(row['step_peak'])} / {describe_bytes(row['predicted_step'])}* | "
                         f"*{error:+.1%}* | – | – | – |")  # seconds: not extrapolated (one noisy step a depth)
            continue
        lines.append(f"| {name} | {row['layers']} | {row['vision_layers']} | "
                     f"{row['parameters']:,} (predicted {row['predicted_parameters']:,}) | {row['page_tokens']} "
                     f"(predicted {row['predicted_page_tokens']}) | "
                     f"{describe_bytes(row['weights'])} / {describe_bytes(row['predicted_weights'])} | "
                     f"{describe_bytes(row['step_peak'])} / {describe_bytes(row['predicted_step'])} | "
                     f"{error:+.1%} | {row['seconds']:.0f} | {row['loss']:.4g} | "
                     f"{row.get('adapter_bytes', 0) / 2**20:.1f} MiB, "
                     f"{'equal' if row.get('adapter_round_trip') else 'NOT equal'} |")
    return "\n".join(lines)


def run(args: argparse.Namespace, cfg: DictConfig) -> None:
    """The command's ``--measure``, ``--measure-one`` (one depth, in the process :func:`measure` starts) and
    ``--compare``: print the measured rows against the model (``--out``: also write them)."""
    if args.measure_one:
        if args.path == "encode":
            row = measure_encode_one(cfg, args.measure_one, args.vision_layers[0], args.model_config, args.pages,
                                     args.queries, args.device)
        elif args.path == "query":
            row = measure_query_one(cfg, args.measure_one, args.vision_layers[0], args.model_config, args.device)
        else:
            row = measure_one(cfg, args.measure_one, args.vision_layers[0], args.model_config, args.device, args.dtype)
        print(json.dumps(row))
        return
    rows = measure(args.overrides, args) if args.measure else read_json(args.compare)
    if args.out:
        write_json(Path(args.out), rows)
    if rows and rows[0].get("path", "train") != "train":
        print(inference_table(rows, args.full_depth))
    else:
        full = extrapolated_depths(rows, args.full_depth, args.full_vision_depth)
        print(measurement_table([predicted_row(cfg, row, args.model_config) for row in
                                 [*rows, *([full] if full else [])]]))

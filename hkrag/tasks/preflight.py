"""Will this experiment fit my GPU? ``python -m hkrag.tasks.preflight experiment=NAME [overrides] [--gpu-memory 80GB]``

Composes the experiment's Hydra config as ``train.py`` does, builds the memory model of one optimizer step from
the configuration alone (:mod:`hkrag.training.memory`: parameters counted on the ``meta`` device with peft, tokens
per page from the processor), prints its terms and a verdict for 24, 40, 80 and 141 GB, and exits non-zero when
``--gpu-memory`` is given and the step is predicted not to fit, naming what to change (``trainer.chunk_size``,
``model.gradient_checkpointing``, ``model.num_crops``; the generator's ``generator_training.optim.batch_size``).

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
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from hkrag.data.collators import RetrieverCollator
from hkrag.io import read_json, write_json
from hkrag.lvlm import PageImage
from hkrag.models.phi3v import Phi3VConfig, load_processor, tiny_phi3v
from hkrag.models.phi3v.loading import CheckpointNotFoundError
from hkrag.ranges import POSITIVE, PROCESSES, memory_size
from hkrag.retriever import VDOCRAG_LORA_TARGETS, HeadSettings, LoraSettings, describe_lora_modules
from hkrag.training.generator import single_pass_prompt
from hkrag.training.memory import (
    GPU_SIZES_GB,
    MALLOC_ENV,
    MAXSIM_PHASE,
    Architecture,
    Estimate,
    LateInteractionHead,
    Parameters,
    Workload,
    count_parameters,
    describe_bytes,
    estimate,
    format_terms,
    kv_cache_bytes,
    measure_encoding,
    measure_generator_step,
    measure_query,
    measure_step,
    measured_dtype,
    noise_pages,
    projection_parameters,
)
from hkrag.training.objective import make_loss

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""train.py's configs (as :data:`hkrag.tasks.common.CONF_DIR`; not imported from there, which loads the retrieval
evaluation's FAISS and trec_eval: the preflight stays light)."""
PAGE_SIZE = (1344, 1344)
"""The page the token count is taken from (VDocRAG's quick-start size); the HD transform pads every page to the
``num_crops`` grid, so a letter page gives the same count."""
QUERY = "Instruct: I'm looking for an image that answers the question.\nQuery: what was the total revenue in 2021?"
"""A training query as OpenDocVQA's look (instruction + question), for the query's token count."""
CHUNKS = (1, 2, 4, 8, 16, 32, 64)
ANSWER_TOKENS = 32
"""Target tokens of a generator example (answers are short) and tokens generated at inference."""
PROMPT_TEXT_TOKENS = 96
"""The single-pass prompt's text around its pages (template and question), in tokens."""


class PreflightError(SystemExit):
    """A configuration predicted not to fit: exit status 1 with the message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def compose_config(overrides: Sequence[str], name: str = "train") -> DictConfig:
    """``train.py``'s configuration under ``overrides`` (``experiment=...`` among them); ``name="eval"``:
    ``eval.py``'s (``--path query``: ``generator=hkrag lvlm=phi3v``)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def is_generator(cfg: DictConfig) -> bool:
    return "generator_training" in str(cfg.run.get("_target_", ""))


def is_pretraining(cfg: DictConfig) -> bool:
    return "PretrainingLoss" in str(cfg.loss.get("_target_", ""))


def model_source(cfg: DictConfig, model_config: str | None) -> tuple[Phi3VConfig, Any]:
    """The model's config and processor: ``--model-config`` (a folder with config.json and the tokenizer files, e.g.
    a copy of the checkpoint without weights), else ``model.base``; the tiny model's from its settings."""
    model = cfg.model
    if model.kind == "tiny":
        built, processor = tiny_phi3v(num_crops=model.num_crops, seed=model.seed, **model.get("config", {}))
        return built.config, processor
    return read_source(model_config or model.base, model.num_crops)


def read_source(source: str, num_crops: int | None) -> tuple[Phi3VConfig, Any]:
    """Phi3V's config and processor (``num_crops`` crops; ``None``: the checkpoint's) from ``source``."""
    try:
        return Phi3VConfig.from_pretrained(source), load_processor(source, num_crops)
    except (OSError, CheckpointNotFoundError) as error:
        raise SystemExit(
            f"preflight: cannot read the model's config.json and tokenizer from {source!r} ({error}); pass "
            "--model-config DIR, a folder holding Phi-3-vision's config.json, preprocessor_config.json and tokenizer "
            "files (no weights needed)"
        ) from error


def lora_settings(cfg: DictConfig) -> tuple[LoraSettings, str]:
    """The LoRA the run trains and where it comes from: ``model.adapter``'s own config when readable, VDocRAG's
    (r 8, their target list) for a hub adapter that cannot be read offline, else ``model.lora``."""
    adapter = cfg.model.get("adapter")
    if adapter:
        path = Path(str(adapter)) / "adapter_config.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            targets = saved.get("target_modules") or VDOCRAG_LORA_TARGETS
            return LoraSettings(r=saved.get("r", 8), alpha=saved.get("lora_alpha", 64),
                                dropout=saved.get("lora_dropout", 0.1), target_modules=tuple(targets)), str(path)
        return LoraSettings(target_modules=VDOCRAG_LORA_TARGETS), f"{adapter} (not read: assumed VDocRAG's LoRA)"
    return LoraSettings(**OmegaConf.to_container(cfg.model.lora, resolve=True)), "model.lora"


def page_shape(processor: Any) -> tuple[int, int]:
    """LM tokens of one page's document prompt and CLIP crops it runs (used crops + the global view)."""
    batch = RetrieverCollator(processor).documents([Image.new("RGB", PAGE_SIZE, "white")])
    crop = processor.image_processor.crop_size
    height, width = (int(v) for v in batch["image_sizes"][0])
    return int(batch["attention_mask"][0].sum()), 1 + (height // crop) * (width // crop)


@dataclass
class Plan:
    """One experiment's memory model: what it runs and the predicted step."""

    name: str
    arch: Architecture
    params: Parameters
    lora_source: str
    work: Workload
    extra: Workload | None
    estimate: Estimate
    knob: str
    inference_kv: int = 0

    def with_work(self, **changes: Any) -> Estimate:
        """The estimate under other settings (chunk, checkpointing, tokens) of the main and extra passes."""
        main = replace(self.work, **changes)
        extra = replace(self.extra, **{k: v for k, v in changes.items() if k != "page_tokens"}) if self.extra \
            else None
        return combined(self.arch, self.params, main, extra)


def combined(arch: Architecture, params: Parameters, work: Workload, extra: Workload | None) -> Estimate:
    """The step's estimate; a second pass (RCG's LM-head pass) adds its phase."""
    result = estimate(arch, params, work)
    if extra is not None:
        phases = estimate(arch, params, extra).phases
        mask = extra.rows * extra.page_tokens**2 * (1 + extra.bytes)  # RCG's 4-D bool mask and its additive copy
        result.phases["RCG pass with the LM head (one chunk)"] = phases["language model backward (one chunk)"] + mask
    return result


def plan(cfg: DictConfig, model_config: str | None = None, processes: int = 1,
         source: tuple[Phi3VConfig, Any] | None = None) -> Plan:
    """The memory model of ``cfg``'s experiment (one process of ``processes``); ``source``: the model's config
    and processor when not read from ``--model-config`` / ``model.base``."""
    config, processor = source or model_source(cfg, model_config)
    arch = Architecture.of(config)
    lora, lora_source = lora_settings(cfg)
    params = count_parameters(config, lora)
    page_tokens, crops = page_shape(processor)
    dtype = cfg.model.get("dtype", "float32") if cfg.model.kind != "tiny" else "float32"
    attention = cfg.model.get("attn_implementation") or "sdpa"
    checkpointing = bool(cfg.model.get("gradient_checkpointing", False))
    name = cfg.get("run_name", "train")
    if is_generator(cfg):
        optim = cfg.generator_training.optim
        pages = int(cfg.generator.get("top_k", 3))
        tokens = pages * page_tokens + PROMPT_TEXT_TOKENS + ANSWER_TOKENS
        work = Workload(rows=optim.batch_size, page_tokens=tokens, crops=pages * crops, query_tokens=0, batch=0,
                        dtype=dtype, checkpointing=checkpointing, attention=attention, lm_head_tokens=tokens,
                        logits_transposed=optim.get("loss_mean", "token") == "example",
                        autocast=optim.get("precision") in ("bf16", "fp16"))
        kv = kv_cache_bytes(arch, tokens, dtype)  # the prompt and the answer it generates
        return Plan(name, arch, params, lora_source, work, None, estimate(arch, params, work),
                    "generator_training.optim.batch_size", kv)
    batch = int(cfg.trainer.global_batch_size) // processes
    chunk = int(cfg.trainer.chunk_size or batch)
    query_tokens = int(cfg.loss.max_query_length) if is_pretraining(cfg) else len(
        processor.tokenizer(QUERY)["input_ids"]) + 1
    late = late_interaction_head(cfg, query_tokens)
    work = Workload(rows=chunk, page_tokens=page_tokens, crops=crops,
                    query_tokens=late.query_tokens if late else query_tokens, batch=batch,
                    dtype=dtype, checkpointing=checkpointing, attention=attention,
                    autocast=cfg.trainer.get("precision") in ("bf16", "fp16"), late_interaction=late)
    extra = None
    if is_pretraining(cfg):
        target = int(cfg.loss.max_target_length)
        extra = replace(work, page_tokens=page_tokens + target, lm_head_tokens=page_tokens + target, batch=0,
                        logits_transposed=True)  # causal_lm_loss
    return Plan(name, arch, params, lora_source, work, extra, combined(arch, params, work, extra), "trainer.chunk_size")


def late_interaction_head(cfg: DictConfig, query_tokens: int) -> LateInteractionHead | None:
    """``cfg``'s late-interaction head for the memory model (``None`` for the dense head): its projection size, a
    query's tokens with the augmentation tokens, and the loss's global score matrix (queries x pages with any hard
    negatives)."""
    head = HeadSettings.of(cfg.model)
    if not head.late_interaction:
        return None
    queries = int(cfg.trainer.global_batch_size)
    return LateInteractionHead(dim=head.dim, query_tokens=query_tokens + head.query_augmentation, queries=queries,
                               pages=queries * (1 + int(cfg.trainer.get("hard_negatives") or 0)),
                               scores=float(cfg.loss.get("infonce_weight", 1.0)) > 0)


def fits(result: Estimate, memory: int) -> bool:
    return result.required() <= memory


def largest_fitting_chunk(p: Plan, memory: int, **changes: Any) -> int | None:
    """The largest power-of-two chunk (rows per forward) up to the batch that fits ``memory``."""
    limit = p.work.batch or p.work.rows * 64
    best = None
    for chunk in CHUNKS:
        if chunk <= limit and fits(p.with_work(rows=chunk, **changes), memory):
            best = chunk
    return best


def maxsim_advice(p: Plan, memory: int, cfg: DictConfig) -> list[str]:
    """What brings the late-interaction loss's score phase under ``memory`` when it alone does not fit (no chunk
    size helps: it scores the whole global batch, queries x pages x query tokens x page tokens): the largest
    power-of-two ``trainer.global_batch_size`` below the configured one that fits, and the most query augmentation
    tokens that fit; each checked against the model, the rest of the step included. Nothing when the phase fits."""
    late = p.work.late_interaction
    if late is None or MAXSIM_PHASE not in p.estimate.phases:
        return []
    alone = Estimate(p.estimate.terms, {MAXSIM_PHASE: p.estimate.phases[MAXSIM_PHASE]})
    if fits(alone, memory):
        return []
    processes = max(1, late.queries // max(1, p.work.batch))
    pages_per_query = late.pages // late.queries
    options = []
    for batch in (2**k for k in range(late.queries.bit_length() - 1, -1, -1)):
        if batch >= late.queries or batch < processes:
            continue
        head = replace(late, queries=batch, pages=batch * pages_per_query)
        if fits(p.with_work(rows=min(p.work.rows, batch // processes), batch=batch // processes,
                            late_interaction=head), memory):
            options.append(f"trainer.global_batch_size={batch} (the MaxSim scores grow with its square: "
                           f"{describe_bytes(p.estimate.phases[MAXSIM_PHASE])} at {late.queries})")
            break
    text_tokens = late.query_tokens - (augmentation := HeadSettings.of(cfg.model).query_augmentation)
    for kept in range(augmentation - 1, -1, -1):
        head = replace(late, query_tokens=text_tokens + kept)
        if fits(p.with_work(query_tokens=text_tokens + kept, late_interaction=head), memory):
            options.append(f"model.late_interaction.query_augmentation={kept} (fewer query tokens; ColPali's "
                           f"recipe appends {augmentation})")
            break
    return options


def advice(p: Plan, memory: int, cfg: DictConfig) -> list[str]:
    """What to change for the step to fit ``memory``, each option checked against the model (the MaxSim phase's
    own options first when it is what does not fit: :func:`maxsim_advice`)."""
    options = maxsim_advice(p, memory, cfg)
    chunk = largest_fitting_chunk(p, memory)
    if chunk is not None and chunk < p.work.rows:
        options.append(f"{p.knob}={chunk}" + (" (with generator_training.optim.grad_accum raised to keep the batch)"
                                               if p.knob.startswith("generator") else ""))
    if not p.work.checkpointing:
        chunk = largest_fitting_chunk(p, memory, checkpointing=True)
        if chunk is not None:
            options.append(f"model.gradient_checkpointing=true (then {p.knob} up to {chunk})")
    crops = cfg.model.get("num_crops")
    real = cfg.model.kind != "tiny"
    if real and (crops is None or int(crops) > 4):  # null: the checkpoint's 16
        options.append("model.num_crops=4 (fewer page tokens: a speed choice of ours, not VDocRAG's 16; re-run "
                       "the preflight with it to see the chunk it allows)")
    if real and p.work.dtype == "float32":
        options.append("model.dtype=bfloat16")
    return options or ["a GPU with more memory (nothing in this configuration brings the step under it)"]


def report(p: Plan, memory: int | None) -> str:
    """The table and the verdicts."""
    w = p.work
    lines = [
        f"preflight: {p.name}",
        f"parameters: {p.params.total:,} total, {p.params.trainable:,} trainable "
        f"(LoRA from {p.lora_source}; {len(p.params.modules)} modules: {describe_lora_modules(p.params.modules)})",
        f"model: {p.arch.layers} LM layers (hidden {p.arch.hidden}), {p.arch.clip_layers} CLIP layers, {w.dtype}, "
        f"attention {w.attention}, gradient checkpointing {'on' if w.checkpointing else 'off'}",
        f"tokens: {w.page_tokens} per {'prompt' if p.knob.startswith('generator') else 'page'} "
        f"({w.crops} CLIP crops), {w.query_tokens} per query; {w.rows} rows per forward"
        + (f", gradient cache over {w.batch} rows" if w.batch else ""),
        "predicted (allocated bytes, one process; a step's peak is the persistent terms plus its largest phase):",
    ]
    if late := w.late_interaction:
        trained = projection_parameters(p.arch.hidden, late.dim)
        lines.insert(-1, f"late-interaction head: projection {p.arch.hidden} -> {late.dim} ({trained:,} parameters, "
                         f"trained), {late.query_tokens} tokens per query with the augmentation tokens, "
                         f"{w.page_tokens} vectors per page; MaxSim "
                         f"scores {late.queries} queries x {late.pages} pages"
                         + ("" if late.scores else " (masked terms only: chunked, not counted)"))
    rows = [*p.estimate.terms.items(), *p.estimate.phases.items(), ("peak of a step", p.estimate.peak),
            ("needed on a GPU (+10% fragmentation, +1.5 GiB CUDA context)", p.estimate.required())]
    if p.inference_kv:
        rows.append(("KV cache of one generation at inference (not in the step)", p.inference_kv))
    lines += format_terms(rows)
    lines.append("verdicts:")
    sizes = [(f"{gb} GB", gb * 10**9) for gb in GPU_SIZES_GB] + ([("--gpu-memory", memory)] if memory else [])
    for label, size in sizes:
        verdict = "fits" if fits(p.estimate, size) else "does not fit"
        best = largest_fitting_chunk(p, size)
        lines.append(f"  {label:>12}: {verdict}; largest {p.knob} that fits: {best if best else 'none'}")
    return "\n".join(lines)


def table_row(p: Plan, num_crops: Any) -> str:
    """One markdown row: the experiment's settings, the need at its configured chunk and, per GPU size, the largest
    chunk (or generator batch) that fits (``-``: none)."""
    cells = [p.name, p.work.dtype, "16 (checkpoint's)" if num_crops is None else str(num_crops),
             "on" if p.work.checkpointing else "off",
             f"{p.knob}={p.work.rows}: {describe_bytes(p.estimate.required())}"]
    cells += [str(largest_fitting_chunk(p, gb * 10**9) or "-") for gb in GPU_SIZES_GB]
    return "| " + " | ".join(cells) + " |"


def check(p: Plan, memory: int, cfg: DictConfig) -> None:
    """Raise :class:`PreflightError` naming what to change when ``p`` does not fit ``memory``."""
    if fits(p.estimate, memory):
        return
    raise PreflightError(
        f"preflight: {p.name} is predicted not to fit {memory / 10**9:.0f} GB: it needs "
        f"{describe_bytes(p.estimate.required())} ({p.knob}={p.work.rows}, gradient checkpointing "
        f"{'on' if p.work.checkpointing else 'off'}, {p.work.page_tokens} tokens per page). Change: "
        + "; or ".join(advice(p, memory, cfg))
    )


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
            device: str = "cpu", dtype: str | None = None, input_hooks: bool = False) -> tuple[Plan, Any]:
    """``cfg``'s plan at full width and ``layers`` / ``vision_layers`` deep, as measured (``dtype``, by default fp32
    on CPU and bf16 on CUDA, bf16 under autocast; the retriever's gradient cache over the whole global batch), and
    the reduced model's config and processor (attention as ``model.attn_implementation``). ``input_hooks``: the step
    as it ran before the input-embedding hooks were removed (:attr:`~hkrag.training.memory.Workload.input_hooks`)."""
    config, processor = model_source(cfg, model_config)
    reduce_depth(config, layers, vision_layers, cfg.model.get("attn_implementation"))
    p = plan(cfg, model_config, source=(config, processor))
    dtype = measured_dtype(device, dtype)
    changes: dict[str, Any] = {"dtype": dtype, "device": device, "autocast": dtype != "float32",
                               "input_hooks": input_hooks}
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
    copies (built with the model, before the step) counted with the frozen model as measured. A row marked
    ``input_hooks`` ran with transformers' input-embedding hooks (every checkpointed step before they were removed,
    :attr:`~hkrag.training.memory.Workload.input_hooks`) and is predicted so."""
    p, _ = reduced(cfg, row["layers"], row["vision_layers"], model_config, row.get("device", "cpu"),
                   row.get("dtype"), bool(row.get("input_hooks")))
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


def overrides_first(argv: Sequence[str]) -> list[str]:
    """``argv`` with its Hydra overrides (``key=value`` words not starting with ``-``) moved before the options, so
    that they may follow ``--layers 1 2`` (whose ``nargs="+"`` would otherwise take them as depths)."""
    overrides = [word for word in argv if "=" in word and not word.startswith("-")]
    return overrides + [word for word in argv if word not in overrides]


def main(argv: Sequence[str] | None = None) -> None:
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
    args = parser.parse_args(overrides_first(sys.argv[1:] if argv is None else argv))
    cfg = compose_config(args.overrides, "eval" if args.path == "query" else "train")
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
    if args.measure or args.compare:
        rows = measure(args.overrides, args) if args.measure else read_json(args.compare)
        if args.out:
            write_json(Path(args.out), rows)
        if rows and rows[0].get("path", "train") != "train":
            print(inference_table(rows, args.full_depth))
        else:
            full = extrapolated_depths(rows, args.full_depth, args.full_vision_depth)
            print(measurement_table([predicted_row(cfg, row, args.model_config) for row in
                                     [*rows, *([full] if full else [])]]))
        return
    p = plan(cfg, args.model_config, args.processes)
    memory = args.gpu_memory
    print(table_row(p, cfg.model.get("num_crops")) if args.row else report(p, memory))
    if memory:
        check(p, memory, cfg)


if __name__ == "__main__":
    main()

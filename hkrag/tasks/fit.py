"""Will a training step fit a GPU? The memory model of an experiment from its configuration alone, the verdicts and
the advice (``python -m hkrag.tasks.preflight``; the model itself is :mod:`hkrag.training.memory`).

Composes the experiment's Hydra config as ``train.py`` does, counts its parameters on the ``meta`` device with peft
and its tokens per page with the processor, and predicts one optimizer step; every change it advises is re-planned
and checked against the model before it is printed.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from hkrag.data.collators import RetrieverCollator
from hkrag.io import read_json
from hkrag.models.phi3v import Phi3VConfig, load_processor, tiny_phi3v
from hkrag.models.phi3v.loading import CheckpointNotFoundError
from hkrag.retriever import VDOCRAG_LORA_TARGETS, HeadSettings, LoraSettings, describe_lora_modules
from hkrag.training.memory import (
    CUDA_OVERHEAD,
    FRAGMENTATION,
    GIB,
    GPU_SIZES_GB,
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
    projection_parameters,
)

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


ASSUMED = (f"the {FRAGMENTATION:.0%} fragmentation headroom and {CUDA_OVERHEAD / GIB:.1f} GiB of CUDA context in it "
           "are assumptions, not measured: no GPU row has measured reserved memory yet")
"""Said wherever a GPU verdict is: :data:`~hkrag.training.memory.FRAGMENTATION` and
:data:`~hkrag.training.memory.CUDA_OVERHEAD` decide every verdict near the edge."""
DEEPSPEED = ("under DeepSpeed (conf/accelerate/deepspeed_zero*.yaml, bf16) the model is not checked: its engine casts "
             "the whole module to bf16, LoRA adapters included (no fp32 adapters, gradients or peft fp32 copies), "
             "keeps fp32 master weights and AdamW moments of the adapters in its optimizer, and adds buffers of its "
             "own (ZeRO-2's gradient buckets: reduce_bucket_size in zero2.json); the verdicts are for DDP or one "
             "process")
"""What the model assumes of the launcher (docs/training.md, "Memory: will it fit?")."""


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
            saved = read_json(path)
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
    source: tuple[Phi3VConfig, Any] | None = field(default=None, repr=False)
    """The model's config and processor the plan was made from (:func:`replan` re-plans other settings on them)."""
    processes: int = 1

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
                    "generator_training.optim.batch_size", kv, (config, processor), processes)
    if processes > int(cfg.trainer.global_batch_size):
        raise SystemExit(f"preflight: --processes {processes} is more than trainer.global_batch_size="
                         f"{cfg.trainer.global_batch_size}: each process needs at least one example of the batch")
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
    return Plan(name, arch, params, lora_source, work, extra, combined(arch, params, work, extra), "trainer.chunk_size",
                source=(config, processor), processes=processes)


def with_crops(processor: Any, crops: int) -> Any:
    """A copy of ``processor`` whose HD transform makes at most ``crops`` crops (``model.num_crops``)."""
    copied = copy.copy(processor)
    copied.image_processor = copy.copy(processor.image_processor)
    copied.image_processor.num_crops = crops
    return copied


def replan(p: Plan, cfg: DictConfig, changes: dict[str, Any]) -> Plan:
    """``p``'s experiment (``cfg``) under the configuration ``changes`` (``{"model.num_crops": 4}``), on the same
    model config; the processor follows ``model.num_crops``."""
    changed = copy.deepcopy(cfg)
    for key, value in changes.items():
        OmegaConf.update(changed, key, value)
    if p.source is None:
        raise ValueError("replan needs the plan's model config and processor (Plan.source)")
    config, processor = p.source
    if "model.num_crops" in changes:
        processor = with_crops(processor, int(changes["model.num_crops"]))
    return plan(changed, processes=p.processes, source=(config, processor))


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


CROPS_ADVISED = 4
"""``model.num_crops`` the preflight may advise (fewer page tokens: a speed choice of ours, not VDocRAG's 16)."""


def setting_changes(p: Plan, cfg: DictConfig) -> list[tuple[dict[str, Any], str]]:
    """The configuration changes beyond the chunk and checkpointing that shrink ``p``'s step, with why each is
    offered: fewer crops (a real model above :data:`CROPS_ADVISED`; null is the checkpoint's 16) and bf16 weights (a
    real model in fp32)."""
    if cfg.model.kind == "tiny":
        return []
    changes: list[tuple[dict[str, Any], str]] = []
    crops = cfg.model.get("num_crops")
    if crops is None or int(crops) > CROPS_ADVISED:
        changes.append(({"model.num_crops": CROPS_ADVISED}, "fewer page tokens: a speed choice of ours, not "
                                                            "VDocRAG's 16"))
    if p.work.dtype == "float32":
        changes.append(({"model.dtype": "bfloat16"}, "half the frozen weights' bytes"))
    return changes


def merged(changes: Sequence[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    """The configuration changes of :func:`setting_changes` as one."""
    return {key: value for change, _ in changes for key, value in change.items()}


def as_overrides(change: dict[str, Any]) -> str:
    """``change`` as the command line's overrides (``model.num_crops=4 model.dtype=bfloat16``)."""
    return " ".join(f"{key}={value}" for key, value in change.items())


def chunk_that_fits(p: Plan, memory: int) -> tuple[int, bool] | None:
    """The largest chunk with which ``p`` fits ``memory``, and whether checkpointing must be switched on for it (only
    when it is off and nothing fits without); ``None``: nothing fits."""
    chunk = largest_fitting_chunk(p, memory)
    if chunk is not None:
        return chunk, False
    if not p.work.checkpointing:
        chunk = largest_fitting_chunk(p, memory, checkpointing=True)
        if chunk is not None:
            return chunk, True
    return None


def then(p: Plan, fitting: tuple[int, bool]) -> str:
    """``then <knob> up to N`` for a fitting :func:`chunk_that_fits`, naming checkpointing when it needs it."""
    chunk, checkpointing = fitting
    return ("with model.gradient_checkpointing=true, " if checkpointing else "") + f"then {p.knob} up to {chunk}"


def minimum_need(p: Plan, cfg: DictConfig) -> tuple[int, str]:
    """The least bytes a GPU must hold for ``p``'s experiment as the model sees it, and the settings of that need:
    every change of :func:`setting_changes` together, checkpointing on, one row per forward."""
    changes = merged(setting_changes(p, cfg))
    least = replan(p, cfg, changes) if changes else p
    settings = as_overrides({**changes, "model.gradient_checkpointing": "true", p.knob: 1})
    return least.with_work(rows=1, checkpointing=True).required(), settings


def advice(p: Plan, memory: int, cfg: DictConfig) -> list[str]:
    """What to change for the step to fit ``memory``: the MaxSim phase's own options first when it is what does not
    fit (:func:`maxsim_advice`), a smaller chunk, checkpointing, and each of :func:`setting_changes`, every one
    re-planned and printed only where the model says it fits; when none does, all of them together, and when even
    that does not fit, a larger GPU with the least memory the model says the experiment needs."""
    options = maxsim_advice(p, memory, cfg)
    chunk = largest_fitting_chunk(p, memory)
    if chunk is not None and chunk < p.work.rows:
        options.append(f"{p.knob}={chunk}" + (" (with generator_training.optim.grad_accum raised to keep the batch)"
                                               if p.knob.startswith("generator") else ""))
    if not p.work.checkpointing:
        chunk = largest_fitting_chunk(p, memory, checkpointing=True)
        if chunk is not None:
            options.append(f"model.gradient_checkpointing=true (then {p.knob} up to {chunk})")
    changes = setting_changes(p, cfg)
    for change, why in changes:
        fitting = chunk_that_fits(replan(p, cfg, change), memory)
        if fitting is not None:
            options.append(f"{as_overrides(change)} ({why}; {then(p, fitting)})")
    if options:
        return options
    if len(changes) > 1:
        fitting = chunk_that_fits(replan(p, cfg, merged(changes)), memory)
        if fitting is not None:
            return [f"{as_overrides(merged(changes))} together ({then(p, fitting)})"]
    need, settings = minimum_need(p, cfg)
    return [f"a larger GPU: nothing in this configuration brings the step under {memory / 10**9:.0f} GB; the least "
            f"the model predicts it needs is {need / 10**9:.1f} GB ({describe_bytes(need)}, with {settings})"]


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
            (f"needed on a GPU (+{FRAGMENTATION:.0%} fragmentation, +{CUDA_OVERHEAD / GIB:.1f} GiB CUDA context: "
             "assumed)", p.estimate.required())]
    if p.inference_kv:
        rows.append(("KV cache of one generation at inference (not in the step)", p.inference_kv))
    lines += format_terms(rows)
    lines.append("verdicts:")
    sizes = [(f"{gb} GB", gb * 10**9) for gb in GPU_SIZES_GB] + ([("--gpu-memory", memory)] if memory else [])
    for label, size in sizes:
        verdict = "fits" if fits(p.estimate, size) else "does not fit"
        best = largest_fitting_chunk(p, size)
        lines.append(f"  {label:>12}: {verdict}; largest {p.knob} that fits: {best if best else 'none'}")
    lines += [f"assumed: {ASSUMED}", f"launcher: {DEEPSPEED}"]
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
        f"{'on' if p.work.checkpointing else 'off'}, {p.work.page_tokens} tokens per page; {ASSUMED}). Change: "
        + "; or ".join(advice(p, memory, cfg))
    )


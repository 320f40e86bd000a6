"""Issue 40's model-size ladder: the tiny Phi3V at several sizes, each with its own reader and agents generator
trained by the same recipes, and where HKRAG's agents start to pay, in one resumable command.

    python -m hkrag.tasks.ladder --out outputs/ladder --seeds 0 1 2 --workers 2            # every rung
    python -m hkrag.tasks.ladder --out outputs/ladder --sizes w64-l2 w128-l2-t16 --rerank  # two rungs, + reranker

A size (a rung, :data:`LADDER`) is a named set of overrides of :func:`hkrag.models.phi3v.tiny_phi3v_config`
(``model.config`` in conf/model/tiny.yaml; a ``vision_config`` override is merged on the tiny tower's settings).
Every size is checked before any training (:func:`check_size`: heads dividing the width, whole crops of patches,
the pages drawn whole at their own resolution and the reader's top k of them within the context); an unknown size
name is refused naming the known ones. Per size and seed ``s``, each a ``train.py`` / ``eval.py`` run in
``<out>/runs/<size>-<job>-s<s>`` (a finished run is kept, an interrupted training run continues from its latest
checkpoint, ``--save-every``; :func:`hkrag.tasks.common.run_job`):

1. ``reader``: ``experiment=reader_tiny`` with the size's ``model.config`` (``trainer.seed=s``);
2. ``stage1`` and ``generator``: the shipped agents generator's two stages (docs/training.md "The agents'
   curriculum"): ``experiment=generator_agents_tiny`` on the gold pages and the single-pass prompt from that size's
   reader, then every agent prompt from stage 1 (each example's loss averaged first), the retrieved training pages
   ranked by that size's reader; ``generator_training.optim.seed=s``;
3. ``gold-*`` / ``retrieved-*``: single pass and HKRAG's agents (``generator=single_pass|hkrag``) on the gold pages
   (``task=generation``) and on the reader's top 3 (``task=rag run_dir=<reader>``, pools ``single`` and ``all``),
   both ungrounded (:data:`hkrag.tasks.common.UNGROUNDED`);
4. with ``--rerank``: ``task=retrieval retriever=rerank`` (the reader's top 10 reordered by the generator's P(yes)).

With ``--workers`` the jobs run side by side, each once the jobs it needs have finished (:func:`needs`).

The recipes are held fixed (chosen on validation at the smallest size, docs/training.md); ``--steps-scale`` or
``--reader-steps`` / ``--generator-steps`` shorten them for a smoke run. The report (``ladder.{json,md}``,
``ladder.png``, ``per_query.jsonl``; :func:`summarize`, a function of the per-query rows and the per-step figures):
per size the relaxed accuracy of single pass and agents on gold pages and on the top 3 (the crossed seeds ×
questions interval with several seeds, else the percentile bootstrap over questions; a question's two pools are one
column), the paired agents − single pass difference on the top 3 with its interval, the Pruner's AUROC on the top 3
and the notes-hold-the-code rate (:mod:`hkrag.rag.step_report` on the agents' runs, seeds pooled), the reranker's
nDCG@5, the training minutes and seconds per query; then the smallest size at which the agents reach single pass on
the top 3 (paired difference ≥ 0, issue 40's rule), or per size which steps fall short.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hydra import compose, initialize_config_dir

from hkrag.data.synthetic import SyntheticConfig
from hkrag.io import png_bytes, write_bytes, write_json, write_text
from hkrag.models.phi3v import Phi3VConfig, tiny_phi3v_config
from hkrag.models.phi3v.image_processing_phi3v import hd_padded_size, num_image_tokens
from hkrag.rag.report import REPORT_FILE as RAG_REPORT
from hkrag.rag.step_report import page_truth, query_truth, step_report
from hkrag.rag.trace import MERGED_FILE, load_trace
from hkrag.stats import seed_matrix
from hkrag.tasks.answers import difference, interval
from hkrag.tasks.chain import retrieval_scores
from hkrag.tasks.common import (
    BASE_DIR,
    CONF_DIR,
    FINAL_ADAPTER,
    REPORT_FILE,
    Job,
    check_seeds,
    invocation,
    read_timings,
    record_time,
    run_jobs,
    run_report_command,
)
from hkrag.tasks.table6 import PAGES, query_row, relevant_pages, run_questions

logger = logging.getLogger(__name__)

LADDER: dict[str, dict[str, Any]] = {
    "w64-l2": {},
    "w64-l4": {"num_hidden_layers": 4},
    "w128-l2": {"hidden_size": 128, "intermediate_size": 256},
    "w64-l2-t16": {"vision_config": {"patch_size": 7}},
    "w128-l2-t16": {"hidden_size": 128, "intermediate_size": 256,
                    "vision_config": {"hidden_size": 64, "intermediate_size": 128, "patch_size": 7}},
    "w128-l4-t16": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                    "vision_config": {"hidden_size": 64, "intermediate_size": 128, "patch_size": 7}},
    "w256-l4-t16": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
                    "num_key_value_heads": 8,
                    "vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                      "patch_size": 7}},
}
"""The rungs, cheapest to train first: ``w64-l2`` is the shipped tiny model (width 64, 2 layers, 4 image tokens a
56-px crop); ``w64-l4``, ``w128-l2`` and ``w64-l2-t16`` each change one thing of it (layers, width, image tokens);
``-t16``: 7-px patches, so 16 image tokens a crop (a 4x4 merged grid), with a vision tower of width 64 on the
``w128``/``w256`` rungs."""
READER = "reader_tiny"
GENERATOR = "generator_agents_tiny"
STAGE1 = ("generator_training.pages=[gold]", "generator_training.curriculum.steps=[single_pass]")
"""The agents generator's first stage (the single-pass prompt on gold pages), as the shipped one was trained."""
STAGE2 = ("+generator_training.optim.loss_mean=example",)
GENERATORS = ("single_pass", "hkrag")
RUNS = tuple(f"{pages}-{generator}" for pages in PAGES for generator in GENERATORS)
"""The answer runs of a size: ``<pages>-<generator>`` (:data:`hkrag.tasks.table6.PAGES`)."""
STAGES = ("reader", "stage1", "generator", "runs", "rerank")
TEXT_TOKENS = 512
"""Context kept for a prompt's text (question, instructions, notes, answer) beside its pages' image tokens."""
PRUNER_AUROC = 0.90
NOTES_CODE = 0.80
"""Issue 40's targets: the Pruner's AUROC on the reader's top 3, the notes naming the asked code."""
ANSWER_STEPS = ("answer", "verify", "integrate")
"""The agents' answering steps compared with the single pass on gold pages (:func:`failing_steps`)."""
DEFAULT_MINUTES = 90
"""Issue 40: the smallest size where the agents pay becomes the shipped default if it trains within this (2 cores)."""
DEFAULT_SEEDS = 3
"""...and only on a figure over at least this many seeds (docs/statistics.md, "The ladder's verdict"): a rung run
with fewer is reported as measured, exploratory."""
PER_QUERY = "per_query.jsonl"
NOTHING_TO_REACH = "single pass: no question right on the top 3 (nothing to reach)"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.]*(-[A-Za-z0-9_.]+)*")


class LadderError(ValueError):
    """A ladder size the pages cannot fit, or an unknown one (named, with the value at fault)."""


@dataclass(frozen=True)
class Size:
    """A rung: its name and its :func:`~hkrag.models.phi3v.tiny_phi3v_config` overrides."""

    name: str
    config: Mapping[str, Any] = field(default_factory=dict)

    def model_config(self) -> dict[str, Any]:
        """The overrides with ``vision_config`` completed from the tiny tower (``tiny_phi3v_config`` replaces the
        whole dict, and a partial one would fall back to CLIP ViT-L's settings)."""
        merged = dict(self.config)
        if "vision_config" in merged:
            tower = tiny_phi3v_config().vision_config
            merged["vision_config"] = {**{key: getattr(tower, key) for key in VISION_KEYS}, **merged["vision_config"]}
        return merged

    def overrides(self) -> list[str]:
        """The ``train.py`` overrides that build this size (``++model.config.<key>=<value>``)."""
        return [f"++model.config.{key}={_hydra_value(value)}" for key, value in self.model_config().items()]


VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
               "patch_size", "projection_dim")
"""The tiny vision tower's settings (``tiny_phi3v_config``'s ``vision_config``)."""


def _hydra_value(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{key}:{_hydra_value(item)}" for key, item in value.items()) + "}"
    return json.dumps(value)


def sizes_named(names: Sequence[str], ladder: Mapping[str, Mapping[str, Any]] = LADDER) -> list[Size]:
    """The rungs ``names`` of ``ladder``, in the order given; an unknown name is refused naming the known ones."""
    unknown = [name for name in names if name not in ladder]
    if unknown:
        raise LadderError(f"unknown ladder size(s) {unknown}: the known sizes are {list(ladder)}")
    if len(set(names)) < len(names):
        raise LadderError(f"ladder sizes {list(names)} repeat a size")
    return [Size(name, ladder[name]) for name in names]


def check_size(size: Size, page: tuple[int, int], num_crops: int, pages: int) -> Phi3VConfig:
    """The size's model config, or a :class:`LadderError` naming the size and the value at fault: a key the tiny
    config does not have (:func:`unknown_keys`), heads that do not divide a width (:func:`head_problem`), or crops
    that do not hold the pages (:func:`page_problem`)."""
    if not NAME.fullmatch(size.name):
        raise LadderError(f"ladder size {size.name!r}: a size's name is letters, digits, '_', '.' and single '-' (it "
                          "names run folders)")
    lm, vision = model_settings(size)
    problem = unknown_keys(size) or head_problem(lm, vision) or page_problem(lm, vision, page, num_crops, pages)
    if problem:
        raise LadderError(f"ladder size {size.name!r}: {problem}")
    try:
        return tiny_phi3v_config(**size.model_config())
    except (ValueError, TypeError) as error:
        raise LadderError(f"ladder size {size.name!r}: {error}") from error


def model_settings(size: Size) -> tuple[dict[str, Any], dict[str, Any]]:
    """The language model's widths and context and the vision tower's settings a size builds (the tiny default's
    where it sets none)."""
    default, merged = tiny_phi3v_config(), size.model_config()
    lm = {key: merged.get(key, getattr(default, key)) for key in
          ("hidden_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}
    return lm, merged.get("vision_config") or {key: getattr(default.vision_config, key) for key in VISION_KEYS}


def unknown_keys(size: Size) -> str | None:
    """The keys of a size that ``tiny_phi3v_config`` does not have (a config would keep them silently, unused)."""
    unknown = sorted(set(size.config) - set(tiny_phi3v_config().to_dict()))
    unknown += sorted(f"vision_config.{key}" for key in set(size.config.get("vision_config", {})) - set(VISION_KEYS))
    return (f"unknown model.config key(s) {unknown} (tiny_phi3v_config has e.g. hidden_size, num_hidden_layers, "
            f"num_attention_heads, num_key_value_heads, vision_config.{VISION_KEYS})") if unknown else None


def head_problem(lm: Mapping[str, Any], vision: Mapping[str, Any]) -> str | None:
    """Heads that do not divide their width, rotary heads of odd width, KV heads that do not divide the heads."""
    for where, width, heads in (("", lm["hidden_size"], lm["num_attention_heads"]),
                                ("vision_config.", vision["hidden_size"], vision["num_attention_heads"])):
        if heads < 1 or width % heads:
            return f"{where}hidden_size {width} is not divisible by {where}num_attention_heads {heads}"
    if (lm["hidden_size"] // lm["num_attention_heads"]) % 2:
        return (f"hidden_size {lm['hidden_size']} / num_attention_heads {lm['num_attention_heads']} gives odd heads, "
                "which rotary embeddings cannot rotate")
    if lm["num_key_value_heads"] < 1 or lm["num_attention_heads"] % lm["num_key_value_heads"]:
        return (f"num_key_value_heads {lm['num_key_value_heads']} does not divide num_attention_heads "
                f"{lm['num_attention_heads']}")
    return None


def page_problem(lm: Mapping[str, Any], vision: Mapping[str, Any], page: tuple[int, int], num_crops: int,
                 pages: int) -> str | None:
    """Patches that do not tile a crop in an even grid (no whole image tokens a crop), a ``page`` (width, height)
    drawn at ``num_crops`` crops below its own resolution, or the top ``pages`` of them with :data:`TEXT_TOKENS` of
    text over the context."""
    crop, patch = vision["image_size"], vision["patch_size"]
    if patch < 1 or crop % patch or (crop // patch) % 2:
        return (f"vision_config.patch_size {patch} does not cut a {crop}-px crop into an even number of patches a "
                "side (the 2x2 merge needs it): no whole number of image tokens a crop")
    width, height = page
    padded_h, padded_w = hd_padded_size(width, height, num_crops, crop)
    if min(padded_w / width, padded_h / height) < 1:
        return (f"vision_config.image_size {crop}: {num_crops} crops of {crop} px hold a {width}x{height} page only "
                f"shrunk to {padded_w}x{padded_h}, below its own resolution (the fine print would blur)")
    tokens = num_image_tokens(padded_h, padded_w, crop, crop // patch // 2)
    if pages * tokens + TEXT_TOKENS > lm["max_position_embeddings"]:
        return (f"vision_config.patch_size {patch}: a page is {tokens} image tokens, so the top {pages} with "
                f"{TEXT_TOKENS} of text exceed max_position_embeddings {lm['max_position_embeddings']}")
    return None


def describe(config: Phi3VConfig) -> str:
    """A size in words: width, layers, heads, image tokens a crop, the vision tower's width."""
    return (f"width {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} heads, "
            f"{config.tokens_per_crop} image tokens a {config.crop_size}-px crop, vision width "
            f"{config.vision_config.hidden_size}")


@dataclass
class LadderConfig:
    """What the ladder runs; ``overrides`` go to every ``train.py`` run (data, for a smoke run), ``eval_overrides``
    to every ``eval.py`` run."""

    out: Path
    sizes: Sequence[str] = tuple(LADDER)
    seeds: Sequence[int] = (0,)
    workers: int = 1
    steps_scale: float = 1.0
    reader_steps: int | None = None
    generator_steps: int | None = None
    """Both generator stages' optimizer steps (None: the experiment's, times ``steps_scale``)."""
    rerank: bool = False
    overrides: Sequence[str] = ()
    eval_overrides: Sequence[str] = ()
    command: str = ""
    save_every: int = 500
    """Each training run's checkpoint interval in optimizer steps (0: none): an interrupted run continues from its
    latest checkpoint when the ladder is run again (:func:`hkrag.tasks.common.run_job`)."""

    def __post_init__(self) -> None:
        steps = [s for s in (self.reader_steps, self.generator_steps) if s is not None]
        if (not self.seeds or self.workers < 1 or not self.steps_scale > 0 or any(s < 1 for s in steps)
                or self.save_every < 0):
            raise ValueError(f"the ladder needs seeds, workers >= 1, steps_scale > 0, steps >= 1 and save_every >= 0: "
                             f"got seeds={list(self.seeds)}, workers={self.workers}, steps_scale={self.steps_scale}, "
                             f"reader_steps={self.reader_steps}, generator_steps={self.generator_steps}, "
                             f"save_every={self.save_every}")
        check_seeds(self.seeds, self.overrides)
        sizes_named(self.sizes)
        self.out = Path(self.out)

    def folder(self, size: str, job: str, seed: int) -> Path:
        return self.out / "runs" / f"{size}-{job}-s{seed}"

    def serve(self, size: str, seed: int) -> list[str]:
        """``eval.py`` overrides serving the size's generator of seed ``seed``."""
        generator = self.folder(size, "generator", seed)
        return ["lvlm=phi3v", f"lvlm.base={generator / BASE_DIR}", f"lvlm.adapter={generator / FINAL_ADAPTER}"]


def training_steps(config: LadderConfig) -> dict[str, int]:
    """The reader's and the generator's optimizer steps: explicit, else the experiments' times ``steps_scale``."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        reader = compose("train", [f"experiment={READER}", *config.overrides]).trainer.max_steps
        generator = compose("train", [f"experiment={GENERATOR}", *config.overrides]
                            ).generator_training.optim.max_steps
    return {"reader": config.reader_steps or max(1, round(reader * config.steps_scale)),
            "generator": config.generator_steps or max(1, round(generator * config.steps_scale))}


def check_sizes(config: LadderConfig) -> dict[str, Phi3VConfig]:
    """Every size's model config (:func:`check_size`) against the pages and crops the runs will use (the built-in
    corpus's page size, ``model.num_crops`` and ``rag.top_k`` as composed with the overrides)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        train = compose("train", [f"experiment={READER}", *config.overrides])
        pages = compose("eval", ["task=rag", *config.eval_overrides]).rag.top_k
    if train.data.get("synthetic") is None:
        raise LadderError("the ladder runs on the built-in synthetic corpus (data=synthetic): its page size is what "
                          "every size is checked against")
    synthetic = SyntheticConfig(**train.data.synthetic)
    return {size.name: check_size(size, (synthetic.width, synthetic.height), train.model.num_crops, pages)
            for size in sizes_named(config.sizes)}


def plan(config: LadderConfig, steps: Mapping[str, int]) -> dict[str, list[Job]]:
    """Every job, stage by stage (:data:`STAGES`): each size's reader, its generator's two stages from that reader,
    the answer runs served by that generator, and (``rerank``) the reranked retrieval."""
    jobs: dict[str, list[Job]] = {stage: [] for stage in STAGES}
    every = config.save_every
    reader_steps = [f"trainer.max_steps={steps['reader']}", *([f"trainer.save_every={every}"] if every else [])]
    generator_steps = [f"generator_training.optim.max_steps={steps['generator']}",
                       *([f"generator_training.optim.save_every={every}"] if every else [])]
    for size in sizes_named(config.sizes):
        for seed in config.seeds:
            reader, stage1 = config.folder(size.name, "reader", seed), config.folder(size.name, "stage1", seed)
            generator = [f"experiment={GENERATOR}", f"generator_training.retriever.run_dir={reader}",
                         f"generator_training.optim.seed={seed}", *config.overrides, *generator_steps]
            jobs["reader"].append((reader, [f"experiment={READER}", f"trainer.seed={seed}", *size.overrides(),
                                            *config.overrides, *reader_steps], "train", REPORT_FILE))
            jobs["stage1"].append((stage1, [*generator, f"generator_training.init_from={reader}", *STAGE1], "train",
                                   REPORT_FILE))
            jobs["generator"].append((config.folder(size.name, "generator", seed),
                                      [*generator, f"generator_training.init_from={stage1}", *STAGE2], "train",
                                      REPORT_FILE))
            serve = config.serve(size.name, seed)
            for pages, task in PAGES.items():
                retriever = [f"run_dir={reader}"] if pages == "retrieved" else []
                jobs["runs"] += [(config.folder(size.name, f"{pages}-{g}", seed),
                                  [*task, f"generator={g}", *retriever, *serve, *config.eval_overrides], "eval",
                                  RAG_REPORT) for g in GENERATORS]
            if config.rerank:
                jobs["rerank"].append((config.folder(size.name, "rerank", seed),
                                       ["task=retrieval", "retriever=rerank", f"run_dir={reader}", *serve,
                                        *config.eval_overrides], "eval", "retrieval.json"))
    return jobs


def needs(config: LadderConfig) -> dict[Path, list[Path]]:
    """What each job needs finished first: a size-seed's stage 1 its reader, its generator stage 1, its answer runs
    and reranked retrieval that generator and reader. Nothing else waits, so with several workers one chain's next
    job starts while another's reader still trains (:func:`hkrag.tasks.common.run_jobs`)."""
    found = {}
    for size in config.sizes:
        for seed in config.seeds:
            reader, stage1, generator = (config.folder(size, job, seed) for job in ("reader", "stage1", "generator"))
            found[stage1], found[generator] = [reader], [stage1]
            for job in [*RUNS, *(["rerank"] if config.rerank else [])]:
                found[config.folder(size, job, seed)] = [generator, reader]
    return found


def run_ladder(config: LadderConfig) -> dict[str, Any]:
    """Check every size, run (or resume) every job, each once the jobs it needs have finished (:func:`needs`), then
    write the report; returns its JSON."""
    models = check_sizes(config)
    steps = training_steps(config)
    timings = read_timings(config.out)
    jobs = [job for stage in plan(config, steps).values() for job in stage]
    for name, seconds in run_jobs(jobs, config.workers, "ladder", needs(config)):
        record_time(timings, config.out, name, seconds)
    return write_report(config, models, steps, timings)


def finished_seeds(config: LadderConfig, size: str) -> list[int]:
    """The seeds of ``size`` whose answer runs (and, with ``rerank``, reranked retrieval) are all finished in
    ``config.out``: the seeds just run and any an earlier sitting finished, so a rung with more seeds keeps them when
    another rung is run with fewer."""
    pattern = re.compile(re.escape(f"{size}-{RUNS[0]}-s") + r"(\d+)")
    found = {int(match.group(1)) for folder in (config.out / "runs").glob(f"{size}-{RUNS[0]}-s*")
             if (match := pattern.fullmatch(folder.name))}
    done = [(run, RAG_REPORT) for run in RUNS] + ([("rerank", "retrieval.json")] if config.rerank else [])
    return sorted(seed for seed in found | set(config.seeds)
                  if all((config.folder(size, job, seed) / marker).is_file() for job, marker in done))


def query_rows(config: LadderConfig, seeds: Mapping[str, Sequence[int]]) -> list[dict[str, Any]]:
    """Every answered query of every size's runs of its ``seeds`` (:func:`hkrag.tasks.table6.query_row` with its
    ``size``)."""
    rows = []
    for size in config.sizes:
        for run in RUNS:
            pages, generator = run.split("-", 1)
            for seed in seeds[size]:
                folder = config.folder(size, run, seed)
                qrels = relevant_pages(folder)
                rows += [{"size": size, **query_row(o, pages, generator, seed, qrels.get((o.dataset, o.query_id), ()))}
                         for o in load_trace(folder / MERGED_FILE)]
    return rows


def pooled_step_report(runs: Sequence[Path]) -> dict[str, Any]:
    """The per-step report (:func:`hkrag.rag.step_report.step_report`) of ``runs`` (one configuration's seeds)
    pooled, with the pages' drawn items and the questions' evidence labels."""
    identity, questions = run_questions(runs[0])
    examples = [example for found in questions.values() for example in found]
    items = page_truth(identity["data"]["root"], identity["rag"]["split"])
    return step_report([outcome for run in runs for outcome in load_trace(run / MERGED_FILE)],
                       {ex.query_id: query_truth(ex) for ex in examples}, items,
                       evidence={ex.query_id: ex.evidence for ex in examples})


def step_figures(config: LadderConfig, size: str, seeds: Sequence[int]) -> dict[str, Any]:
    """A size's per-step figures from the agents' runs, seeds pooled: the Pruner's AUROC on the top 3 (all calls
    and the ``all`` pool), the notes naming the relevant page's code (gold and top 3 together) and each answering
    step's relaxed accuracy on gold pages."""
    reports = {pages: pooled_step_report([config.folder(size, f"{pages}-hkrag", seed) for seed in seeds])
               for pages in PAGES}
    scores = reports["retrieved"]["pruner"]["p_yes"]
    notes = [report["notes"]["fine_print code"] for report in reports.values()]
    hits, n = sum(share["hits"] for share in notes), sum(share["n"] for share in notes)
    return {"pruner_auroc": scores["auroc"], "pruner_auroc_all_pool": scores["by_pool"].get("all"),
            "pruner_yes": reports["retrieved"]["pruner"]["recall_yes"],
            "notes_code": {"hits": hits, "n": n, "rate": hits / n if n else None},
            "gold_steps": {step: reports["gold"]["answers"][step]["rate"] for step in ANSWER_STEPS}}


def rerank_figures(config: LadderConfig, size: str, seeds: Sequence[int]) -> dict[str, Any] | None:
    """nDCG@5 of the reranked top 10 and of the reader alone (its evaluation after training, when it made one) on
    ``synfine`` in the ``all`` pool and averaged over the data sets of the ``all`` pool, means over seeds."""
    if not config.rerank:
        return None
    found: dict[str, Any] = {}
    for name, job in (("reranked", "rerank"), ("reader", "reader")):
        try:
            found[name] = ndcg_means([retrieval_scores(config.folder(size, job, seed)) for seed in seeds])
        except FileNotFoundError:
            found[name] = None
    return found


def ndcg_means(scores: Sequence[Mapping[str, Mapping[str, Mapping[str, float]]]]) -> dict[str, float | None]:
    """Means over seeds of ``{dataset: {pool: {query: ndcg@5}}}`` (one per seed): ``synfine`` in the ``all`` pool,
    and the mean over the data sets of the ``all`` pool."""
    all_pool = [float(np.mean([np.mean(list(d["all"].values())) for d in s.values() if "all" in d])) for s in scores]
    fine = [float(np.mean(list(s["synfine"]["all"].values()))) for s in scores if "all" in s.get("synfine", {})]
    return {"synfine_all": float(np.mean(fine)) if fine else None, "all_pool": float(np.mean(all_pool))}


def training_minutes(timings: Mapping[str, float], config: LadderConfig, size: str, seeds: Sequence[int]
                     ) -> list[float] | None:
    """Each seed's training time of one generator (reader, stage 1, stage 2), in minutes; None when a run's time is
    missing. Seeds trained side by side (``--workers``) shared the cores, so each took longer than alone."""
    parts = [[timings.get(config.folder(size, job, seed).name) for job in ("reader", "stage1", "generator")]
             for seed in seeds]
    if any(value is None for seed in parts for value in seed):
        return None
    return [sum(seed) / 60 for seed in parts]


def run_matrix(rows: Sequence[Mapping[str, Any]], size: str, pages: str, generator: str,
               value: str = "score") -> tuple[np.ndarray, list[tuple[str, str]]]:
    """``(seeds, rows)`` of one size's run and each column's question ``(data set, query id)``; every seed must
    have answered the same rows."""
    by_seed: dict[int, dict[tuple[str, str, str], float]] = {}
    for row in rows:
        if (row["size"], row["pages"], row["generator"]) == (size, pages, generator):
            by_seed.setdefault(row["seed"], {})[row["dataset"], row["pool"], row["query_id"]] = float(row[value])
    if not by_seed:
        raise ValueError(f"no rows of size {size!r}, pages {pages!r}, generator {generator!r}")
    try:
        _, keys, matrix = seed_matrix(by_seed)
    except ValueError as error:
        raise ValueError(f"size {size!r}, {pages}-{generator}: the seeds answered different queries "
                         f"({error})") from None
    return matrix, [(d, q) for d, _, q in keys]


def size_row(rows: Sequence[Mapping[str, Any]], size: str) -> dict[str, Any]:
    """One size's accuracies, paired difference on the top 3 and seconds per query, from its per-query rows."""
    accuracy, seconds = {}, {}
    for run in RUNS:
        pages, generator = run.split("-", 1)
        matrix, questions = run_matrix(rows, size, pages, generator)
        accuracy[run] = {**interval(matrix, questions), "rows": matrix.shape[1], "seeds": matrix.shape[0]}
        seconds[run] = float(run_matrix(rows, size, pages, generator, "seconds")[0].mean())
    agents, questions = run_matrix(rows, size, "retrieved", "hkrag")
    single = run_matrix(rows, size, "retrieved", "single_pass")[0]
    return {"accuracy": accuracy, "agents_minus_single_pass": difference(agents, single, questions),
            "seconds_per_query": seconds}


def failing_steps(row: Mapping[str, Any]) -> list[str]:
    """The steps of a size that fall short: the Pruner's AUROC (top 3) and the notes below issue 40's targets, an
    answering step below the single pass on gold pages."""
    steps = row.get("steps") or {}
    found = []
    scores = steps.get("pruner_auroc_all_pool") or steps.get("pruner_auroc") or {}
    auroc = scores.get("auroc")
    if auroc is None:
        found.append(f"Pruner: no AUROC on the top 3 ({scores.get('n', 0)} calls with a P(yes), "
                     f"{scores.get('positives', 0)} of them \"yes\" labels: both labels are needed)")
    elif auroc < PRUNER_AUROC:
        found.append(f"Pruner: AUROC {auroc:.3f} < {PRUNER_AUROC:.2f} on the top 3 (all pool)")
    notes = (steps.get("notes_code") or {}).get("rate")
    if notes is None:
        found.append("Decoupler: no notes call on a relevant page (its notes unmeasured)")
    elif notes < NOTES_CODE:
        found.append(f"Decoupler: notes name the code {100 * notes:.1f} % < {100 * NOTES_CODE:.0f} %")
    single = row["accuracy"]["gold-single_pass"]["mean"]
    for step, rate in (steps.get("gold_steps") or {}).items():
        if rate is not None and rate < single:
            found.append(f"{step}: {100 * rate:.1f} % < single pass {100 * single:.1f} % on gold pages")
    return found


def summarize(rows: Sequence[Mapping[str, Any]], sizes: Sequence[str], extras: Mapping[str, Mapping[str, Any]]
              ) -> dict[str, Any]:
    """The ladder from the per-query rows (:func:`size_row`) and each size's other figures (``extras``: ``steps``,
    ``rerank``, ``training_minutes``, ``model``), with issue 40's verdict: the smallest size whose agents reach the
    single pass on the reader's top 3 (paired difference ≥ 0), whether it trains within :data:`DEFAULT_MINUTES`,
    and for every size the steps that fall short (:func:`failing_steps`; :data:`NOTHING_TO_REACH` first where the
    single pass reads nothing on the top 3)."""
    table = {size: {**size_row(rows, size), **extras.get(size, {})} for size in sizes}
    for row in table.values():
        reads = row["accuracy"]["retrieved-single_pass"]["mean"] > 0
        row["agents_reach_single_pass"] = reads and row["agents_minus_single_pass"]["diff"] >= 0
        row["failing_steps"] = ([] if reads else [NOTHING_TO_REACH]) + failing_steps(row)
    reached = next((size for size in sizes if table[size]["agents_reach_single_pass"]), None)
    minutes = table[reached].get("training_minutes") if reached else None
    seeds = table[reached]["accuracy"]["retrieved-hkrag"]["seeds"] if reached else None
    return {"sizes": table, "smallest_paying_size": reached,
            "trains_within_default_budget": None if minutes is None else minutes <= DEFAULT_MINUTES,
            "enough_seeds_for_default": None if seeds is None else seeds >= DEFAULT_SEEDS,
            "rule": "the agents reach the single pass on the reader's top 3 when their paired difference (agents − "
                    "single pass, same seeds and rows) is ≥ 0, its 95 % interval reported beside it, and the single "
                    "pass answers some question right (where neither reads, there is nothing to reach)"}


def write_report(config: LadderConfig, models: Mapping[str, Phi3VConfig], steps: Mapping[str, int],
                 timings: Mapping[str, float]) -> dict[str, Any]:
    """``ladder.{json,md}``, ``ladder.png`` and ``per_query.jsonl`` in ``config.out`` from the finished runs, each
    size with its :func:`finished_seeds`."""
    seeds = {size: finished_seeds(config, size) for size in config.sizes}
    rows = query_rows(config, seeds)
    extras = {size: {"model": describe(models[size]), "config": sizes_named([size])[0].model_config(),
                     "seeds": seeds[size], "steps": step_figures(config, size, seeds[size]),
                     "rerank": rerank_figures(config, size, seeds[size]),
                     **_minutes(training_minutes(timings, config, size, seeds[size]))}
              for size in config.sizes}
    summary = summarize(rows, config.sizes, extras)
    settings = {"command": config.command, "sizes": list(config.sizes), "seeds": list(config.seeds),
                "training_steps": dict(steps), "reader": READER, "generator": GENERATOR, "stage1": list(STAGE1),
                "stage2": list(STAGE2), "overrides": list(config.overrides),
                "eval_overrides": list(config.eval_overrides), "rerank": config.rerank,
                "save_every": config.save_every}
    report = {"settings": settings, "timings": dict(timings), **summary}
    write_text(config.out / PER_QUERY, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    write_json(config.out / "ladder.json", report)
    write_text(config.out / "ladder.md", markdown(report))
    write_bytes(config.out / "ladder.png", plot(report))
    return report


def _minutes(by_seed: Sequence[float] | None) -> dict[str, Any]:
    """A size's ``training_minutes`` (mean over seeds) and ``training_minutes_by_seed``."""
    return {"training_minutes": None if by_seed is None else float(np.mean(by_seed)),
            "training_minutes_by_seed": None if by_seed is None else list(by_seed)}


def _cell(found: Mapping[str, Any] | None, key: str = "mean") -> str:
    if not found or found.get(key) is None:
        return "—"
    return f"{100 * found[key]:.1f} [{100 * found['low']:.1f}, {100 * found['high']:.1f}]"


def _seeds(row: Mapping[str, Any]) -> str:
    found = row.get("seeds")
    return ", ".join(map(str, found)) if found is not None else str(row["accuracy"][RUNS[0]]["seeds"])


def _number(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "—" if value is None else f"{scale * value:.{digits}f}"


def _training_cell(row: Mapping[str, Any]) -> str:
    by_seed = row.get("training_minutes_by_seed") or []
    each = f" ({' / '.join(_number(value) for value in by_seed)})" if len(by_seed) > 1 else ""
    return _number(row.get("training_minutes")) + each


COLUMNS = ("single pass, gold", "agents, gold", "single pass, top 3", "agents, top 3", "agents − single pass, top 3",
           "Pruner AUROC, top 3 (all pool)", "notes name the code", "nDCG@5 reranked (reader alone), synfine, all",
           "training min", "s / query, top 3 (single pass / agents)")
"""The figures of a rung's row in the ladder's table, after its name, model and seeds (:func:`table_row`)."""


def table_head(first: Sequence[str] = ("size", "model", "seeds")) -> list[str]:
    """The Markdown table's header and rule lines: ``first`` columns, then :data:`COLUMNS`."""
    names = [*first, *COLUMNS]
    return ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]


def table_row(name: str, row: Mapping[str, Any], first: Sequence[str] = ()) -> str:
    """One rung's Markdown row: its name, ``first`` extra cells, model and seeds, then :data:`COLUMNS`."""
    accuracy, steps, rerank = row["accuracy"], row.get("steps") or {}, row.get("rerank") or {}
    auroc = steps.get("pruner_auroc_all_pool") or steps.get("pruner_auroc") or {}
    notes = steps.get("notes_code") or {}
    seconds = row["seconds_per_query"]
    cells = [name, *first, row.get("model", ""), _seeds(row), *(_cell(accuracy[run]) for run in RUNS),
             _cell(row["agents_minus_single_pass"], "diff"),
             f"{auroc['auroc']:.3f} [{auroc['low']:.3f}, {auroc['high']:.3f}]" if auroc.get("auroc") is not None
             else "—",
             f"{_number(notes.get('rate'), 100)} ({notes.get('hits', 0)}/{notes.get('n', 0)})",
             f"{_number((rerank.get('reranked') or {}).get('synfine_all'), 100)} "
             f"({_number((rerank.get('reader') or {}).get('synfine_all'), 100)})",
             _training_cell(row), f"{seconds['retrieved-single_pass']:.3f} / {seconds['retrieved-hkrag']:.3f}"]
    return "| " + " | ".join(cells) + " |"


def markdown(report: Mapping[str, Any]) -> str:
    """The ladder as Markdown: one row per size, then the verdict and each size's failing steps."""
    settings = report["settings"]
    lines = ["# The model-size ladder: where HKRAG's agents start to pay\n",
             f"`{settings['command'] or 'python -m hkrag.tasks.ladder'}`: per size `experiment={settings['reader']}` "
             f"({settings['training_steps']['reader']} steps), then `experiment={settings['generator']}` in two "
             f"stages from that reader ({settings['training_steps']['generator']} steps each); each size with "
             f"every seed finished in the folder (this invocation ran seeds {settings['seeds']}). Relaxed accuracy "
             f"×100 [95 %] on the test split (gold pages; the reader's top 3 in pools single and all, a question's "
             f"pools one column): with several seeds the crossed seeds × questions interval, with one the "
             f"percentile bootstrap over questions; per-query rows in `{PER_QUERY}`. Training minutes: the reader "
             f"and both stages, the mean over seeds and, with several, each seed's (seeds trained side by side "
             f"shared the cores; each run's seconds are in `ladder.json`'s timings).\n",
             *table_head()]
    lines += [table_row(size, row) for size, row in report["sizes"].items()]
    reached = report["smallest_paying_size"]
    lines += ["", f"**Rule.** {report['rule']}.\n"]
    if reached:
        budget = {True: f"trains within {DEFAULT_MINUTES} min", False: f"trains in more than {DEFAULT_MINUTES} min",
                  None: "training time not recorded"}[report["trains_within_default_budget"]]
        seeds = ("" if report.get("enough_seeds_for_default") is not False else
                 f"; fewer than {DEFAULT_SEEDS} seeds: exploratory, the shipped default changes only on a figure over "
                 f"{DEFAULT_SEEDS} or more")
        lines.append(f"**The smallest size at which the agents reach the single pass on the top 3: `{reached}`** "
                     f"({budget}{seeds}).\n")
    else:
        lines.append("**No size's agents reach the single pass on the top 3.**\n")
    lines += ["## The steps that fall short, per size\n"]
    for size, row in report["sizes"].items():
        lines.append(f"- `{size}`: " + ("; ".join(row["failing_steps"]) or "none"))
    return "\n".join(lines) + "\n"


def plot(report: Mapping[str, Any]) -> bytes:
    """PNG: relaxed accuracy against size, agents and single pass, on gold pages and on the top 3, with intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(report["sizes"])
    figure, axis = plt.subplots(figsize=(max(4.5, 1.4 * len(sizes)), 3.4))
    x = np.arange(len(sizes))
    for run in RUNS:
        pages, generator = run.split("-", 1)
        found = [report["sizes"][size]["accuracy"][run] for size in sizes]
        mean = np.array([100 * f["mean"] for f in found])
        spread = np.array([[100 * (f["mean"] - f["low"]) for f in found],
                           [100 * (f["high"] - f["mean"]) for f in found]])
        axis.errorbar(x, mean, yerr=spread, marker="o" if generator == "hkrag" else "s", capsize=3,
                      linestyle="-" if pages == "gold" else "--",
                      label=f"{'agents' if generator == 'hkrag' else 'single pass'}, "
                            f"{'gold' if pages == 'gold' else 'top 3'}")
    axis.set(xticks=x, xlabel="size", ylabel="relaxed accuracy ×100 [95 %]", ylim=(-2, 102),
             title="HKRAG's agents and the single pass by model size")
    axis.set_xticklabels(sizes, fontsize=8)
    axis.legend(fontsize=7)
    figure.tight_layout()
    return png_bytes(figure, dpi=110)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Resumable: a rerun skips every finished run and continues an interrupted "
                                            "training run from its latest checkpoint.")
    parser.add_argument("--out", type=Path, required=True, help="folder of the runs and reports (resumed if present)")
    parser.add_argument("--sizes", nargs="+", default=list(LADDER), metavar="SIZE",
                        help=f"rungs by name, smallest first (default: all: {' '.join(LADDER)})")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (default: 0)")
    parser.add_argument("--workers", type=int, default=1, help="jobs side by side, one process each (default: 1)")
    parser.add_argument("--steps-scale", type=float, default=1.0,
                        help="multiply the recipes' optimizer steps (a smoke run: e.g. 0.001; default: 1)")
    parser.add_argument("--reader-steps", type=int, help="the reader's optimizer steps (overrides --steps-scale)")
    parser.add_argument("--generator-steps", type=int,
                        help="each generator stage's optimizer steps (overrides --steps-scale)")
    parser.add_argument("--rerank", action="store_true",
                        help="also the reranker: the reader's top 10 reordered by the Pruner's P(yes) (costly: 10 "
                        "LVLM calls a query)")
    parser.add_argument("--save-every", type=int, default=500, metavar="STEPS",
                        help="each training run's checkpoint interval (0: none); an interrupted run continues from "
                        "its latest checkpoint when the command is run again (default: 500)")
    parser.add_argument("--eval", action="append", default=[], dest="eval_overrides", metavar="OVERRIDE",
                        help="an eval.py override for every evaluation (repeat), e.g. --eval rag.max_queries=10")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every training run (e.g. data)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = invocation("hkrag.tasks.ladder", argv).strip()
    return run_report_command(  # bad arguments or an unknown size: a usage error, not a traceback
        parser, lambda: LadderConfig(args.out, args.sizes, args.seeds, args.workers, args.steps_scale,
                                     args.reader_steps, args.generator_steps, args.rerank, args.overrides,
                                     args.eval_overrides, command, args.save_every),
        run_ladder, LadderError, lambda config: config.out / "ladder.md")


if __name__ == "__main__":
    main()

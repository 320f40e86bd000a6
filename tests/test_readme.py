"""The README runs: every command in the shell blocks of README.md and docs/**/*.md parses, runs at tiny scale where it
can offline, and `python train.py` (the quick start) runs verbatim and lands in the README's demo table.

The commands are read from the documents at collection time (tests/readme_commands.py), so a new one is tested
without editing this file; one that cannot run here must be listed in OFFLINE (or EXTERNAL) with the reason, one too
long for the default suite in SLOW (`python -m pytest -m slow tests/test_readme.py` runs those, and the commands of
docs/**/*.md, which the default suite only parses; bench/RESULTS.md's are parsed, never run). Runs happen in a
temporary working directory (symlinks to train.py, eval.py, conf/), never in the repository's data/ or outputs/: the
demo's run serves `run_dir=latest` and `outputs/train/<stamp>`; commands reading `data/synthetic/corpus` directly
(OCR, degradation, PDFs) run in a second directory with a small corpus. Shrinking overrides are appended unless the
command sets the key itself. Slow commands that read an earlier command's output (the sweeps, the mining steps) run
in document order. With HKRAG_README_WORKSPACE set, the two working directories live there and are kept between
pytest runs, so the slow commands can run in batches (in document order: a later batch reads an earlier one's
output, and the demo runs once).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hkrag.tasks.training import DEMO_COLUMNS, DEMO_ROWS, demo_figures

sys.path.insert(0, str(Path(__file__).parent))
import readme_commands as rc  # noqa: E402

ROOT = rc.ROOT
COMMANDS = rc.commands()
DEMO = "python train.py"
"""The quick start's main job; it runs exactly as written."""
LINKED = ("train.py", "eval.py", "conf", "scripts", "bench", "constraints.txt", "pyproject.toml")
"""What a working directory needs from the repository (weights come through HKRAG_WEIGHTS_DIR, and a
``run_dir=weights/...`` from the repository: hkrag.tasks.common.resolve_run_dir)."""
TIMEOUT_S = 900
DEMO_TABLE_HEADER = "| queries | before (the shipped reader), single"

EXTERNAL: tuple[tuple[str, str], ...] = (
    (r"^vllm ", "vLLM's server (GPU, hub weights), not installed here"),
    (r"-m sglang\.", "SGLang's server (GPU, hub weights), not installed here"),
    (r"^(mkdir|git) ", "set-up of the one-off comparison with the original remote code (docs/phi3v_fidelity.md)"),
)
"""Commands of programs outside this project: neither parsed nor run (regex on the command, reason)."""

OFFLINE: tuple[tuple[str, str], ...] = (
    (r"pieces restore docs/ladder/l4t16/pieces",
     "the w128-l4-t16 rung's pieces, removed from the tree once it finished (commit 469a6fc holds them)"),
    (r"(^|/)pip install", "installs packages over the network (checked: requirements, extras, constraints file)"),
    (r"-m pytest|^python tests/", "the test suite itself, which CI runs (.ci/run; checked: markers and paths)"),
    (r"data=opendocvqa|opendocvqa_corpus", "OpenDocVQA from the Hugging Face hub (network)"),
    (r"experiment=(hkrag_retriever|ablation_|pretrain_vdocrag|generator_vdocrag)",
     "paper scale: the 4.2B Phi-3-vision from the hub, a GPU"),
    (r"^accelerate launch", "several GPUs (DDP / DeepSpeed) and, here, paper-scale models"),
    (r"lvlm=openai|judge=openai", "an OpenAI-compatible endpoint (tests/test_lvlm_http.py covers the client)"),
    (r"task=mteb(?!.*benchmark=local)", "MTEB's ViDoRe / VisRAG benchmarks from the hub (network)"),
    (r"hkrag\.lvlm\.serve", "a server that runs until stopped (tests/test_lvlm_http.py serves one over loopback)"),
    (r"compare_phi3v_reference|/tmp/refenv|-m venv",
     "the one-off comparison with the original remote code: a second venv (transformers 4.45.2) and a mirror"),
    (r" \.\.\. resume=latest", "`...` stands for the interrupted run's own overrides (tests/test_training.py "
     "resumes exactly)"),
    (r"data/synthetic_regions|units_det(cf|ship|f0)?_|region_ocr_det|<stitched corpus>|<region corpus"
     r"|--regions data/deg|data/deg\w*/(units|region_ocr)",
     "crops of a trained detector's boxes (and their OCR, stitched; clean or degraded pages): the test's 2-step "
     "detector selects none, which build refuses by design (tests/test_regions.py builds from detected and gold "
     "boxes)"),
    (r"region_pairs|reader_regions|region_train|runs/(rr|test_gold|(test_)?rdet(2k|cf|ship)[\w-]*)_s",
     "the region reader's training set holds out whole documents for validation: the small corpus's one document a "
     "style leaves a style without one, which region_pairs refuses by design (tests/test_region_pairs.py builds one; "
     "the reader's runs and evaluations follow from it)"),
    (r"runs/(index|corpus)", "a user's own index and embeddings under runs/ (tests/test_index_tuning.py, "
     "tests/test_retrieval_budget.py run the same code)"),
    (r"^python eval\.py( task=(rag|retrieval))?( model\.head=\w+)?$", "no run_dir: the default retriever is the "
     "paper's Phi-3-vision from the hub (network)"),
    (r"agent_steps <run>", "`<run>` is a generator training run (experiment=generator_agents_tiny), which the demo's "
     "run is not (tests/test_curriculum.py runs agent_steps on one)"),
    (r"--size full", "a full-size Phi-3-vision training step (4.2B parameters, tens of GB of memory)"),
    (r"--out weights/", "ships over the repository's own weights (tests/test_shipped.py checks them and ships a "
     "run elsewhere)"),
    (r"outputs/ladder(_r6000)?/runs/w128-l2-|outputs/budget/w128-l2-r6000-|outputs/pruner_stage_w128/",
     "serves or trains from the `w128-l2` rung's runs (or reads a stage trained from them): the ladder's commands "
     "run here shrunk to `--sizes w64-l2`, so none trains it (tests/test_shipped.py serves the shipped one, "
     "tests/test_answers.py compares answer runs)"),
    (r"outputs/pruner_stage/long_w64", "a balanced Pruner stage on the ladder's reader, which runs here shrunk to 2 "
     "steps: it ranks no relevant page first for the few training questions kept, so the stage has no 'yes' label to "
     "balance and is refused by design (docs/errors.md; the same stage on the shipped reader, pruner_stage/v1, runs "
     "here, and tests/test_curriculum.py balances one)"),
    (r"reader_on_pruner_calls .*--calls docs/", "pairs the committed Pruner calls of a full stage's 108 validation "
     "questions with that stage's run, which runs here shrunk to a few other questions (refused: no reader scores "
     "for them); tests/test_curriculum.py runs the command end to end on a tiny run's own calls"),
    (r"shared/reference|bench/memory_recorded",
     "Phi-3-vision's config.json from ../shared/reference/phi3v, outside the repository"),
    (r"bench/(demo_range|reader|late_interaction|li_validation|reading|search)\.py",
     "a measurement made of full-size runs with no flag to shrink them (demo_range: 15 demo runs; reader, "
     "late_interaction, li_validation: three seeds of 300-3,000 steps; reading: 8,000 steps; search: 10^6 vectors); "
     "its figures are bench/RESULTS.md's"),
    (r"=\w*\*", "a pattern naming several configs (each checked to exist), not one command"),
)
"""Commands that cannot run offline here: their parse is checked, their run skipped with the reason."""

REFUSED: tuple[tuple[str, str], ...] = (
    (r"--seeds 0 0 1", "seeds [0, 0, 1] repeat [0]"),
    (r"preflight --processes 0", "expected an integer >= 1"),
)
"""Commands a document shows being refused (docs/errors.md): the parse check or the run must fail with the
message (regex on the command, the message)."""

SLOW: tuple[tuple[str, str], ...] = (
    (r"^python train\.py -m ", "a sweep of 12 demo runs (about 10 min; tiny: 12 short runs)"),
    (r"multirun/train/<stamp>", "reads the sweep's output"),
    (r"hkrag\.tasks\.(replica|chain|table6|ladder)\b", "runs of runs (minutes even with their tiny flags)"),
    (r"^python eval\.py -m ", "a sweep over the Judger threshold"),
    (r"multirun/eval/<stamp>", "reads the sweep's output"),
    (r"degrade=|task=degradation", "re-OCRs every degraded page"),
    (r"text_column=ocr_text", "needs the OCR'd corpus: runs after the OCR command"),
    (r"eval\.split=train|hkrag\.index\.mine|negatives_file=", "hard-negative mining: encodes the training corpus"),
)
"""Commands too long for the default suite (they run under ``-m slow``), with the reason. Every command of
docs/**/*.md also runs under ``-m slow`` only (the default suite parses them and runs the README's)."""

TINY_FLAGS: tuple[tuple[str, str], ...] = (
    (r"hkrag\.tasks\.replica", "--quick --steps 2 --eval-every 2 --generator-steps 2 --eval rag.max_queries=2"),
    (r"hkrag\.tasks\.chain", "--seeds 0 --generator-steps 2 --curve-every 0 --eval rag.max_queries=2"),
    (r"hkrag\.tasks\.chain.*--pretrain-steps", "--pretrain-steps 2"),
    (r"hkrag\.tasks\.table6", "--seeds 0 --generator-steps 2 --eval rag.max_queries=2 --eval rag.pools=[single]"),
    (r"hkrag\.tasks\.ladder\b", "--sizes w64-l2 --seeds 0 --reader-steps 2 --generator-steps 2 "
                                 "--eval rag.max_queries=2 --eval rag.pools=[single]"),
    (r"hkrag\.data\.layout train", "--steps 2"),
    (r"bench/lvlm\.py", "--questions 1 --repeats 1 --new-tokens 2"),
    (r"bench/agents\.py", "--queries 1 --repeats 1"),
    (r"bench/grounding\.py", "--validation-questions 2"),
)
"""Modules' own flags that shrink them (every matching row; they follow the command's own flags, so they win; for
the runs-of-runs modules (:data:`RUNS_OF_RUNS`) the train.py shrink overrides follow the command's overrides)."""
RUNS_OF_RUNS = r"hkrag\.tasks\.(replica|chain|table6|ladder)\b"
"""The modules that start train.py runs and take its overrides (:data:`RUNS_SHRINK`)."""

SMALL_DATA = ("data.synthetic.n_train=40", "data.synthetic.n_test=12", "data.synthetic.train_groups_per_style=2",
              "data.synthetic.test_groups_per_style=1", "paths.data_dir=small-data")
TRAIN_SHRINK = ("trainer.max_steps=2", "trainer.global_batch_size=8", "trainer.save_every=null",
                "trainer.eval_every=0", "model.num_crops=4", "eval.doc_batch_size=16",
                "data.eval_datasets=[synchart,synfine]", *SMALL_DATA, "generator_training.optim.max_steps=2",
                "generator_training.optim.batch_size=2", "generator_training.max_queries=8",
                "generator_training.validation.fraction=0.5")
"""train.py overrides that shrink a run to seconds (only keys the composed config has and the command leaves). A
generator run that holds out validation groups holds out half: a tenth of the 8 queries' two groups is none, and
`agent_steps` then has no validation query to evaluate."""
FORCED = ("trainer.max_steps=2", "generator_training.optim.max_steps=2")
"""train.py overrides that replace the command's own value (`trainer.max_steps=3000` runs 2 steps here)."""
RUNS_SHRINK = ("trainer.max_steps=2", "trainer.global_batch_size=8", "eval.doc_batch_size=16",
               "data.eval_datasets=[synchart,synfine]", *SMALL_DATA)
"""The train.py overrides a runs-of-runs module passes to every run it starts."""
EVAL_SHRINK = ("rag.max_queries=2", "rag.pools=[single]", "eval.pools=[single]", "data.eval_datasets=[synfine]",
               "degradation.ocr_workers=1")
"""eval.py overrides that shrink a run (on the demo's corpus: one data set, its own pool, two questions)."""
SMALL_CORPUS = {"n_train": 10, "n_test": 10, "train_groups_per_style": 1, "test_groups_per_style": 1,
                "group_size": 2, "train_fine_groups": 1, "test_fine_groups": 1}
"""The small workspace's corpus (20 pages); its eval.py / train.py runs name it, or they would regenerate the demo's."""
SMALL_CORPUS_OVERRIDES = tuple(f"++data.synthetic.{key}={value}" for key, value in SMALL_CORPUS.items())
OCR_CORPUS = "python -m hkrag.data.ocr data/synthetic/corpus --out data/synthetic_ocr --column ocr_text"
"""Writes the OCR'd copy that commands with ``data.corpus_source=data/synthetic_ocr`` read (the README's OCR line)."""
SMALL_WORKSPACE = re.compile(r"hkrag\.data\.(ocr|degrade|pdf|layout|region_corpus)|ocr_text|degrade=|task=degradation"
                             r"|bench/grounding\.py(?!.*--reuse-test)|corpus_source=data/deg")
"""Commands that run in the workspace with the small corpus (they read every page of data/synthetic/corpus, or,
bench/grounding.py, OCR every test question's page three times and training pages at nine settings, unless it reuses
the committed test rows), and those that read what one of them wrote (a degraded corpus)."""
REREAD = re.compile(r"--out (docs/[\w/.-]+).*--reuse-test")
"""A command that reads its ``--out`` report folder back (bench/grounding.py ``--reuse-test``): it runs on a copy of the
committed folder, in the demo's workspace (the built-in corpus those rows are of)."""
COMMITTED_INPUTS = re.compile(r"(?<=hkrag\.tasks\.ladder_overview)((?: docs/[\w/.-]+)+)")
"""A command whose inputs are committed report folders (the ladder's overview reads ``docs/ladder/*/ladder.json``):
it runs on copies of them in its workspace."""


def first_match(table: tuple[tuple[str, str], ...], text: str) -> str | None:
    return next((reason for pattern, reason in table if re.search(pattern, text)), None)


def parse_param(command: rc.Command):
    reason = first_match(EXTERNAL, command.text)
    marks = [pytest.mark.skip(reason=f"not parsed: {reason}")] if reason else []
    return pytest.param(command, marks=marks, id=command.text)


ELIDED = "part of the command is left out (…): its flags or keys are checked, it cannot run"


def run_param(command: rc.Command):
    reason = first_match(EXTERNAL, command.text) or (
        None if first_match(REFUSED, command.text) else first_match(OFFLINE, command.text)) or (
        ELIDED if rc.elided(command.text) else None)
    slow = first_match(SLOW, command.text) or command.source.startswith("docs/")
    marks = [pytest.mark.skip(reason=f"cannot run offline: {reason}")] if reason else []
    marks += [pytest.mark.slow] if slow and not reason else []
    return pytest.param(command, marks=marks, id=command.text)


def environment() -> dict[str, str]:
    """The commands' environment: offline, no W&B, the shipped weights, and this checkout's code first on the path
    (a `python bench/...` script would otherwise import whichever hkrag is installed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HKRAG_RUN_DIR", "HKRAG_DATA_DIR")}
    path = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "HKRAG_WEIGHTS_DIR": str(ROOT / "weights"),
            "PYTHONPATH": path}


def run_shell(text: str, cwd: Path, timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``text`` with bash in ``cwd``; on failure the test fails with the command, exit status and stderr's tail."""
    try:
        result = subprocess.run(["bash", "-c", text], cwd=cwd, env=environment(), capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{text}\n(in {cwd}) did not finish in {timeout} s; stderr tail:\n{(expired.stderr or '')[-3000:]}")
    if result.returncode != 0:
        pytest.fail(f"{text}\n(in {cwd}) exited {result.returncode}; stderr tail:\n{result.stderr[-4000:]}")
    return result


KEPT_WORKSPACE = "HKRAG_README_WORKSPACE"
"""Environment variable: a folder where the working directories are kept between pytest runs (batches)."""


def workspace(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        (root / name).symlink_to(ROOT / name)
    return root


def session_workspace(tmp_path_factory, name: str) -> tuple[Path, bool]:
    """A working directory named ``name`` and whether it was kept from an earlier run (:data:`KEPT_WORKSPACE`)."""
    kept = os.environ.get(KEPT_WORKSPACE)
    root = Path(kept).resolve() / name / "work" if kept else tmp_path_factory.mktemp(name) / "work"
    if root.is_dir():
        return root, True
    return workspace(root), False


@pytest.fixture(scope="session")
def demo_workspace(tmp_path_factory) -> Path:
    return session_workspace(tmp_path_factory, "readme")[0]


@pytest.fixture(scope="session")
def demo_run(demo_workspace) -> Path:
    """``python train.py`` exactly as the README's quick start runs it (the demo's corpus, the shipped reader,
    324 steps), in the working directory (once: a kept workspace's run is reused); its run folder."""
    if not list((demo_workspace / "outputs" / "train").glob("*/report.json")):
        run_shell(DEMO, demo_workspace)
    runs = sorted((demo_workspace / "outputs" / "train").glob("*/report.json"))
    assert len(runs) == 1, f"`{DEMO}` wrote {len(runs)} reports: {runs}"
    return runs[0].parent


@pytest.fixture(scope="session")
def small_workspace(tmp_path_factory) -> Path:
    """A working directory whose data/synthetic is a small corpus (20 pages) and reports/ two PDFs, with
    Tesseract installed: for the commands that read every page."""
    from PIL import Image

    from hkrag.data.ocr import OcrUnavailable, install_tesseract
    from hkrag.data.synthetic import SyntheticConfig, generate

    try:
        install_tesseract("eng")
    except OcrUnavailable as reason:
        pytest.skip(f"Tesseract: {reason}")
    root, kept = session_workspace(tmp_path_factory, "readme-small")
    if kept:
        return root
    generate(root / "data" / "synthetic", SyntheticConfig(**SMALL_CORPUS))
    (root / "reports").mkdir()
    for name, colour in (("a.pdf", "white"), ("b.pdf", "lightgrey")):
        pages = [Image.new("RGB", (200, 280), colour) for _ in range(2)]
        pages[0].save(root / "reports" / name, "PDF", save_all=True, append_images=pages[1:], resolution=72)
    return root


def newest(folder: Path) -> Path:
    found = sorted(path for path in folder.glob("*") if path.is_dir())
    if not found:
        pytest.fail(f"nothing under {folder}: the command that writes it runs earlier in its document (-m slow)")
    return found[-1]


def placeholder_values(text: str, request, cwd: Path, slug: str) -> dict[str, str]:
    """Concrete values for the placeholders ``text`` names, from the fixtures' runs; ``--out DIR`` is a new folder
    of the command's own (``slug``): shipping refuses one another command filled."""
    values = dict(rc.PARSE_VALUES)
    needed = rc.needed_values(text)
    if {"train_run", "shards", "queries", "qrels", "adapter"} & set(needed):
        run = request.getfixturevalue("demo_run").relative_to(request.getfixturevalue("demo_workspace"))
        after = run / "eval-after"
        values.update(train_run=str(run), adapter=str(run / "checkpoints" / "final" / "adapter"),
                      shards=f"--shards {after / 'embeddings-all'}", queries=f"--queries {after / 'queries'}",
                      qrels=f"--qrels {after / 'qrels.json'}")
    if "train_sweep" in needed:
        values["train_sweep"] = str(newest(cwd / "multirun" / "train"))
    if "eval_sweep" in needed:
        values["eval_sweep"] = str(newest(cwd / "multirun" / "eval"))
    if {"rag_runs", "rag_run"} & set(needed):
        runs = request.getfixturevalue("rag_runs")
        values.update(rag_runs=" ".join(map(str, runs)), rag_run=str(runs[0]))
    if "val_steps" in needed:
        values["val_steps"] = str(validation_steps(cwd))
    if "out_dir" in needed:
        values["out_dir"] = f"--out outputs/readme/{slug}-out"
    return values


VALIDATION_RUN = Path("outputs", "readme", "validation-agents")
"""The run whose ``steps.json`` stands for a validation report (``--threshold-from VAL/steps.json``)."""


def validation_steps(cwd: Path) -> Path:
    """A ``steps.json`` with a Pruner P(yes) threshold: HKRAG's agents on the shipped generator over the shipped
    reader's top pages (``task=rag``: the Pruner scores retrieved pages, not gold ones) and its step report, made
    once."""
    steps = VALIDATION_RUN / "steps.json"
    if not (cwd / steps).is_file():
        run_shell(f"python eval.py task=rag run_dir=weights/reader_tiny generator=hkrag lvlm=phi3v_agents_tiny "
                  f"{' '.join(EVAL_SHRINK)} hydra.run.dir={VALIDATION_RUN}", cwd)
        run_shell(f"python -m hkrag.rag steps {VALIDATION_RUN}", cwd)
    return steps


@pytest.fixture(scope="session")
def rag_runs(demo_workspace) -> list[Path]:
    """Two RAG runs for `python -m hkrag.rag compare`: those of the commands run before it, else two tiny
    `eval.py task=generation` runs (single-pass and HKRAG's agents)."""
    runs = sorted(path.parent.relative_to(demo_workspace)
                  for path in (demo_workspace / "outputs" / "readme").glob("*/rag.json"))
    if len(runs) >= 2:
        return runs[:2]
    runs = []
    for generator in ("single_pass", "hkrag"):
        folder = Path("outputs", "readme", f"compare-{generator}")
        run_shell(f"python eval.py task=generation generator={generator} {' '.join(EVAL_SHRINK)} "
                  f"hydra.run.dir={folder}", demo_workspace)
        runs.append(folder)
    return runs


def override_keys(args: list[str]) -> set[str]:
    return {arg.split("=", 1)[0].lstrip("+~") for arg in args if "=" in arg and not arg.startswith("-")}


def shrink(argv: list[str], slug: str, env: dict[str, str] | None = None) -> list[str]:
    """Overrides appended to a train.py / eval.py command: those of :data:`TRAIN_SHRINK` / :data:`EVAL_SHRINK`
    whose key its config has and it does not set, and its own run folder (so `latest` stays the demo) unless it
    names one (``hydra.run.dir=``, or ``HKRAG_RUN_DIR=`` in its environment ``env``)."""
    script, args = argv[1], argv[2:]
    multirun = any(arg in rc.HYDRA_FLAGS for arg in args)
    plain = [arg for arg in args if arg not in rc.HYDRA_FLAGS]
    cfg = rc.compose(script, rc.hydra_jobs(plain, multirun)[0])
    given = override_keys(plain)
    candidates = TRAIN_SHRINK if script == "train.py" else EVAL_SHRINK
    if any("data/" in arg for arg in plain):  # it reads files made from the demo's corpus: keep that corpus
        candidates = tuple(o for o in candidates if o not in SMALL_DATA)
    extra = [o for o in candidates
             if o.split("=")[0] not in given and OmegaConf.select(cfg, o.split("=")[0], default="?") != "?"]
    if {"hydra.run.dir", "hydra.sweep.dir"} & given or "HKRAG_RUN_DIR" in (env or {}):
        return extra
    folder = f"hydra.sweep.dir=multirun/{cfg.run_name}/readme-{slug}" if multirun else \
        f"hydra.run.dir=outputs/readme/{slug}"
    return [*extra, folder]


def value_options(command: list[str]) -> set[str]:
    """The options of ``python -m module``'s parser (its subcommand's) that take a value: a ``key=value`` after one
    is that option's value (``--eval rag.max_queries=2``, ``--stage1 'generator_training.pages=[gold]'``), not one of
    the module's positional overrides."""
    if command[1:2] != ["-m"]:
        return set()
    parser = rc.command_parser(rc.load_module(command[2]).main, command[3:])
    return {flag for flag, action in parser._option_string_actions.items() if action.nargs != 0}


def tiny(text: str, slug: str, small: bool = False) -> str:
    """The command as the test runs it: placeholders filled, tiny flags and shrinking overrides appended (in the
    small workspace, the small corpus's settings too)."""
    if text == DEMO:
        return text
    argv = shlex.split(text)
    env, command = rc.split_env(argv)
    flags = [flag for pattern, flags in TINY_FLAGS if re.search(pattern, text) for flag in shlex.split(flags)]
    if flags:  # python -m module [options] [overrides]: argparse takes the positional overrides in one run
        own = command[3:]
        valued = value_options(command)
        overrides = [arg for i, arg in enumerate(own) if "=" in arg and not arg.startswith("-")
                     and not (i and own[i - 1] in valued)]
        options = [arg for arg in own if arg not in overrides]
        prefix = [f"{name}={value}" for name, value in env.items()]
        shrink_runs = RUNS_SHRINK if re.search(RUNS_OF_RUNS, text) else ()
        return shlex.join([*prefix, *command[:3], *options, *flags, *overrides, *shrink_runs])
    appended: list[str] = []
    if rc.program(command) in rc.PYTHON and command[1:2] and command[1] in rc.HYDRA_SCRIPTS:
        forced = {override.split("=")[0]: override for override in FORCED}
        if command[1] == "train.py" and any(arg.split("=")[0] in forced for arg in command):
            command = [forced.get(arg.split("=")[0], arg) for arg in command]
            text = shlex.join([*(f"{name}={value}" for name, value in env.items()), *command])
        appended += shrink(command, slug, env) + list(SMALL_CORPUS_OVERRIDES if small else ())
    return " ".join([text, *map(shlex.quote, appended)])


@pytest.mark.parametrize("command", [parse_param(c) for c in COMMANDS])
def test_command_parses(command: rc.Command):
    """Every command's flags and overrides are accepted by the program it calls (nothing runs); one a document
    shows refused (:data:`REFUSED`) is refused with its message, or accepted here and refused when it runs."""
    refused = first_match(REFUSED, command.text)
    try:
        rc.check_parses(command.text)
    except (AssertionError, ValueError) as error:
        if refused and refused in str(error):
            return
        pytest.fail(f"{command.source}: `{command.text}` does not parse: {error}")


@pytest.mark.parametrize("command", [parse_param(c) for c in rc.commands(rc.RECORDS)])
def test_recorded_command_parses(command: rc.Command):
    """Every command bench/RESULTS.md records a figure with still parses (they are full-size measurements: none
    runs here); a renamed script or flag would leave the record naming a command that no longer exists."""
    try:
        rc.check_parses(command.text)
    except (AssertionError, ValueError) as error:
        pytest.fail(f"{command.source}: `{command.text}` does not parse: {error}")


@pytest.mark.parametrize("name", [pytest.param(c, id=c.text) for c in rc.program_names()])
def test_named_program_exists(name: rc.Command):
    """A prose span that names a program without arguments (`python -m hkrag.data.ocr`) names one that exists."""
    try:
        rc.check_name(name.text)
    except AssertionError as error:
        pytest.fail(f"{name.source}: `{name.text}`: {error}")


@pytest.mark.parametrize("command", [run_param(c) for c in COMMANDS])
def test_command_runs(command: rc.Command, request):
    """Every command that can run offline runs, shrunk; `python train.py` runs verbatim (the demo fixture)."""
    if command.text == DEMO:
        report = json.loads((request.getfixturevalue("demo_run") / "report.json").read_text())
        assert report["steps"] == 324 and report["before"] and report["after"]
        return
    run_command(command, request)


WRITTEN = re.compile(r"(?:hydra\.run\.dir=|HKRAG_RUN_DIR=|--out )((?:outputs|runs)/[\w./-]+)")
"""The run folders a command writes (``hydra.run.dir=``, ``HKRAG_RUN_DIR=``, ``--out``)."""
READ = re.compile(r"(?<![\w/.-])((?:outputs|runs)/[\w./-]+)")
"""The run folders (and files in them) a command names."""


def writer(path: str, reader: rc.Command) -> rc.Command | None:
    """The command, other than ``reader`` and of any document, that runs here and writes the folder holding
    ``path``."""
    return next((c for c in COMMANDS if c is not reader and not first_match(EXTERNAL, c.text)
                 and not first_match(OFFLINE, c.text)
                 and any(path == folder or path.startswith(folder + "/") for folder in WRITTEN.findall(c.text))), None)


def run_writers(command: rc.Command, cwd: Path, request) -> None:
    """Run first the command that writes a run folder ``command`` reads and ``cwd`` lacks: one of a later document
    (docs/evaluation.md reads docs/training.md's outputs/s2_example), or one left out of this pytest run."""
    own = set(WRITTEN.findall(command.text))
    for path in READ.findall(command.text):
        found = None if path in own or (cwd / path).exists() else writer(path, command)
        if found:
            run_command(found, request)


def run_command(command: rc.Command, request) -> None:
    """``command`` run shrunk in its workspace, after what it reads (the demo, the OCR'd corpus, the run folders
    other commands write); a refused one must be refused with its message."""
    small = SMALL_WORKSPACE.search(command.text)
    cwd = request.getfixturevalue("small_workspace" if small else "demo_workspace")
    run_writers(command, cwd, request)
    if "bench/" in command.text and not small:  # bench scripts read the demo's corpus, data/synthetic
        request.getfixturevalue("demo_run")
    if "latest" in command.text:
        runs = request.getfixturevalue("demo_run").parent
        if small and not (cwd / "outputs" / "train").exists():  # the small corpus's pages, the demo's model
            (cwd / "outputs").mkdir(exist_ok=True)
            (cwd / "outputs" / "train").symlink_to(runs)
    for folder in [*REREAD.findall(command.text), *" ".join(COMMITTED_INPUTS.findall(command.text)).split()]:
        shutil.copytree(ROOT / folder, cwd / folder, dirs_exist_ok=True)
    if "=data/synthetic_ocr" in command.text and not (cwd / "data" / "synthetic_ocr").is_dir():
        run_shell(OCR_CORPUS, cwd)
    slug = f"c{COMMANDS.index(command):03d}"
    text = rc.concrete(command.text, placeholder_values(command.text, request, cwd, slug))
    refused = first_match(REFUSED, command.text)
    if refused:  # verbatim: shrinking flags could replace what is refused
        result = subprocess.run(["bash", "-c", text], cwd=cwd, env=environment(), capture_output=True, text=True,
                                timeout=TIMEOUT_S)
        assert result.returncode != 0 and refused in result.stderr, (
            f"{text} (in {cwd}) was to be refused with {refused!r}: exit {result.returncode}, stderr tail:\n"
            f"{result.stderr[-3000:]}")
        return
    run_shell(tiny(text, slug, bool(small)), cwd)


# --- the demo's figures against the README's table ----------------------------------------------------------------


def parse_cell(cell: str) -> tuple[float, float]:
    """A demo-table cell as (lo, hi): ``83.9–89.7`` (en dash) or a single figure ``89.7`` (lo = hi); bold allowed."""
    text = cell.replace("*", "").strip()
    match = re.fullmatch(r"(\d+(?:\.\d)?)\s*[–-]\s*(\d+(?:\.\d)?)", text) or re.fullmatch(r"(\d+(?:\.\d)?)", text)
    if not match:
        raise ValueError(f"demo table cell {cell!r} is neither `lo–hi` nor a figure")
    lo, hi = float(match.group(1)), float(match.group(match.lastindex))
    if lo > hi:
        raise ValueError(f"demo table cell {cell!r}: lo > hi")
    return lo, hi


def demo_table(readme: str) -> dict[tuple[str, str], tuple[float, float]]:
    """The README's demo table ("What the demo shows") as (row, column) -> (lo, hi); fails naming what it lacks."""
    rows = list(rc.iter_markdown_table(readme, DEMO_TABLE_HEADER))
    if not rows:
        pytest.fail(f"README.md has no table whose header starts {DEMO_TABLE_HEADER!r}")
    header, body = rows[0], rows[1:]
    if header[1:] != list(DEMO_COLUMNS):
        pytest.fail(f"README demo table columns {header[1:]} are not hkrag.tasks.training.DEMO_COLUMNS "
                    f"{list(DEMO_COLUMNS)}: update one or the other")
    if [row[0] for row in body] != list(DEMO_ROWS):
        pytest.fail(f"README demo table rows {[row[0] for row in body]} are not hkrag.tasks.training.DEMO_ROWS "
                    f"{list(DEMO_ROWS)}: update one or the other")
    return {(row[0], column): parse_cell(cell) for row in body for column, cell in zip(DEMO_COLUMNS, row[1:])}


def test_demo_table_parser():
    table = "\n".join([
        "text", "| queries | " + " | ".join(DEMO_COLUMNS) + " |",
        "|---|---|---|---|---|",
        *(f"| {row} | 83.9–89.7 | 1.0 | **93.5** | **60.1–62.0** |" for row in DEMO_ROWS), "", "after"])
    parsed = demo_table(table)
    first = DEMO_ROWS[0]
    assert parsed[(first, "before (the shipped reader), single")] == (83.9, 89.7)
    assert parsed[(first, "before, all")] == (1.0, 1.0)
    assert parsed[(first, "after 324 steps, single")] == (93.5, 93.5)
    assert parsed[(first, "after, all")] == (60.1, 62.0)
    assert len(parsed) == 16
    with pytest.raises(ValueError, match="neither"):
        parse_cell("about 90")
    with pytest.raises(pytest.fail.Exception, match="DEMO_ROWS"):
        demo_table(table.replace(DEMO_ROWS[1], "styles, other"))


def test_the_readme_demo_table_parses():
    """Cheap, without the demo: the README's table has the rows and columns report.json maps to."""
    assert len(demo_table((ROOT / "README.md").read_text())) == len(DEMO_ROWS) * len(DEMO_COLUMNS)


def test_demo_lands_in_the_readme_range(demo_run):
    """Each figure of `python train.py`'s report.json (nDCG@5 x100, the four styles averaged per evidence type, then
    synfine; hkrag.tasks.training.demo_figures) lies in the README's stated range, rounded to one decimal."""
    report = json.loads((demo_run / "report.json").read_text())
    figures = {when: demo_figures(report[when]) for when in ("before", "after")}
    outside = []
    for (row, column), (lo, hi) in demo_table((ROOT / "README.md").read_text()).items():
        when, pool = DEMO_COLUMNS[column]
        figure = round(figures[when][pool][row], 1)
        if not lo <= figure <= hi:
            outside.append(f"{row} | {column}: {figure:.1f} not in {lo:.1f}–{hi:.1f}")
    assert not outside, "the demo left the README's range:\n" + "\n".join(outside)


def test_ci_runs_the_readme_test_command():
    """.ci/run ends with the README's quick-start test command, verbatim (install line included)."""
    readme = (ROOT / "README.md").read_text()
    lines = [line for _, body in re.findall(r"^```(\w*)\n(.*?)^```", readme, re.M | re.S) for line in body.splitlines()
             if line.rstrip().endswith("python -m pytest") and line.startswith("pip install")]
    assert len(lines) == 1, f"the README's quick start has {len(lines)} install-and-test lines: {lines}"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == lines[0].strip(), f".ci/run's last command {ci[-1]!r} is not the README's {lines[0]!r}"


def test_commands_are_found():
    """The extraction sees the README's commands (a broken fence parser would silently test nothing)."""
    texts = [c.text for c in COMMANDS]
    assert DEMO in texts and "python -m pytest -m slow" in texts
    assert all("\\" not in t and not t.endswith("&&") for t in texts)


def test_extraction_rules(tmp_path):
    """Shell fences only; plain fences' non-command lines skipped; comments, `&&` and continuations handled."""
    document = tmp_path / "doc.md"
    document.write_text("\n".join([
        "```bash", "# a comment line", "pip install -e . && python train.py a=1   # trailing comment",
        "python -m x --out DIR \\", "    --flag 'a # b'", "```",
        "```", "corpus/", "  README.md   # tree", "python eval.py task=rag", "```",
        "```python", "python = 3", "```", "```yaml", "python: 3", "```", ""]))
    found = rc.extract(document)
    assert [c.text for c in found] == ["pip install -e .", "python train.py a=1",
                                       "python -m x --out DIR --flag 'a # b'", "python eval.py task=rag"]
    assert found[2].source.endswith("doc.md:4") and found[3].source.endswith("doc.md:10")


def test_tiny_replaces_a_commands_own_step_count():
    """A train.py command that sets its own length runs 2 steps here, its other overrides kept."""
    text = tiny("python train.py experiment=reader_tiny trainer.max_steps=3000 'data.field_queries=[\"{title}\"]'", "x")
    argv = shlex.split(text)
    assert "trainer.max_steps=2" in argv and "trainer.max_steps=3000" not in argv
    assert 'data.field_queries=["{title}"]' in argv and argv.count("trainer.max_steps=2") == 1


def test_tiny_keeps_the_run_folder_a_command_names_in_its_environment():
    """``HKRAG_RUN_DIR=outputs/x python eval.py ...`` writes outputs/x, where the next command reads it: the shrunk run
    gets no folder of its own (docs/rerank/README.md's `rag steps outputs/pruner_test_rag` found no run there)."""
    named = tiny("HKRAG_RUN_DIR=outputs/x python eval.py task=rag run_dir=weights/reader_tiny", "c001")
    assert named.startswith("HKRAG_RUN_DIR=outputs/x ") and "hydra.run.dir" not in named
    assert "hydra.run.dir=outputs/readme/c001" in tiny("python eval.py task=rag run_dir=weights/reader_tiny", "c001")


def test_tiny_keeps_an_options_override_value_with_it():
    """An override that is an option's value (table6's ``--stage1``) stays after its option; the tiny flags and the
    runs' shrinking overrides follow (a value moved to the positionals left ``--stage1`` without one)."""
    text = ("python -m hkrag.tasks.table6 --out o --stage1 'generator_training.pages=[gold]' --eval rag.top_k=2 "
            "+generator_training.optim.loss_mean=example")
    argv = shlex.split(tiny(text, "x"))
    assert argv[argv.index("--stage1") + 1] == "generator_training.pages=[gold]"
    assert argv[argv.index("--eval") + 1] == "rag.top_k=2"
    assert argv.index("+generator_training.optim.loss_mean=example") > argv.index("--generator-steps")


def test_a_corpus_is_read_in_the_workspace_that_wrote_it():
    """A command reading ``data.corpus_source=data/X`` runs in the workspace of the command that writes ``--out
    data/X`` (docs/data.md's evaluation of the degraded pages ran in the demo's, where they are not)."""
    runs = [c.text for c in COMMANDS if not first_match(EXTERNAL, c.text) and not first_match(OFFLINE, c.text)]
    writers = {match.group(1): text for text in runs for match in re.finditer(r"--out (data/\S+)", text)}
    misplaced = [(text, writers[source]) for text in runs for source in re.findall(r"corpus_source=(data/\S+)", text)
                 if source in writers and bool(SMALL_WORKSPACE.search(text)) != bool(SMALL_WORKSPACE.search(
                     writers[source]))]
    assert writers and not misplaced, misplaced


def test_every_run_folder_a_command_reads_is_one_a_command_writes():
    """A run folder (outputs/, runs/) that a runnable command reads is written by another that runs here (or is the
    demo's, outputs/train/<stamp>): docs/evaluation.md's `rag steps outputs/test_s2_gold_hkrag` read one no command
    wrote; its `agent_steps outputs/s2_example` finds docs/training.md's stage-2 run."""
    runs = [c for c in COMMANDS if not first_match(EXTERNAL, c.text) and not first_match(OFFLINE, c.text)
            and not rc.elided(c.text)]
    unwritten = [(c.source, path) for c in runs for path in READ.findall(c.text)
                 if path not in WRITTEN.findall(c.text) and not path.startswith("outputs/train/")
                 and not writer(path, c)]
    assert not unwritten, unwritten
    steps = next(c for c in runs if c.text.startswith("python -m hkrag.tasks.agent_steps outputs/s2_example"))
    assert "hydra.run.dir=outputs/s2_example " in writer("outputs/s2_example", steps).text


def test_a_shrunk_generator_run_holds_out_validation_queries():
    """docs/training.md's stage-2 run, shrunk, holds out half its groups (agent_steps reads the held-out queries);
    a run without a validation split gets no such key."""
    stage2 = ("python train.py experiment=generator_agents_tiny hydra.run.dir=outputs/s2_example "
              "generator_training.init_from=outputs/d_single +generator_training.optim.loss_mean=example")
    assert "generator_training.validation.fraction=0.5" in shlex.split(tiny(stage2, "x"))
    assert not any("validation" in arg for arg in shlex.split(tiny("python train.py loss=infonce", "x")))


def test_each_command_gets_its_own_out_dir(tmp_path):
    """``--out DIR`` is a fresh folder per command (the replica's run filled the shared one, which shipping then
    refused to overwrite)."""
    folders = {placeholder_values("python -m hkrag.data.synthetic --out DIR", None, tmp_path, slug)["out_dir"]
               for slug in ("c001", "c002")}
    assert len(folders) == 2


def test_a_step_report_reads_a_rag_run_and_a_validation_report():
    """docs/evaluation.md's `rag steps RUN --threshold-from VAL/steps.json`: RUN is a RAG run (not a train.py run,
    which has no trace) and VAL a validation report's steps.json."""
    text = rc.concrete("python -m hkrag.rag steps RUN --threshold-from VAL/steps.json", rc.PARSE_VALUES)
    assert text == (f"python -m hkrag.rag steps {rc.PARSE_VALUES['rag_run']} --threshold-from "
                    f"{rc.PARSE_VALUES['val_steps']}")


def test_prose_extraction_rules(tmp_path):
    """Prose spans: a program first (or a script with arguments, run by python), whitespace collapsed across lines,
    `a|b` (and a table's `\\|`) expanded, bare programs kept apart as names, paths and fenced spans ignored."""
    document = tmp_path / "doc.md"
    document.write_text("\n".join([
        "Run `python eval.py task=rag|generation` or `bench/x.py --flag 1`, see `tests/test_x.py` and `eval.py`.",
        "Then `python -m hkrag.data.ocr`, `python -m hkrag.rag compare",
        "  RUN_DIR RUN_DIR` and | `generator=a\\|b` | `accelerate launch`.",
        "```bash", "echo `python train.py x=1`", "```", "`python -m pytest -m slow`", ""]))
    found, names = rc.extract_inline(document)
    assert [c.text for c in found] == ["python eval.py task=rag", "python eval.py task=generation",
                                       "python bench/x.py --flag 1", "python -m hkrag.rag compare RUN_DIR RUN_DIR",
                                       "python -m pytest -m slow"]
    assert all(c.inline for c in found) and found[3].source.endswith("doc.md:2") and found[4].source.endswith(":7")
    assert [c.text for c in names] == ["python -m hkrag.data.ocr", "accelerate launch"]


def test_prose_commands_are_found():
    """README's prose commands are among those tested, a fenced copy winning over a prose one."""
    by_text = {c.text: c for c in COMMANDS}
    rag = ("python eval.py task=rag run_dir=weights/reader_tiny generator=single_pass generator.top_k=1 "
           "lvlm=phi3v_reader_tiny")
    assert by_text[rag].inline and by_text[rag].source.startswith("README.md:")
    assert not by_text[DEMO].inline
    assert "python -m hkrag.data.ocr" in [c.text for c in rc.program_names()]


@pytest.mark.parametrize(("text", "message"), [
    ("python train.py trainer.bogus_key=1", "bogus_key"),
    ("python train.py loss.tau=0", "loss.tau=0"),
    ("python eval.py task=nosuch", "nosuch"),
    ("python train.py -m loss=hkrag,nosuch", "nosuch"),
    ("python train.py loss=hkrag,infonce", "no -m"),
    ("python -m hkrag.data.degrade data/synthetic/corpus jpeg:10 --output x", "--out"),
    ("python -m hkrag.tasks.chain --out x --worker-count 2", "--worker-count"),
    ("python -m hkrag.nosuch --out x", "no such module"),
    ("accelerate launch --config_file conf/accelerate/nosuch.yaml train.py", "does not exist"),
    ("accelerate launch --nosuch train.py", "--nosuch"),
    ('pip install -e ".[nosuch]" -c constraints.txt', "nosuch"),
    ("pip install torch==1.0 -c constraints.txt", "disagrees"),
    ("python -m pytest -m fast", "fast"),
    ("python eval.py task=rag run_dir=outputs/eval/<nosuch>", "placeholder '<nosuch>'"),
    ("python eval.py task=<name> nosuch=1", "nosuch"),
    ("python eval.py task=rag nokey=…", "no config key or group ['nokey']"),
    ("python train.py experiment=nosuch_*", "no conf/experiment/nosuch_*.yaml"),
    ("python -m hkrag.data.ocr … --nosuch-flag 1", "--nosuch-flag"),
    ("accelerate launch --nosuch-option 2", "--nosuch-option"),
    ("pip install 'hkrag[nosuch]'", "nosuch"),
    ("python tests/test_interval_coverage.py 5", "takes no command-line arguments"),
    ("OMP_NUM_THREADS=1 nice -n 10 python bench/multivector.py --nosuch-flag 3", "--nosuch-flag"),
    ("nice python -m hkrag.tasks.chain --out x --worker-count 2", "--worker-count"),
])
def test_a_changed_flag_fails_the_parse_check(text: str, message: str):
    """What a README command that changed its flags (or names a missing file, extra or marker) meets."""
    with pytest.raises((AssertionError, ValueError), match=re.escape(message)):
        rc.check_parses(text)


def test_no_script_folder_shadows_a_package():
    """``python bench/x.py`` puts bench/ first on the path, so a bench/ or scripts/ module named as one of the
    project's packages hides it: bench/agents.py made ``python bench/demo_range.py`` fail to import (``hkrag.tasks``
    imports ``agents``), which the in-process parse check, where ``agents`` was already imported, did not see."""
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert {"hkrag", "agents"} <= packages
    shadows = [str(path.relative_to(ROOT)) for folder in ("bench", "scripts") for path in (ROOT / folder).iterdir()
               if path.stem in packages]
    assert not shadows, f"{shadows} hide the packages of the same name from a script run in that folder"


def test_a_bench_script_that_imports_the_agents_runs_as_a_script():
    """bench/demo_range.py, run as ``python bench/demo_range.py --help`` (a fresh interpreter, bench/ first on the
    path), imports hkrag.tasks and the agents it composes."""
    result = subprocess.run([sys.executable, "bench/demo_range.py", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--summarize" in result.stdout

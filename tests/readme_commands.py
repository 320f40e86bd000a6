"""The shell commands of README.md and docs/*.md, read from their fenced code blocks, and the checks that each
still parses: Hydra overrides compose (sweeps expanded), ``python -m`` arguments pass the module's own argparse
parser, ``accelerate launch`` accepts its options and config file, pip names extras and constraint files that
exist, pytest names registered markers and existing paths. tests/test_readme.py runs them."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import itertools
import re
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SHELL_BLOCKS = ("bash", "sh", "shell", "console", "")
"""Fence languages whose lines are shell commands ("" is a plain fence: only lines starting with a program)."""
PROGRAMS = ("python", "python3", "pip", "accelerate", "pytest", "vllm", "mkdir", "git")
"""First words that make a plain fence's line a command (plain fences also hold trees and sample output)."""
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
PYTHON = ("python", "python3")
HYDRA_SCRIPTS = {"train.py": "train", "eval.py": "eval"}
HYDRA_FLAGS = ("-m", "--multirun")

PLACEHOLDERS: tuple[tuple[str, str], ...] = (
    (r"outputs/train/<stamp>", "train_run"),
    (r"multirun/train/<stamp>", "train_sweep"),
    (r"multirun/eval/<stamp>", "eval_sweep"),
    (r"RUN_DIR RUN_DIR \.\.\.", "rag_runs"),
    (r"--shards DIR", "shards"),
    (r"--queries DIR", "queries"),
    (r"--qrels FILE", "qrels"),
    (r"<adapter dir or hub id>", "adapter"),
    (r"model\.adapter=\.\.\.", "hub_adapter"),
    (r"<mirror>", "mirror"),
    (r"--out DIR", "out_dir"),
)
"""The documents' placeholders (regex) and the name of the value that replaces each: parse checks use
:data:`PARSE_VALUES`, runs a fixture's value (tests/test_readme.py)."""
PARSE_VALUES = {
    "train_run": "outputs/train/2026-01-01_00-00-00", "train_sweep": "multirun/train/2026-01-01_00-00-00",
    "eval_sweep": "multirun/eval/2026-01-01_00-00-00", "rag_runs": "outputs/eval/a outputs/eval/b",
    "shards": "--shards runs/corpus", "queries": "--queries runs/queries", "qrels": "--qrels runs/qrels.json",
    "adapter": "runs/adapter", "hub_adapter": "model.adapter=NTT-hil-insight/VDocRetriever-Phi3-vision",
    "mirror": "/tmp/mirror", "out_dir": "--out outputs/replica",
}
LEFTOVER = re.compile(r"<[^<>\s][^<>]*>|(?<![\w.-])(DIR|FILE|RUN_DIR|\.\.\.|…)(?![\w.-])")
"""A placeholder no rule replaced: a new one in a document needs a row in :data:`PLACEHOLDERS`."""


@dataclass(frozen=True)
class Command:
    """One command of a document: its text as written (comment stripped, continuation lines joined, one part of
    an ``&&`` chain) and where it first appears."""

    text: str
    source: str

    def __str__(self) -> str:
        return self.text


def strip_comment(line: str) -> str:
    """The line without a trailing shell comment (a ``#`` outside quotes that starts a word)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def extract(path: Path) -> list[Command]:
    """The commands of ``path``'s shell fences, in order, ``&&`` chains split."""
    text, found = path.read_text(), []
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for match in FENCE.finditer(text):
        language, body = match.group(1).lower(), match.group(2)
        if language not in SHELL_BLOCKS:
            continue
        first_line = text.count("\n", 0, match.start(2)) + 1
        lines, start, pending = body.splitlines(), None, ""
        for offset, raw in enumerate(lines):
            line = strip_comment(raw)
            start = first_line + offset if not pending else start
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            joined, pending = (pending + line.strip()).strip(), ""
            if not joined or (language == "" and joined.split()[0] not in PROGRAMS):
                continue
            for part in joined.split(" && "):
                found.append(Command(part.strip(), f"{name}:{start}"))
    return found


def commands(paths: Sequence[Path] = DOCUMENTS) -> list[Command]:
    """Every distinct command of the documents (the first occurrence of each text)."""
    seen: dict[str, Command] = {}
    for path in paths:
        for command in extract(path):
            seen.setdefault(command.text, command)
    return list(seen.values())


def concrete(text: str, values: dict[str, str]) -> str:
    """``text`` with its placeholders replaced by ``values``, optional ``[--flag value]`` groups unbracketed and
    a bare ``...`` (more of the same) dropped; raises ValueError naming a placeholder no rule knows."""
    for pattern, name in PLACEHOLDERS:
        text = re.sub(pattern, lambda _m, name=name: values[name], text)
    text = re.sub(r"\[(--[^\[\]]*)\]", r"\1", text)
    text = re.sub(r"\s+\.\.\.(?=\s|$)", "", text)
    leftover = LEFTOVER.search(text)
    if leftover:
        raise ValueError(f"unknown placeholder {leftover.group(0)!r} in {text!r}: add it to "
                         "tests/readme_commands.py PLACEHOLDERS")
    return text


def needed_values(text: str) -> list[str]:
    """The names of the placeholder values ``text`` needs."""
    return [name for pattern, name in PLACEHOLDERS if re.search(pattern, text)]


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``NAME=value`` environment assignments, and the command after them."""
    env = {}
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    return env, argv


def program(argv: Sequence[str]) -> str:
    """The program's name without its folder (``/tmp/refenv/bin/python`` -> ``python``)."""
    return Path(argv[0]).name


# --- parse checks: each returns what it checked -------------------------------------------------------------------


class Parsed(Exception):
    """Raised by the patched ``ArgumentParser.parse_args``: parsing succeeded, stop before the work."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


def parse_with_argparse(main: Callable[..., object], args: list[str], takes_argv: bool = True) -> argparse.Namespace:
    """Call ``main`` with ``args`` but stop right after its argparse parser accepted them (``--help`` counts as
    accepted); raises AssertionError with argparse's message when it rejects them."""
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    stderr = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_only), contextlib.redirect_stderr(stderr), \
            contextlib.redirect_stdout(io.StringIO()), mock.patch.object(sys, "argv", ["prog", *args]):
        try:
            main(args) if takes_argv else main()
        except Parsed as parsed:
            return parsed.namespace
        except SystemExit as exit_:
            if exit_.code in (0, None):
                return argparse.Namespace(help=True)
            raise AssertionError(f"argparse rejects {args}: {stderr.getvalue().strip()}") from None
    raise AssertionError(f"{main.__module__}.main returned without parsing its arguments")


def check_module(module: str, args: list[str]) -> str:
    """``python -m module args``: the module's ``main(argv)`` parser accepts ``args``."""
    try:
        loaded = importlib.import_module(module)
        if not hasattr(loaded, "main"):
            loaded = importlib.import_module(f"{module}.__main__")
    except ImportError as error:
        raise AssertionError(f"python -m {module}: no such module ({error})") from None
    parse_with_argparse(loaded.main, args)
    return f"{module}'s argparse parser accepts the arguments"


def check_script(script: str, args: list[str]) -> str:
    """``python path/to/script.py args`` (not train.py / eval.py): the script's ``main`` parser accepts them."""
    path = ROOT / script
    if not path.is_file():
        raise AssertionError(f"{script} does not exist")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # as `python path/to/script.py` puts the script's folder first
    try:
        spec.loader.exec_module(loaded)
    finally:
        sys.path.remove(str(path.parent))
    takes_argv = loaded.main.__code__.co_argcount > 0
    parse_with_argparse(loaded.main, args, takes_argv)
    return f"{script}'s argparse parser accepts the arguments"


def hydra_jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists of each job: one, or with ``-m`` the product of the sweeps (``a=1,2``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for override in parsed:
        if override.is_sweep_override():
            if not multirun:
                raise AssertionError(f"{override.input_line} sweeps but the command has no -m")
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(job) for job in itertools.product(*choices)]


def compose(script: str, overrides: list[str]):
    """The config ``python <script> <overrides>`` runs (hydra.* overrides applied too)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name=HYDRA_SCRIPTS[script], overrides=overrides, return_hydra_config=True)


def check_hydra(script: str, args: list[str]) -> str:
    """``python train.py|eval.py [-m] overrides``: every job's config composes and passes the config checks."""
    from hkrag.tasks.validation import validate_config

    multirun = any(arg in HYDRA_FLAGS for arg in args)
    flags = [arg for arg in args if arg.startswith("-") and arg not in HYDRA_FLAGS]
    if flags:
        raise AssertionError(f"{script}: unexpected flags {flags}")
    jobs = hydra_jobs([arg for arg in args if arg not in HYDRA_FLAGS], multirun)
    for job in jobs:
        try:
            cfg = compose(script, job)
        except Exception as error:  # Hydra's errors name the override: show them whole
            raise AssertionError(f"{script} {' '.join(job)} does not compose: {error}") from None
        validate_config(cfg)
    return f"{len(jobs)} Hydra job(s) of {script} compose and pass validate_config"


def check_accelerate(args: list[str]) -> str:
    """``accelerate launch [options] script overrides``: accelerate's parser takes the options, the config file
    exists and loads (with its DeepSpeed JSON), and the script's overrides compose."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    if args[:1] != ["launch"]:
        raise AssertionError(f"accelerate {args[:1]}: only `accelerate launch` is expected")
    parsed = parse_with_argparse(lambda argv: launch_command_parser().parse_args(argv), args[1:])
    checked = ["accelerate launch's parser accepts the options"]
    if parsed.config_file:
        if not (ROOT / parsed.config_file).is_file():
            raise AssertionError(f"accelerate config {parsed.config_file} does not exist")
        config = load_config_from_file(str(ROOT / parsed.config_file))
        deepspeed = (config.deepspeed_config or {}).get("deepspeed_config_file")
        if deepspeed and not (ROOT / deepspeed).is_file():
            raise AssertionError(f"{parsed.config_file} names {deepspeed}, which does not exist")
        checked.append(f"{parsed.config_file} loads")
    checked.append(check_python([parsed.training_script, *parsed.training_script_args]))
    return "; ".join(checked)


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def constraint_pins(path: Path) -> dict[str, str]:
    """``name==version`` lines of a pip constraints file, by normalised name."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if match:
            pins[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return pins


def check_pip(args: list[str]) -> str:
    """``pip install ...``: requirements parse, ``-e .[extras]`` names extras of pyproject.toml, ``-c FILE``
    exists and pins (==) agree with the command's."""
    from packaging.requirements import Requirement

    if args[:1] != ["install"]:
        raise AssertionError(f"pip {args[:1]}: only `pip install` is expected")
    extras_known = set(pyproject()["project"]["optional-dependencies"])
    requirements, constraints, editable, rest = [], [], [], iter(args[1:])
    for arg in rest:
        if arg in ("-c", "--constraint"):
            constraints.append(next(rest))
        elif arg in ("-e", "--editable"):
            editable.append(next(rest))
        elif arg.startswith("-"):
            continue
        elif arg.endswith(".whl") or "/" in arg:
            continue
        else:
            requirements.append(Requirement(arg))
    for target in editable:
        match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
        if not match:
            raise AssertionError(f"pip install -e {target}: expected the repository root, `.[extras]`")
        unknown = set((match.group(1) or "").split(",")) - extras_known - {""}
        if unknown:
            raise AssertionError(f"pip install -e {target}: no extra {sorted(unknown)} in pyproject.toml "
                                 f"(has {sorted(extras_known)})")
    for name in constraints:
        path = ROOT / name
        if not path.is_file():
            raise AssertionError(f"pip constraints file {name} does not exist")
        pins = constraint_pins(path)
        for requirement in requirements:
            pinned = pins.get(re.sub(r"[-_.]+", "-", requirement.name).lower())
            if pinned and not requirement.specifier.contains(pinned, prereleases=True):
                raise AssertionError(f"{requirement} disagrees with {name}'s {requirement.name}=={pinned}")
    return f"{len(requirements)} requirement(s), extras of {editable or '-'} and constraints {constraints or '-'} exist"


def check_pytest(args: list[str]) -> str:
    """``pytest ...``: ``-m`` names registered markers, named test paths exist."""
    registered = {line.split(":")[0].strip() for line in pyproject()["tool"]["pytest"]["ini_options"]["markers"]}
    rest = iter(args)
    for arg in rest:
        if arg == "-m":
            names = set(re.findall(r"[A-Za-z_]\w*", next(rest))) - {"and", "or", "not"}
            if names - registered:
                raise AssertionError(f"pytest -m: markers {sorted(names - registered)} are not registered in "
                                     f"pyproject.toml (registered: {sorted(registered)})")
        elif not arg.startswith("-") and not (ROOT / arg.split("::")[0]).exists():
            raise AssertionError(f"pytest {arg}: no such test path")
    return "pytest's markers are registered and its paths exist"


def check_python(argv: list[str]) -> str:
    """A ``python ...`` command line (after the interpreter)."""
    if argv[:1] == ["-m"]:
        module, args = argv[1], argv[2:]
        if module == "pytest":
            return check_pytest(args)
        if module == "pip":
            return check_pip(args)
        return check_module(module, args)
    if argv[0] in HYDRA_SCRIPTS:
        return check_hydra(argv[0], argv[1:])
    if argv[0].endswith(".py"):
        return check_script(argv[0], argv[1:])
    raise AssertionError(f"python {argv[0]}: not a module, script or Hydra entry point")


def check_parses(text: str) -> str:
    """Check ``text`` (placeholders filled with :data:`PARSE_VALUES`) parses; what was checked, or AssertionError."""
    _, argv = split_env(shlex.split(concrete(text, PARSE_VALUES)))
    name = program(argv)
    if name in PYTHON:
        return check_python(argv[1:])
    if name in ("pip", "pip3"):
        return check_pip(argv[1:])
    if name == "pytest":
        return check_pytest(argv[1:])
    if name == "accelerate":
        return check_accelerate(argv[1:])
    raise AssertionError(f"{name}: no parse check for this program; add one to tests/readme_commands.py or list the "
                         "command in tests/test_readme.py EXTERNAL")


def iter_markdown_table(text: str, header_start: str) -> Iterator[list[str]]:
    """The cell lists of the Markdown table whose header row starts with ``header_start`` (header first, the
    ``|---|`` row skipped); nothing when no such table."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header_start):
            for row in lines[i:]:
                if not row.startswith("|"):
                    return
                if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", row.strip()):
                    yield [cell.strip() for cell in row.strip().strip("|").split("|")]
            return

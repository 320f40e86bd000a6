"""The shell commands of README.md and every docs/**/*.md (hand-written and generated reports alike), read from their
fenced code blocks and from the prose's inline code spans (`python ...`, `eval.py ...`, `bench/x.py --flag ...`),
and the checks that each still parses: Hydra overrides compose (sweeps expanded), ``python -m`` arguments pass the
module's own argparse parser, ``accelerate launch`` accepts its options and config file, pip names extras and
constraint files that exist, pytest names registered markers and existing paths. A prose span that elides part of an
argparse command (``…``) has its flags checked against the parser; one that only names a program (``python -m
hkrag.data.ocr``) has the program checked.
tests/test_readme.py runs them."""

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

from omegaconf import OmegaConf

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
RECORDS = (ROOT / "bench" / "RESULTS.md",)
"""The benchmark record: how each measured figure was made (full-size runs, GPUs, 10^6 vectors), parsed, not run."""
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
    (r"<image run> <text run>", "rag_runs"),
    (r"<its eval\.py task=generation run>", "rag_run"),
    (r"(?<=rag steps )(<run>|RUN(?![\w.-]))", "rag_run"),
    (r"VAL/steps\.json", "val_steps"),
    (r"<that run>|<the demo run>|<train\.py run>|<run>|(?<![\w.-])RUN(?![\w.-])", "train_run"),
    (r"<stitched corpus>", "stitched_corpus"),
    (r"<region corpus of detected boxes>", "detected_units"),
    (r"<phi3v config \+ tokenizer>", "phi3v_config"),
    (r"<name>\.json", "row_file"),
)
"""The documents' placeholders (regex) and the name of the value that replaces each: parse checks use
:data:`PARSE_VALUES`, runs a fixture's value (tests/test_readme.py)."""
PARSE_VALUES = {
    "train_run": "outputs/train/2026-01-01_00-00-00", "train_sweep": "multirun/train/2026-01-01_00-00-00",
    "eval_sweep": "multirun/eval/2026-01-01_00-00-00", "rag_runs": "outputs/eval/a outputs/eval/b",
    "shards": "--shards runs/corpus", "queries": "--queries runs/queries", "qrels": "--qrels runs/qrels.json",
    "adapter": "runs/adapter", "hub_adapter": "model.adapter=NTT-hil-insight/VDocRetriever-Phi3-vision",
    "mirror": "/tmp/mirror", "out_dir": "--out outputs/replica", "rag_run": "outputs/eval/a",
    "stitched_corpus": "data/units_ocr_all-box", "detected_units": "data/units_det_all-box",
    "val_steps": "outputs/eval/b/steps.json", "phi3v_config": "../shared/reference/phi3v",
    "row_file": "outputs/row.json",
}
LEFTOVER = re.compile(r"<[^<>\s][^<>]*>|(?<![\w.-])(DIR|FILE|RUN_DIR|RUN|\.\.\.|…)(?![\w.-])")
"""A placeholder no rule replaced: a new one in a document needs a row in :data:`PLACEHOLDERS`."""


INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
"""An inline code span (its backticks, its text); fences are blanked before this runs."""
INLINE_COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+ )*(?:(?:python3?|pip3?|accelerate|pytest)(?: |$)|[\w./-]+\.py )")
"""A span that is a command (or names a program): a program first, or a Python script with arguments
(``eval.py task=rag``, ``bench/search.py --mmap``: run by ``python``)."""
ELISION = re.compile(r"(?<!\S)(?:([\w.+~-]+=)(…|\.\.\.|<name>|)|(…|\.\.\.))(?!\S)")
"""``…`` / ``...`` as a word: the rest of a command (or more of the same) left out; as a Hydra value
(``run_dir=…``, ``task=<name>``, a bare ``run_dir=`` in prose): any value of that key."""
ALTERNATIVES = re.compile(r"(?<![\w'\"|])([\w.+~/-]+=)?(\w+(?:\|\w+)+)(?![\w'\"|])")
"""``task=rag|generation`` or ``sweep|compare``: one command per alternative."""


@dataclass(frozen=True)
class Command:
    """One command of a document: its text as written (comment stripped, continuation lines joined, one part of
    an ``&&`` chain; a prose span's whitespace collapsed, ``python`` put before a bare script, one alternative of
    ``a|b``) and where it first appears; ``inline`` when it comes from the prose."""

    text: str
    source: str
    inline: bool = False

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


def expand_alternatives(text: str) -> list[str]:
    """``text`` once per alternative of each unquoted ``a|b`` word (``task=rag|generation`` -> ``task=rag``,
    ``task=generation``), every combination."""
    match = ALTERNATIVES.search(text)
    if not match:
        return [text]
    prefix = match.group(1) or ""
    return [expanded for choice in match.group(2).split("|")
            for expanded in expand_alternatives(text[:match.start()] + prefix + choice + text[match.end():])]


def prose_spans(path: Path) -> Iterator[tuple[str, int]]:
    """The inline code spans of ``path``'s prose (fenced blocks skipped), whitespace collapsed, ``\\|`` (a pipe
    escaped inside a Markdown table) unescaped, with the line each starts on."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    for match in INLINE.finditer(text):
        span = " ".join(match.group(2).split()).replace("\\|", "|")
        yield span, text.count("\n", 0, match.start()) + 1


def is_name(text: str) -> bool:
    """Whether ``text`` only names a program (no arguments: ``python -m hkrag.data.ocr``, ``accelerate launch``,
    ``python -m``, ``pip``): prose that points at a program, not a command to run."""
    argv = split_env(shlex.split(text))[1]
    name, rest = program(argv), argv[1:]
    if name in PYTHON:
        return not rest or rest[0] == "-c" or (rest[0] == "-m" and len(rest) <= 2)
    return len(rest) <= (1 if name == "accelerate" else 0)


def extract_inline(path: Path) -> tuple[list[Command], list[Command]]:
    """The commands of ``path``'s prose spans (alternatives expanded, ``python`` put before a bare script) and the
    spans that only name a program (:func:`is_name`)."""
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found, names = [], []
    for span, line in prose_spans(path):
        if not INLINE_COMMAND.match(span):
            continue
        for text in expand_alternatives(span):
            argv = split_env(shlex.split(text))[1]
            if argv[0].endswith(".py"):
                text = text.replace(argv[0], f"python {argv[0]}", 1)
            command = Command(text, f"{name}:{line}", inline=True)
            (names if is_name(text) else found).append(command)
    return found, names


def commands(paths: Sequence[Path] = DOCUMENTS) -> list[Command]:
    """Every distinct command of the documents, fenced and prose (the first occurrence of each text; a fenced one
    wins, so a command in both runs as its fence's)."""
    seen: dict[str, Command] = {}
    for path in paths:
        for command in extract(path):
            seen.setdefault(command.text, command)
    for path in paths:
        for command in extract_inline(path)[0]:
            seen.setdefault(command.text, command)
    return list(seen.values())


def program_names(paths: Sequence[Path] = DOCUMENTS) -> list[Command]:
    """Every distinct prose span that only names a program (:func:`is_name`)."""
    seen: dict[str, Command] = {}
    for path in paths:
        for command in extract_inline(path)[1]:
            seen.setdefault(command.text, command)
    return list(seen.values())


def concrete(text: str, values: dict[str, str]) -> str:
    """``text`` with its placeholders replaced by ``values``, optional ``[--flag value]`` groups unbracketed and
    a bare ``...`` (more of the same) dropped; raises ValueError naming a placeholder no rule knows."""
    for pattern, name in PLACEHOLDERS:
        text = re.sub(pattern, lambda _m, name=name: values[name], text)
    text = re.sub(r"\[(--[^\[\]]*)\]", r"\1", text)
    text = ELISION.sub("", text)
    text = " ".join(text.split())
    leftover = LEFTOVER.search(text)
    if leftover:
        raise ValueError(f"unknown placeholder {leftover.group(0)!r} in {text!r}: add it to "
                         "tests/readme_commands.py PLACEHOLDERS")
    return text


def elided(text: str) -> bool:
    """Whether part of ``text`` is left out (:data:`ELISION`; a placeholder's own ``...``, as in
    ``RUN_DIR RUN_DIR ...``, is a placeholder's)."""
    for pattern, name in PLACEHOLDERS:
        text = re.sub(pattern, name, text)
    return bool(ELISION.search(text))


def needed_values(text: str) -> list[str]:
    """The names of the placeholder values ``text`` needs."""
    return [name for pattern, name in PLACEHOLDERS if re.search(pattern, text)]


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``NAME=value`` environment assignments, and the command after them (after ``nice [-n N]``, which
    only lowers its priority)."""
    env = {}
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    if argv[:1] == ["nice"]:
        argv = argv[3:] if argv[1:2] == ["-n"] else argv[1:]
    return env, argv


def program(argv: Sequence[str]) -> str:
    """The program's name without its folder (``/tmp/refenv/bin/python`` -> ``python``)."""
    return Path(argv[0]).name


# --- parse checks: each returns what it checked -------------------------------------------------------------------


class Parsed(Exception):
    """Raised by the patched ``ArgumentParser.parse_args``: parsing succeeded, stop before the work."""

    def __init__(self, namespace: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> None:
        super().__init__("parsed")
        self.namespace = namespace
        self.parser = parser


def argparse_parser(main: Callable[..., object], takes_argv: bool = True) -> argparse.ArgumentParser:
    """The parser ``main`` builds (caught at its ``parse_args``, before it parses anything)."""

    def catch(self, args=None, namespace=None):
        raise Parsed(argparse.Namespace(), self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", catch), mock.patch.object(sys, "argv", ["prog"]):
        try:
            main([]) if takes_argv else main()
        except Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"{main.__module__}.main returned without parsing its arguments")


def command_parser(main: Callable[..., object], args: list[str], takes_argv: bool = True) -> argparse.ArgumentParser:
    """The parser that reads ``args``' options: ``main``'s, or that of the subcommand ``args`` names."""
    parser = argparse_parser(main, takes_argv)
    for arg in args:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub and arg in sub.choices:
            parser = sub.choices[arg]
    return parser


def check_flags(main: Callable[..., object], args: list[str], takes_argv: bool = True) -> str:
    """A command with a part elided (``…``): every ``--flag`` it names is an option of ``main``'s parser (or of
    the subcommand it names)."""
    parser = command_parser(main, args, takes_argv)
    flags = [arg.split("=", 1)[0] for arg in args if arg.startswith("--") and arg != "--"]
    unknown = [flag for flag in flags if flag not in parser._option_string_actions]
    if unknown:
        raise AssertionError(f"{parser.prog} has no option {unknown} (has {sorted(parser._option_string_actions)})")
    return f"{parser.prog}'s parser has the flags {flags} (the rest is elided)"


def unchecked_inputs(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` (and its subcommands) take its input paths as they are: a document names run folders that an
    earlier command writes, so the parse check reads :func:`hkrag.cli.existing`'s arguments as plain paths."""
    for action in parser._actions:
        if getattr(action.type, "__qualname__", "").startswith("existing."):
            action.type = Path
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                unchecked_inputs(sub)


def parse_with_argparse(main: Callable[..., object], args: list[str], takes_argv: bool = True) -> argparse.Namespace:
    """Call ``main`` with ``args`` but stop right after its argparse parser accepted them (``--help`` counts as
    accepted); raises AssertionError with argparse's message when it rejects them."""
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        unchecked_inputs(self)
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


def load_module(module: str):
    """The module ``python -m module`` runs (its ``__main__`` when the package has no ``main``)."""
    try:
        loaded = importlib.import_module(module)
        if not hasattr(loaded, "main"):
            loaded = importlib.import_module(f"{module}.__main__")
    except ImportError as error:
        raise AssertionError(f"python -m {module}: no such module ({error})") from None
    return loaded


def check_module(module: str, args: list[str], elided: bool = False) -> str:
    """``python -m module args``: the module's ``main(argv)`` parser accepts ``args`` (with a part elided: knows
    its flags)."""
    loaded = load_module(module)
    if elided:
        return check_flags(loaded.main, args)
    parse_with_argparse(loaded.main, args)
    return f"{module}'s argparse parser accepts the arguments"


def load_script(script: str):
    """``script`` (relative to the repository) loaded as a module, as ``python script`` would import it."""
    path = ROOT / script
    if not path.is_file():
        raise AssertionError(f"{script} does not exist")
    spec = importlib.util.spec_from_file_location(f"readme_script_{path.stem}", path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded  # dataclasses look their module up there
    sys.path.insert(0, str(path.parent))  # as `python path/to/script.py` puts the script's folder first
    try:
        spec.loader.exec_module(loaded)
    finally:
        sys.path.remove(str(path.parent))
    return loaded


def check_script(script: str, args: list[str], elided: bool = False) -> str:
    """``python path/to/script.py args`` (not train.py / eval.py): the script's ``main`` parser accepts them (with
    a part elided: knows their flags)."""
    path = ROOT / script
    if path.is_file() and "parse" not in path.read_text():  # no argparse parser, its own or a helper's
        if args:
            raise AssertionError(f"{script} takes no command-line arguments, given {args}")
        load_script(script)
        return f"{script} takes no arguments"
    loaded = load_script(script)
    takes_argv = loaded.main.__code__.co_argcount > 0
    if elided:
        return check_flags(loaded.main, args, takes_argv)
    parse_with_argparse(loaded.main, args, takes_argv)
    return f"{script}'s argparse parser accepts the arguments"


def check_name(text: str) -> str:
    """A prose span that only names a program (:func:`is_name`): the module imports, the program is installed."""
    import shutil

    argv = split_env(shlex.split(text))[1]
    if program(argv) in PYTHON and argv[1:2] == ["-m"] and len(argv) == 3:
        load_module(argv[2])
        return f"module {argv[2]} exists"
    if program(argv) in PYTHON or shutil.which(argv[0]):
        return f"{argv[0]} is installed"
    raise AssertionError(f"{argv[0]}: no such program installed")


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


def check_hydra(script: str, args: list[str], elided_keys: Sequence[str] = ()) -> str:
    """``python train.py|eval.py [-m] overrides``: every job's config composes and passes the config checks; a
    key whose value is elided (``run_dir=…``) or a glob (``experiment=generator_*``) must exist (a config key, or a
    config group with a matching file)."""
    from hkrag.tasks.validation import validate_config

    multirun = any(arg in HYDRA_FLAGS for arg in args)
    flags = [arg for arg in args if arg.startswith("-") and arg not in HYDRA_FLAGS]
    if flags:
        raise AssertionError(f"{script}: unexpected flags {flags}")
    globs = [arg for arg in args if re.fullmatch(r"[\w/]+=[\w-]*\*[\w*-]*", arg)]
    jobs = hydra_jobs([arg for arg in args if arg not in HYDRA_FLAGS and arg not in globs], multirun)
    for job in jobs:
        try:
            cfg = compose(script, job)
        except Exception as error:  # Hydra's errors name the override: show them whole
            raise AssertionError(f"{script} {' '.join(job)} does not compose: {error}") from None
        validate_config(cfg)
    for override in globs:
        key, pattern = override.split("=", 1)
        if not list((ROOT / "conf" / key).glob(f"{pattern}.yaml")):
            raise AssertionError(f"{script} {override}: no conf/{key}/{pattern}.yaml")
    missing = [key for key in elided_keys
               if OmegaConf.select(cfg, key, default="?") == "?" and not (ROOT / "conf" / key).is_dir()]
    if missing:
        raise AssertionError(f"{script}: no config key or group {missing}")
    return f"{len(jobs)} Hydra job(s) of {script} compose and pass validate_config"


def check_accelerate(args: list[str]) -> str:
    """``accelerate launch [options] script overrides``: accelerate's parser takes the options, the config file
    exists and loads (with its DeepSpeed JSON), and the script's overrides compose."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    if args[:1] != ["launch"]:
        raise AssertionError(f"accelerate {args[:1]}: only `accelerate launch` is expected")
    if not any(arg.endswith(".py") for arg in args):  # prose naming a launch's options, its script named apart
        return check_flags(lambda argv: launch_command_parser().parse_args(argv), args[1:])
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
    project = pyproject()["project"]["name"]
    for requirement in requirements:
        if requirement.name == project and requirement.extras - extras_known:
            raise AssertionError(f"pip install {requirement}: no extra {sorted(requirement.extras - extras_known)} in "
                                 f"pyproject.toml (has {sorted(extras_known)})")
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


def check_python(argv: list[str], elided: bool = False, elided_keys: Sequence[str] = ()) -> str:
    """A ``python ...`` command line (after the interpreter); ``elided``: part of it is left out (``…``), among
    it the values of ``elided_keys``."""
    if argv[:1] == ["-m"]:
        module, args = argv[1], argv[2:]
        if module == "pytest":
            return check_pytest(args)
        if module == "pip":
            return check_pip(args)
        return check_module(module, args, elided)
    if argv[0] in HYDRA_SCRIPTS:
        return check_hydra(argv[0], argv[1:], elided_keys)
    if argv[0].endswith(".py"):
        return check_script(argv[0], argv[1:], elided)
    raise AssertionError(f"python {argv[0]}: not a module, script or Hydra entry point")


def check_parses(text: str) -> str:
    """Check ``text`` (placeholders filled with :data:`PARSE_VALUES`) parses; what was checked, or AssertionError."""
    _, argv = split_env(shlex.split(concrete(text, PARSE_VALUES)))
    name = program(argv)
    elided_keys = [match.group(1)[:-1].lstrip("+~") for match in ELISION.finditer(text) if match.group(1)]
    if name in PYTHON:
        return check_python(argv[1:], elided(text), elided_keys)
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

"""The docs a new user reads (README.md, engine/*.md, kernels/KERNELS.md) name only commands, flags,
defaults and metrics that exist: each `xlaserve ...` command in their shell blocks names only flags its
(sub)command has, each `--flag` they name is some command's, the CLI synopsis shows each flag's real
default, each `xlaserve:` metric they name is reported, the README's test command is the one CI runs, and
each `Class.method(args)` engine/INTERFACES.md names takes arguments of those names."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import pkgutil
import re
import shlex
from pathlib import Path

import pytest

import xlaserve
from xlaserve.engine.metrics import PREFIX, EngineMetrics
from xlaserve.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    "README.md",
    "engine/INTERFACES.md",
    "engine/SPEC_DECODE.md",
    "engine/QUANTIZATION.md",
    "kernels/KERNELS.md",
]
# Other tools' flags the docs name beside ours: pip's, pytest-xdist's, lm-eval's.
FOREIGN_FLAGS = {"--no-deps", "--dist", "--no-loadscope-reorder", "--tasks"}
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w])")
MODULE = re.compile(r"python -m (xlaserve[\w.]*)")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {name for action in parser._actions for name in action.option_strings}


def all_options(parser: argparse.ArgumentParser) -> set[str]:
    found = options(parser)
    for sub in subparsers(parser).values():
        found |= all_options(sub)
    return found


def module_options(module: str) -> set[str]:
    """The flags of a `python -m xlaserve...` tool, read from its `--help` (its parser is built in main)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    return set(FLAG.findall(out.getvalue())) | set(re.findall(r"(?<![\w-])-[a-z]+\b", out.getvalue()))


def shell_lines(text: str):
    """(line number, command line) of every line in the text's shell blocks, continuations joined."""
    fence, joined, first = None, "", 0
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:]
            continue
        if fence not in ("bash", "sh", "console", ""):
            continue
        first = first if joined else number
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        try:
            shlex.split(joined + line, comments=True)
        except ValueError:  # a quoted argument goes on over the next line (a curl's JSON body)
            joined += line + "\n"
            continue
        yield first, joined + line
        joined = ""


def xlaserve_commands(text: str):
    """(line number, argv after `xlaserve`) of each `xlaserve` command in the shell blocks."""
    for number, line in shell_lines(text):
        lexer = shlex.shlex(line.replace("[", " ").replace("]", " "), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for word in [*lexer, ";"]:
            # A shell operator ends a command, and so does a second `xlaserve`: two hosts' commands side
            # by side (README's multi-host example).
            if word.strip("&|;<>()") == "" or (word == "xlaserve" and words):
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                    words.pop(0)  # XLA_FLAGS=... xlaserve ...
                if words[:1] == ["xlaserve"]:
                    yield number, words[1:]
                words = []
            if word.strip("&|;<>()"):
                words.append(word)


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


@pytest.fixture(scope="module")
def docs() -> dict[str, str]:
    return {name: (ROOT / name).read_text() for name in DOCS}


def command_parser(parser, argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The (sub)command's parser an argv reaches, and the words after its name."""
    words = list(argv)
    while words and words[0] in subparsers(parser):
        parser = subparsers(parser)[words.pop(0)]
    return parser, words


def test_every_xlaserve_command_in_the_docs_names_its_own_flags(parser, docs):
    wrong, seen = [], 0
    for name, text in docs.items():
        for number, argv in xlaserve_commands(text):
            seen += 1
            command, words = command_parser(parser, argv)
            if command is parser:
                wrong.append(f"{name}:{number}: no such command: xlaserve {' '.join(argv)}")
                continue
            own = options(command) | {"-h", "--help"}
            words = words[: words.index("--")] if "--" in words else words  # the rest goes on to another
            for word in words:
                flag = word.split("=")[0]
                if flag.startswith("-") and not re.fullmatch(r"-\d.*", flag) and flag not in own:
                    wrong.append(f"{name}:{number}: `{command.prog}` has no {flag}")
    assert seen > 30  # the blocks were found
    assert wrong == [], "\n".join(wrong)


def test_every_flag_the_docs_name_exists(parser, docs):
    known = all_options(parser) | FOREIGN_FLAGS
    for text in docs.values():
        for module in set(MODULE.findall(text)):
            known |= module_options(module.rstrip("."))
    unknown = [
        f"{name}:{number}: {flag}"
        for name, text in docs.items()
        for number, line in enumerate(text.split("\n"), 1)
        for flag in FLAG.findall(line)
        if flag not in known
    ]
    assert unknown == []


def test_the_cli_synopsis_shows_each_flags_default(parser, docs):
    """In the README's CLI block `[--flag NUMBER]` shows the flag's default; a word is a choice
    (`[--backend hf]`) and a capital a placeholder (`[--input-len N]`)."""
    text = docs["README.md"]
    block = text.split("## CLI\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    checked = 0
    for line in block.split("\n"):
        argv = shlex.split(line.split(" #")[0].replace("[", " [ ").replace("]", " ] "))
        if argv[:1] != ["xlaserve"]:
            continue
        command, words = command_parser(parser, argv[1:])
        actions = {name: action for action in command._actions for name in action.option_strings}
        for i, word in enumerate(words[:-2]):
            value = words[i + 1]
            if word not in actions or words[i + 2] != "]" or not re.fullmatch(r"[\d.]+", value):
                continue
            action, where = actions[word], f"{command.prog} {word}"
            assert action.default is not None, f"{where}: no default, the synopsis shows {value}"
            parse = action.type if callable(action.type) else str  # a str default goes through it too
            default = parse(action.default) if isinstance(action.default, str) else action.default
            assert parse(value) == default, f"{where}: default {action.default!r}, the synopsis shows {value}"
            checked += 1
    assert checked >= 8


def test_the_metrics_the_readme_lists_are_the_engines(docs):
    """`/metrics` section: each name listed (Prometheus adds `_total` to a counter) is one the engine
    reports, less the server's own restart counter."""
    section = docs["README.md"].split("`/metrics` has vLLM's metric names", 1)[1].split("\n\n", 1)[0]
    section = section.split("`cache_config_info`")[0]  # then its labels, the cache's settings
    listed = set(re.findall(r"`([a-z_]+)(?:\{[a-z_]+\})?`", section)) - {"model_name", "max_tokens", "n"}
    reported = {m.name.removeprefix(PREFIX) for m in EngineMetrics().snapshot()}
    counters = {name + "_total" for name in reported}
    missing = sorted(name for name in listed if name not in reported | counters)
    assert len(listed) > 15
    assert missing == ["engine_core_restarts_total"]  # the API server's, beside the engine's


def test_the_readme_test_command_is_what_ci_runs(docs):
    setup = docs["README.md"].split("## Set up\n", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2  # the main job's, and the tests'
    readme_pytest = commands[1].split("&& ")[-1].split()
    ci = (ROOT / ".ci" / "run").read_text()
    [ci_pytest] = [
        line.split(" ||")[0].split() for line in ci.split("\n") if line.startswith("python -m pytest")
    ]
    assert [w for w in ci_pytest if not w.startswith("--durations")] == readme_pytest
    for install in re.findall(r"^pip install .*$", ci, re.M):
        assert install.replace("-q ", "") in commands[1]


def test_every_metric_the_docs_name_is_reported(docs):
    """`xlaserve:NAME` anywhere in the docs: a metric the engine or the server reports (the names built
    from PREFIX in the metrics modules, and the gauges set once the engine is ready), `_total` and a
    histogram's `_bucket` as Prometheus adds them."""
    sources = [ROOT / "engine/engine/metrics.py", ROOT / "engine/entrypoints/serving/metrics.py"]
    reported = {m.name.removeprefix(PREFIX) for m in EngineMetrics().snapshot()}
    reported |= {
        name for path in sources for name in re.findall(r'(?:PREFIX \+ |gauges\[)"(\w+)"', path.read_text())
    }
    named = {name for text in docs.values() for name in re.findall(r"xlaserve:(\w+)", text)}
    unknown = sorted(n for n in named if re.sub(r"_(total|bucket|sum|count)$", "", n) not in reported)
    assert len(named) > 10
    assert unknown == []


def test_interfaces_name_each_methods_own_arguments():
    """engine/INTERFACES.md is read beside the code: a `Class.method(a, b)` it names must take `a` and `b`
    (a renamed parameter left in the text sends a reader looking for the wrong name)."""
    found = {}
    for info in pkgutil.walk_packages(xlaserve.__path__, "xlaserve."):
        if "grpc" in info.name:  # generated stubs, and grpcio is not every install's
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == info.name:
                found.setdefault(name, value)
    text = (ROOT / "engine/INTERFACES.md").read_text()
    wrong, checked = [], 0
    for match in re.finditer(r"`([A-Z]\w*)\.([a-z_]\w*)\(([^`()]*)\)`", text):
        owner, method, args = match.groups()
        if owner not in found or not callable(getattr(found[owner], method, None)):
            continue
        params = inspect.signature(getattr(found[owner], method)).parameters
        for arg in (a.strip().lstrip("*") for a in args.split(",")):
            name = re.split(r"[=:\s\[]", arg)[0]
            if name.isidentifier():
                checked += 1
                if name not in params:
                    wrong.append(f"{owner}.{method}: {name!r} (its parameters: {list(params)})")
    assert checked > 20 and not wrong, wrong

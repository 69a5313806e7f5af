"""Engine arguments, defined once: vLLM's flag names, mapped onto `EngineConfig.from_kwargs`.

Every command that builds an engine (generate, chat, serve, bench) takes these flags from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
import typing

from xlaserve.config import ARG_KEY, CONFIG_GROUPS, Arg, EngineConfig
from xlaserve.entrypoints.serving.reasoning import REASONING_PARSERS, get_reasoning_parser
from xlaserve.entrypoints.serving.tool_parsers import default_tool_parser, get_tool_parser

# The argparse group of each sub-config's flags (the rest are "engine").
_FLAG_GROUPS = {"lora": "LoRA", "parallel": "parallelism"}


def engine_arg_fields() -> list[tuple[str, dataclasses.Field]]:
    """Every engine argument field, with the `EngineConfig` group it belongs to ("speculative" for
    the JSON one), in the order the flags are listed."""
    found = [(group, f) for group, klass in CONFIG_GROUPS.items() for f in dataclasses.fields(klass)]
    found += [("speculative", f) for f in dataclasses.fields(EngineConfig) if f.name == "speculative"]
    return found


def _flag_type(field: dataclasses.Field, owner: type) -> type:
    """The field's type without None (a nested config is given as JSON text)."""
    hint = typing.get_type_hints(owner)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = args[0]
    return str if dataclasses.is_dataclass(base) else base


def _add_flag(group, field: dataclasses.Field, owner: type) -> None:
    spec: Arg = field.metadata[ARG_KEY]
    names = [spec.flag_for(field.name), *spec.aliases]
    kind = _flag_type(field, owner)
    # Every flag defaults to None: unset keeps the config's default (engine_kwargs leaves it out).
    options = {"default": None, "help": spec.help, "dest": spec.kwarg_for(field.name)}
    if kind is bool:
        # A switch that is on by default (or decided at start: None) must be able to say no.
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        can_be_on = default is not False
        options["action"] = argparse.BooleanOptionalAction if can_be_on else "store_true"
    elif typing.get_origin(kind) is tuple:  # a list of values: --flag 1 4 16
        options.update(type=typing.get_args(kind)[0], nargs="+")
    else:
        options["type"] = None if kind is str else kind
        if spec.choices is not None:
            options["choices"] = list(spec.choices)
    group.add_argument(*names, **options)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flag names, one per config field: help, choices and spelling from the field's
    `Arg` (config_args.py), type from its annotation; unset flags keep the config's defaults."""
    groups = {name: parser.add_argument_group(name) for name in ("engine", "LoRA", "parallelism")}
    owners = {**CONFIG_GROUPS, "speculative": EngineConfig}
    for group, field in engine_arg_fields():
        if field.metadata[ARG_KEY].is_flag:
            _add_flag(groups[_FLAG_GROUPS.get(group, "engine")], field, owners[group])
    groups["LoRA"].add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='adapters served from the start: name=path, or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}; a request picks one by its "model"',
    )


def _set_engine_args(args: argparse.Namespace) -> dict:
    kwargs = {}
    for group, field in engine_arg_fields():
        spec = field.metadata[ARG_KEY]
        key = spec.kwarg_for(field.name)
        if spec.is_flag and key != "model" and getattr(args, key, None) is not None:
            kwargs[key] = getattr(args, key)
    return kwargs


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments the user set (unset ones keep the config defaults), as
    `EngineConfig.from_kwargs` names them; checked here, before anything is loaded (for commands that
    build several engines from them: the benchmarks)."""
    kwargs = _set_engine_args(args)
    EngineConfig.from_kwargs(args.model, **kwargs)  # validate before loading anything
    return kwargs


def engine_config(args: argparse.Namespace, **extra) -> EngineConfig:
    """The one EngineConfig of a command that builds one engine (`serve`): the flags set, plus `extra`
    (settings with flags of the command's own, such as max_num_queued_reqs)."""
    return EngineConfig.from_kwargs(args.model, **_set_engine_args(args), **extra)


def parse_lora_modules(values: list[str] | None) -> list[dict]:
    """--lora-modules entries (vLLM's forms: `name=path`, or a JSON object with name, path and
    optionally base_model_name) as {"name", "path", "base_model_name"} dicts."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--lora-modules: {value!r} is not valid JSON ({e})") from None
            if (
                not isinstance(entry, dict)
                or not {"name", "path"} <= set(entry)
                or set(entry)
                - {
                    "name",
                    "path",
                    "base_model_name",
                }
            ):
                raise ValueError(
                    f"--lora-modules: {value!r} must be an object with name, path and optionally "
                    "base_model_name"
                )
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {value!r} is neither name=path nor a JSON object")
            entry = {"name": name, "path": path}
        modules.append({"base_model_name": None, **entry})
    return modules


def run_follower_if_needed(args: argparse.Namespace, kwargs: dict | None = None) -> bool:
    """On node_rank > 0 of a multi-host engine, serve process 0's steps instead of the command, with the
    engine process 0 builds: `kwargs` when the command sizes it beyond the flags (`generate`'s one-request
    defaults), else the flags' (`engine_kwargs`). Both must build the same programs, or a step's
    collectives would wait on each other for good."""
    if not getattr(args, "node_rank", None):
        return False
    from xlaserve.entrypoints.llm import serve_follower  # jax and the model code: only when needed
    from xlaserve.executor import ProcessZeroLost

    try:
        serve_follower(args.model, **(engine_kwargs(args) if kwargs is None else kwargs))
    except ProcessZeroLost:
        # Exit at once, code 1: past this, JAX's exit handler would wait on process 0's coordination
        # service until JAX's own heartbeat timeout (100 s) aborts the process.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return True


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's server flags for tool calling and reasoning models (`xlaserve serve`)."""
    g = parser.add_argument_group("tools and reasoning")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); its calls are read by '
        "--tool-call-parser. On by default when the model's family has a known parser",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how the model writes tool calls: hermes, llama3_json, mistral, openai (gpt-oss's harmony), "
        "qwen3_coder, pythonic, deepseek_v3, deepseek_v31, granite, glm45 "
        '(default: from the model family); "none": no parser, auto tool choice off',
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help=f"split a reasoning model's thinking into reasoning_content: {', '.join(REASONING_PARSERS)}",
    )


def _model_type(model: str | None) -> str | None:
    """The HF model_type of a model directory (None for GGUF files and the embedded model)."""
    path = os.path.join(model, "config.json") if model and os.path.isdir(model) else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("model_type")


@dataclasses.dataclass(frozen=True)
class ToolChoiceSetting:
    """The server's auto tool choice, decided at start from the flags and the model's family."""

    enable_auto_tool_choice: bool
    tool_call_parser: str | None  # the parser's name; None: calls are never parsed from free text
    reason: str  # why, for the start-up log

    def log_line(self) -> str:
        state = f"on, parser {self.tool_call_parser}" if self.enable_auto_tool_choice else "off"
        return f"auto tool choice {state} ({self.reason})"


def auto_tool_choice(args: argparse.Namespace) -> ToolChoiceSetting:
    """vLLM's flags as vLLM reads them (--enable-auto-tool-choice with --tool-call-parser NAME; a
    parser named alone reads only forced calls), and beyond vLLM: with neither flag, auto tool choice is
    on when the model's family has a known parser (clients such as pydantic-ai, litellm and the Agents
    SDK send tool_choice "auto" whenever they send tools). `--tool-call-parser none` turns that off."""
    name = args.tool_call_parser
    if name == "none":
        if args.enable_auto_tool_choice:
            raise ValueError("--enable-auto-tool-choice needs a parser: --tool-call-parser none turns it off")
        return ToolChoiceSetting(False, None, "--tool-call-parser none")
    if name is not None:
        get_tool_parser(name)  # a bad name fails at once
        return ToolChoiceSetting(args.enable_auto_tool_choice, name, f"--tool-call-parser {name}")
    family = _model_type(args.model)
    default = default_tool_parser(family)
    if default is None:
        if args.enable_auto_tool_choice:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser: this model's family has no default"
            )
        model = f"model family {family!r}" if family else "a model without an HF model_type"
        why = f"{model} has no known tool call parser: --enable-auto-tool-choice --tool-call-parser NAME"
        return ToolChoiceSetting(False, None, why)
    flag = "--enable-auto-tool-choice" if args.enable_auto_tool_choice else "by default"
    why = f"{flag}: model family {family!r} writes {default}'s format; --tool-call-parser none turns it off"
    return ToolChoiceSetting(True, default, why)


def tool_options(args: argparse.Namespace) -> dict:
    """The flags of `add_tool_args` as ServerState fields (parser classes); ValueError on a bad name."""
    setting = auto_tool_choice(args)
    name = setting.tool_call_parser
    return {
        "enable_auto_tool_choice": setting.enable_auto_tool_choice,
        "tool_parser_cls": get_tool_parser(name) if name is not None else None,
        "reasoning_parser_cls": get_reasoning_parser(args.reasoning_parser)
        if args.reasoning_parser
        else None,
    }

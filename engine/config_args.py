"""How an engine argument reads on the command line, declared beside its config field.

Each config field (config/) carries an `Arg` in its metadata: plain data, so the flag's help cannot
drift from the field and the config imports nothing of argparse. entrypoints/arg_utils.py turns it
into a flag, with the type from the field's annotation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARG_KEY = "arg"  # the key of a field's `Arg` in its dataclass field metadata


@dataclass(frozen=True)
class Arg:
    """How an engine argument reads on the command line. Kept as data beside the field, so the flag's
    help cannot drift from the field, and the config imports nothing of argparse: the flag's type,
    its bool form (--x or --x/--no-x) and its default (unset: the field's) come from the field."""

    help: str
    flag: str | None = None  # None: --field-name; else a CLI-only spelling (--scheduling-policy)
    aliases: tuple[str, ...] = ()  # short forms, e.g. -tp
    choices: tuple[str, ...] | None = None
    is_flag: bool = True  # False: no engine flag; `help` says where the value is set instead

    def flag_for(self, name: str) -> str:
        return self.flag or "--" + name.replace("_", "-")

    def kwarg_for(self, name: str) -> str:
        """The keyword `EngineConfig.from_kwargs` (and the flag's argparse dest) knows it by."""
        return self.flag_for(name)[2:].replace("-", "_")


def arg(help: str, **spec) -> dict:
    """Field metadata declaring the field's flag (see `Arg`)."""
    return {ARG_KEY: Arg(help, **spec)}


def not_a_flag(where: str) -> dict:
    """Field metadata for a field with no engine flag (`where`: what sets it)."""
    return {ARG_KEY: Arg(where, is_flag=False)}


def json_object(value, name: str) -> dict:
    """A nested config's value as a dict: a dict as it is, its JSON text (the CLI's flag) parsed; anything
    else a ValueError naming `name` (speculative_config, pooler_config)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value

"""Requests' default sampling from a model's generation_config.json (vLLM's --generation-config and
--override-generation-config), and the ids that end a sequence by it. ModelConfig reads them once, when
it is built, so that a value no request could take fails the start rather than every request."""

from __future__ import annotations

import json
import logging
import os

from xlaserve.config.checks import require
from xlaserve.config_args import json_object
from xlaserve.sampling_params import SamplingParams
from xlaserve.structured_outputs_params import is_int

logger = logging.getLogger(__name__)

# What vLLM takes from a model's generation_config.json as requests' defaults (--generation-config).
GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
_SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}


def parse_override(override: str | dict) -> str:
    """--override-generation-config's JSON text (or a dict) as sorted JSON text, the config's form;
    ValueError naming keys that are not GENERATION_CONFIG_KEYS."""
    fields = json_object(override, "override_generation_config")
    unknown = sorted(set(fields) - set(GENERATION_CONFIG_KEYS))
    require(
        not unknown,
        f"override_generation_config: unknown keys {unknown}; known: {list(GENERATION_CONFIG_KEYS)}",
    )
    return json.dumps(fields, sort_keys=True)


def read_generation_config(folder: str | None) -> tuple[str | None, dict | None]:
    """`folder`'s generation_config.json: its path and its fields, None for a file that is not there.
    Read once, for the sampling defaults and the EOS ids both."""
    path = None if folder is None else os.path.join(folder, GENERATION_CONFIG_FILE)
    if path is None or not os.path.isfile(path):
        return path, None
    with open(path) as f:
        return path, json_object(f.read(), f"generation_config ({path})")


def sampling_defaults(path: str | None, fields: dict | None, override: str | None) -> dict:
    """Requests' default sampling fields (vLLM's get_diff_sampling_param): those of GENERATION_CONFIG_KEYS
    the generation config (`fields`, read from `path`; None under generation_config "vllm") sets, then
    the override's (JSON text) over them, with max_new_tokens as SamplingParams' max_tokens. {} when
    neither says anything. A value SamplingParams refuses is a ValueError naming its source and field,
    at start rather than in every request."""
    found = {}
    if fields is not None:
        found = {k: v for k, v in fields.items() if k in GENERATION_CONFIG_KEYS and v is not None}
    overrides = {} if override is None else json.loads(override)
    defaults = {_SAMPLING_NAMES.get(k, k): v for k, v in {**found, **overrides}.items()}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        source = " and ".join([path] * bool(found) + ["override_generation_config"] * bool(overrides))
        raise ValueError(f"the default sampling from {source}: {e}") from None
    return defaults


def eos_token_ids(fields: dict | None, folder: str | None) -> tuple[int, ...]:
    """The generation config's (`fields`) eos_token_id (an id or a list), else `folder`'s config.json's,
    as vLLM's try_get_generation_config: under generation_config "vllm" too, which drops only the
    sampling defaults."""
    if fields is None:
        path = None if folder is None else os.path.join(folder, "config.json")
        if path is None or not os.path.isfile(path):
            return ()
        with open(path) as f:
            fields = json_object(f.read(), f"config.json ({path})")
    eos = fields.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if is_int(i) and i >= 0)


def log_sampling_defaults(defaults: dict) -> None:
    if defaults:  # vLLM warns too: a request's sampling changes with no word from its client
        logger.warning(
            "requests' default sampling is %s, from the model's generation config and "
            "--override-generation-config (--generation-config vllm: the engine's own)",
            defaults,
        )

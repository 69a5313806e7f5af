"""LoRA's engine arguments and --lora-modules (vLLM's two forms), without an engine."""

import argparse
import json

import pytest

from xlaserve.config import EngineConfig
from xlaserve.entrypoints.arg_utils import add_engine_args, engine_kwargs, parse_lora_modules
from xlaserve.lora_request import LoRARequest


def test_lora_modules_both_forms():
    modules = parse_lora_modules(
        ["sql=/a/sql", json.dumps({"name": "chat", "path": "/a/chat", "base_model_name": "base"})]
    )
    assert modules == [
        {"name": "sql", "path": "/a/sql", "base_model_name": None},
        {"name": "chat", "path": "/a/chat", "base_model_name": "base"},
    ]


@pytest.mark.parametrize(
    "value", ["sql", "=/a", "sql=", '{"name": "x"}', '{"name": "x", "path": "p", "r": 4}', "{bad"]
)
def test_bad_lora_modules_are_errors_naming_the_flag(value):
    with pytest.raises(ValueError, match="--lora-modules"):
        parse_lora_modules([value])


def test_lora_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "64", "--max-cpu-loras", "5"]
    )
    config = EngineConfig.from_kwargs(None, **engine_kwargs(args))
    assert (config.lora.enable_lora, config.lora.max_loras, config.lora.max_lora_rank) == (True, 3, 64)
    assert config.lora.num_cpu_loras == 5
    assert EngineConfig.from_kwargs(None, max_loras=2).lora.num_cpu_loras == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_loras": 0}, "max_loras"),
        ({"max_lora_rank": 0}, "max_lora_rank"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
    ],
)
def test_bad_lora_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(None, enable_lora=True, **kwargs)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("", 1, "/p"), "lora_name"),
        (("a", 0, "/p"), "lora_int_id"),
        (("a", True, "/p"), "lora_int_id"),
        (("a", 1, ""), "lora_path"),
    ],
)
def test_bad_lora_request_names_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        LoRARequest(*args)

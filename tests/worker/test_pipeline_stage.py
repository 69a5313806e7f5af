"""Pipeline stages on the host: how the layers and devices split, what each stage keeps, the flag, and
the configurations refused by name (the device side: tests/sharding/test_pipeline_parallel.py)."""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import pytest

from xlaserve.config import EngineConfig
from xlaserve.entrypoints.arg_utils import add_engine_args, engine_kwargs
from xlaserve.worker.pipeline_stage import StageLayout, split_layers, stage_devices

_HERE = os.path.dirname(os.path.abspath(__file__))  # a draft model path that exists, for config checks


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "sizes"),
    # As vLLM's get_pp_indices: the remainder one layer each to the stages before the last.
    [(4, 2, [2, 2]), (5, 2, [3, 2]), (7, 4, [2, 2, 2, 1]), (10, 4, [2, 3, 3, 2]), (30, 4, [7, 8, 8, 7])],
)
def test_layers_split_into_contiguous_stages(num_layers, num_stages, sizes):
    stages = split_layers(num_layers, num_stages)
    assert [len(s.layers) for s in stages] == sizes
    assert [i for s in stages for i in s.layers] == list(range(num_layers))
    assert [(s.is_first, s.is_last) for s in stages][0] == (True, num_stages == 1)
    assert stages[-1].is_last and not stages[-1].is_first


def test_more_stages_than_layers_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=5 exceeds the model's 4 layers"):
        split_layers(4, 5)


def _devices(num_devices: int, per_process: int | None = None) -> list:
    """Stand-ins for jax's global device list: `per_process` devices a process, process 0's first."""
    per_process = per_process or num_devices
    return [SimpleNamespace(id=i, process_index=i // per_process) for i in range(num_devices)]


def _ids(groups: list) -> list:
    return [[d.id for d in group] for group in groups]


def test_each_stage_gets_its_own_tensor_parallel_devices():
    assert _ids(stage_devices(_devices(8), 2, 3)) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size=4 x tensor_parallel_size=2 needs 8 devices, 6"
    ):
        stage_devices(_devices(6), 2, 4)


def test_a_stage_keeps_its_part_of_each_stack_and_the_modules_it_runs():
    first, middle, last = split_layers(6, 3)  # layers 0-1, 2-3, 4-5
    # DeepSeek-like stacks: one dense layer, then the rest; which of each stack's layers a stage keeps.
    dense, moe = range(0, 1), range(1, 6)

    def kept(stage, stack):
        return list(stack)[stage.stack_slice(stack)]

    assert (kept(first, dense), kept(first, moe)) == ([0], [1])
    assert (kept(middle, dense), kept(middle, moe)) == ([], [2, 3])
    assert (kept(last, dense), kept(last, moe)) == ([], [4, 5])
    assert [first.holds(m, False) for m in ("embed_tokens", "norm", "lm_head")] == [True, False, False]
    assert [middle.holds(m, False) for m in ("embed_tokens", "norm", "lm_head")] == [False, False, False]
    assert [last.holds(m, False) for m in ("embed_tokens", "norm", "lm_head")] == [False, True, True]
    assert last.holds("embed_tokens", True)  # a tied head reads the embedding on the last stage
    assert StageLayout(0, 1, range(4)).holds("lm_head", False)  # one stage runs everything


def test_a_hybrid_models_stacks_are_cut_where_a_stage_starts_inside_a_period():
    """A hybrid model's stacks hold every P-th layer (models/hybrid.py): a stage's part of each is one
    contiguous run of entries, whichever period position the stage starts at."""
    stacks = {"linear_layers_0": (0, 3, 6), "linear_layers_1": (1, 4, 7), "attention_layers_0": (2, 5, 8)}
    first, second = StageLayout(0, 2, range(0, 4)), StageLayout(1, 2, range(4, 9))
    for stage in (first, second):
        parts = {name: stack[stage.stack_slice(stack)] for name, stack in stacks.items()}
        assert sorted(layer for part in parts.values() for layer in part) == list(stage.layers)
    assert first.stack_slice(stacks["linear_layers_1"]) == slice(0, 1)  # layer 1 only
    assert second.stack_slice(stacks["linear_layers_1"]) == slice(1, 3)  # layers 4 and 7
    assert second.stack_slice(stacks["linear_layers_0"]) == slice(2, 3)  # layer 6; 3 is the first stage's


def test_the_flag_and_its_short_form_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv in (["--pipeline-parallel-size", "2"], ["-pp", "2"]):
        config = EngineConfig.from_kwargs(None, **engine_kwargs(parser.parse_args(argv)))
        assert config.parallel.pipeline_parallel_size == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be >= 1, got 0"),
        (
            {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2, "model": _HERE}},
            "pipeline_parallel_size=2 cannot be combined with speculative_config method 'draft_model'",
        ),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}, "nnodes": 2},
            "pipeline_parallel_size=2 cannot be combined with speculative_config across nnodes yet",
        ),
        (
            {"runner": "pooling", "nnodes": 2},
            "pipeline_parallel_size=2 cannot be combined with runner='pooling' across nnodes yet",
        ),
        (  # on stages on one host it runs (tests/sharding/test_context_parallel.py)
            {"kv_transfer_config": {"kv_connector": "JaxConnector", "kv_role": "kv_both"}, "nnodes": 2},
            "kv_transfer_config runs on one host",
        ),
    ],
)
def test_what_pipelines_do_not_run_yet_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(None, **{"pipeline_parallel_size": 2, **kwargs})


def test_lora_on_stages_reaches_the_config():
    for nnodes in (1, 2):
        config = EngineConfig.from_kwargs(None, pipeline_parallel_size=2, enable_lora=True, nnodes=nnodes)
        assert (config.parallel.pipeline_parallel_size, config.lora.enable_lora) == (2, True)


def test_stages_across_processes_are_refused_unless_each_lies_in_one_process():
    """Several processes (jax.distributed): a stage's devices in one process, every process a stage."""
    devices = _devices(4, per_process=2)
    assert _ids(stage_devices(devices, 2, 2)) == [[0, 1], [2, 3]]
    assert _ids(stage_devices(devices, 1, 4)) == [[0], [1], [2], [3]]
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2: stage 0's devices span processes \[0, 1\]"
    ):
        stage_devices(devices[::2] + devices[1::2], 2, 2)  # one device of each process per stage
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 x tensor_parallel_size=1 leaves process"):
        stage_devices(devices, 1, 2)  # both stages on process 0


def test_stages_on_several_processes_reach_the_config():
    config = EngineConfig.from_kwargs(None, pipeline_parallel_size=2, nnodes=2, node_rank=1)
    assert (config.parallel.pipeline_parallel_size, config.parallel.nnodes) == (2, 2)
    assert config.async_scheduling_off_reason() is not None  # the multi-host executor's steps: synchronous

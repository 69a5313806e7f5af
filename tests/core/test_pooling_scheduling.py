"""Pooling requests in the scheduler (no jax): chunked like any prompt, never sampled, finished when the
prompt is computed with the runner's pooled output, with async scheduling too."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.outputs import ModelRunnerOutput
from xlaserve.core.request import FinishReason, Request, RequestStatus
from xlaserve.core.scheduler import Scheduler
from xlaserve.pooling_params import PoolingParams
from xlaserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(*, async_scheduling=False) -> Scheduler:
    config = SimpleNamespace(
        max_num_seqs=4,
        max_num_batched_tokens=8,
        policy="fcfs",
        long_prefill_token_threshold=0,
        max_num_partial_prefills=4,
        max_long_partial_prefills=4,
    )
    cache = SimpleNamespace(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    return Scheduler(
        config, cache, 64, KVCacheManager(BLOCK_SIZE, 32, True, 64), async_scheduling=async_scheduling
    )


def pooling_request(request_id: str, num_tokens: int) -> Request:
    return Request(
        request_id,
        list(range(3, 3 + num_tokens)),
        SamplingParams(max_tokens=1, temperature=0.0),
        pooling_params=PoolingParams(task="embed"),
    )


def run(scheduler: Scheduler, pooled=lambda s: np.array([float(s.request.num_prompt_tokens)], np.float32)):
    """Step until idle (async: one step in flight); -> (outputs by request id, steps, rows per step)."""
    outputs, rows, in_flight = {}, [], None
    while scheduler.has_unfinished_requests() or in_flight is not None:
        scheduled = scheduler.schedule()
        rows.append([(s.request_id, s.num_new_tokens) for s in scheduled.scheduled])
        result = ModelRunnerOutput()
        for s in scheduled.scheduled:
            if s.request.pooling_params is not None:
                assert not s.is_sampling
            elif s.is_sampling:
                result.sampled_token_ids[s.request_id] = 7
            if s.is_pooling and pooled(s) is not None:
                result.pooler_output[s.request_id] = pooled(s)
        step = (scheduled, result)
        if scheduler.async_scheduling:
            step, in_flight = in_flight, (step if scheduled.scheduled else None)
            if step is None:
                continue
        for out in scheduler.update_from_output(*step):
            outputs.setdefault(out.request_id, []).append(out)
    return outputs, rows


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_long_prompt_is_chunked_and_pooled_once(async_scheduling):
    scheduler = make_scheduler(async_scheduling=async_scheduling)
    scheduler.add_request(pooling_request("long", 19))
    scheduler.add_request(pooling_request("short", 3))
    generating = Request("gen", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    scheduler.add_request(generating)
    outputs, rows = run(scheduler)
    assert [n for step in rows for rid, n in step if rid == "long"] == [8, 8, 3]  # computed once, in chunks
    for rid, num_tokens in (("long", 19), ("short", 3)):
        (out,) = outputs[rid]  # one output: the finished one
        assert out.finish_reason == FinishReason.STOP and out.new_token_ids == []
        assert out.pooling_output.tolist() == [num_tokens]
    assert generating.output_token_ids == [7, 7]  # a generation request beside them still samples
    assert not scheduler.requests and scheduler.kv_cache_manager.usage == 0.0


def test_a_missing_pooled_output_finishes_with_an_error():
    scheduler = make_scheduler()
    request = pooling_request("lost", 5)
    scheduler.add_request(request)
    outputs, _ = run(scheduler, pooled=lambda s: None)
    assert outputs["lost"][0].finish_reason == FinishReason.ERROR
    assert request.status == RequestStatus.FINISHED_ERROR and not scheduler.requests


def test_encoder_prompts_run_whole_in_one_step():
    """enable_chunked_prefill=False (an encoder-only model): a prompt that does not fit what is left of
    a step waits for the next instead of being split, and a shorter one behind it may go first."""
    config = SimpleNamespace(
        max_num_seqs=4,
        max_num_batched_tokens=8,
        policy="fcfs",
        long_prefill_token_threshold=2,  # ignored: no chunks at all
        max_num_partial_prefills=4,
        max_long_partial_prefills=4,
    )
    cache = SimpleNamespace(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    scheduler = Scheduler(
        config, cache, 8, KVCacheManager(BLOCK_SIZE, 32, False, 8), enable_chunked_prefill=False
    )
    for rid, n in (("a", 5), ("b", 6), ("c", 3)):
        scheduler.add_request(pooling_request(rid, n))
    outputs, rows = run(scheduler)
    assert [step for step in rows if step] == [[("a", 5), ("c", 3)], [("b", 6)]]
    assert sorted(outputs) == ["a", "b", "c"]

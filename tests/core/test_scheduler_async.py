"""Async scheduling's placeholders, without jax: a fake device whose step N+1 reads the ids step N
sampled from its own memory (as the runner's `last_sampled`), driven one step late as EngineCore
drives it, against the same fake run synchronously. Streams, finish reasons, the prefix index and
the free blocks must all come out the same."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlaserve.core.request import Request, RequestStatus
from xlaserve.core.scheduler import Scheduler
from xlaserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 7
_arrivals = itertools.count()


def make_scheduler(*, is_async, num_blocks=64, max_num_batched_tokens=32, max_model_len=64, policy="fcfs"):
    config = SimpleNamespace(
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,
        long_prefill_token_threshold=0,
        max_num_partial_prefills=8,
        max_long_partial_prefills=8,
    )
    manager = KVCacheManager(BLOCK_SIZE, num_blocks, True, max_model_len)
    return Scheduler(
        config, SimpleNamespace(block_size=BLOCK_SIZE), max_model_len, manager, async_scheduling=is_async
    )


def make_request(request_id, prompt, max_tokens=8, **params):
    return Request(
        request_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=EOS,
        arrival_time=float(next(_arrivals)),
    )


class FakeDevice:
    """A paged KV cache of token ids. A step writes its tokens, taking a placeholder's id from the
    previous step's sampled ids at `prev_sampled_row`, and samples f(context read back) for each
    sampling row. Only it ever sees a placeholder's id before the scheduler does."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.kv = np.full((scheduler.kv_cache_manager.num_blocks, BLOCK_SIZE), -1, np.int64)
        self.last_sampled: list[int] = []

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result, sampled = ModelRunnerOutput(), []
        for s in output.scheduled:
            ids = list(s.token_ids)
            if s.prev_sampled_row >= 0:
                assert len(ids) == s.num_new_tokens - 1
                ids.append(self.last_sampled[s.prev_sampled_row])
            assert len(ids) == s.num_new_tokens
            for position, token_id in enumerate(ids, s.num_computed_tokens):
                self.kv[s.block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE] = token_id
        for s in output.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            context = [int(self.kv[s.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE]) for p in range(end)]
            # Mostly the context's sum; EOS now and then so that stops land mid-stream.
            token = EOS if sum(context) % 11 == 0 else sum(context) % 97 + 10
            sampled.append(token)
            if s.is_sampling:
                result.sampled_token_ids[s.request_id] = token
        self.last_sampled = sampled
        self._check_prefix_index()
        return result

    def _check_prefix_index(self) -> None:
        # A hashed block holds exactly the known ids its request's hashes stand for.
        manager = self.scheduler.kv_cache_manager
        for request in self.scheduler.requests.values():
            blocks = manager.get_blocks(request.request_id)
            for index in range(manager.num_cached_blocks.get(request.request_id, 0)):
                tokens = request.all_token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
                assert list(self.kv[blocks[index].block_id]) == tokens


def run(scheduler, requests, *, abort_after=None):
    """Step until idle, applying each step's outputs one step late when the scheduler is async (as
    EngineCore does). abort_after: {request id: abort once this many tokens were streamed}."""
    device = FakeDevice(scheduler)
    for request in requests:
        scheduler.add_request(request)
    free_blocks = scheduler.kv_cache_manager.num_free_blocks
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str] = {}
    in_flight = None

    def apply(pending):
        for out in scheduler.update_from_output(*pending):
            assert out.request_id not in reasons, "a token after the request finished"
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
            limit = (abort_after or {}).get(out.request_id)
            if limit is not None and len(tokens[out.request_id]) >= limit and out.finish_reason is None:
                scheduler.finish_requests(out.request_id, RequestStatus.FINISHED_ABORTED)
                reasons[out.request_id] = "abort"

    for _ in range(2000):
        if not scheduler.has_unfinished_requests() and in_flight is None:
            break
        output = scheduler.schedule()
        for s in output.scheduled:  # never past max_tokens counting what is in flight
            req = s.request
            assert req.num_output_tokens + req.num_output_placeholders <= req.max_tokens
        pending = (output, device.execute(output))
        if in_flight is not None:
            apply(in_flight)
        in_flight = pending
        if not scheduler.async_scheduling:
            apply(in_flight)
            in_flight = None
        elif not scheduler.has_unfinished_requests():
            apply(in_flight)
            in_flight = None
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == free_blocks  # no block leaked
    assert all(r.num_output_placeholders == 0 for r in requests)
    return tokens, reasons


def _requests(specs):
    return [make_request(f"r{i}", prompt, **kw) for i, (prompt, kw) in enumerate(specs)]


CASES = {
    "decode": [(range(1, 6), {"max_tokens": 12}), (range(20, 31), {"max_tokens": 5})],
    "max_tokens_1_and_2": [(range(1, 4), {"max_tokens": 1}), (range(2, 9), {"max_tokens": 2})],
    "eos_and_stop_ids": [
        (range(i, i + 5), {"max_tokens": 30, "stop_token_ids": [40, 41, 42]}) for i in range(1, 9)
    ],
    "min_tokens": [(range(i, i + 3), {"max_tokens": 20, "min_tokens": 6}) for i in range(1, 6)],
    "chunked_prefill": [(range(1, 51), {"max_tokens": 6}), (range(3, 9), {"max_tokens": 9})],
    "prefix_hits": [([5, 6, 7, 8, 9, 10, 11, 12, 13] + [i], {"max_tokens": 10}) for i in range(5)],
    "max_model_len": [(range(1, 50), {"max_tokens": 40, "ignore_eos": True})],
}


@pytest.mark.parametrize("case", list(CASES))
def test_async_streams_equal_sync(case):
    kw = {"max_num_batched_tokens": 16} if case == "chunked_prefill" else {}
    sync = run(make_scheduler(is_async=False, **kw), _requests(CASES[case]))
    asyn = run(make_scheduler(is_async=True, **kw), _requests(CASES[case]))
    assert asyn == sync
    assert any(tokens for tokens in sync[0].values())


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_async_preemption_keeps_streams(policy):
    specs = [(range(i, i + 9), {"max_tokens": 24, "ignore_eos": True}) for i in range(1, 7)]
    sync_scheduler = make_scheduler(is_async=False, num_blocks=20, policy=policy)
    async_scheduler = make_scheduler(is_async=True, num_blocks=20, policy=policy)
    sync = run(sync_scheduler, _requests(specs))
    asyn = run(async_scheduler, _requests(specs))
    assert async_scheduler.num_preemptions_total > 0
    assert asyn == sync


def test_async_abort_mid_stream():
    specs = [(range(i, i + 5), {"max_tokens": 20, "ignore_eos": True}) for i in range(1, 5)]
    abort_after = {"r1": 3, "r2": 1}
    sync = run(make_scheduler(is_async=False), _requests(specs), abort_after=abort_after)
    asyn = run(make_scheduler(is_async=True), _requests(specs), abort_after=abort_after)
    assert asyn == sync
    assert len(asyn[0]["r1"]) == 3 and asyn[1]["r1"] == "abort"


def test_placeholders_one_step_late():
    scheduler = make_scheduler(is_async=True)
    request = make_request("a", [1, 2, 3, 4, 5], max_tokens=2)
    scheduler.add_request(request)
    first = scheduler.schedule()  # the prompt; samples token 1
    assert request.num_output_placeholders == 1 and request.num_computed_tokens == 5
    assert request.num_tokens == 5 and request.num_tokens_with_placeholders == 6
    second = scheduler.schedule()  # token 1 (on the device at row 0) in, samples token 2 = max_tokens
    [s] = second.scheduled
    assert (s.num_computed_tokens, s.num_new_tokens, s.prev_sampled_row, s.sample_index) == (5, 1, 0, 1)
    assert s.is_sampling and s.token_ids == []
    assert request.num_output_placeholders == 2
    assert scheduler.schedule().is_empty  # a third token would pass max_tokens
    scheduler.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": 50}))
    assert request.output_token_ids == [50] and request.num_output_placeholders == 1
    outputs = scheduler.update_from_output(second, ModelRunnerOutput(sampled_token_ids={"a": 51}))
    assert outputs[0].new_token_ids == [51] and outputs[0].finish_reason == "length"
    assert request.num_output_placeholders == 0 and not scheduler.has_unfinished_requests()


def test_token_after_a_stop_is_dropped():
    scheduler = make_scheduler(is_async=True)
    request = make_request("a", [1, 2, 3], max_tokens=10)
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()
    outputs = scheduler.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": EOS}))
    assert outputs[0].new_token_ids == [EOS] and outputs[0].finish_reason == "stop"
    # What step 2 sampled after the stop never reaches the client.
    assert scheduler.update_from_output(second, ModelRunnerOutput(sampled_token_ids={"a": 99})) == []
    assert request.output_token_ids == [EOS]


def test_penalties_and_grammars_ask_for_known_tokens():
    scheduler = make_scheduler(is_async=True)
    plain = make_request("plain", [1, 2, 3])
    penalized = make_request("pen", [1, 2, 3], presence_penalty=0.5)
    scheduler.add_request(plain)
    scheduler.add_request(penalized)
    assert not scheduler.needs_known_tokens()
    first = scheduler.schedule()
    assert scheduler.needs_known_tokens()  # the penalty counts need the id still in flight
    scheduler.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"plain": 20, "pen": 21}))
    assert not scheduler.needs_known_tokens()
    scheduler.finish_requests(["plain", "pen"], RequestStatus.FINISHED_ABORTED)


def test_the_flag_and_where_async_scheduling_is_off():
    import argparse

    from xlaserve.config import EngineConfig
    from xlaserve.entrypoints.arg_utils import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert "async_scheduling" not in engine_kwargs(parser.parse_args([]))  # the default: on where possible
    assert engine_kwargs(parser.parse_args(["--no-async-scheduling"]))["async_scheduling"] is False
    assert engine_kwargs(parser.parse_args(["--async-scheduling"]))["async_scheduling"] is True
    assert EngineConfig.from_kwargs().is_async_scheduling
    assert not EngineConfig.from_kwargs(async_scheduling=False).is_async_scheduling
    multihost = EngineConfig.from_kwargs(async_scheduling=True, nnodes=2)
    assert not multihost.is_async_scheduling and "multi-host" in multihost.async_scheduling_off_reason()

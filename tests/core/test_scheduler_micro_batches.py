"""Pipeline micro-batches, without jax: up to `num_micro_batches` steps in flight, driven as EngineCore
drives them (dispatch step k + 1, then apply the oldest), each of other requests. A request in a step in
flight is never scheduled again before that step's output is applied (not its next prefill chunk, not
its next decode token, not its recompute after a preemption), and the streams are the synchronous run's.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
from test_scheduler import (
    BLOCK_SIZE,
    FakeModelRunner,
    assert_no_leaked_blocks,
    make_request,
    run_to_completion,
    scheduled_tokens,
    scheduler_config,
)

from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.request import RequestStatus
from xlaserve.core.scheduler import Scheduler


def make_scheduler(num_micro_batches: int, num_blocks=64, max_model_len=64):
    """A step of 32 tokens at most, a prompt's chunk of 16 at most."""
    manager = KVCacheManager(BLOCK_SIZE, num_blocks, True, max_model_len)
    return Scheduler(
        scheduler_config(max_num_seqs=8, max_num_batched_tokens=32, long_prefill_token_threshold=16),
        SimpleNamespace(block_size=BLOCK_SIZE),
        max_model_len,
        manager,
        num_micro_batches=num_micro_batches,
    )


def requests():
    prompts = [list(range(1, 41)), [5, 6, 7], [9, 10, 11, 12, 13], [3] * 9, [20, 21], [30, 31, 32, 33]]
    return [make_request(f"r{i}", prompt, max_tokens=6 + i) for i, prompt in enumerate(prompts)]


def test_a_request_in_a_step_in_flight_is_not_scheduled_again():
    scheduler = make_scheduler(num_micro_batches=2)
    runner = FakeModelRunner(scheduler)
    long, short, third = requests()[:3]  # a 40-token prompt (chunked at 16), two short ones
    for request in (long, short, third):
        scheduler.add_request(request)
    first = scheduler.schedule()  # its share: 2 of the 3 requests
    assert scheduled_tokens(first) == {"r0": 16, "r1": 3}
    first_result = runner.execute(first)
    # r0 still misses 24 prompt tokens and r1 samples next, but both are in the step in flight.
    second = scheduler.schedule()
    assert scheduled_tokens(second) == {"r2": 5}
    assert scheduler.is_in_flight(long) and scheduler.is_in_flight(third)
    second_result = runner.execute(second)
    assert scheduler.schedule().is_empty  # every request is in a step in flight
    scheduler.update_from_output(first, first_result)
    assert not scheduler.is_in_flight(long) and scheduler.is_in_flight(third)
    third_step = scheduler.schedule()
    assert scheduled_tokens(third_step) == {"r0": 16, "r1": 1}  # r2's sampled id is not known yet
    scheduler.update_from_output(second, second_result)
    scheduler.update_from_output(third_step, runner.execute(third_step))
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    assert_no_leaked_blocks(scheduler)


def _run_micro_batched(scheduler: Scheduler, runner: FakeModelRunner) -> tuple[dict, dict, int]:
    """EngineCore's loop over micro-batches: ({id: tokens}, {id: finish reason}, most steps in flight)."""
    in_flight, tokens, reasons, peak = deque(), {}, {}, 0

    def apply(output, result):
        for core_output in scheduler.update_from_output(output, result):
            tokens.setdefault(core_output.request_id, []).extend(core_output.new_token_ids)
            if core_output.finish_reason is not None:
                reasons[core_output.request_id] = core_output.finish_reason

    for _ in range(2000):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        output = scheduler.schedule()
        ids = set(scheduled_tokens(output))
        assert all(not ids & set(scheduled_tokens(earlier)) for earlier, _ in in_flight)
        result = runner.execute(output)
        if output.is_empty:  # wait for the oldest
            if in_flight:
                apply(*in_flight.popleft())
            apply(output, result)
            continue
        in_flight.append((output, result))
        peak = max(peak, len(in_flight))
        keep = scheduler.num_micro_batches - 1 if scheduler.has_unfinished_requests() else 0
        while len(in_flight) > keep:
            apply(*in_flight.popleft())
    else:
        raise AssertionError("the scheduler made no progress")
    assert_no_leaked_blocks(scheduler)
    return tokens, reasons, peak


@pytest.mark.parametrize("num_micro_batches", [2, 3])
@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: too few blocks for all, so requests are preempted
def test_micro_batches_stream_what_the_synchronous_run_streams(num_micro_batches, num_blocks):
    sync = make_scheduler(1, num_blocks=num_blocks)
    for request in requests():
        sync.add_request(request)
    want_tokens, want_reasons, _ = run_to_completion(sync, FakeModelRunner(sync))
    scheduler = make_scheduler(num_micro_batches, num_blocks=num_blocks)
    for request in requests():
        scheduler.add_request(request)
    tokens, reasons, peak = _run_micro_batched(scheduler, FakeModelRunner(scheduler))
    assert tokens == want_tokens
    assert reasons == want_reasons
    assert peak == num_micro_batches
    if num_blocks == 14:
        assert scheduler.num_preemptions_total > 0


def test_micro_batches_refuse_async_scheduling():
    with pytest.raises(ValueError, match="async_scheduling must be off"):
        Scheduler(
            scheduler_config(),
            SimpleNamespace(block_size=BLOCK_SIZE),
            64,
            KVCacheManager(BLOCK_SIZE, 16, True, 64),
            async_scheduling=True,
            num_micro_batches=2,
        )

"""Scheduler, Request and SamplingParams, driven by a fake model over a fake paged KV cache (no jax)."""

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest

from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from xlaserve.core.request import FinishReason, Request, RequestStatus
from xlaserve.core.scheduler import Scheduler
from xlaserve.sampling_params import RequestOutputKind, SamplingParams

BLOCK_SIZE = 4
_arrivals = itertools.count()


def assert_no_leaked_blocks(scheduler: Scheduler) -> None:
    """No request is left and every block but the null block is free and unreferenced."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    assert not manager.req_to_blocks and not manager.num_cached_blocks
    free_ids = sorted(block.block_id for block in pool.free_block_queue.get_all_free_blocks())
    assert free_ids == list(range(1, pool.num_blocks))
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def scheduler_config(
    max_num_seqs=8,
    max_num_batched_tokens=32,
    policy="fcfs",
    long_prefill_token_threshold=0,
    max_num_partial_prefills=None,
    max_long_partial_prefills=None,
):
    """SchedulerConfig's fields (a namespace: these tests use budgets below its minimum of 16). By
    default the fairness limits are off, so chunks are budget-sized as before they existed."""
    max_num_partial_prefills = max_num_partial_prefills or max_num_seqs
    return SimpleNamespace(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
        max_num_partial_prefills=max_num_partial_prefills,
        max_long_partial_prefills=max_long_partial_prefills or max_num_partial_prefills,
    )


@pytest.fixture
def make_scheduler():
    """Builds schedulers; after the test, aborts what is left and checks no block leaked."""
    schedulers = []

    def factory(
        num_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        policy="fcfs",
        max_model_len=64,
        enable_caching=True,
        **fairness,
    ) -> Scheduler:
        manager = KVCacheManager(BLOCK_SIZE, num_blocks, enable_caching, max_model_len)
        scheduler = Scheduler(
            scheduler_config(max_num_seqs, max_num_batched_tokens, policy, **fairness),
            SimpleNamespace(block_size=BLOCK_SIZE, enable_prefix_caching=enable_caching),
            max_model_len,
            manager,
        )
        schedulers.append(scheduler)
        return scheduler

    yield factory
    for scheduler in schedulers:
        scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
        assert_no_leaked_blocks(scheduler)


def make_request(
    request_id, prompt, max_tokens=8, *, eos_token_id=None, priority=0, cache_salt=None, **params
):
    return Request(
        request_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos_token_id,
        arrival_time=float(next(_arrivals)),
        priority=priority,
        cache_salt=cache_salt,
    )


class FakeModelRunner:
    """Writes token ids into a fake paged KV cache; samples (sum of the context read back) % 1000.

    Reading the context back through the block table checks that every prefix hit, chunk and
    recomputation left the right tokens in the right slots. After each step it also checks that
    every block in the prefix-cache index holds exactly the tokens its hash stands for.
    """

    def __init__(self, scheduler: Scheduler, script=None, failing=()):
        self.scheduler = scheduler
        # Requests whose rows the "runner" fails to build: nothing of theirs is written or sampled.
        self.failing = set(failing)
        manager = scheduler.kv_cache_manager
        self.kv = np.full((manager.num_blocks, BLOCK_SIZE), -1, np.int64)
        self.tokens_by_hash: dict[bytes, tuple[int, ...]] = {}
        self.script = script  # request id -> tokens to return, instead of the sum

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        # Every new token of the batch is written before any is read, as each layer does.
        result = ModelRunnerOutput()
        for scheduled in output.scheduled:
            if scheduled.request_id in self.failing:
                result.failed_req_ids.add(scheduled.request_id)
                continue
            start = scheduled.num_computed_tokens
            assert len(scheduled.block_ids) * BLOCK_SIZE >= start + scheduled.num_new_tokens
            for position, token_id in enumerate(scheduled.token_ids, start):
                block_id = scheduled.block_ids[position // BLOCK_SIZE]
                assert block_id != 0, "a real token was routed to the null block"
                self.kv[block_id, position % BLOCK_SIZE] = token_id
        for scheduled in output.scheduled:
            if not scheduled.is_sampling or scheduled.request_id in self.failing:
                continue
            request = scheduled.request
            context = [
                int(self.kv[scheduled.block_ids[p // BLOCK_SIZE], p % BLOCK_SIZE])
                for p in range(request.num_tokens)
            ]
            assert context == request.all_token_ids, f"stale K/V for {request.request_id}"
            if self.script is None:
                result.sampled_token_ids[request.request_id] = sum(context) % 1000
            else:
                result.sampled_token_ids[request.request_id] = self.script[request.request_id][
                    request.num_output_tokens
                ]
        self._check_prefix_index(output)
        return result

    def _check_prefix_index(self, output: SchedulerOutput) -> None:
        requests = [*self.scheduler.requests.values(), *(s.request for s in output.scheduled)]
        for request in requests:
            for index, block_hash in enumerate(request.block_hashes):
                tokens = request.all_token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
                self.tokens_by_hash[block_hash] = tuple(tokens)
        pool = self.scheduler.kv_cache_manager.block_pool
        # A failed request's blocks are unwritten until the scheduler drops them from the index.
        unwritten = {b for s in output.scheduled if s.request_id in self.failing for b in s.block_ids}
        for block_hash, block in pool.cached_block_hash_to_block.items():
            if block.block_id in unwritten:
                continue
            assert tuple(self.kv[block.block_id]) == self.tokens_by_hash[block_hash], f"{block} is stale"


def step(scheduler: Scheduler, runner: FakeModelRunner):
    output = scheduler.schedule()
    assert output.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(output.scheduled) <= scheduler.max_num_seqs
    assert len({s.request_id for s in output.scheduled}) == len(output.scheduled)
    return output, scheduler.update_from_output(output, runner.execute(output))


def run_to_completion(scheduler: Scheduler, runner: FakeModelRunner, max_steps: int = 2000):
    """Step until idle; returns ({request id: tokens streamed}, {request id: finish reason}, steps)."""
    tokens, reasons, steps = {}, {}, []
    while scheduler.has_unfinished_requests():
        assert len(steps) < max_steps, "the scheduler made no progress"
        output, core_outputs = step(scheduler, runner)
        steps.append(output)
        for core_output in core_outputs:
            tokens.setdefault(core_output.request_id, []).extend(core_output.new_token_ids)
            if core_output.finish_reason is not None:
                reasons[core_output.request_id] = core_output.finish_reason
    assert_no_leaked_blocks(scheduler)
    return tokens, reasons, steps


def scheduled_tokens(output: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in output.scheduled}


# -- chunked prefill and batching -----------------------------------------------------------------


def test_long_prompt_is_chunked_and_samples_once(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=32, max_model_len=128, num_blocks=64)
    runner = FakeModelRunner(scheduler)
    request = make_request("long", range(100), max_tokens=1)
    scheduler.add_request(request)
    chunks = []
    while scheduler.has_unfinished_requests():
        output, core_outputs = step(scheduler, runner)
        [scheduled] = output.scheduled
        chunks.append((scheduled.num_computed_tokens, scheduled.num_new_tokens, scheduled.is_sampling))
        assert bool(core_outputs) == scheduled.is_sampling
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.schedule().finished_req_ids == {"long"}


def test_decode_tokens_ride_with_prefill_chunks(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=16)
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("short", range(5), max_tokens=10))
    step(scheduler, runner)
    scheduler.add_request(make_request("long", range(100, 140), max_tokens=2))
    output, _ = step(scheduler, runner)
    assert scheduled_tokens(output) == {"short": 1, "long": 15}
    assert [s.is_sampling for s in output.scheduled] == [True, False]
    assert output.scheduled[1].token_ids == list(range(100, 115))
    output, _ = step(scheduler, runner)
    assert scheduled_tokens(output) == {"short": 1, "long": 15}
    run_to_completion(scheduler, runner)


def test_max_num_seqs_is_respected(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeModelRunner(scheduler)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", range(i, i + 6), max_tokens=3))
    _, reasons, steps = run_to_completion(scheduler, runner)
    assert max(len(output.scheduled) for output in steps) == 2
    assert set(reasons) == {f"r{i}" for i in range(5)}


def test_fcfs_admits_in_arrival_order(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeModelRunner(scheduler)
    for name in ("a", "b", "c"):
        scheduler.add_request(
            make_request(name, range(4), max_tokens=2, priority={"a": 9, "b": 0, "c": 5}[name])
        )
    _, reasons, _ = run_to_completion(scheduler, runner)
    assert list(reasons) == ["a", "b", "c"]


def test_priority_admits_lowest_value_then_earliest(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    runner = FakeModelRunner(scheduler)
    for name, priority in (("low", 2), ("high", 0), ("mid", 1), ("high2", 0)):
        scheduler.add_request(make_request(name, range(4), max_tokens=2, priority=priority))
    assert [r.request_id for r in scheduler.waiting] == ["high", "high2", "mid", "low"]
    _, reasons, _ = run_to_completion(scheduler, runner)
    assert list(reasons) == ["high", "high2", "mid", "low"]


def test_total_tokens_never_exceed_budget_under_load(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=20, max_num_seqs=4, num_blocks=200, max_model_len=128)
    runner = FakeModelRunner(scheduler)
    for i in range(10):
        scheduler.add_request(make_request(f"r{i}", range(i * 7, i * 7 + 30), max_tokens=5))
    tokens, _, steps = run_to_completion(scheduler, runner)
    assert all(len(tokens[f"r{i}"]) == 5 for i in range(10))
    assert max(output.total_num_scheduled_tokens for output in steps) == 20


# -- prefix caching through the scheduler --------------------------------------------------------


def test_prefix_hits_in_tokens_and_salts(make_scheduler):
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    first = make_request("first", range(10), max_tokens=2)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    second = make_request("second", range(10), max_tokens=2)
    salted = make_request("salted", range(10), max_tokens=2, cache_salt="tenant")
    scheduler.add_request(second)
    scheduler.add_request(salted)
    output, core_outputs = step(scheduler, runner)
    assert scheduled_tokens(output) == {"second": 2, "salted": 10}
    assert second.num_cached_tokens == 8 and salted.num_cached_tokens == 0
    assert {o.request_id: o.num_cached_tokens for o in core_outputs} == {"second": 8, "salted": 0}
    # The prompt's whole blocks past its hit, which it writes to the cache (vLLM's cache creation).
    assert {o.request_id: o.num_cache_creation_tokens for o in core_outputs} == {"second": 0, "salted": 8}
    assert first.num_cache_creation_tokens == 8
    run_to_completion(scheduler, runner)
    assert second.output_token_ids == salted.output_token_ids
    stats = scheduler.make_stats().prefix_cache_stats
    assert (stats.num_queries, stats.num_hits) == (30, 8)
    assert scheduler.make_stats().prefix_cache_stats.num_queries == 0


def test_cache_creation_counts_the_blocks_vllm_counts(make_scheduler):
    """vLLM's num_cache_creation_tokens: the prompt's whole blocks its request hashes, less its hit
    (PrefillStats.finalize over estimate_cached_tokens). A repeated prompt of whole blocks hits all but
    its last block, recomputes that one and counts it (vLLM's pool indexes the second copy beside the
    first; ours keeps the first: the count is vLLM's, not our pool's inserts). A prompt_logprobs request
    reads no cache but writes its blocks: all of them count."""
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    first = make_request("first", range(8), max_tokens=2)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("repeat", range(8), max_tokens=2))
    scheduler.add_request(make_request("scored", range(8), max_tokens=2, prompt_logprobs=0))
    output, core_outputs = step(scheduler, runner)
    assert scheduled_tokens(output) == {"repeat": 4, "scored": 8}
    counts = {o.request_id: (o.num_cached_tokens, o.num_cache_creation_tokens) for o in core_outputs}
    assert counts == {"repeat": (4, 4), "scored": (0, 8)}
    assert first.num_cache_creation_tokens == 8


def test_same_step_requests_share_a_prefix(make_scheduler):
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    first, twin = (
        make_request("first", range(13), max_tokens=3),
        make_request("twin", range(13), max_tokens=3),
    )
    scheduler.add_request(first)
    scheduler.add_request(twin)
    output, _ = step(scheduler, runner)
    # The twin hits the blocks the first request writes in this very step.
    assert scheduled_tokens(output) == {"first": 13, "twin": 1}
    assert output.scheduled[1].block_ids[:3] == output.scheduled[0].block_ids[:3]
    run_to_completion(scheduler, runner)
    assert first.output_token_ids == twin.output_token_ids


# -- preemption ------------------------------------------------------------------------------------


def workload():
    return [make_request(f"r{i}", range(i * 3, i * 3 + 10), max_tokens=20) for i in range(6)]


def test_preemption_by_recompute_gives_identical_outputs(make_scheduler):
    roomy = make_scheduler(num_blocks=100, max_num_batched_tokens=16)
    for request in workload():
        roomy.add_request(request)
    expected, _, _ = run_to_completion(roomy, FakeModelRunner(roomy))
    assert roomy.num_preemptions_total == 0

    tight = make_scheduler(num_blocks=12, max_num_batched_tokens=16)  # one request needs 8 blocks
    requests = workload()
    for request in requests:
        tight.add_request(request)
    tokens, reasons, steps = run_to_completion(tight, FakeModelRunner(tight))
    assert tokens == expected
    assert all(reason == FinishReason.LENGTH for reason in reasons.values())
    assert tight.num_preemptions_total > 0
    assert sum(r.num_preemptions for r in requests) == tight.num_preemptions_total
    assert any(output.preempted_req_ids for output in steps)
    assert tight.make_stats().num_preemptions_total == tight.num_preemptions_total


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_match_an_unconstrained_run(make_scheduler, policy, seed):
    rng = random.Random(seed)
    specs = [
        (
            f"r{i}",
            [rng.randrange(50) for _ in range(rng.randint(1, 24))],
            rng.randint(1, 16),
            rng.randint(0, 3),
        )
        for i in range(10)
    ]
    specs += [(f"dup{i}", specs[i][1] + [7], 5, 0) for i in range(3)]  # shared prefixes

    def run(num_blocks, budget, max_num_seqs, **fairness):
        scheduler = make_scheduler(
            num_blocks=num_blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            policy=policy,
            **fairness,
        )
        runner = FakeModelRunner(scheduler)
        pending = list(specs)
        tokens = {}
        while pending or scheduler.has_unfinished_requests():
            for _ in range(rng.randint(0, 3)):  # requests arrive mid-run
                if pending:
                    rid, prompt, max_tokens, priority = pending.pop(0)
                    scheduler.add_request(make_request(rid, prompt, max_tokens, priority=priority))
            _, core_outputs = step(scheduler, runner)
            for core_output in core_outputs:
                tokens.setdefault(core_output.request_id, []).extend(core_output.new_token_ids)
        assert_no_leaked_blocks(scheduler)
        return tokens, scheduler.num_preemptions_total

    expected, _ = run(num_blocks=200, budget=64, max_num_seqs=16)
    num_partial = rng.choice([1, 2, 3])
    tokens, num_preemptions = run(
        num_blocks=11,
        budget=rng.choice([5, 9, 16]),
        max_num_seqs=rng.choice([2, 4, 8]),
        long_prefill_token_threshold=rng.choice([0, 2, 3, 8, None]),  # None: the default, spares budget
        max_num_partial_prefills=num_partial,
        max_long_partial_prefills=rng.randint(1, num_partial),
    )
    assert tokens == expected
    assert num_preemptions > 0  # the tiny cache must actually exercise preempt-and-resume


def _three_running(scheduler, runner):
    """a, b admitted in step 1 and c in step 2; in step 3 a and b need a block and none is free."""
    a, b, c = (
        make_request(name, [i] * 3, max_tokens=8, priority=priority)
        for i, (name, priority) in enumerate([("a", 0), ("b", 2), ("c", 1)])
    )
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, runner)
    scheduler.add_request(c)
    step(scheduler, runner)
    assert [r.request_id for r in scheduler.running] == ["a", "b", "c"]
    output, _ = step(scheduler, runner)
    return output


def test_fcfs_preempts_the_last_running_request(make_scheduler):
    scheduler = make_scheduler(num_blocks=4)  # 3 usable blocks
    runner = FakeModelRunner(scheduler)
    output = _three_running(scheduler, runner)
    # c goes first to free a block for a; then b, which needs one too, has only itself to evict.
    assert output.preempted_req_ids == {"b", "c"}
    assert scheduled_tokens(output) == {"a": 1}
    # Preempted requests go back to the front of the queue, in their original order.
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.requests["c"].status == RequestStatus.PREEMPTED
    assert scheduler.requests["c"].num_computed_tokens == 0
    run_to_completion(scheduler, runner)


def test_priority_preempts_the_largest_priority_value(make_scheduler):
    scheduler = make_scheduler(num_blocks=4, policy="priority")
    runner = FakeModelRunner(scheduler)
    output = _three_running(scheduler, runner)
    assert output.preempted_req_ids == {"b"}
    assert scheduled_tokens(output) == {"a": 1, "c": 1}
    run_to_completion(scheduler, runner)


def test_priority_preempts_a_request_already_scheduled_this_step(make_scheduler):
    scheduler = make_scheduler(num_blocks=3, policy="priority")  # 2 usable blocks
    runner = FakeModelRunner(scheduler)
    low = make_request("low", [1, 2], max_tokens=6, priority=2)
    scheduler.add_request(low)
    step(scheduler, runner)
    scheduler.add_request(make_request("high", [5, 6, 7, 8], max_tokens=4, priority=0))
    step(scheduler, runner)
    # "low" fills its block (position 3) first; then "high" needs a block and evicts it,
    # taking back the budget "low" was given and the hash of the block it never wrote.
    output, _ = step(scheduler, runner)
    assert output.preempted_req_ids == {"low"}
    assert scheduled_tokens(output) == {"high": 1}
    assert output.total_num_scheduled_tokens == 1
    assert scheduler.kv_cache_manager.block_pool.get_cached_block(low.block_hashes[0]) is None
    run_to_completion(scheduler, runner)
    assert low.num_preemptions == 1


def test_request_that_can_never_fit_is_rejected(make_scheduler):
    scheduler = make_scheduler(num_blocks=5, max_model_len=64)  # 4 usable blocks = 16 tokens
    with pytest.raises(ValueError, match=r"^max_tokens: .*needs 5 KV cache blocks .* only 4;"):
        scheduler.add_request(make_request("big", range(10), max_tokens=10))
    # One rule with the front end's (core/limits.py): the prompt must leave room for one output token.
    with pytest.raises(ValueError, match="shorter than max_model_len=8"):
        make_scheduler(max_model_len=8).add_request(make_request("long", range(8), max_tokens=1))
    make_scheduler(max_model_len=8).add_request(make_request("fits", range(7), max_tokens=1))
    # max_model_len caps what a request can ever need.
    capped = make_scheduler(num_blocks=5, max_model_len=16)
    capped.add_request(make_request("ok", range(10), max_tokens=100))
    assert not scheduler.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(make_scheduler):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("same", range(4)))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("same", range(4)))


def test_request_that_cannot_fit_alone_fails_instead_of_hanging(make_scheduler):
    scheduler = make_scheduler(num_blocks=5)
    runner = FakeModelRunner(scheduler)
    manager = scheduler.kv_cache_manager
    running = make_request("running", [1, 2, 3], max_tokens=8)
    scheduler.add_request(running)
    step(scheduler, runner)
    # Something outside the scheduler holds the other blocks (an invariant broken on purpose).
    hog = manager.block_pool.get_new_blocks(3)
    waiting = make_request("waiting", range(8), max_tokens=4)
    scheduler.add_request(waiting)
    step(scheduler, runner)  # position 3 still fits in the running request's block
    # The running request cannot grow even alone; then nothing holds a block and "waiting" fails too.
    output, core_outputs = step(scheduler, runner)
    assert output.is_empty
    assert [(o.request_id, o.finish_reason) for o in core_outputs] == [
        ("running", FinishReason.ERROR),
        ("waiting", FinishReason.ERROR),
    ]
    assert scheduler.schedule().finished_req_ids == {"running", "waiting"}
    assert running.status == waiting.status == RequestStatus.FINISHED_ERROR
    assert not scheduler.has_unfinished_requests()
    manager.block_pool.free_blocks(hog)


def test_a_request_failed_by_the_runner_ends_alone_and_frees_its_blocks(make_scheduler):
    def run(failing):
        scheduler = make_scheduler(max_num_batched_tokens=16)
        runner = FakeModelRunner(scheduler)
        scheduler.add_request(make_request("ok", range(10), max_tokens=6))
        scheduler.add_request(make_request("bad", range(10, 30), max_tokens=6))
        step(scheduler, runner)  # "bad" got a partial chunk, its blocks are indexed as if written
        runner.failing |= set(failing)
        return run_to_completion(scheduler, runner)

    expected, _, _ = run(failing=())
    tokens, reasons, _ = run(failing={"bad"})
    assert reasons["bad"] == FinishReason.ERROR and tokens["bad"] == []
    assert tokens["ok"] == expected["ok"] and reasons["ok"] == FinishReason.LENGTH
    # run_to_completion checked that no block leaked; FakeModelRunner that no cached block is stale.


# -- fairness under long prompts -----------------------------------------------------------------


def test_short_request_starts_while_a_long_prompt_prefills(make_scheduler):
    def run(**fairness):
        scheduler = make_scheduler(max_num_batched_tokens=32, max_model_len=256, num_blocks=80, **fairness)
        runner = FakeModelRunner(scheduler)
        scheduler.add_request(make_request("long", range(200), max_tokens=2))
        first, _ = step(scheduler, runner)
        scheduler.add_request(make_request("short", range(500, 505), max_tokens=3))
        second, core_outputs = step(scheduler, runner)
        tokens, _, steps = run_to_completion(scheduler, runner)
        for core_output in core_outputs:
            tokens[core_output.request_id][:0] = core_output.new_token_ids
        chunks = [
            s.num_new_tokens
            for out in [first, second, *steps]
            for s in out.scheduled
            if s.request_id == "long"
        ]
        return scheduled_tokens(second), chunks, tokens

    starved, chunks, expected = run()  # no cap: the long prompt takes every step's whole budget
    assert starved == {"long": 32}
    fair, chunks, tokens = run(long_prefill_token_threshold=8)
    assert fair == {"long": 8, "short": 5}  # admitted in the very next step
    assert max(chunks) == 8 and sum(chunks) == 200 + 1  # prompt, then one decode step
    assert tokens == expected


def test_partial_prefill_limits(make_scheduler):
    scheduler = make_scheduler(
        max_num_batched_tokens=32,
        max_model_len=128,
        num_blocks=100,
        long_prefill_token_threshold=6,
        max_num_partial_prefills=2,
        max_long_partial_prefills=1,
    )
    runner = FakeModelRunner(scheduler)
    for rid, start, length in [("long1", 0, 40), ("long2", 100, 40), ("medium", 200, 6), ("short", 300, 3)]:
        scheduler.add_request(make_request(rid, range(start, start + length), max_tokens=1))
    output, _ = step(scheduler, runner)
    # long2 waits for the one long slot; the shorter prompts behind it go ahead, each fitting whole.
    assert scheduled_tokens(output) == {"long1": 6, "medium": 6, "short": 3}
    _, reasons, steps = run_to_completion(scheduler, runner)
    assert set(reasons) == {"long1", "long2"}
    for output in steps:
        partial = [s for s in output.scheduled if not s.is_sampling]
        assert len(partial) <= 1 and all(s.num_new_tokens <= 6 for s in output.scheduled)


def test_partial_prefills_leave_room_for_a_third_prompt(make_scheduler):
    scheduler = make_scheduler(
        max_num_batched_tokens=16,
        max_model_len=128,
        num_blocks=100,
        long_prefill_token_threshold=4,
        max_num_partial_prefills=2,
    )
    runner = FakeModelRunner(scheduler)
    for i, rid in enumerate("abc"):
        scheduler.add_request(make_request(rid, range(100 * i, 100 * i + 30), max_tokens=1))
    output, _ = step(scheduler, runner)
    assert scheduled_tokens(output) == {"a": 4, "b": 4}  # "c" would be a third partial prefill
    scheduler.add_request(make_request("d", range(40, 43), max_tokens=1))
    output, _ = step(scheduler, runner)
    assert scheduled_tokens(output) == {"a": 4, "b": 4, "d": 3}
    run_to_completion(scheduler, runner)


def test_default_threshold_is_a_quarter_of_the_budget_and_spares_the_rest(make_scheduler):
    """The default cap is fairness and no more: a prompt alone in the engine prefills in budget-sized
    chunks (its first token 4 steps away, not 13); beside another prompt it takes what that one leaves
    under the cap (a quarter), so every step is full. A threshold the user sets is a hard cap."""
    scheduler = make_scheduler(
        max_num_batched_tokens=64, max_model_len=256, long_prefill_token_threshold=None
    )
    assert scheduler.long_prefill_token_threshold == 16
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("a", range(200), max_tokens=1))
    output, _ = step(scheduler, runner)
    assert scheduled_tokens(output) == {"a": 64}
    scheduler.add_request(make_request("b", range(300, 340), max_tokens=1))
    output, _ = step(scheduler, runner)
    assert scheduled_tokens(output) == {"a": 48, "b": 16}
    explicit = make_scheduler(max_num_batched_tokens=64, max_model_len=128, long_prefill_token_threshold=16)
    explicit_runner = FakeModelRunner(explicit)
    explicit.add_request(make_request("c", range(100), max_tokens=1))
    output, _ = step(explicit, explicit_runner)
    assert scheduled_tokens(output) == {"c": 16}  # a threshold the user set holds alone too
    run_to_completion(scheduler, runner)
    run_to_completion(explicit, explicit_runner)


# -- stopping -------------------------------------------------------------------------------------


def run_script(make_scheduler, script, **request_kwargs):
    scheduler = make_scheduler(max_model_len=request_kwargs.pop("max_model_len", 64))
    request = make_request("r", range(4), **request_kwargs)
    scheduler.add_request(request)
    tokens, reasons, _ = run_to_completion(scheduler, FakeModelRunner(scheduler, script={"r": script}))
    return request, tokens["r"], reasons["r"]


def test_stop_token_id_stops_with_its_id(make_scheduler):
    request, tokens, reason = run_script(make_scheduler, [5, 6, 7, 8], stop_token_ids=[7])
    assert tokens == [5, 6, 7] and reason == FinishReason.STOP and request.stop_reason == 7


def test_eos_stops_unless_ignored(make_scheduler):
    request, tokens, reason = run_script(make_scheduler, [5, 2, 6], eos_token_id=2)
    assert tokens == [5, 2] and reason == FinishReason.STOP and request.stop_reason is None
    request, tokens, reason = run_script(
        make_scheduler, [5, 2, 6, 2], max_tokens=4, eos_token_id=2, ignore_eos=True
    )
    assert tokens == [5, 2, 6, 2] and reason == FinishReason.LENGTH


def test_min_tokens_defers_eos_and_stop_ids(make_scheduler):
    script = [2, 9, 2, 9, 2]
    _, tokens, reason = run_script(make_scheduler, script, eos_token_id=2, min_tokens=3, stop_token_ids=[9])
    assert tokens == [2, 9, 2] and reason == FinishReason.STOP
    request, tokens, _ = run_script(make_scheduler, [9, 9, 9], min_tokens=2, stop_token_ids=[9])
    assert tokens == [9, 9] and request.stop_reason == 9


def test_stop_beats_length_on_the_last_token(make_scheduler):
    _, tokens, reason = run_script(make_scheduler, [5, 2], max_tokens=2, eos_token_id=2)
    assert tokens == [5, 2] and reason == FinishReason.STOP


def test_max_tokens_and_max_model_len_finish_with_length(make_scheduler):
    request, tokens, reason = run_script(make_scheduler, list(range(10)), max_tokens=3)
    assert tokens == [0, 1, 2] and reason == FinishReason.LENGTH
    request, tokens, reason = run_script(make_scheduler, list(range(10)), max_tokens=10, max_model_len=6)
    assert tokens == [0, 1] and request.num_tokens == 6 and reason == FinishReason.LENGTH


def test_logprobs_pass_through_and_prompt_logprobs_stream_per_chunk(make_scheduler):
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("r", range(10), max_tokens=2, prompt_logprobs=1, logprobs=0)
    scheduler.add_request(request)
    seen = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        result = ModelRunnerOutput()
        [scheduled] = output.scheduled
        if scheduled.num_computed_tokens < request.num_prompt_tokens:
            result.prompt_logprobs["r"] = ("chunk", scheduled.num_computed_tokens)
        if scheduled.is_sampling:
            result.sampled_token_ids["r"] = 3
            result.logprobs["r"] = ("lp", request.num_output_tokens)
        for core_output in scheduler.update_from_output(output, result):
            seen.append(
                (core_output.new_token_ids, core_output.new_prompt_logprobs, core_output.new_logprobs)
            )
    assert seen == [
        ([], ("chunk", 0), None),
        ([], ("chunk", 4), None),
        ([3], ("chunk", 8), ("lp", 0)),
        ([3], None, ("lp", 1)),
    ]


# -- aborts and bookkeeping --------------------------------------------------------------------------


def test_abort_frees_running_and_waiting_requests(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeModelRunner(scheduler)
    scheduler.add_request(make_request("running", range(9)))
    scheduler.add_request(make_request("waiting", range(9)))
    output = scheduler.schedule()
    assert scheduler.kv_cache_manager.usage > 0
    scheduler.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    # The step already scheduled for an aborted request produces nothing.
    assert scheduler.update_from_output(output, runner.execute(output)) == []
    assert scheduler.schedule().finished_req_ids == {"running", "waiting"}
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache_manager.usage == 0
    with pytest.raises(ValueError, match="FINISHED_"):
        scheduler.finish_requests("x", RequestStatus.RUNNING)


def test_stats_snapshot(make_scheduler):
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", range(8)))
    scheduler.add_request(make_request("b", range(8)))
    scheduler.schedule()
    stats = scheduler.make_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions_total) == (1, 1, 0)
    assert stats.kv_cache_usage == pytest.approx(2 / 63)
    assert scheduler.get_num_unfinished_requests() == 2


def test_unknown_policy_and_block_size_mismatch_are_rejected():
    manager = KVCacheManager(BLOCK_SIZE, 8, True, 32)
    config = scheduler_config(max_num_seqs=1, max_num_batched_tokens=16, policy="lifo")
    with pytest.raises(ValueError):
        Scheduler(config, SimpleNamespace(block_size=BLOCK_SIZE), 32, manager)
    config = scheduler_config(max_num_seqs=1, max_num_batched_tokens=16, policy="fcfs")
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(config, SimpleNamespace(block_size=16), 32, manager)


# -- Request and SamplingParams ---------------------------------------------------------------------


def test_request_tracks_tokens_and_status():
    request = make_request("r", np.arange(3), max_tokens=4)
    assert request.prompt_token_ids == [0, 1, 2] and request.num_cached_tokens == -1
    request.append_output_token_ids(np.int64(7))
    request.append_output_token_ids([8, 9])
    assert request.all_token_ids == [0, 1, 2, 7, 8, 9] and request.output_token_ids == [7, 8, 9]
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (6, 3, 3)
    assert request.max_tokens == 4 and not request.is_finished and request.get_finish_reason() is None
    for status, reason in [
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
        (RequestStatus.FINISHED_ERROR, "error"),
    ]:
        request.status = status
        assert request.is_finished and request.get_finish_reason() == reason
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)


def test_request_rejects_empty_prompt_and_unresolved_max_tokens():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        Request("r", [1], SamplingParams(max_tokens=None))


def test_sampling_params_defaults_and_normalization():
    params = SamplingParams(stop="###", stop_token_ids=(3, 4), top_k=-1)
    assert params.stop == ["###"] and params.stop_token_ids == [3, 4] and params.top_k == 0
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    assert not SamplingParams().has_penalties and SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(logprobs=20, max_tokens=None).logprobs == 20
    assert SamplingParams(temperature=2).temperature == 2


def test_repeated_stop_token_ids_and_bad_words_are_one_each():
    """vLLM's: repeats are dropped, each value where it first appeared (and -1 logprobs are kept for the
    input processor to resolve against the vocabulary)."""
    params = SamplingParams(stop_token_ids=[7, 3, 7, 7, 3], bad_words=["b", "a", "b"], logprobs=-1)
    assert params.stop_token_ids == [7, 3] and params.bad_words == ["b", "a"]
    assert (params.logprobs, SamplingParams(prompt_logprobs=-1).prompt_logprobs) == (-1, -1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be"),
        ({"temperature": -1.0}, r"temperature must be in \[0, 2\], got -1.0"),
        ({"temperature": 2.5}, r"temperature must be in \[0, 2\], got 2.5"),  # vLLM's, offline too
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k must be -1"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
        ({"min_tokens": -1}, "min_tokens must be an int >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens must be <= max_tokens \(4\)"),
        ({"logprobs": 1.5}, "logprobs must be an int >= 0"),  # its upper bound is the engine's
        ({"prompt_logprobs": -2}, r"prompt_logprobs must be an int >= 0, -1 \(the whole vocabulary\)"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids must be ints >= 0"),
        ({"temperature": float("nan")}, "temperature"),
        ({"stop_token_ids": [np.int64(3)]}, "stop_token_ids must be ints"),  # vLLM's isinstance(int)
        ({"allowed_token_ids": [np.float32(3)]}, "allowed_token_ids must be ints"),
        ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind or None, got 'delta'"),
        ({"output_kind": 1}, "output_kind must be a RequestOutputKind"),
    ],
)
def test_sampling_params_validation_names_field_and_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_follow_vllms_conversions(caplog):
    """vLLM's: a temperature in (0, 0.01) is raised to 0.01 with a warning (0 stays greedy); logprobs=True
    is 1 (False: none); numpy integers pass where vLLM's checks are comparisons (allowed_token_ids)."""
    with caplog.at_level("WARNING", logger="xlaserve.sampling_params"):
        params = SamplingParams(temperature=0.005)
    assert params.temperature == 0.01 and not params.is_greedy
    assert "temperature 0.005 is below 0.01" in caplog.text
    assert SamplingParams(temperature=1e-7).temperature == 0.01
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(temperature=0.01).temperature == 0.01
    assert (SamplingParams(logprobs=True).logprobs, SamplingParams(prompt_logprobs=True).prompt_logprobs) == (
        1,
        1,
    )
    assert SamplingParams(logprobs=False).logprobs is None
    allowed = SamplingParams(allowed_token_ids=list(np.array([5, 7]))).allowed_token_ids
    assert allowed == [5, 7] and all(type(t) is int for t in allowed)
    assert SamplingParams().output_kind is None
    assert SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind.mode == "delta"


def test_reset_running_requests_preempts_them_in_order_and_they_recompute(make_scheduler):
    """vLLM's reset_prefix_cache(reset_running_requests=True) between steps: every running request gives
    its blocks back and waits again ahead of the queue in admission order, the prefix index is empty,
    and the run ends with the undisturbed run's tokens (the fake runner reads every context back)."""
    roomy = make_scheduler(num_blocks=100, max_num_batched_tokens=16, max_num_seqs=4)
    for request in workload():
        roomy.add_request(request)
    expected, _, _ = run_to_completion(roomy, FakeModelRunner(roomy))

    scheduler = make_scheduler(num_blocks=100, max_num_batched_tokens=16, max_num_seqs=4)
    runner = FakeModelRunner(scheduler)
    for request in workload():
        scheduler.add_request(request)
    tokens = {}
    for _ in range(6):
        for core_output in step(scheduler, runner)[1]:
            tokens.setdefault(core_output.request_id, []).extend(core_output.new_token_ids)
    running = [r.request_id for r in scheduler.running]
    assert running == ["r0", "r1", "r2", "r3"]
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert [r.request_id for r in scheduler.waiting] == [*running, "r4", "r5"]
    assert scheduler.num_preemptions_total == 4 and not scheduler.running
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1 and not pool.cached_block_hash_to_block
    rest, _, _ = run_to_completion(scheduler, runner)
    assert {rid: tokens.get(rid, []) + rest.get(rid, []) for rid in expected} == expected

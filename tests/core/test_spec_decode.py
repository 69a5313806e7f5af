"""Speculative decoding's host side (no jax): the config, the n-gram proposer, and the scheduler
carrying drafts as ordinary tokens, keeping the accepted ones and rolling back over the rest."""

from types import SimpleNamespace

import numpy as np
import pytest

from xlaserve.config import EngineConfig, SpeculativeConfig
from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.outputs import ModelRunnerOutput
from xlaserve.core.request import Request, RequestStatus
from xlaserve.core.scheduler import Scheduler
from xlaserve.core.spec_decode import (
    DraftModelProposer,
    NgramProposer,
    SpecDecodingStats,
    make_proposer,
    ngram_propose,
)
from xlaserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
K = 3


# -- config ---------------------------------------------------------------------------------------


def test_speculative_config_from_dict_and_json():
    config = EngineConfig.from_kwargs(
        None, speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}
    )
    assert config.speculative == SpeculativeConfig("ngram", 5, 1, 3)
    text = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}'
    assert EngineConfig.from_kwargs(None, speculative_config=text).speculative.prompt_lookup_min == 2
    assert EngineConfig.from_kwargs(None).speculative is None


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "medusa"}, "speculative_config.method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, r"in \[1, 16\]"),
        ({"method": "ngram", "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min must be >= 1"),
        (
            {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_max must be >= prompt_lookup_min=3",
        ),
        ({"method": "ngram", "lookahead": 2}, r"unknown field\(s\) \['lookahead'\]"),
        ({"num_speculative_tokens": 2}, "speculative_config.method is required"),
        ({"method": "draft_model"}, "speculative_config.model is required"),
        ({"method": "draft_model", "model": "/no/such/draft"}, "speculative_config.model: '/no/such/draft'"),
        ("{not json", "speculative_config must be a JSON object"),
        ("[1]", "speculative_config must be a JSON object"),
    ],
)
def test_speculative_config_errors_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(None, speculative_config=value)


def test_draft_model_config_takes_an_existing_path(tmp_path):
    config = EngineConfig.from_kwargs(
        None,
        speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2},
    )
    assert config.speculative == SpeculativeConfig("draft_model", 2, model=str(tmp_path))
    assert isinstance(make_proposer(config.speculative, 64), DraftModelProposer)
    assert type(make_proposer(SpeculativeConfig("ngram"), 64)) is NgramProposer
    assert make_proposer(None, 64) is None


def test_async_scheduling_is_refused_with_speculative_decoding():
    """The seam for async scheduling: a scheduler config with async_scheduling on cannot take drafts."""
    config = EngineConfig.from_kwargs(None, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="async_scheduling cannot be combined with speculative_config"):
        EngineConfig(
            config.model,
            config.cache,
            SimpleNamespace(async_scheduling=True),
            config.parallel,
            config.compilation,
            config.speculative,
        )


# -- the proposer ---------------------------------------------------------------------------------


def propose(tokens, k=K, min_n=1, max_n=4):
    return ngram_propose(np.asarray(tokens), k, min_n, max_n).tolist()


def test_ngram_proposes_what_followed_the_longest_earliest_match():
    # Suffix [7, 8, 9]: it occurred at 0 (followed by 1 2 7) and at 5 (followed by 4 5 6).
    assert propose([7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9]) == [1, 2, 7]
    # Suffix [2, 3] occurs at 1 (-> 9 9) and at 5 (-> 9 3): the earliest wins.
    assert propose([1, 2, 3, 9, 9, 2, 3, 9, 3, 4, 2, 3], k=2, max_n=2) == [9, 9]
    # Longest first: [8, 2, 3] matches at 3 (-> 6) though [2, 3] alone matches earlier at 0 (-> 5).
    assert propose([2, 3, 5, 8, 2, 3, 6, 8, 2, 3], k=1, max_n=3) == [6]
    assert propose([1, 2, 3, 4]) == []  # nothing repeats
    assert propose([5, 6, 5, 6], k=8) == [5, 6]  # only what exists after the match
    assert propose([5, 6, 1, 5, 6], min_n=3) == []  # shorter matches than min_n do not count
    assert propose([4]) == []


def make_request(request_id="r", prompt=(1, 2, 3, 1, 2, 3, 1, 2), **params):
    params = {"max_tokens": 20, "temperature": 0.0, **params}
    return Request(request_id, list(prompt), SamplingParams(**params), eos_token_id=0)


def test_proposer_drafts_only_for_decoding_requests_within_their_limits():
    proposer = NgramProposer(SpeculativeConfig("ngram", K, 1, 4), max_model_len=64)
    request = make_request(max_tokens=3)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = 5  # still prefilling: no drafts
    proposer.propose([request])
    assert request.spec_token_ids == []
    request.num_computed_tokens = request.num_tokens - 1
    proposer.propose([request])
    assert request.spec_token_ids == [3, 1]  # max_tokens=3: 2 drafts + the verified token at most
    request.append_output_token_ids([3, 1])
    request.num_computed_tokens = request.num_tokens - 1
    proposer.propose([request])
    assert request.spec_token_ids == []  # one token left: nothing to draft
    under_min = make_request(min_tokens=4)
    under_min.status, under_min.num_computed_tokens = RequestStatus.RUNNING, 7
    proposer.propose([under_min])
    assert under_min.spec_token_ids == []  # min_tokens still bans EOS: not drafted
    for bad_words, drafts in (([[5, 3]], []), ([[5]], [3, 1, 2])):  # a ban after a token: not drafted
        banning = make_request(bad_words_token_ids=bad_words)
        banning.status, banning.num_computed_tokens = RequestStatus.RUNNING, 7
        proposer.propose([banning])
        assert banning.spec_token_ids == drafts
    near_end = make_request()
    near_end.status, near_end.num_computed_tokens = RequestStatus.RUNNING, 7
    NgramProposer(SpeculativeConfig("ngram", K, 1, 4), max_model_len=10).propose([near_end])
    assert near_end.spec_token_ids == [3]  # 8 tokens of 10: one draft, then the verified token


def test_draft_model_proposer_takes_the_last_steps_drafts_within_the_limits():
    proposer = DraftModelProposer(SpeculativeConfig("ngram", K), max_model_len=64)  # reads k only
    decoding, absent, prefilling = (make_request(r) for r in ("d", "a", "p"))
    capped = make_request("c", max_tokens=3)  # room for two drafts and the verified token
    for request in (decoding, capped, absent, prefilling):
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_tokens - 1
        request.spec_token_ids = [99]  # stale: replaced or dropped
    prefilling.num_computed_tokens = 3
    output = ModelRunnerOutput(draft_token_ids={"d": [4, 5, 6], "c": [4, 5, 6], "p": [4, 5, 6]})
    proposer.propose([decoding, capped, absent, prefilling], output)
    assert [r.spec_token_ids for r in (decoding, capped, absent, prefilling)] == [[4, 5, 6], [4, 5], [], []]
    proposer.propose([decoding], ModelRunnerOutput())  # an empty step proposes nothing
    assert decoding.spec_token_ids == []


# -- the scheduler --------------------------------------------------------------------------------


def make_scheduler(num_blocks=32, max_num_batched_tokens=32, enable_caching=True, num_lookahead_tokens=0):
    config = SimpleNamespace(
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        policy="fcfs",
        long_prefill_token_threshold=0,
        max_num_partial_prefills=8,
        max_long_partial_prefills=8,
    )
    manager = KVCacheManager(BLOCK_SIZE, num_blocks, enable_caching, max_model_len=64)
    return Scheduler(
        config,
        SimpleNamespace(block_size=BLOCK_SIZE),
        64,
        manager,
        num_spec_tokens=K,
        num_lookahead_tokens=num_lookahead_tokens,
    )


def step(scheduler, proposer, accept: dict[str, int], sampled: int = 50):
    """One step whose runner accepts the first accept[id] drafts of each verified request."""
    output = scheduler.schedule()
    runner = ModelRunnerOutput()
    for s in output.scheduled:
        if s.is_sampling:
            runner.sampled_token_ids[s.request_id] = sampled
            num = min(accept.get(s.request_id, 0), len(s.spec_token_ids))
            runner.accepted_token_ids[s.request_id] = s.spec_token_ids[:num]
    outs = scheduler.update_from_output(output, runner)
    proposer.propose(scheduler.running)
    return output, {o.request_id: o for o in outs}


def test_drafts_ride_in_the_batch_and_rejected_ones_roll_back():
    scheduler = make_scheduler()
    proposer = NgramProposer(SpeculativeConfig("ngram", K, 1, 4), max_model_len=64)
    request = make_request(max_tokens=20)
    scheduler.add_request(request)
    free_at_start = scheduler.kv_cache_manager.num_free_blocks
    output, _ = step(scheduler, proposer, {})  # the prompt; its sampled token 50 is appended
    assert output.scheduled[0].num_new_tokens == 8
    # [..., 1, 2, 50]: no match for 50 -> no drafts
    assert request.spec_token_ids == []
    output, _ = step(scheduler, proposer, {}, sampled=1)  # ... 1 2 50 1: "1" first seen before "2 3 1"
    assert request.spec_token_ids == [2, 3, 1]
    output, outs = step(scheduler, proposer, {"r": 2}, sampled=7)
    s = output.scheduled[0]
    assert s.spec_token_ids == [2, 3, 1] and s.num_new_tokens == 4 and output.total_num_scheduled_tokens == 4
    assert s.token_ids == [1, 2, 3, 1]  # the last real token, then the drafts
    assert outs["r"].new_token_ids == [2, 3, 7]
    # 2 of 3 accepted: the K/V of the last real token and the two accepted drafts is kept.
    assert request.num_computed_tokens == request.num_tokens - 1 == s.num_computed_tokens + 3
    stats = scheduler.make_stats().spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]
    assert scheduler.make_stats().spec_decoding_stats.num_drafts == 0  # a snapshot resets
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == free_at_start  # no block leaked


def test_max_tokens_is_exact_and_tokens_after_a_stop_are_dropped():
    scheduler = make_scheduler()
    proposer = NgramProposer(SpeculativeConfig("ngram", K, 1, 4), max_model_len=64)
    capped = make_request("capped", max_tokens=4)
    stopped = make_request("stopped", prompt=(5, 6, 7, 5, 6, 7, 5, 6), stop_token_ids=[5])
    for request in (capped, stopped):
        scheduler.add_request(request)
    step(scheduler, proposer, {}, sampled=1)  # the prompts, then 1: 'capped' is 1 2 3 ... 1 2 1 -> drafts 2 3
    assert capped.spec_token_ids == [2, 3]  # 3 tokens left: two drafts at most
    assert stopped.spec_token_ids == []
    stopped.spec_token_ids = [7, 5, 6]  # as if proposed: the stop id 5 is the second draft
    _, outs = step(scheduler, proposer, {"capped": 2, "stopped": 3}, sampled=9)
    assert outs["capped"].new_token_ids == [2, 3, 9] and capped.num_output_tokens == 4
    assert outs["capped"].finish_reason == "length"
    assert outs["stopped"].new_token_ids == [7, 5] and outs["stopped"].finish_reason == "stop"
    assert not scheduler.requests
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_usable_blocks


def test_drafts_fit_the_token_budget_and_never_preempt():
    # A 14-token budget; 4 decoding requests with 3 drafts each want 16 tokens.
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=14)
    proposer = NgramProposer(SpeculativeConfig("ngram", K, 1, 4), max_model_len=64)
    requests = [make_request(f"r{i}", prompt=(1, 2, 3, 1)) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    while any(r.num_output_tokens == 0 for r in requests):
        step(scheduler, proposer, {}, sampled=2)
    for request in requests:
        request.spec_token_ids = [3, 1, 2]
    output = scheduler.schedule()
    assert output.total_num_scheduled_tokens == 14
    assert [len(s.spec_token_ids) for s in output.scheduled] == [3, 3, 3, 1]
    assert not output.preempted_req_ids
    # A full pool: the request decodes without its drafts, and nobody is preempted for them.
    small = make_scheduler(num_blocks=4)  # 3 usable blocks of 4 slots
    request = make_request("a", prompt=(1, 2, 3, 1, 2, 3, 1), max_tokens=5)  # 2 blocks
    other = make_request("b", prompt=(9, 9, 9), max_tokens=9)  # the third
    small.add_request(request)
    small.add_request(other)
    step(small, proposer, {}, sampled=2)
    request.spec_token_ids = [3, 1]
    output = small.schedule()
    assert [(s.num_new_tokens, s.spec_token_ids) for s in output.scheduled] == [(1, []), (1, [])]
    assert not output.preempted_req_ids


def test_lookahead_slots_are_taken_when_free_and_never_preempt():
    """A draft model writes K/V for k positions past a step's tokens: their blocks are allocated with
    the step's when free (capped by max_model_len), and skipped rather than preempting anyone."""
    scheduler = make_scheduler(num_blocks=32, num_lookahead_tokens=K)
    request = make_request("a", prompt=(1, 2, 3, 1, 2, 3, 1))  # 7 tokens + 3 ahead: 3 blocks, not 2
    scheduler.add_request(request)
    scheduler.schedule()
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 3
    near_end = make_scheduler(max_num_batched_tokens=64, num_lookahead_tokens=K)
    long_request = make_request("b", prompt=tuple(range(1, 63)), max_tokens=2)  # 62 of 64 positions
    near_end.add_request(long_request)
    near_end.schedule()
    assert len(near_end.kv_cache_manager.get_block_ids("b")) == 16  # 64 slots: no error past the end
    small = make_scheduler(num_blocks=4, num_lookahead_tokens=K)  # 3 usable blocks of 4 slots
    proposer = DraftModelProposer(SpeculativeConfig("ngram", K), max_model_len=64)
    for request_id, prompt in (("c", (1, 2, 3, 1)), ("d", (9, 9, 9))):
        small.add_request(make_request(request_id, prompt=prompt, max_tokens=5))
    for _ in range(2):  # the prompts, then a decode: 'd' gets no slots ahead, and nobody is preempted
        output, _ = step(small, proposer, {}, sampled=2)
        assert [s.request_id for s in output.scheduled] == ["c", "d"] and not output.preempted_req_ids
        assert [len(small.kv_cache_manager.get_block_ids(r)) for r in "cd"] == [2, 1]


def test_stats_add_up():
    total = SpecDecodingStats(3)
    for num_drafts, num_accepted in [(3, 3), (3, 0), (2, 1), (1, 1)]:
        total.observe(num_drafts, num_accepted)
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (4, 9, 5)
    assert total.num_accepted_tokens_per_pos == [3, 1, 1]

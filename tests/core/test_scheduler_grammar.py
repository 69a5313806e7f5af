"""The scheduler's narrow hook for structured outputs, with a fake grammar (no llguidance, no jax): a
request waits for its grammar without holding up others, a failed grammar fails only its request,
a complete grammar stops the request with its last token as text, and preemption never re-advances
a grammar."""

from __future__ import annotations

from types import SimpleNamespace

from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.outputs import ModelRunnerOutput
from xlaserve.core.request import FinishReason, Request, RequestStatus
from xlaserve.core.scheduler import Scheduler
from xlaserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2


class FakeGrammar:
    """Ready when told; complete after `length` tokens; rejects token 666."""

    def __init__(self, length: int = 3, is_ready: bool = True, error: str | None = None):
        self.length = length
        self.is_ready = is_ready
        self.error = error
        self.accepted: list[int] = []

    @property
    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length or EOS in self.accepted

    def accept_token(self, token_id: int) -> None:
        if token_id == 666:
            self.error = "rejected"
        self.accepted.append(token_id)


def make_scheduler(num_blocks: int = 64, max_num_batched_tokens: int = 32) -> Scheduler:
    manager = KVCacheManager(BLOCK_SIZE, num_blocks, True, 64)
    return Scheduler(
        SimpleNamespace(
            max_num_seqs=8,
            max_num_batched_tokens=max_num_batched_tokens,
            policy="fcfs",
            long_prefill_token_threshold=0,  # the fairness limits off: chunks are budget-sized
            max_num_partial_prefills=8,
            max_long_partial_prefills=8,
        ),
        SimpleNamespace(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        64,
        manager,
    )


def make_request(
    request_id: str, grammar=None, max_tokens: int = 8, prompt_len: int = 6, **params
) -> Request:
    request = Request(
        request_id,
        list(range(10, 10 + prompt_len)),
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=EOS,
    )
    request.grammar = grammar
    return request


def step(scheduler: Scheduler, token_id: int = 7):
    """One step where every sampling request samples `token_id`."""
    output = scheduler.schedule()
    sampled = {s.request_id: token_id for s in output.scheduled if s.is_sampling}
    return output, scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids=sampled))


def test_a_compiling_grammar_waits_without_holding_up_others():
    scheduler = make_scheduler()
    grammar = FakeGrammar(is_ready=False)
    scheduler.add_request(make_request("slow", grammar))
    scheduler.add_request(make_request("plain"))
    output, _ = step(scheduler)
    assert [s.request_id for s in output.scheduled] == ["plain"]
    assert [r.request_id for r in scheduler.waiting] == ["slow"]
    grammar.is_ready = True
    output, _ = step(scheduler)
    assert {s.request_id for s in output.scheduled} == {"slow", "plain"}


def test_a_grammar_that_failed_to_compile_fails_its_request_only():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("bad", FakeGrammar(error="did not compile")))
    scheduler.add_request(make_request("plain"))
    output, outputs = step(scheduler)
    assert [s.request_id for s in output.scheduled] == ["plain"]
    failed = next(o for o in outputs if o.request_id == "bad")
    assert failed.finish_reason == FinishReason.ERROR and "bad" not in scheduler.requests


def test_a_complete_grammar_stops_with_its_last_token_as_text():
    scheduler = make_scheduler()
    grammar = FakeGrammar(length=3)
    request = make_request("r", grammar, max_tokens=8, min_tokens=5)
    scheduler.add_request(request)
    outputs = [step(scheduler)[1][0] for _ in range(3)]
    assert grammar.accepted == [7, 7, 7]
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].is_grammar_complete
    assert not any(o.is_grammar_complete for o in outputs[:-1])
    assert request.status == RequestStatus.FINISHED_STOPPED  # before min_tokens: nothing may follow


def test_eos_allowed_by_the_grammar_is_a_stop_token():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", FakeGrammar(length=5)))
    step(scheduler)
    _, (output,) = step(scheduler, token_id=EOS)
    assert output.finish_reason == FinishReason.STOP and not output.is_grammar_complete


def test_a_rejected_token_fails_the_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", FakeGrammar(length=5)))
    _, (output,) = step(scheduler, token_id=666)
    assert output.finish_reason == FinishReason.ERROR


def test_preemption_never_re_advances_the_grammar():
    """Recomputing prompt and outputs after a preemption samples only at the end: the grammar sees
    each output token once."""
    scheduler = make_scheduler(num_blocks=9, max_num_batched_tokens=16)  # 8 usable blocks
    grammars = [FakeGrammar(length=100) for _ in range(3)]
    requests = [make_request(f"r{i}", g, max_tokens=14, prompt_len=6) for i, g in enumerate(grammars)]
    for request in requests:
        scheduler.add_request(request)
    num_preempted = 0
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        num_preempted += len(output.preempted_req_ids)
    assert num_preempted > 0
    for request, grammar in zip(requests, grammars):
        assert grammar.accepted == request.output_token_ids and len(grammar.accepted) == 14

"""core/stop.py's check_stop (which token finishes a request, and why) and core/policy.py's
admission order and preemption victim, on plain Requests (no scheduler, no jax)."""

from types import SimpleNamespace

from xlaserve.core.policy import SchedulingPolicy, enqueue_waiting, pick_victim
from xlaserve.core.request import Request, RequestStatus
from xlaserve.core.stop import check_stop, is_grammar_complete
from xlaserve.sampling_params import SamplingParams

EOS = 2


def _request(request_id="r", *, priority=0, arrival_time=0.0, **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(
        request_id,
        [5, 6, 7],
        SamplingParams(**params),
        eos_token_id=EOS,
        priority=priority,
        arrival_time=arrival_time,
    )


def _append(request: Request, token_id: int, max_model_len: int = 64) -> RequestStatus:
    request.append_output_token_ids(token_id)
    check_stop(request, max_model_len)
    return request.status


class _Grammar(SimpleNamespace):
    """A grammar that ends after `accepts` more tokens (or errors on `bad`)."""

    error = None

    def accept_token(self, token_id):
        if token_id == getattr(self, "bad", None):
            self.error = f"token {token_id} not allowed"
        self.accepts -= 1

    @property
    def is_terminated(self):
        return self.accepts <= 0


def test_eos_and_stop_ids_wait_for_min_tokens():
    request = _request(min_tokens=2, stop_token_ids=[9])
    assert _append(request, EOS) == RequestStatus.WAITING  # 1 < min_tokens: EOS is just a token
    assert _append(request, 9) == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 9
    ignoring = _request(ignore_eos=True)
    assert _append(ignoring, EOS) == RequestStatus.WAITING


def test_length_limits():
    request = _request(max_tokens=2)
    assert _append(request, 11) == RequestStatus.WAITING
    assert _append(request, 12) == RequestStatus.FINISHED_LENGTH
    # max_model_len counts prompt and outputs: 3 + 1 reaches 4.
    assert _append(_request(), 11, max_model_len=4) == RequestStatus.FINISHED_LENGTH


def test_grammar_ends_the_request_before_min_tokens():
    request = _request(min_tokens=5)
    request.grammar = _Grammar(accepts=2)
    assert _append(request, 11) == RequestStatus.WAITING
    assert _append(request, 12) == RequestStatus.FINISHED_STOPPED
    assert is_grammar_complete(request)  # the last token is text, not EOS
    ended_on_eos = _request()
    ended_on_eos.grammar = _Grammar(accepts=1)
    assert _append(ended_on_eos, EOS) == RequestStatus.FINISHED_STOPPED
    assert not is_grammar_complete(ended_on_eos)
    rejected = _request()
    rejected.grammar = _Grammar(accepts=3, bad=13)
    assert _append(rejected, 13) == RequestStatus.FINISHED_ERROR


def test_fcfs_order_and_victim():
    waiting: list[Request] = []
    a, b, c = (_request(name, arrival_time=t) for t, name in enumerate("abc"))
    enqueue_waiting(waiting, a, SchedulingPolicy.FCFS, is_preempted=False)
    enqueue_waiting(waiting, b, SchedulingPolicy.FCFS, is_preempted=False)
    enqueue_waiting(waiting, c, SchedulingPolicy.FCFS, is_preempted=True)  # admitted before the rest
    assert [r.request_id for r in waiting] == ["c", "a", "b"]
    assert pick_victim([a, b, c], SchedulingPolicy.FCFS) == 2  # the last admitted


def test_priority_order_and_victim():
    waiting: list[Request] = []
    low = _request("low", priority=5, arrival_time=0.0)
    high = _request("high", priority=0, arrival_time=2.0)
    mid_early, mid_late = (
        _request("mid1", priority=1, arrival_time=1.0),
        _request("mid2", priority=1, arrival_time=3.0),
    )
    for request in (low, mid_late, high, mid_early):
        enqueue_waiting(waiting, request, SchedulingPolicy.PRIORITY, is_preempted=False)
    assert [r.request_id for r in waiting] == ["high", "mid1", "mid2", "low"]
    running = [high, low, mid_early, mid_late]
    assert pick_victim(running, SchedulingPolicy.PRIORITY) == 1  # the lowest priority
    assert pick_victim([high, mid_late, mid_early], SchedulingPolicy.PRIORITY) == 1  # then the latest

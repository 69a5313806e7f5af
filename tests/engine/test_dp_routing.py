"""Data-parallel routing: children of an n > 1 request share a rank, whatever the ids look like."""

from __future__ import annotations

from xlaserve.core.outputs import EngineCoreOutput
from xlaserve.engine.dp_engine import DataParallelEngineCore
from xlaserve.engine.processor import InputProcessor
from xlaserve.sampling_params import SamplingParams


class FakeRank:
    """EngineCore's routing surface: holds requests, finishes them all in one step."""

    max_model_len = 64

    def __init__(self):
        self.requests = []

    def add_request(self, request):
        self.requests.append(request)

    def get_num_unfinished_requests(self):
        return len(self.requests)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        done, self.requests = self.requests, []
        return [EngineCoreOutput(r.request_id, [1], "length") for r in done]

    def abort_requests(self, ids):
        self.requests = [r for r in self.requests if r.request_id not in ids]


def make_requests(request_id, n):
    processor = InputProcessor(None, max_model_len=64, vocab_size=100, eos_token_id=None, seed=0)
    return processor.make_requests(request_id, [1, 2, 3], SamplingParams(n=n, max_tokens=4))


def test_children_share_a_rank_even_when_user_ids_contain_underscores():
    dp = DataParallelEngineCore([FakeRank(), FakeRank()])
    # "0_a" is what the old "{index}_{parent}" scheme named child 0 of "a": a user id may look like it.
    for request in make_requests("0_a", 1) + make_requests("a", 3) + make_requests("x_1", 2):
        dp.add_request(request)
    ranks = [{(r.parent_id or r.request_id) for r in rank.requests} for rank in dp.ranks]
    assert ranks[0] == {"0_a", "x_1"} and ranks[1] == {"a"}  # least loaded first, families kept whole
    assert sorted(len(rank.requests) for rank in dp.ranks) == [3, 3]
    children = [r for r in dp.ranks[1].requests]
    assert [r.parent_id for r in children] == ["a"] * 3
    assert len({r.request_id for r in children}) == 3 and "0_a" not in {r.request_id for r in children}
    # The routing table of a parent is dropped once its last child is added, and finished ids leave.
    assert dp._rank_of_parent == {}
    dp.step()
    assert dp._rank_of == {} and not dp.has_unfinished_requests()

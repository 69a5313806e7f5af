"""Data-parallel routing: children of an n > 1 request share a rank, whatever the ids look like, and a
request goes to the rank holding its prefix while that rank is not much busier."""

from __future__ import annotations

from types import SimpleNamespace

from xlaserve.core.outputs import EngineCoreOutput
from xlaserve.engine.dp_engine import DataParallelEngineCore
from xlaserve.engine.processor import InputProcessor
from xlaserve.sampling_params import SamplingParams


class FakeRank:
    """EngineCore's routing surface: holds requests, finishes them all in one step."""

    max_model_len = 64
    kv_cache_manager = SimpleNamespace(num_cached_tokens=lambda request: 0)  # holds no prefix

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


class CachingRank:
    """EngineCore's routing interface: its unfinished requests, and the prefix tokens it holds of each
    prompt."""

    def __init__(self, cached: dict[str, int]):
        self.max_model_len = 128
        self.requests = []
        self.kv_cache_manager = SimpleNamespace(
            num_cached_tokens=lambda request: cached.get(request.prompt, 0)
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def add_request(self, request) -> None:
        self.requests.append(request.prompt)


def test_a_request_goes_to_the_rank_holding_its_prefix_while_it_is_not_much_busier():
    ranks = [CachingRank({"long": 16}), CachingRank({"long": 32, "other": 16})]
    core = DataParallelEngineCore(ranks, balance_slack=1)
    for i, prompt in enumerate(["new", "long", "long", "long", "long", "new", "other"]):
        core.add_request(SimpleNamespace(request_id=str(i), parent_id=None, prompt=prompt))
    # "new" is cached nowhere: the least loaded rank, the first of equals. "long": the longer prefix on
    # rank 1 while it is at most one request busier than rank 0; then rank 0, which holds less of it.
    # "other": rank 1, the only one holding it, as busy as rank 0.
    assert ranks[0].requests == ["new", "long", "new"]
    assert ranks[1].requests == ["long", "long", "long", "other"]

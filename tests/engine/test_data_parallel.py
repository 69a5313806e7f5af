"""Data-parallel ranks step together (issue 28): each rank's step runs in a thread of its own, an
error in one rank surfaces once the others have finished their step, and on fake CPU devices two
ranks give the same greedy ids as one, with n > 1 children, a synchronous (penalized) rank beside
an async one, an abort, and stats summed over the ranks."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from xlaserve.engine.dp_engine import DataParallelEngineCore


class FakeRank:
    """EngineCore's step interface; `step` waits at `barrier` (every rank stepping must reach it)."""

    def __init__(self, name: str, barrier=None, has_work: bool = True, fails: bool = False):
        self.name, self.barrier, self.has_work, self.fails = name, barrier, has_work, fails
        self.max_model_len = 128
        self.num_steps = 0

    def has_unfinished_requests(self) -> bool:
        return self.has_work

    def shutdown(self) -> None:
        pass

    def step(self) -> list:
        if self.barrier is not None:
            self.barrier.wait()  # a timeout (BrokenBarrierError) unless the others step meanwhile
        if self.fails:
            raise RuntimeError(f"{self.name} failed")
        self.num_steps += 1
        return [SimpleNamespace(request_id=self.name, finish_reason=None)]


def test_ranks_step_at_the_same_time():
    barrier = threading.Barrier(2, timeout=10)
    ranks = [FakeRank("a", barrier), FakeRank("idle", has_work=False), FakeRank("b", barrier)]
    core = DataParallelEngineCore(ranks)
    assert [o.request_id for o in core.step()] == ["a", "b"]  # in rank order
    assert [r.num_steps for r in ranks] == [1, 0, 1]
    core.shutdown()


def test_an_error_in_one_rank_surfaces_after_the_others_finish():
    gate = threading.Event()
    slow = FakeRank("slow")
    slow.step = lambda: gate.wait(10) and FakeRank.step(slow)  # finishes after "bad" has raised
    ranks = [FakeRank("bad", fails=True), slow]
    core = DataParallelEngineCore(ranks)
    threading.Timer(0.2, gate.set).start()
    with pytest.raises(RuntimeError, match="bad failed"):
        core.step()
    assert slow.num_steps == 1  # the step call returned only after every rank's step
    core.shutdown()


def test_two_ranks_match_one(tp_worker, tiny_llama_2kv):
    """Two ranks of one device, and two ranks of two pipeline stages each (four devices, each rank's
    stages on its own two): one engine's tokens, streams, abort and steps on both ranks."""
    layouts = [{}, {"data_parallel_size": 2}, {"data_parallel_size": 2, "pipeline_parallel_size": 2}]
    one, *others = tp_worker.run("data_parallel", tiny_llama_2kv, layouts)
    for two in others:
        assert two["tokens"] == one["tokens"], two["layout"]
        assert [len(children) for children in two["tokens"]] == [1, 1, 2, 1, 1, 1]
        assert two["streamed"] == one["streamed"] and two["after_abort"] == one["after_abort"]
        assert one["num_running_mid_stream"] == two["num_running_mid_stream"] == 1
        assert one["abort_freed_all"] and two["abort_freed_all"]
        assert len(two["steps_per_rank"]) == 2 and min(two["steps_per_rank"]) > 0  # both ranks ran
        # Each prompt sent again goes to the rank that cached it (the least loaded rank would be the
        # other one for both): its two full blocks hit there, as on one rank.
        assert two["cached_when_sent_again"] == one["cached_when_sent_again"] == [32, 32]
    assert others[0]["devices_per_rank"] == [[0], [1]]
    assert others[1]["devices_per_rank"] == [[0, 1], [2, 3]]  # each rank's stages on devices of its own


def test_bench_pairs_alternate_and_report_the_median_ratio():
    from xlaserve.entrypoints.bench.data_parallel import run_paired

    dp = SimpleNamespace(engine_core=SimpleNamespace(ranks=[0, 1]), tok_s=[300.0, 200.0, 330.0])
    one = SimpleNamespace(tok_s=[100.0, 200.0, 110.0])
    order = []

    def run(llm, prompts, output_len, batch):
        order.append("dp" if llm is dp else "one")
        return {"output_tokens_per_s": llm.tok_s.pop(0)}

    paired = run_paired(dp, one, run, [], 4, True, rounds=3)
    assert order == ["one", "dp", "dp", "one", "one", "dp"]  # the order turns each round
    assert paired["ratios_output_throughput"] == [3.0, 1.0, 3.0] and paired["ratio_output_throughput"] == 3.0
    assert paired["data_parallel_size"] == 2

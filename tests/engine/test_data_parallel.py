"""Data-parallel ranks step together (issue 28): every rank dispatches its step before any waits for
its device, an error in one rank surfaces once the others have finished their step, and on fake CPU
devices two ranks give the same greedy ids as one, with n > 1 children, a synchronous (penalized) rank
beside an async one, an abort, and stats summed over the ranks."""

from __future__ import annotations

import pytest

from xlaserve.engine.dp_engine import DataParallelEngineCore


class FakeRank:
    """EngineCore's step interface, recording the order of calls in `log`."""

    def __init__(self, name: str, log: list, has_work: bool = True, fail_in: str | None = None):
        self.name, self.log, self.has_work, self.fail_in = name, log, has_work, fail_in
        self.max_model_len = 128
        self.num_finished = 0

    def has_unfinished_requests(self) -> bool:
        return self.has_work

    def begin_step(self) -> None:
        self.log.append(("begin", self.name))
        if self.fail_in == "begin":
            raise RuntimeError(f"{self.name} failed to begin")

    def finish_step(self) -> list:
        self.log.append(("finish", self.name))
        self.num_finished += 1
        if self.fail_in == "finish":
            raise RuntimeError(f"{self.name} failed to finish")
        return []


def test_every_rank_dispatches_before_any_waits():
    log = []
    core = DataParallelEngineCore(
        [FakeRank("a", log), FakeRank("idle", log, has_work=False), FakeRank("b", log)]
    )
    assert core.step() == []
    assert log == [("begin", "a"), ("begin", "b"), ("finish", "a"), ("finish", "b")]


@pytest.mark.parametrize("fail_in", ["begin", "finish"])
def test_an_error_in_one_rank_surfaces_after_the_others_finish(fail_in):
    log = []
    ranks = [FakeRank("a", log), FakeRank("b", log, fail_in=fail_in), FakeRank("c", log)]
    core = DataParallelEngineCore(ranks)
    with pytest.raises(RuntimeError, match=f"b failed to {fail_in}"):
        core.step()
    if fail_in == "begin":  # c never began; a, which had dispatched, is not left half-stepped
        assert log == [("begin", "a"), ("begin", "b"), ("finish", "a")]
    else:
        assert [r.num_finished for r in ranks] == [1, 1, 1]


def test_two_ranks_match_one(tp_worker, tiny_llama_2kv):
    one, two = tp_worker.run("data_parallel", tiny_llama_2kv, [{}, {"data_parallel_size": 2}])
    assert two["tokens"] == one["tokens"]
    assert [len(children) for children in two["tokens"]] == [1, 1, 2, 1, 1, 1]
    assert two["streamed"] == one["streamed"] and two["after_abort"] == one["after_abort"]
    assert one["num_running_mid_stream"] == two["num_running_mid_stream"] == 1
    assert one["abort_freed_all"] and two["abort_freed_all"]
    assert len(two["steps_per_rank"]) == 2 and min(two["steps_per_rank"]) > 0  # both ranks ran


def test_bench_pairs_alternate_and_report_the_median_ratio():
    from types import SimpleNamespace

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

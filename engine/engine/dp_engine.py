"""Data parallelism with vLLM's semantics: N engine cores side by side, one front end.

Each data-parallel rank is a full EngineCore (its own scheduler, KV cache and device group of
tensor_parallel_size devices); a request goes to the rank whose prefix cache holds the longest prefix of
it, among the ranks at most `balance_slack` unfinished requests busier than the least loaded (the least
loaded where none holds any: vLLM's rule). We chose this over one SPMD
program with the batch sharded because each rank then schedules, preempts and caches prefixes on its
own. Each step runs every rank's EngineCore.step in a thread of its own, so the ranks' steps run at
the same time; the step returns with the slowest rank's, so a long prefill on one rank delays the
others' next step (as in one SPMD program), and their host work shares one interpreter's GIL.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

from xlaserve.config import EngineConfig
from xlaserve.core.kv_cache_manager import PrefixCacheStats
from xlaserve.core.kv_connector import KVTransferStats
from xlaserve.core.outputs import EngineCoreOutput, SchedulerStats
from xlaserve.core.request import Request
from xlaserve.core.spec_decode import SpecDecodingStats
from xlaserve.engine.core import EngineCore
from xlaserve.engine.protocol import SleepMode
from xlaserve.engine.structured_output import StructuredOutputManager
from xlaserve.executor import LoadedCheckpoint, device_groups, make_executor


def make_engine_core(
    config: EngineConfig,
    checkpoint: LoadedCheckpoint,
    structured_output: StructuredOutputManager | None = None,
    devices=None,
) -> EngineCore | DataParallelEngineCore:
    """An EngineCore, or a DataParallelEngineCore of data_parallel_size ranks, each with an executor
    on its own group of tensor_parallel_size devices (all built from one read of the checkpoint,
    sharing one structured-output manager). Each rank gets its own view of the config (its
    `data_parallel_rank`), from which it derives what it must not share with the others: a producer's
    block server port, a persistent disk tier's directory."""
    groups = device_groups(config, devices)  # too few devices: an error before any rank is built
    ranks = []
    for rank, group in enumerate(groups):
        parallel = dataclasses.replace(config.parallel, data_parallel_rank=rank)
        rank_config = dataclasses.replace(config, parallel=parallel)
        ranks.append(
            EngineCore(rank_config, make_executor(rank_config, checkpoint, group), structured_output)
        )
    if len(ranks) == 1:
        return ranks[0]
    # An eighth of a rank's sequences: a prompt cached on one rank draws its followers there while that
    # costs little, and a prefix every request shares (a system prompt) soon lives on every rank.
    return DataParallelEngineCore(ranks, balance_slack=max(1, config.scheduler.max_num_seqs // 8))


class DataParallelEngineCore:
    """The EngineCore interface over data-parallel ranks (anything with EngineCore's methods)."""

    def __init__(self, ranks: list[EngineCore], balance_slack: int = 0):
        self.ranks = ranks
        self.balance_slack = balance_slack
        self.max_model_len = ranks[0].max_model_len  # each rank fits it to its (equal) cache
        self._rank_of: dict[str, int] = {}
        # n > 1: (the rank of the first child, children added so far) until the last is added.
        self._rank_of_parent: dict[str, tuple[int, int]] = {}
        # One thread per rank, in which `step` runs that rank's EngineCore.step.
        self._threads = concurrent.futures.ThreadPoolExecutor(len(ranks), thread_name_prefix="xlaserve-dp")

    @property
    def kv_cache_manager(self):
        return self.ranks[0].kv_cache_manager

    @property
    def executor(self):
        """Rank 0's executor: what the ranks' (equal) executors report (weights, blocks, LoRA slots)."""
        return self.ranks[0].executor

    @property
    def runner(self):
        return self.ranks[0].runner

    def add_request(self, request: Request) -> None:
        # Children of one n > 1 request share a rank, so they share prompt blocks.
        rank, num_added = self._rank_of_parent.pop(request.parent_id, (None, 0))
        if rank is None:
            rank = self._rank_for(request)
        self.ranks[rank].add_request(request)
        self._rank_of[request.request_id] = rank
        if request.parent_id is not None and num_added + 1 < request.sampling_params.n:
            self._rank_of_parent[request.parent_id] = (rank, num_added + 1)

    def _rank_for(self, request: Request) -> int:
        """The rank holding the longest cached prefix of `request` among those at most `balance_slack`
        unfinished requests busier than the least loaded; ties (no hit anywhere) to the least loaded,
        then the first."""
        loads = [rank.get_num_unfinished_requests() for rank in self.ranks]
        limit = min(loads) + self.balance_slack

        def preference(i: int) -> tuple[int, int, int]:
            if loads[i] > limit:
                return (-1, 0, 0)
            return (self.ranks[i].kv_cache_manager.num_cached_tokens(request), -loads[i], -i)

        return max(range(len(self.ranks)), key=preference)

    def check_lora(self, lora_request) -> None:
        self.ranks[0].check_lora(lora_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            rank = self._rank_of.pop(rid, None)
            if rank is not None:
                self.ranks[rank].abort_requests([rid])

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.ranks)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.ranks)

    def step(self) -> list[EngineCoreOutput]:
        """One step of every rank with work, each rank in its own thread, as vLLM runs one engine-core
        process per rank: XLA releases the GIL while it runs a step (and jax on CPU runs much of a
        step inside the dispatching call), so one rank's step runs while another's host schedules,
        prepares or applies. The call returns when every rank has finished; the first rank's error
        (in rank order) raises then, so none is left mid-step."""
        stepping = [self._threads.submit(rank.step) for rank in self.ranks if rank.has_unfinished_requests()]
        concurrent.futures.wait(stepping)
        outputs: list[EngineCoreOutput] = []
        for future in stepping:
            outputs += future.result()
        return self._forget_finished(outputs)

    def take_outputs(self) -> list[EngineCoreOutput]:
        return self._forget_finished([output for rank in self.ranks for output in rank.take_outputs()])

    def _forget_finished(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        for output in outputs:
            if output.finish_reason is not None:
                self._rank_of.pop(output.request_id, None)
        return outputs

    def make_stats(self) -> SchedulerStats:
        stats = [r.make_stats() for r in self.ranks]
        prefix = PrefixCacheStats()
        for s in stats:
            for f in ("num_requests", "num_queries", "num_hits"):
                setattr(prefix, f, getattr(prefix, f) + getattr(s.prefix_cache_stats, f))
        return dataclasses.replace(
            stats[0],
            num_running=sum(s.num_running for s in stats),
            num_waiting=sum(s.num_waiting for s in stats),
            kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
            num_preemptions_total=sum(s.num_preemptions_total for s in stats),
            prefix_cache_stats=prefix,
            spec_decoding_stats=_sum_spec_stats([s.spec_decoding_stats for s in stats]),
            kv_transfer_stats=KVTransferStats.total([s.kv_transfer_stats for s in stats]),
        )

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return all([r.reset_prefix_cache(reset_running_requests) for r in self.ranks])

    def update_weights(self, weights) -> list[str]:
        weights = weights if isinstance(weights, dict) else dict(weights)  # every rank reads it
        return [r.update_weights(weights) for r in self.ranks][0]

    def update_weights_from_path(self, path: str) -> list[str]:
        return [r.update_weights_from_path(path) for r in self.ranks][0]

    def sleep(self, level: int = 1, mode: SleepMode = "abort"):
        reports = [r.sleep(level, mode) for r in self.ranks]
        return dataclasses.replace(reports[0], device_bytes=sum(r.device_bytes for r in reports))

    def wake_up(self):
        reports = [r.wake_up() for r in self.ranks]
        return dataclasses.replace(reports[0], device_bytes=sum(r.device_bytes for r in reports))

    @property
    def is_sleeping(self) -> bool:
        return self.ranks[0].is_sleeping

    def apply_model(self, func) -> list:
        return [result for rank in self.ranks for result in rank.apply_model(func)]

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return [result for rank in self.ranks for result in rank.collective_rpc(method, args, kwargs)]

    # The profiler traces the whole process, every rank's programs: rank 0's call starts and stops it.
    def start_profile(self) -> None:
        self.ranks[0].start_profile()

    def stop_profile(self) -> str:
        return self.ranks[0].stop_profile()

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.shutdown()
        self._threads.shutdown()


def _sum_spec_stats(per_rank: list[SpecDecodingStats | None]) -> SpecDecodingStats | None:
    if per_rank[0] is None:
        return None
    total = SpecDecodingStats(per_rank[0].num_spec_tokens)
    for stats in per_rank:
        total.add(stats)
    return total

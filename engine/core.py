"""EngineCore: one step = schedule, execute, update. Used in-process by `LLM` and, in its own
process, behind the OpenAI server."""

from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus
from engine.scheduler import EngineCoreOutput, Scheduler, SchedulerStats

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, hf_config: dict, tensors: dict, max_model_len: int, devices=None):
        self.config = config
        self.max_model_len = max_model_len
        self.runner = ModelRunner(config, hf_config, tensors, max_model_len, devices)
        self.kv_cache_manager = KVCacheManager(
            config.cache.block_size, self.runner.num_blocks, config.cache.enable_prefix_caching, max_model_len
        )
        self.scheduler = Scheduler(config.scheduler, config.cache, max_model_len, self.kv_cache_manager)
        if not config.compilation.enforce_eager:
            self.runner.warm_up()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule which requests get how many tokens, run them, and report what changed."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output.scheduled)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

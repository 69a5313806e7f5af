"""EngineCore: one step = schedule, execute, update, emit. Used in-process by `LLM` and, in its own
process, behind the OpenAI server.

With async scheduling (vLLM V1's, on by default where the executor allows) at most one step stays in
flight: a step schedules and dispatches step N+1, then applies step N's outputs, which the device
computed while the host was scheduling. The ids step N sampled feed step N+1 on the device; the host
learns them one step late (core/scheduler.py's placeholders).

With pipeline micro-batches (an executor whose `max_concurrent_batches` > 1: pipeline stages on one
host) up to that many steps stay in flight instead, each of other requests (vLLM's batch queue): a step
dispatches step k + 1 and then waits for the oldest, so stage 0 runs step k + 1 while the later stages
run step k. No step needs another's sampled ids, so async scheduling's placeholders are not used.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import get_args

from xlaserve.config import EngineConfig
from xlaserve.core.encoder_cache_manager import EncoderCacheManager
from xlaserve.core.kv_cache_manager import KVCacheManager
from xlaserve.core.kv_transfer import make_kv_connector_scheduler
from xlaserve.core.outputs import EngineCoreOutput, SchedulerOutput, SchedulerStats
from xlaserve.core.request import FinishReason, Request, RequestStatus
from xlaserve.core.scheduler import Scheduler
from xlaserve.core.spec_decode import make_proposer
from xlaserve.engine.kv_events import ZmqEventPublisher
from xlaserve.engine.kv_fetch import RemotePrefills
from xlaserve.engine.protocol import SleepMode
from xlaserve.engine.structured_output import StructuredOutputManager
from xlaserve.executor import Executor, StepFuture

logger = logging.getLogger(__name__)

SLEEP_MODES = get_args(SleepMode)

# With nothing to schedule but grammars compiling, a step blocks this long on them at most (the core
# process then looks at its sockets again).
_GRAMMAR_WAIT_S = 0.01


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        structured_output: StructuredOutputManager | None = None,
    ):
        """`executor` holds the model (xlaserve.executor.make_executor) and is the core's only door to
        the devices: the core asks it for the KV cache's size, the limits and checks that depend on the
        model, and hands it each step."""
        self.config = config
        self.is_profiling = False
        self.executor = executor
        # Without a manager (no tokenizer) a constrained request is refused, never run unconstrained.
        self.structured_output = structured_output or StructuredOutputManager()
        # Only now is the cache's size known: a context it cannot hold is an error (or, when the user
        # left max_model_len to the model, lowered) here, at start, not a rejection of every request.
        max_model_len = executor.fit_max_model_len(is_user_set=config.model.max_model_len is not None)
        self.max_model_len = max_model_len
        # K/V kept outside the device cache (host offload: core/kv_offload.py), or the base class (none);
        # it hears of every block the prefix cache evicts.
        self.kv_connector = make_kv_connector_scheduler(
            config.cache,
            executor.kv_bytes_per_block,
            executor.kv_persist_dir,
            config.kv_transfer,
            enable_kv_cache_events=config.kv_events is not None,
        )
        # Disaggregated prefill's consumer: requests wait here while their prompt's blocks are fetched
        # from a producer (engine/engine/kv_fetch.py), then join the scheduler with them.
        self.remote_prefills = RemotePrefills(
            config.kv_transfer, config.cache.block_size, executor.kv_bytes_per_block
        )
        # A pooling model that reads every prompt token (MEAN/CLS/ALL, an encoder) caches no prefix, and
        # an encoder's prompt runs whole in one step (worker/pooler.py).
        self.kv_cache_manager = KVCacheManager(
            config.cache.block_size,
            executor.num_kv_blocks,
            config.cache.enable_prefix_caching and executor.is_prefix_cacheable,
            max_model_len,
            on_evict=self.kv_connector.on_block_evicted,
            kv_cache_groups=executor.kv_cache_groups,
            enable_kv_cache_events=config.kv_events is not None,
        )
        self.async_scheduling = config.is_async_scheduling
        if config.scheduler.async_scheduling is not False and not self.async_scheduling:
            logger.info("async scheduling off: %s", config.async_scheduling_off_reason())
        elif config.scheduler.async_scheduling is None and executor.runs_on_host_cpu:
            # Left to its default on a CPU: the overlap is not free there (engine/PERFORMANCE.md, "Async
            # scheduling": the host's Python beside a step takes a core from XLA's threads, and a parallel
            # op waits for its slowest thread); --async-scheduling still turns it on.
            self.async_scheduling = False
            logger.info(
                "async scheduling off: the devices are this host's CPU cores (--async-scheduling: on)"
            )
        # Micro-batches replace async scheduling: each step's ids are known on the host when it is scheduled.
        num_micro_batches = executor.max_concurrent_batches
        if num_micro_batches > 1 and executor.runs_on_host_cpu:
            # Stages on this host's CPU cores share them: they overlap little, and a half batch decodes
            # almost as slowly as a whole one (engine/PERFORMANCE.md, "Pipeline micro-batches": 0.65x).
            logger.info("pipeline micro-batches off: the stages' devices are this host's CPU cores")
            num_micro_batches = 1
        if num_micro_batches > 1:
            self.async_scheduling = False
            logger.info("pipeline micro-batches: up to %d steps in flight", num_micro_batches)
        spec = config.speculative
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            max_model_len,
            self.kv_cache_manager,
            async_scheduling=self.async_scheduling,
            num_spec_tokens=config.num_spec_tokens,
            # A draft model writes its K/V for the k positions after each sampled token (its drafts):
            # slots for them are allocated ahead when free (worker/draft_model.py).
            num_lookahead_tokens=executor.num_lookahead_tokens,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill and not executor.is_encoder,
            kv_connector=self.kv_connector,
            encoder_cache=EncoderCacheManager(executor.encoder_cache_layout),
            num_micro_batches=num_micro_batches,
        )
        # Speculative decoding (engine/SPEC_DECODE.md): drafts for the next step, from this one's tokens.
        self.proposer = make_proposer(spec, max_model_len)
        # Grammar masks per step row: one per verified position (the mask after drafts 0..j-1).
        self._num_verified_positions = 1 + config.num_spec_tokens
        self._is_draft_sampled = spec is not None and spec.method == "draft_model"
        # KV cache events (--kv-events-config): what each step stored in and removed from the prefix
        # cache, published after the step (engine/engine/kv_events.py). None: off, and nothing recorded.
        # Opened before the warm-up: an endpoint in use fails at once, and subscribers connect meanwhile.
        self.kv_event_publisher = None
        if config.kv_events is not None:
            self.kv_event_publisher = ZmqEventPublisher(config.kv_events, config.parallel.data_parallel_rank)
        executor.start()  # warm-up compiles; a multi-host executor then waits for its followers
        if self.kv_event_publisher is not None:  # a persistent disk tier's blocks, routable from the start
            self._publish_kv_events()
        # The steps dispatched but not yet applied, oldest first (`max_steps_in_flight` at most).
        self._in_flight: deque[tuple[SchedulerOutput, StepFuture]] = deque()
        # The most steps of requests dispatched and not yet applied at once (tests, benchmarks).
        self.peak_steps_in_flight = 0
        self._last_runner_output = None  # the last step applied: a draft model's drafts ride in it
        self.sleep_level = 0  # 1: the KV cache freed, 2: and the weights (sleep / wake_up)
        # Outputs made between steps (a sleep applies the steps in flight and aborts what it finds): the
        # next step returns them first, or the core process sends them at once (take_outputs).
        self._pending_outputs: list[EngineCoreOutput] = []

    @property
    def runner(self):
        """The executor's model runner, for tests and benchmarks that inspect it (compile counts, the
        programs, timings); the core itself never calls it."""
        return self.executor.runner

    def add_request(self, request: Request) -> None:
        if self.is_sleeping:
            raise ValueError(
                "the engine is asleep (sleep() was called): call wake_up() before sending requests"
            )
        if request.lora_request is not None:
            self.check_lora(request.lora_request)  # a bad adapter fails here, not in a step
        self.structured_output.add_request(request)
        if self.remote_prefills.wants(request):
            # What this engine's caches hold of the prompt is not fetched (a conversation coming back).
            self.remote_prefills.submit(request, self.scheduler.num_local_prefix_tokens(request))
        else:
            self.scheduler.add_request(request)

    def check_lora(self, lora_request) -> None:
        """ValueError (naming the adapter and the field) unless LoRA is on and the adapter is servable."""
        self.executor.check_lora(lora_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.remote_prefills.abort(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or len(self.remote_prefills) > 0

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests() + len(self.remote_prefills)

    @property
    def max_steps_in_flight(self) -> int:
        """Steps dispatched and not yet applied, at most, counting the one just dispatched: the
        micro-batches, else 2 with async scheduling (step N runs while N + 1 is dispatched), else 1."""
        if self.scheduler.num_micro_batches > 1:
            return self.scheduler.num_micro_batches
        return 2 if self.async_scheduling else 1

    def step(self) -> list[EngineCoreOutput]:
        """Schedule which requests get how many tokens, run them, and report what changed (with async
        scheduling, what changed in the previous step, which ran while this one was scheduled)."""
        outputs = self.take_outputs()
        if self.is_sleeping:  # requests a sleep kept wait for wake_up
            return outputs
        self.structured_output.wait_before_schedule()  # returns at once when no grammar compiles
        for request in self.remote_prefills.take_ready():  # their blocks arrived (or will be computed)
            self.scheduler.add_request(request)
        if self._in_flight and self.scheduler.needs_known_tokens():
            # A synchronous step: penalties or a grammar need the ids still on the device.
            outputs += self._update_in_flight()
        scheduler_output = self.scheduler.schedule()
        grammar_bitmask = self.structured_output.grammar_bitmask(
            scheduler_output.scheduled, self._num_verified_positions
        )
        future = self.executor.execute_async(
            scheduler_output.scheduled, grammar_bitmask, scheduler_output.kv_connector_metadata
        )
        was_idle = not self._in_flight
        if scheduler_output.is_empty:
            # Nothing new runs (every request the scheduler could run is in a step in flight, or waits):
            # the engine waits for the oldest step instead of spinning.
            outputs += self._update_in_flight(keep=len(self._in_flight) - 1)
            self._last_runner_output = future.result()
            outputs += self.scheduler.update_from_output(scheduler_output, self._last_runner_output)
        else:
            self._in_flight.append((scheduler_output, future))
            self.peak_steps_in_flight = max(self.peak_steps_in_flight, len(self._in_flight))
            # Kept in flight only while the next step can use them: a request that failed while the step
            # was prepared must be finished (its blocks uncached) before anything else is scheduled.
            is_done = future.failed_req_ids or not self.scheduler.has_unfinished_requests()
            outputs += self._update_in_flight(keep=0 if is_done else self.max_steps_in_flight - 1)
        if self.proposer is not None:  # speculative decoding runs synchronously: every id is known
            self.proposer.propose(self.scheduler.running, self._last_runner_output)
            # Grammars cut their drafts; a draft model's sampled drafts keep their first rejected one.
            self.structured_output.check_drafts(self.scheduler.running, keep_rejected=self._is_draft_sampled)
        if scheduler_output.is_empty and was_idle:  # what is unfinished waits for its grammar, or blocks
            if len(self.remote_prefills):
                self.remote_prefills.wait(_GRAMMAR_WAIT_S)
            else:
                self.structured_output.wait_for_grammars(_GRAMMAR_WAIT_S)
        if self.kv_event_publisher is not None:
            self._publish_kv_events()
        return outputs

    def take_outputs(self) -> list[EngineCoreOutput]:
        """The outputs made between steps, since the last call (the core process sends them before a
        utility call's result, so that its caller's streams end first)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _publish_kv_events(self) -> None:
        """Hand what the prefix cache (and the offload tiers) stored and removed since the last batch to the
        publisher's thread."""
        events = self.kv_cache_manager.take_events() + self.kv_connector.take_events()
        if events:
            self.kv_event_publisher.publish(events)

    def _update_in_flight(self, keep: int = 0) -> list[EngineCoreOutput]:
        """Wait for the steps in flight, oldest first, and apply their outputs until `keep` are left."""
        outputs = []
        while len(self._in_flight) > max(keep, 0):
            scheduler_output, future = self._in_flight.popleft()
            self._last_runner_output = future.result()
            outputs += self.scheduler.update_from_output(scheduler_output, self._last_runner_output)
        return outputs

    def set_async_scheduling(self, enabled: bool) -> None:
        """Turn async scheduling on or off between steps (benchmarks pair both modes on one engine);
        the step in flight, if any, is applied first and its outputs dropped: call it while idle."""
        if enabled and self.config.async_scheduling_off_reason() is not None:
            raise ValueError(f"async scheduling is not possible: {self.config.async_scheduling_off_reason()}")
        if enabled and self.scheduler.num_micro_batches > 1:
            raise ValueError("async scheduling is not possible: pipeline micro-batches run instead")
        self._update_in_flight()
        self.async_scheduling = self.scheduler.async_scheduling = enabled

    def set_num_micro_batches(self, num: int) -> None:
        """Keep up to `num` steps of different requests in flight (1: one at a time; benchmarks pair both
        on one engine), at most the executor's `max_concurrent_batches`; the steps in flight are applied
        first and their outputs dropped: call it while idle."""
        if not 1 <= num <= max(self.executor.max_concurrent_batches, 1):
            raise ValueError(
                f"num_micro_batches must be in 1..{self.executor.max_concurrent_batches} here, got {num}"
            )
        if num > 1 and self.async_scheduling:
            raise ValueError("micro-batches are not possible with async scheduling on")
        self._update_in_flight()
        self.scheduler.num_micro_batches = num

    def make_stats(self) -> SchedulerStats:
        stats = dataclasses.replace(self.scheduler.make_stats(), sleep_level=self.sleep_level)
        if stats.kv_transfer_stats is not None:
            stats.kv_transfer_stats.add(self.remote_prefills.make_stats())
        return stats

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix; with `reset_running_requests` (vLLM's, sent after a weight update)
        the running requests are preempted first and recompute theirs (core/preemption.py)."""
        is_reset = self.scheduler.reset_prefix_cache(reset_running_requests)
        if self.kv_event_publisher is not None:  # routers forget this engine's blocks now, not next step
            self._publish_kv_events()
        return is_reset

    # -- the research stack (worker/weight_update.py) ---------------------------------------------

    def _require_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise ValueError(
                f"{what}: {self.get_num_unfinished_requests()} requests are still running; "
                "wait for them (or abort them) first"
            )

    def _require_awake(self, what: str) -> None:
        if self.is_sleeping:  # a level-2 wake-up would put back the weights saved at sleep over them
            raise ValueError(f"{what}: the engine is asleep: call wake_up() first")

    def update_weights(self, weights) -> list[str]:
        """New weights (HF names -> arrays, all or some); the prefix cache goes with the old ones."""
        return self._swap_weights("update_weights", self.executor.update_weights, weights)

    def update_weights_from_path(self, path: str) -> list[str]:
        return self._swap_weights("update_weights_from_path", self.executor.update_weights_from_path, path)

    def _swap_weights(self, what: str, swap, source) -> list[str]:
        self._require_awake(what)
        self._require_idle(what)
        self._update_in_flight()
        names = swap(source)
        self.reset_prefix_cache()
        return names

    def sleep(self, level: int = 1, mode: SleepMode = "abort"):
        """Hand the KV cache's device memory back (level 2: the weights' too) until `wake_up`. The
        requests unfinished go by `mode`, vLLM's: "abort" finishes them (finish_reason abort); "keep"
        keeps them waiting, the running ones preempted, to recompute after wake_up; "wait" refuses while
        any is left (the front end waits for them first: AsyncLLM.sleep)."""
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 (the KV cache) or 2 (and the weights), got {level!r}")
        if mode not in SLEEP_MODES:
            raise ValueError(f"sleep: mode must be one of {', '.join(SLEEP_MODES)}, got {mode!r}")
        if self.is_sleeping:
            raise ValueError("sleep: the engine is already asleep")
        if mode == "wait":
            self._require_idle("sleep")
        self._pending_outputs += self._update_in_flight()
        if mode == "abort":
            self._pending_outputs += self._abort_all()
        # The cached blocks' contents go with the cache, and the kept requests' with them.
        self.reset_prefix_cache(reset_running_requests=True)
        report = self.executor.sleep(level)
        self.sleep_level = level
        return report

    def _abort_all(self) -> list[EngineCoreOutput]:
        """Abort every unfinished request; -> the outputs that tell their callers."""
        request_ids = [*self.scheduler.requests, *self.remote_prefills.request_ids()]
        self.abort_requests(request_ids)
        return [EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT) for rid in request_ids]

    def wake_up(self):
        if not self.is_sleeping:
            raise ValueError("wake_up: the engine is not asleep")
        report = self.executor.wake_up()
        self.sleep_level = 0
        return report

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    # -- a user's code on the model (LLM.apply_model, collective_rpc) -------------------------------

    def apply_model(self, func) -> list:
        # The weights are immutable arrays the steps in flight only read: no step needs to finish first.
        self._require_awake("apply_model")
        return self.executor.apply_model(func)

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """One result per rank (here one): vLLM's one per worker."""
        return [self.executor.collective_rpc(method, args, kwargs or {})]

    # -- the profiler (CompilationConfig.profiler_dir) ---------------------------------------------

    def start_profile(self) -> None:
        """Start a jax.profiler trace of this process (the engine's programs, its host work) into
        profiler_dir, through the executor; `stop_profile` writes it."""
        folder = self.config.compilation.profiler_dir
        if folder is None:
            raise ValueError(
                "start_profile needs profiler_dir (--profiler-dir, or XLASERVE_PROFILER_DIR): the folder "
                "the trace is written to"
            )
        if self.is_profiling:
            raise ValueError("start_profile: a profile is already running; call stop_profile first")
        self.executor.start_profile(folder)
        self.is_profiling = True
        logger.info("profiling into %s", folder)

    def stop_profile(self) -> str:
        """Write the trace `start_profile` began; -> the folder it is under (plugins/profile/<run>/:
        an .xplane.pb for TensorBoard, a .trace.json.gz for Perfetto)."""
        if not self.is_profiling:
            raise ValueError("stop_profile: no profile is running; call start_profile first")
        self.executor.stop_profile()
        self.is_profiling = False
        logger.info("profile written to %s", self.config.compilation.profiler_dir)
        return self.config.compilation.profiler_dir

    def shutdown(self) -> None:
        self._keep_kv_blocks()
        self.remote_prefills.shutdown()
        self.executor.shutdown()
        self.structured_output.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

    def _keep_kv_blocks(self) -> None:
        """What outlives the engine (a persistent disk tier's blocks: core/kv_offload.py), copied once the
        steps in flight are done."""
        if self.config.cache.kv_offloading_disk_persist:
            self._update_in_flight()  # their blocks are computed, and the cache is theirs to the end
        plan = self.kv_connector.shutdown_plan(self.kv_cache_manager.cached_blocks())
        if plan is not None:
            self.executor.keep_kv_blocks(plan)
            if self.kv_event_publisher is not None:  # the disk tier's last stores (and what they evicted)
                self._publish_kv_events()
        self.kv_connector.shut_down()

"""The engine's whole configuration (EngineConfig): the groups above, checked against each other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from xlaserve.config.cache import CacheConfig
from xlaserve.config.checks import require
from xlaserve.config.compilation import CompilationConfig
from xlaserve.config.kv_events import KVEventsConfig, tcp_port
from xlaserve.config.kv_transfer import KVTransferConfig
from xlaserve.config.lora import LoRAConfig
from xlaserve.config.model import ModelConfig
from xlaserve.config.parallel import ParallelConfig
from xlaserve.config.scheduler import SchedulerConfig
from xlaserve.config_args import ARG_KEY, arg
from xlaserve.speculative_config import SpeculativeConfig, speculators_target


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    compilation: CompilationConfig
    speculative: SpeculativeConfig | None = field(
        default=None,
        metadata=arg(
            'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 1, "prompt_lookup_max": 4} (engine/SPEC_DECODE.md)',
            flag="--speculative-config",
        ),
    )
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self):
        if self.cache.kv_offloading_size is not None:
            # The transfers ride beside the step on one process (a drafter's own cache, indexed by the
            # same block ids, moves with the target's: worker/kv_plumbing.py).
            require(self.parallel.nnodes == 1, "kv_offloading_size runs on one host (nnodes=1)")
        events, dp = self.cache.kv_events, self.parallel.data_parallel_size
        if events is not None and events.is_publishing:
            # Each data-parallel rank publishes on a port of its own (`kv_events`).
            for name in ("endpoint", "replay_endpoint"):
                port = tcp_port(getattr(events, name))
                require(
                    port is None or port + dp - 1 <= 65535,
                    f"kv_events_config.{name}: data_parallel_size={dp} ranks publish on {dp} consecutive "
                    f"ports from {port}, past 65535; use a port of at most {65536 - dp}",
                )
        if self.cache.kv_transfer_config is not None:
            # The block server and the loads ride beside the step on one process, as offload's do (on
            # pipeline stages too: one block server over every stage's cache).
            require(self.parallel.nnodes == 1, "kv_transfer_config runs on one host (nnodes=1)")
            # Each data-parallel rank serves its blocks on a port of its own (`kv_transfer`).
            transfer, dp = self.cache.kv_transfer, self.parallel.data_parallel_size
            require(
                not transfer.is_producer or transfer.kv_port + dp - 1 <= 65535,
                f"kv_transfer_config.kv_port={transfer.kv_port}: a producer with data_parallel_size={dp} "
                f"serves on {dp} consecutive ports from kv_port, past 65535; lower kv_port to at most "
                f"{65536 - dp}",
            )
            require(
                self.model.runner != "pooling",
                "kv_transfer_config needs a generating model (runner='generate')",
            )
        dcp = self.parallel.decode_context_parallel_size
        if dcp > 1:  # what the interleaved cache (sharding/context_parallel.py) does not serve yet
            require(
                self.cache.block_size % dcp == 0,
                f"block_size={self.cache.block_size} must be a multiple of decode_context_parallel_size="
                f"{dcp} (each rank stores block_size / {dcp} of a block's tokens)",
            )
            require(
                self.speculative is None or not self.speculative.has_draft_cache,
                f"decode_context_parallel_size={dcp} cannot be combined with a draft model or MTP layer yet",
            )
        pcp = self.parallel.prefill_context_parallel_size
        if pcp > 1:  # what the token-split step (sharding/context_parallel.py) does not serve yet
            require(
                self.speculative is None or not self.speculative.has_draft_cache,
                f"prefill_context_parallel_size={pcp} cannot be combined with a draft model or MTP layer yet",
            )
        pp = self.parallel.pipeline_parallel_size
        if pp > 1:  # what the pipelined executor (executor/pipeline.py) does not run yet
            for is_set, what in (
                # A draft model's forward runs whole on one group of devices, not cut into stages.
                (
                    self.speculative is not None and self.speculative.method != "ngram",
                    f"speculative_config method {getattr(self.speculative, 'method', None)!r} (n-gram runs)",
                ),
                # The last stage's process answers each step with its sampled ids, not pooled states or
                # verified drafts.
                (
                    self.model.runner == "pooling" and self.parallel.nnodes > 1,
                    "runner='pooling' across nnodes",
                ),
                (
                    self.speculative is not None and self.parallel.nnodes > 1,
                    "speculative_config across nnodes",
                ),
            ):
                require(not is_set, f"pipeline_parallel_size={pp} cannot be combined with {what} yet")
        # Speculative decoding runs on the synchronous step: the next step's drafts come from this
        # step's accepted tokens, which async scheduling would not have yet.
        require(
            self.speculative is None or self.scheduler.async_scheduling is not True,
            "async_scheduling cannot be combined with speculative_config; turn one of them off",
        )
        if self.model.runner == "pooling":
            require(
                self.speculative is None, "runner='pooling' never decodes: speculative_config does not apply"
            )
            if self.cache.enable_prefix_caching and self.model.pooling_type != "LAST":
                # A cached prefix's tokens are not computed again, and pooling over them needs their
                # hidden states: only LAST pooling (the last token is always computed) may skip them.
                object.__setattr__(
                    self, "cache", dataclasses.replace(self.cache, enable_prefix_caching=False)
                )

    def async_scheduling_off_reason(self) -> str | None:
        """Why async scheduling cannot run with this configuration (None: it can)."""
        if self.parallel.nnodes > 1:
            return "the multi-host executor runs each step synchronously (followers check every step)"
        if self.speculative is not None:
            return "speculative decoding proposes drafts from the accepted ids, known only after a step"
        return None

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """This data-parallel rank's kv_transfer_config (None: off): rank r's block server listens on
        kv_port + r, and its finished requests name that port, so a consumer fetches from the rank that
        computed the prompt."""
        transfer = self.cache.kv_transfer
        if transfer is None or self.parallel.data_parallel_rank == 0:
            return transfer
        return dataclasses.replace(transfer, kv_port=transfer.kv_port + self.parallel.data_parallel_rank)

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """This data-parallel rank's kv_events_config when it publishes (None: nothing is recorded):
        rank r publishes on the endpoint's port + r (vLLM's rule)."""
        events = self.cache.kv_events
        if events is None or not events.is_publishing:
            return None
        return events.for_rank(self.parallel.data_parallel_rank)

    @property
    def num_spec_tokens(self) -> int:
        """Drafts verified per request and step: speculative_config's k, 0 without speculation. A
        step then reads 1 + k positions per request (the scheduler's slots, the runner's verification,
        the grammar masks)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    @property
    def is_async_scheduling(self) -> bool:
        """Async scheduling is asked for (or left to its default, on) and possible here."""
        return self.scheduler.async_scheduling is not False and self.async_scheduling_off_reason() is None

    @property
    def core_shutdown_timeout_s(self) -> float:
        """How long this engine's core may take to stop by itself once asked, before it is terminated: a
        persistent disk tier writes its cached blocks out first (core/kv_offload.py), which takes long."""
        return 300.0 if self.cache.kv_offloading_disk_persist else 5.0

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> EngineConfig:
        """Split vLLM-named keyword arguments among the sub-configs; unknown names are an error. A
        field is known by its name and by its flag's (`scheduling_policy` for `policy`)."""
        parts: dict[str, dict] = {name: {} for name in CONFIG_GROUPS}
        model, speculative = speculators_target(model, kwargs.pop("speculative_config", None))
        parts["model"]["model"] = model
        names: dict[str, tuple[str, str]] = {}
        for group, klass in CONFIG_GROUPS.items():
            for f in dataclasses.fields(klass):
                names[f.name] = (group, f.name)
                spec = f.metadata.get(ARG_KEY)
                if spec is not None:
                    names.setdefault(spec.kwarg_for(f.name), (group, f.name))
        speculative = SpeculativeConfig.parse(speculative)
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"unknown engine argument {key!r}; known: {sorted(names)}")
            group, name = names[key]
            parts[group][name] = value
        return cls(
            **{group: CONFIG_GROUPS[group](**parts[group]) for group in CONFIG_GROUPS},
            speculative=speculative,
        )


# The sub-configs by their `EngineConfig` field name: what `from_kwargs` splits arguments among and
# what entrypoints/arg_utils.py reads flags from.
CONFIG_GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "compilation": CompilationConfig,
    "lora": LoRAConfig,
}

"""Parallelism: tensor, expert, data and pipeline parallel sizes, hosts."""

from __future__ import annotations

from dataclasses import dataclass, field

from xlaserve.config.checks import require
from xlaserve.config_args import arg, not_a_flag


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(
        default=1, metadata=arg("devices one model is sharded over", aliases=("-tp",))
    )
    data_parallel_size: int = field(
        default=1, metadata=arg("engine cores side by side, each on its own devices", aliases=("-dp",))
    )
    # Which data-parallel rank this view of the config is (vLLM's ParallelConfig.data_parallel_rank):
    # make_engine_core (engine/dp_engine.py) gives each rank its own, so that what a rank must hold
    # alone (a producer's block server port, a persistent disk tier's directory) is derived from it.
    data_parallel_rank: int = field(default=0, metadata=not_a_flag("make_engine_core, per rank"))
    pipeline_parallel_size: int = field(
        default=1,
        metadata=arg(
            "pipeline stages: the layers split into this many contiguous stages, each on its own "
            "tensor_parallel_size devices",
            aliases=("-pp",),
        ),
    )
    decode_context_parallel_size: int = field(
        default=1,
        metadata=arg(
            "decode context parallel (vLLM's DCP): each sequence's KV cache interleaved over this many "
            "tensor-parallel ranks that would otherwise hold copies of the same KV head",
            aliases=("-dcp",),
        ),
    )
    prefill_context_parallel_size: int = field(
        default=1,
        metadata=arg(
            "prefill context parallel (vLLM's PCP): each step's tokens split over this many groups of "
            "tensor_parallel_size devices, each group holding the whole KV cache",
            aliases=("-pcp",),
        ),
    )
    enable_expert_parallel: bool = field(
        default=False, metadata=arg("shard a MoE's experts over the tensor-parallel devices")
    )
    # Multi-host (vLLM's multi-node names): one process per host, jax.distributed across them.
    nnodes: int = field(default=1, metadata=arg("processes (hosts) of a multi-host engine"))
    node_rank: int = field(default=0, metadata=arg("this process's rank; 0 runs the front end"))
    master_addr: str = field(
        default="127.0.0.1", metadata=arg("address of process 0 (jax.distributed coordinator)")
    )
    # jax.distributed's coordinator; the step channel uses master_port + 1, and pipeline stages on
    # several processes receive their inputs on master_port + 2 + node_rank (sharding/distributed.py)
    master_port: int = field(
        default=29500,
        metadata=arg("coordinator port; the step channel uses +1, pipeline stages' transfers +2+node_rank"),
    )

    def __post_init__(self):
        require(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}",
        )
        require(
            self.data_parallel_size >= 1, f"data_parallel_size must be >= 1, got {self.data_parallel_size}"
        )
        require(
            0 <= self.data_parallel_rank < self.data_parallel_size,
            f"data_parallel_rank must be in [0, data_parallel_size={self.data_parallel_size}), "
            f"got {self.data_parallel_rank}",
        )
        require(
            self.pipeline_parallel_size >= 1,
            f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}",
        )
        dcp = self.decode_context_parallel_size
        require(dcp >= 1, f"decode_context_parallel_size must be >= 1, got {dcp}")
        require(
            self.tensor_parallel_size % dcp == 0,
            f"decode_context_parallel_size={dcp} must divide tensor_parallel_size="
            f"{self.tensor_parallel_size} (its ranks are tensor-parallel ranks)",
        )
        require(
            dcp == 1 or self.pipeline_parallel_size == 1,
            f"decode_context_parallel_size={dcp} cannot be combined with pipeline_parallel_size="
            f"{self.pipeline_parallel_size} yet",
        )
        pcp = self.prefill_context_parallel_size
        require(pcp >= 1, f"prefill_context_parallel_size must be >= 1, got {pcp}")
        if pcp > 1:
            for other, value in (
                ("pipeline_parallel_size", self.pipeline_parallel_size),
                ("data_parallel_size", self.data_parallel_size),
                ("nnodes", self.nnodes),
            ):
                require(
                    value == 1,
                    f"prefill_context_parallel_size={pcp} cannot be combined with {other}={value} yet",
                )
        require(self.nnodes >= 1, f"nnodes must be >= 1, got {self.nnodes}")
        require(
            0 <= self.node_rank < self.nnodes,
            f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}",
        )
        require(
            self.nnodes == 1 or self.data_parallel_size == 1,
            f"data_parallel_size={self.data_parallel_size} with nnodes={self.nnodes} is not supported; "
            "use tensor parallelism across hosts",
        )

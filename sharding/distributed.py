"""Multi-host engines: jax.distributed set-up. (How process 0 sends each step to the others is
the executor's: xlaserve/executor/multihost.py.)"""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)


def initialize(master_addr: str, master_port: int, nnodes: int, node_rank: int) -> None:
    """jax.distributed over `nnodes` processes; on CPU the collectives go through gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"{master_addr}:{master_port}", num_processes=nnodes, process_id=node_rank
    )
    logger.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        node_rank,
        nnodes,
        jax.local_device_count(),
        jax.device_count(),
    )

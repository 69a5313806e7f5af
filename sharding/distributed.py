"""Multi-host engines: jax.distributed set-up. (How process 0 sends each step to the others is
the executor's: xlaserve/executor/multihost.py.)"""

from __future__ import annotations

import dataclasses
import logging
import socket

import jax
from jax._src import distributed as jax_distributed  # the caller's coordinator address: public nowhere

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Session:
    """The jax.distributed session a process joined: where its coordinator is and which process it is."""

    master_addr: str
    master_port: int
    nnodes: int
    node_rank: int
    cross_host_transfers: bool


# jax.distributed is process-wide and joined once: the session this process joined (None: none yet), so
# that a later engine over the same processes joins it as it is and one over others is refused.
_session: Session | None = None


def initialize(
    master_addr: str, master_port: int, nnodes: int, node_rank: int, cross_host_transfers: bool = False
) -> None:
    """jax.distributed over `nnodes` processes; on CPU the collectives go through gloo.

    Once per process, and not where the caller's code joined one already: the engine runs over that
    session if it is the one the engine names (same coordinator, process count and rank). A later engine
    (the first one shut down, its followers released) runs over the session the first joined, when it
    names the same one; other processes or ports are a ValueError.

    `cross_host_transfers`: the engine needs `jax.device_put` to copy arrays to another process's
    devices (pipeline stages on different processes). The CPU backend has no transfers of its own, so
    JAX's DCN transfer server carries them: this process listens on port master_port + 2 + node_rank
    (port 0 does not work: the peers are told the port asked for, not the one bound). A session joined
    here always sets them up, whatever its first engine, so that any later engine may have stages across
    processes: JAX starts the server only at the first cross-host transfer (a session whose engines never
    make one costs nothing: no socket, no thread)."""
    global _session
    session = Session(master_addr, master_port, nnodes, node_rank, cross_host_transfers)
    if _session is None and jax.distributed.is_initialized():
        _session = _users_session()
    if _session is not None:
        _check_joins(_session, session)
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = f"{_reachable_address(master_addr)}:{transfer_port(master_port, node_rank)}"
    jax.config.update("jax_cross_host_transfer_socket_address", address)
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
    _session = dataclasses.replace(session, cross_host_transfers=True)


def _users_session() -> Session:
    """The session the user's own code joined (`jax.distributed.initialize` before the first engine), read
    from JAX's state without creating its backends; cross-host transfers are there if the user set their
    socket address (JAX reads it when it creates the backend)."""
    state = jax_distributed.global_state
    master_addr, _, master_port = state.coordinator_address.rpartition(":")
    transfers = bool(jax.config.read("jax_cross_host_transfer_socket_address"))
    logger.info(
        "jax.distributed: joined by the caller at %s, process %d of %d",
        state.coordinator_address,
        state.process_id,
        state.num_processes,
    )
    return Session(master_addr, int(master_port), state.num_processes, state.process_id, transfers)


def _check_joins(live: Session, wanted: Session) -> None:
    """A later engine runs over the live session only: jax.distributed cannot be joined twice."""
    differ = [
        f"{field.name}={getattr(wanted, field.name)!r} (the session's: {getattr(live, field.name)!r})"
        for field in dataclasses.fields(Session)
        if field.name != "cross_host_transfers" and getattr(wanted, field.name) != getattr(live, field.name)
    ]
    if differ:
        raise ValueError(
            f"this process joined a jax.distributed session already (for an earlier engine, or by its own "
            f"jax.distributed.initialize), and a process joins one only once: the engine's "
            f"{', '.join(differ)}; build it with the session's values or in a new process"
        )
    if wanted.cross_host_transfers and not live.cross_host_transfers:
        raise ValueError(
            "pipeline stages across processes need cross-host transfers, which JAX sets up with its "
            "backend; the jax.distributed session this process's own code joined has none: set "
            "jax_cross_host_transfer_socket_address (this host's address and a free port) before JAX "
            "creates its backend, or let the engine join jax.distributed"
        )


def transfer_port(master_port: int, node_rank: int) -> int:
    """The port a process receives cross-host device transfers on (after the coordinator's and the step
    channel's)."""
    return master_port + 2 + node_rank


def _reachable_address(master_addr: str) -> str:
    """This host's address on the route to process 0 (process 0's own is master_addr): the address the
    other processes send transfers to. A UDP connect sends nothing; it only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, 1))
        return s.getsockname()[0]

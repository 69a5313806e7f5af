"""The research stack's calls between steps on a multi-host engine (executor/multihost.py).

A research-stack call (worker/weight_update.py) goes to the followers as a `Call` between steps: process
0 runs it first (a caller's error, a wrong name or shape, then changes nothing anywhere), then every
follower runs it on its own shards and answers; `update_weights`' arrays travel as host bytes (each
process cuts its own shards from them, as a load does), `update_weights_from_path` as the path (each
process reads the checkpoint itself, as at start). Pipeline stages across processes update in two
phases (executor/pipeline.py): every process prepares its own stages' new weights, and only once all
have is each told to commit them. A follower looks a call up by name in a fixed table, nothing else.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping

import jax
import numpy as np

from xlaserve.lora_request import LoRARequest
from xlaserve.worker import sleep_mode, weight_update
from xlaserve.worker.model_runner import ModelRunner


@dataclasses.dataclass(frozen=True)
class Call:
    """Host work for every follower between steps: a research-stack call (`method` of
    worker/weight_update.py, or of worker/sleep_mode.py for sleep and wake_up, with `args`, and for
    update_weights or prepare_update the arrays, host copies sent as their bytes), or
    "put_lora_in_slot" (slot, LoRARequest fields): an adapter process 0 wrote into a slot while
    preparing the next step."""

    method: str
    args: tuple = ()
    weights: dict[str, np.ndarray] | None = None

    def __post_init__(self):
        if self.method not in _FOLLOWER_CALLS:
            raise ValueError(f"no call {self.method!r} between steps (known: {', '.join(_FOLLOWER_CALLS)})")

    def to_frames(self) -> list[bytes]:
        weights = self.weights or {}
        header = {
            "method": self.method,
            "args": list(self.args),
            "weights": [[name, a.dtype.name, list(a.shape)] for name, a in weights.items()],
        }
        return [json.dumps(header).encode(), *(np.ascontiguousarray(a).data for a in weights.values())]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Call:
        header = json.loads(frames[0])
        weights = {
            name: np.frombuffer(data, jax.numpy.dtype(dtype)).reshape(shape)
            for (name, dtype, shape), data in zip(header["weights"], frames[1:], strict=True)
        }
        return cls(header["method"], tuple(header["args"]), weights if header["weights"] else None)

    def run(self, runner: ModelRunner):
        args = (self.weights,) if self.method in _TAKES_WEIGHTS else self.args
        return _FOLLOWER_CALLS[self.method](runner, *args)


def _put_lora_in_slot(runner: ModelRunner, slot: int, *lora) -> None:
    runner.lora.put_in_slot(slot, LoRARequest(*lora))


# What a follower runs between steps, by the name process 0 sends: nothing else is looked up by name.
_FOLLOWER_CALLS = {
    "put_lora_in_slot": _put_lora_in_slot,
    "update_weights": weight_update.update_weights,
    "update_weights_from_path": weight_update.update_weights_from_path,
    "prepare_update": weight_update.prepare_update,
    "prepare_update_from_path": weight_update.prepare_update_from_path,
    "commit_update": weight_update.commit_update,
    "abort_update": weight_update.abort_update,
    "sleep": sleep_mode.sleep,
    "wake_up": sleep_mode.wake_up,
}
# The calls whose one argument is the arrays sent as bytes (`weights`), not `args`.
_TAKES_WEIGHTS = frozenset({"update_weights", "prepare_update"})


def host_weights(weights: Mapping | Iterable) -> dict[str, np.ndarray]:
    """update_weights' arrays as host copies, to send: a jax array must be whole in this process."""
    out = {}
    for name, array in weight_update.named_arrays(weights).items():
        if isinstance(array, jax.Array) and not array.is_fully_addressable:
            raise ValueError(
                f"weights: {name!r} spans several processes; across hosts update_weights takes arrays "
                "process 0 holds whole (or use update_weights_from_path)"
            )
        out[name] = np.asarray(array)
    return out

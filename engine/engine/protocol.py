"""Messages between the front end (AsyncLLM) and the engine core process, encoded with msgspec.

msgpack over ZMQ: typed decoding rebuilds `SamplingParams` (re-running its validation) and the
scheduler's own `EngineCoreOutput` / `SchedulerStats` dataclasses. Nothing here is pickled, so
bytes a client sent can never become code in the core.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

from xlaserve.core.multimodal import MultiModalFeature
from xlaserve.core.outputs import EngineCoreOutput, SchedulerStats
from xlaserve.core.request import Request
from xlaserve.lora_request import LoRARequest
from xlaserve.pooling_params import PoolingParams
from xlaserve.sampling_params import SamplingParams


class ImageFeature(msgspec.Struct, array_like=True):
    """A `MultiModalFeature` on the wire: its pixels as float32 bytes of `shape`."""

    modality: str
    mm_hash: str
    offset: int
    length: int
    shape: list[int]
    data: bytes
    grid: list[int] | None = None  # an image of its own size: its patch grid (t, h, w)
    seconds_per_grid: float | None = None  # a video: seconds per temporal grid

    @classmethod
    def from_feature(cls, f: MultiModalFeature) -> ImageFeature:
        pixels = np.ascontiguousarray(f.data, np.float32)
        grid = None if f.grid is None else list(f.grid)
        shape = list(pixels.shape)
        return cls(
            f.modality, f.mm_hash, f.offset, f.length, shape, pixels.tobytes(), grid, f.seconds_per_grid
        )

    def to_feature(self) -> MultiModalFeature:
        pixels = np.frombuffer(self.data, np.float32).reshape(self.shape)
        grid = None if self.grid is None else tuple(self.grid)
        return MultiModalFeature(
            self.modality, self.mm_hash, self.offset, self.length, pixels, grid, self.seconds_per_grid
        )


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A `Request` on the wire: what the core needs to rebuild it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    sampling_seed: int = 0
    parent_id: str | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # a pooling request (runner="pooling")
    mm_features: list[ImageFeature] = msgspec.field(default_factory=list)  # a vision-language prompt's images

    @classmethod
    def from_request(cls, request: Request) -> EngineCoreRequest:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.arrival_time,
            request.eos_token_id,
            request.priority,
            request.cache_salt,
            request.sampling_seed,
            request.parent_id,
            request.lora_request,
            request.pooling_params,
            [ImageFeature.from_feature(f) for f in request.mm_features],
        )

    def to_request(self) -> Request:
        return Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            eos_token_id=self.eos_token_id,
            arrival_time=self.arrival_time,
            priority=self.priority,
            cache_salt=self.cache_salt,
            sampling_seed=self.sampling_seed,
            parent_id=self.parent_id,
            lora_request=self.lora_request,
            pooling_params=self.pooling_params,
            mm_features=[f.to_feature() for f in self.mm_features],
        )


# -- front end -> core ---------------------------------------------------------------------------


class AddRequests(msgspec.Struct, tag="add"):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    """Call an EngineCore method by name (only those in `UTILITY_METHODS`), or read a property;
    answered by UtilityResult."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


CoreInput = AddRequests | AbortRequests | UtilityCall | Shutdown
# vLLM's pause modes: what a sleep does with the requests it finds unfinished (EngineCore.sleep).
SleepMode = Literal["abort", "wait", "keep"]
# The research stack's calls (worker/weight_update.py) besides the prefix cache's reset.
UTILITY_METHODS = (
    "reset_prefix_cache",
    "update_weights_from_path",
    "sleep",
    "wake_up",
    "is_sleeping",
    "start_profile",
    "stop_profile",
)


# -- core -> front end ---------------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready"):
    """Sent once, after warm-up: what the front end needs to validate requests up front."""

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    num_usable_blocks: int
    weight_bytes: int = 0  # the weights on the devices, a drafter's too (quantized: as stored, with scales)
    num_kv_blocks: int = 0  # KV cache blocks, the null block included
    # With LoRA on: the adapter slots' layout (stack -> module path -> [layers, in, out]) and each
    # stack's layer ids (a hybrid model's stacks hold every P-th layer), so the front end refuses an
    # adapter the model cannot take when it is loaded (models/lora_adapter.py check_fits).
    lora_layout: dict[str, dict[str, list[int]]] | None = None
    lora_layer_stacks: dict[str, list[int]] | None = None
    # runner="pooling": the model's task (embed, classify, reward) and hidden size (`dimensions`' bound).
    pooling_task: str | None = None
    hidden_size: int = 0
    id2label: list[str] = msgspec.field(default_factory=list)  # a classifier's label names by index
    # Which `dimensions` an embedder takes (worker/loading.py ModelInfo's).
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    """One step's outputs (possibly none) and the scheduler's gauges after it.

    `rejected`: requests the core refused at add time, with the reason (the front end validates
    first, so this is a safety net, not the usual path).
    """

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None
    rejected: list[tuple[str, str]] = msgspec.field(default_factory=list)


class UtilityResult(msgspec.Struct, tag="utility_result"):
    call_id: int
    result: Any = None
    error: str | None = None
    invalid: bool = False  # the error is the caller's (a ValueError: bad arguments, a busy engine)


class EngineDead(msgspec.Struct, tag="dead"):
    """The core's last word before it exits on an unexpected error."""

    reason: str


CoreOutput = EngineReady | EngineCoreOutputs | UtilityResult | EngineDead


def _encode_array(obj):
    """A pooled output (numpy, float32) as nested lists of floats: exact, and plain msgpack."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_encode_array)


def make_input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreInput)


def make_output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreOutput)

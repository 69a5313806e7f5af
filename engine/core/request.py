"""One generation request as the scheduler sees it: token ids, progress and status."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from xlaserve.core.multimodal import MultiModalFeature
from xlaserve.lora_request import LoRARequest
from xlaserve.pooling_params import PoolingParams
from xlaserve.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    """Why a request finished, as reported to users (OpenAI's `finish_reason`)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the FINISHED_* statuses."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finish_reason(status: RequestStatus) -> FinishReason | None:
        """The user-facing reason for a finished status, None while unfinished."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Grammar(Protocol):
    """What the scheduler asks of a request's grammar (structured outputs). The engine layer
    implements it (engine/structured_output) and compiles it off the engine loop; the scheduler only
    looks, so it stays plain Python."""

    @property
    def is_ready(self) -> bool:
        """Compiled (or failed to compile): the request may be scheduled."""

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (it did not compile, or rejected a token); None while fine."""

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: nothing may follow."""

    def accept_token(self, token_id: int) -> None:
        """Advance past a sampled token (once per output token; recomputation never re-advances it)."""


def child_request_id(parent_id: str, index: int) -> str:
    """The id of child `index` of an n > 1 request: unique beside the parent's, never parsed."""
    return f"{parent_id}[{index}]"


class Request:
    """A request's tokens and progress.

    There is no prefill or decode phase: the scheduler only compares `num_computed_tokens`
    (tokens whose K/V is in the cache, or will be once the scheduled step runs) with
    `num_tokens` (prompt + outputs so far). A preempted request drops to 0 computed tokens
    and recomputes `all_token_ids` when it is scheduled again.

    `block_hashes[i]` is the chained hash of full block i of `all_token_ids`; the KV cache
    manager extends it as blocks fill up, hashing each block once.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        sampling_seed: int = 0,
        parent_id: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ):
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        if sampling_params.max_tokens is None:
            raise ValueError(
                f"request {request_id!r}: sampling_params.max_tokens must be resolved to an int "
                "(the engine caps it by max_model_len) before a Request is built"
            )
        self.request_id = request_id
        self.prompt_token_ids = [int(token_id) for token_id in prompt_token_ids]
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.sampling_seed = sampling_seed
        # The user request this one samples for, when n > 1 made several (None: it is its own).
        # A field, not a naming convention: a user's id may contain any character.
        self.parent_id = parent_id
        self.lora_request = lora_request  # the adapter it runs with; None: the base model
        # Disaggregated prefill: the prompt's K/V a producer sent (core/kv_transfer.py's RemoteKV),
        # until the step that loads it; None: none (or already loaded).
        self.remote_kv = None
        # A pooling request (runner="pooling"): it never samples, and finishes when its prompt is
        # computed, with the pooled hidden states the runner returns (worker/pooler.py).
        self.pooling_params = pooling_params
        # Its images, in prompt order (core/multimodal.py), and the encoder cache slot of each one its
        # scheduled tokens reached (core/encoder_cache_manager.py sets it; index -> slot).
        self.mm_features = list(mm_features)
        self.encoder_slots: dict[int, int] = {}

        # Append only through append_output_token_ids, which keeps both lists in step.
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by a step still in flight, whose ids the host does not know
        # yet. They count in num_computed_tokens once scheduled; `num_tokens` excludes them until the
        # step's output appends the real ids. `last_sampled_row` is the row of the newest one in its
        # step's sampled ids, which the next step reads on the device (-1: none in flight).
        self.num_output_placeholders = 0
        self.last_sampled_row = -1
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit (tokens) at first scheduling
        self.num_external_computed_tokens = 0  # of which a KV connector loaded (host offload, a producer)
        self.num_cache_creation_tokens = 0  # the prompt's tokens it adds to the prefix cache (ditto)
        self.scheduled_time: float | None = None  # time.time() at first scheduling
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        # Set by the engine when sampling_params.structured_outputs constrains the output.
        self.grammar: Grammar | None = None
        # Speculative decoding: tokens proposed to follow all_token_ids, verified by the next step.
        self.spec_token_ids: list[int] = []

    @property
    def lora_id(self) -> int:
        """The adapter's lora_int_id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Prompt plus outputs, those still in flight (async scheduling) included."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Number of tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        """Most output tokens this request may generate (resolved by the engine)."""
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        """True once the request reached a FINISHED_* status."""
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled token id(s) to the outputs (and so to `all_token_ids`)."""
        # Model runners hand back numpy scalars; store plain ints so hashing and equality are exact.
        if not isinstance(token_ids, Iterable):
            token_ids = [token_ids]
        for token_id in token_ids:
            self.output_token_ids.append(int(token_id))
            self.all_token_ids.append(int(token_id))

    def get_finish_reason(self) -> FinishReason | None:
        """The user-facing finish reason, None while unfinished."""
        return RequestStatus.get_finish_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )

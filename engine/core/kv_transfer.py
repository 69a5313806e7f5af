"""Disaggregated prefill, the scheduler's half and the wire: a producer runs a prompt and sends its K/V
blocks, a consumer loads them and decodes (vLLM's P/D disaggregation; README "Disaggregated prefill").

The flow, for one request the router (entrypoints/router.py) sends to both:

1. The producer gets it with `kv_transfer_params: {"do_remote_decode": true}` (and max_tokens=1). In
   the step that completes its prompt, this half lists the prompt's full blocks as a send
   (`KVConnectorMetadata.sends`); the worker's half (worker/kv_transfer.py) gathers them right after
   that step's forward, before the request can finish and free them, and serves them from its block
   server (`kv_ip:kv_port`). The finished request's output carries where they are
   (`request_finished`: remote_host, remote_port, remote_request_id).
2. The consumer gets the same prompt with those params. Its engine core fetches the blocks first
   (engine/engine/kv_fetch.py: chunk by chunk, each asked for once the previous arrived, so a slow
   consumer never has more than one chunk in flight), then hands the request to the scheduler with
   them attached (`Request.remote_kv`). This half then reports them as tokens an outside source holds
   (`get_num_new_matched_tokens`, like host offload's), and the step loads them into the request's
   blocks before its forward: the consumer computes only the last prompt token. A prefix the consumer
   already holds (its device prefix cache, or with `kv_offloading_size` its host tier: a conversation
   coming back) is not fetched: the fetch starts at the first block it lacks, and the composed
   connector (core/kv_multi_connector.py) loads the prefix from its own tier, the rest from the fetch.

A fetch that fails (producer gone, a chunk past `timeout_s`, a digest or block layout that does not
match) hands the request over without blocks: the consumer computes the prompt itself, nothing is
lost, and `num_remote_fetch_failures` counts it.

The wire: a consumer's DEALER asks the producer's ROUTER `[b"get", request_id, digest, chunk,
first_block]` (first_block, optional, 0 by default: the blocks before it the consumer holds, and chunks
count from it; the prompt's number of blocks: none are sent, the copy is only released); the answer is
`[header, *one frame per cache array]`, the header a JSON object (`status` "ok", or "missing" /
"mismatch" with `error`; `num_blocks` (the prompt's), `num_chunks`, `block_bytes`: bytes per block of
each cache array, `block_size`). The last chunk served frees the producer's copy; unfetched copies
expire after `send_ttl_s`. A producer's copy is its own, gathered right after the forward: the prompt's
device blocks may be evicted (or offloaded to its host tier) as soon as the request finishes, whether
or not a consumer has fetched them. Plain Python and numpy: no jax here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from xlaserve.config import CacheConfig, KVTransferConfig
from xlaserve.core.kv_cache_manager import skips_prefix_cache
from xlaserve.core.kv_connector import KVConnectorMetadata, KVConnectorScheduler, KVTransferStats
from xlaserve.core.kv_multi_connector import MultiConnectorScheduler
from xlaserve.core.kv_offload import OffloadingConnectorScheduler, num_host_blocks
from xlaserve.core.request import Request

GET = b"get"


def prefix_digest(request: Request, num_tokens: int) -> str:
    """What a producer's blocks hold, as both sides compute it: the first `num_tokens` prompt ids, the
    cache salt and the adapter (a tenant's blocks never serve another's prompt)."""
    hasher = hashlib.sha256(np.asarray(request.prompt_token_ids[:num_tokens], "<i8").tobytes())
    lora = request.lora_request
    hasher.update(repr((request.cache_salt, None if lora is None else lora.lora_name)).encode())
    return hasher.hexdigest()[:32]


def encode_header(**fields) -> bytes:
    return json.dumps(fields).encode()


def decode_header(frame: bytes) -> dict:
    return json.loads(frame)


@dataclass
class RemoteKV:
    """A producer's blocks of one prompt, fetched: its tokens `first_token` .. `num_tokens` (whole
    blocks), as per cache array [num_blocks, bytes per block] uint8 rows. The blocks before
    `first_token` were not asked for: the consumer's own caches (device, host tier) held them when
    the fetch began."""

    num_tokens: int
    blocks: tuple[np.ndarray, ...]
    first_token: int = 0


def is_remote_decode(request: Request) -> bool:
    params = request.sampling_params.kv_transfer_params
    return bool(params and params.get("do_remote_decode"))


def is_remote_prefill(request: Request) -> bool:
    params = request.sampling_params.kv_transfer_params
    return bool(params and params.get("do_remote_prefill"))


class DisaggConnectorScheduler(KVConnectorScheduler):
    """A producer's sends and a consumer's loads (a `kv_both` engine does either, per request)."""

    def __init__(self, config: KVTransferConfig, block_size: int, bytes_per_block: int):
        self.config = config
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._sent: set[str] = set()  # producer requests whose blocks a step has gathered
        self._loads: list[tuple[list[int], tuple[np.ndarray, ...]]] = []  # this step's (block ids, rows)
        self.stats = KVTransferStats()

    def num_prompt_blocks(self, request: Request) -> int:
        """Full blocks a producer sends: every one before the last prompt token's, which the consumer
        computes (its logits sample the first output token)."""
        return (request.num_prompt_tokens - 1) // self.block_size

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        remote = request.remote_kv
        # Blocks the fetch skipped (the consumer's caches held them) but that are gone by now (evicted
        # meanwhile) leave a gap the fetched ones cannot follow: the prompt is computed from there.
        if remote is None or skips_prefix_cache(request) or num_computed_tokens < remote.first_token:
            return 0
        return max(
            0, min(remote.num_tokens, self.num_prompt_blocks(request) * self.block_size) - num_computed_tokens
        )

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens, num_external_tokens) -> None:
        remote, request.remote_kv = request.remote_kv, None  # loaded once; a recompute computes
        if remote is None:
            return
        self.stats.num_queries += request.num_tokens - num_computed_tokens
        self.stats.num_hits += num_external_tokens
        self.stats.num_remote_hits += num_external_tokens
        if not num_external_tokens:
            return
        first = num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        skipped = remote.first_token // self.block_size  # rows start at the first block fetched
        rows = tuple(r[first - skipped : last - skipped] for r in remote.blocks)
        self._loads.append((list(block_ids[first:last]), rows))

    def build_connector_meta(self, scheduled) -> KVConnectorMetadata | None:
        sends = []
        for s in scheduled:
            request = s.request
            done = s.num_computed_tokens + s.num_new_tokens >= request.num_prompt_tokens
            if done and is_remote_decode(request) and request.request_id not in self._sent:
                self._sent.add(request.request_id)
                num_blocks = self.num_prompt_blocks(request)
                digest = prefix_digest(request, num_blocks * self.block_size)
                sends.append((request.request_id, np.asarray(s.block_ids[:num_blocks], np.int32), digest))
                self.stats.num_blocks_sent += num_blocks
                self.stats.bytes_sent += num_blocks * self.bytes_per_block
        if not scheduled or not (sends or self._loads):
            return None
        meta = KVConnectorMetadata(sends=sends)
        if self._loads:
            meta.inline_load_block_ids = np.asarray([b for ids, _ in self._loads for b in ids], np.int32)
            meta.inline_blocks = tuple(
                np.concatenate(parts) for parts in zip(*(rows for _, rows in self._loads))
            )
            self.stats.num_blocks_loaded_remote += len(meta.inline_load_block_ids)
            self.stats.bytes_loaded_remote += len(meta.inline_load_block_ids) * self.bytes_per_block
            self._loads = []
        return meta

    def request_finished(self, request: Request) -> dict | None:
        if request.request_id not in self._sent:
            return None  # not a producer's request, or it failed before its prompt completed
        self._sent.discard(request.request_id)
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_host": self.config.kv_ip,
            "remote_port": self.config.kv_port,
            "remote_request_id": request.request_id,
        }

    def update_connector_output(self, stats: KVTransferStats | None) -> None:
        if stats is not None:
            self.stats.send_seconds += stats.send_seconds
            self.stats.remote_load_seconds += stats.remote_load_seconds

    def make_stats(self) -> KVTransferStats:
        stats, self.stats = self.stats, KVTransferStats()
        stats.disaggregated = 1
        return stats


def make_kv_connector_scheduler(
    cache: CacheConfig,
    bytes_per_block: int,
    persist_dir: str | None = None,
    kv_transfer: KVTransferConfig | None = None,
    enable_kv_cache_events: bool = False,
) -> KVConnectorScheduler:
    """The scheduler's half of the configured connector: host offload's, disaggregated prefill's, both
    composed (the host tier asked first, a producer for the rest: core/kv_multi_connector.py), or the
    base class (off). `persist_dir`: a persistent disk tier's directory (core/kv_offload.py);
    `kv_transfer`: this data-parallel rank's disaggregated prefill (EngineConfig.kv_transfer; None: off);
    `enable_kv_cache_events`: the host tier records its changes for the KV cache events."""
    connectors: list[KVConnectorScheduler] = []
    if cache.kv_offloading_size is not None:
        disk_size = cache.disk_tier_size
        connectors.append(
            OffloadingConnectorScheduler(
                num_host_blocks(cache.kv_offloading_size, bytes_per_block),
                cache.block_size,
                bytes_per_block,
                0
                if disk_size is None
                else num_host_blocks(disk_size, bytes_per_block, "kv_offloading_disk_size"),
                persist_dir,
                enable_kv_cache_events,
            )
        )
    if kv_transfer is not None:
        connectors.append(DisaggConnectorScheduler(kv_transfer, cache.block_size, bytes_per_block))
    if len(connectors) > 1:
        return MultiConnectorScheduler(connectors)
    return connectors[0] if connectors else KVConnectorScheduler()

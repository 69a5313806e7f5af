"""What each kind of layer keeps per request, as the host's block bookkeeping sees it (no jax).

A model's layers fall into groups; the layers of a group share one block table, so the host tracks
blocks per group, not per layer. Each group has a spec saying how many blocks a request of n tokens
holds and whether those blocks can serve another request with the same prefix (vLLM's
`KVCacheSpec`; here `CacheGroupSpec`, apart from the device-side `kernels.KVCacheSpec`). All groups
draw their blocks from one `BlockPool`: a block id indexes the cache arrays of whichever group holds it.

- `FullAttentionSpec`: every token's K/V, a block per `block_size` tokens (MLA's latent cache is
  this kind too: its arrays differ, its bookkeeping does not).
- `SlidingWindowSpec`: as full attention, but a query sees only the last `sliding_window` keys, so
  blocks that fell out of the window are returned to the pool while the request runs.
- `StateSpec`: a linear-attention or SSM layer (Mamba2's conv state and SSM state): a fixed-size
  state per request, whatever its length. One block (the request's state slot) for the request's
  whole life, overwritten in place by each step, freed with the request. A state-only model draws
  its slots from the shared pool; a hybrid model's state group (`num_slots` set: Qwen3.5's linear
  attention beside its attention layers) has a pool of its own, one slot per request that can run
  (and, with prefix caching, as many snapshot slots), since a slot is as large as hundreds of K/V
  blocks and cannot share their page size. A state serves a prefix hit through a snapshot: a copy of
  the live slot taken when a step ends on a block boundary of the prompt (core/kv_cache_coordinator.py
  `StateGroupBlocks`), indexed under that block's hash, copied into the next request's live slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from xlaserve.core.limits import cdiv


@dataclass(frozen=True)
class CacheGroupSpec:
    """The bookkeeping every kind shares: a block per `block_size` tokens, cacheable by prefix."""

    block_size: int  # tokens per block (the engine's, for every group)

    holds_state = False

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def num_blocks(self, num_tokens: int) -> int:
        """Blocks a request with `num_tokens` token slots holds."""
        return cdiv(num_tokens, self.block_size)

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no future query reads: none, with full attention."""
        return 0


@dataclass(frozen=True)
class FullAttentionSpec(CacheGroupSpec):
    """Every token's K/V (or MLA's latent) stays readable for the request's life."""


@dataclass(frozen=True)
class SlidingWindowSpec(CacheGroupSpec):
    sliding_window: int = 0  # keys a query sees, itself included

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks whose every key lies before the window of the next query (position
        `num_computed_tokens`, which sees keys from num_computed_tokens - sliding_window + 1 on);
        later queries see even less, so these blocks are never read again."""
        first_visible = max(num_computed_tokens - self.sliding_window + 1, 0)
        return first_visible // self.block_size


@dataclass(frozen=True)
class StateSpec(CacheGroupSpec):
    """A recurrent state per request. `block_size` is still the engine's: the block table the runner
    receives repeats the request's one slot once per block_size tokens, so the step's arrays keep the
    shape they have for attention and a state layer reads the slot from the table's first column."""

    # Slots in the group's own pool (the null slot included), or None: slots are blocks of the shared pool.
    num_slots: int | None = None
    # Of `num_slots`, those kept for prefix-cache snapshots (the rest: a live slot per request that can
    # run, and the null slot). A snapshot never takes a slot a live request would need.
    num_snapshot_slots: int = 0

    # A state summarizes every token before it, so a prefix hit needs a snapshot taken at the very
    # position of the hit: snapshots are taken at block boundaries (vLLM's), and a hit is the longest
    # cached prefix that ends on one (core/kv_cache_coordinator.py `StateGroupBlocks`).
    holds_state = True

    def __post_init__(self):
        super().__post_init__()
        if self.num_slots is not None and self.num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the null slot), got {self.num_slots}")
        if self.num_snapshot_slots and (
            self.num_slots is None or self.num_snapshot_slots >= self.num_slots - 1
        ):
            raise ValueError(
                f"num_snapshot_slots ({self.num_snapshot_slots}) must leave a live slot in num_slots "
                f"({self.num_slots})"
            )

    @property
    def num_live_slots(self) -> int | None:
        """Slots kept for running requests in the group's own pool (None: the shared pool's blocks)."""
        return None if self.num_slots is None else self.num_slots - 1 - self.num_snapshot_slots

    def num_blocks(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table, and the spec of their kind."""

    spec: CacheGroupSpec
    layer_ids: tuple[int, ...]


def full_attention_groups(block_size: int, num_layers: int) -> tuple[KVCacheGroup, ...]:
    """Today's models: every layer in one full-attention group."""
    return (KVCacheGroup(FullAttentionSpec(block_size), tuple(range(num_layers))),)


def context_blocks(groups: tuple[KVCacheGroup, ...], num_usable_blocks: int, max_model_len: int) -> int:
    """Blocks of the engine's block_size that one request's context may span: the usable blocks,
    unless every group keeps a state, whose one slot holds any length (then max_model_len's), or the
    attention layers form several groups drawing from the pool (layers of several windows): then the
    longest context whose blocks fit, every full-attention group holding all of them and each
    sliding-window group a window's worth."""
    if groups and all(g.spec.holds_state for g in groups):
        return max(num_usable_blocks, cdiv(max_model_len, groups[0].spec.block_size))
    attention = [g.spec for g in groups if not g.spec.holds_state]
    if len(attention) < 2:
        return num_usable_blocks
    held = [
        cdiv(spec.sliding_window, spec.block_size) + 1 if isinstance(spec, SlidingWindowSpec) else None
        for spec in attention
    ]

    def fits(num_blocks: int) -> bool:
        return sum(num_blocks if h is None else min(num_blocks, h) for h in held) <= num_usable_blocks

    if None not in held and fits(num_usable_blocks):  # windows alone: any length holds a window each
        return max(num_usable_blocks, cdiv(max_model_len, attention[0].block_size))
    low, high = 0, num_usable_blocks
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low

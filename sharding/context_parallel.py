"""Decode context parallelism (vLLM's DCP): a sequence's KV cache interleaved over tensor-parallel ranks.

Under tensor parallelism with fewer KV heads than ranks, each KV head is copied onto tp / num_kv_heads
ranks (sharding/kv_heads.py), and every copy holds the whole sequence: memory spent on copies. With
`decode_context_parallel_size` d, each group of d consecutive ranks holding copies of one KV head
stores every sequence's K/V once between them, interleaved: the token at position p lives on the
group's rank p % d. A block of the scheduler's `block_size` tokens is then block_size / d slots on
each rank of the group, so the same memory holds d times the tokens.

The host keeps the scheduler's blocks (the prefix cache, the block tables are unchanged); only the
slot mapping names the physical slot on the owning rank (`physical_slot_mapping`). Attention runs
per rank under `shard_map` over the "tensor" axis:
- write: each rank writes the new tokens it owns (p % d == its rank in the group) and drops the rest;
- attend: the group's query heads are gathered, each rank attends them to its own keys (a key at
  local slot j of a sequence is position j * d + the rank's index; a query at position p sees the
  local keys j <= (p - index) / d), and the partial results (max, sum, weighted values) are gathered
  and merged by log-sum-exp, each rank keeping its own query heads.

Latent attention (DeepSeek's MLA, kernels/mla.py) has one latent "KV head" every query head shares,
replicated on every rank under plain tensor parallelism. Under decode context parallel it is one latent
head per rank (`InterleavedLatentSpec`), interleaved the same way, so a group of d ranks holds d times
the tokens in the same memory: the latents are written by `write_latent` on their owning rank, and each
rank attends the group's absorbed queries to its own latents as attention with one shared head whose
key is the whole latent (c, k_pe) and whose value is the latent itself (c: its k_pe part, weighted
too, is dropped after the merge), merged across the group like K/V.

Prefill context parallel runs the backend's own kernel (Pallas on a GPU, the reference on CPU) on each
rank's share of the tokens, seen as a ragged batch of its own (`_rank_share`), latent attention too.
Decode context parallel runs the reference path's float32 online softmax (kernels/paged_attend.py
`PagedAttend`), stopped before the normalization, whose partials the group merges; its sliding windows
count back from each query's position over the sequence's positions (a rank's slot j holds position
j * d + its index: `PagedAttend`'s kv_stride and kv_offset), and attention sinks join the softmax once
(on each group's first rank only). A float8 K/V cache is written and read as its format says. Not yet:
models with recurrent layers. The gathers run over the whole "tensor" axis and each rank keeps its
group's part (axis_index_groups would send only the group's).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from xlaserve.kernels.backend import AttentionBackend
from xlaserve.kernels.metadata import KVCache, KVCacheSpec
from xlaserve.kernels.mla import MLACache, write_latent
from xlaserve.kernels.paged_attend import PagedAttend
from xlaserve.kernels.reference import FP8_E4M3, token_positions, write_kv
from xlaserve.sharding.attention import attention_under_shard_map
from xlaserve.sharding.rules import KV_CACHE_AXES, logical_to_mesh, to_partition_spec

PAGES_PER_CHUNK = 4  # pages gathered per loop step of the attention


def check_decode_context_parallel(model_config, kv_spec, dcp: int, tensor_parallel_size: int) -> None:
    """ValueError naming decode_context_parallel_size when the model's KV heads are not copied at least
    `dcp` times over the ranks, or the model has what the interleaved cache does not serve yet.
    `model_config`: the checkpoint's (before KV heads are copied)."""
    if dcp == 1:
        return
    num_kv = model_config.num_kv_heads
    prefix = f"decode_context_parallel_size={dcp}"
    if tensor_parallel_size % num_kv or (tensor_parallel_size // num_kv) % dcp:
        raise ValueError(
            f"{prefix} needs each of the model's {num_kv} KV heads copied onto a multiple of {dcp} ranks: "
            f"tensor_parallel_size ({tensor_parallel_size}) must be a multiple of num_kv_heads x {dcp} "
            f"= {num_kv * dcp}"
        )
    _check_attention_kinds(prefix, model_config, kv_spec)


def physical_slot_mapping(slot_mapping: np.ndarray, block_size: int, dcp: int) -> np.ndarray:
    """The scheduler's slots (block * block_size + offset) -> the owning rank's slot in a cache of
    blocks of block_size / dcp: offset o of a block is on rank o % dcp, at local offset o // dcp."""
    blocks, offsets = np.divmod(slot_mapping, block_size)
    return (blocks * (block_size // dcp) + offsets // dcp).astype(slot_mapping.dtype)


def decode_context_parallel_cache_spec(kv_spec: KVCacheSpec, tensor_parallel_size: int) -> KVCacheSpec:
    """The cache spec under decode context parallel: K and V as they are (their copies of a KV head
    already one per rank); latent attention's one shared latent head, replicated under plain tensor
    parallelism, becomes one per rank (`InterleavedLatentSpec`)."""
    if kv_spec.cache_class is not MLACache:
        return kv_spec
    return InterleavedLatentSpec(kv_spec.num_layers, tensor_parallel_size, kv_spec.head_dim, MLACache)


@dataclasses.dataclass(frozen=True)
class InterleavedLatentSpec(KVCacheSpec):
    """MLA's latent cache under decode context parallel: ``[num_layers * num_blocks, block_size / d,
    tensor_parallel_size, kv_lora_rank + rope_dim]`` split over "tensor" by its head axis, so that each
    rank's one latent head holds the tokens it owns. A block's bytes are one rank's, as plain tensor
    parallelism's replicated latent counts one copy: the budget holds d times the blocks."""

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        return super().bytes_per_block(block_size, itemsize) // self.num_kv_heads


def decode_context_parallel(backend: AttentionBackend, mesh: Mesh, dcp: int) -> AttentionBackend:
    """`backend` with K/V (or latents) written interleaved over groups of `dcp` ranks and attention
    merged across each group (module docstring). On a mesh with a "context" axis (prefill context
    parallel too), each context group attends its share of the step's tokens, the K/V of all of them
    written."""
    rules = logical_to_mesh(enable_expert_parallel=False)
    axis = rules["kv_heads"]
    heads = PartitionSpec(None, axis, None)  # k, v [T, heads, head_dim]: every token, gathered if split
    num_context = mesh.shape.get("context", 1)
    q_spec = PartitionSpec("context" if num_context > 1 else None, axis, None)  # q and the output
    cache = to_partition_spec(KV_CACHE_AXES, rules)
    replicated = PartitionSpec()
    kv_dtype = backend.kv_cache_dtype  # a float8 cache (--kv-cache-dtype), or None: the model's dtype

    def place():  # this rank's index in its group, and the group's first rank
        rank = jax.lax.axis_index(axis)
        return rank % dcp, rank - rank % dcp

    def owned(slot_mapping, positions):
        # Tokens another rank of the group owns go to the null block, as padding does.
        return jnp.where(positions % dcp == place()[0], slot_mapping, 0)

    def write_kv_owned(k_cache, v_cache, k, v, slot_mapping, *, positions):
        def local(k_cache, v_cache, k, v, slot_mapping, positions):
            return write_kv(k_cache, v_cache, k, v, owned(slot_mapping, positions), kv_dtype=kv_dtype)

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(cache, cache, heads, heads, replicated, replicated),
            out_specs=(cache, cache),
            check_vma=False,
        )(k_cache, v_cache, k, v, slot_mapping, positions)

    def write_latent_owned(latent_cache, latent, slot_mapping, *, positions):
        def local(latent_cache, latent, slot_mapping, positions):
            return write_latent(latent_cache, latent, owned(slot_mapping, positions))

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(cache, replicated, replicated, replicated),
            out_specs=cache,
            check_vma=False,
        )(latent_cache, latent, slot_mapping, positions)

    def attend_with_group(q, attend: PagedAttend, kv_lens, block_tables, query_start_loc, num_seqs, sm_scale):
        """This rank's query heads q [T, h, D] attended with its group's, each rank over its own slots
        (`attend`): -> the softmax-weighted values [T, h, D] (float32)."""
        index, first = place()
        num_tokens, num_local_heads, head_dim = q.shape
        # The group's query heads: every rank's, of which the group's d ranks' [T, d * h, D].
        group_q = jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(q, axis), first, dcp)
        group_q = group_q.transpose(1, 0, 2, 3).reshape(num_tokens, 1, 1, dcp * num_local_heads, head_dim)
        seq, position, is_real = token_positions(num_tokens * num_context, kv_lens, query_start_loc, num_seqs)
        if num_context > 1:  # this context group's tokens
            first_token = jax.lax.axis_index("context") * num_tokens
            seq, position, is_real = (
                jax.lax.dynamic_slice_in_dim(x, first_token, num_tokens) for x in (seq, position, is_real)
            )
        partials = attend.partials(
            group_q.astype(jnp.float32) * sm_scale,
            _padded_tables(block_tables[seq]),
            position[:, None],
            is_real[:, None],
            PAGES_PER_CHUNK,
        )
        # Every rank's partials [T, 1, 1, d * h, ...], of which the group's: merged by log-sum-exp.
        m, l, acc = (
            jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(x[:, 0, 0], axis), first, dcp) for x in partials
        )
        out = _merge(m, l, acc)  # [T, d * h, D]
        return jax.lax.dynamic_slice_in_dim(out, index * num_local_heads, num_local_heads, axis=1)

    def local(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, **kw):
        index, first = place()
        sinks_kg = None
        if kw["sinks"] is not None:  # the group's heads' sinks, counted once: on its first rank only
            group_sinks = jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(kw["sinks"], axis), first, dcp)
            sinks_kg = jnp.where(index == 0, group_sinks.reshape(1, -1), -jnp.inf)
        # This rank's slot j of a sequence holds its position j * d + index (the window and the causal
        # bound are the sequence's positions: PagedAttend's kv_stride and kv_offset).
        attend = _attend(
            k_cache,
            v_cache,
            q.dtype,
            kw.get("soft_cap"),
            kw["sliding_window"],
            sinks_kg,
            dcp,
            index,
            kv_dtype,
        )
        metadata = (kv_lens, block_tables, query_start_loc, num_seqs)
        return attend_with_group(q, attend, *metadata, kw["sm_scale"]).astype(q.dtype)

    def mla_local(
        q_latent, q_rope, latent_cache, kv_lens, block_tables, query_start_loc, num_seqs, *, sm_scale
    ):
        # Latent attention is attention with one shared head whose key is the latent and the rotated key
        # part (kernels/mla.py): PagedAttend over the rank's latents as both keys and values, the
        # values' last rope_dim numbers (the rotated key part) weighted too and dropped after the merge.
        lora_rank = q_latent.shape[-1]
        attend = _attend(
            latent_cache, latent_cache, q_latent.dtype, None, kv_stride=dcp, kv_offset=place()[0]
        )
        q = jnp.concatenate([q_latent, q_rope], axis=-1)  # [T, h, lora_rank + rope_dim]
        metadata = (kv_lens, block_tables, query_start_loc, num_seqs)
        return attend_with_group(q, attend, *metadata, sm_scale)[..., :lora_rank].astype(q_latent.dtype)

    def mla_attention(q_latent, q_rope, latent_cache, kv_lens, block_tables, query_start_loc, num_seqs, **kw):
        # The query heads split by "tensor" (and the tokens by "context"), the latent cache by rank.
        operands = (q_latent, q_rope, latent_cache, kv_lens, block_tables, query_start_loc, num_seqs)
        return jax.shard_map(
            functools.partial(mla_local, sm_scale=kw["sm_scale"]),
            mesh=mesh,
            in_specs=(q_spec, q_spec, cache) + (replicated,) * 4,
            out_specs=q_spec,
            check_vma=False,
        )(*operands)

    return dataclasses.replace(
        backend,
        name=f"{backend.name}+dcp",
        attention=attention_under_shard_map(mesh, q_spec, cache, local),
        write_kv=write_kv_owned,
        mla_attention=mla_attention,
        write_latent=write_latent_owned,
        serves_attend_ahead=False,
        reason=f"decode context parallel over {dcp} ranks per KV head: interleaved K/V (or latents), "
        "attention partials merged by log-sum-exp (sharding/context_parallel.py)",
    )


def _attend(
    k_cache,
    v_cache,
    q_dtype,
    soft_cap,
    sliding_window=None,
    sinks_kg=None,
    kv_stride=1,
    kv_offset=0,
    kv_dtype=None,
) -> PagedAttend:
    """The reference's paged attention over this device's cache (16-bit caches are stored as words; a
    float8 cache, `kv_dtype`, as uint8 words on CPU)."""
    value_dtype = q_dtype if k_cache.dtype == jnp.uint16 else k_cache.dtype
    if k_cache.dtype == jnp.uint8:
        value_dtype = jnp.dtype(kv_dtype or FP8_E4M3)
    return PagedAttend(
        k_cache, v_cache, sliding_window, soft_cap, value_dtype, sinks_kg, kv_stride, kv_offset
    )


def _padded_tables(tables):
    """Each query's block table, padded to whole loop steps of PAGES_PER_CHUNK pages (null pages)."""
    padded = -(-tables.shape[1] // PAGES_PER_CHUNK) * PAGES_PER_CHUNK
    return jnp.pad(tables, ((0, 0), (0, padded - tables.shape[1])))


def _merge(m, l, acc):
    """Partials of d ranks (m, l [d, T, H], acc [d, T, H, D]) -> the softmax-weighted values [T, H, D]."""
    m_max = m.max(axis=0)
    m_safe = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    scale = jnp.exp(m - m_safe)  # 0 for a rank that saw no key
    total = (scale * l).sum(axis=0)
    out = (scale[..., None] * acc).sum(axis=0)
    return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def check_prefill_context_parallel(model_config, kv_spec, pcp: int) -> None:
    """ValueError naming prefill_context_parallel_size for what its attention does not serve yet: a
    cache of recurrent states (latent attention is served: the latent cache is whole on every rank)."""
    if pcp > 1 and kv_spec.layer_kind != "full_attention":
        raise ValueError(
            f"prefill_context_parallel_size={pcp} is not supported for {model_config.architecture} yet "
            "(its cache holds recurrent states)"
        )


def _check_attention_kinds(prefix: str, model_config, kv_spec) -> None:
    """What decode context parallel does not interleave yet: caches other than K and V per head and
    latent attention's latents (recurrent states)."""
    if kv_spec.layer_kind != "full_attention" or kv_spec.cache_class not in (KVCache, MLACache):
        raise ValueError(
            f"{prefix} is not supported for {model_config.architecture} yet (its cache holds recurrent "
            "states, not K and V per head nor latents); use decode_context_parallel_size=1"
        )


def prefill_context_parallel(backend: AttentionBackend, mesh: Mesh) -> AttentionBackend:
    """`backend` with attention run per device on its share of the step's tokens (the mesh's "context"
    axis) and of the heads ("tensor"): each query over its sequence's whole context, which every
    context rank's cache holds (XLA gathers the step's K/V over the axis before they are written).
    The backend's own kernel runs on a rank's tokens as a ragged batch of their own (`_rank_share`:
    each sequence's tokens in the share, its context to the last of them), so whatever it serves
    (the Pallas kernel on a GPU, windows, sinks, Gemma 3's spans, latent attention) it serves here.
    Everything else in the step (the projections, the MLP) runs on each rank's tokens as XLA splits it
    from the step's token ids (worker/step_programs.py `token_sharding`)."""
    rules = logical_to_mesh(enable_expert_parallel=False)
    tokens_heads = PartitionSpec("context", rules["kv_heads"], None)  # q and the output [T, heads, D]
    cache = to_partition_spec(KV_CACHE_AXES, rules)  # split by KV head, whole on every context rank
    replicated = PartitionSpec()
    num_ranks = mesh.shape["context"]
    kernel, mla_kernel = backend.attention, backend.mla_attention

    def local(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, **kw):
        kv_lens, query_start_loc = _rank_share(kv_lens, query_start_loc, q.shape[0])
        kw = {k: v for k, v in kw.items() if v is not None}  # what the call did not set stays unset
        return kernel(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, **kw)

    def mla_attention(q_latent, q_rope, latent_cache, kv_lens, block_tables, query_start_loc, num_seqs, **kw):
        # The query heads split by "tensor" and the tokens by "context"; the latent cache (one shared
        # latent head) whole on every device.
        def mla_local(q_latent, q_rope, latent_cache, kv_lens, block_tables, query_start_loc, num_seqs):
            kv_lens, query_start_loc = _rank_share(kv_lens, query_start_loc, q_latent.shape[0])
            return mla_kernel(
                q_latent, q_rope, latent_cache, kv_lens, block_tables, query_start_loc, num_seqs, **kw
            )

        operands = (q_latent, q_rope, latent_cache, kv_lens, block_tables, query_start_loc, num_seqs)
        in_specs = (tokens_heads, tokens_heads) + (replicated,) * 5
        return jax.shard_map(
            mla_local, mesh=mesh, in_specs=in_specs, out_specs=tokens_heads, check_vma=False
        )(*operands)

    return dataclasses.replace(
        backend,
        name=f"{backend.name}+pcp",
        attention=attention_under_shard_map(
            mesh, tokens_heads, cache, local, ahead_spec=PartitionSpec("context")
        ),
        mla_attention=mla_attention,
        reason=f"prefill context parallel over {num_ranks} ranks: each rank's tokens over the whole cache, "
        "by the backend's own kernel (sharding/context_parallel.py)",
    )


def _rank_share(kv_lens, query_start_loc, num_local: int):
    """The step's ragged batch as this context rank sees it: its `num_local` tokens (from
    axis_index * num_local in the flat batch) are each sequence's tokens in that range, and a
    sequence's context ends at the last of them. -> (kv_lens [R], query_start_loc [R + 1])."""
    first = jax.lax.axis_index("context") * num_local
    local_starts = jnp.clip(query_start_loc - first, 0, num_local)
    # A sequence's last token here is flat index first + local_starts[r + 1] - 1, at position
    # kv_len - (query_start_loc[r + 1] - that index); none here: no query reads the length.
    kv_lens = kv_lens - query_start_loc[1:] + first + local_starts[1:]
    has_tokens = local_starts[1:] > local_starts[:-1]
    return jnp.where(has_tokens, kv_lens, 0), local_starts

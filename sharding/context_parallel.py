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

The attention here is a jnp loop over page chunks (the reference path's online softmax; any attention
backend asked for is replaced by it). Not yet: sliding windows, attention sinks, a float8 cache,
latent attention (MLA), models with recurrent layers. The gathers run over the whole "tensor" axis
and each rank keeps its group's part (axis_index_groups would send only the group's).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from xlaserve.kernels.backend import AttentionBackend
from xlaserve.kernels.dtype_ops import as_words, from_words
from xlaserve.kernels.reference import token_positions
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


def decode_context_parallel(backend: AttentionBackend, mesh: Mesh, dcp: int) -> AttentionBackend:
    """`backend` with K/V written interleaved over groups of `dcp` ranks and attention merged across
    each group (module docstring)."""
    rules = logical_to_mesh(enable_expert_parallel=False)
    axis = rules["kv_heads"]
    heads = PartitionSpec(None, axis, None)  # q, k, v [T, heads, head_dim] and the output
    cache = to_partition_spec(KV_CACHE_AXES, rules)
    replicated = PartitionSpec()

    def write_kv(k_cache, v_cache, k, v, slot_mapping, *, positions):
        def local(k_cache, v_cache, k, v, slot_mapping, positions):
            index = jax.lax.axis_index(axis) % dcp
            num_rows, block_size = k_cache.shape[:2]
            # Tokens another rank owns go past the cache's end, where the scatter drops them.
            slots = jnp.where(positions % dcp == index, slot_mapping, num_rows * block_size)
            blocks, offsets = slots // block_size, slots % block_size

            def write(cache, new):
                new = as_words(new) if cache.dtype == jnp.uint16 else new.astype(cache.dtype)
                return cache.at[blocks, offsets].set(new, mode="drop")

            return write(k_cache, k), write(v_cache, v)

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(cache, cache, heads, heads, replicated, replicated),
            out_specs=(cache, cache),
            check_vma=False,
        )(k_cache, v_cache, k, v, slot_mapping, positions)

    def attention(
        q,
        k_cache,
        v_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        *,
        sm_scale,
        soft_cap=None,
        **kw,
    ):
        if kw.get("sliding_window") is not None or kw.get("sinks") is not None:
            raise ValueError("decode context parallelism does not serve sliding windows or sinks yet")

        def local(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs):
            rank = jax.lax.axis_index(axis)
            index, first = rank % dcp, rank - rank % dcp  # this rank in its group, the group's first
            num_tokens, num_local_heads, head_dim = q.shape
            # The group's query heads: every rank's, of which the group's d ranks' [T, d * h, D].
            group_q = jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(q, axis), first, dcp)
            group_q = group_q.transpose(1, 0, 2, 3).reshape(num_tokens, dcp * num_local_heads, head_dim)
            seq, position, is_real = token_positions(num_tokens, kv_lens, query_start_loc, num_seqs)
            # Local keys visible to each query: slots 0 .. last (position - index) // d; none when < 0.
            last = jnp.where(position >= index, (position - index) // dcp, -1)
            value_dtype = q.dtype if k_cache.dtype == jnp.uint16 else k_cache.dtype
            partial = _partial_attention(
                group_q[:, None],
                k_cache,
                v_cache,
                block_tables[seq],
                last,
                is_real,
                sm_scale,
                soft_cap,
                value_dtype,
            )
            # Every rank's partials, of which the group's: merged by log-sum-exp.
            m, l, acc = (
                jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(x[:, 0], axis), first, dcp) for x in partial
            )
            out = _merge(m, l, acc)  # [T, d * h, D]
            mine = jax.lax.dynamic_slice_in_dim(out, index * num_local_heads, num_local_heads, axis=1)
            return mine.astype(q.dtype)

        operands = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)
        in_specs = (heads, cache, cache) + (replicated,) * 4
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(*operands)

    return dataclasses.replace(
        backend,
        name=f"{backend.name}+dcp",
        attention=attention,
        write_kv=write_kv,
        reason=f"decode context parallel over {dcp} ranks per KV head: interleaved K/V, attention partials "
        "merged by log-sum-exp (sharding/context_parallel.py)",
    )


def _partial_attention(q, k_cache, v_cache, tables, last, is_real, sm_scale, soft_cap, value_dtype):
    """Each query [T, K, G, D] (G query heads per KV head) over its sequence's keys in slots 0..last[t]
    of its pages (tables [T, max_blocks]; caches [rows, block_size, K, D]): the online softmax's (max
    [T, K, G], sum [T, K, G], weighted values [T, K, G, D]) in float32, not normalized."""
    num_tokens, num_kv_heads, group, head_dim = q.shape
    num_rows, block_size = k_cache.shape[:2]
    chunk_len = PAGES_PER_CHUNK * block_size
    max_blocks = tables.shape[1]
    padded = -(-max_blocks // PAGES_PER_CHUNK) * PAGES_PER_CHUNK
    tables = jnp.pad(tables, ((0, 0), (0, padded - max_blocks)))
    q = q.astype(jnp.float32) * sm_scale
    stop = (jnp.max(jnp.where(is_real, last, -1)) + chunk_len) // chunk_len

    def gather(cache, pages):  # pages [T, P] -> [T, P * block_size, K, D] float32
        rows = cache.reshape(num_rows, -1)[pages]
        shape = (num_tokens, chunk_len, num_kv_heads, head_dim)
        return from_words(rows, value_dtype).reshape(shape).astype(jnp.float32)

    def body(i, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, i * PAGES_PER_CHUNK, PAGES_PER_CHUNK, axis=1)
        k, v = gather(k_cache, pages), gather(v_cache, pages)
        visible = (i * chunk_len + jnp.arange(chunk_len) <= last[:, None]) & is_real[:, None]  # [T, S]
        s = jnp.einsum("tkgd,tskd->tkgs", q, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with nothing visible stays zero
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        v = jnp.where(visible[..., None, None], v, 0.0)  # slots past a context may hold NaN
        acc = alpha[..., None] * acc + jnp.einsum("tkgs,tskd->tkgd", p, v)
        return m_new, alpha * l + p.sum(axis=-1), acc

    rows = (num_tokens, num_kv_heads, group)
    init = (
        jnp.full(rows, -jnp.inf, jnp.float32),
        jnp.zeros(rows, jnp.float32),
        jnp.zeros((*rows, head_dim), jnp.float32),
    )
    return jax.lax.fori_loop(0, stop, body, init)


def _merge(m, l, acc):
    """Partials of d ranks (m, l [d, T, H], acc [d, T, H, D]) -> the softmax-weighted values [T, H, D]."""
    m_max = m.max(axis=0)
    m_safe = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    scale = jnp.exp(m - m_safe)  # 0 for a rank that saw no key
    total = (scale * l).sum(axis=0)
    out = (scale[..., None] * acc).sum(axis=0)
    return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def check_prefill_context_parallel(model_config, kv_spec, pcp: int) -> None:
    """ValueError naming prefill_context_parallel_size for what its attention does not serve yet."""
    if pcp > 1:
        _check_attention_kinds(f"prefill_context_parallel_size={pcp}", model_config, kv_spec)


def _check_attention_kinds(prefix: str, model_config, kv_spec) -> None:
    """What both context-parallel attentions do not serve yet: caches other than K and V (state layers,
    latent attention), sliding windows, attention sinks."""
    architecture = model_config.architecture
    if kv_spec.layer_kind != "full_attention" or kv_spec.cache_class.__name__ != "KVCache":
        raise ValueError(
            f"{prefix} is not supported for {architecture} yet (its cache is not K and V per head)"
        )
    if any(w is not None for w in model_config.layer_sliding_windows):
        raise ValueError(f"{prefix} is not supported with sliding-window attention ({architecture}) yet")
    if getattr(model_config, "attention_sinks", False):
        raise ValueError(f"{prefix} is not supported with attention sinks ({architecture}) yet")


def prefill_context_parallel(backend: AttentionBackend, mesh: Mesh) -> AttentionBackend:
    """`backend` with attention run per device on its share of the step's tokens (the mesh's "context"
    axis) and of the KV heads ("tensor"): each query over its sequence's whole context, which every
    context rank's cache holds (XLA gathers the step's K/V over the axis before they are written).
    Everything else in the step (the projections, the MLP) runs on each rank's tokens as XLA splits it
    from the step's token ids (worker/step_programs.py `token_sharding`)."""
    rules = logical_to_mesh(enable_expert_parallel=False)
    tokens_heads = PartitionSpec("context", rules["kv_heads"], None)  # q and the output [T, heads, D]
    cache = to_partition_spec(KV_CACHE_AXES, rules)  # split by KV head, whole on every context rank
    num_ranks = mesh.shape["context"]

    def attention(
        q,
        k_cache,
        v_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        *,
        sm_scale,
        soft_cap=None,
        **kw,
    ):
        if kw.get("sliding_window") is not None or kw.get("sinks") is not None:
            raise ValueError("prefill context parallelism does not serve sliding windows or sinks yet")

        def local(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs):
            num_local, num_heads, head_dim = q.shape
            num_kv_heads = k_cache.shape[2]
            first = jax.lax.axis_index("context") * num_local  # this rank's tokens in the step
            seq, position, is_real = (
                jax.lax.dynamic_slice_in_dim(x, first, num_local)
                for x in token_positions(num_local * num_ranks, kv_lens, query_start_loc, num_seqs)
            )
            value_dtype = q.dtype if k_cache.dtype == jnp.uint16 else k_cache.dtype
            q_tkgd = q.reshape(num_local, num_kv_heads, num_heads // num_kv_heads, head_dim)
            _, l, acc = _partial_attention(
                q_tkgd,
                k_cache,
                v_cache,
                block_tables[seq],
                position,
                is_real,
                sm_scale,
                soft_cap,
                value_dtype,
            )
            out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
            return out.reshape(num_local, num_heads, head_dim).astype(q.dtype)

        operands = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)
        in_specs = (tokens_heads, cache, cache) + (PartitionSpec(),) * 4
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=tokens_heads, check_vma=False)(
            *operands
        )

    return dataclasses.replace(
        backend,
        name=f"{backend.name}+pcp",
        attention=attention,
        reason=f"prefill context parallel over {num_ranks} ranks: each rank's tokens over the whole cache "
        "(sharding/context_parallel.py)",
    )

"""Attention kernels under tensor parallelism: one `shard_map` over the KV-head axis.

Paged attention is independent per KV head, and tensor parallelism already shards the query heads,
the KV heads and the KV cache over the "tensor" axis (sharding/rules.py; sharding/kv_heads.py
repeats KV heads so every rank holds at least one). XLA partitions the pure-jnp reference by
itself, but a Pallas or Triton kernel is a custom call with no partitioning rule: XLA would gather
the whole cache onto every device and run the kernel on all heads everywhere. Under `shard_map`
each device runs the kernel on its own heads and its own slice of the cache, with no
communication; the block tables and lengths are replicated. The reference runs under it too: XLA
could partition its jnp, but not once the decode path folds the KV heads into one dot per query
(kernels/reference.py), where the folded query [n, (k g), (k' d)] names the sharded head axis twice
and XLA gathers the whole cache instead. DeepSeek's latent attention is
split the same way over its query heads, with the latent cache (one shared latent head) replicated
(interleaved over the ranks under decode context parallel: sharding/context_parallel.py),
and the per-chunk terms of Gated DeltaNet and of Mamba2's SSD (kernels/gated_delta.py, kernels/ssd.py
`chunk_terms`: Pallas kernels under the pallas backend) over their heads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import Mesh, PartitionSpec

from xlaserve.kernels.backend import AttentionBackend
from xlaserve.sharding.rules import KV_CACHE_AXES, logical_to_mesh, to_partition_spec


def shard_attention_over_kv_heads(backend: AttentionBackend, mesh: Mesh) -> AttentionBackend:
    """`backend` with its attention run per device on that device's heads (see the module
    docstring). Any backend on a one-device mesh is returned unchanged."""
    rules = logical_to_mesh(enable_expert_parallel=False)  # the attention axes do not depend on it
    axis = rules["kv_heads"]
    if mesh.shape[axis] == 1:
        return backend
    heads = PartitionSpec(None, axis, None)  # q [T, q_heads, head_dim] and the output
    cache = to_partition_spec(KV_CACHE_AXES, rules)  # [blocks, block_size, kv_heads, head_dim]
    replicated = PartitionSpec()
    kernel = backend.attention

    def local(*operands, **kw):
        return kernel(*operands, **{k: v for k, v in kw.items() if v is not None})

    attention = attention_under_shard_map(mesh, heads, cache, local, ahead_spec=replicated)

    mla_kernel = backend.mla_attention

    def mla_attention(q_latent, q_rope, latent_cache, kv_lens, block_tables, query_start_loc, num_seqs, **kw):
        # MLA: the query heads are split, the latent cache (one shared latent head) is replicated.
        def local(*operands):
            return mla_kernel(*operands, **kw)

        operands = (q_latent, q_rope, latent_cache, kv_lens, block_tables, query_start_loc, num_seqs)
        in_specs = (heads, heads) + (replicated,) * 5
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(*operands)

    delta_kernel = backend.delta_chunk_terms
    chunk_heads = PartitionSpec(None, None, rules["linear_heads"])  # q, k, v, g, beta [C, Q, H, ..]
    terms_heads = PartitionSpec(None, rules["linear_heads"])  # each term [C, H, ..]

    def delta_chunk_terms(q, k, v, g, beta):
        return jax.shard_map(
            delta_kernel,
            mesh=mesh,
            in_specs=(chunk_heads,) * 5,
            out_specs=(terms_heads,) * 6,
            check_vma=False,
        )(q, k, v, g, beta)

    ssd_kernel = backend.ssd_chunk_terms

    def ssd_chunk_terms(xdt, cum, bh, ch):  # [C, Q, H, ..] in; y [C, Q, H, P] and states [C, H, P, N] out
        return jax.shard_map(
            ssd_kernel,
            mesh=mesh,
            in_specs=(chunk_heads,) * 4,
            out_specs=(chunk_heads, terms_heads),
            check_vma=False,
        )(xdt, cum, bh, ch)

    return dataclasses.replace(
        backend,
        attention=functools.wraps(kernel)(attention),
        mla_attention=functools.wraps(mla_kernel)(mla_attention),
        delta_chunk_terms=functools.wraps(delta_kernel)(delta_chunk_terms),
        ssd_chunk_terms=functools.wraps(ssd_kernel)(ssd_chunk_terms),
        reason=f"{backend.reason}; run per device over the {mesh.shape[axis]} shards of the KV heads "
        "(shard_map)",
    )


def attention_under_shard_map(
    mesh: Mesh,
    q_spec: PartitionSpec,
    cache_spec: PartitionSpec,
    local,
    ahead_spec: PartitionSpec | None = None,
):
    """The attention contract (kernels/reference.py `ragged_paged_attention`'s signature) as `local`
    (the same operands and keywords; those the call did not set are None) run per device under
    shard_map: q and the output split by `q_spec`, the caches by `cache_spec`, the sinks (one per query
    head) like q's heads, attend_ahead (one per token) by `ahead_spec` (None: not served), the metadata
    and a layer's traced window (its value under the layer scan) whole; None and int windows and the
    other keywords stay static. Tensor parallelism's wrapper (above) and context parallelism's
    (sharding/context_parallel.py) are this with their own specs and `local`."""

    def attention(
        q,
        k_cache,
        v_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        *,
        sliding_window=None,
        sinks=None,
        attend_ahead=None,
        **static,
    ):
        if attend_ahead is not None and ahead_spec is None:
            raise ValueError("attend_ahead (bidirectional spans) is not served by this attention")
        operands = [q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs]
        in_specs = [q_spec, cache_spec, cache_spec] + [PartitionSpec()] * 4
        traced_window = isinstance(sliding_window, jax.Array)
        extras = (
            (traced_window, sliding_window, PartitionSpec()),
            (sinks is not None, sinks, PartitionSpec(q_spec[1])),
            (attend_ahead is not None, attend_ahead, ahead_spec),
        )
        for present, operand, spec in extras:
            if present:
                operands.append(operand)
                in_specs.append(spec)

        def body(*args):
            extra = list(args[7:])
            window = extra.pop(0) if traced_window else sliding_window
            local_sinks = extra.pop(0) if sinks is not None else None
            ahead = extra.pop(0) if attend_ahead is not None else None
            return local(*args[:7], sliding_window=window, sinks=local_sinks, attend_ahead=ahead, **static)

        return jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=q_spec, check_vma=False)(
            *operands
        )

    return attention

"""Attention test cases shared by the attention and MLA tests, with a float64 numpy oracle.

Each case lays sequences out as the engine does: a flat ragged batch of new tokens, each sequence's
context split into a cached prefix (already in its blocks) and this step's new tokens (written by
`write_kv`), block ids shuffled, padding tokens and padding sequences after the real ones. Every
block no table references is NaN, so a result that reads unreferenced memory is NaN.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels.mla import write_latent
from xlaserve.kernels.reference import ragged_paged_attention, write_kv

NULL_BLOCK = 0  # where padding tokens write and padded block-table entries point (engine/batch.py)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The padded shapes one compiled variant serves."""

    block_size: int = 16
    num_tokens: int = 192  # T
    num_padded_seqs: int = 8  # R
    max_blocks_per_seq: int = 16
    num_blocks: int = 96
    head_dim: int = 16


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    num_q_heads: int
    num_kv_heads: int
    dtype: str = "float32"
    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False  # one sink logit per query head (gpt-oss)
    layout: Layout = Layout()
    tokens_per_chunk: int = 64  # the reference's page chunk
    # MLA (DeepSeek): one KV head of kv_lora_rank + rope_dim numbers whose first latent_rank (the
    # kv_lora_rank) are also the value; the op returns those latent_rank dims of the output.
    latent_rank: int | None = None


CONFIGS = {
    "mha_soft_cap": AttnConfig(2, 2, soft_cap=3.0),
    "gqa2": AttnConfig(4, 2),
    "gqa8_window": AttnConfig(8, 1, sliding_window=21),
    "gqa2_window_cap": AttnConfig(4, 2, sliding_window=5, soft_cap=2.0),
    "gqa2_window_sinks": AttnConfig(4, 2, sliding_window=21, sinks=True),
    "bfloat16": AttnConfig(4, 2, dtype="bfloat16"),
    "bfloat16_sinks": AttnConfig(4, 2, dtype="bfloat16", sinks=True),
    # A block size that divides neither the chunk nor the contexts, one page per chunk.
    "block5_chunk1": AttnConfig(
        8, 2, layout=Layout(block_size=5, max_blocks_per_seq=41, num_blocks=160), tokens_per_chunk=5
    ),
}
# The kernels' configs add GQA 3 (SmolLM2: a group that is not a power of two, padded to 4 rows).
KERNEL_CONFIGS = {**CONFIGS, "gqa3": AttnConfig(6, 2)}

# (context length after this step, new tokens this step) per real sequence; B is the block size.
BATCHES = {
    "decode": lambda b: [(1, 1), (b - 1, 1), (b, 1), (b + 1, 1), (200, 1), (2 * b + 3, 1)],
    "prefill": lambda b: [(1, 1), (b - 1, b - 1), (b, b), (b + 1, b + 1), (120, 120)],
    # Prefill chunks whose context already holds cached tokens, next to decodes and a fresh prefill.
    "mixed": lambda b: [(200, 1), (40, 24), (b + 1, 1), (33, 33), (1, 1), (b + 7, b), (3 * b, 2 * b)],
    "one_long_chunk": lambda b: [(200, 100)],
    # Speculative verifications (the last token and k drafts) beside a decode and a short prompt.
    "verify": lambda b: [(200, 5), (b + 1, 2), (1, 1), (3 * b + 2, 8), (4, 4), (2 * b, 5)],
}

# Latents of 32 + 16 (each a power of two, as the MLA kernel needs); 20 heads leave the kernel's
# last head block part empty.
MLA_LAYOUT = Layout(head_dim=48)
MLA_CONFIGS = {
    "mla": AttnConfig(4, 1, layout=MLA_LAYOUT, latent_rank=32),
    "mla_bfloat16": AttnConfig(4, 1, dtype="bfloat16", layout=MLA_LAYOUT, latent_rank=32),
    "mla_20_heads": AttnConfig(20, 1, layout=MLA_LAYOUT, latent_rank=32),
    "mla_20_heads_bfloat16": AttnConfig(20, 1, dtype="bfloat16", layout=MLA_LAYOUT, latent_rank=32),
}


def reference_attention(q, k_ctx, v_ctx, *, sm_scale, sliding_window, soft_cap, sinks=None):
    """One sequence in float64: q [n, Hq, D] are the last n positions of k_ctx/v_ctx [L, Hkv, D].
    `sinks` [Hq]: a further logit per head in the softmax's denominator (HF's gpt-oss eager path)."""
    q, k_ctx, v_ctx = (np.asarray(x, np.float64) for x in (q, k_ctx, v_ctx))
    n, num_q_heads, _ = q.shape
    context_len, num_kv_heads, _ = k_ctx.shape
    kv_head = np.arange(num_q_heads) // (num_q_heads // num_kv_heads)
    k_hld, v_hld = k_ctx[:, kv_head].transpose(1, 0, 2), v_ctx[:, kv_head].transpose(1, 0, 2)
    scores = np.einsum("nhd,hld->hnl", q, k_hld) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * np.tanh(scores / soft_cap)
    q_pos = np.arange(context_len - n, context_len)[:, None]
    kv_pos = np.arange(context_len)[None, :]
    visible = kv_pos <= q_pos
    if sliding_window is not None:
        visible &= kv_pos > q_pos - sliding_window
    scores = np.where(visible[None], scores, -np.inf)
    if sinks is not None:
        scores = np.concatenate([scores, np.broadcast_to(sinks[:, None, None], (num_q_heads, n, 1))], -1)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink's value is zero
    return np.einsum("hnl,hld->nhd", probs, v_hld)


def _fill(rng, shape, dtype):
    # Rounded to dtype on the host (as jnp.asarray rounds: to float32, then to dtype), not by a
    # device convert: that would compile one program per shape.
    return rng.standard_normal(shape).astype(np.float32).astype(dtype).astype(np.float64)


@dataclasses.dataclass
class Case:
    """One padded step as float64/int32 numpy arrays (values already rounded to `dtype`)."""

    cfg: AttnConfig
    q: np.ndarray  # [T, Hq, D]
    k_new: np.ndarray  # [T, Hkv, D]
    v_new: np.ndarray  # [T, Hkv, D]
    k_cache: np.ndarray  # [num_blocks, block_size, Hkv, D]: before this step's write
    v_cache: np.ndarray
    slot_mapping: np.ndarray  # [T]
    kv_lens: np.ndarray  # [R]
    block_tables: np.ndarray  # [R, max_blocks_per_seq]
    query_start_loc: np.ndarray  # [R + 1]
    num_seqs: int
    expected: np.ndarray  # [T, Hq, D] float64; padding rows 0
    num_real_tokens: int
    contexts: list  # per sequence: (blocks, k_ctx, v_ctx)
    sinks: np.ndarray | None = None  # [Hq] float32 when cfg.sinks

    @property
    def sm_scale(self) -> float:
        return self.cfg.layout.head_dim**-0.5

    def written_caches(self) -> tuple[np.ndarray, np.ndarray]:
        """The caches after this step's keys and values are written (numpy, no jax)."""
        bs = self.cfg.layout.block_size
        k_cache, v_cache = self.k_cache.copy(), self.v_cache.copy()
        k_cache[self.slot_mapping // bs, self.slot_mapping % bs] = self.k_new
        v_cache[self.slot_mapping // bs, self.slot_mapping % bs] = self.v_new
        return k_cache, v_cache


def build_case(
    cfg: AttnConfig, seqs: list[tuple[int, int]], seed: int, *, poison_tails=False, padding_seed=0
):
    """Lay out one padded step. The data of the sequence in row i depends on (seed, i) only and the
    padding's on padding_seed, so cases that differ only in padding or in other rows can be compared."""
    lay = cfg.layout
    rng = np.random.default_rng([seed, 1])
    pad_rng = np.random.default_rng([seed, 2, padding_seed])
    bs, dim, hq, hkv = lay.block_size, lay.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    dtype = jnp.dtype(cfg.dtype)  # a numpy dtype (ml_dtypes' for bfloat16)
    q_scale = 3.0 if cfg.soft_cap else 1.0  # large enough scores that the cap matters
    assert sum(n for _, n in seqs) < lay.num_tokens and len(seqs) < lay.num_padded_seqs

    # Poison every block, then give each sequence shuffled, non-contiguous blocks.
    cache_shape = (lay.num_blocks, bs, hkv, dim)
    k_cache = np.full(cache_shape, np.nan)
    v_cache = np.full(cache_shape, np.nan)
    if not poison_tails:
        # Padded table entries point at the null block and the last block of a sequence has stale
        # slots past its context: both are read (then masked), so they hold finite garbage here.
        k_cache[NULL_BLOCK] = 50.0 * pad_rng.standard_normal(cache_shape[1:])
        v_cache[NULL_BLOCK] = 50.0 * pad_rng.standard_normal(cache_shape[1:])
    free = list(rng.permutation(np.arange(1, lay.num_blocks)))
    block_tables = np.full((lay.num_padded_seqs, lay.max_blocks_per_seq), NULL_BLOCK, np.int32)
    kv_lens = np.zeros(lay.num_padded_seqs, np.int32)
    query_start_loc = np.zeros(lay.num_padded_seqs + 1, np.int32)
    slot_mapping = np.full(lay.num_tokens, NULL_BLOCK * bs, np.int32)  # padding tokens -> null block
    # Padding tokens carry arbitrary queries, keys and values.
    q = _fill(pad_rng, (lay.num_tokens, hq, dim), dtype) * q_scale
    k_new = _fill(pad_rng, (lay.num_tokens, hkv, dim), dtype)
    v_new = _fill(pad_rng, (lay.num_tokens, hkv, dim), dtype)
    expected = np.zeros((lay.num_tokens, hq, dim))
    # Sink logits around the scores' scale, so that some heads give the sink most of the weight.
    sinks = (2.0 * rng.standard_normal(hq)).astype(np.float32) if cfg.sinks else None
    contexts = []
    offset = 0
    for row, (context_len, n) in enumerate(seqs):
        seq_rng = np.random.default_rng([seed, 3, row])
        num_blocks = -(-context_len // bs)
        blocks = np.array([free.pop() for _ in range(num_blocks)], np.int32)
        block_tables[row, :num_blocks] = blocks
        if not poison_tails:
            k_cache[blocks[-1]] = 50.0 * pad_rng.standard_normal(cache_shape[1:])
            v_cache[blocks[-1]] = 50.0 * pad_rng.standard_normal(cache_shape[1:])
        k_ctx = _fill(seq_rng, (context_len, hkv, dim), dtype)
        v_ctx = _fill(seq_rng, (context_len, hkv, dim), dtype)
        if cfg.latent_rank is not None:
            v_ctx = k_ctx  # the expected output's first latent_rank dims are MLA's
        q[offset : offset + n] = _fill(seq_rng, (n, hq, dim), dtype) * q_scale
        k_new[offset : offset + n] = k_ctx[context_len - n :]
        v_new[offset : offset + n] = v_ctx[context_len - n :]
        pos = np.arange(context_len)
        slots_b, slots_o = blocks[pos // bs], pos % bs
        cached = pos < context_len - n
        k_cache[slots_b[cached], slots_o[cached]] = k_ctx[cached]
        v_cache[slots_b[cached], slots_o[cached]] = v_ctx[cached]
        slot_mapping[offset : offset + n] = slots_b[~cached] * bs + slots_o[~cached]
        expected[offset : offset + n] = reference_attention(
            q[offset : offset + n],
            k_ctx,
            v_ctx,
            sm_scale=dim**-0.5,
            sliding_window=cfg.sliding_window,
            soft_cap=cfg.soft_cap,
            sinks=None if sinks is None else sinks.astype(np.float64),
        )
        contexts.append((blocks, k_ctx, v_ctx))
        offset += n
        kv_lens[row] = context_len
        query_start_loc[row + 1] = offset
    query_start_loc[len(seqs) + 1 :] = offset
    if padding_seed:
        # Whatever a padding sequence's length says, it owns no token and bounds no loop.
        kv_lens[len(seqs) :] = pad_rng.integers(
            1, lay.max_blocks_per_seq * bs + 1, lay.num_padded_seqs - len(seqs)
        )
    return Case(
        cfg,
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        slot_mapping,
        kv_lens,
        block_tables,
        query_start_loc,
        len(seqs),
        expected,
        offset,
        contexts,
        sinks,
    )


def reference_op(cfg: AttnConfig) -> Callable:
    """The jnp reference with this config's page chunk (one object per chunk, so jit caches hit)."""
    return _reference_op(cfg.tokens_per_chunk)


@cache
def _reference_op(tokens_per_chunk: int) -> Callable:
    return partial(ragged_paged_attention, tokens_per_chunk=tokens_per_chunk)


@cache
def _jitted_step(attention: Callable, traced_window: bool):
    # A traced window is an argument of the step (as a layer's window under the layer scan).
    static = ("sm_scale", "soft_cap") if traced_window else ("sm_scale", "sliding_window", "soft_cap")

    @partial(jax.jit, static_argnames=static)
    def step(q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables, query_start_loc, num_seqs, **kw):
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, slot_mapping)
        out = attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, **kw)
        return out, k_cache, v_cache

    return step


def run_case(
    cfg: AttnConfig,
    seqs: list[tuple[int, int]],
    seed: int,
    *,
    attention: Callable | None = None,
    poison_tails=False,
    padding_seed=0,
    traced_window=False,
):
    """Build one padded step and run `write_kv` + `attention` (default: the reference) under jit;
    -> (out, expected, k_cache, v_cache) as float64, and info. Pass the same `attention` object
    across calls (a module-level partial) so that its jitted step is reused. `traced_window` passes
    the sliding window as an int32 array, not a static int."""
    case = build_case(cfg, seqs, seed, poison_tails=poison_tails, padding_seed=padding_seed)
    dtype = jnp.dtype(cfg.dtype)
    step = _jitted_step(attention if attention is not None else reference_op(cfg), traced_window)
    window = cfg.sliding_window
    if traced_window and window is not None:
        window = np.int32(window)
    # numpy arguments (cast on the host, exactly: the values are already rounded to dtype) and numpy
    # results: jnp.asarray and astype would each compile a small program per shape and dtype.
    out, k_out, v_out = step(
        case.q.astype(dtype),
        case.k_new.astype(dtype),
        case.v_new.astype(dtype),
        case.k_cache.astype(dtype),
        case.v_cache.astype(dtype),
        case.slot_mapping,
        case.kv_lens,
        case.block_tables,
        case.query_start_loc,
        np.int32(case.num_seqs),
        sm_scale=case.sm_scale,
        sliding_window=window,
        soft_cap=cfg.soft_cap,
        **({} if case.sinks is None else {"sinks": case.sinks}),
    )
    assert out.dtype == dtype and out.shape == case.q.shape
    info = {"num_real_tokens": case.num_real_tokens, "contexts": case.contexts}
    return _as64(out), case.expected, _as64(k_out), _as64(v_out), info


def _as64(x: jax.Array) -> np.ndarray:
    return np.asarray(x).astype(np.float64)  # bfloat16 -> float64 on the host: exact


@cache
def _jitted_mla_step(mla: Callable):
    @partial(jax.jit, static_argnames=("sm_scale",))
    def step(
        q_latent, q_rope, latent, latent_cache, slot_mapping, kv_lens, block_tables, qsl, num_seqs, **kw
    ):
        latent_cache = write_latent(latent_cache, latent, slot_mapping)
        return mla(q_latent, q_rope, latent_cache, kv_lens, block_tables, qsl, num_seqs, **kw), latent_cache

    return step


def run_mla_case(
    cfg: AttnConfig,
    seqs: list[tuple[int, int]],
    seed: int,
    *,
    mla: Callable,
    poison_tails=False,
    padding_seed=0,
):
    """`run_case` for an MLA op (the signature of kernels/mla.py) on a config with a `latent_rank`:
    the query's first latent_rank dims are q_latent and the rest q_rope, the keys are the latents
    (written by `write_latent`), and the K cache is the latent cache (returned as both caches)."""
    case = build_case(cfg, seqs, seed, poison_tails=poison_tails, padding_seed=padding_seed)
    rank, dtype = cfg.latent_rank, jnp.dtype(cfg.dtype)
    out, latent_cache = _jitted_mla_step(mla)(  # numpy in and out, as in run_case
        case.q[..., :rank].astype(dtype),
        case.q[..., rank:].astype(dtype),
        case.k_new[:, 0].astype(dtype),
        case.k_cache.astype(dtype),
        case.slot_mapping,
        case.kv_lens,
        case.block_tables,
        case.query_start_loc,
        np.int32(case.num_seqs),
        sm_scale=case.sm_scale,
    )
    assert out.dtype == dtype and out.shape == (*case.q.shape[:2], rank)
    latent_cache = _as64(latent_cache)
    info = {"num_real_tokens": case.num_real_tokens, "contexts": case.contexts}
    return _as64(out), case.expected[..., :rank], latent_cache, latent_cache, info


def tolerance(dtype: str) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 2e-2, "atol": 2e-2}


def case_seed(*names: str) -> int:
    return zlib.crc32("/".join(names).encode())  # a different, reproducible seed per case


def attend_ahead_case(dtype: str, *, words: bool):
    """A call with `attend_ahead` (Gemma 3's image spans) and its float64 oracle: two sequences, one
    with 9 cached tokens and a 5-token span in its 14-token chunk, one whose 7-token chunk starts
    inside a span begun in the cache; a sliding window of 12 counting back from each token's own
    position. -> (operands, keywords, expected [T, heads, dim]). `words`: a 16-bit cache stored as
    uint16 words (the reference backend's)."""
    rng = np.random.default_rng(3)
    block, heads, kv_heads, dim, window = 4, 4, 2, 16, 12
    contexts, chunks = [9, 6], [14, 7]  # cached tokens, new tokens per sequence
    aheads = [np.zeros(n, np.int32) for n in chunks]
    aheads[0][3:8] = np.arange(4, -1, -1)  # positions 12..16: one span
    aheads[1][:3] = [2, 1, 0]  # positions 6..8: the rest of a span begun in the cache
    lens = [c + n for c, n in zip(contexts, chunks, strict=True)]
    max_blocks = max(-(-n // block) for n in lens)
    keys = [rng.normal(size=(n, kv_heads, dim)) for n in lens]
    values = [rng.normal(size=(n, kv_heads, dim)) for n in lens]
    queries = [rng.normal(size=(n, heads, dim)) for n in chunks]
    k_cache = np.zeros((1 + 2 * max_blocks, block, kv_heads, dim))
    v_cache = np.zeros_like(k_cache)
    tables = np.zeros((2, max_blocks), np.int32)
    for s, n in enumerate(lens):
        for b in range(-(-n // block)):
            tables[s, b] = 1 + s * max_blocks + b
            rows = slice(b * block, min(n, (b + 1) * block))
            k_cache[tables[s, b], : rows.stop - rows.start] = keys[s][rows]
            v_cache[tables[s, b], : rows.stop - rows.start] = values[s][rows]
    expected = []
    for s in range(2):
        for i in range(chunks[s]):
            p = contexts[s] + i
            seen = np.arange(lens[s])
            seen = seen[(seen <= p + aheads[s][i]) & (seen > p - window)]
            q = queries[s][i].reshape(kv_heads, heads // kv_heads, dim)
            scores = np.einsum("kgd,skd->kgs", q, keys[s][seen]) * dim**-0.5
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            expected.append(np.einsum("kgs,skd->kgd", probs, values[s][seen]).reshape(heads, dim))
    jdtype = jnp.dtype(dtype)
    cache = [jnp.asarray(c, jdtype) for c in (k_cache, v_cache)]
    if words and dtype == "bfloat16":
        cache = [jax.lax.bitcast_convert_type(c, jnp.uint16) for c in cache]
    operands = (
        jnp.asarray(np.concatenate(queries), jdtype),
        *cache,
        jnp.asarray(lens, jnp.int32),
        jnp.asarray(tables),
        jnp.asarray([0, chunks[0], sum(chunks)], jnp.int32),
        jnp.int32(2),
    )
    kwargs = {
        "sm_scale": dim**-0.5,
        "sliding_window": window,
        "attend_ahead": jnp.asarray(np.concatenate(aheads)),
    }
    return operands, kwargs, np.stack(expected)

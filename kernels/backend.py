"""Attention backend selection: `--attention-backend auto|reference|pallas|jax-triton`.

- `reference`: the pure-jnp op of `kernels/reference.py`; runs everywhere.
- `pallas`: the Pallas kernel of `kernels/ragged_paged_attention.py`; Triton lowering on a GPU,
  interpret mode on CPU (exact but slow: for tests, not for serving).
- `jax-triton`: the Triton kernel of `kernels/triton_attention.py` through jax-triton; needs a GPU
  and the `cuda` extra (`cuda12` on CUDA 12).
- `auto`: the reference on CPU; on a GPU the first kernel of `AUTO_GPU_ORDER` (fastest first, as
  measured by `xlaserve bench attention`, kernels/KERNELS.md) that is installed and passes a
  self-check against the reference on this device. A shape the chosen kernel does not support (a head_dim
  that is not a power of two) falls back to the reference, logged.

An unavailable backend asked for by name is a ValueError that says why. Every backend writes the
cache with the reference `write_kv` (one XLA scatter into the donated cache).

`select_backend` makes the same choice with what it depends on as arguments (the platform, the
kernels by name, auto's order, the self-checks), so that tests can drive auto's GPU path with
fakes; `get_attention_backend` is it with the real ones on this process's default platform.

Multi-head latent attention (DeepSeek) has its own op, `mla_attention`: the jnp reference of
`kernels/mla.py` for `reference`, and the Pallas kernel of `kernels/ragged_paged_mla.py` for both
kernel backends (Pallas ships with jax; there is no separate Triton MLA kernel). Latent shapes
the kernel does not take (a rank or rope dim that is not a power of two >= 16) fall back to the
reference, logged.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from xlaserve.kernels import reference
from xlaserve.kernels.attention_args import validate_attention_args
from xlaserve.kernels.dtype_ops import word_dtype
from xlaserve.kernels.gated_delta import chunk_terms_reference as delta_chunk_terms_reference
from xlaserve.kernels.mla import mla_paged_attention, write_latent
from xlaserve.kernels.ssd import chunk_terms_reference
from xlaserve.kernels.synthetic import StepShape, synthetic_step

logger = logging.getLogger(__name__)

# Kernels `auto` tries on a GPU, fastest first. Set from `xlaserve bench attention` on the target GPU;
# until a GPU session has measured, Pallas leads because it needs no package beyond jax[cuda13].
AUTO_GPU_ORDER = ("pallas", "jax-triton")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
KV_CACHE_FP8_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
SELF_CHECK_TOLERANCE = 2e-2  # bfloat16 inputs and outputs, relative to 1 + |reference|


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    attention: Callable  # the ragged_paged_attention signature of kernels/reference.py
    write_kv: Callable
    reason: str
    mla_attention: Callable = mla_paged_attention  # the signature of kernels/mla.py
    # Writes the latent cache (kernels/mla.py `write_latent`'s signature, `positions` keyword included):
    # decode context parallelism writes each token on the rank that owns it.
    write_latent: Callable = write_latent
    # The reference stores a 16-bit float K/V cache as uint16 words: XLA's CPU backend would
    # otherwise convert the whole cache to float32 for every gather and scatter (dtype_ops.py).
    cache_words: bool = False

    # --kv-cache-dtype fp8/fp8_e4m3/fp8_e5m2: the float8 dtype K and V are stored in (scale 1.0).
    kv_cache_dtype: jnp.dtype | None = None
    # Mamba2's per-chunk SSD part (kernels/ssd.py `chunk_terms_reference`'s signature): the Pallas
    # kernel's when 'pallas' is asked for by name; `auto` keeps the reference until it is checked on a GPU.
    ssd_chunk_terms: Callable = chunk_terms_reference
    # The gated delta rule's per-chunk part (Qwen3.5, kernels/gated_delta.py's chunked form), likewise.
    delta_chunk_terms: Callable = delta_chunk_terms_reference
    # Whether `attention` takes `attend_ahead` (tokens that also see positions past their own: Gemma 3's
    # image spans): the reference and the Pallas kernel; not the Triton kernel, not context parallelism.
    serves_attend_ahead: bool = False

    def cache_dtype(self, dtype):
        """The dtype the K/V cache of a model computing in `dtype` is stored in."""
        dtype = self.kv_cache_dtype or jnp.dtype(dtype)
        return word_dtype(dtype) if self.cache_words else jnp.dtype(dtype)

    def with_kv_cache_dtype(self, name: str) -> AttentionBackend:
        """This backend over a cache of `name` (vLLM's --kv-cache-dtype): auto is the model's dtype;
        fp8 (= fp8_e4m3) and fp8_e5m2 store one byte per value, read back as the model's dtype. The
        reference keeps them as uint8 words (kernels/dtype_ops.py) and is told which float8 they hold."""
        if name == "auto":
            return self
        fp8 = jnp.dtype(KV_CACHE_FP8_DTYPES[name])
        attention = self.attention
        if self.attention is reference.ragged_paged_attention:
            attention = functools.partial(reference.ragged_paged_attention, kv_dtype=fp8)
        write_kv = functools.partial(reference.write_kv, kv_dtype=fp8)
        return dataclasses.replace(self, attention=attention, write_kv=write_kv, kv_cache_dtype=fp8)


def get_attention_backend(name: str = "auto", *, mla: bool = False) -> AttentionBackend:
    """Resolve a backend name on this process's default platform; see the module docstring.
    `mla`: the model uses latent attention, so `auto` also self-checks the MLA kernel (other
    models skip that compile)."""
    return select_backend(name, jax.default_backend(), mla=mla)


# A kernel's loader: platform -> (attention function, how it runs), or a ValueError naming the reason
# it cannot run there. Imports happen here, so a kernel that is not installed fails only when asked for.
KernelLoader = Callable[[str], tuple[Callable, str]]


def _load_pallas(platform: str) -> tuple[Callable, str]:
    from xlaserve.kernels import ragged_paged_attention as pallas

    if platform in GPU_PLATFORMS:
        return functools.partial(pallas.ragged_paged_attention, interpret=False), "Pallas, Triton lowering"
    if platform == "cpu":
        return (
            functools.partial(pallas.ragged_paged_attention, interpret=True),
            "Pallas in interpret mode on CPU (exact, slow: for testing, not serving)",
        )
    raise ValueError(
        "attention backend 'pallas' runs on a GPU (Triton lowering) or on CPU (interpret mode), not "
        f"on {platform!r}"
    )


def _load_jax_triton(platform: str) -> tuple[Callable, str]:
    if platform not in GPU_PLATFORMS:
        raise ValueError(
            f"attention backend 'jax-triton' needs a CUDA GPU, and the default platform is {platform!r}; "
            "use 'pallas' (interpret mode on CPU) or 'reference'"
        )
    try:
        import jax_triton  # noqa: F401  (refuses to import without a GPU build of jaxlib)

        from xlaserve.kernels import triton_attention
    except ImportError as e:
        raise ValueError(
            f"attention backend 'jax-triton' is not installed ({e}); pip install 'xlaserve[cuda]'"
        ) from e
    return triton_attention.ragged_paged_attention, "Triton kernel via jax_triton.triton_call"


KERNELS: dict[str, KernelLoader] = {"pallas": _load_pallas, "jax-triton": _load_jax_triton}
BACKENDS = ("reference", *KERNELS)  # the names besides "auto"


SELF_CHECK_STEP = StepShape(
    # A decode token, a fresh prefill, a chunk over cached context, a one-token context; GQA 4; padding.
    seqs=((37, 1), (16, 16), (50, 9), (1, 1)),
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=64,
    num_tokens=32,
    num_padded_seqs=6,
)


MLA_SELF_CHECK_STEP = dataclasses.replace(SELF_CHECK_STEP, num_kv_heads=1, head_dim=48)  # latents of 32 + 16


def mla_self_check(mla: Callable, seed: int = 0) -> float:
    """`self_check` for an MLA op (kernels/mla.py's signature) against the reference."""
    q, cache, _, *rest = synthetic_step(MLA_SELF_CHECK_STEP, seed)
    args = (q[..., :32], q[..., 32:], cache, *rest)
    got = jax.jit(functools.partial(mla, sm_scale=0.125))(*args).astype(jnp.float32)
    want = jax.jit(functools.partial(mla_paged_attention, sm_scale=0.125))(*args).astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want) / (1.0 + jnp.abs(want))))


def self_check(attention: Callable, shape: StepShape = SELF_CHECK_STEP, seed: int = 0) -> float:
    """Max of |attention - reference| / (1 + |reference|) on one small step on this device (bfloat16
    outputs round to 2**-8 relative, so a one-ulp difference counts ~0.004)."""
    args = synthetic_step(shape, seed)
    kw = {"sm_scale": shape.head_dim**-0.5}
    got = jax.jit(functools.partial(attention, **kw))(*args).astype(jnp.float32)
    want = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(*args).astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want) / (1.0 + jnp.abs(want))))


def select_backend(
    name: str,
    platform: str,
    kernels: Mapping[str, KernelLoader] = KERNELS,
    *,
    auto_order: Sequence[str] = AUTO_GPU_ORDER,
    self_check: Callable[[Callable], float] = self_check,
    mla_self_check: Callable[[Callable], float] = mla_self_check,
    mla: bool = False,
) -> AttentionBackend:
    """`get_attention_backend`'s choice on `platform` (a `jax.default_backend()` name) among
    `kernels` (name -> KernelLoader; a name outside them, "auto" and "reference" is a ValueError).
    `auto` on a GPU tries the kernels named in `auto_order`, first to last, and keeps the first whose
    `self_check` (attention function -> max error against the reference on this device) is within
    SELF_CHECK_TOLERANCE; with `mla`, it keeps the MLA kernel only if `mla_self_check` passes too (else
    the reference serves MLA)."""
    if name == "auto":
        return _auto(platform, kernels, auto_order, self_check, mla_self_check if mla else None)
    if name == "reference":
        return AttentionBackend(
            "reference",
            reference.ragged_paged_attention,
            reference.write_kv,
            "asked for by name",
            cache_words=not mla,
            serves_attend_ahead=True,
        )
    if name in kernels:
        attention, how = kernels[name](platform)
        backend = AttentionBackend(
            name,
            attention,
            reference.write_kv,
            f"asked for by name; {how}",
            _mla_kernel(platform),
            serves_attend_ahead=name == "pallas",
        )
        if name == "pallas":  # imported here, like the attention kernel (_load_pallas)
            from xlaserve.kernels.gated_delta_pallas import delta_chunk_terms
            from xlaserve.kernels.ssd_pallas import ssd_chunk_terms

            interpret = platform not in GPU_PLATFORMS
            backend = dataclasses.replace(
                backend,
                ssd_chunk_terms=functools.partial(ssd_chunk_terms, interpret=interpret),
                delta_chunk_terms=functools.partial(delta_chunk_terms, interpret=interpret),
            )
        return backend
    raise ValueError(f"attention_backend must be one of {('auto', 'reference', *kernels)}, got {name!r}")


def _auto(
    platform: str,
    kernels: Mapping[str, KernelLoader],
    auto_order: Sequence[str],
    self_check: Callable[[Callable], float],
    mla_self_check: Callable[[Callable], float] | None,  # None: the model has no latent attention
) -> AttentionBackend:
    if platform not in GPU_PLATFORMS:
        return AttentionBackend(
            "reference",
            reference.ragged_paged_attention,
            reference.write_kv,
            f"auto on {platform!r}: the jnp reference "
            "(the kernels target GPUs; Pallas interpret mode is for tests)",
            cache_words=mla_self_check is None,
            serves_attend_ahead=True,
        )
    skipped = []
    for name in auto_order:
        try:
            if name not in kernels:
                raise ValueError(f"no attention kernel named {name!r}")
            attention, how = kernels[name](platform)
            error = self_check(attention)
        except Exception as e:  # noqa: BLE001  (a missing package, a Triton compile failure: try the next)
            skipped.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if not error <= SELF_CHECK_TOLERANCE:  # NaN fails too
            skipped.append(f"{name}: self-check error {error:.3g} > {SELF_CHECK_TOLERANCE}")
            continue
        reason = (
            f"auto on {platform!r}: the fastest kernel that passes the self-check here "
            f"({how}; max error {error:.2g})"
        )
        if skipped:
            reason += "; skipped " + "; ".join(skipped)
        attention = _with_reference_fallback(name, attention)
        ahead = name == "pallas"
        if mla_self_check is None:
            return AttentionBackend(name, attention, reference.write_kv, reason, serves_attend_ahead=ahead)
        mla_attention, mla_how = _checked_mla_kernel(platform, mla_self_check)
        return AttentionBackend(
            name,
            attention,
            reference.write_kv,
            f"{reason}; {mla_how}",
            mla_attention,
            serves_attend_ahead=ahead,
        )
    return AttentionBackend(
        "reference",
        reference.ragged_paged_attention,
        reference.write_kv,
        f"auto on {platform!r}: no kernel passed its self-check ({'; '.join(skipped)})",
        cache_words=mla_self_check is None,
        serves_attend_ahead=True,
    )


def _mla_kernel(platform: str) -> Callable:
    """The Pallas MLA kernel (interpret mode on CPU), or the reference for latent shapes it does not
    take (decided at trace time, logged)."""
    from xlaserve.kernels.ragged_paged_mla import ragged_paged_mla

    kernel = functools.partial(ragged_paged_mla, interpret=platform not in GPU_PLATFORMS)

    def mla_or_reference(q_latent, q_rope, latent_cache, *args, **kw):
        rank, rope_dim = q_latent.shape[-1], q_rope.shape[-1]
        if all(d >= 16 and d & (d - 1) == 0 for d in (rank, rope_dim)):
            return kernel(q_latent, q_rope, latent_cache, *args, **kw)
        logger.warning(
            "the MLA kernel takes power-of-two latent dims >= 16, not kv_lora_rank=%d, rope_dim=%d: "
            "using the reference",
            rank,
            rope_dim,
        )
        return mla_paged_attention(q_latent, q_rope, latent_cache, *args, **kw)

    return mla_or_reference


def _checked_mla_kernel(platform: str, mla_self_check: Callable[[Callable], float]) -> tuple[Callable, str]:
    """auto's MLA: the Pallas kernel if it passes its self-check on this device, else the reference."""
    kernel = _mla_kernel(platform)
    try:
        error = mla_self_check(kernel)
    except Exception as e:  # noqa: BLE001  (a compile failure: the reference serves MLA)
        return mla_paged_attention, f"MLA: the reference (the kernel failed: {type(e).__name__}: {e})"
    if not error <= SELF_CHECK_TOLERANCE:
        return mla_paged_attention, f"MLA: the reference (kernel self-check error {error:.3g})"
    return kernel, f"MLA: the Pallas kernel (max error {error:.2g})"


def _with_reference_fallback(name: str, attention: Callable) -> Callable:
    """`attention`, or the reference for shapes the kernel does not take (decided at trace time)."""

    def attention_or_reference(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs, **kw):
        args = (q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, num_seqs)
        try:
            validate_attention_args(
                *args,
                sm_scale=kw["sm_scale"],
                sliding_window=kw.get("sliding_window"),
                soft_cap=kw.get("soft_cap"),
            )
        except ValueError as e:
            logger.warning("attention backend %s does not take this call (%s): using the reference", name, e)
            return reference.ragged_paged_attention(*args, **kw)
        return attention(*args, **kw)

    return attention_or_reference

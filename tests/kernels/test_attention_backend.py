"""`--attention-backend` resolution: names, platforms, auto's choice on a GPU, and its fallbacks.

auto's GPU path runs here on CPU through `select_backend`, the choice with the platform, the kernels
and the self-checks as arguments: fakes go in as arguments, nothing in the module is patched."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import pytest

from xlaserve.kernels import backend, get_attention_backend, reference
from xlaserve.kernels.backend import select_backend
from xlaserve.kernels.mla import mla_paged_attention
from xlaserve.kernels.synthetic import StepShape, synthetic_step


def test_auto_on_cpu_is_the_reference():
    chosen = get_attention_backend("auto")
    assert chosen.name == "reference" and chosen.attention is reference.ragged_paged_attention
    assert "'cpu'" in chosen.reason


def test_reference_by_name():
    assert get_attention_backend("reference").attention is reference.ragged_paged_attention


def test_pallas_on_cpu_runs_in_interpret_mode():
    chosen = get_attention_backend("pallas")
    assert chosen.name == "pallas" and chosen.attention.keywords == {"interpret": True}
    assert "interpret mode" in chosen.reason
    assert backend.self_check(chosen.attention) < backend.SELF_CHECK_TOLERANCE
    assert chosen.write_kv is reference.write_kv


def test_unavailable_or_unknown_backends_are_clear_errors():
    with pytest.raises(ValueError, match="'jax-triton' needs a CUDA GPU, and the default platform is 'cpu'"):
        get_attention_backend("jax-triton")
    with pytest.raises(
        ValueError, match=r"must be one of \('auto', 'reference', 'pallas', 'jax-triton'\), got 'flash'"
    ):
        get_attention_backend("flash")
    with pytest.raises(ValueError, match="not on 'tpu'"):
        select_backend("pallas", "tpu")


def _fake_kernel(attention, how="fake"):
    """A KernelLoader that loads `attention`, or raises it if it is an exception."""

    def load(platform):
        if isinstance(attention, Exception):
            raise attention
        return attention, f"{how} on {platform}"

    return load


def test_auto_on_gpu_takes_the_first_kernel_that_passes_its_self_check():
    """Simulated: the first kernel in order is missing, the second is wrong, the third passes."""
    good = reference.ragged_paged_attention
    kernels = {
        "missing": _fake_kernel(ValueError("not installed")),
        "wrong": _fake_kernel(lambda *args, **kw: None),  # never run: the self-check is faked too
        "good": _fake_kernel(good),
    }

    def fake_self_check(attention):
        return 0.001 if attention is good else float("nan")

    chosen = select_backend(
        "auto", "gpu", kernels, auto_order=("missing", "wrong", "good"), self_check=fake_self_check
    )
    assert chosen.name == "good"
    assert (
        "missing: ValueError: not installed" in chosen.reason
        and "wrong: self-check error nan" in chosen.reason
    )

    fallback = select_backend(
        "auto", "gpu", kernels, auto_order=("missing", "wrong"), self_check=fake_self_check
    )
    assert fallback.name == "reference" and "no kernel passed its self-check" in fallback.reason


def test_auto_falls_back_to_the_reference_for_shapes_a_kernel_does_not_take(caplog):
    """head_dim 80 is not a power of two: the kernel would refuse it, auto's wrapper uses the reference."""

    def kernel(*args, **kw):
        raise AssertionError("the kernel must not be called for head_dim 80")

    chosen = select_backend(
        "auto", "gpu", {"pallas": _fake_kernel(kernel)}, auto_order=("pallas",), self_check=lambda a: 0.0
    )
    args = synthetic_step(
        StepShape(seqs=((20, 3), (5, 1)), num_q_heads=4, num_kv_heads=2, head_dim=80, dtype="float32")
    )
    with caplog.at_level(logging.WARNING):
        out = jax.jit(functools.partial(chosen.attention, sm_scale=0.1))(*args)
    # jitted, as the wrapper ran: run op by op, the reference compiles one program per operation.
    expected = jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=0.1))(*args)
    assert jnp.array_equal(out, expected)
    assert "head_dim must be a power of two" in caplog.text


def test_auto_on_gpu_keeps_the_mla_kernel_only_if_it_passes_its_self_check():
    def choose(mla_error: float, *, mla: bool = True):
        return select_backend(
            "auto",
            "gpu",
            {"good": _fake_kernel(reference.ragged_paged_attention)},
            auto_order=("good",),
            self_check=lambda attention: 0.0,
            mla_self_check=lambda mla: mla_error,
            mla=mla,
        )

    chosen = choose(0.001)
    assert chosen.mla_attention is not mla_paged_attention and "MLA: the Pallas kernel" in chosen.reason
    # A model without latent attention skips the MLA check (and its compile).
    assert "MLA" not in choose(0.001, mla=False).reason
    chosen = choose(float("nan"))
    assert (
        chosen.mla_attention is mla_paged_attention
        and "MLA: the reference (kernel self-check error nan)" in chosen.reason
    )


def test_mla_self_check_measures_the_kernel():
    # The real check (a bfloat16 step), with the kernel in interpret mode (what `pallas` uses on CPU).
    pallas_mla = get_attention_backend("pallas").mla_attention
    assert backend.mla_self_check(pallas_mla) <= backend.SELF_CHECK_TOLERANCE

    def wrong(q_latent, *args, **kw):
        return 2 * mla_paged_attention(q_latent, *args, **kw)

    assert backend.mla_self_check(wrong) > 10 * backend.SELF_CHECK_TOLERANCE
    assert pallas_mla is not get_attention_backend("reference").mla_attention

"""`--attention-backend` resolution: names, platforms, auto's choice on a GPU, and its fallbacks."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import pytest

from xlaserve.kernels import backend, get_attention_backend, reference
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
        backend._kernel("pallas", "tpu")


def test_auto_on_gpu_takes_the_first_kernel_that_passes_its_self_check(monkeypatch):
    """Simulated: the first kernel in order is missing, the second is wrong, the third passes."""
    kernels = {
        "missing": ValueError("not installed"),
        "wrong": lambda *args, **kw: None,  # never run: the self-check is faked too
        "good": reference.ragged_paged_attention,
    }
    errors = {"wrong": float("nan"), "good": 0.001}

    def fake_kernel(name, platform):
        if isinstance(kernels[name], Exception):
            raise kernels[name]
        return kernels[name], f"{name} on {platform}"

    monkeypatch.setattr(backend, "AUTO_GPU_ORDER", ("missing", "wrong", "good"))
    monkeypatch.setattr(backend, "_kernel", fake_kernel)
    monkeypatch.setattr(
        backend, "self_check", lambda attention: errors["good" if attention is kernels["good"] else "wrong"]
    )
    chosen = backend._auto("gpu")
    assert chosen.name == "good"
    assert (
        "missing: ValueError: not installed" in chosen.reason
        and "wrong: self-check error nan" in chosen.reason
    )

    monkeypatch.setattr(backend, "AUTO_GPU_ORDER", ("missing", "wrong"))
    fallback = backend._auto("gpu")
    assert fallback.name == "reference" and "no kernel passed its self-check" in fallback.reason


def test_auto_falls_back_to_the_reference_for_shapes_a_kernel_does_not_take(caplog):
    """head_dim 80 is not a power of two: the kernel would refuse it, auto's wrapper uses the reference."""

    def kernel(*args, **kw):
        raise AssertionError("the kernel must not be called for head_dim 80")

    attention = backend._with_reference_fallback("pallas", kernel)
    args = synthetic_step(
        StepShape(seqs=((20, 3), (5, 1)), num_q_heads=4, num_kv_heads=2, head_dim=80, dtype="float32")
    )
    with caplog.at_level(logging.WARNING):
        out = jax.jit(functools.partial(attention, sm_scale=0.1))(*args)
    expected = reference.ragged_paged_attention(*args, sm_scale=0.1)
    assert jnp.array_equal(out, expected)
    assert "head_dim must be a power of two" in caplog.text


def test_auto_on_gpu_keeps_the_mla_kernel_only_if_it_passes_its_self_check(monkeypatch):
    from xlaserve.kernels.mla import mla_paged_attention

    monkeypatch.setattr(backend, "AUTO_GPU_ORDER", ("good",))
    monkeypatch.setattr(backend, "_kernel", lambda name, platform: (reference.ragged_paged_attention, "fake"))
    monkeypatch.setattr(backend, "self_check", lambda attention: 0.0)
    monkeypatch.setattr(backend, "mla_self_check", lambda mla: 0.001)
    chosen = backend._auto("gpu", mla=True)
    assert chosen.mla_attention is not mla_paged_attention and "MLA: the Pallas kernel" in chosen.reason
    # A model without latent attention skips the MLA check (and its compile).
    assert "MLA" not in backend._auto("gpu").reason
    monkeypatch.setattr(backend, "mla_self_check", lambda mla: float("nan"))
    chosen = backend._auto("gpu", mla=True)
    assert (
        chosen.mla_attention is mla_paged_attention
        and "MLA: the reference (kernel self-check error nan)" in chosen.reason
    )


def test_mla_self_check_measures_the_kernel():
    # The real check (a bfloat16 step), with the kernel in interpret mode (what `pallas` uses on CPU).
    assert backend.mla_self_check(backend._mla_kernel("cpu")) <= backend.SELF_CHECK_TOLERANCE

    def wrong(q_latent, *args, **kw):
        return 2 * backend.mla_paged_attention(q_latent, *args, **kw)

    assert backend.mla_self_check(wrong) > 10 * backend.SELF_CHECK_TOLERANCE
    assert (
        get_attention_backend("pallas").mla_attention is not get_attention_backend("reference").mla_attention
    )

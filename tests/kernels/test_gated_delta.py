"""The gated delta rule over a ragged batch (kernels/gated_delta.py) against the recurrence itself in
float64 numpy, token by token per sequence: the chunked form (sequences cut mid-chunk, entering
states, padding sequences and tokens, grouped value heads) and the recurrent form of a decode step;
against Hugging Face's own torch chunked implementation for one sequence; and, with batch invariance
on, the token-by-token form's bits for a sequence alone, among companions, and cut into two steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from xlaserve.kernels.gated_delta import ragged_gated_delta_rule
from xlaserve.kernels.invariant import traced_with

HK, HV, DK, DV = 2, 4, 6, 5
# The invariance switch is read when the function is traced: one jitted function per setting.
RULES = {
    on: jax.jit(traced_with(on, ragged_gated_delta_rule), static_argnames=("chunk_size",))
    for on in (True, False)
}


def numpy_rule(q, k, v, g, beta, qsl, init):
    """S = exp(g) S; S += beta k (v - k^T S)^T; o = S^T q, with q, k L2-normed and q scaled."""

    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    rep = HV // HK
    q, k = np.repeat(l2(q), rep, 1) * DK**-0.5, np.repeat(l2(k), rep, 1)
    o = np.zeros(v.shape, np.float64)
    final = init.astype(np.float64).copy()
    for r in range(len(qsl) - 1):
        s = init[r].astype(np.float64)
        for t in range(qsl[r], qsl[r + 1]):
            s = s * np.exp(g[t])[:, None, None]
            delta = (v[t] - np.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", s, q[t])
        final[r] = s
    return o, final


def case(lengths, num_tokens, seed):
    rng = np.random.default_rng(seed)
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    r = len(lengths)
    return dict(
        q=rng.normal(size=(num_tokens, HK, DK)),
        k=rng.normal(size=(num_tokens, HK, DK)),
        v=rng.normal(size=(num_tokens, HV, DV)),
        g=-rng.uniform(0.01, 1.5, (num_tokens, HV)),
        beta=rng.uniform(0.05, 0.95, (num_tokens, HV)),
        qsl=qsl,
        init=rng.normal(size=(r, HV, DK, DV)) * (rng.uniform(size=(r, 1, 1, 1)) < 0.7),
    )


def run(k, chunk_size=8, invariant=False):
    o, final = RULES[invariant](
        *(jnp.asarray(k[n], jnp.float32) for n in ("q", "k", "v", "g", "beta")),
        jnp.asarray(k["qsl"]),
        jnp.asarray(k["init"], jnp.float32),
        chunk_size=chunk_size,
    )
    return np.asarray(o), np.asarray(final)


# One shape (32 tokens, 5 sequences) for all three: one compile per form.
@pytest.mark.parametrize("invariant", [False, True], ids=["chunked-or-recurrent", "token-by-token"])
@pytest.mark.parametrize(
    "lengths",
    [
        [11, 1, 9, 0, 0],  # cut mid-chunk, a decode row, padding sequences and tokens
        [25, 0, 0, 0, 0],  # one sequence over four chunks
        [1, 1, 1, 1, 0],  # decode: the recurrent form
    ],
)
def test_rule_matches_float64_recurrence(lengths, invariant):
    k = case(lengths, 32, seed=sum(lengths))
    o, final = run(k, invariant=invariant)
    ro, rfinal = numpy_rule(*(k[n] for n in ("q", "k", "v", "g", "beta", "qsl", "init")))
    n = k["qsl"][-1]
    np.testing.assert_allclose(o[:n], ro[:n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(final, rfinal, rtol=1e-5, atol=1e-5)


def test_rule_matches_hugging_face_chunked_torch():
    """transformers' torch_chunk_gated_delta_rule (chunk 64, padded at the end) on one sequence with
    an entering state: the same output and final state as our per-sequence chunks of 8."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    k = case([25, 0, 0, 0, 0], 32, seed=7)
    o, final = run(k)
    t = {n: torch.tensor(k[n][:25][None], dtype=torch.float32) for n in ("q", "k", "v", "g", "beta")}
    ho, hfinal = torch_chunk_gated_delta_rule(
        t["q"],
        t["k"],
        t["v"],
        g=t["g"],
        beta=t["beta"],
        initial_state=torch.tensor(k["init"][:1], dtype=torch.float32),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    np.testing.assert_allclose(o[:25], ho[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(final[0], hfinal[0].numpy(), rtol=1e-5, atol=1e-5)


def test_token_by_token_bits_do_not_depend_on_companions_or_steps():
    """Sequence A (13 tokens) alone in a step of 16 tokens; among three others in a step of 32; and cut
    into steps of 5 and 8 tokens (the second entering with the first's state): the same float32 bits."""
    a = case([13, 0, 0, 0, 0], 16, seed=3)
    crowd = case([4, 13, 9, 1, 0], 32, seed=4)
    for name in ("q", "k", "v", "g", "beta"):
        crowd[name][4:17] = a[name][:13]
    crowd["init"][1] = a["init"][0]
    alone_o, alone_final = run(a, invariant=True)
    crowd_o, crowd_final = run(crowd, invariant=True)
    assert np.array_equal(crowd_o[4:17], alone_o[:13]) and np.array_equal(crowd_final[1], alone_final[0])
    first = {n: v.copy() for n, v in a.items()}
    first["qsl"] = np.array([0, 5, 5, 5, 5, 5], np.int32)
    o1, final1 = run(first, invariant=True)
    second = {
        n: np.roll(v, -5, axis=0) if n in ("q", "k", "v", "g", "beta") else v.copy() for n, v in a.items()
    }
    second["qsl"] = np.array([0, 8, 8, 8, 8, 8], np.int32)
    second["init"] = final1.astype(np.float64)  # the state the first step left (float32 values)
    o2, final2 = run(second, invariant=True)
    assert np.array_equal(np.concatenate([o1[:5], o2[:8]]), alone_o[:13])
    assert np.array_equal(final2[0], alone_final[0])


# -- the Pallas per-chunk kernel (kernels/gated_delta_pallas.py) -------------------------------------


def test_pallas_chunk_kernel_matches_the_reference_in_interpret_mode():
    """The per-chunk kernel (its UT inverse as a product of squarings) against `chunk_terms_reference`
    (forward substitution), alone and inside the ragged rule against the float64 recurrence."""
    import functools

    from xlaserve.kernels.gated_delta import chunk_terms_reference
    from xlaserve.kernels.gated_delta_pallas import delta_chunk_terms

    rng = np.random.default_rng(7)
    num_chunks, q = 3, 8
    args = [
        rng.normal(size=(num_chunks, q, HV, DK)) * 0.5,
        rng.normal(size=(num_chunks, q, HV, DK)) * 0.5,
        rng.normal(size=(num_chunks, q, HV, DV)),
        -rng.uniform(0.01, 1.5, (num_chunks, q, HV)),
        rng.uniform(0.05, 0.95, (num_chunks, q, HV)),
    ]
    args = [jnp.asarray(a, jnp.float32) for a in args]
    for ours, ref in zip(delta_chunk_terms(*args, interpret=True), chunk_terms_reference(*args), strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="g has shape"):
        delta_chunk_terms(*args[:3], args[3][:, :4], args[4], interpret=True)
    k = case([11, 1, 9, 0, 0], 32, seed=21)
    o, final = jax.jit(
        traced_with(False, ragged_gated_delta_rule), static_argnames=("chunk_size", "chunk_terms")
    )(
        *(jnp.asarray(k[n], jnp.float32) for n in ("q", "k", "v", "g", "beta")),
        jnp.asarray(k["qsl"]),
        jnp.asarray(k["init"], jnp.float32),
        chunk_size=8,
        chunk_terms=functools.partial(delta_chunk_terms, interpret=True),
    )
    ro, rfinal = numpy_rule(*(k[n] for n in ("q", "k", "v", "g", "beta", "qsl", "init")))
    np.testing.assert_allclose(np.asarray(o)[:21], ro[:21], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(final), rfinal, rtol=1e-5, atol=1e-5)


def test_pallas_chunk_kernel_lowers_to_one_triton_call():
    """Qwen3.5's chunk shapes (Q 64, Dk = Dv = 128, 16 value heads) lower for CUDA on this CPU machine,
    and 'pallas' by name hands the kernel to the DeltaNet layers (interpret mode on CPU)."""
    import re

    from xlaserve.kernels.backend import select_backend
    from xlaserve.kernels.gated_delta import chunk_terms_reference
    from xlaserve.kernels.gated_delta_pallas import delta_chunk_terms

    shapes = [(4, 64, 16, 128)] * 3 + [(4, 64, 16)] * 2
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    text = jax.jit(delta_chunk_terms).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo.custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]
    pallas = select_backend("pallas", "cpu")
    assert pallas.delta_chunk_terms.func is delta_chunk_terms
    assert pallas.delta_chunk_terms.keywords == {"interpret": True}
    assert select_backend("auto", "cpu").delta_chunk_terms is chunk_terms_reference

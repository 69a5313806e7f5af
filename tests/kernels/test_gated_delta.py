"""The gated delta rule over a ragged batch (kernels/gated_delta.py) against the recurrence itself in
float64 numpy, token by token per sequence: the chunked form (sequences cut mid-chunk, entering
states, padding sequences and tokens, grouped value heads) and the recurrent form of a decode step;
and against Hugging Face's own torch chunked implementation for one sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from xlaserve.kernels.gated_delta import ragged_gated_delta_rule

HK, HV, DK, DV = 2, 4, 6, 5
rule = jax.jit(ragged_gated_delta_rule, static_argnames=("chunk_size",))


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


def run(k, chunk_size=8):
    o, final = rule(
        *(jnp.asarray(k[n], jnp.float32) for n in ("q", "k", "v", "g", "beta")),
        jnp.asarray(k["qsl"]),
        jnp.asarray(k["init"], jnp.float32),
        chunk_size=chunk_size,
    )
    return np.asarray(o), np.asarray(final)


# One shape (32 tokens, 5 sequences) for all three: one compile.
@pytest.mark.parametrize(
    "lengths",
    [
        [11, 1, 9, 0, 0],  # cut mid-chunk, a decode row, padding sequences and tokens
        [25, 0, 0, 0, 0],  # one sequence over four chunks
        [1, 1, 1, 1, 0],  # decode: the recurrent form
    ],
)
def test_rule_matches_float64_recurrence(lengths):
    k = case(lengths, 32, seed=sum(lengths))
    o, final = run(k)
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

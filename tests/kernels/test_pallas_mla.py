"""What is specific to the Pallas MLA kernel (kernels/ragged_paged_mla.py): its tilings (over stale
NaN slots) against the jnp reference of kernels/mla.py (interpret mode), the compiled kernel on a
GPU, its CUDA lowering and sm_90 compile, and the engine with `attention_backend="pallas"` on a tiny
DeepSeek. The contract it shares with every backend (the float64 oracle over decode, prefill, mixed
and long-chunk steps, 4 and 20 heads, float32 and bfloat16; padding; stale slots; errors) is
test_attention_contract.py's, which checks the jnp MLA reference the same way."""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.cuda_compile_run import compile_in_subprocess
from xlaserve.kernels.mla import mla_paged_attention
from xlaserve.kernels.ragged_paged_mla import ragged_paged_mla
from xlaserve.kernels.synthetic import StepShape, synthetic_step

RANK, ROPE = 32, 16
STEPS = {
    # (context length, new tokens) per sequence; tokens and sequences padded
    "decode": (((37, 1), (16, 1), (100, 1), (1, 1)), 8, 6),
    "mixed": (((37, 1), (16, 16), (90, 40), (1, 1)), 64, 6),
    "long chunk": (((300, 64),), 64, 2),
}


def make_step(name: str, heads: int, dtype: str, seed: int, poison_stale: bool = False):
    seqs, num_tokens, num_padded = STEPS[name]
    shape = StepShape(
        seqs=seqs,
        num_q_heads=heads,
        num_kv_heads=1,
        head_dim=RANK + ROPE,
        dtype=dtype,
        num_tokens=num_tokens,
        num_padded_seqs=num_padded,
    )
    q, cache, _, kv_lens, block_tables, qsl, num_seqs = synthetic_step(shape, seed)
    if poison_stale:  # slots past each context in its last block: a reused block's stale values
        cache = np.array(cache)
        for row, (ctx, _) in enumerate(seqs):
            last = int(block_tables[row, (ctx - 1) // cache.shape[1]])
            cache[last, ctx % cache.shape[1] or cache.shape[1] :] = np.nan
        cache = jnp.asarray(cache)
    return q[..., :RANK], q[..., RANK:], cache, kv_lens, block_tables, qsl, num_seqs


def check(got, want, dtype: str, num_real: int) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    np.testing.assert_allclose(got[:num_real], want[:num_real], rtol=tol, atol=tol)
    np.testing.assert_array_equal(got[num_real:], 0.0)  # padding tokens


@pytest.mark.parametrize(
    "tiling", [{"block_q": 8, "block_h": 2, "block_kv": 16}, {"block_q": 1, "block_h": 16, "block_kv": 64}]
)
def test_tilings_and_stale_slots(tiling):
    args = make_step("mixed", 4, "float32", seed=7, poison_stale=True)
    want = mla_paged_attention(*args, sm_scale=0.1)  # masks stale slots too
    got = ragged_paged_mla(*args, sm_scale=0.1, interpret=True, **tiling)
    check(got, want, "float32", int(args[5][args[6]]))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs the compiled kernel: needs a CUDA GPU")
@pytest.mark.parametrize("step", list(STEPS))
def test_compiled_on_gpu_matches_reference(step):
    args = make_step(step, 16, "bfloat16", seed=3)
    want = mla_paged_attention(*args, sm_scale=0.1)
    check(ragged_paged_mla(*args, sm_scale=0.1), want, "bfloat16", int(args[5][args[6]]))


def test_lowers_for_cuda_through_triton():
    sd = jax.ShapeDtypeStruct
    args = (
        sd((64, 16, 512), jnp.bfloat16),
        sd((64, 16, 64), jnp.bfloat16),
        sd((512, 16, 1, 576), jnp.bfloat16),
        sd((8,), jnp.int32),
        sd((8, 64), jnp.int32),
        sd((9,), jnp.int32),
        sd((), jnp.int32),
    )
    fn = functools.partial(ragged_paged_mla, sm_scale=0.1)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo.custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]


def test_compiles_to_sm90_cubin():
    """Triton's compiler and ptxas take the lowered kernel to a cubin (DeepSeek-V3 shapes at TP 8)."""
    out = compile_in_subprocess("mla", "decode")
    assert out.count("ok   mla    sm_90") == 1, out


@pytest.mark.slow  # two engines, about 30 s
def test_engine_deepseek_pallas_matches_reference(tmp_path, caplog):
    from helpers.tiny_models import TINY_DEEPSEEK_V3, save_tiny_model
    from xlaserve import LLM, SamplingParams

    dims = {**TINY_DEEPSEEK_V3, "kv_lora_rank": RANK, "qk_rope_head_dim": ROPE}
    model = save_tiny_model(str(tmp_path), "DeepseekV3", n_shared_experts=1, **dims)
    prompts = ["The capital of France is", "def f(x):", "One two three four five six seven"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs = {}
    for backend in ("reference", "pallas"):
        llm = LLM(
            model,
            attention_backend=backend,
            dtype="float32",
            max_model_len=128,
            max_num_batched_tokens=32,
            max_num_seqs=4,
            kv_cache_memory=2**22,
            enforce_eager=True,
        )
        with caplog.at_level(logging.WARNING):
            runs[backend] = llm.generate(prompts, params, use_tqdm=False)
    assert "MLA kernel takes power-of-two" not in caplog.text  # the kernel ran, not the fallback
    for ref, kern in zip(runs["reference"], runs["pallas"]):
        assert kern.outputs[0].token_ids == ref.outputs[0].token_ids
        lp = [
            [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in (ref, kern)
        ]
        np.testing.assert_allclose(lp[1], lp[0], atol=1e-5)

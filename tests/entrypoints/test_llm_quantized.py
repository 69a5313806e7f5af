"""SmolLM2 with quantized weights and a float8 KV cache, against the bfloat16 engine, end to end.

Perplexity over a fixed text (tests/helpers/perplexity_text.py, ~330 tokens, prompt logprobs):
int8 weights within 2% of bfloat16's (also with every int8 dot in integers, the batch-1 decode
path: kernels/dtype_ops.split_int8_matmul), fp8 weights within 1.5% (-0.4% measured with its
per-channel scales of least rounding error, models/fp8_scales.py; +3.2% with max/448 scales; variants
of equal rounding error moved it between -0.5% and +0.3%), an fp8 KV cache within 5%. (Greedy
tokens are not compared here: a near-tie may flip; each mode's greedy decoding has its own tests.)
The quantized engines report fewer weight bytes (`xlaserve:model_weight_bytes`): int8 and fp8 at
most 0.52x of bfloat16's, the GGUF's blocks kept (`--quantization gguf`) at most 0.4x.
"""

from __future__ import annotations

import gc
import math

import pytest

from helpers.perplexity_text import TEXT
from helpers.smollm2 import smollm2_gguf_path
from xlaserve import LLM, SamplingParams
from xlaserve.kernels import dtype_ops

MODES = {  # name -> engine arguments on top of bfloat16
    "bfloat16": {},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "fp8 KV cache": {"kv_cache_dtype": "fp8"},
    "gguf": {"quantization": "gguf"},  # the embedded GGUF's Q4_1 / Q8_0 blocks kept as they are
    # int8 with every dot by an int8 weight in integers (kernels/dtype_ops.split_int8_matmul), which
    # the engine does for one row only (a batch-1 decode step): its accuracy over the whole text.
    "int8 integer dots": {"quantization": "int8"},
}
# The bfloat16 model is the GGUF's blocks dequantized: keeping them is only bfloat16's rounding away.
BOUNDS = {
    "int8": 0.02,
    "fp8": 0.015,  # -0.41% measured (+3.22% with max/448 scales: this bound catches it)
    "fp8 KV cache": 0.05,
    "gguf": 0.02,
    "int8 integer dots": 0.02,
}  # relative to bfloat16's perplexity


def perplexity(llm: LLM) -> float:
    ids = llm.tokenizer(TEXT)["input_ids"]
    out = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    logprobs = [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def _metric(llm, name: str) -> float:
    return next(m for m in llm.get_metrics() if m.name == f"xlaserve:{name}").value


def _measure(extra: dict) -> tuple:
    llm = LLM(
        dtype="bfloat16",
        # The text's 335 tokens in one step of as many (not padded to 512: its forward and its prompt
        # logprobs over the 49,152-token vocabulary a third smaller), one request at a time.
        max_model_len=336,
        max_num_seqs=1,
        max_num_batched_tokens=336,
        kv_cache_memory=32 * 2**20,
        enforce_eager=True,  # compile only the buckets these steps use
        optimization_level=2,  # SmolLM2's steps dominate: XLA's default level (tests/conftest.py)
        **extra,
    )
    return perplexity(llm), _metric(llm, "model_weight_bytes"), _metric(llm, "num_kv_blocks")


@pytest.mark.slow  # six SmolLM2 engines, compiled lazily: ~3 minutes on 2 cores
def test_quantized_perplexity_within_bounds_of_bfloat16():
    smollm2_gguf_path()
    results = {}
    for name, extra in MODES.items():
        split_rows = 1 << 30 if name == "int8 integer dots" else dtype_ops.INT8_SPLIT_MAX_ROWS
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dtype_ops, "INT8_SPLIT_MAX_ROWS", split_rows)
            results[name] = _measure(extra)
        gc.collect()
    base_ppl, base_bytes, base_blocks = results["bfloat16"]
    for name, (ppl, weight_bytes, blocks) in results.items():
        print(
            f"{name}: perplexity {ppl:.3f} ({ppl / base_ppl - 1:+.2%}), "
            f"weights {weight_bytes / 2**20:.1f} MiB ({weight_bytes / base_bytes:.2f}x), "
            f"KV blocks {blocks:.0f}"
        )
        if name in BOUNDS:
            assert abs(ppl / base_ppl - 1) <= BOUNDS[name], name
    # The issue's targets: int8 (embedding and tied head too, no float copy of the head) <= 0.52x.
    # The 4-bit GGUF: 0.625 bytes per projection weight and its Q8_0 table at 1.06: ~0.37x (not 0.3x).
    assert results["int8"][1] <= 0.52 * base_bytes and results["fp8"][1] <= 0.52 * base_bytes
    assert results["gguf"][1] <= 0.4 * base_bytes
    assert results["fp8 KV cache"][2] == 2 * base_blocks

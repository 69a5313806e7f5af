"""`--quantization gguf`: Q8_0, Q4_0 and Q4_1 blocks kept quantized (models/gguf_quant.py).

Blocks written by the `gguf` package's own quantizers decode to exactly what its dequantizer gives;
the embedded SmolLM2 loaded that way keeps its matrices as int8 codes with group scales and gives
the prompt logprobs of the default (dequantized float32) path.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from helpers.perplexity_text import TEXT
from helpers.smollm2 import smollm2_gguf_path
from xlaserve.models.gguf_quant import GGUF_SCHEME, decode_blocks, gguf_scheme
from xlaserve.models.quantization import QuantizedTensor


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_decode_to_the_gguf_packages_dequantization(kind):
    tensor_type = GGMLQuantizationType[kind]
    w = np.random.default_rng(0).normal(size=(24, 96)).astype(np.float32)  # [out, in]
    raw = quantize(w, tensor_type)
    kept = decode_blocks(raw, tensor_type, w.shape)
    assert kept.q.dtype == np.int8 and kept.scale.shape == (24, 3)
    assert (kept.zero is not None) == (kind == "Q4_1")
    np.testing.assert_array_equal(kept.dequantized(), dequantize(raw, tensor_type).reshape(w.shape))
    # As the loader places it ([in, out], blocks of 32 inputs): the same matrix.
    np.testing.assert_array_equal(kept.transposed().dequantized(), kept.dequantized().T)
    assert gguf_scheme({"w": kept}) == (GGUF_SCHEME, {"w": kept})


@pytest.mark.slow  # two SmolLM2 engines: ~40 s
def test_embedded_smollm2_kept_quantized_matches_its_dequantized_model():
    from xlaserve import LLM, SamplingParams
    from xlaserve.models.loader import load_checkpoint

    smollm2_gguf_path()
    checkpoint = load_checkpoint(None, progress=False, skip_tokenizer_init=True, quantization="gguf")
    kept = [n for n, t in checkpoint.tensors.items() if isinstance(t, QuantizedTensor)]
    assert len(kept) >= 30 * 7  # every projection of every layer
    del checkpoint
    logprobs, weight_bytes = {}, {}
    for quantization in (None, "gguf"):
        llm = LLM(
            dtype="float32",
            quantization=quantization,
            max_model_len=512,
            max_num_seqs=2,
            max_num_batched_tokens=512,
            kv_cache_memory=48 * 2**20,  # float32: 46 KiB per token
            enforce_eager=True,
        )
        ids = llm.tokenizer(TEXT)["input_ids"]
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        logprobs[quantization] = np.array([e[t].logprob for t, e in zip(ids[1:], out.prompt_logprobs[1:])])
        weight_bytes[quantization] = llm.engine_core.runner.weight_bytes
        del llm
    print(f"GGUF kept quantized: weights {weight_bytes['gguf'] / weight_bytes[None]:.2f}x of float32")
    np.testing.assert_allclose(logprobs["gguf"], logprobs[None], atol=2e-3)
    assert weight_bytes["gguf"] < 0.5 * weight_bytes[None]

"""`--quantization gguf`: Q8_0, Q4_0, Q4_1 and Q4_K blocks kept quantized (models/gguf_quant.py).

Blocks written by the `gguf` package's own quantizers (Q4_K: built by hand, as llama.cpp lays them
out), and real tensors of the embedded SmolLM2 Q4_1 GGUF, decode to exactly what its dequantizer
gives, also on the device path (4-bit codes packed two to a byte, float16 scales, unpacked and
dequantized by jax); a tiny Llama loaded from such blocks gives its dequantized model's logits; the
embedded SmolLM2 loaded that way gives the prompt logprobs of the default (dequantized float32) path."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K, dequantize, quantize
from test_quantization import hf_config_of, hf_tensors, prefill_logits, rel_err

from helpers.family_cases import make_hf_model
from helpers.perplexity_text import TEXT
from helpers.smollm2 import smollm2_gguf_path
from xlaserve.kernels.dtype_ops import dequantize as device_dequantize
from xlaserve.kernels.dtype_ops import unpack_int4
from xlaserve.models import gguf_quant
from xlaserve.models.gguf_quant import GGUF_SCHEME, GGUFBlocks, decode_blocks, gguf_scheme
from xlaserve.models.gguf_quant import dequantize as fast_dequantize
from xlaserve.models.quantization import QuantizedTensor, pack_int4, weight_bytes


def device_dequantized(kept: QuantizedTensor) -> np.ndarray:
    """The weight as the jitted step computes it ([out, in] float32): in our [in, out] layout, 4-bit
    codes packed two to a byte on the host and unpacked on the device, scales in the scheme's dtype."""
    scheme, _ = gguf_scheme({"w": kept})
    t = kept.transposed()
    codes = unpack_int4(jnp.asarray(pack_int4(t.q))) if kept.bits == 4 else jnp.asarray(t.q)
    scale = jnp.asarray(t.scale, scheme.scale_dtype)
    zero = None if t.zero is None else jnp.asarray(t.zero, scheme.scale_dtype)
    return np.asarray(device_dequantize(codes, scale, jnp.float32, zero, scheme.block)).T


def assert_read_lazily_alike(tmp_path, raw: np.ndarray, tensor_type, kept: QuantizedTensor) -> None:
    """The loader's `GGUFBlocks` over the same bytes in a file (at an offset) decodes to `kept` when
    read, with its bits, block and scheme known before."""
    path = tmp_path / "blocks.bin"
    path.write_bytes(b"header!" + raw.tobytes())
    lazy = GGUFBlocks(str(path), 7, tensor_type, kept.q.shape)
    assert (lazy.bits, lazy.block) == (kept.bits, kept.block)
    reads = []  # the bytes each read of the file copied

    def counted(read):
        def counting(*args):
            out = read(*args)
            reads.append(out.nbytes)
            return out

        return counting

    with (
        mock.patch.object(gguf_quant, "read_tensor_data", counted(gguf_quant.read_tensor_data)),
        mock.patch.object(gguf_quant, "read_block_fields", counted(gguf_quant.read_block_fields)),
    ):
        assert gguf_scheme({"w": lazy})[0] == gguf_scheme({"w": kept})[0]
        read = lazy.read()
    # The blocks are read once, by the load's read; the scheme's scale check reads their scale bytes only.
    assert len(reads) == 2 and reads[1] == raw.nbytes and reads[0] <= raw.nbytes // 4, reads
    for field in ("q", "scale", "zero"):
        np.testing.assert_array_equal(getattr(read, field), getattr(kept, field), err_msg=field)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_decode_to_the_gguf_packages_dequantization(kind, tmp_path):
    tensor_type = GGMLQuantizationType[kind]
    w = np.random.default_rng(0).normal(size=(24, 96)).astype(np.float32)  # [out, in]
    raw = quantize(w, tensor_type)
    kept = decode_blocks(raw, tensor_type, w.shape)
    assert kept.q.dtype == np.int8 and kept.scale.shape == (24, 3)
    assert (kept.zero is not None) == (kind != "Q8_0") and kept.bits == (8 if kind == "Q8_0" else 4)
    want = dequantize(raw, tensor_type).reshape(w.shape)
    np.testing.assert_array_equal(kept.dequantized(), want)
    np.testing.assert_array_equal(device_dequantized(kept), want)  # packed, float16 scales: bit-exact
    # As the loader places it ([in, out], blocks of 32 inputs): the same matrix.
    np.testing.assert_array_equal(kept.transposed().dequantized(), kept.dequantized().T)
    assert gguf_scheme({"w": kept}) == (replace(GGUF_SCHEME, scale_dtype=jnp.dtype(jnp.float16)), {"w": kept})
    assert_read_lazily_alike(tmp_path, raw, tensor_type, kept)
    # The loader's own dequantization (models/gguf_quant.dequantize): gguf's bits, every one.
    fast = fast_dequantize(raw, tensor_type)
    assert fast.dtype == np.float32 and fast.shape == (w.size,)
    np.testing.assert_array_equal(fast.view(np.uint32), want.reshape(-1).view(np.uint32))


def test_embedded_smollm2_q4_1_and_q8_0_tensors_are_bit_exact_packed():
    """Real tensors of the embedded SmolLM2 Q4_1 GGUF: the packed device path gives gguf's numbers."""
    reader = GGUFReader(smollm2_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.7.attn_k.weight", "token_embd.weight"):
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        kept = decode_blocks(t.data, t.tensor_type, shape)
        assert kept.bits == (8 if t.tensor_type == GGMLQuantizationType.Q8_0 else 4), name
        want = dequantize(t.data, t.tensor_type).reshape(shape)
        np.testing.assert_array_equal(device_dequantized(kept), want, err_msg=name)


def q4_k_blocks(num_blocks: int, seed: int = 0) -> np.ndarray:
    """Hand-built Q4_K super-blocks (the gguf package quantizes to Q4_K only in C): random float16 d
    and dmin, 6-bit scales and minimums packed as llama.cpp lays them out, random 4-bit codes."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(1e-3, 2e-2, num_blocks).astype(np.float16)
    dmin = rng.uniform(1e-3, 2e-2, num_blocks).astype(np.float16)
    sc, mn = rng.integers(0, 64, (2, num_blocks, 8)).astype(np.uint8)
    packed = np.zeros((num_blocks, 12), np.uint8)
    # Bytes 0-3: low 6 bits of sc[0:4], top 2 bits of sc[4:8]; 4-7: the same for mn; 8-11: the
    # low 4 bits of sc[4:8] (low nibble) and mn[4:8] (high nibble).
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    codes = rng.integers(0, 256, (num_blocks, 128)).astype(np.uint8)
    return np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, codes], axis=1
    )


def test_q4_k_blocks_fold_into_group_scales_bit_exactly(tmp_path):
    raw = q4_k_blocks(12)  # [8, 384]: 12 super-blocks of 256
    sc, mn = Q4_K.get_scale_min(raw[:, 4:16])
    assert sc.max() > 31 and mn.max() > 31  # the 6-bit values' top bits are exercised
    kept = decode_blocks(raw, GGMLQuantizationType.Q4_K, (8, 384))
    assert kept.bits == 4 and kept.scale.shape == (8, 12) and kept.q.max() <= 15
    want = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(8, 384)
    np.testing.assert_array_equal(kept.dequantized(), want)
    np.testing.assert_array_equal(device_dequantized(kept), want)
    assert gguf_scheme({"w": kept})[0] == GGUF_SCHEME  # folded products: float32 scales
    assert_read_lazily_alike(tmp_path, raw, GGMLQuantizationType.Q4_K, kept)


def q6_k_blocks(num_blocks: int, seed: int = 0) -> np.ndarray:
    """Hand-built Q6_K super-blocks: random low and high bits, int8 scales, a small float16 d."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 256, (num_blocks, 208)).astype(np.uint8)  # ql, qh, int8 scales
    d = rng.uniform(1e-4, 1e-3, num_blocks).astype(np.float16)
    return np.concatenate([bits, d.view(np.uint8).reshape(-1, 2)], axis=1)


def test_q6_k_blocks_decode_bit_exactly_with_scales_per_16(tmp_path):
    raw = q6_k_blocks(12)
    kept = decode_blocks(raw, GGMLQuantizationType.Q6_K, (8, 384))
    assert kept.bits == 8 and kept.block == (1, 16) and kept.scale.shape == (8, 24) and kept.zero is None
    assert kept.q.min() == -32 and kept.q.max() == 31
    want = dequantize(raw, GGMLQuantizationType.Q6_K).reshape(8, 384)
    np.testing.assert_array_equal(kept.dequantized(), want)
    t = kept.transposed()  # as the step dequantizes it: blocks of 16 inputs
    got = device_dequantize(jnp.asarray(t.q), jnp.asarray(t.scale), jnp.float32, None, (16, 1))
    np.testing.assert_array_equal(np.asarray(got).T, want)
    assert_read_lazily_alike(tmp_path, raw, GGMLQuantizationType.Q6_K, kept)


def test_tiny_llama_with_k_quant_blocks_kept_gives_its_dequantized_models_logits():
    """Q4_K projections (packed, float32 folded scales per 32) and Q6_K ones (int8 codes, scales per
    16: a block of its own in the same model), hand-built blocks: the dequantized model's logits."""
    model = make_hf_model("LlamaForCausalLM", hidden_size=256, intermediate_size=256, head_dim=64)
    hf_config, tensors = hf_config_of(model), hf_tensors(model)
    kept, dense = {}, {}
    for i, (name, w) in enumerate(tensors.items()):
        kind = GGMLQuantizationType.Q6_K if "v_proj" in name or "down" in name else GGMLQuantizationType.Q4_K
        if w.ndim == 2 and "proj" in name:
            raw = (q6_k_blocks if kind == GGMLQuantizationType.Q6_K else q4_k_blocks)(w.size // 256, seed=i)
            kept[name] = decode_blocks(raw, kind, w.shape)
            dense[name] = dequantize(raw, kind).reshape(w.shape)
        else:
            kept[name] = dense[name] = w
    scheme, kept = gguf_scheme(kept)
    assert scheme == GGUF_SCHEME  # float32 scales: the folded products are not float16s
    got, params = prefill_logits(hf_config, kept, scheme)
    want, _ = prefill_logits(hf_config, dense, None)
    assert rel_err(got, want) <= 1e-5
    flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(params)}
    assert flat["layers/self_attn/q_proj/kernel"].shape == (3, 128, 256)  # packed Q4_K
    assert flat["layers/self_attn/v_proj/kernel"].dtype == jnp.int8  # Q6_K codes
    assert flat["layers/self_attn/v_proj/kernel_scale"].shape == (3, 16, 128)  # per 16 inputs


def test_tiny_llama_with_gguf_blocks_kept_packed_gives_its_dequantized_models_logits():
    """Projections as Q4_1 and Q4_0 blocks and the tied embedding as Q8_0, written by the gguf
    package: packed 4-bit kernels, float16 group scales, the table kept as [D, V] int8 (no float copy),
    and the logits of the model loaded from the same blocks dequantized (1e-5)."""
    model = make_hf_model(
        "LlamaForCausalLM", hidden_size=64, intermediate_size=64, head_dim=16, tie_word_embeddings=True
    )
    hf_config, tensors = hf_config_of(model), hf_tensors(model)
    kept, dense = {}, {}
    for name, w in tensors.items():
        kind = "Q8_0" if "embed" in name else "Q4_0" if "o_proj" in name or "down" in name else "Q4_1"
        if w.ndim == 2 and name != "lm_head.weight":
            raw = quantize(w, GGMLQuantizationType[kind])
            kept[name] = decode_blocks(raw, GGMLQuantizationType[kind], w.shape)
            dense[name] = dequantize(raw, GGMLQuantizationType[kind]).reshape(w.shape)
        else:
            kept[name] = dense[name] = w
    scheme, kept = gguf_scheme(kept)
    got, params = prefill_logits(hf_config, kept, scheme)
    want, float_params = prefill_logits(hf_config, dense, None)
    assert rel_err(got, want) <= 1e-5
    flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(params)}
    assert flat["layers/self_attn/q_proj/kernel"].dtype == jnp.uint8
    assert flat["layers/self_attn/q_proj/kernel"].shape == (3, 32, 64)  # [layers, in / 2, out]
    assert flat["layers/self_attn/q_proj/kernel_scale"].dtype == jnp.float16
    assert flat["embed_tokens/kernel"].dtype == jnp.int8 and flat["embed_tokens/kernel"].shape == (64, 101)
    assert "embed_tokens/weight" not in flat and "lm_head/kernel" not in flat
    ratio = weight_bytes(params) / weight_bytes(float_params)
    print(f"tiny Llama, GGUF blocks kept: {ratio:.3f}x of float32")
    assert ratio < 0.2


@pytest.mark.slow  # two SmolLM2 engines: ~40 s
def test_embedded_smollm2_kept_quantized_matches_its_dequantized_model():
    from xlaserve import LLM, SamplingParams
    from xlaserve.models.loader import load_checkpoint

    smollm2_gguf_path()
    checkpoint = load_checkpoint(None, progress=False, skip_tokenizer_init=True, quantization="gguf")
    kept = [n for n, t in checkpoint.tensors.items() if isinstance(t, GGUFBlocks)]  # decoded when placed
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
            optimization_level=2,  # SmolLM2's steps dominate: XLA's default level (tests/conftest.py)
        )
        ids = llm.tokenizer(TEXT)["input_ids"]
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        logprobs[quantization] = np.array([e[t].logprob for t, e in zip(ids[1:], out.prompt_logprobs[1:])])
        weight_bytes[quantization] = llm.engine_core.runner.weight_bytes
        del llm
    print(f"GGUF kept quantized: weights {weight_bytes['gguf'] / weight_bytes[None]:.2f}x of float32")
    np.testing.assert_allclose(logprobs["gguf"], logprobs[None], atol=2e-3)
    assert weight_bytes["gguf"] < 0.5 * weight_bytes[None]

"""gpt-oss beyond the family's float32 parity (tests/models/test_moe_families.py): its released MXFP4
experts, and batch invariance in bfloat16 through the sinks and the biased experts.

- MXFP4 decoding (models/mxfp4.py) gives Hugging Face's own decoded values, exactly.
- A checkpoint whose experts are stored as MXFP4 blocks and scales (config.json's
  `quantization_config`, as the releases ship) serves the greedy tokens and prompt logprobs of the HF
  model holding the decoded weights.
- bfloat16: a request's tokens and logprobs alone equal, bit for bit, those among companions.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from helpers.family_cases import (
    assert_greedy_and_prompt_logprobs_match,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prompts,
    randomize_weights,
    save_hf_model,
)
from xlaserve import LLM, SamplingParams
from xlaserve.models.mxfp4 import FP4_VALUES, decode_mxfp4

VOCAB = 256
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def make_hf_model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**CONFIG, attn_implementation="eager")
    return randomize_weights(transformers.GptOssForCausalLM(config).eval())


def test_mxfp4_decodes_as_hugging_face():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)  # [E, out, G, 16]: 128 inputs
    scales = rng.integers(120, 135, (3, 40, 4), dtype=np.uint8)
    ours = decode_mxfp4(blocks, scales)
    assert ours.shape == (3, 128, 40)  # [E, in, out], HF's unquantized layout
    theirs = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32)
    np.testing.assert_array_equal(ours.astype(np.float32), theirs.numpy())
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        decode_mxfp4(blocks, scales[..., :3])


def encode_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, in, out] float -> (blocks [E, out, in / 32, 16], scales [E, out, in / 32]): each 32 inputs
    of an output channel share the power of two that brings their largest magnitude within 6."""
    rows = np.swapaxes(weight, 1, 2).astype(np.float64)  # [E, out, in]
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1), 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)  # [E, out, G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # Contiguous: safetensors' numpy writer stores a strided array's buffer as it lies in memory.
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)


def test_an_mxfp4_checkpoint_serves_its_decoded_experts(tmp_path):
    """The experts stored as a release stores them; the reference is the HF model loaded from the
    same checkpoint with HF's own decoding of those bytes, so both sides read the same 4-bit weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory = save_hf_model(make_hf_model(seed=3), tmp_path / "mxfp4")
    reference = save_hf_model(make_hf_model(seed=3), tmp_path / "decoded")
    tensors = load_file(f"{directory}/model.safetensors")
    decoded = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = encode_mxfp4(tensors.pop(name))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        decoded[name] = convert_moe_packed_tensors(
            torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32
        ).numpy()
        assert not np.array_equal(decoded[name], load_file(f"{reference}/model.safetensors")[name])
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    save_file(decoded, f"{reference}/model.safetensors", metadata={"format": "pt"})
    config = json.load(open(f"{directory}/config.json"))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn"]}
    json.dump(config, open(f"{directory}/config.json", "w"))
    hf = transformers.GptOssForCausalLM.from_pretrained(reference, attn_implementation="eager").eval()

    llm = LLM(
        directory,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=8,
        kv_cache_memory=2**20,
    )
    assert_greedy_and_prompt_logprobs_match(llm, hf, prompts(VOCAB, seed=5)[:2])


def test_bfloat16_tokens_and_logprobs_are_the_same_bits_alone_and_among_companions(tmp_path):
    """Batch invariance at the dtype users run, through the sinks (the CPU attention op's softmax),
    the sliding layer and the biased experts: a request alone, then among 1 and 6 companions (other
    token and request buckets, its prompt cut into other chunks)."""
    llm = LLM(
        save_hf_model(make_hf_model(seed=4), tmp_path),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        block_size=8,
        kv_cache_memory=2**20,
    )
    rng = np.random.default_rng(7)
    batch = [rng.integers(3, VOCAB, n).tolist() for n in (21, 6, 40, 13, 27, 9, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)

    def numbers(requests: list[list[int]]):
        outs = llm.generate([{"prompt_token_ids": p} for p in requests], params, use_tqdm=False)
        return [
            (
                o.outputs[0].token_ids,
                [sorted((i, lp.logprob) for i, lp in e.items()) for e in o.outputs[0].logprobs],
            )
            for o in outs
        ]

    alone = numbers(batch[:1])[0]
    assert numbers(batch[:2])[0] == alone
    assert numbers(batch[1:4] + batch[:1] + batch[4:])[3] == alone

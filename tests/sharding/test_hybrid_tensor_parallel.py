"""Tensor parallelism over Gated DeltaNet (Qwen3.5, Qwen3-Next) on fake CPU devices: the linear
attention's key heads (each with its value heads), its conv channels and its recurrent state split
over the ranks, against one device. The engines run in the session's fake-mesh worker
(helpers/tp_run.py); the Hugging Face parity of the one-device engine is tests/models/test_qwen3_5.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from helpers.family_cases import randomize_weights, save_hf_model

VOCAB = 97
# Four key heads (two value heads each), so TP 4 gives each rank one key head; 8 query heads over 2
# KV heads (repeated under TP 4). The layers alternate linear attention and full attention.
QWEN3_5 = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention"] * 2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,  # the Pallas attention kernel's smallest
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
QWEN3_NEXT = dict(
    QWEN3_5,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    norm_topk_prob=True,
)
# Prompts of 40 and 70 tokens prefill in chunks (the worker's engines take 32 tokens a step): the
# recurrent state and the conv inputs cross the chunks, sharded.
PROMPT_LENGTHS = (5, 40, 19, 70)
GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


def _save(tmp_path_factory, name: str, config_class: str, architecture: str, config: dict) -> str:
    hf_config = getattr(transformers, config_class)(**config)
    hf_config.architectures = [architecture]
    torch.manual_seed(3)
    model = randomize_weights(getattr(transformers, architecture)(hf_config).eval(), norm_center=0.0)
    return save_hf_model(model, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    return _save(tmp_path_factory, "tp_qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5)


@pytest.fixture(scope="module")
def tiny_qwen3_next(tmp_path_factory):
    return _save(tmp_path_factory, "tp_qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", QWEN3_NEXT)


def _generate(tp_worker, model_dir: str, layouts: list[dict]) -> list[dict]:
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    return tp_worker.run(
        "generate_ids", model_dir, {"layouts": layouts, "prompts": prompts, "params": [GREEDY]}
    )


def _assert_same_as_one_device(results: list[dict]) -> None:
    base = results[0]["runs"][0]
    for result in results[1:]:
        run = result["runs"][0]
        assert run["tokens"] == base["tokens"], result["layout"]
        for ours, theirs in zip(run["logprobs"], base["logprobs"], strict=True):
            for a, b in zip(ours, theirs, strict=True):
                assert [i for i, _ in a] == [i for i, _ in b], result["layout"]
                np.testing.assert_allclose([v for _, v in a], [v for _, v in b], atol=2e-5)


def test_deltanet_heads_split_over_the_mesh_match_one_device(tp_worker, tiny_qwen3_5):
    # The reference path split by XLA (GSPMD), and the Pallas kernels (attention, the delta rule's
    # chunk terms: interpreted here) run per device on its heads under shard_map (sharding/attention.py).
    layouts = [{}, {"tensor_parallel_size": 4}, {"tensor_parallel_size": 2, "attention_backend": "pallas"}]
    _assert_same_as_one_device(_generate(tp_worker, tiny_qwen3_5, layouts))


def test_deltanet_split_by_key_head_and_no_weight_gathered(tp_worker, tiny_qwen3_5):
    shards = tp_worker.run("param_shards", tiny_qwen3_5, {"tensor_parallel_size": 4})
    key_dim, value_dim, d = 4 * 8, 8 * 8, 32
    conv_dim = 2 * key_dim + value_dim
    # Stacked [periods, ...]: each rank holds a quarter of every head-shaped axis, and its state.
    expected = {
        "linear_layers_0/linear_attn/in_proj_qkv/kernel": [[2, d, conv_dim], [2, d, conv_dim // 4]],
        "linear_layers_0/linear_attn/in_proj_z/kernel": [[2, d, value_dim], [2, d, value_dim // 4]],
        "linear_layers_0/linear_attn/in_proj_b/kernel": [[2, d, 8], [2, d, 2]],
        "linear_layers_0/linear_attn/conv1d/weight": [[2, conv_dim, 1, 4], [2, conv_dim // 4, 1, 4]],
        "linear_layers_0/linear_attn/A_log": [[2, 8], [2, 2]],
        "linear_layers_0/linear_attn/out_proj/kernel": [[2, value_dim, d], [2, value_dim // 4, d]],
    }
    assert {name: shards[name] for name in expected} == expected
    ops = tp_worker.run("hlo", tiny_qwen3_5, {"tensor_parallel_size": 4})
    kinds = [op for _, op in ops]
    # The embedding's, then per period (one scanned body): the linear attention's out_proj, the
    # attention's o_proj, and each layer's MLP down projection. Nothing is gathered.
    assert kinds.count("all-reduce") == 5 and "all-gather" not in kinds, ops


def test_qwen3_next_deltanet_and_experts_split_match_one_device(tp_worker, tiny_qwen3_next):
    layouts = [{}, {"tensor_parallel_size": 2}]
    _assert_same_as_one_device(_generate(tp_worker, tiny_qwen3_next, layouts))


def test_indivisible_key_heads_and_mamba_mixers_are_clear_errors(tp_worker, tiny_qwen3_5, tmp_path):
    # 8 query heads, 2 KV heads and the MLP split 8 ways; the 4 key heads do not.
    message = tp_worker.run("error", tiny_qwen3_5, {"tensor_parallel_size": 8})
    assert "tensor_parallel_size=8" in message and "linear_num_key_heads=4" in message
    config = transformers.Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_heads=8,
        head_dim=8,
        state_size=8,
        n_groups=1,
        num_hidden_layers=2,
    )
    config.architectures = ["Mamba2ForCausalLM"]
    mamba = save_hf_model(transformers.Mamba2ForCausalLM(config).eval(), tmp_path / "mamba2")
    message = tp_worker.run("error", mamba, {"tensor_parallel_size": 2})
    assert "tensor_parallel_size=2" in message and "Mamba2ForCausalLM" in message and "B and C" in message

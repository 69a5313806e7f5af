"""Tensor parallelism over recurrent mixers on fake CPU devices, against one device: Gated DeltaNet
(Qwen3.5: key heads, each with its value heads) and Mamba2 (Falcon-H1: groups of heads with their B
and C, copied when there are more ranks than groups), their conv channels and recurrent state split
over the ranks. The engines run in the session's fake-mesh worker (helpers/tp_run.py); the Hugging
Face parity of the one-device engines (Qwen3-Next's and Granite 4.0-H's regrouped projections
included) is tests/models/test_qwen3_5.py and test_mamba2.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from helpers.family_cases import FALCON_H1_TEXT, HYBRID_VOCAB, QWEN3_5_TEXT, randomize_weights, save_hf_model

VOCAB = HYBRID_VOCAB
# Four key heads (two value heads each), so TP 4 gives each rank one key head; 8 query heads over 2
# KV heads (repeated under TP 4). The layers alternate linear attention and full attention.
QWEN3_5 = dict(
    QWEN3_5_TEXT,
    num_attention_heads=8,
    head_dim=16,  # the Pallas attention kernel's smallest
    linear_num_key_heads=4,
    linear_num_value_heads=8,
)
# Falcon-H1: attention and Mamba2 side by side in every layer, muP multipliers on in_proj's five
# parts (regrouped with them), 2 groups: under TP 4 each is copied once (4 groups of 2 heads).
FALCON_H1 = dict(
    FALCON_H1_TEXT,
    head_dim=16,
    mamba_d_ssm=64,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_rms_norm=True,  # the gated norm over the checkpoint's groups: each spans two ranks
    mamba_norm_before_gate=True,
)
# Prompts of 40 and 70 tokens prefill in chunks (the worker's engines take 32 tokens a step): the
# recurrent state and the conv inputs cross the chunks, sharded.
PROMPT_LENGTHS = (5, 40, 19, 70)
GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


def _save(
    tmp_path_factory, name: str, config_class: str, architecture: str, config: dict, seed: int = 3
) -> str:
    hf_config = getattr(transformers, config_class)(**config)
    hf_config.architectures = [architecture]
    torch.manual_seed(seed)
    norm_center = 0.0 if architecture.startswith("Qwen") else 1.0  # Qwen3.5's norms scale by 1 + w
    model = randomize_weights(getattr(transformers, architecture)(hf_config).eval(), norm_center=norm_center)
    return save_hf_model(model, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    return _save(tmp_path_factory, "tp_qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5)


def _generate(tp_worker, model_dir: str, layouts: list[dict], num_runs: int = 1) -> list[dict]:
    """Each layout's engine generates the prompts `num_runs` times: the runs after the first hit the
    prefix cache (snapshots of the sharded state, copied into the requests' slots on every rank)."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    return tp_worker.run(
        "generate_ids", model_dir, {"layouts": layouts, "prompts": prompts, "params": [GREEDY] * num_runs}
    )


def _assert_same_as_one_device(results: list[dict]) -> None:
    """Every run of every layout gives the one-device engine's first run."""
    base = results[0]["runs"][0]
    for result in results:
        for run in result["runs"]:
            assert run["tokens"] == base["tokens"], result["layout"]
            for ours, theirs in zip(run["logprobs"], base["logprobs"], strict=True):
                for a, b in zip(ours, theirs, strict=True):
                    assert [i for i, _ in a] == [i for i, _ in b], result["layout"]
                    np.testing.assert_allclose([v for _, v in a], [v for _, v in b], atol=2e-5)


def test_deltanet_heads_split_over_the_mesh_match_one_device(tp_worker, tiny_qwen3_5):
    # One key head a rank, under the Pallas kernels (attention, the delta rule's chunk terms:
    # interpreted here), which run per device on its heads under shard_map (sharding/attention.py).
    # The reference path split by XLA itself: the next test's compiled program.
    # Twice each: the second run's prompts hit the snapshots the first left at their last boundaries.
    layouts = [{}, {"tensor_parallel_size": 4, "attention_backend": "pallas"}]
    results = _generate(tp_worker, tiny_qwen3_5, layouts, num_runs=2)
    _assert_same_as_one_device(results)
    assert [r["runs"][1]["num_cached_tokens"] for r in results] == [[0, 32, 16, 64]] * 2


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


def test_mamba2_groups_copied_and_split_match_one_device(tp_worker, tmp_path_factory):
    # Falcon-H1's 2 groups over 4 ranks (each copied once), its multipliers regrouped with in_proj, the
    # attention beside it, under the Pallas kernels (attention, the SSD's chunk terms) per device.
    falcon = _save(tmp_path_factory, "tp_falcon_h1", "FalconH1Config", "FalconH1ForCausalLM", FALCON_H1)
    layouts = [{}, {"tensor_parallel_size": 4, "attention_backend": "pallas"}]
    _assert_same_as_one_device(_generate(tp_worker, falcon, layouts))
    shards = tp_worker.run("param_shards", falcon, {"tensor_parallel_size": 4})
    # in_proj: per group z (16), x (16), B (8), C (8), dt (2); 4 groups (2 copied twice) -> 200, 50 a rank.
    mamba = "parallel_layers_0/mamba"
    assert shards[f"{mamba}/in_proj/kernel"] == [[2, 32, 200], [2, 32, 50]]
    assert shards[f"{mamba}/conv1d/weight"] == [[2, 128, 1, 4], [2, 32, 1, 4]]  # per group x, B, C
    # A trainer's checkpoint-shaped in_proj and conv (no copies) taken by update_weights, regrouped and
    # copied as a load would: the tokens of a fresh engine on it.
    other = _save(
        tmp_path_factory, "tp_falcon_h1_b", "FalconH1Config", "FalconH1ForCausalLM", FALCON_H1, seed=4
    )
    layout = {"tensor_parallel_size": 4}
    out = tp_worker.run(
        "update_weights", falcon, {"other_dir": other, "layout": layout, "prompts": [[5, 17, 33, 60]]}
    )
    assert out["after"] == out["fresh"] and out["after"] != out["before"]


def test_indivisible_heads_groups_and_mamba_v1_are_clear_errors(tp_worker, tiny_qwen3_5, tmp_path):
    # 8 query heads, 2 KV heads and the MLP split 8 ways; the 4 key heads do not.
    message = tp_worker.run("error", tiny_qwen3_5, {"tensor_parallel_size": 8})
    assert "tensor_parallel_size=8" in message and "linear_num_key_heads=4" in message
    config = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, tie_word_embeddings=True
    )
    config.architectures = ["MambaForCausalLM"]
    mamba = save_hf_model(transformers.MambaForCausalLM(config).eval(), tmp_path / "mamba")
    message = tp_worker.run("error", mamba, {"tensor_parallel_size": 2})
    assert "tensor_parallel_size=2" in message and "MambaForCausalLM" in message and "x_proj" in message

"""Tensor and data parallelism on 8 fake CPU devices (the cases run in the session's worker process,
helpers/tp_run.py, since the device count is fixed when jax starts): the same greedy tokens and logits
as one device. The two-process cases (jax.distributed, 4 devices each) are in test_multihost.py."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.tiny_models import save_tiny_llama


def assert_same_as_first(results):
    base = results[0]
    for r in results[1:]:
        assert r["tokens"] == base["tokens"], r["layout"]
        np.testing.assert_allclose(r["logprobs"], base["logprobs"], atol=1e-5, err_msg=str(r["layout"]))


def test_tensor_and_data_parallel_match_one_device(tp_worker, tiny_llama_2kv):
    # Each layout is an engine compiling its own programs (a data-parallel one, per rank). TP 4 repeats
    # the 2 KV heads; TP 2 x DP 2 is tensor parallelism inside each data-parallel rank. Plain TP 2 (one
    # KV head a device) is test_sharding_rules.py's odd-vocabulary case (a Llama of 2 KV heads, logprobs
    # within 1e-5), plain DP 2 test_data_parallel.py's two ranks (the same ids as one), TP 8 (each KV
    # head on 4 devices) test_multihost.py's two processes of 4 devices (the same text as one device).
    layouts = [
        {},
        {"tensor_parallel_size": 4},
        {"tensor_parallel_size": 2, "data_parallel_size": 2},
    ]
    assert_same_as_first(tp_worker.run("generate", tiny_llama_2kv, layouts))


def test_tensor_parallel_step_all_reduces_and_gathers_no_weight(tp_worker, tiny_llama_2kv):
    ops = tp_worker.run("hlo", tiny_llama_2kv, {"tensor_parallel_size": 4})
    kinds = [op for _, op in ops]
    # Per layer (one scanned body): after the attention output and the MLP down projection;
    # plus one for the vocabulary-parallel embedding lookup.
    assert kinds.count("all-reduce") == 3, ops
    # No weight is ever gathered whole (the largest all-gather allowed is activation-sized).
    assert "all-gather" not in kinds, ops


@pytest.fixture(scope="module")
def tiny_llama_hd16(tmp_path_factory):
    # head_dim 16: the kernels take power-of-two head sizes >= 16.
    return save_tiny_llama(
        str(tmp_path_factory.mktemp("tiny_llama_hd16")), num_key_value_heads=2, head_dim=16
    )


def test_pallas_kernel_under_tensor_parallelism_matches_one_device(tp_worker, tiny_llama_hd16):
    # The kernel runs per device on its KV heads (sharding/attention.py); TP 4 repeats the 2 KV heads.
    layouts = [
        {},
        {"tensor_parallel_size": 2, "attention_backend": "pallas"},
        {"tensor_parallel_size": 4, "attention_backend": "pallas"},
    ]
    assert_same_as_first(tp_worker.run("generate", tiny_llama_hd16, layouts))


def test_kernel_custom_call_sees_only_its_devices_heads(tp_worker):
    # Lowered for CUDA on a TP-4 mesh: without the shard_map the Triton call takes the whole cache
    # (XLA would gather it onto every device); with it, a quarter of the heads and of the cache.
    calls = tp_worker.run("kernel_operands", "", 4)
    assert calls["plain"] == [["32x16x64", "80x4x64", "80x4x64", "32x16x64"]]  # q, k, v, out
    assert calls["sharded"] == [["32x4x64", "80x1x64", "80x1x64", "32x4x64"]]


def test_indivisible_tensor_parallel_size_is_a_clear_error(tp_worker, tiny_llama_2kv):
    message = tp_worker.run("error", tiny_llama_2kv, {"tensor_parallel_size": 3})
    assert "tensor_parallel_size=3" in message and "num_attention_heads=8" in message


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from helpers.tiny_models import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3")), "Qwen3", head_dim=16)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    from helpers.tiny_models import save_tiny_model

    return save_tiny_model(
        str(tmp_path_factory.mktemp("tiny_qwen3_moe")),
        "Qwen3Moe",
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )


def test_qwen3_tensor_parallel_matches_one_device(tp_worker, tiny_qwen3):
    layouts = [{}, {"tensor_parallel_size": 2}, {"tensor_parallel_size": 4}]
    assert_same_as_first(tp_worker.run("generate", tiny_qwen3, layouts))


def test_moe_expert_parallel_matches_one_device(tp_worker, tiny_qwen3_moe):
    layouts = [
        {},
        {"tensor_parallel_size": 4, "enable_expert_parallel": True},
        {"tensor_parallel_size": 2},  # experts' MLPs split instead
    ]
    assert_same_as_first(tp_worker.run("generate", tiny_qwen3_moe, layouts))


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    from helpers.tiny_models import save_tiny_model, small_byte_tokenizer

    return save_tiny_model(
        str(tmp_path_factory.mktemp("tiny_gpt_oss")),
        "GptOss",
        tokenizer=small_byte_tokenizer(),
        head_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
    )


def test_gpt_oss_sinks_and_biased_experts_under_tensor_parallelism(tp_worker, tiny_gpt_oss):
    # The sinks split like the query heads (into the attention's shard_map with them: 2 heads a rank),
    # whole experts to ranks with their biases. (Without expert parallelism each expert's MLP and its
    # biases split instead: qwen3_moe's TP 2 case above runs that path, bias aside.)
    layouts = [{}, {"tensor_parallel_size": 4, "enable_expert_parallel": True}]
    assert_same_as_first(tp_worker.run("generate", tiny_gpt_oss, layouts))


def test_minimax_m2_norms_over_all_heads_under_tensor_parallelism(tp_worker, tmp_path_factory):
    """q and k normed over every head at once: TP 4 splits the heads (1 query head a rank, the norm's
    mean summed across ranks) and repeats the 2 KV heads, k_norm's weights with them, as a load does
    and as `update_weights` does: a checkpoint-shaped update gives a fresh TP-4 engine's tokens."""
    from helpers.tiny_models import save_tiny_model, small_byte_tokenizer

    def save(name: str, seed: int) -> str:
        return save_tiny_model(
            str(tmp_path_factory.mktemp(name)),
            "MiniMaxM2",
            seed=seed,
            tokenizer=small_byte_tokenizer(),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rotary_dim=8,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
        )

    model = save("tiny_minimax_m2", seed=0)
    assert_same_as_first(tp_worker.run("generate", model, [{}, {"tensor_parallel_size": 4}]))
    other = save("tiny_minimax_m2_b", seed=1)
    layout = {"tensor_parallel_size": 4}
    out = tp_worker.run(
        "update_weights", model, {"other_dir": other, "layout": layout, "prompts": [[5, 17, 33]]}
    )
    assert out["after"] == out["fresh"] and out["after"] != out["before"]
    assert out["compiles"] == 0


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    from helpers.tiny_models import TINY_DEEPSEEK_V3, save_tiny_model

    return save_tiny_model(
        str(tmp_path_factory.mktemp("tiny_deepseek")),
        "DeepseekV3",
        **{**TINY_DEEPSEEK_V3, "num_hidden_layers": 3, "n_routed_experts": 8, "n_group": 4, "topk_group": 2},
        n_shared_experts=1,
        routed_scaling_factor=2.5,
    )


def test_deepseek_mla_tensor_parallel_matches_one_device(tp_worker, tiny_deepseek):
    # With `pallas`, the MLA kernel runs per device on its heads over the replicated latent cache.
    # TP 4 (one head a device) without the kernel, TP 2 with it.
    layouts = [
        {},
        {"tensor_parallel_size": 4},
        {"tensor_parallel_size": 2, "attention_backend": "pallas"},
    ]
    assert_same_as_first(tp_worker.run("generate", tiny_deepseek, layouts))


def test_deepseek_mla_splits_heads_and_replicates_latents(tp_worker, tiny_deepseek):
    # TP 4 over 4 heads: the up-projections out of the latents (q_b_proj: 4 x (16 + 16) columns,
    # kv_b_proj: 4 x (16 + 12)) and o_proj keep one head per device; the down-projections into the
    # shared latents (32 + 16) stay whole.
    shards = tp_worker.run("param_shards", tiny_deepseek, {"tensor_parallel_size": 4})
    for stack, layers in (("dense_layers", 1), ("moe_layers", 2)):
        attn = f"{stack}/self_attn"
        assert shards[f"{attn}/q_b_proj/kernel"] == [[layers, 32, 128], [layers, 32, 32]]
        assert shards[f"{attn}/kv_b_proj/kernel"] == [[layers, 32, 112], [layers, 32, 28]]
        assert shards[f"{attn}/o_proj/kernel"] == [[layers, 48, 64], [layers, 12, 64]]
        assert shards[f"{attn}/q_a_proj/kernel"] == [[layers, 64, 32]] * 2
        assert shards[f"{attn}/kv_a_proj_with_mqa/kernel"] == [[layers, 64, 48]] * 2


def test_update_weights_under_tensor_parallelism(tp_worker, tiny_llama_257, tmp_path):
    """TP 4 over 2 KV heads and a 257-token vocabulary: the update repeats the KV heads and pads the
    vocabulary as the load does, into the same shards: the greedy ids of a fresh TP-4 engine on the new
    checkpoint, and nothing compiled."""
    other = save_tiny_llama(str(tmp_path / "other"), seed=1, vocab_size=257, num_key_value_heads=2)
    out = tp_worker.run(
        "update_weights", tiny_llama_257, {"other_dir": other, "layout": {"tensor_parallel_size": 4}}
    )
    assert out["after"] == out["fresh"] and out["after"] != out["before"]
    assert out["compiles"] == 0


def test_an_engine_on_a_trainers_mesh_takes_its_arrays_device_to_device(tp_worker, tiny_llama_2kv, tmp_path):
    """`LLM(mesh=...)` runs on the trainer's two devices (tensor parallel 2), and `update_weights` of the
    trainer's arrays, sharded over its own ("fsdp",) axis, moves nothing to the host (a transfer guard
    forbids it): the greedy ids of a fresh engine on the new checkpoint."""
    other = save_tiny_llama(str(tmp_path / "other"), seed=1, num_key_value_heads=2)
    out = tp_worker.run("update_weights_on_mesh", tiny_llama_2kv, {"other_dir": other, "num_devices": 2})
    assert out["devices"] == [0, 1]
    assert out["after"] == out["fresh"] and out["after"] != out["before"]


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    from helpers.tiny_vlm import save_tiny_llava

    return save_tiny_llava(str(tmp_path_factory.mktemp("tp_llava")))


def test_vision_language_model_under_tensor_parallelism_matches_one_device(tp_worker, tiny_llava):
    # LLaVA at TP 4: the CLIP tower's heads and MLP, the projector and the decoder split over the mesh,
    # the images encoded by the sharded encoder program; prompts with one image, two, and none.
    results = tp_worker.run("generate_images", tiny_llava, [{}, {"tensor_parallel_size": 4}])
    assert_same_as_first(results)
    shards = tp_worker.run("param_shards", tiny_llava, {"tensor_parallel_size": 4})
    tower = "vision_tower/layers/0"
    assert shards[f"{tower}/self_attn/q_proj/kernel"] == [[32, 32], [32, 8]]  # 4 heads, one a device
    assert shards[f"{tower}/self_attn/out_proj/kernel"] == [[32, 32], [8, 32]]
    assert shards[f"{tower}/mlp/fc1/kernel"] == [[32, 64], [32, 16]]
    assert shards["multi_modal_projector/linear_2/kernel"] == [[64, 64], [16, 64]]
    assert shards["vision_tower/embeddings/patch_embedding/weight"] == [[32, 3, 8, 8]] * 2  # whole


def test_gemma3_with_images_under_tensor_parallelism_matches_one_device(tp_worker, tmp_path_factory):
    """Gemma 3 at TP 2: the SigLIP tower split like CLIP's, the pooled projector's matrix whole, the
    decoder's bidirectional image spans per device (the attention's `attend_ahead` is replicated)."""
    from helpers.tiny_vlm import save_tiny_gemma3

    model = save_tiny_gemma3(str(tmp_path_factory.mktemp("tp_gemma3")))
    assert_same_as_first(tp_worker.run("generate_images", model, [{}, {"tensor_parallel_size": 2}]))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_qwen_vl_with_images_under_tensor_parallelism_matches_one_device(tp_worker, tmp_path_factory, family):
    """Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE at TP 2: the tower's MLP and mergers split by channel (the
    fused qkv whole), the packed patches, M-RoPE positions and DeepStack rows replicated, the decoder
    split as Qwen2's and Qwen3's; Qwen3-VL-MoE's with expert parallelism, whole experts to ranks (each
    expert's MLP split instead: test_moe_expert_parallel_matches_one_device's TP 2)."""
    from helpers import tiny_vlm

    model = getattr(tiny_vlm, f"save_tiny_{family}")(str(tmp_path_factory.mktemp(f"tp_{family}")))
    layout = {"tensor_parallel_size": 2, "enable_expert_parallel": family == "qwen3_vl_moe"}
    assert_same_as_first(tp_worker.run("generate_images", model, [{}, layout]))
    shards = tp_worker.run("param_shards", model, layout)
    mlp, merger = {
        "qwen2_5_vl": ("visual/blocks/0/mlp/gate_proj/kernel", "visual/merger/fc2/kernel"),
        "qwen3_vl": (
            "visual/blocks/0/mlp/linear_fc1/kernel",
            "visual/deepstack_merger_list/1/linear_fc2/kernel",
        ),
    }[family.removesuffix("_moe")]
    assert shards[mlp] == [[32, 48], [32, 24]]
    assert shards[merger] == [[128, 64], [64, 64]]
    assert shards["visual/blocks/0/attn/qkv/kernel"] == [[32, 96]] * 2  # whole
    if family == "qwen3_vl_moe":  # [layers, experts, in, out]: 4 of the 8 experts a rank
        assert shards["layers/mlp/experts_gate/kernel"] == [[2, 8, 64, 16], [2, 4, 64, 16]]
        assert shards["layers/mlp/experts_down/kernel"] == [[2, 8, 16, 64], [2, 4, 16, 64]]
        assert shards["layers/mlp/gate/kernel"] == [[2, 64, 8]] * 2  # the router whole

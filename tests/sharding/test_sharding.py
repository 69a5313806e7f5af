"""Tensor and data parallelism on 8 fake CPU devices (the cases run in the session's worker process,
helpers/tp_run.py, since the device count is fixed when jax starts): the same greedy tokens and logits
as one device. The two-process cases start their own processes (jax.distributed, 4 devices each)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from helpers.tiny_models import save_tiny_llama


def assert_same_as_first(results):
    base = results[0]
    for r in results[1:]:
        assert r["tokens"] == base["tokens"], r["layout"]
        np.testing.assert_allclose(r["logprobs"], base["logprobs"], atol=1e-5, err_msg=str(r["layout"]))


def test_tensor_and_data_parallel_match_one_device(tp_worker, tiny_llama_2kv):
    layouts = [
        {},
        {"tensor_parallel_size": 2},
        {"tensor_parallel_size": 4},
        {"tensor_parallel_size": 8},
        {"data_parallel_size": 2},
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generated_text(stdout: str) -> str:
    # gloo's C++ logging shares stdout; the generated text is the last other line.
    return [line for line in stdout.splitlines() if not line.startswith("[Gloo]")][-1]


CLI = [sys.executable, "-m", "xlaserve.entrypoints.cli", "--log-level", "WARNING"]


def _generate_args(model: str) -> list[str]:
    return [
        "generate",
        "The capital of France is",
        "--model",
        model,
        "--raw",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--max-model-len",
        "128",
        "--max-num-batched-tokens",
        "32",
        "--max-num-seqs",
        "4",
        "--kv-cache-memory",
        str(2**23),
        "--enforce-eager",
        "--dtype",
        "float32",
    ]


@pytest.fixture(scope="module")
def one_process_text(tiny_llama_2kv) -> str:
    """What `xlaserve generate` writes in one process on one device: both two-process cases' reference."""
    single = subprocess.run(
        CLI + _generate_args(tiny_llama_2kv),
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, XLA_FLAGS=""),
        check=False,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    return _generated_text(single.stdout)


@pytest.mark.slow
def test_two_processes_tensor_parallel_8_match_one_process(tiny_llama_2kv, one_process_text):
    args = _generate_args(tiny_llama_2kv)
    port = _free_port()
    multi = ["-tp", "8", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    follower = subprocess.Popen(
        CLI + args + multi + ["--node-rank", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    leader = subprocess.run(
        CLI + args + multi + ["--node-rank", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    _, follower_err = follower.communicate(timeout=120)
    assert leader.returncode == 0, leader.stderr[-3000:]
    assert follower.returncode == 0, follower_err[-3000:]  # released cleanly by process 0
    assert _generated_text(leader.stdout) == one_process_text
    assert _generated_text(leader.stdout).strip()


def test_divergent_follower_stops_the_engine_with_a_clear_error():
    import threading

    from xlaserve.executor.multihost import StepReceiver, StepSender
    from xlaserve.worker.input_batch import StepInputs, build_step_batch, sampling_tensors

    port = _free_port()
    received = []

    def follower():
        receiver = StepReceiver("127.0.0.1", port, node_rank=1)
        while (inputs := receiver.recv()) is not None:
            received.append(inputs)
            receiver.report(np.array([7, 7], np.int32))  # not what process 0 sampled
        receiver.close()

    thread = threading.Thread(target=follower)
    thread.start()
    sender = StepSender("127.0.0.1", port, num_followers=1, timeout_s=30)
    inputs = StepInputs(build_step_batch([], 16, 16, 4, 16), sampling_tensors([], 16, 32, False), False, None)
    sender.send(inputs)
    with pytest.raises(RuntimeError, match="divergence at step 0: process 1"):
        sender.check(np.array([1, 2], np.int32))
    sender.close()
    thread.join(timeout=30)
    assert len(received) == 1 and received[0].batch.input_ids.shape == (16,)


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
def tiny_deepseek(tmp_path_factory):
    from helpers.tiny_models import save_tiny_model

    return save_tiny_model(
        str(tmp_path_factory.mktemp("tiny_deepseek")),
        "DeepseekV3",
        num_attention_heads=4,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=12,
        q_lora_rank=32,
    )


def test_deepseek_mla_tensor_parallel_matches_one_device(tp_worker, tiny_deepseek):
    # With `pallas`, the MLA kernel runs per device on its heads over the replicated latent cache.
    layouts = [
        {},
        {"tensor_parallel_size": 2},
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


@pytest.mark.slow
def test_two_process_server_matches_one_process(tiny_llama_2kv, one_process_text, tmp_path):
    """`xlaserve serve` across two processes (TP 8 over 2 x 4 devices): the OpenAI API answers from
    process 0 as one process would, and SIGTERM on process 0 releases process 1."""
    import openai

    from helpers.server_harness import ServerProcess

    port = _free_port()
    multi = ["-tp", "8", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    # The smallest buckets that hold the one request (its warm-up, in both processes, compiles every
    # program: token buckets 1, 4, 16 and request bucket 1, 10 programs instead of 32 and 4's 16).
    engine = [
        "--max-model-len",
        "128",
        "--max-num-batched-tokens",
        "16",
        "--max-num-seqs",
        "1",
        "--dtype",
        "float32",
    ]
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "xlaserve.entrypoints.cli",
            "serve",
            tiny_llama_2kv,
            *engine,
            *multi,
            "--node-rank",
            "1",
            "--kv-cache-memory",
            str(2**23),
        ],
        env=dict(os.environ, **env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    leader = ServerProcess(
        str(tmp_path),
        str(tmp_path / "cache"),
        [*engine, *multi, "--node-rank", "0"],
        model=tiny_llama_2kv,
        env=env,
    )
    try:
        leader.wait_ready()
        client = openai.OpenAI(base_url=leader.url + "/v1", api_key="unused")
        served = (
            client.completions.create(
                model=tiny_llama_2kv, prompt="The capital of France is", max_tokens=8, temperature=0
            )
            .choices[0]
            .text
        )
    finally:
        code = leader.stop()
    _, follower_err = follower.communicate(timeout=120)
    assert code == 0, leader.log_tail()
    assert follower.returncode == 0, follower_err[-3000:]
    assert served.strip() and served == one_process_text


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

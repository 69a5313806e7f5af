"""Shared fixtures: one SmolLM2 engine (compiled once) and its Hugging Face reference."""

from __future__ import annotations

import os
import tempfile

# Before anything imports jax: this process and its subprocesses compile at XLA's backend optimization
# level 0 (helpers/tiny_models.FAST_COMPILE_XLA_FLAGS): the suite's tiny models and kernel tests spend
# nearly all their time compiling. Engines on SmolLM2, whose steps dominate their tests, ask for XLA's
# default level themselves (helpers/smollm2.ENGINE_ARGS: optimization_level=2).
from helpers.tiny_models import FAST_COMPILE_XLA_FLAGS, GC_THRESHOLDS

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_XLA_FLAGS}".strip()

import gc  # noqa: E402

import pytest  # noqa: E402

# The server tests' session fixtures (a real `xlaserve serve` subprocess): see helpers/server_harness.py.
from helpers.server_harness import dead_tool_server_address, mcp_tool_server, server, server_cache_dir  # noqa: F401
from helpers.smollm2 import ENGINE_ARGS, smollm2_gguf_path
from helpers.suite_profile import register as register_suite_profile

# The fake-mesh tests' session worker (8 fake CPU devices) and tiny models: see helpers/tp_run.py.
from helpers.tp_run import tiny_llama_2kv, tiny_llama_257, tp_worker  # noqa: F401

# Python's cyclic GC, at its default thresholds, ran ~20 full collections a module over the suite's
# large heap (torch, transformers, jax's caches): 4.0 of test_model_families.py's 59 s, ~7% of the
# suite's CPU. Rarer collections (young garbage still goes every 20,000 allocations) took it to 0.8 s.
# Tests that need an engine's memory back call gc.collect() themselves.
gc.set_threshold(*GC_THRESHOLDS)
# Tests never reach a hub; transformers must not try.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The persistent compilation cache is on by default; the suite keeps its own, out of the user's home.
os.environ.setdefault("XLASERVE_CACHE_ROOT", tempfile.mkdtemp(prefix="xlaserve-tests-"))
# Triton reads TRITON_INTERPRET once, when first imported, and torch-based test libraries (peft) import
# it early: without a GPU, the Triton kernel's numerics tests need the interpreter from the start.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    register_suite_profile(config)  # XLASERVE_SUITE_PROFILE=folder: per-test CPU and compile times


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


# -- running the suite on two workers (pytest-xdist, `-n 2 --dist loadgroup`: .ci/run) ------------------
# Each worker is its own process with its own session fixtures, so a fixture two workers both use is
# built twice (an engine's warm-up compiles, a server's start). Tests therefore go to workers by
# group: a module's tests stay together (its module fixtures are built once), and a module that uses
# one of the session's expensive fixtures joins that fixture's group, so each is built once. A module
# using fixtures of two groups joins the first (test_server.py: the server's, building its own `llm`):
# merging the groups would leave one worker with most of the suite.
SHARED_FIXTURE_GROUPS = {  # group -> its fixtures, in the order a module picks its group
    "server": {"server"},
    "smollm2": {"llm", "llm_bf16", "hf_model"},
    "fake-mesh": {"tp_worker"},
}
# The order workers take the groups in: the longest first. Stop 57's profile (wall minutes on a
# worker; the fake-mesh worker's tiny models now compile with the elemental emitters): smollm2 ~8,
# fake-mesh ~7, server ~6. One worker takes fake-mesh and then the server's, the other smollm2, and
# the short modules fill in beside them: the two workers ended 7 s apart (1,223 and 1,216 s).
GROUP_ORDER = ["fake-mesh", "smollm2", "server"]


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def _module_fixtures(items) -> dict[str, set[str]]:
    """module path -> every fixture its tests use."""
    fixtures: dict[str, set[str]] = {}
    for item in items:
        fixtures.setdefault(_module(item), set()).update(item.fixturenames)
    return fixtures


def _module_groups(fixtures: dict[str, set[str]]) -> dict[str, str | None]:
    """module path -> the shared-fixture group it joins (None: its own)."""
    return {
        module: next((g for g, names in SHARED_FIXTURE_GROUPS.items() if names & used), None)
        for module, used in fixtures.items()
    }


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "loadgroup", False):
        return  # one process, or xdist's other schedules: nothing to group
    fixtures = _module_fixtures(items)
    groups = _module_groups(fixtures)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[_module(item)] or _module(item)))
    # Workers take groups in collection order: the shared-fixture groups (the longest) first, in
    # GROUP_ORDER, so that the short modules fill in beside them at the end. The SmolLM2 engine `llm`
    # and the session server run the same 24 programs: whichever starts first compiles them into the
    # suite's shared program store, the other loads them (~4 s). Within the SmolLM2 group, the
    # modules that do not build `llm` go first.
    order = GROUP_ORDER

    def position(item) -> tuple[int, int]:
        group = groups[_module(item)]
        if group is None:
            return len(order), 0
        return order.index(group), int(group == "smollm2" and "llm" in fixtures[_module(item)])

    items.sort(key=position)

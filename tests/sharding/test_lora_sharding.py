"""LoRA under tensor parallelism on fake CPU devices (the session's worker process, helpers/tp_run.py:
the device count is fixed when jax starts): the slot stacks are split like their kernels, and the tokens
and logprobs equal one device's."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.lora_adapters import make_adapter
from helpers.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow  # two engines in the fake-mesh worker

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_lora_under_tensor_parallelism_matches_one_device(tp_worker, tmp_path):
    pytest.importorskip("peft")
    import transformers

    model_dir = save_tiny_llama(str(tmp_path / "model"))  # D=64, F=128, 8 heads, 4 KV heads, 2 layers
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    make_adapter(base, 8, 16, False, TARGETS, str(tmp_path / "adapter"), seed=0)
    one, two = tp_worker.run("lora", model_dir, {"adapter_dir": str(tmp_path / "adapter"), "sizes": [1, 2]})
    assert two["tokens"] == one["tokens"]
    np.testing.assert_allclose(two["logprobs"], one["logprobs"], atol=1e-5)
    assert one["tokens"][:3] != one["tokens"][3:]  # the adapter changes the output
    # A [L, in, S, r] / B [L, S, r, out] per device (S = max_loras = 1): A split on the input of row-parallel
    # projections, B on the output of column-parallel ones, the rest whole.
    shards = two["shards"]
    assert shards["a:self_attn.o_proj"] == [2, 32, 1, 8] and shards["b:self_attn.o_proj"] == [2, 1, 8, 64]
    assert shards["a:mlp.down_proj"] == [2, 64, 1, 8] and shards["b:mlp.down_proj"] == [2, 1, 8, 64]
    assert shards["a:self_attn.q_proj"] == [2, 64, 1, 8] and shards["b:self_attn.q_proj"] == [2, 1, 8, 32]
    assert shards["b:self_attn.k_proj"] == [2, 1, 8, 16] and shards["b:mlp.up_proj"] == [2, 1, 8, 64]

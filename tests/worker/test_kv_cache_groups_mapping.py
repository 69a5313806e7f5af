"""worker/kv_cache_groups.py: a model's cache spec and layers -> the core's KV cache groups, and what a
state-keeping model refuses by the field that asks for it (no engine is built)."""

from __future__ import annotations

import pytest

from xlaserve.config import EngineConfig
from xlaserve.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec, StateSpec
from xlaserve.models.loader import complete_config
from xlaserve.models.registry import get_model_class, model_config_from_hf
from xlaserve.worker.kv_cache_groups import cache_layout, kv_cache_groups

ATTENTION = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 3,
             "num_attention_heads": 2}  # fmt: skip
MAMBA2 = {"architectures": ["Mamba2ForCausalLM"], "vocab_size": 64, "hidden_size": 16, "expand": 2,
          "num_heads": 4, "head_dim": 8, "state_size": 4, "n_groups": 1, "num_hidden_layers": 2}  # fmt: skip


def groups_of(hf: dict, **engine_kwargs):
    model_config = model_config_from_hf(complete_config(dict(hf)))
    kv_spec = get_model_class(model_config.architecture or "LlamaForCausalLM").kv_cache_spec(model_config)
    return kv_cache_groups(
        kv_spec, model_config, EngineConfig.from_kwargs(None, block_size=8, **engine_kwargs)
    )


def test_layer_kinds_map_to_group_specs():
    (llama,) = groups_of({**ATTENTION, "architectures": ["LlamaForCausalLM"]})
    assert llama.spec == FullAttentionSpec(8) and llama.layer_ids == (0, 1, 2)
    mistral = {**ATTENTION, "architectures": ["MistralForCausalLM"], "sliding_window": 12}
    assert groups_of(mistral)[0].spec == SlidingWindowSpec(8, sliding_window=12)
    (mamba,) = groups_of(MAMBA2)
    assert mamba.spec == StateSpec(8) and mamba.layer_ids == (0, 1)


GEMMA2 = {**ATTENTION, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 12}  # sliding, full, sliding
# Gemma 3's pattern at 12 layers: five sliding, one full, twice.
GEMMA3 = {**ATTENTION, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12, "sliding_window": 12,
          "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2}  # fmt: skip


def test_layers_of_several_windows_form_equal_groups_sharing_cache_slots():
    """vLLM's hybrid layout: each window's layers in groups as large as the rarest window's count,
    full attention's first; a layer's cache slot is its place in its group."""
    full, *sliding = groups_of(GEMMA2)
    assert (full.spec, full.layer_ids) == (FullAttentionSpec(8), (1,))
    window = SlidingWindowSpec(8, sliding_window=12)
    assert [(g.spec, g.layer_ids) for g in sliding] == [(window, (0,)), (window, (2,))]
    groups = groups_of(GEMMA3)
    assert [g.layer_ids for g in groups] == [(5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    layout = cache_layout(groups)
    assert layout.num_slots == 2 and layout.num_groups == 6
    assert layout.layer_groups.tolist() == [1, 1, 2, 2, 3, 0, 3, 4, 4, 5, 5, 0]
    assert layout.layer_slots.tolist() == [0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    assert layout.layer_block_offsets(100).tolist() == [0, 100, 0, 100, 0, 0, 100, 0, 100, 0, 100, 100]
    assert cache_layout(groups_of({**ATTENTION, "architectures": ["LlamaForCausalLM"]})) is None


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"disable_hybrid_kv_cache_manager": True},
        {"kv_offloading_size": 1.0},
        {"pipeline_parallel_size": 2},
    ],
    ids=["flag", "host-tier", "pipeline"],
)
def test_features_that_move_one_table_keep_one_full_attention_group(engine_kwargs):
    (group,) = groups_of(GEMMA3, **engine_kwargs)
    assert group.spec == FullAttentionSpec(8) and group.layer_ids == tuple(range(12))


def test_a_state_model_takes_ngram_drafts_and_refuses_a_float8_cache_and_a_host_tier():
    # n-gram drafts are verified with the state's backup; a draft model is refused (test_mamba2.py).
    assert groups_of(MAMBA2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        groups_of(MAMBA2, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_offloading_size"):
        groups_of(MAMBA2, kv_offloading_size=1.0)


QWEN3_5 = {"architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 64, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 8,
           "layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_key_heads": 1,
           "linear_num_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4}  # fmt: skip


def test_a_hybrid_model_has_attention_blocks_and_a_state_slot_pool_paid_first():
    """Qwen3.5: the attention layers' group first (the step's block table), then the linear layers'
    state group with max_num_seqs + 1 slots of its own; the slots' bytes leave the budget before any
    block is counted, and a budget they do not leave room in is refused naming max_num_seqs."""
    from xlaserve.worker.kv_cache import num_kv_blocks

    model_config = model_config_from_hf(complete_config(dict(QWEN3_5)))
    spec = get_model_class("Qwen3_5ForCausalLM").kv_cache_spec(model_config).with_max_num_seqs(4)
    config = EngineConfig.from_kwargs(None, block_size=8, max_num_seqs=4, kv_cache_memory=2**16)
    attention, state = kv_cache_groups(spec, model_config, config)
    assert attention.spec == FullAttentionSpec(8) and attention.layer_ids == (1, 3)
    assert state.spec == StateSpec(8, num_slots=5) and state.layer_ids == (0, 2)
    # Per slot and linear layer: conv inputs (3 x 16 float32: q, k, v) and the state (2 x 4 x 4 float32).
    state_bytes = 5 * 2 * (3 * 16 * 4 + 2 * 4 * 4 * 4)
    block_bytes = 2 * 2 * 8 * 1 * 8 * 4  # K and V of two attention layers
    assert num_kv_blocks(config.cache, spec, "float32") == (2**16 - state_bytes) // block_bytes
    small = EngineConfig.from_kwargs(None, block_size=8, kv_cache_memory=state_bytes + block_bytes).cache
    with pytest.raises(ValueError, match="max_num_seqs"):
        num_kv_blocks(small, spec, "float32")

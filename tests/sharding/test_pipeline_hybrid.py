"""Hybrid models on pipeline stages, on fake CPU devices (helpers/pp_worker.py `hybrid`, one call for the
module): a tiny Qwen3.5 of 6 layers (Gated DeltaNet and attention alternating: stages L F L | F L F, so
the boundary falls inside a period and each stage runs the period rotated) and a tiny Granite 4.0-H
of 4 layers (Mamba2, attention, Mamba2, Mamba2: stages M A | M M, the second holding no attention layer)
give PP=1's tokens and logprobs bit for bit under PP=2: three requests in flight, one prefilled in
chunks across steps, then the same prompts again, hitting the state snapshots the first run left
(prefix caching: each stage copies its own layers' state rows); Qwen3.5 in bfloat16 with two
micro-batches in flight, Granite in float32. The PP=2 engines are warmed up under the strict compile
guard and compile nothing afterwards; each stage's cache holds its own layers' K/V blocks and state
slots only, with the same block and slot ids.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers.family_cases import GRANITE_HYBRID, QWEN3_5_TEXT, randomize_weights, save_hf_model

pytestmark = pytest.mark.slow  # four engines in the fake-mesh worker, two warmed up whole

PP1, PP2 = {}, {"pipeline_parallel_size": 2}
BF16 = {"dtype": "bfloat16"}
# Qwen3.5 in bfloat16 (its stacked weights packed for the CPU's dot, read in place at each layer's index:
# kernels/dtype_ops.py `stack_entry`), Granite 4.0-H in float32; both PP=2 engines warmed up whole.
LAYOUTS = {"qwen3_5": [BF16, {**BF16, **PP2}], "granite": [PP1, PP2]}
GUARDED = {"qwen3_5": {**BF16, **PP2}, "granite": PP2}
# Two micro-batches in flight, each step another mix of requests than PP=1's: bitwise only where the
# model is batch-invariant, bfloat16 (float32's chunked delta rule takes its chunk size from the step).
MICRO_BATCHES = {"qwen3_5": {**BF16, **PP2}}
# 16 tokens a step: the 40-token prompt prefills in three chunks, beside the others' decodes.
SHAPE = {"max_num_batched_tokens": 16, "max_num_seqs": 4}
PROMPTS = [[5, 17, 33, 4, 60], [(7 * i) % 98 + 3 for i in range(40)], [44, 20, 7, 81, 15, 9, 66] * 3]


def _save(tmp_path_factory, name: str, config_class: str, architecture: str, fields: dict) -> str:
    config = getattr(transformers, config_class)(**fields)
    config.architectures = [architecture]
    torch.manual_seed(3)
    zero_centred = architecture.startswith("Qwen")  # Qwen3.5's norms scale by 1 + w
    model = randomize_weights(
        getattr(transformers, architecture)(config).eval(), 0.0 if zero_centred else 1.0
    )
    return save_hf_model(model, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def runs(tp_worker, tmp_path_factory) -> dict[str, list[dict]]:
    """{model: [result per layout of LAYOUTS]}."""
    qwen = dict(QWEN3_5_TEXT, num_hidden_layers=6, layer_types=["linear_attention", "full_attention"] * 3)
    granite = dict(GRANITE_HYBRID, layer_types=["mamba", "attention", "mamba", "mamba"])
    models = {
        "qwen3_5": _save(tmp_path_factory, "pp_qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", qwen),
        "granite": _save(
            tmp_path_factory, "pp_granite", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", granite
        ),
    }
    arg = {"models": models, "layouts": LAYOUTS, "guarded": GUARDED, "shape": SHAPE, "prompts": PROMPTS}
    arg["micro_batches"] = MICRO_BATCHES
    return tp_worker.run("pipeline_hybrid", "", arg)


@pytest.mark.parametrize(("model", "dtype"), [("qwen3_5", BF16), ("granite", {})])
def test_stages_are_bitwise_one_device(runs, model, dtype):
    one, staged = (runs[model][LAYOUTS[model].index({**dtype, **layout})] for layout in (PP1, PP2))
    assert staged["layout"] == {**dtype, **PP2}
    # Two micro-batches of the three requests in flight where MICRO_BATCHES says, else one step.
    assert staged["peak_steps_in_flight"] == (2 if staged["layout"] == MICRO_BATCHES.get(model) else 1)
    for run_one, run_staged in zip(one["runs"], staged["runs"], strict=True):
        assert run_staged["tokens"] == run_one["tokens"]
        assert run_staged["logprobs"] == run_one["logprobs"]  # every float, exactly
        assert run_staged["num_cached_tokens"] == run_one["num_cached_tokens"]
    first, again = one["runs"]
    assert len({tuple(t) for t in first["tokens"]}) == len(PROMPTS)  # the prompts differ in output
    # The second run starts the two longer prompts from snapshots, and gives the first run's tokens (in
    # bfloat16 its bits: batch-invariant; float32's chunked delta rule and SSD take chunks from the step).
    assert first["num_cached_tokens"] == [0, 0, 0] and again["num_cached_tokens"][1:] == [32, 16]
    assert again["tokens"] == first["tokens"]
    if dtype == BF16:
        assert again["logprobs"] == first["logprobs"]


def test_each_stage_holds_its_layers_rows_and_nothing_compiles_after_warm_up(runs):
    """Qwen3.5's stages: 1 attention + 2 DeltaNet layers, then 2 + 1; Granite's: 1 + 1, then 0 + 2 (an
    empty K/V array). Every stage has every block id and state slot."""
    expected = {"qwen3_5": [(1, 2), (2, 1)], "granite": [(1, 1), (0, 2)]}
    for model, counts in expected.items():
        staged = runs[model][LAYOUTS[model].index(GUARDED[model])]
        assert staged["layout"] == GUARDED[model]
        assert staged["compiles_after_warm_up"] == 0
        blocks, slots = staged["num_blocks"], staged["num_state_slots"]
        assert slots == 2 * SHAPE["max_num_seqs"] + 1  # the live ones, the null slot, the snapshots
        assert staged["cache_rows"] == [[a * blocks, a * blocks, s * slots, s * slots] for a, s in counts]

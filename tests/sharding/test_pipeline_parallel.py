"""Pipeline parallelism on 8 fake CPU devices (helpers/pp_worker.py, one call for the whole module):
stages compute what one device computes for their layers, in the same order, so PP=4 (a tiny
Qwen3-MoE: first, middle and last stages, the experts cut into stages) gives bitwise the same greedy
ids and logprobs as PP=1; PP=2 x TP=2 (a tiny Llama) matches within 1e-4 (tensor parallelism's
all-reduce sums in another order); each stage holds only its own weights and KV cache, on its own
devices; nothing compiles after warm-up."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # four engines in the fake-mesh worker, one warmed up

PP1, PP4 = {}, {"pipeline_parallel_size": 4}
PP2_TP2 = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}
# Each engine compiles its own programs (each stage's forward per bucket, ~2-4 s each on this machine):
# the fewest layouts that cover 4 stages (a first, two middle and a last: PP=2's two stages are PP=4's
# ends) of MoE experts, tensor parallelism inside the stages, and the compile guard.
LAYOUTS = {"llama": [PP1, PP2_TP2], "qwen3_moe": [PP1, PP4]}
GUARDED = {"llama": PP2_TP2}  # warmed up under the strict compile guard


@pytest.fixture(scope="module")
def runs(tp_worker, tmp_path_factory):
    """{model: [result per layout of LAYOUTS]} for a tiny Llama and a tiny Qwen3-MoE of 4 layers each."""
    from helpers.tiny_models import save_tiny_llama, save_tiny_model, small_byte_tokenizer

    tokenizer = small_byte_tokenizer()  # a 320-token vocabulary: small logits and sampler programs
    llama = save_tiny_llama(
        str(tmp_path_factory.mktemp("pp_llama")),
        num_hidden_layers=4,
        num_key_value_heads=2,
        tokenizer=tokenizer,
    )
    moe = save_tiny_model(
        str(tmp_path_factory.mktemp("pp_qwen3_moe")),
        "Qwen3Moe",
        tokenizer=small_byte_tokenizer(),
        num_hidden_layers=4,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
    )
    arg = {"models": {"llama": llama, "qwen3_moe": moe}, "layouts": LAYOUTS, "guarded": GUARDED}
    return tp_worker.run("pipeline", "", arg)


def _max_logprob_diff(a: list, b: list) -> float:
    """The largest |difference| between two runs' logprobs of the same ids at the same positions."""
    return max(
        abs(x[1] - y[1])
        for seq_a, seq_b in zip(a, b)
        for pos_a, pos_b in zip(seq_a, seq_b)
        for x in pos_a
        for y in pos_b
        if x[0] == y[0]
    )


def test_pipeline_stages_are_bitwise_one_device(runs):
    one, staged = runs["qwen3_moe"][0], runs["qwen3_moe"][LAYOUTS["qwen3_moe"].index(PP4)]
    assert staged["layout"] == PP4
    assert staged["tokens"] == one["tokens"]
    assert staged["logprobs"] == one["logprobs"]  # every float, exactly
    assert len({tuple(t) for t in one["tokens"]}) == len(one["tokens"])  # the prompts differ in output


def test_pipeline_times_tensor_parallel_matches_one_device(runs):
    one, staged = runs["llama"][0], runs["llama"][LAYOUTS["llama"].index(PP2_TP2)]
    assert staged["tokens"] == one["tokens"]
    assert _max_logprob_diff(staged["logprobs"], one["logprobs"]) < 1e-4


def test_each_stage_holds_only_its_layers_and_nothing_compiles_after_warm_up(runs):
    guarded = runs["llama"][LAYOUTS["llama"].index(GUARDED["llama"])]
    assert guarded["compiles_after_warm_up"] == 0
    assert guarded["num_steps"] > 0
    first, last = guarded["stages"]
    num_blocks = first["num_blocks"]
    # Two stages of 2 of the 4 layers, each on its own 2 devices (sharded there by tensor
    # parallelism), its KV cache of its 2 layers only.
    assert (first["devices"], last["devices"]) == ([0, 1], [2, 3])
    assert (first["layer_devices"], last["layer_devices"]) == ([0, 1], [2, 3])
    assert first["num_layers"] == last["num_layers"] == [2]
    assert first["kv_rows"] == last["kv_rows"] == [2 * num_blocks, 2 * num_blocks]
    # The embedding on the first stage, the final norm and the (untied) LM head on the last.
    assert (first["has_embedding"], first["has_norm"], first["has_lm_head"]) == (True, False, False)
    assert (last["has_embedding"], last["has_norm"], last["has_lm_head"]) == (False, True, True)

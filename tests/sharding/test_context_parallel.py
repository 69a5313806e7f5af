"""Context parallelism (sharding/context_parallel.py) on fake CPU devices, against one device.

A tiny Llama with one KV head. Decode context parallel: under plain tensor parallelism every rank would
hold a copy of the head and the whole sequence; with decode_context_parallel_size 2 (tensor parallel 2)
and 4 (tensor parallel 4) the copies store every second or fourth token instead, and each query's
attention is merged from their partial results. Prefill context parallel 2 (alone, with tensor
parallel 2, and with decode context parallel 2 inside each group): each half of the devices computes
half of every step's tokens. Prompts of 5 to 70
tokens prefill in chunks and decode; the second run of the same prompts hits the prefix cache, whose
blocks are the scheduler's as ever.
"""

from __future__ import annotations

import numpy as np
import pytest

from xlaserve.config import EngineConfig

DCP2 = {"tensor_parallel_size": 2, "decode_context_parallel_size": 2}
DCP4 = {"tensor_parallel_size": 4, "decode_context_parallel_size": 4}
PCP2 = {"prefill_context_parallel_size": 2}
PCP2_TP2 = {"prefill_context_parallel_size": 2, "tensor_parallel_size": 2}
PCP2_DCP2 = {**PCP2_TP2, "decode_context_parallel_size": 2}
LAYOUTS = [{}, DCP2, DCP4, PCP2, PCP2_TP2, PCP2_DCP2]
# A float8 cache (--kv-cache-dtype fp8_e5m2): alone, and under PCP 2 with DCP 2 in each group (DCP 2 alone
# writes and reads the same interleave).
FP8 = {"kv_cache_dtype": "fp8_e5m2"}
FP8_LAYOUTS = [FP8, {**PCP2_DCP2, **FP8}]
PROMPT_LENGTHS = (5, 40, 19, 70)


def assert_as_one_device(base: dict, others: list[dict]) -> None:
    """Each layout's runs (the first and the prefix-cached rerun): one device's greedy tokens, its top
    logprobs within 1e-4."""
    for other in others:
        for run in other["runs"]:
            assert run["tokens"] == base["runs"][0]["tokens"], other["layout"]
            np.testing.assert_allclose(
                np.concatenate(run["logprobs"]),
                np.concatenate(base["runs"][0]["logprobs"]),
                atol=1e-4,
                err_msg=str(other["layout"]),
            )


def assert_layouts_as_one_device(tp_worker, model: str, layouts: list[dict], seed: int) -> dict:
    """`model` on one device and on each of `layouts`, the prompts of PROMPT_LENGTHS (random ids from
    `seed`): `assert_as_one_device`. -> each layout's results (the worker's), by str(layout)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 300, n).tolist() for n in PROMPT_LENGTHS]
    base, *others = tp_worker.run("context_parallel", model, {"layouts": [{}, *layouts], "prompts": prompts})
    assert_as_one_device(base, others)
    return {str(r["layout"]): r for r in (base, *others)}


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory) -> str:
    from helpers.tiny_models import save_tiny_llama, small_byte_tokenizer

    return save_tiny_llama(
        str(tmp_path_factory.mktemp("dcp_llama")),
        num_hidden_layers=2,
        num_key_value_heads=1,
        tokenizer=small_byte_tokenizer(),
    )


@pytest.fixture(scope="module")
def results(tp_worker, one_kv_head) -> dict:
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 300, n).tolist() for n in PROMPT_LENGTHS]
    out = tp_worker.run(
        "context_parallel", one_kv_head, {"layouts": LAYOUTS + FP8_LAYOUTS, "prompts": prompts}
    )
    return {str(r["layout"]): r for r in out}


def test_context_parallel_gives_one_devices_tokens_and_logprobs(results):
    base = results[str({})]["runs"][0]
    for layout in LAYOUTS[1:]:
        for run in results[str(layout)]["runs"]:
            assert run["tokens"] == base["tokens"], layout
            np.testing.assert_allclose(
                np.concatenate(run["logprobs"]),
                np.concatenate(base["logprobs"]),
                atol=1e-4,
                err_msg=str(layout),
            )
            assert run["num_cached_tokens"] in ([0] * 4, [0, 32, 16, 64]), layout
        assert results[str(layout)]["runs"][1]["num_cached_tokens"] == [0, 32, 16, 64], layout


def test_a_float8_cache_under_context_parallelism_gives_one_devices_tokens(results):
    """A float8 cache (fp8_e5m2: the format its writes and reads must both be told) under PCP 2 with
    DCP 2: K/V written interleaved (each rank's tokens gathered under PCP) and read back as on
    one device: its greedy tokens, its top logprobs within 1e-2, where storing float8 at all moves them
    by ~0.2 (a value whose float32 projection differs in its last bits under tensor parallelism may
    round to the neighbouring float8). Each rank holds its share of a block, one byte a value."""
    base = results[str(FP8)]
    base_lp = np.concatenate(base["runs"][0]["logprobs"])
    float32_lp = np.concatenate(results[str({})]["runs"][0]["logprobs"])
    assert np.abs(base_lp - float32_lp).max() > 0.05  # the float8 cache is what is compared
    for layout in FP8_LAYOUTS[1:]:
        for run in results[str(layout)]["runs"]:
            assert run["tokens"] == base["runs"][0]["tokens"], layout
            np.testing.assert_allclose(
                np.concatenate(run["logprobs"]), base_lp, atol=1e-2, err_msg=str(layout)
            )
    assert [results[str(layout)]["k_shard"][1:3] for layout in FP8_LAYOUTS] == [[16, 1], [8, 1]]
    assert all(results[str(layout)]["k_dtype"] == "uint8" for layout in FP8_LAYOUTS)


def test_each_rank_stores_its_share_of_every_block(results):
    """A rank's slice of a block of 16 tokens is 4 slots at DCP 4 (8 at DCP 2), of its one copy of the KV
    head: the budget holds as many blocks as on one device, where plain tensor parallel 4 (four whole
    copies) would hold a quarter. The DCP programs gather (the group's queries and partials)."""
    one, dcp2, dcp4 = (results[str(layout)] for layout in ({}, DCP2, DCP4))
    assert [r["k_shard"][1:3] for r in (one, dcp2, dcp4)] == [[16, 1], [8, 1], [4, 1]]
    assert dcp4["num_blocks"] == dcp2["num_blocks"] == one["num_blocks"]
    assert dcp4["k_shard"][0] == 2 * dcp4["num_blocks"]  # 2 layers of blocks on every rank
    assert one["collectives"]["all-gather"] == 0
    assert dcp4["collectives"]["all-gather"] > 0 and dcp2["collectives"]["all-gather"] > 0


def test_what_decode_context_parallel_refuses_is_named(tp_worker, tiny_llama_2kv):
    # 2 KV heads over 4 ranks: two copies of each, not four.
    message = tp_worker.run("error", tiny_llama_2kv, DCP4)
    assert "decode_context_parallel_size=4" in message and "num_kv_heads x 4 = 8" in message
    for kwargs, field in (
        ({"tensor_parallel_size": 2, "decode_context_parallel_size": 4}, "must divide tensor_parallel_size"),
        ({**DCP4, "block_size": 8}, None),  # 2 slots of each block on every rank
        ({"tensor_parallel_size": 16, "decode_context_parallel_size": 16, "block_size": 8}, "block_size=8"),
        ({**DCP2, "pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ):
        if field is None:
            EngineConfig.from_kwargs(None, **kwargs)
            continue
        with pytest.raises(
            ValueError, match=rf"decode_context_parallel_size.*{field}|{field}.*decode_context"
        ):
            EngineConfig.from_kwargs(None, **kwargs)


def test_prefill_context_parallel_splits_the_steps_tokens(results):
    """A 16-token bucket's projections run on 8 rows a device under PCP 2 (16 on one device); the K/V
    each rank computed are gathered before they are written (every rank's cache is whole)."""
    assert results[str({})]["dot_rows"] == [16]
    for layout in (PCP2, PCP2_TP2, PCP2_DCP2):
        assert results[str(layout)]["dot_rows"] == [8], layout
        assert results[str(layout)]["collectives"]["all-gather"] > 0, layout
    assert results[str(PCP2)]["k_shard"] == results[str({})]["k_shard"]
    # With DCP 2 inside each context group, a rank holds half of each block (interleaved) of its copy.
    assert results[str(PCP2_DCP2)]["k_shard"][1:3] == [8, 1]


def test_what_prefill_context_parallel_refuses_is_named():
    EngineConfig.from_kwargs(None, **PCP2_DCP2)
    for kwargs, field in (({**PCP2, "data_parallel_size": 2}, "data_parallel_size"),):
        with pytest.raises(
            ValueError, match=rf"prefill_context_parallel_size=2 cannot be combined with {field}"
        ):
            EngineConfig.from_kwargs(None, **kwargs)


def test_evicted_blocks_come_back_from_the_host_tier_under_context_parallelism(tp_worker, one_kv_head):
    """KV offload (kv_offloading_size) under PCP 2 with DCP 2 in each group, and on two pipeline stages.
    Under PCP x DCP the offload's programs gather and scatter whole blocks of the global cache arrays
    (each rank's interleaved half of a block among them); on stages each stage copies its own layer's
    blocks, all on one plan. A prompt the device cache evicted comes back from the host tier: its 32
    prefix tokens loaded (4 blocks of the whole model's bytes), the same tokens and logprobs bit for bit
    as when it was computed (a block put back in the wrong place, or a rank's half in the other's, would
    change them), every block free after. (One device's tokens under these layouts: the tests above.)"""
    rng = np.random.default_rng(21)
    prompts = [rng.integers(3, 300, 40).tolist() for _ in range(3)]
    layouts = [PCP2_DCP2, {"pipeline_parallel_size": 2}]
    results = tp_worker.run("context_parallel_offload", one_kv_head, {"layouts": layouts, "prompts": prompts})
    for result in results:
        first, *_, again = result["runs"]
        assert [r["num_cached_tokens"] for r in result["runs"]] == [0, 0, 0, 32], result["layout"]
        assert (again["tokens"], again["logprobs"]) == (first["tokens"], first["logprobs"]), result["layout"]
        assert result["host_hits"] == 32 and result["all_free"], result["layout"]
        assert result["loaded_bytes"] == 4 * result["bytes_per_block"], result["layout"]
    assert results[1]["bytes_per_block"] == results[0]["bytes_per_block"]  # the whole model's, both


def _each_fetched_every_block(result: dict) -> list[dict]:
    """A transfer chain's consumers, each having fetched its three prompts' whole blocks (32, 16 and 8
    tokens: 7 blocks, of one size on every engine) and recomputed none."""
    (bytes_per_block,) = set(result["bytes_per_block"])
    for consumer in result["consumers"]:
        assert consumer["num_cached_tokens"] == [32, 16, 8]
        assert consumer["fetches"] == {"loaded": 3, "recomputed": 0}
        assert consumer["bytes_fetched"] == 7 * bytes_per_block
    return result["consumers"]


def test_blocks_move_between_engines_of_different_layouts(tp_worker, one_kv_head):
    """Disaggregated prefill between layouts: one device -> PCP 2 x TP 2 x DCP 2 -> plain TP 2. A block
    leaves a cache and enters one as one device holds it (worker/kv_offload.BlockLayout: the one KV head
    once, its tokens in position order), so the three engines' blocks are the same bytes (where the device
    caches hold a block as 4 slots of 2 interleaved copies, and as 8 slots of 2 whole copies), and each
    consumer decodes from its producer's blocks: every prompt's whole blocks fetched, none recomputed, one
    device's tokens and logprobs within 1e-4."""
    rng = np.random.default_rng(23)
    prompts = [rng.integers(3, 300, n).tolist() for n in (37, 20, 9)]
    layouts = [{}, PCP2_DCP2, {"tensor_parallel_size": 2}]
    result = tp_worker.run("transfer_across_layouts", one_kv_head, {"layouts": layouts, "prompts": prompts})
    reference = result["reference"]
    for consumer in _each_fetched_every_block(result):
        assert consumer["tokens"] == reference["tokens"]
        np.testing.assert_allclose(
            np.concatenate(consumer["logprobs"]), np.concatenate(reference["logprobs"]), atol=1e-4
        )


def test_blocks_move_between_pipeline_stages_data_parallel_ranks_and_one_device(tp_worker, one_kv_head):
    """Disaggregated prefill on pipeline stages and data-parallel ranks, in bfloat16: one device -> PP 2
    -> DP 2 -> the one device again (its prefix cache reset). A PP=2 producer serves each block as the
    whole model's layers (its stages' blocks joined along the layer axis), a PP=2 consumer splits a
    fetched block by its stages' layers: the same bytes per block on both sides. A DP=2 consumer fetches
    on each rank (its own fetches); a DP=2 producer serves each prompt from the rank that computed it, on
    kv_port + rank (the prompts go to ranks 0, 1, 0). Each consumer fetches every prompt's whole blocks,
    recomputes none, holds no block after (nor its producer a copy) and decodes the plain engine's tokens
    and logprobs bit for bit (a stage's layer put in the other stage's place would change them)."""
    rng = np.random.default_rng(29)
    prompts = [rng.integers(3, 300, n).tolist() for n in (37, 20, 9)]
    layouts = [
        {"dtype": "bfloat16"},
        {"dtype": "bfloat16", "pipeline_parallel_size": 2},
        {"dtype": "bfloat16", "data_parallel_size": 2},
    ]
    arg = {"layouts": layouts, "prompts": prompts, "chain": [0, 1, 2, 0]}
    result = tp_worker.run("transfer_across_stages", one_kv_head, arg)
    reference = result["reference"]
    for consumer in _each_fetched_every_block(result):
        assert consumer["all_free"] and consumer["copies_held"] == 0
        assert (consumer["tokens"], consumer["logprobs"]) == (reference["tokens"], reference["logprobs"])
    assert [c["port_offsets"] for c in result["consumers"]] == [[0, 0, 0], [0, 0, 0], [0, 1, 0]]


def test_a_moe_model_split_by_tokens_and_no_compile_after_warm_up(tp_worker, tmp_path_factory):
    """A tiny Qwen3-MoE (experts in every layer) at PCP 2, warmed up under the strict compile guard
    (every bucket compiled first, nothing after): one device's tokens and logprobs."""
    from helpers.tiny_models import save_tiny_model, small_byte_tokenizer

    moe = save_tiny_model(
        str(tmp_path_factory.mktemp("cp_qwen3_moe")),
        "Qwen3Moe",
        tokenizer=small_byte_tokenizer(),
        num_hidden_layers=2,
        head_dim=16,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
    )
    rng = np.random.default_rng(12)
    prompts = [rng.integers(3, 300, n).tolist() for n in PROMPT_LENGTHS]
    arg = {"layouts": [{}, PCP2], "prompts": prompts, "guarded": PCP2}
    base, pcp = tp_worker.run("context_parallel", moe, arg)
    assert_as_one_device(base, [pcp])
    # The attention projections and the router split (8 rows a device); the experts' grouped matmuls
    # sort every (token, expert) pair of the step, so XLA runs them on the gathered 16 x 2 pairs.
    assert pcp["compiles_after_warm_up"] == 0 and pcp["dot_rows"] == [8, 32]


def test_what_the_models_attention_needs_is_refused_by_name():
    from types import SimpleNamespace

    from xlaserve.kernels import KVCache, MLACache
    from xlaserve.sharding.context_parallel import (
        check_decode_context_parallel,
        check_prefill_context_parallel,
    )

    def model(**fields):
        base = dict(
            architecture="X", num_kv_heads=1, layer_sliding_windows=(None, None), attention_sinks=False
        )
        return SimpleNamespace(**{**base, **fields})

    kv = SimpleNamespace(layer_kind="full_attention", cache_class=KVCache)
    latent = SimpleNamespace(layer_kind="full_attention", cache_class=MLACache)
    hybrid = SimpleNamespace(layer_kind="hybrid", cache_class=KVCache)
    check_prefill_context_parallel(model(), kv, 2)
    check_prefill_context_parallel(model(), latent, 2)  # the latent cache whole on every rank
    check_decode_context_parallel(model(), kv, 2, 4)
    check_decode_context_parallel(model(), latent, 2, 4)  # the latents interleaved like K and V
    check_decode_context_parallel(model(layer_sliding_windows=(None, 128), attention_sinks=True), kv, 2, 4)
    with pytest.raises(ValueError, match=r"^prefill_context_parallel_size=2 .*recurrent states"):
        check_prefill_context_parallel(model(), hybrid, 2)
    with pytest.raises(ValueError, match=r"^decode_context_parallel_size=2 .*recurrent states"):
        check_decode_context_parallel(model(), hybrid, 2, 4)


def test_sliding_windows_and_sinks_under_both(tp_worker, tmp_path_factory):
    """A tiny gpt-oss (one KV head; layers alternate an 8-token window with full attention, each head
    with its sink; experts): at DCP 2 a rank's keys are every second position, so its window is
    counted over the sequence's positions, and the sinks join the merged softmax once; at PCP 2 each
    rank's queries use the window and sinks as one device does. Prompts of 5 to 70 tokens: one device's
    tokens and logprobs, before and after prefix hits."""
    from helpers.tiny_models import save_tiny_model, small_byte_tokenizer

    model = save_tiny_model(
        str(tmp_path_factory.mktemp("cp_gpt_oss")),
        "GptOss",
        tokenizer=small_byte_tokenizer(),
        num_hidden_layers=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
    )
    assert_layouts_as_one_device(tp_worker, model, [DCP2, PCP2], seed=13)


def test_latent_attention_split_by_tokens_and_interleaved(tp_worker, tmp_path_factory):
    """A tiny DeepSeek-V3 (latent attention, experts) at PCP 2 (each rank's tokens through the MLA
    attention as a ragged batch of their own, over the latent cache every rank holds),
    at DCP 2 and DCP 4 (the one shared latent head interleaved over the ranks: each attends the group's
    query heads to its own latents, the partials merged by log-sum-exp), and at PCP 2 with DCP 2 in
    each group (TP 2 under PCP too): one device's tokens and logprobs. Under DCP a rank's latent cache
    holds 1/d of each block's slots, so the budget that holds one device's blocks holds d times as many."""
    from helpers.tiny_models import TINY_DEEPSEEK_V3, save_tiny_model, small_byte_tokenizer

    directory = str(tmp_path_factory.mktemp("cp_deepseek"))
    model = save_tiny_model(directory, "DeepseekV3", tokenizer=small_byte_tokenizer(), **TINY_DEEPSEEK_V3)
    layouts = [PCP2, DCP2, DCP4, PCP2_DCP2]
    results = assert_layouts_as_one_device(tp_worker, model, layouts, seed=14)
    one, dcp2, dcp4, pcp2_dcp2 = (results[str(layout)] for layout in ({}, DCP2, DCP4, PCP2_DCP2))
    latent_dim = TINY_DEEPSEEK_V3["kv_lora_rank"] + TINY_DEEPSEEK_V3["qk_rope_head_dim"]
    shards = [r["k_shard"][1:] for r in (one, dcp2, dcp4, pcp2_dcp2)]
    assert shards == [[16, 1, latent_dim], [8, 1, latent_dim], [4, 1, latent_dim], [8, 1, latent_dim]]
    assert dcp2["num_blocks"] // 2 == dcp4["num_blocks"] // 4 == one["num_blocks"]  # the budget's floor
    assert dcp4["collectives"]["all-gather"] > 0

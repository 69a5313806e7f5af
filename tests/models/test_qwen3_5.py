"""Qwen3_5ForCausalLM (text) against Hugging Face's torch path (no flash-linear-attention), float32.

A tiny random Qwen3.5 of two periods (linear attention, full attention, twice: the scan over periods
offsets both the K/V blocks and the state rows), 4 value heads over 2 key heads, partial RoPE, the
attention output gate, saved as safetensors and served by `LLM`: prompt logprobs of prompts prefilled
in chunks of 16 (the delta rule's state and the conv inputs carried across chunks), 16 greedy tokens
of four requests in flight, and a request preempted mid-decode and recomputed into a state slot
that still holds another request's state: all as Hugging Face's. The cache has two groups: the
attention layers' blocks, and a state slot per request from a pool of 2 * max_num_seqs + 1 (the null
slot, and as many snapshot slots as live ones: prefix caching through snapshots of the state at block
boundaries, whose hits give Hugging Face's tokens too).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

from helpers.family_cases import (
    ENGINE_ARGS,
    FALCON_H1_TEXT,
    GRANITE_HYBRID,
    NUM_GREEDY,
    QWEN3_5_TEXT,
    assert_greedy_and_prompt_logprobs_match,
    hf_greedy,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prefix_hits_against_hugging_face,
    prompts,
    randomize_weights,
    save_hf_model,
    speculation_against_hugging_face,
    speculation_prompts,
    tokens_with_a_preemption,
    word_tokenizer,
)
from helpers.tiny_models import elemental_emitters, save_bigram_llama
from xlaserve import LLM, SamplingParams
from xlaserve.worker.mm_encoder import MAX_TOWER_SCORES_BYTES, patch_buckets

VOCAB = 101
CONFIG = QWEN3_5_TEXT
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    config = transformers.Qwen3_5TextConfig(**CONFIG)
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    # Zero-centred norms (1 + w); the gated norm of the linear attention scales by w itself.
    return randomize_weights(transformers.Qwen3_5ForCausalLM(config).eval(), norm_center=0.0)


@pytest.fixture(scope="module")
def llm(hf_model, tmp_path_factory) -> LLM:
    # Synchronous steps, so the preemption test can drop a request between two of them.
    return LLM(
        save_hf_model(hf_model, tmp_path_factory.mktemp("qwen3_5")), **ENGINE_ARGS, async_scheduling=False
    )


def test_attention_blocks_and_a_state_slot_pool(llm):
    manager = llm.engine_core.kv_cache_manager
    assert manager.enable_caching and manager.snapshots_states
    groups = manager.kv_cache_groups
    assert [(type(g.spec).__name__, g.layer_ids) for g in groups] == [
        ("FullAttentionSpec", (1, 3)),
        ("StateSpec", (0, 2)),
    ]
    state_pool = manager.coordinator.managers[1].pool
    max_num_seqs = ENGINE_ARGS["max_num_seqs"]
    assert state_pool is not manager.block_pool and state_pool.num_blocks == 2 * max_num_seqs + 1
    assert groups[1].spec.num_live_slots == max_num_seqs


def test_greedy_tokens_and_prompt_logprobs_match_hugging_face(llm, hf_model):
    # 21-45 tokens: prefilled in chunks of 16, four in flight
    assert_greedy_and_prompt_logprobs_match(llm, hf_model, prompts(VOCAB, seed=2))
    manager = llm.engine_core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks  # every block back
    state_pool = manager.coordinator.managers[1].pool
    assert state_pool.get_num_free_blocks() == state_pool.num_usable_blocks  # snapshots are evictable


def test_preempted_request_recomputes_the_same_tokens(llm, hf_model):
    """Preempted after 5 tokens (its blocks and slot freed), taken up again from position 0 in a slot
    whose old state the step must ignore: the same 16 tokens as one uninterrupted run."""
    first, other = prompts(VOCAB, seed=3)[1], prompts(VOCAB, seed=3)[3]
    tokens = tokens_with_a_preemption(llm, first, other, GREEDY)
    assert tokens == {"other": hf_greedy(hf_model, other), "victim": hf_greedy(hf_model, first)}


def test_prefix_hits_through_state_snapshots_give_hugging_face_tokens(llm, hf_model):
    """Four prompts one after the other (blocks of 8, chunks of 16): a (39 tokens) is snapshotted at
    its last boundary, 32; b shares 26 tokens with it: its attention hit (24) has no snapshot, so it
    hits nothing and stops its prefill at 24, the branch point, for one; c, sharing the same 26 tokens,
    hits 24; d, a's prompt and more (a next turn), hits 32. Tokens and logprobs as Hugging Face's
    (helpers/family_cases.py)."""
    cached = prefix_hits_against_hugging_face(llm, hf_model, VOCAB)
    assert cached == {"a": 0, "b": 0, "c": 24, "d": 32}


def test_a_budget_short_of_the_snapshot_slots_keeps_fewer(llm, hf_model, tmp_path):
    """A cache budget that holds the live slots, one snapshot slot and the blocks of one request of
    max_model_len, but not the default max_num_seqs snapshot slots: the snapshots are halved until they
    fit (4, 2, then 1; logged), and the engine serves, its prompt's last boundary snapshotted and hit by
    a rerun."""
    spec = llm.engine_core.runner.kv_spec
    slot_bytes = spec.fixed_bytes(4) // spec.num_state_slots
    block_bytes = spec.bytes_per_block(ENGINE_ARGS["block_size"], 4)
    num_blocks = ENGINE_ARGS["max_model_len"] // ENGINE_ARGS["block_size"] + 1  # and the null block
    budget = 6 * slot_bytes + num_blocks * block_bytes + block_bytes // 2  # null + 4 live + 1 snapshot
    tight = LLM(save_hf_model(hf_model, tmp_path), **{**ENGINE_ARGS, "kv_cache_memory": budget})
    state_pool = tight.engine_core.kv_cache_manager.coordinator.state_manager.pool
    assert tight.engine_core.runner.kv_spec.num_state_snapshots == 1 and state_pool.num_blocks == 6
    prompt = prompts(VOCAB, seed=6)[0]
    for num_cached in (0, (len(prompt) - 1) // 8 * 8):
        out = tight.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, prompt)
        assert out.num_cached_tokens == num_cached


def test_ngram_drafts_rejected_restore_the_state_entering_the_step(hf_model, tmp_path):
    """Speculative decoding on a hybrid model: a step verifying drafts keeps the state entering it in a
    spare slot; when a draft is rejected, the live slot holds the state after it, so the backup is
    copied back before the next forward, which computes the accepted tokens again. Greedy tokens as
    Hugging Face's, with verifications that kept every draft and ones that rejected some."""
    seen = speculation_against_hugging_face(save_hf_model(hf_model, tmp_path), hf_model, VOCAB)
    assert any(a == n for n, a in seen) and any(a < n for n, a in seen), seen


def test_draft_model_drafts_on_a_hybrid_target(hf_model, tmp_path):
    """A draft model beside a hybrid target: its K/V cache rides the target's attention block table
    (group 0), the target's state is restored when a draft is rejected, as under n-gram. The draft is
    a bigram Llama that follows a token with what the target did after it in its answer to the first
    prompt, so some verifications keep every draft and others reject some. Greedy tokens as Hugging
    Face's; a hybrid draft is refused by name."""
    path = save_hf_model(hf_model, tmp_path / "target")
    first = speculation_prompts(VOCAB)[0]
    answer = first[-1:] + hf_greedy(hf_model, first)
    next_token = dict(zip(reversed(answer[:-1]), reversed(answer[1:]), strict=True))  # earliest wins
    draft = save_bigram_llama(str(tmp_path / "draft"), next_token, tokenizer=word_tokenizer(VOCAB))
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    seen = speculation_against_hugging_face(path, hf_model, VOCAB, spec)
    assert any(a == n for n, a in seen) and any(a < n for n, a in seen), seen
    with pytest.raises(ValueError, match=r"^speculative_config.model: the draft model must have attention"):
        LLM(path, **ENGINE_ARGS, speculative_config={**spec, "model": path})


def test_a_vision_language_release_serves_text_only(tmp_path):
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration: its decoder under model.language_model, a
    vision tower and config.json's text_config (its images: tests/models/test_qwen_vl.py). With every
    --limit-mm-per-prompt at 0 (vLLM's text-only mode) it starts with no encoder and no tower weight on
    the device, takes a full checkpoint's update (the tower's tensors skipped), and gives Hugging Face's
    greedy tokens on text. Without a processor config, the default max_pixels's images, whose
    tower attention was once too large to start, get patch buckets (the attention runs in query
    blocks)."""
    text = {k: v for k, v in CONFIG.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=16,
    )
    config = transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, eos_token_id=2, pad_token_id=0
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(1)
    hf = randomize_weights(transformers.Qwen3_5ForConditionalGeneration(config).eval(), norm_center=0.0)
    hf.save_pretrained(tmp_path)
    word_tokenizer(VOCAB).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE_ARGS, limit_mm_per_prompt={"image": 0, "video": 0})
    runner = llm.engine_core.runner
    assert runner.mm_encoder is None
    # No tower weight reaches the devices (vLLM skips them too): its leaves are empty placeholders, and
    # the gauge counts the language model's float32 parameters only.
    tower = jax.tree.leaves(runner.params["visual"])
    assert tower and all(leaf.size == 0 for leaf in tower)
    text = sum(p.numel() for name, p in hf.named_parameters() if not name.startswith("model.visual."))
    gauge = next(m.value for m in llm.get_metrics() if m.name == "xlaserve:model_weight_bytes")
    assert gauge == runner.weight_bytes == 4 * text
    # A trainer's full checkpoint, tower included: accepted, the tower's tensors skipped.
    updated = llm.update_weights_from_path(str(tmp_path))
    assert "model.visual.patch_embed.proj.weight" in updated and "lm_head.weight" in updated
    assert all(leaf.size == 0 for leaf in jax.tree.leaves(runner.params["visual"]))
    cfg = runner.model_config
    largest = cfg.max_image_tokens * cfg.vision.merge_unit
    assert cfg.vision.num_heads * largest**2 * 4 > MAX_TOWER_SCORES_BYTES  # dense scores: refused once
    doublings = [64 * 2**i for i in range(largest.bit_length()) if 64 * 2**i < largest]
    assert patch_buckets(cfg.vision, largest) == [*doublings, largest]
    batch = prompts(VOCAB, seed=4)[:2]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(hf, p) for p in batch]


def test_bfloat16_tokens_and_logprobs_are_the_same_bits_alone_and_among_companions(hf_model, tmp_path):
    """Batch invariance through the linear attention at the dtype users run: a request's greedy tokens
    and logprobs alone equal, bit for bit, those it gets among 1 and 6 companions (other token and
    request buckets, its prompt cut into other chunks, steps mixing prefill chunks and decodes: the
    delta rule runs token by token, kernels/gated_delta.py). At these tiny widths the chunked form
    happens to round alike once cast to bfloat16; tests/kernels/test_gated_delta.py shows, in float32,
    the bits it would change and the token-by-token form keeps."""
    llm = LLM(
        save_hf_model(hf_model, tmp_path),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=16,  # token buckets 1, 4, 16; request buckets 1, 4, 8
        block_size=8,
        kv_cache_memory=2**20,
    )
    rng = np.random.default_rng(7)
    batch = [rng.integers(3, VOCAB, n).tolist() for n in (21, 6, 40, 13, 27, 9, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    num_cached = []

    def numbers(requests: list[list[int]]):
        outs = llm.generate([{"prompt_token_ids": p} for p in requests], params, use_tqdm=False)
        num_cached.append([o.num_cached_tokens for o in outs])
        return [
            (
                o.outputs[0].token_ids,
                [sorted((i, lp.logprob) for i, lp in e.items()) for e in o.outputs[0].logprobs],
            )
            for o in outs
        ]

    alone = numbers(batch[:1])[0]
    assert numbers(batch[:2])[0] == alone
    assert numbers(batch[1:4] + batch[:1] + batch[4:])[3] == alone
    # The reruns start from the state snapshot the first run left at 16 tokens (prefix caching): the
    # same bits as computing the prompt whole.
    assert num_cached[0][0] == 0 and num_cached[1][0] == 16 and num_cached[2][3] == 16


NEXT = dict(
    CONFIG,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    norm_topk_prob=True,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
)


def hf_compared_engine(hf, tmp_path) -> LLM:
    """An engine on `hf`'s weights, for a test comparing it with Hugging Face's outputs only."""
    with elemental_emitters():
        return LLM(save_hf_model(hf, tmp_path), **ENGINE_ARGS)


def test_qwen3_next_matches_hugging_face(tmp_path):
    """Qwen3-Next: the same hybrid layers with its fused DeltaNet projections (regrouped per key head
    at load) and a mixture of experts with a gated shared expert in every layer: greedy tokens and
    prompt logprobs of chunked requests in flight, as Hugging Face's."""
    config = transformers.Qwen3NextConfig(**NEXT)
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(2)
    hf = randomize_weights(transformers.Qwen3NextForCausalLM(config).eval(), norm_center=0.0)
    llm = hf_compared_engine(hf, tmp_path)
    assert_greedy_and_prompt_logprobs_match(llm, hf, prompts(VOCAB, seed=5))


@pytest.mark.parametrize("position_embedding_type", ["rope", None], ids=["rope", "nope"])
def test_granite_4_hybrid_matches_hugging_face(position_embedding_type, tmp_path):
    """Granite 4.0-H: Mamba2 layers beside attention layers (RoPE, or none), experts and a shared MLP
    in every layer, Granite's embedding, residual, attention and logit scalings: greedy tokens and
    prompt logprobs of chunked requests in flight, as Hugging Face's."""
    config = transformers.GraniteMoeHybridConfig(
        **GRANITE_HYBRID, position_embedding_type=position_embedding_type
    )
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    torch.manual_seed(3)
    hf = randomize_weights(transformers.GraniteMoeHybridForCausalLM(config).eval())
    llm = hf_compared_engine(hf, tmp_path)
    assert_greedy_and_prompt_logprobs_match(llm, hf, prompts(VOCAB, seed=6))


def test_qwen3_5_moe_matches_hugging_face(tmp_path):
    """Qwen3.5-MoE: Qwen3.5's unfused DeltaNet projections with Qwen3-Next's experts and gated shared
    expert: greedy tokens of chunked requests in flight, as Hugging Face's."""
    fields = {k: v for k, v in NEXT.items() if k != "norm_topk_prob"}  # always renormalized
    config = transformers.Qwen3_5MoeTextConfig(**fields)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    torch.manual_seed(4)
    hf = randomize_weights(transformers.Qwen3_5MoeForCausalLM(config).eval(), norm_center=0.0)
    llm = hf_compared_engine(hf, tmp_path)
    batch = prompts(VOCAB, seed=7)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(hf, p) for p in batch]


FALCON_H1 = FALCON_H1_TEXT


@pytest.mark.parametrize(
    "gate_norm",
    [{"mamba_rms_norm": True, "mamba_norm_before_gate": True}, {"mamba_rms_norm": False}],
    ids=["rms_norm_before_gate", "no_norm"],
)
def test_falcon_h1_matches_hugging_face(gate_norm, tmp_path):
    """Falcon-H1: Mamba2 and attention side by side in every layer (each layer has K/V blocks and a
    state slot), with its muP multipliers and the mixer's gated norm (before the gate) or none:
    greedy tokens and prompt logprobs of chunked requests in flight, as Hugging Face's."""
    config = transformers.FalconH1Config(**FALCON_H1, **gate_norm)
    config.architectures = ["FalconH1ForCausalLM"]
    torch.manual_seed(5)
    hf = randomize_weights(transformers.FalconH1ForCausalLM(config).eval())
    llm = hf_compared_engine(hf, tmp_path)
    groups = llm.engine_core.kv_cache_manager.kv_cache_groups
    assert [(type(g.spec).__name__, g.layer_ids) for g in groups] == [
        ("FullAttentionSpec", (0, 1)),
        ("StateSpec", (0, 1)),
    ]
    assert_greedy_and_prompt_logprobs_match(llm, hf, prompts(VOCAB, seed=8))


JAMBA = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_layer_period=4,
    attn_layer_offset=1,  # mamba, attention, mamba, mamba
    expert_layer_period=2,
    expert_layer_offset=1,  # experts in layers 1 and 3: each mixer with either feed-forward
    num_experts=4,
    num_experts_per_tok=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank=4,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def test_jamba_matches_hugging_face(tmp_path):
    """Jamba: Mamba (v1: the selective scan over a [D, N] state per slot, with dt/B/C norms) beside
    NoPE attention, experts (softmax over all, top k not renormalized) in every other layer, a SwiGLU
    MLP in the rest: greedy tokens and prompt logprobs of chunked requests in flight, as HF's."""
    config = transformers.JambaConfig(**JAMBA)
    config.architectures = ["JambaForCausalLM"]
    torch.manual_seed(6)
    hf = randomize_weights(transformers.JambaForCausalLM(config).eval())
    with torch.no_grad():  # HF's A_log: log(1..N) per channel; random ones would make A tiny or huge
        for layer in hf.model.layers:
            if hasattr(layer, "mamba"):
                layer.mamba.A_log.copy_(torch.log(torch.arange(1.0, 9.0)).expand(64, -1))
    llm = hf_compared_engine(hf, tmp_path)
    groups = llm.engine_core.kv_cache_manager.kv_cache_groups
    assert [(type(g.spec).__name__, g.layer_ids) for g in groups] == [
        ("FullAttentionSpec", (1,)),
        ("StateSpec", (0, 2, 3)),
    ]
    assert_greedy_and_prompt_logprobs_match(llm, hf, prompts(VOCAB, seed=9))

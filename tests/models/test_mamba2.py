"""Mamba2ForCausalLM against Hugging Face's (its torch fallback path, no mamba_ssm), float32.

A tiny random Mamba2 (2 layers, 8 heads of 8, state 8, 2 groups, conv kernel 4) saved as safetensors
and served by `LLM`: prompt logprobs of a 45-token prompt prefilled in chunks of 16 (the state
carried across chunks, the conv reading the previous chunk's inputs), 16 greedy tokens of four
requests in flight (chunked prefill, then decode by the recurrent form), and a request preempted
mid-decode and recomputed into a slot that still holds another state: all as Hugging Face's.
The cache is one state slot per request (core/kv_cache_spec.py `StateSpec`), and prefixes are cached
as snapshots of the state in slots of the same pool, taken where a step ends on a block boundary.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers.family_cases import (
    ENGINE_ARGS,
    NUM_GREEDY,
    assert_greedy_and_prompt_logprobs_match,
    hf_greedy,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prefix_hits_against_hugging_face,
    prompts,
    randomize_weights,
    save_hf_model,
    speculation_against_hugging_face,
    tokens_with_a_preemption,
)
from xlaserve import LLM, SamplingParams

VOCAB = 101
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    expand=2,
    num_heads=8,
    head_dim=8,
    state_size=8,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,
    num_hidden_layers=2,
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    config = transformers.Mamba2Config(**CONFIG)
    config.architectures = ["Mamba2ForCausalLM"]
    torch.manual_seed(0)
    return randomize_weights(transformers.Mamba2ForCausalLM(config).eval())


@pytest.fixture(scope="module")
def llm(hf_model, tmp_path_factory) -> LLM:
    # Synchronous steps, so the preemption test can drop a request between two of them.
    return LLM(
        save_hf_model(hf_model, tmp_path_factory.mktemp("mamba2")), **ENGINE_ARGS, async_scheduling=False
    )


def test_one_state_slot_per_request_and_snapshots_in_the_same_pool(llm):
    manager = llm.engine_core.kv_cache_manager
    assert manager.enable_caching and manager.snapshots_states
    assert [type(g.spec).__name__ for g in manager.kv_cache_groups] == ["StateSpec"]
    assert manager.coordinator.state_manager.pool is manager.block_pool


def test_prefix_hits_through_state_snapshots_give_hugging_face_tokens(llm, hf_model):
    """As Qwen3.5's (test_qwen3_5.py), without attention blocks to show where b's prefix leaves a's:
    b and c hit nothing (no snapshot ends inside their shared 26 tokens); d, a's next turn, hits a's
    last boundary, 32."""
    cached = prefix_hits_against_hugging_face(llm, hf_model, VOCAB)
    assert cached == {"a": 0, "b": 0, "c": 0, "d": 32}


def test_features_a_state_cannot_serve_are_refused_by_name(hf_model, tmp_path):
    path = save_hf_model(hf_model, tmp_path)
    transfer = {"kv_connector": "JaxConnector", "kv_role": "kv_both", "kv_port": 1}
    for kwargs, field in (
        ({"kv_offloading_size": 0.01}, "kv_offloading_size"),
        ({"kv_transfer_config": transfer}, "kv_transfer_config"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ):
        with pytest.raises(ValueError, match=rf"^{field}.*not supported for models with state-space layers"):
            LLM(path, **ENGINE_ARGS, **kwargs)


def test_ngram_drafts_rejected_restore_the_state_entering_the_step(hf_model, tmp_path):
    """As Qwen3.5's (test_qwen3_5.py), with the backups drawn from the shared pool of slots (this
    random model's outputs never follow the prompts' pattern: every verification rejects, and each
    restores its backup); a draft model is refused by name (its K/V cache would follow the slots)."""
    path = save_hf_model(hf_model, tmp_path)
    seen = speculation_against_hugging_face(path, hf_model, VOCAB)
    assert seen and all(a < n for n, a in seen), seen
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"^speculative_config: method 'draft_model' is not supported.*only"):
        LLM(path, **ENGINE_ARGS, speculative_config=draft)


def test_greedy_tokens_and_prompt_logprobs_match_hugging_face(llm, hf_model):
    # 21-45 tokens: prefilled in chunks of 16, four in flight
    assert_greedy_and_prompt_logprobs_match(llm, hf_model, prompts(VOCAB, seed=2))


def test_preempted_request_recomputes_the_same_tokens(llm, hf_model):
    """Preempted after 5 tokens (its slot freed), taken up again from position 0 in a slot whose old
    state the step must ignore: the same 16 tokens as one uninterrupted run."""
    first, other = prompts(VOCAB, seed=3)[1], prompts(VOCAB, seed=3)[3]
    tokens = tokens_with_a_preemption(llm, first, other, GREEDY)
    assert tokens == {"other": hf_greedy(hf_model, other), "victim": hf_greedy(hf_model, first)}


def test_bfloat16_states_cross_steps_whole_however_the_prompt_is_cut(hf_model, tmp_path):
    """At the dtype users run: the conv inputs cross steps as the cache's raw words (kernels/ssd.py; a
    numeric cast to those integers once zeroed them) and the SSM state in float32, so a prompt prefilled
    in chunks of 4 and of 16 gives the same bits, near Hugging Face's float32 prompt logprobs; and among
    companions (their states in other slots, other request buckets) the same bits again."""
    path = save_hf_model(hf_model, tmp_path)
    prompt, *companions = prompts(VOCAB, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=0)

    def numbers(out):
        logprobs = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        decoded = [[(t, lp.logprob) for t, lp in e.items()] for e in out.outputs[0].logprobs]
        return list(out.outputs[0].token_ids), logprobs, decoded

    runs = []
    for threshold in (4, 16):
        llm = LLM(path, **{**ENGINE_ARGS, "dtype": "bfloat16", "long_prefill_token_threshold": threshold})
        runs.append(numbers(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]))
    crowd = [{"prompt_token_ids": p} for p in (companions[0], prompt, *companions[1:])]
    runs.append(numbers(llm.generate(crowd, params, use_tqdm=False)[1]))
    del llm
    assert runs[0] == runs[1] == runs[2]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(runs[0][1], expected.tolist())) < 0.05


def test_mamba_v1_matches_hugging_face(tmp_path):
    """MambaForCausalLM (v1): the selective scan over a [D, N] state per channel (kernels/
    selective_scan.py) in Mamba2's cache layout (a head per channel), tied embeddings: greedy tokens
    and prompt logprobs of chunked requests in flight, as Hugging Face's."""
    config = transformers.MambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        time_step_rank=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config.architectures = ["MambaForCausalLM"]
    torch.manual_seed(1)
    hf = randomize_weights(transformers.MambaForCausalLM(config).eval())
    with torch.no_grad():  # HF's A_log: log(1..N) per channel; random ones would make A tiny or huge
        for layer in hf.backbone.layers:
            layer.mixer.A_log.copy_(torch.log(torch.arange(1.0, 9.0)).expand(64, -1))
    llm = LLM(save_hf_model(hf, tmp_path), **ENGINE_ARGS)
    assert [type(g.spec).__name__ for g in llm.engine_core.kv_cache_manager.kv_cache_groups] == ["StateSpec"]
    assert_greedy_and_prompt_logprobs_match(llm, hf, prompts(VOCAB, seed=3))

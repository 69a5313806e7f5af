"""Mamba2ForCausalLM against Hugging Face's (its torch fallback path, no mamba_ssm), float32.

A tiny random Mamba2 (2 layers, 8 heads of 8, state 8, 2 groups, conv kernel 4) saved as safetensors
and served by `LLM`: prompt logprobs of a 45-token prompt prefilled in chunks of 16 (the state
carried across chunks, the conv reading the previous chunk's inputs), 16 greedy tokens of four
requests in flight (chunked prefill, then decode by the recurrent form), and a request preempted
mid-decode and recomputed into a slot that still holds another state: all as Hugging Face's.
The cache is one state slot per request, prefix caching off (core/kv_cache_spec.py `StateSpec`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from helpers.family_cases import (
    ENGINE_ARGS,
    NUM_GREEDY,
    hf_greedy,
    hf_logits,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prompts,
    randomize_weights,
    save_hf_model,
)
from xlaserve import LLM, SamplingParams
from xlaserve.core.outputs import SchedulerOutput
from xlaserve.core.request import Request

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


def test_one_state_slot_per_request_and_no_prefix_cache(llm):
    manager = llm.engine_core.kv_cache_manager
    assert not manager.enable_caching
    assert [type(g.spec).__name__ for g in manager.kv_cache_groups] == ["StateSpec"]


def test_greedy_tokens_and_prompt_logprobs_match_hugging_face(llm, hf_model):
    batch = prompts(VOCAB, seed=2)  # 21-45 tokens: prefilled in chunks of 16, four in flight
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(hf_model, p) for p in batch]
    for ids, out in zip(batch, outputs):
        ours = np.array([entry[t].logprob for t, entry in zip(ids[1:], out.prompt_logprobs[1:])])
        expected = torch.log_softmax(torch.tensor(hf_logits(hf_model, ids)), -1).numpy()
        np.testing.assert_allclose(ours, expected[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=1e-4)


def test_preempted_request_recomputes_the_same_tokens(llm, hf_model):
    """Preempted after 5 tokens (its slot freed), taken up again from position 0 in a slot whose old
    state the step must ignore: the same 16 tokens as one uninterrupted run."""
    core = llm.engine_core
    first, other = prompts(VOCAB, seed=3)[1], prompts(VOCAB, seed=3)[3]
    core.add_request(Request("other", other, GREEDY, eos_token_id=2))
    core.add_request(Request("victim", first, GREEDY, eos_token_id=2))
    tokens: dict[str, list[int]] = {"other": [], "victim": []}
    is_preempted = False
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
        if not is_preempted and len(tokens["victim"]) == 5:
            scheduler = core.scheduler
            victim = next(i for i, r in enumerate(scheduler.running) if r.request_id == "victim")
            scheduler._preempt(victim, SchedulerOutput())
            is_preempted = True
    assert is_preempted and core.scheduler.num_preemptions_total >= 1
    assert tokens == {"other": hf_greedy(hf_model, other), "victim": hf_greedy(hf_model, first)}

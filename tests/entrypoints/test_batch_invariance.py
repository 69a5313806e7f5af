"""Batch invariance at the dtype users run (bfloat16): a request's tokens and logprobs are the same bits
alone and among companions, in every request bucket, chunked or not, with its prefix computed or read
from the prefix cache (kernels/invariant.py; README "Batch invariance")."""

from __future__ import annotations

import pytest

from xlaserve import SamplingParams, StructuredOutputsParams

PROMPTS = [
    "Explain paged attention in two sentences.",
    "Write a haiku about XLA.",
    "List three uses of a hash map.",
    "Why is the sky blue?",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)


@pytest.fixture(scope="module")
def llm(llm_bf16):
    # The session's bfloat16 SmolLM2 (conftest.py). Prefix caching on: the crowded runs below read the
    # prompts' full blocks from the cache that the lone runs filled; 128 tokens a step: crowded prompts
    # are chunked.
    return llm_bf16


def _chat(llm, prompts):
    return [
        o.outputs[0]
        for o in llm.chat([[{"role": "user", "content": p}] for p in prompts], PARAMS, use_tqdm=False)
    ]


def _numbers(out):
    return out.token_ids, [[(i, lp.logprob) for i, lp in entry.items()] for entry in out.logprobs]


def _request_numbers(output):
    """A RequestOutput's sampled numbers and its prompt logprobs (None where not asked)."""
    prompt = output.prompt_logprobs and [
        entry and sorted((i, lp.logprob) for i, lp in entry.items()) for entry in output.prompt_logprobs
    ]
    return _numbers(output.outputs[0]), prompt


def _companions(n: int) -> list[str]:
    return [f"Tell me a fact about the number {i}, then one about {i * 7}." for i in range(n)]


def test_tokens_and_logprobs_are_the_same_bits_alone_and_in_any_crowd(llm):
    alone = [_numbers(_chat(llm, [p])[0]) for p in PROMPTS]
    stats = llm.engine_core.kv_cache_manager.prefix_cache_stats
    hits_before = stats.num_hits
    # The prompts two by two, then all four at once: request bucket 4, with two rows and with four.
    # Then the four among 12 companions (16 requests, max_num_seqs): request bucket 16. Decode-only
    # and mixed steps, chunked prefills.
    crowds = [PROMPTS[:2], PROMPTS[2:], list(PROMPTS)]
    crowd = _companions(12)
    for index, prompt in enumerate(PROMPTS):
        crowd.insert(5 * index, prompt)  # at 0, 5, 10 and 15
    crowds.append(crowd)
    for crowd in crowds:
        outputs = _chat(llm, crowd)
        for index, prompt in enumerate(PROMPTS):
            if prompt in crowd:
                got = outputs[crowd.index(prompt)]
                assert _numbers(got) == alone[index], f"{prompt!r} among {len(crowd) - 1} others"
    # The crowded runs read the lone runs' full blocks from the prefix cache (unless the engine's
    # metrics snapshot reset the counters: then some hit was counted since).
    assert llm.engine_core.kv_cache_manager.prefix_cache_stats.num_hits > 0 or stats.num_hits > hits_before


# ~300 tokens: past the attention's short-context limit (256), so the fed-back prompt's last chunk is the
# kind of step the tiled long path took before invariance (kernels/reference.py), while its tokens were
# decoded one by one.
LONG_PROMPT = (
    " ".join(
        f"Step {i}: the scheduler admits request {i * 3 % 17}, its blocks come from the free list."
        for i in range(18)
    )
    + " Summarize the steps above."
)


@pytest.mark.parametrize("prompt", [PROMPTS[0], LONG_PROMPT], ids=["short", "long"])
def test_sampled_logprobs_equal_the_teacher_forced_prompt_logprobs(llm, prompt):
    """The logprob of each generated token, and the prompt logprob of that token when the sequence is
    fed back as a prompt: the trainer's forward and the sampler's agree bit for bit, for a context
    short enough for one step and for one that is chunked (128 tokens a step) past 256 tokens."""
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, logprobs=0), use_tqdm=False)[0]
    if prompt is LONG_PROMPT:
        assert 256 < len(out.prompt_token_ids) < 400
    generated = out.outputs[0]
    fed_back = {"prompt_token_ids": list(out.prompt_token_ids) + list(generated.token_ids)}
    again = llm.generate(fed_back, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    num_prompt = len(out.prompt_token_ids)
    teacher = [again.prompt_logprobs[num_prompt + i][t].logprob for i, t in enumerate(generated.token_ids)]
    sampled = [generated.logprobs[i][t].logprob for i, t in enumerate(generated.token_ids)]
    assert teacher == sampled


def _sampling_features(llm) -> dict[str, SamplingParams]:
    """A request of each sampler feature whose tensors span the batch: the [R, V] penalty arrays are built
    (another program) when any row needs them, the grammar's bitmask when any row has a grammar, the
    top-k/top-p sort runs when any row filters, and the greedy rows ride the random rows' branch when
    any row samples."""
    the = llm.tokenizer.encode(" the")[0]
    greedy = dict(temperature=0.0, max_tokens=12, logprobs=5)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return {
        "plain": SamplingParams(**greedy),
        "penalties": SamplingParams(
            **greedy, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2
        ),
        "logit_bias": SamplingParams(**greedy, logit_bias={the: -5.0, 13: 3.0}),
        "bad_words": SamplingParams(**greedy, bad_words=["the", "a"]),
        "min_tokens": SamplingParams(**greedy, min_tokens=12),
        "allowed_token_ids": SamplingParams(**greedy, allowed_token_ids=list(range(200, 3000))),
        "seeded": SamplingParams(temperature=0.9, max_tokens=12, logprobs=5, seed=7),
        "seeded_top_k_top_p_min_p": SamplingParams(
            temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, max_tokens=12, logprobs=5, seed=11
        ),
        "seeded_penalized": SamplingParams(
            temperature=0.8, max_tokens=12, logprobs=5, seed=5, repetition_penalty=1.3
        ),
        "prompt_logprobs": SamplingParams(**{**greedy, "max_tokens": 4}, prompt_logprobs=5),
        "json_schema": SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(json=schema)),
    }


@pytest.fixture(scope="module")
def features_alone(llm):
    """(prompts, features, each feature's request run alone): one prompt per feature."""
    features = _sampling_features(llm)
    prompts = (PROMPTS + _companions(len(features)))[: len(features)]
    alone = {
        name: _request_numbers(llm.generate(prompt, params, use_tqdm=False)[0])
        for prompt, (name, params) in zip(prompts, features.items())
    }
    return prompts, features, alone


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_every_sampler_feature_is_the_same_bits_alone_and_among_the_others(llm, features_alone, scheduling):
    """Each feature's request alone, then all of them in one batch (each its own prompt): every one
    keeps its solo tokens, logprobs and prompt logprobs, though the batch now runs the penalty and
    grammar programs, the top-k/top-p sort and the random rows' branch for rows that asked for none.
    With async scheduling too (the default on accelerators), where each step is scheduled before the
    previous one's tokens are known: penalties, bad words and grammars read the outputs they wait for."""
    prompts, features, alone = features_alone
    default = llm.engine_core.async_scheduling
    llm.engine_core.set_async_scheduling(scheduling == "async")
    try:
        together = llm.generate(prompts, list(features.values()), use_tqdm=False)
    finally:
        llm.engine_core.set_async_scheduling(default)
    for name, output in zip(features, together):
        assert _request_numbers(output) == alone[name], name

"""Structured outputs through the offline `LLM` on SmolLM2, under the conditions that stress a
matcher: chunked prefill (only the sampling step is masked), prefix-cache hits, preemption by
recompute (the matcher's state depends on output tokens only, so it survives), n > 1 and seeds;
and nothing compiles after warm-up (the masked sampler variants are all warm)."""

from __future__ import annotations

import re

from xlaserve import SamplingParams, StructuredOutputsParams
from xlaserve.worker.compile_guard import num_compiles

WORDS = r"([a-z]{2,6} ){12}end"  # ~25 tokens that only the grammar's end can stop


def test_grammars_survive_preemption_chunking_and_the_prefix_cache(llm):
    llm.reset_prefix_cache()
    scheduler = llm.engine_core.scheduler
    preemptions_before, compiles_before = scheduler.num_preemptions_total, num_compiles()
    # A shared prefix of two blocks (cached after the first request), then ~150 tokens of each
    # request's own, so every prompt is longer than max_num_batched_tokens (128) and its prefill is
    # chunked; 16 such requests need more blocks than the KV cache holds, so some are preempted.
    prefix = "Here is a long list of short lowercase words, one after another, with nothing else. " * 2
    prompts = [prefix + " ".join(f"item {i * 100 + j}" for j in range(34)) for i in range(16)]
    tokenizer, cache = llm.get_tokenizer(), llm.engine_core.kv_cache_manager
    assert min(len(tokenizer.encode(p)) for p in prompts) > 128
    assert (
        sum(len(tokenizer.encode(p)) + 25 for p in prompts) > 1.2 * cache.num_usable_blocks * cache.block_size
    )
    params = [
        SamplingParams(
            temperature=1.0,
            seed=100 + i,
            max_tokens=60,
            structured_outputs=StructuredOutputsParams(regex=WORDS),
        )
        for i in range(16)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert scheduler.num_preemptions_total > preemptions_before
    assert max(o.num_cached_tokens for o in outputs) >= 32
    for output in outputs:
        completion = output.outputs[0]
        assert re.fullmatch(WORDS, completion.text), completion.text
        assert completion.finish_reason == "stop"
    # A seeded request draws the same tokens alone as it did among the others (the last admitted is
    # the first FCFS preempts).
    alone = llm.generate(prompts[15], params[15], use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == outputs[15].outputs[0].token_ids
    assert num_compiles() == compiles_before


def test_n_children_each_follow_the_grammar(llm):
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=3,
        max_tokens=12,
        logprobs=1,
        structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue", "light gray"]),
    )
    (output,) = llm.chat([{"role": "user", "content": "Name a color."}], params, use_tqdm=False)
    for completion in output.outputs:
        assert (
            completion.text in ("red", "green", "blue", "light gray") and completion.finish_reason == "stop"
        )
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(entry[t].logprob > -1e9 for entry, t in zip(completion.logprobs, completion.token_ids))

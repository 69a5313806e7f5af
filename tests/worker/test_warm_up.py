"""Warm-up compiles in a thread pool, ahead of time (`lower().compile()`): the programs it compiles
must be the very ones the steps call, or the first steps would compile again. A tiny engine under
the strict compile guard runs every sampler variant (greedy, random with top-p, penalties, logprobs
on and off, prompt logprobs, a grammar) in every bucket after warm-up and compiles nothing."""

from __future__ import annotations

import dataclasses

import pytest

from helpers.tiny_models import save_tiny_llama
from xlaserve import SamplingParams, StructuredOutputsParams
from xlaserve.worker import warm_up
from xlaserve.worker.compile_guard import num_compiles


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from xlaserve.entrypoints.llm import LLM

    model = save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama_warm_up")))
    llm = LLM(
        model,
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        kv_cache_memory=2**22,
        strict_compile_guard=True,
    )
    yield llm
    llm.shutdown()


def test_no_step_compiles_after_the_parallel_warm_up(tiny_llm):
    runner = tiny_llm.engine_core.runner
    assert runner.token_buckets == [1, 4, 16, 32]
    before = num_compiles()
    grammar = StructuredOutputsParams(regex="[ab]+")
    variants = [
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=5, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=grammar),
    ]
    # Prompts of 1 to ~30 tokens, alone and together: steps land in every token and request bucket.
    prompts = ["hi", "a b c d e f g h", "one two three four five six seven eight nine ten " * 2]
    for params in variants:
        tiny_llm.generate(prompts[:1], params, use_tqdm=False)
        tiny_llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    tiny_llm.generate(prompts + prompts[:1], variants[:4], use_tqdm=False)  # mixed variants in one step
    assert num_compiles() == before
    # Per token bucket a forward and prompt logprobs; per request bucket (1 and 4) four sampler variants.
    assert runner.num_programs_compiled == 4 * 2 + 2 * 4


def test_plain_sampling_only_prepares_the_forwards_and_the_plain_sampler(tiny_llm, monkeypatch):
    """warm_up_plain_sampling_only: warm-up prepares each token bucket's forward and each request bucket's
    sampler without penalties or a grammar (the variant the test above shows plain steps run), and no
    prompt-logprobs program. Read on the engine above: each program prepared is its executable already
    compiled, so nothing compiles."""
    runner = tiny_llm.engine_core.runner
    compilation = dataclasses.replace(runner.config.compilation, warm_up_plain_sampling_only=True)
    monkeypatch.setattr(runner, "config", dataclasses.replace(runner.config, compilation=compilation))
    monkeypatch.setattr(runner, "num_programs_compiled", runner.num_programs_compiled)
    prepared = []

    def compiled_before(store, program, args, kwargs):
        if program.name == "sample":
            assert not args[2].has_penalties and args[2].allowed_token_bitmask is None
        prepared.append(program.name)
        return program.executables[program.signature(args, kwargs)], True

    monkeypatch.setattr(warm_up, "_load_or_compile", compiled_before)
    before = num_compiles()
    warm_up.compile_all(runner)
    assert num_compiles() == before
    assert sorted(prepared) == ["forward"] * 4 + ["sample"] * 2  # token buckets 1, 4, 16, 32; rows 1, 4


def test_the_speculative_lone_bucket_shares_the_lone_requests_sampler():
    """k = 2 adds a token bucket of 3 with one sequence row (its forward only: the sampler and verify
    programs are request bucket 1's); a step of 3 tokens from 2 requests takes bucket 4."""
    from xlaserve.worker.buckets import pick_bucket, request_bucket

    buckets = [1, 3, 4, 16]
    rows = {n: request_bucket(n, 4, lone_buckets=(3,)) for n in buckets}
    assert rows == {1: 1, 3: 1, 4: 4, 16: 4}
    assert [pick_bucket(buckets, 3, n, rows.get) for n in (1, 2, 3)] == [3, 4, 4]


def test_chosen_capture_sizes_replace_the_default_buckets():
    """cudagraph_capture_sizes are the buckets (max_num_batched_tokens always one, larger sizes dropped,
    speculative decoding's 1 + k kept); a step pads to the smallest chosen one that holds it."""
    from xlaserve.config import EngineConfig
    from xlaserve.worker.buckets import make_token_buckets, pick_bucket

    config = EngineConfig.from_kwargs(None, cudagraph_capture_sizes=[64, 8, 1, 8], max_num_batched_tokens=32)
    sizes = config.compilation.cudagraph_capture_sizes
    assert sizes == (1, 8, 64)
    assert make_token_buckets(32, sizes=sizes) == [1, 8, 32]
    assert make_token_buckets(32, (4,), sizes) == [1, 4, 8, 32]
    assert make_token_buckets(32) == [1, 4, 16, 32]
    assert [pick_bucket([1, 8, 32], n) for n in (1, 2, 8, 9)] == [1, 8, 8, 32]
    for bad in ([0], [2, -1], "16", [1.5], [True]):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes must be a list of token counts"):
            EngineConfig.from_kwargs(None, cudagraph_capture_sizes=bad)

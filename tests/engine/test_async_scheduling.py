"""Async scheduling on SmolLM2 (float32): the engine scheduling step N+1 while step N runs streams
exactly what it streams synchronously, for every sampling feature at once, emits nothing past a stop,
and gives every KV block back. One engine (the shared `llm`, synchronous by default on a CPU) runs each
workload in both modes (`set_async_scheduling`), its prefix cache reset before each run so both start
alike; the strict compile guard proves nothing compiles after warm-up in either mode. Requests whose
K/V goes mid-generation (vLLM's reset_prefix_cache(reset_running_requests=True), a sleep that keeps
them) recompute it, with a step in flight or not, to exactly the ids of an undisturbed run."""

from __future__ import annotations

import itertools

import pytest

from xlaserve import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Count to ten: one, two,",
    "def fibonacci(n):",
    "My favourite colour is",
    "Write a haiku about the sea.",
    "The three primary colours are",
    "Q: What is 12 times 12?\nA:",
    "Once upon a time, in a small village,",
]
PHONE = r"[0-9]{3}-[0-9]{4}"


def _params(tokenizer) -> list[SamplingParams]:
    comma, period = tokenizer.encode(",")[0], tokenizer.encode(".")[0]
    return [
        SamplingParams(temperature=0.0, max_tokens=24),  # greedy
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7, max_tokens=20),  # seeded
        SamplingParams(temperature=0.0, max_tokens=40, stop=[" and", "e"]),  # stop strings (mid-token)
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[comma, period]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=1),  # max_tokens exact, at its smallest
        SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=9, logprobs=3),  # n > 1, logprobs
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=2),
        # Penalties and min_tokens: through the synchronous fallback (they read the output ids).
        SamplingParams(
            temperature=0.7,
            seed=5,
            max_tokens=16,
            min_tokens=10,
            presence_penalty=0.8,
            frequency_penalty=0.4,
            repetition_penalty=1.3,
        ),
    ]


def _view(outputs):
    return [
        [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
            for c in o.outputs
        ]
        + [o.prompt_logprobs]
        for o in outputs
    ]


@pytest.fixture(scope="module")
def engines(llm):
    """What the tests run in both modes: the async engine, then the same synchronous."""
    assert not llm.engine_core.async_scheduling  # the default where the devices are the host's CPU
    yield _InMode(llm, True), _InMode(llm, False)
    llm.engine_core.set_async_scheduling(False)


class _InMode:
    """The shared engine, switched to one mode (and its prefix cache reset) before each use."""

    def __init__(self, llm, is_async: bool):
        self.llm, self.is_async = llm, is_async

    def __enter__(self):
        self.llm.engine_core.set_async_scheduling(self.is_async)
        assert self.llm.reset_prefix_cache()
        return self.llm

    def __exit__(self, *exc):
        return False


def _generate_both(engines, prompts, params):
    results = []
    for mode in engines:
        with mode as engine:
            manager = engine.engine_core.kv_cache_manager
            free_blocks = manager.num_free_blocks
            results.append(engine.generate(prompts, params, use_tqdm=False))
            assert manager.num_free_blocks == free_blocks  # no block leaked
    return results


def test_every_sampling_feature_matches_sync(engines):
    tokenizer = engines[0].llm.tokenizer
    asyn, sync = _generate_both(engines, PROMPTS, _params(tokenizer))
    assert _view(asyn) == _view(sync)
    comma, period = tokenizer.encode(",")[0], tokenizer.encode(".")[0]
    stop_ids = asyn[3].outputs[0].token_ids
    # Nothing past a stop: the stop id ends the output, and only there.
    assert asyn[3].outputs[0].finish_reason == "stop" and stop_ids[-1] in (comma, period)
    assert not {comma, period} & set(stop_ids[:-1])
    stop_string = asyn[2].outputs[0]
    assert stop_string.finish_reason == "stop" and stop_string.stop_reason in (" and", "e")
    assert len(asyn[4].outputs[0].token_ids) == 1  # max_tokens exact
    assert [len(c.token_ids) for c in asyn[5].outputs] == [9, 9, 9]
    assert len(asyn[7].outputs[0].token_ids) >= 10  # min_tokens


def test_prefix_cache_hits_match_sync(engines):
    shared = "You are a helpful assistant who answers in one short sentence, politely. " * 3
    prompts = [shared + q for q in ("Where is Rome?", "What is rain?", "Who wrote Hamlet?")]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    results = []
    for mode in engines:
        with mode as engine:  # the first prompt fills the cache, the second call hits it
            results.append(engine.generate(prompts[:1], params, use_tqdm=False))
            results[-1] += engine.generate(prompts, params, use_tqdm=False)
    assert _view(results[0]) == _view(results[1])
    assert all(o.num_cached_tokens > 0 for o in results[0][1:])


def test_structured_outputs_match_sync(engines):
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"choice": ["yes", "no"]}),
        SamplingParams(temperature=0.8, seed=2, max_tokens=12, structured_outputs={"regex": PHONE}),
    ]
    prompts = ["Is the sky blue? Answer yes or no:", "Call me at"]
    asyn, sync = _generate_both(engines, prompts, params)
    assert _view(asyn) == _view(sync)
    assert asyn[0].outputs[0].text in ("yes", "no")
    assert len(asyn[1].outputs[0].text) == 8 and asyn[1].outputs[0].text[3] == "-"


def test_preemption_matches_sync(engines):
    # A small KV budget without another engine: all but 10 blocks (160 tokens) are held aside, and
    # 4 requests of ~55 tokens each need 16.
    prompt = "List the planets of the solar system and say one thing about each. " * 2
    prompts = [f"{i}. {prompt}" for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = []
    for mode in engines:
        with mode as engine:
            scheduler = engine.engine_core.scheduler
            pool = scheduler.kv_cache_manager.block_pool
            held = pool.get_new_blocks(pool.get_num_free_blocks() - 10)
            before = scheduler.num_preemptions_total
            try:
                results.append(engine.generate(prompts, params, use_tqdm=False))
                assert pool.get_num_free_blocks() == 10  # no block leaked
            finally:
                pool.free_blocks(held)
            assert scheduler.num_preemptions_total > before
    assert _view(results[0]) == _view(results[1])


def test_abort_mid_stream_matches_sync(engines):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    texts = []
    for mode in engines:
        with mode as engine:
            manager = engine.engine_core.kv_cache_manager
            free_blocks = manager.num_free_blocks
            stream = engine.stream("Tell me a long story about a dragon.", params)
            texts.append([next(stream) for _ in range(5)])
            stream.close()  # aborts the request mid-stream
            assert not engine.engine_core.has_unfinished_requests()
            assert manager.num_free_blocks == free_blocks
    assert texts[0] == texts[1]
    # The engine goes on serving after the abort (the step in flight is applied and dropped).
    asyn, sync = _generate_both(engines, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6))
    assert _view(asyn) == _view(sync)


def _disturb_before_step(engine, monkeypatch, at_step: int, disturb) -> None:
    """Run `disturb()` before the engine's step number `at_step` (from 0) of its next calls."""
    step, calls = engine._step, itertools.count()

    def disturbed_step():
        if next(calls) == at_step:
            disturb()
        return step()

    monkeypatch.setattr(engine, "_step", disturbed_step)


# Greedy with logprobs, and seeded: the seeded sampler draws from the token's position, so a recompute
# draws the same.
RECOMPUTED = [
    SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True),
]


@pytest.mark.parametrize("what", ["reset_running_requests", "sleep_keep"])
def test_running_requests_whose_kv_goes_recompute_the_same_ids(engines, monkeypatch, what):
    """Mid-generation (two requests decoding, a step in flight in the async mode), either vLLM's
    reset_prefix_cache(reset_running_requests=True), or sleep(mode="keep") then wake_up: both running
    requests are preempted, every block comes back, and each finishes with the ids and logprobs of an
    undisturbed run."""
    seen = {}
    results = []
    for mode in engines:
        with mode as engine:
            undisturbed = engine.generate(PROMPTS[:2], RECOMPUTED, use_tqdm=False)
            scheduler = engine.engine_core.scheduler
            free_blocks = scheduler.kv_cache_manager.num_free_blocks

            def disturb():
                seen["running"], before = len(scheduler.running), scheduler.num_preemptions_total
                if what == "reset_running_requests":
                    assert engine.reset_prefix_cache(reset_running_requests=True)
                else:
                    engine.sleep(1, mode="keep")
                    assert scheduler.get_num_unfinished_requests() == 2 and engine.is_sleeping()
                    engine.wake_up()
                seen["preempted"] = scheduler.num_preemptions_total - before
                seen["free"] = scheduler.kv_cache_manager.num_free_blocks

            _disturb_before_step(engine, monkeypatch, 8, disturb)
            disturbed = engine.generate(PROMPTS[:2], RECOMPUTED, use_tqdm=False)
            monkeypatch.undo()
            assert seen == {"running": 2, "preempted": 2, "free": free_blocks}, mode.is_async
            assert _view(disturbed) == _view(undisturbed), mode.is_async
            results.append(disturbed)
    assert _view(results[0]) == _view(results[1])

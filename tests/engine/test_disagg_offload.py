"""Host offload and disaggregated prefill on one engine (core/kv_multi_connector.py), on a tiny random
Llama in bfloat16, a plain engine, a producer and a consumer (both with a host tier) in one process over
loopback ZMQ. A conversation coming back after both devices evicted it: the producer loads its prefix
from its host tier and computes the rest; the consumer loads its prefix from its host tier and fetches
only the blocks after it; the answer is the plain engine's, token for token and logprob for logprob. A
prompt the consumer holds whole is not fetched (the producer's copy is released), a failed fetch
computes what the host tier lacks, and no block leaks on either side."""

from __future__ import annotations

import numpy as np
import pytest
from test_disagg_prefill import BLOCK, _free_port, _metrics, _transfer, _with_params

from helpers.family_cases import make_hf_model, save_hf_model
from xlaserve import LLM, SamplingParams
from xlaserve.core.kv_multi_connector import MultiConnectorScheduler, MultiConnectorWorker

# 15 usable blocks: two 70-token prompts after a third evict it from either device cache.
ENGINE_ARGS = {
    "dtype": "bfloat16",
    "max_model_len": 96,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
    "block_size": BLOCK,
    "num_gpu_blocks_override": 16,
    "enforce_eager": True,
}
OFFLOAD = {"kv_offloading_size": 2**-10}  # 1 MiB
DECODE = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
PREFILL = _with_params({"do_remote_decode": True}, SamplingParams(max_tokens=1, temperature=0.0))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(plain engine, producer, consumer), the last two with a host tier."""
    model_dir = save_hf_model(make_hf_model("LlamaForCausalLM", seed=7), tmp_path_factory.mktemp("llama"))
    reference = LLM(model_dir, **ENGINE_ARGS)
    producer = LLM(model_dir, **ENGINE_ARGS, **OFFLOAD, **_transfer("kv_producer", _free_port()))
    consumer = LLM(model_dir, **ENGINE_ARGS, **OFFLOAD, **_transfer("kv_consumer", _free_port()))
    yield reference, producer, consumer
    for llm in (reference, producer, consumer):
        llm.shutdown()


def _completion(out):
    c = out.outputs[0]
    return c.token_ids, [{k: v.logprob for k, v in step.items()} for step in c.logprobs]


def _disaggregated(producer: LLM, consumer: LLM, prompt: list[int]):
    """The prompt through the producer and the consumer, as the router sends it: (producer's output,
    consumer's output)."""
    prefilled = producer.generate([{"prompt_token_ids": prompt}], PREFILL, use_tqdm=False)[0]
    params = _with_params(prefilled.kv_transfer_params, DECODE)
    return prefilled, consumer.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def _counters(llm: LLM) -> dict:
    m = _metrics(llm)
    return {
        "host_hits": m[("xlaserve:kv_offload_hits", ("host",))],
        "saved": m[("xlaserve:kv_offload_total_bytes", ("device_to_host",))],
        "fetched": m.get(("xlaserve:kv_transfer_total_bytes", ("fetched",))),
        "fetches": tuple(
            m[("xlaserve:kv_transfer_fetches", (o,))] for o in ("loaded", "recomputed", "cached")
        ),
    }


def _delta(after: dict, before: dict) -> dict:
    return {
        k: tuple(a - b for a, b in zip(after[k], before[k]))
        if isinstance(after[k], tuple)
        else after[k] - before[k]
        for k in after
    }


def _assert_no_leaks(reference: LLM, producer: LLM, consumer: LLM) -> None:
    for llm in (reference, producer, consumer):
        manager = llm.engine_core.kv_cache_manager
        assert not manager.req_to_blocks
        assert manager.num_free_blocks == manager.num_usable_blocks
    _, disagg = producer.engine_core.runner.kv_connector.workers
    assert len(disagg.server) == 0  # every copy fetched or released


def test_a_returning_conversation_loads_its_prefix_from_both_host_tiers(engines):
    reference, producer, consumer = engines
    for llm in (producer, consumer):  # one connector of two parts, on each side
        assert isinstance(llm.engine_core.kv_connector, MultiConnectorScheduler)
        assert isinstance(llm.engine_core.runner.kv_connector, MultiConnectorWorker)
    rng = np.random.default_rng(11)
    first, *others = (rng.integers(3, 101, 70).tolist() for _ in range(3))
    first_out = None
    for prompt in (first, *others):  # one at a time: the later two evict the first on both sides
        expected = _completion(reference.generate([{"prompt_token_ids": prompt}], DECODE, use_tqdm=False)[0])
        _, out = _disaggregated(producer, consumer, prompt)
        assert _completion(out) == expected
        assert out.num_cached_tokens == (70 - 1) // BLOCK * BLOCK  # every full block fetched
        first_out = first_out or out
    assert _counters(consumer)["host_hits"] == 0 and _counters(consumer)["saved"] > 0

    # The conversation comes back: its first prompt, the answer, and a new turn (86 tokens, 10 blocks
    # before the last token).
    turn = first + list(first_out.outputs[0].token_ids) + rng.integers(3, 101, 10).tolist()
    expected = _completion(reference.generate([{"prompt_token_ids": turn}], DECODE, use_tqdm=False)[0])
    before_p, before_c = _counters(producer), _counters(consumer)
    prefilled, out = _disaggregated(producer, consumer, turn)
    assert _completion(out) == expected  # bit for bit, as the plain engine answers
    produced, consumed = _delta(_counters(producer), before_p), _delta(_counters(consumer), before_c)
    # The producer computed the first prompt's 8 full blocks before: its host tier gives them back, it
    # computes the other 22 tokens (and still sends all 10 blocks).
    assert prefilled.num_cached_tokens == 64 and produced["host_hits"] == 64
    # The consumer holds 9 (the first prompt and two answer tokens) in its host tier: it fetches the
    # tenth alone, loads the nine from the host, and computes the last prompt token.
    assert out.num_cached_tokens == 80 and consumed["host_hits"] == 72
    bytes_per_block = consumer.engine_core.executor.kv_bytes_per_block
    assert consumed["fetched"] == bytes_per_block and consumed["fetches"] == (1, 0, 0)
    _assert_no_leaks(reference, producer, consumer)


def test_a_prompt_held_whole_is_not_fetched_and_a_failed_fetch_computes_the_rest(engines):
    reference, producer, consumer = engines
    rng = np.random.default_rng(12)
    prompt = rng.integers(3, 101, 50).tolist()  # 6 full blocks before the last token
    expected = _completion(reference.generate([{"prompt_token_ids": prompt}], DECODE, use_tqdm=False)[0])
    _, out = _disaggregated(producer, consumer, prompt)
    assert _completion(out) == expected

    # Again: the consumer's device cache holds all six blocks, so it only releases the producer's copy.
    before = _counters(consumer)
    _, out = _disaggregated(producer, consumer, prompt)
    assert _completion(out) == expected and out.num_cached_tokens == 48
    delta = _delta(_counters(consumer), before)
    assert delta["fetched"] == 0 and delta["fetches"] == (0, 0, 1)

    # A request the producer never held, whose first 4 blocks the consumer has: the fetch (of the rest)
    # fails, the consumer loads what it holds and computes the rest.
    other = prompt[:32] + rng.integers(3, 101, 18).tolist()
    expected = _completion(reference.generate([{"prompt_token_ids": other}], DECODE, use_tqdm=False)[0])
    params = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": producer.engine_core.config.cache.kv_transfer.kv_port,
        "remote_request_id": "never-prefilled",
    }
    before = _counters(consumer)
    out = consumer.generate([{"prompt_token_ids": other}], _with_params(params, DECODE), use_tqdm=False)[0]
    assert _completion(out) == expected and out.num_cached_tokens == 32
    delta = _delta(_counters(consumer), before)
    assert delta["fetched"] == 0 and delta["fetches"] == (0, 1, 0)
    _assert_no_leaks(reference, producer, consumer)

"""Layers of several windows on a block table per group (worker/kv_cache_groups.py `window_groups`), in
bfloat16: a tiny Gemma 3 of six layers (sliding, sliding, full, twice: two full-attention layers, so
groups of two: the full group (2, 5) and the sliding groups (0, 1) and (3, 4), in two cache slots).

- The same KV cache budget holds three times the blocks (a block is a page in two slots, not six
  layers).
- A running request's sliding groups hold a window's worth of blocks (the rest went back to the pool),
  its full group every block; all of them come back when it finishes.
- Its tokens and logprobs are bitwise those of the same model on one table for every layer
  (`disable_hybrid_kv_cache_manager`, the layout before groups): prompts longer than the window,
  prefilled in chunks, run again from the prefix cache, and a request preempted and recomputed.
(Float32 parity with Hugging Face on groups: test_model_families.py's Gemma 2 and 3.)
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.family_cases import make_hf_model, save_hf_model, tokens_with_a_preemption
from xlaserve import LLM, SamplingParams
from xlaserve.core.request import Request

WINDOW = 12
BLOCK_SIZE = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
ENGINE_ARGS = dict(
    dtype="bfloat16",
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=16,  # prompts prefill in chunks of 16
    block_size=BLOCK_SIZE,
    kv_cache_memory=2**20,
    enforce_eager=True,
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> tuple[LLM, LLM]:
    """(the grouped engine, the one-table engine) of one model."""
    hf_model = make_hf_model(
        "Gemma3ForCausalLM", seed=3, num_hidden_layers=6, layer_types=LAYER_TYPES, sliding_window=WINDOW
    )
    directory = save_hf_model(hf_model, tmp_path_factory.mktemp("gemma3_groups"))
    grouped = LLM(directory, **ENGINE_ARGS)
    one_table = LLM(directory, **ENGINE_ARGS, disable_hybrid_kv_cache_manager=True)
    return grouped, one_table


def prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    long = [int(t) for t in rng.integers(3, 101, 70)]
    return [
        long,
        long[:48] + [int(t) for t in rng.integers(3, 101, 9)],  # shares six blocks with the first
        [int(t) for t in rng.integers(3, 101, 45)],
        [int(t) for t in rng.integers(3, 101, 23)],
    ]


def test_groups_share_cache_slots_so_the_budget_holds_three_times_the_blocks(engines):
    grouped, one_table = engines
    runner = grouped.engine_core.runner
    groups = runner.kv_cache_groups
    assert [g.layer_ids for g in groups] == [(2, 5), (0, 1), (3, 4)]
    assert [getattr(g.spec, "sliding_window", None) for g in groups] == [None, WINDOW, WINDOW]
    assert runner.cache_layout.num_slots == 2 and runner.kv_spec.num_layers == 2
    assert runner.kv_cache.k.shape[0] == 2 * runner.num_blocks
    assert one_table.engine_core.runner.cache_layout is None
    assert runner.num_blocks // 3 == one_table.engine_core.runner.num_blocks  # 682 and 227 (rounded down)


def test_sliding_groups_hold_a_window_of_blocks_and_give_all_back(engines):
    grouped, _ = engines
    core = grouped.engine_core
    manager = core.scheduler.kv_cache_manager
    num_free = manager.num_free_blocks
    prompt = prompts(0)[0]
    core.add_request(Request("long", prompt, SamplingParams(max_tokens=3, temperature=0.0), eos_token_id=2))
    held = []
    while core.has_unfinished_requests():
        core.step()
        request = next((r for r in core.scheduler.running if r.request_id == "long"), None)
        if request is not None:
            held.append(
                (
                    request.num_computed_tokens,
                    [
                        sum(not b.is_null for b in m.req_to_blocks["long"])
                        for m in manager.coordinator.managers
                    ],
                )
            )
    num_computed, (full, *sliding) = held[-1]
    assert num_computed >= len(prompt)
    assert full == -(-num_computed // BLOCK_SIZE)  # every block of the context
    # A window of 12 keys over blocks of 8, and the blocks of the step's own tokens: at most 3.
    assert all(0 < n <= 3 for n in sliding), held
    assert manager.num_free_blocks == num_free


def _outputs(llm: LLM, batch, params):
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs, o.num_cached_tokens)
        for o in llm.generate(batch, params, use_tqdm=False)
    ]


def test_tokens_and_logprobs_are_the_one_tables_bits(engines):
    grouped, one_table = engines
    batch = [{"prompt_token_ids": p} for p in prompts(1)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    reference = _outputs(one_table, batch, params)
    first = _outputs(grouped, batch, params)
    again = _outputs(grouped, batch, params)  # from the prefix cache
    assert any(cached for *_, cached in again), "the second run hit no cached prefix"
    for ours in (first, again):
        for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(ours, reference):
            assert tokens == ref_tokens
            assert [{t: lp.logprob for t, lp in d.items()} for d in logprobs] == [
                {t: lp.logprob for t, lp in d.items()} for d in ref_logprobs
            ]


def test_each_request_alone_is_the_same_bits_as_in_the_batch(engines):
    """Batch invariance through the sliding groups (bfloat16): each prompt alone, in steps of its own, gives
    the tokens and logprobs it gets among the other three (chunks cut elsewhere, other request buckets),
    though its window's blocks go back to the pool at other steps."""
    grouped, _ = engines
    batch = [{"prompt_token_ids": p} for p in prompts(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    together = [(tokens, logprobs) for tokens, logprobs, _ in _outputs(grouped, batch, params)]
    alone = [_outputs(grouped, [prompt], params)[0][:2] for prompt in batch]
    as_numbers = [(t, [{i: lp.logprob for i, lp in d.items()} for d in lps]) for t, lps in together + alone]
    assert as_numbers[: len(batch)] == as_numbers[len(batch) :]


def test_a_preempted_request_recomputes_the_same_tokens(engines):
    grouped, one_table = engines
    victim, other = prompts(2)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = tokens_with_a_preemption(grouped, victim, other, params)
    reference = one_table.generate(
        [{"prompt_token_ids": other}, {"prompt_token_ids": victim}], params, use_tqdm=False
    )
    assert [tokens["other"], tokens["victim"]] == [list(o.outputs[0].token_ids) for o in reference]

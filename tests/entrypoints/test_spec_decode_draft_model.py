"""Speculative decoding with a draft model (worker/draft_model.py), k=3, on a tiny random Llama: greedy
outputs equal those without speculation token for token, through chunked prefill, prefix-cache hits and
preemption; the target as its own draft accepts every draft (greedy and sampled: a strong check of the
draft's cache on the shared block ids and of its q); seeded sampling is reproducible; nothing compiles
after warm-up; a draft with another vocabulary, or no draft at the path, is refused naming the field."""

from __future__ import annotations

import json

import jax
import pytest
from test_spec_decode_llm import ENGINE_ARGS, prompts, spec_metrics

from helpers.family_cases import make_hf_model, save_hf_model
from xlaserve import LLM, SamplingParams
from xlaserve.entrypoints.cli import main
from xlaserve.worker.compile_guard import num_compiles

K = 3
NUM_TOKENS = 32
# test_spec_decode_llm's (18 usable blocks of 8 slots: four requests of 56-72 tokens preempt, lookahead
# slots included): the baseline engine is that module's, its programs found in the compilation cache.
ARGS = ENGINE_ARGS


def params(*, with_penalties: bool) -> list[SamplingParams]:
    common = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "ignore_eos": True}
    penalties = {"repetition_penalty": 1.3, "frequency_penalty": 0.2} if with_penalties else {}
    return [
        SamplingParams(**common),
        SamplingParams(**common, logprobs=2),
        SamplingParams(**common, **penalties),  # the draft proposes without them: the target decides
        SamplingParams(**common),
    ]


def draft_config(model_dir) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("LlamaForCausalLM"), tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def truncated_draft_dir(tmp_path_factory):
    """The target's first layer (same embedding and head): a draft that agrees with it sometimes."""
    model = make_hf_model("LlamaForCausalLM")
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    return save_hf_model(model, tmp_path_factory.mktemp("draft"))


SAMPLED = SamplingParams(temperature=0.8, top_k=20, n=2, seed=5, max_tokens=24, ignore_eos=True)


def run_sampled(llm: LLM) -> list[list[int]]:
    inputs = [{"prompt_token_ids": p} for p in prompts()[:2]]
    return [c.token_ids for o in llm.generate(inputs, SAMPLED, use_tqdm=False) for c in o.outputs]


@pytest.fixture(scope="module")
def baseline(target_dir):
    """Token ids without speculation: greedy with and without penalties (they differ in one request),
    and seeded sampling."""
    llm = LLM(target_dir, enforce_eager=True, **ARGS)
    outputs = {is_on: [o.outputs[0].token_ids for o in run(llm, is_on)] for is_on in (True, False)}
    return outputs | {"sampled": run_sampled(llm)}


def run(llm: LLM, with_penalties: bool):
    inputs = [{"prompt_token_ids": p} for p in prompts()]
    return llm.generate(inputs, params(with_penalties=with_penalties), use_tqdm=False)


def check_outputs_and_metrics(llm: LLM, baseline, with_penalties: bool) -> dict:
    """Greedy outputs equal the baseline's; the engine went through chunked prefill, prefix-cache hits
    and preemption; metrics add up; every block is back."""
    core = llm.engine_core
    outputs = run(llm, with_penalties)
    assert [o.outputs[0].token_ids for o in outputs] == baseline[with_penalties]
    assert all(len(o.outputs[0].token_ids) == NUM_TOKENS for o in outputs)
    assert len(outputs[1].outputs[0].logprobs) == NUM_TOKENS
    assert max(len(p) for p in prompts()) > ARGS["max_num_batched_tokens"]  # chunked prefill
    assert core.scheduler.num_preemptions_total > 0
    assert sum(m.value for m in llm.get_metrics() if m.name == "xlaserve:prefix_cache_hits") > 0
    metrics = spec_metrics(llm)
    assert 0 < metrics["num_draft_tokens"] <= K * metrics["num_drafts"]
    assert metrics["num_accepted_tokens"] <= metrics["num_draft_tokens"]
    per_pos = metrics["per_pos"]
    assert len(per_pos) == K and sum(per_pos) == metrics["num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)
    manager = core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks and not manager.req_to_blocks
    return metrics


def test_the_target_as_its_own_draft_accepts_every_draft(target_dir, baseline):
    """Its cache rides the target's block ids: were a K/V missing (a prefix-cache hit, a preempted
    request's recompute, a chunk) or stale, some draft would differ from the target's choice."""
    spec = draft_config(target_dir)
    llm = LLM(target_dir, speculative_config=spec, strict_compile_guard=True, **ARGS)
    before = num_compiles()
    metrics = check_outputs_and_metrics(llm, baseline, with_penalties=False)
    assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"]  # acceptance rate 1.0
    assert metrics["num_drafts"] > 20
    # Sampled rows draw their drafts from q = the target's own p: min(1, p / q) = 1 accepts them all
    # (up to float rounding), which checks that each row reads its own q. A draft is drawn with the
    # noise the sampler would use at its index: the tokens are those sampled without speculation,
    # however the steps fell (the second run hits the prefix cache).
    before_sampled = spec_metrics(llm)
    tokens = run_sampled(llm)
    assert tokens == run_sampled(llm) == baseline["sampled"]
    assert len(set(map(tuple, tokens))) == 4 and all(len(t) == 24 for t in tokens)
    after = spec_metrics(llm)
    num_drafted = after["num_draft_tokens"] - before_sampled["num_draft_tokens"]
    assert num_drafted > 8 * K
    assert after["num_accepted_tokens"] - before_sampled["num_accepted_tokens"] >= 0.95 * num_drafted
    assert num_compiles() == before and llm.engine_core.runner.guard.num_unexpected == 0


def test_a_smaller_draft_keeps_greedy_outputs_exact(truncated_draft_dir, target_dir, baseline):
    spec = draft_config(truncated_draft_dir)
    llm = LLM(target_dir, speculative_config=spec, enforce_eager=True, **ARGS)
    metrics = check_outputs_and_metrics(llm, baseline, with_penalties=True)
    assert metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]  # a different model: some rejected
    runner = llm.engine_core.runner
    assert runner.drafter.kv_spec.num_layers == 1
    # The weights gauge counts the draft's (one layer of the target's two, same embedding and head).
    assert 0 < runner.drafter.weight_bytes < runner.weight_bytes
    gauge = next(m.value for m in llm.get_metrics() if m.name == "xlaserve:model_weight_bytes")
    assert gauge == runner.weight_bytes + runner.drafter.weight_bytes
    # Sleep frees the draft's cache and (level 2) its weights beside the target's; awake, the same tokens.
    caches = sum(x.nbytes for x in jax.tree.leaves((runner.kv_cache, runner.drafter.kv_cache)))
    slept = llm.sleep(2)
    assert slept.device_bytes >= gauge + caches
    assert llm.wake_up().device_bytes == slept.device_bytes
    greedy = [o.outputs[0].token_ids for o in run(llm, with_penalties=True)]
    assert greedy == baseline[True]


def test_a_draft_with_another_vocabulary_is_refused(tmp_path, target_dir):
    other = save_hf_model(make_hf_model("LlamaForCausalLM", vocab_size=97), tmp_path / "other")
    with pytest.raises(ValueError, match=r"speculative_config.model: the draft's vocab_size \(97\) must"):
        LLM(target_dir, speculative_config=draft_config(other), enforce_eager=True, **ARGS)


def test_serve_refuses_a_draft_that_is_not_there(capsys):
    spec = json.dumps({"method": "draft_model", "model": "/no/such/draft"})
    assert main(["serve", "--speculative-config", spec]) == 2
    assert "speculative_config.model: '/no/such/draft' does not exist" in capsys.readouterr().err

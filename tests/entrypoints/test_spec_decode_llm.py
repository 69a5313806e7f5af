"""Speculative decoding end to end (n-gram proposer, k=3) on two tiny random families, one of them MoE:
greedy outputs equal those without it token for token, through chunked prefill, prefix caching and
preemption, with penalties and logprobs; stop strings and max_tokens cut exactly; the metrics add up;
no KV block leaks; and, after warm-up, nothing compiles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from helpers.family_cases import make_hf_model, randomize_weights, save_hf_model
from xlaserve import LLM, SamplingParams
from xlaserve.worker.compile_guard import num_compiles

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
ENGINE_ARGS = {
    "dtype": "bfloat16",  # the dtype users run: exactness needs batch invariance (kernels/invariant.py)
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,  # prompts of 24-40 tokens prefill in chunks
    "block_size": 8,
    # 18 usable blocks of 8: four requests of ~90 tokens preempt. The draft-model tests
    # (test_spec_decode_draft_model.py) run the same engine without speculation as their baseline: equal
    # settings, so its programs come from the compilation cache there.
    "num_gpu_blocks_override": 19,
    "enable_prefix_caching": True,
}
NUM_TOKENS = 56


def make_mixtral(vocab_size=101, seed=0):
    config = transformers.MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
    )
    config.architectures = ["MixtralForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(config).eval()
    return randomize_weights(model)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("LlamaForCausalLM"), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama_spec(llama_dir):
    """Warmed up, compile guard strict: the greedy test and the compile test share it."""
    return LLM(llama_dir, speculative_config=SPEC, strict_compile_guard=True, **ENGINE_ARGS)


def prompts() -> list[list[int]]:
    """Four prompts, two sharing a 16-token prefix; repeats inside give the n-gram proposer material."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 101, 16).tolist()
    phrase = rng.integers(3, 101, 6).tolist()
    return [
        shared + phrase * 3,
        shared + phrase * 2 + rng.integers(3, 101, 8).tolist(),
        rng.integers(3, 101, 24).tolist(),
        (phrase + rng.integers(3, 101, 4).tolist()) * 3,
    ]


def params() -> list[SamplingParams]:
    common = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "ignore_eos": True}
    return [
        SamplingParams(**common),
        SamplingParams(**common, logprobs=2),
        SamplingParams(**common, repetition_penalty=1.3, frequency_penalty=0.2),
        SamplingParams(**common),
    ]


def run(llm: LLM):
    inputs = [{"prompt_token_ids": p} for p in prompts()]
    return llm.generate(inputs, params(), use_tqdm=False)


def spec_metrics(llm: LLM) -> dict:
    out = {}
    for m in llm.get_metrics():
        name = m.name.removeprefix("xlaserve:spec_decode_")
        if "position" in m.labels:
            out.setdefault("per_pos", []).append(m.value)
        elif m.name.startswith("xlaserve:spec_decode_"):
            out[name] = m.value
    return out


def test_greedy_outputs_equal_without_speculation_llama(llama_dir, llama_spec):
    check_greedy_outputs_equal(llama_dir, llama_spec)


def test_greedy_outputs_equal_without_speculation_mixtral(tmp_path):
    model_dir = save_hf_model(make_mixtral(), tmp_path / "mixtral")
    check_greedy_outputs_equal(
        model_dir, LLM(model_dir, enforce_eager=True, speculative_config=SPEC, **ENGINE_ARGS)
    )


def check_greedy_outputs_equal(model_dir, llm):
    base_llm = LLM(model_dir, enforce_eager=True, **ENGINE_ARGS)
    base, spec = run(base_llm), run(llm)
    core = llm.engine_core
    for b, s in zip(base, spec, strict=True):
        assert s.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(s.outputs[0].token_ids) == NUM_TOKENS
    # Logprobs: one entry per token, the emitted token's value as without speculation, to the bit.
    b_lp, s_lp = base[1].outputs[0].logprobs, spec[1].outputs[0].logprobs
    assert len(s_lp) == NUM_TOKENS
    for b_entry, s_entry, token in zip(b_lp, s_lp, spec[1].outputs[0].token_ids, strict=True):
        assert next(iter(s_entry)) == token
        assert s_entry[token].logprob == b_entry[token].logprob
    # Speculation happened, through preemption, and most of it was right (the models loop).
    metrics = spec_metrics(llm)
    assert core.scheduler.num_preemptions_total > 0
    assert 0 < metrics["num_accepted_tokens"] <= metrics["num_draft_tokens"]
    assert metrics["num_draft_tokens"] <= 3 * metrics["num_drafts"]
    per_pos = metrics["per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == metrics["num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # accepting draft i needs drafts 0..i-1 accepted
    assert core.runner.num_steps < base_llm.engine_core.runner.num_steps
    # Every block is back: free, or cached and evictable.
    manager = core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks and not manager.req_to_blocks


def test_nothing_compiles_after_warm_up_and_stops_cut_exactly(llama_spec):
    llm = llama_spec
    before = num_compiles()
    outputs = run(llm)
    # Sampled rows, n > 1 and a seed, beside greedy ones: every verification variant was warmed up.
    sampled = SamplingParams(temperature=0.8, top_k=5, n=2, seed=3, max_tokens=20, logprobs=1)
    inputs = [{"prompt_token_ids": prompts()[0]}, {"prompt_token_ids": prompts()[3]}]
    first = llm.generate(inputs, [sampled, params()[2]], use_tqdm=False)
    again = llm.generate(inputs, [sampled, params()[2]], use_tqdm=False)
    assert [c.token_ids for c in first[0].outputs] == [c.token_ids for c in again[0].outputs]  # seeded
    assert [len(c.token_ids) for c in first[0].outputs] == [20, 20]
    assert all(len(c.logprobs) == 20 for c in first[0].outputs)
    # A bad word of two tokens (its second banned after its first) does not draft, beside a request that
    # does: the output is the greedy one up to the word's first place, then leaves it, and never says it.
    ids = outputs[0].outputs[0].token_ids
    word = ids[5:7]
    first = next(j for j in range(len(ids) - 1) if ids[j : j + 2] == word)
    drafted = spec_metrics(llm)["num_draft_tokens"]
    banned, companion = llm.generate(
        [{"prompt_token_ids": prompts()[0]}, {"prompt_token_ids": prompts()[3]}],
        [dataclasses.replace(params()[0], bad_words_token_ids=[word]), params()[3]],
        use_tqdm=False,
    )
    out = banned.outputs[0].token_ids
    assert out[: first + 1] == ids[: first + 1] and out[first + 1] != ids[first + 1]
    assert all(out[j : j + 2] != word for j in range(len(out) - 1))
    assert companion.outputs[0].token_ids == outputs[3].outputs[0].token_ids
    assert spec_metrics(llm)["num_draft_tokens"] > drafted  # the companion drafted
    assert num_compiles() == before and llm.engine_core.runner.guard.num_unexpected == 0
    assert spec_metrics(llm)["num_accepted_tokens"] > 0
    # A stop string inside a run of accepted drafts: text and tokens end at it.
    text = outputs[0].outputs[0].text.split()
    stop = " ".join(text[10:12])
    cut = llm.generate(
        [{"prompt_token_ids": prompts()[0]}],
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[stop], logprobs=1),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == ids[:12] and len(cut.logprobs) == 12
    # max_tokens exact even when every draft would be accepted.
    short = llm.generate(
        [{"prompt_token_ids": prompts()[0]}],
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert short.token_ids == ids[:7] and short.finish_reason == "length"


@pytest.fixture(scope="module")
def smollm2_spec():
    """A second SmolLM2 engine, with n-gram speculation (k = 4), shared by the slow tests. It compiles
    what its steps use (enforce_eager: a full warm-up of every verification bucket took ~100 s here);
    that warm-up leaves nothing to compile under speculation is the tiny Llama's test above. At most
    4 sequences (the tests send 2 or 3; the shared engine takes 16): every step's sampler and verifier
    pad to 4 rows (or 1), fewer programs to compile, and batch invariance keeps the outputs equal."""
    from helpers.smollm2 import ENGINE_ARGS as SMOLLM2_ARGS

    args = SMOLLM2_ARGS | {
        "dtype": "bfloat16",
        "enforce_eager": True,
        "strict_compile_guard": False,
        "max_num_seqs": 4,
    }
    return LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **args)


@pytest.mark.slow
def test_smollm2_greedy_outputs_equal_without_speculation(llm_bf16, smollm2_spec):
    """SmolLM2 (bfloat16): copy prompts of ~150-200 tokens (chunked by the 128-token budget) and a chat
    prompt, 64 greedy tokens each, equal token for token with the shared bfloat16 engine's, and their
    logprobs to the bit (batch invariance: a verification step's rows are the decode's)."""
    llm = llm_bf16
    from helpers.smollm2 import ENGINE_ARGS as SMOLLM2_ARGS
    from xlaserve.entrypoints.bench.speculative import copy_workload

    spec_llm = smollm2_spec
    conversations = copy_workload(2) + [[{"role": "user", "content": "Describe the water cycle."}]]
    sampling = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0)
    expected = llm.chat(conversations, sampling, use_tqdm=False)
    actual = spec_llm.chat(conversations, sampling, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in actual) > SMOLLM2_ARGS["max_num_batched_tokens"]
    for e, a in zip(expected, actual, strict=True):
        assert a.outputs[0].token_ids == e.outputs[0].token_ids
        assert [next(iter(x.values())).logprob for x in a.outputs[0].logprobs] == [
            next(iter(x.values())).logprob for x in e.outputs[0].logprobs
        ]
    metrics = spec_metrics(spec_llm)
    assert metrics["num_accepted_tokens"] > metrics["num_drafts"]  # copying: more than one per draft


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "city", "languages"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_smollm2_json_schema_greedy_outputs_equal_without_speculation(llm_bf16, smollm2_spec):
    """Drafts under a JSON schema (cut where the grammar rejects them, each position masked): the same
    greedy tokens as without speculation, JSON that validates, and most drafts accepted (it copies)."""
    import json

    import jsonschema

    from xlaserve import StructuredOutputsParams

    record = {"name": "Ada Lovelace", "city": "London", "languages": ["English", "French", "Italian"]}
    messages = [
        [{"role": "user", "content": f"Return this record as JSON, exactly as given: {json.dumps(record)}"}],
        [{"role": "user", "content": "Give a JSON record of a person: name, city, languages they speak."}],
    ]
    sampling = SamplingParams(
        temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    drafts_before = spec_metrics(smollm2_spec).get("num_draft_tokens", 0)
    expected = llm_bf16.chat(messages, sampling, use_tqdm=False)
    actual = smollm2_spec.chat(messages, sampling, use_tqdm=False)
    for e, a in zip(expected, actual, strict=True):
        assert a.outputs[0].token_ids == e.outputs[0].token_ids
        assert a.outputs[0].finish_reason == "stop", a.outputs[0].text
        jsonschema.validate(json.loads(a.outputs[0].text), PERSON)
    assert json.loads(actual[0].outputs[0].text) == record
    metrics = spec_metrics(smollm2_spec)
    assert metrics["num_draft_tokens"] > drafts_before

"""Speculative decoding under structured outputs, end to end on a tiny random Llama with SmolLM2's
tokenizer (k = 3): requests under a JSON schema or a regex draft (n-gram, or the target as its own draft
model, whose unconstrained drafts the grammar cuts), every verified position is sampled under its own
mask, and greedy outputs equal those without speculation token for token; the JSON validates against
its schema; nothing compiles after warm-up."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_spec_decode_llm import spec_metrics

from helpers.tiny_models import save_tiny_llama, small_byte_tokenizer
from xlaserve import LLM, SamplingParams, StructuredOutputsParams
from xlaserve.worker.compile_guard import num_compiles

K = 3
ARGS = {
    "dtype": "bfloat16",  # the dtype users run (batch invariance: kernels/invariant.py)
    "max_model_len": 256,
    # One sequence, 16 tokens a step: few programs to warm up (the prompts, ~30 tokens, prefill in chunks).
    "max_num_seqs": 1,
    "max_num_batched_tokens": 16,
    "block_size": 8,
    "kv_cache_memory": 2**20,
    "strict_compile_guard": True,
}
TAGS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 8, "maxItems": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["tags", "size"],
    "additionalProperties": False,
}
CODE = r"(ab|cd|ef)( (ab|cd|ef)){11}\."


def requests() -> tuple[list[str], list[SamplingParams]]:
    """Prompts that already hold what the grammar asks for: material for the n-gram proposer."""
    prompts = [
        'Tags: {"tags": ["red", "red", "blue", "red", "red", "blue"], "size": 12} and again:',
        "Codes: ab ab cd ab ab cd ef ab ab cd. More codes:",
        'Tags: {"tags": ["green", "green", "green", "blue"], "size": 7} then',
    ]
    greedy = {"temperature": 0.0, "max_tokens": 80}
    tags = StructuredOutputsParams(json=TAGS, disable_any_whitespace=True)  # random models love spaces
    params = [
        SamplingParams(**greedy, structured_outputs=tags),
        SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(regex=CODE)),
        SamplingParams(**greedy, logprobs=1, structured_outputs=tags),
    ]
    return prompts, params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny_llama"))
    return save_tiny_llama(directory, tokenizer=small_byte_tokenizer(), max_position_embeddings=256)


@pytest.fixture(scope="module")
def expected(model_dir):
    """Token ids without speculation (eager: nothing to warm up for one run)."""
    prompts, params = requests()
    llm = LLM(model_dir, **{**ARGS, "strict_compile_guard": False, "enforce_eager": True})
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def check(llm: LLM, expected) -> dict:
    prompts, params = requests()
    before = num_compiles()
    actual = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert num_compiles() == before and llm.engine_core.runner.guard.num_unexpected == 0
    for e, a in zip(expected, actual, strict=True):
        assert a.token_ids == e.token_ids
        assert a.finish_reason == "stop"  # the grammar completed
    jsonschema.validate(json.loads(actual[0].text), TAGS)
    jsonschema.validate(json.loads(actual[2].text), TAGS)
    assert re.fullmatch(CODE, actual[1].text), actual[1].text
    assert len(actual[2].logprobs) == len(actual[2].token_ids)
    metrics = spec_metrics(llm)
    assert 0 < metrics["num_accepted_tokens"] <= metrics["num_draft_tokens"]
    return metrics


def test_ngram_drafts_under_grammars_keep_greedy_outputs(model_dir, expected):
    llm = LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": K}, **ARGS)
    check(llm, expected)


def test_draft_model_drafts_under_grammars_keep_greedy_outputs(model_dir, expected):
    """The target as its own draft proposes its unconstrained tokens. Greedy rows cut them at the first
    the grammar forbids (the random model's unmasked argmax, nearly always) and keep greedy outputs
    exact; sampled rows keep that first forbidden draft (cutting a sampled draft by its value would bias
    the output), which the verifier rejects for sure, and their JSON still validates. Eager: the draft
    programs compile as used."""
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": K}
    llm = LLM(
        model_dir, speculative_config=spec, **{**ARGS, "strict_compile_guard": False, "enforce_eager": True}
    )
    prompts, params = requests()
    actual = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [a.token_ids for a in actual] == [e.token_ids for e in expected]
    greedy = spec_metrics(llm)
    assert greedy["num_accepted_tokens"] == greedy["num_draft_tokens"]  # what greedy rows keep is right
    tags = StructuredOutputsParams(json=TAGS, disable_any_whitespace=True)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=80, structured_outputs=tags)
    output = llm.generate(prompts[0], sampled, use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "stop"
    jsonschema.validate(json.loads(output.text), TAGS)
    metrics = spec_metrics(llm)
    assert metrics["num_draft_tokens"] - greedy["num_draft_tokens"] > 0  # sampled rows verified drafts

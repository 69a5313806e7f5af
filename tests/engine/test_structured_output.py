"""Structured outputs on the host: the spec's validation (errors name the member), its trip over the
wire to the engine core, llguidance's checks, and the manager (compile cache, one matcher per
request, the step's bitmask) with SmolLM2's real tokenizer. No model, no jax."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from xlaserve.core.outputs import ScheduledRequest
from xlaserve.core.request import Request
from xlaserve.engine.protocol import AddRequests, EngineCoreRequest, make_encoder, make_input_decoder
from xlaserve.engine.structured_output import StructuredOutputManager, check_grammar
from xlaserve.sampling_params import SamplingParams
from xlaserve.structured_outputs_params import (
    MAX_SCHEMA_DEPTH,
    StructuredOutputsError,
    StructuredOutputsParams,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# -- the spec -------------------------------------------------------------------------------------

BAD_SPECS = [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"json": 5}, "structured_outputs.json"),
    ({"json": nested(MAX_SCHEMA_DEPTH)}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"regex": 5}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"choice": "a"}, "structured_outputs.choice"),
    ({"grammar": "x" * (256 * 1024 + 1)}, "structured_outputs.grammar"),
    ({"json_object": False}, "structured_outputs.json_object"),
    ({"structural_tag": "[]"}, "structured_outputs.structural_tag"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace"),
]


@pytest.mark.parametrize("fields, param", BAD_SPECS, ids=[json.dumps(f)[:40] for f, _ in BAD_SPECS])
def test_bad_spec_names_the_member(fields, param):
    with pytest.raises(StructuredOutputsError) as info:
        StructuredOutputsParams(**fields)
    assert info.value.param == param and str(info.value).startswith(param)


def test_sampling_params_takes_a_dict_and_rejects_other_types():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ValueError, match="unknown members"):
        SamplingParams(structured_outputs={"regexp": "x"})
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="json")
    assert "chars" in repr(StructuredOutputsParams(json=PERSON))  # logs get the size, not the schema


def test_spec_travels_to_the_engine_core():
    """msgpack through the core's own encoder and decoder: the dataclass comes back equal and checked."""
    specs = [
        StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
        StructuredOutputsParams(json=json.dumps(PERSON)),
        StructuredOutputsParams(regex=r"\d+", whitespace_pattern=" "),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='start: "a"+'),
        StructuredOutputsParams(json_object=True),
    ]
    requests = [
        EngineCoreRequest.from_request(
            Request(str(i), [1, 2], SamplingParams(max_tokens=4, n=2, seed=3, structured_outputs=spec))
        )
        for i, spec in enumerate(specs)
    ]
    decoded = make_input_decoder().decode(make_encoder().encode(AddRequests(requests)))
    for request, spec in zip(decoded.requests, specs):
        assert request.sampling_params.structured_outputs == spec


# -- llguidance's checks ----------------------------------------------------------------------------

BAD_STRUCTURE = {"begin": "x", "schema": {}, "end": ""}  # begins with no trigger
GRAMMAR_ERRORS = [
    ({"regex": "[a-"}, "structured_outputs.regex", "unclosed"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar", "unknown name"),
    ({"grammar": 'root ::= "a" | ('}, "structured_outputs.grammar", "grammar"),
    ({"json": {"type": "foo"}}, "structured_outputs.json", "foo"),
    ({"json": {"not": {"type": "string"}}}, "structured_outputs.json", "not"),  # unsupported keyword
    ({"json": {"type": "string", "pattern": "(a"}}, "structured_outputs.json", "regex"),
    ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json", "missing"),
    ({"structural_tag": json.dumps({"triggers": ["<f"], "structures": [BAD_STRUCTURE]})},
     "structured_outputs.structural_tag", "triggers"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param, words", GRAMMAR_ERRORS, ids=[e[2] for e in GRAMMAR_ERRORS])
def test_llguidance_errors_name_the_member(fields, param, words):
    with pytest.raises(StructuredOutputsError) as info:
        check_grammar(StructuredOutputsParams(**fields))
    assert info.value.param == param and words in str(info.value)


def test_every_kind_compiles():
    tag = {"triggers": ["<f"], "structures": [{"begin": "<f=a>", "schema": PERSON, "end": "</f>"}]}
    for fields in (
        {"json": PERSON, "disable_additional_properties": True},
        {"json_object": True, "whitespace_pattern": "[ ]?"},
        {"regex": "[a-z]{2,4}"},
        {"choice": ["héllo", 'say "hi"']},
        {"grammar": 'root ::= "a" "b"*'},  # GBNF
        {"structural_tag": json.dumps(tag)},
    ):
        assert check_grammar(StructuredOutputsParams(**fields))


# -- the manager, with SmolLM2's tokenizer ----------------------------------------------------------


# `tokenizer` (SmolLM2's) and `manager` (a StructuredOutputManager on it): tests/engine/conftest.py


def constrained(request_id: str, **spec) -> Request:
    params = SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(**spec))
    return Request(request_id, [1, 2, 3], params, eos_token_id=2)


def wait_ready(*requests: Request) -> None:
    deadline = time.monotonic() + 60
    while not all(r.grammar.is_ready for r in requests):
        assert time.monotonic() < deadline, "grammar never compiled"
        time.sleep(0.01)


def allowed_ids(bitmask_row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little"))


def test_bitmask_covers_constrained_sampling_rows_only(manager, tokenizer):
    digits = constrained("digits", regex="[0-9]{1,3}")
    plain = Request("plain", [1, 2, 3], SamplingParams(max_tokens=4))
    chunk = constrained("chunk", regex="[0-9]+")  # prefilling: only part of its prompt this step
    for request in (digits, plain, chunk):
        manager.add_request(request)
    wait_ready(digits, chunk)
    assert plain.grammar is None
    scheduled = [
        ScheduledRequest(digits, 3, [1]),
        ScheduledRequest(plain, 3, [2]),
        ScheduledRequest(chunk, 2, [3]),
    ]
    assert manager.grammar_bitmask([scheduled[1], scheduled[2]]) is None  # nobody samples under a grammar
    bitmask = manager.grammar_bitmask(scheduled)
    assert bitmask.shape == (3, 49152 // 32) and bitmask.dtype == np.int32
    assert (bitmask[1:] == -1).all()
    allowed = allowed_ids(bitmask[0])
    texts = [tokenizer.decode([i]) for i in allowed]
    assert texts and all(t.isdigit() and len(t) <= 3 for t in texts), texts[:20]
    assert 2 not in allowed  # EOS: the regex needs a digit first


def test_grammars_are_cached_and_matchers_are_per_request(manager, tokenizer):
    """n > 1: children share the compiled grammar, and each advances its own matcher."""
    a, b = constrained("n[0]", choice=["yes", "no"]), constrained("n[1]", choice=["yes", "no"])
    manager.add_request(a)
    manager.add_request(b)
    assert a.grammar._compiled is b.grammar._compiled
    wait_ready(a, b)
    assert a.grammar.matcher is not b.grammar.matcher
    for token_id in tokenizer.encode("yes", add_special_tokens=False):
        a.grammar.accept_token(token_id)
    assert a.grammar.is_terminated and a.grammar.error is None
    assert not b.grammar.is_terminated  # untouched by its sibling
    assert 2 not in allowed_ids(manager.grammar_bitmask([ScheduledRequest(b, 3, [1])])[0])  # no EOS yet
    for token_id in tokenizer.encode("no", add_special_tokens=False):
        b.grammar.accept_token(token_id)
    assert b.grammar.is_terminated


def test_json_terminates_at_the_closing_brace(manager, tokenizer):
    request = constrained("json", json=PERSON, disable_any_whitespace=True)
    manager.add_request(request)
    wait_ready(request)
    ids = tokenizer.encode('{"name":"Ann","age":7}', add_special_tokens=False)
    for token_id in ids[:-1]:
        request.grammar.accept_token(token_id)
        assert not request.grammar.is_terminated
    request.grammar.accept_token(ids[-1])
    assert request.grammar.is_terminated and request.grammar.error is None


def test_a_rejected_token_is_an_error(manager, tokenizer):
    request = constrained("strict", regex="[0-9]+")
    manager.add_request(request)
    wait_ready(request)
    request.grammar.accept_token(tokenizer.encode("abc", add_special_tokens=False)[0])
    assert request.grammar.error is not None


def test_a_grammar_that_fails_with_the_tokenizer_fails_its_request(manager):
    """Checked without a tokenizer up front, a special token the tokenizer lacks fails at compile."""
    request = constrained("special", grammar='start: <|no_such_token|> "x"')
    manager.add_request(request)
    wait_ready(request)
    assert request.grammar.error is not None and request.grammar.matcher is None
    manager.wait_for_grammars(0.01)  # nothing left compiling: returns at once


def test_without_a_tokenizer_constrained_requests_are_refused():
    manager = StructuredOutputManager()
    with pytest.raises(ValueError, match="tokenizer"):
        manager.add_request(constrained("x", regex="a"))
    manager.add_request(Request("plain", [1], SamplingParams(max_tokens=1)))  # the rest is untouched
    manager.shutdown()


def test_grammar_waits_for_the_end_of_reasoning(manager, tokenizer):
    """reasoning_end_token_id: free tokens (a -1 row, nothing fed to the matcher) until that id is
    sampled, then the grammar applies from the next token."""
    end_id = tokenizer.encode("!", add_special_tokens=False)[0]  # stands in for "</think>"
    thinking = constrained("thinking", regex="[0-9]+", reasoning_end_token_id=end_id)
    manager.add_request(thinking)
    wait_ready(thinking)
    row = ScheduledRequest(thinking, 3, [1])
    assert manager.grammar_bitmask([row]) is None  # still reasoning: no constrained row
    for token_id in tokenizer.encode("Let me see", add_special_tokens=False):  # not digits: free
        thinking.grammar.accept_token(token_id)
        assert thinking.grammar.error is None and thinking.grammar.is_reasoning
    thinking.grammar.accept_token(end_id)
    assert not thinking.grammar.is_reasoning
    texts = [tokenizer.decode([i]) for i in allowed_ids(manager.grammar_bitmask([row])[0])]
    assert texts and all(t.isdigit() for t in texts)
    thinking.grammar.accept_token(tokenizer.encode("abc", add_special_tokens=False)[0])
    assert thinking.grammar.error is not None  # the grammar holds now


def test_grammar_waits_for_a_header_that_ends_the_reasoning(manager, tokenizer):
    """reasoning_end_prefix_ids (gpt-oss's `<|channel|>final`, then its `<|message|>`): the end id alone,
    or after another prefix, keeps the tokens free; after the prefix and a few tokens (`<|constrain|>json`)
    it starts the grammar. Speculative drafts see the same: free up to the end, the grammar after it."""
    channel, final, constrain, message = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "#f@!")
    analysis = tokenizer.encode("a", add_special_tokens=False)[0]
    request = constrained(
        "harmony", regex="[0-9]+", reasoning_end_token_id=message, reasoning_end_prefix_ids=[channel, final]
    )
    manager.add_request(request)
    wait_ready(request)
    grammar = request.grammar
    for token_id in (message, channel, analysis, message):  # an analysis message's body: still free
        grammar.accept_token(token_id)
        assert grammar.is_reasoning
    assert grammar.grammar_start([channel, final, constrain, message, 5]) == 4  # drafts: after the header
    assert grammar.grammar_start([channel, final, constrain]) == 4  # not ended in the drafts: all free
    for token_id in (channel, final, constrain):
        grammar.accept_token(token_id)
        assert grammar.is_reasoning
    grammar.accept_token(message)
    assert not grammar.is_reasoning and grammar.grammar_start([message]) == 0
    row = ScheduledRequest(request, 3, [1])
    texts = [tokenizer.decode([i]) for i in allowed_ids(manager.grammar_bitmask([row])[0])]
    assert texts and all(t.isdigit() for t in texts)
    # A prompt that ends inside the header: the output's end id completes it.
    spec = StructuredOutputsParams(
        regex="[0-9]+", reasoning_end_token_id=message, reasoning_end_prefix_ids=[channel, final]
    )
    opened = Request("opened", [1, channel, final], SamplingParams(max_tokens=4, structured_outputs=spec))
    manager.add_request(opened)
    wait_ready(opened)
    opened.grammar.accept_token(message)
    assert not opened.grammar.is_reasoning


def test_reasoning_end_token_id_is_checked_and_travels():
    with pytest.raises(StructuredOutputsError, match="reasoning_end_token_id must be a token id"):
        StructuredOutputsParams(regex="a", reasoning_end_token_id=-1)
    with pytest.raises(StructuredOutputsError, match="reasoning_end_prefix_ids must be a non-empty list"):
        StructuredOutputsParams(regex="a", reasoning_end_token_id=1, reasoning_end_prefix_ids=[3, "x"])
    with pytest.raises(StructuredOutputsError, match="beside a reasoning_end_token_id"):
        StructuredOutputsParams(regex="a", reasoning_end_prefix_ids=[3])
    spec = StructuredOutputsParams(regex="a", reasoning_end_token_id=7, reasoning_end_prefix_ids=[5, 6])
    request = EngineCoreRequest.from_request(Request("r", [1], SamplingParams(structured_outputs=spec)))
    decoded = make_input_decoder().decode(make_encoder().encode(AddRequests([request])))
    travelled = decoded.requests[0].sampling_params.structured_outputs
    assert (travelled.reasoning_end_token_id, travelled.reasoning_end_prefix_ids) == (7, [5, 6])

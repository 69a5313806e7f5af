"""Structured outputs through `xlaserve serve` and the official `openai` client, on SmolLM2: OpenAI's
`response_format` (and `chat.completions.parse` with a pydantic model), vLLM's `structured_outputs`
(json, regex, choice, grammar), and constrained requests sharing steps with unconstrained ones."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pydantic
import pytest

from helpers.json_schemas import SCHEMAS
from helpers.sdk_clients import strict_openai
from helpers.server_harness import MODEL_NAME

MAX_TOKENS = 96  # each of the 20 schemas completes in under 64 tokens, at temperature 0 or 1


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return strict_openai(server)


@pytest.fixture(scope="module")
def async_client(server):
    """A factory: an async client's connections belong to the event loop they were opened on."""
    return lambda: openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300
    )


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON for a {name} record."}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_against_its_schema(async_client, temperature):
    """Twenty schemas at once (they share steps): each output parses and validates, and stops on its
    own (the grammar completes) rather than at max_tokens."""

    async def one(client, i: int, name: str, schema: dict):
        return await client.chat.completions.create(
            model=MODEL_NAME,
            messages=ask(name),
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": schema, "strict": True},
            },
        )

    async def run():
        async with async_client() as client:
            return await asyncio.gather(*(one(client, i, n, s) for i, (n, s) in enumerate(SCHEMAS.items())))

    for (name, schema), response in zip(SCHEMAS.items(), asyncio.run(run())):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", f"{name}: {choice.message.content!r}"
        jsonschema.validate(json.loads(choice.message.content), schema)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)
    population_millions: int = pydantic.Field(ge=0, le=40)
    is_capital: bool


def test_parse_returns_a_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, City), message.content
    assert City.model_validate_json(message.content) == message.parsed


def test_regex_choice_and_grammar(client):
    def complete(prompt: str, n: int = 1, **structured_outputs):
        return client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=24,
            temperature=1.0,
            seed=5,
            n=n,
            extra_body={"structured_outputs": structured_outputs},
        ).choices

    for choice in complete("Phone:", n=3, regex=r"\+1-[0-9]{3}-[0-9]{4}"):
        assert re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", choice.text) and choice.finish_reason == "stop"
    options = ["yes", "no", "not sure"]
    choices = complete("Is the sky green?", n=4, choice=options)  # one matcher per child
    assert all(c.text in options and c.finish_reason == "stop" for c in choices)
    grammar = 'start: "(" NUM (" + " NUM)? (" + " NUM)? ")"\nNUM: /[0-9]{1,2}/'  # llguidance's Lark
    (choice,) = complete("Sum:", grammar=grammar)
    assert (
        re.fullmatch(r"\([0-9]{1,2}( \+ [0-9]{1,2}){0,2}\)", choice.text) and choice.finish_reason == "stop"
    )


def test_json_object_streams_and_works_on_completions(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "user", "content": "Give a JSON object with keys x and y."}
        ],  # any object: keep it short
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="A JSON object describing a cat:",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "cat", "schema": SCHEMAS["person"]},
            }
        },
    )
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS["person"])


def test_logprobs_are_those_of_the_constrained_distribution(client):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ask("color"),
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS["color"]}},
    )
    content = response.choices[0].logprobs.content
    assert "".join(t.token for t in content) == response.choices[0].message.content
    # Greedy under the mask: each token is the most likely of those the grammar allowed.
    assert all(t.top_logprobs[0].token == t.token and t.logprob > -9999 for t in content)


def test_unconstrained_outputs_are_unchanged_by_constrained_neighbours(async_client):
    """Greedy requests alone, then sharing steps with constrained ones (the masked sampler variant):
    the same tokens."""
    prompts = ["The capital of France is", "List three fruits:", "Once upon a time"]

    async def plain(client, prompt: str) -> str:
        r = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
        return r.choices[0].text

    async def constrained(client, name: str) -> str:
        r = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=ask(name),
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}},
        )
        return r.choices[0].message.content

    async def run():
        async with async_client() as client:
            alone = await asyncio.gather(*(plain(client, p) for p in prompts))
            mixed = await asyncio.gather(
                *(plain(client, p) for p in prompts), *(constrained(client, n) for n in ("items", "refs"))
            )
        return alone, mixed[: len(prompts)]

    alone, mixed = asyncio.run(run())
    assert mixed == alone


BAD_REQUESTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema"),  # a keyword llguidance does not implement
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param", BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_bad_spec_is_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=ask("x"), max_tokens=4, extra_body=fields)
    assert info.value.body["param"] == param, info.value.body
    ok = client.chat.completions.create(model=MODEL_NAME, messages=ask("x"), max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")

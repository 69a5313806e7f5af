"""The OpenAI Agents SDK (`openai-agents`) against `xlaserve serve` (the session's SmolLM2 server), on
its default model provider, which speaks the Responses API: an agent with a function tool gets the
tool called with arguments its schema accepts, and a plain agent's final output equals what
/v1/responses answers directly for the same instructions and input."""

from __future__ import annotations

import asyncio

import httpx
import jsonschema
import pytest

from helpers.server_harness import MODEL_NAME

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")

CITY_DAYS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "days"],
}
QUESTION = "What is 2+2?"
ASK = "What will the weather be in Paris for the next 3 days?"


def run(server, agent, text: str, api: str = "responses"):
    """Runner.run on the SDK's default provider (`api`: the Responses API, or "chat_completions") pointed
    at the server, with a client made in this run's event loop (an AsyncOpenAI client is bound to its
    loop), tracing off."""

    async def go():
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300
        )
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_default_openai_api(api)
        agents.set_tracing_disabled(True)
        try:
            return await agents.Runner.run(agent, text, max_turns=2)
        finally:
            await client.close()

    return asyncio.run(go())


def test_agent_calls_a_function_tool(server):
    calls = []

    @agents.function_tool
    def get_weather(city: str, days: int) -> str:
        """Weather forecast for a city."""
        calls.append({"city": city, "days": days})
        return "sunny"

    agent = agents.Agent(
        name="forecaster",
        instructions="Use the tools.",
        model=MODEL_NAME,
        tools=[get_weather],
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0.0, max_tokens=100
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = run(server, agent, ASK)
    assert len(calls) >= 1
    for call in calls:
        jsonschema.validate(call, CITY_DAYS)
    assert result.final_output == "sunny"
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]


def test_plain_agent_answers_as_the_responses_route(server):
    agent = agents.Agent(
        name="plain",
        instructions="Answer briefly.",
        model=MODEL_NAME,
        model_settings=agents.ModelSettings(temperature=0.0, max_tokens=100),
    )
    # The SDK fails an incomplete response: the answer must end before max_tokens.
    result = run(server, agent, QUESTION)
    body = {
        "model": MODEL_NAME,
        "instructions": "Answer briefly.",
        "input": QUESTION,
        "temperature": 0.0,
        "max_output_tokens": 100,
        "store": False,
    }
    direct = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers, timeout=300)
    assert direct.status_code == 200, direct.text
    text = "".join(
        part["text"]
        for item in direct.json()["output"]
        if item["type"] == "message"
        for part in item["content"]
    )
    assert result.final_output == text and text


def test_chat_completions_agent_with_reasoning_effort_and_verbosity(server):
    """The SDK's chat provider sends a ModelSettings' reasoning effort as `reasoning_effort` and its
    verbosity as `verbosity` (vLLM takes both; gpt-oss's template reads the effort, SmolLM2's ignores
    it): the agent answers as the chat route does for the same messages."""
    settings = {"temperature": 0.0, "max_tokens": 16}
    agent = agents.Agent(
        name="plain",
        instructions="Answer briefly.",
        model=MODEL_NAME,
        model_settings=agents.ModelSettings(
            **settings, reasoning=openai.types.shared.Reasoning(effort="low"), verbosity="low"
        ),
    )
    result = run(server, agent, QUESTION, api="chat_completions")
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    body = {"model": MODEL_NAME, "messages": messages, **settings}
    direct = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=300)
    assert direct.status_code == 200, direct.text
    text = direct.json()["choices"][0]["message"]["content"]
    assert result.final_output == text and text

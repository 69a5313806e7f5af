"""Remote MCP tools in the Responses API (the session's server, started with --tool-server naming the
suite's MCP server and an address where nothing listens), driven by the official `openai` client: the
tools are listed (allowed_tools applied), the model's calls are made by the server and fed back, and
every output item says what happened; an MCP server outside --tool-server is refused before any
connection, and the other bad tool specs are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from helpers.mcp_server import ToolServer, tide_table
from helpers.server_harness import MODEL_NAME

ASK = "When is high tide in Brest? Use the tide table."


def mcp_tool(url: str, **fields) -> dict:
    return {"type": "mcp", "server_label": "tides", "server_url": url, "require_approval": "never", **fields}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


def test_tools_are_listed_called_and_fed_back(server, client, mcp_tool_server):
    mcp_tool_server.calls.clear()
    response = client.responses.create(
        model=MODEL_NAME,
        input=ASK,
        tools=[mcp_tool(mcp_tool_server.url, allowed_tools=["tide_table"])],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_output_tokens=80,
    )
    kinds = [item.type for item in response.output]
    # What follows the calls is the model's (SmolLM2 under auto may call again, or answer).
    assert kinds[0] == "mcp_list_tools" and kinds[1] == "mcp_call", kinds
    listed = response.output[0]
    assert listed.server_label == "tides" and [t.name for t in listed.tools] == ["tide_table"]
    assert listed.tools[0].input_schema["required"] == ["port"]
    calls = [item for item in response.output if item.type == "mcp_call"]
    # Every call the model made reached the MCP server, in order, and its output is the tool's answer.
    assert [(name, args) for name, args in mcp_tool_server.calls] == [
        ("tide_table", json.loads(call.arguments)) for call in calls
    ]
    for call in calls:
        assert call.server_label == "tides" and call.name == "tide_table" and call.error is None
        assert call.output == tide_table(json.loads(call.arguments)["port"])
    assert response.status == "completed"
    # Every model turn's prompt is counted: each after a call holds the one before it.
    prompt_ids = httpx.post(
        server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": ASK}, headers=server.headers
    ).json()["tokens"]
    assert response.usage.input_tokens > (len(calls) + 1) * len(prompt_ids)


def test_a_server_outside_the_allow_list_is_never_contacted(server, client):
    outsider = ToolServer("outsider")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(
                model=MODEL_NAME, input=ASK, tools=[mcp_tool(outsider.url)], max_output_tokens=8
            )
        error = e.value.body
        assert error["param"] == "tools[0].server_url" and outsider.address in error["message"]
        assert outsider.num_requests == 0 and outsider.calls == []
    finally:
        outsider.stop()


def test_an_allowed_server_that_is_down_is_424(server, dead_tool_server_address):
    body = {"model": MODEL_NAME, "input": ASK, "tools": [mcp_tool(f"http://{dead_tool_server_address}/mcp")]}
    response = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers, timeout=120)
    assert response.status_code == 424, response.text
    assert response.json()["error"]["param"] == "tools[0].server_url"


BAD = [  # (tools, other fields, the param named)
    ([mcp_tool("ftp://127.0.0.1:21/mcp")], {}, "tools[0].server_url"),
    ([mcp_tool("not a url")], {}, "tools[0].server_url"),
    ([mcp_tool("http://169.254.169.254/latest/meta-data")], {}, "tools[0].server_url"),
    ([mcp_tool("http://x/mcp", require_approval="always")], {}, "tools[0].require_approval"),
    ([mcp_tool("http://x/mcp", server_label="a b")], {}, "tools[0].server_label"),
    ([mcp_tool("http://x/mcp", allowed_tools=["bad name!"])], {}, "tools[0].allowed_tools[0]"),
    ([mcp_tool("http://x/mcp", headers={"a": "b"})], {}, "tools[0].headers"),
    ([{"type": "mcp", "server_label": "t"}], {}, "tools[0].server_url"),
    ([{"type": "mcpx", "server_label": "t"}], {}, "tools[0].type"),
    ([mcp_tool("http://x/mcp")], {"stream": True}, "stream"),
]


@pytest.mark.parametrize("tools,fields,param", BAD, ids=[p for _, _, p in BAD])
def test_bad_mcp_tools_are_400_naming_the_field(server, mcp_tool_server, tools, fields, param):
    tools = [
        {**t, "server_url": mcp_tool_server.url} if t.get("server_url") == "http://x/mcp" else t
        for t in tools
    ]
    before = mcp_tool_server.num_requests
    body = {"model": MODEL_NAME, "input": ASK, "tools": tools, **fields}
    response = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    assert mcp_tool_server.num_requests == before


def test_two_servers_with_one_label_are_400(server, mcp_tool_server):
    tools = [mcp_tool(mcp_tool_server.url), mcp_tool(mcp_tool_server.url)]
    body = {"model": MODEL_NAME, "input": ASK, "tools": tools}
    response = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools[1].server_label"

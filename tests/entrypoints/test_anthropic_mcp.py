"""Anthropic's MCP connector (`mcp_servers`, beta mcp-client-2025-04-04) on /v1/messages, through the
session's server (--tool-server naming the suite's MCP server and an address where nothing listens) and
the official `anthropic` client: the model's calls of an MCP server's tools are made by the server and
shown as mcp_tool_use / mcp_tool_result blocks, the model goes on after them, a streamed answer is the
whole one block for block, tool_configuration decides what is offered, the authorization token reaches
the MCP server and is never echoed, and a server outside --tool-server is refused before any connection.
A disabled server is never contacted, count_tokens counts the first turn with the MCP tools offered, a
listed tool name outside Anthropic's pattern or taken twice is refused, and each later turn's prompt is
the answer so far sent back as history."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from helpers.mcp_server import ToolServer, tide_table
from helpers.sdk_clients import anthropic_prompt_tokens, strict_anthropic
from helpers.server_harness import MODEL_NAME

ASK = [{"role": "user", "content": "When is high tide in Brest? Use the tide table."}]
BETA = ["mcp-client-2025-04-04"]
GREEDY = {"temperature": 0}  # this client has no temperature argument; the API still takes the field
# What the prefix cache held of the prompts differs from run to run (a later run finds an earlier's blocks).
UNCACHED = {"input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}


def _usage(message) -> dict:
    """A message's usage as runs of one request compare."""
    return message.usage.model_dump(exclude=UNCACHED, exclude_none=True)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return strict_anthropic(server)


def mcp_server(url: str, **fields) -> dict:
    return {"type": "url", "url": url, "name": "tides", **fields}


def tide_fields(url: str, max_tokens: int, **fields) -> dict:
    """ASK with the tide table alone offered and a call of it forced first, greedy."""
    only = {"tool_configuration": {"allowed_tools": ["tide_table"]}}
    return dict(
        model=MODEL_NAME,
        messages=ASK,
        mcp_servers=[mcp_server(url, **only, **fields)],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=max_tokens,  # over every turn of the message
        betas=BETA,
        extra_body=GREEDY,
    )


def _check_calls(message, mcp_tool_server) -> list:
    """Each mcp_tool_use is followed by its result, the tool's answer; every call reached the MCP server."""
    kinds = [block.type for block in message.content]
    assert kinds[:2] == ["mcp_tool_use", "mcp_tool_result"], kinds
    uses = [block for block in message.content if block.type == "mcp_tool_use"]
    results = [block for block in message.content if block.type == "mcp_tool_result"]
    assert [r.tool_use_id for r in results] == [u.id for u in uses]
    assert len({u.id for u in uses}) == len(uses) and all(u.id.startswith("mcptoolu_") for u in uses)
    for use, result in zip(uses, results):
        assert use.server_name == "tides" and use.name == "tide_table"
        assert not result.is_error
        assert [part.text for part in result.content] == [tide_table(use.input["port"])]
    assert mcp_tool_server.calls == [("tide_table", use.input) for use in uses]
    return uses


def test_a_call_is_made_by_the_server_and_the_model_goes_on(server, client, mcp_tool_server):
    mcp_tool_server.calls.clear()
    message = client.beta.messages.create(**tide_fields(mcp_tool_server.url, 96))
    (use, *_) = _check_calls(message, mcp_tool_server)
    # After the result the model went on (a later turn): its blocks follow, the stop reason is its own.
    assert len(message.content) > 2 and message.content[0].id == use.id
    # (SmolLM2 under auto may answer, or call a tool of its own invention: a tool_use block for the client.)
    is_called = any(block.type == "tool_use" for block in message.content)
    assert message.stop_reason in (("tool_use",) if is_called else ("end_turn", "max_tokens"))
    assert message.usage.output_tokens <= 96  # max_tokens bounds the turns together
    # Every turn's prompt is counted: the second holds the first.
    prompt_ids = httpx.post(
        server.url + "/tokenize", json={"model": MODEL_NAME, "messages": ASK}, headers=server.headers
    ).json()["tokens"]
    assert anthropic_prompt_tokens(message.usage) > 2 * len(prompt_ids)
    # The answer's MCP blocks sent back as history: the call and its result reach the prompt.
    made = [block.model_dump(exclude_none=True) for block in message.content[:2]]
    history = [*ASK, {"role": "assistant", "content": made}, {"role": "user", "content": "Thanks."}]
    answered = client.messages.create(model=MODEL_NAME, messages=history, max_tokens=4, extra_body=GREEDY)
    without = [*ASK, {"role": "assistant", "content": made[:1]}, {"role": "user", "content": "Thanks."}]
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=without)
    assert answered.content and anthropic_prompt_tokens(answered.usage) > counted.input_tokens
    # Each later turn's prompt is the request's with the answer so far sent back as an assistant message
    # (the same tools offered): the turns' prompts summed, as count_tokens counts each, are the usage.
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    starts = [i for i in range(1, len(blocks)) if _turn_starts(blocks, i)]
    servers = tide_fields(mcp_tool_server.url, 1)["mcp_servers"]
    turns = [ASK] + [[*ASK, {"role": "assistant", "content": blocks[:i]}] for i in starts]
    assert len(turns) >= 2
    counts = [
        client.beta.messages.count_tokens(model=MODEL_NAME, messages=turn, mcp_servers=servers, betas=BETA)
        for turn in turns
    ]
    assert anthropic_prompt_tokens(message.usage) == sum(count.input_tokens for count in counts)


def _turn_starts(blocks: list[dict], i: int) -> bool:
    """Whether a model turn starts at block i: after the results of the turn before."""
    return blocks[i - 1]["type"] == "mcp_tool_result" and blocks[i]["type"] != "mcp_tool_result"


def _no_id(block) -> dict:
    return block.model_dump(exclude={"id", "tool_use_id"}, exclude_none=True)


def test_a_streamed_message_is_the_whole_one_block_for_block(server, client, mcp_tool_server):
    fields = tide_fields(mcp_tool_server.url, 64)
    whole = client.beta.messages.create(**fields)
    mcp_tool_server.calls.clear()
    with client.beta.messages.stream(**fields) as stream:
        streamed = stream.get_final_message()
    _check_calls(streamed, mcp_tool_server)
    assert [_no_id(b) for b in streamed.content] == [_no_id(b) for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    assert _usage(streamed) == _usage(whole)
    # The events, read raw: the call's block streams its input, its result comes whole after it.
    body = {k: v for k, v in fields.items() if k not in ("betas", "extra_body")} | GREEDY | {"stream": True}
    headers = {**server.headers, "anthropic-beta": BETA[0]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    first = kinds.index("content_block_start")
    use = events[first]["content_block"]
    assert use["type"] == "mcp_tool_use" and use["server_name"] == "tides" and use["input"] == {}
    end = kinds.index("content_block_stop", first)
    deltas = [e["delta"] for e in events[first + 1 : end]]
    assert deltas and all(d["type"] == "input_json_delta" for d in deltas)
    assert json.loads("".join(d["partial_json"] for d in deltas)) == whole.content[0].input
    result = events[end + 1]
    assert result["type"] == "content_block_start" and result["index"] == events[end]["index"] + 1
    assert result["content_block"]["type"] == "mcp_tool_result"
    assert result["content_block"]["tool_use_id"] == use["id"]
    assert events[end + 2] == {"type": "content_block_stop", "index": result["index"]}
    assert {k: v for k, v in events[-2]["usage"].items() if k not in UNCACHED} == _usage(whole)


def test_tool_configuration_decides_what_is_offered(server, client, mcp_tool_server):
    mcp_tool_server.calls.clear()
    # allowed_tools: a name the server lacks is simply not offered; launch_codes is never offered, so
    # even a call the model must make (tool_choice any) cannot be of it.
    configuration = {"allowed_tools": ["set_alarm", "no_such_tool"]}
    message = client.beta.messages.create(
        model=MODEL_NAME,
        messages=ASK,
        mcp_servers=[mcp_server(mcp_tool_server.url, tool_configuration=configuration)],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=120,
        betas=BETA,
        extra_body=GREEDY,
    )
    uses = [block for block in message.content if block.type == "mcp_tool_use"]
    assert uses and {use.name for use in uses} == {"set_alarm"}
    # (Made unless max_tokens cut it: SmolLM2 may go on adding properties to an open schema.)
    assert {name for name, _ in mcp_tool_server.calls} <= {"set_alarm"}
    for choice, configuration in [
        ({"type": "tool", "name": "launch_codes"}, {"allowed_tools": ["tide_table"]}),
        ({"type": "any"}, {"enabled": False}),
    ]:
        body = {
            "model": MODEL_NAME,
            "max_tokens": 8,
            "messages": ASK,
            "mcp_servers": [mcp_server(mcp_tool_server.url, tool_configuration=configuration)],
            "tool_choice": choice,
        }
        response = httpx.post(server.url + "/v1/messages", json=body, headers=server.headers, timeout=60)
        assert response.status_code == 400 and "tool_choice" in response.json()["error"]["message"]
    assert "launch_codes" not in {name for name, _ in mcp_tool_server.calls}


def test_the_token_reaches_the_mcp_server_and_is_never_echoed(server, client, mcp_tool_server):
    first = len(mcp_tool_server.headers)
    tools = [mcp_server(mcp_tool_server.url, authorization_token="token-456")]
    message = client.beta.messages.create(
        model=MODEL_NAME, messages=ASK, mcp_servers=tools, max_tokens=4, betas=BETA, extra_body=GREEDY
    )
    seen = mcp_tool_server.headers[first:]
    assert seen and all(h.get("authorization") == "Bearer token-456" for h in seen)  # every request
    assert "token-456" not in json.dumps(message.model_dump())
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": ASK, "mcp_servers": tools, "stream": True}
    streamed = httpx.post(server.url + "/v1/messages", json=body, headers=server.headers, timeout=120)
    assert streamed.status_code == 200 and "token-456" not in streamed.text


def test_a_server_outside_the_allow_list_is_never_contacted(server, client):
    outsider = ToolServer("outsider")
    try:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.beta.messages.create(
                model=MODEL_NAME,
                messages=ASK,
                mcp_servers=[mcp_server(outsider.url)],
                max_tokens=8,
                betas=BETA,
            )
        message = e.value.body["error"]["message"]
        assert "mcp_servers[0].url" in message and outsider.address in message
        assert outsider.num_requests == 0 and outsider.calls == []
    finally:
        outsider.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_an_allowed_server_that_is_down_is_424_before_any_answer(server, dead_tool_server_address, stream):
    body = {
        "model": MODEL_NAME,
        "max_tokens": 8,
        "messages": ASK,
        "mcp_servers": [mcp_server(f"http://{dead_tool_server_address}/mcp")],
        "stream": stream,
    }
    response = httpx.post(server.url + "/v1/messages", json=body, headers=server.headers, timeout=120)
    assert response.status_code == 424, response.text
    error = response.json()
    assert error["type"] == "error" and "mcp_servers[0].url" in error["error"]["message"]


def test_two_servers_with_one_name_are_400(server, mcp_tool_server):
    servers = [mcp_server(mcp_tool_server.url), mcp_server(mcp_tool_server.url)]
    before = mcp_tool_server.num_requests
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": ASK, "mcp_servers": servers}
    response = httpx.post(server.url + "/v1/messages", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 400 and "mcp_servers[1].name" in response.json()["error"]["message"]
    assert mcp_tool_server.num_requests == before


def test_a_disabled_server_is_never_contacted_nor_offered(
    server, client, mcp_tool_server, dead_tool_server_address
):
    off = {"tool_configuration": {"enabled": False}}
    servers = [
        mcp_server(f"http://{dead_tool_server_address}/mcp", name="down", **off),
        mcp_server(mcp_tool_server.url, **off),
    ]
    before = mcp_tool_server.num_requests
    message = client.beta.messages.create(
        model=MODEL_NAME, messages=ASK, mcp_servers=servers, max_tokens=1, betas=BETA, extra_body=GREEDY
    )
    counted = client.beta.messages.count_tokens(
        model=MODEL_NAME, messages=ASK, mcp_servers=servers, betas=BETA
    )
    plain = client.messages.count_tokens(model=MODEL_NAME, messages=ASK)
    assert (
        anthropic_prompt_tokens(message.usage) == counted.input_tokens == plain.input_tokens
    )  # none offered
    assert mcp_tool_server.num_requests == before


def test_count_tokens_counts_the_first_turn_with_the_mcp_tools(
    server, client, mcp_tool_server, dead_tool_server_address
):
    fields = dict(model=MODEL_NAME, messages=ASK, mcp_servers=[mcp_server(mcp_tool_server.url)], betas=BETA)
    counted = client.beta.messages.count_tokens(**fields)
    # One token: no call can be made, the message is its first turn.
    message = client.beta.messages.create(**fields, max_tokens=1, extra_body=GREEDY)
    assert counted.input_tokens == anthropic_prompt_tokens(message.usage)
    assert counted.input_tokens > client.messages.count_tokens(model=MODEL_NAME, messages=ASK).input_tokens
    # The messages route's refusals: a server outside --tool-server (400), one that is down (424).
    down = {**fields, "mcp_servers": [mcp_server(f"http://{dead_tool_server_address}/mcp")]}
    with pytest.raises(anthropic.APIStatusError) as e:
        client.beta.messages.count_tokens(**down)
    assert e.value.status_code == 424 and "mcp_servers[0].url" in e.value.body["error"]["message"]
    outside = {**fields, "mcp_servers": [mcp_server("http://127.0.0.1:9/mcp")]}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.beta.messages.count_tokens(**outside)
    assert "mcp_servers[0].url" in e.value.body["error"]["message"]


def _refusal(server, path: str, body: dict) -> tuple[int, str]:
    response = httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)
    return response.status_code, response.json().get("error", {}).get("message", "")


def test_a_tool_name_outside_the_pattern_or_taken_twice_is_refused(server, client, mcp_tool_server):
    """The odd server lists tide.table (outside ^[a-zA-Z0-9_-]{1,64}$), tide_table (the tides server's
    tool's name) and moon_phase: a 424 naming the server and the tool, or a 400 naming allowed_tools,
    on both routes, and no tool is called."""
    odd = mcp_server(mcp_tool_server.odd_url, name="odd")
    calls = len(mcp_tool_server.calls)
    moon = {"name": "moon_phase", "input_schema": {"type": "object"}}
    cases = [
        ([odd], None, 424, ["mcp_servers[0]", "'odd'", "'tide.table'", "allowed_tools"]),
        ([{**odd, "tool_configuration": {"allowed_tools": ["moon_phase"]}}], [moon], 400,
         ["mcp_servers[0].tool_configuration.allowed_tools", "'moon_phase'"]),
        ([mcp_server(mcp_tool_server.url), {**odd, "tool_configuration": {"allowed_tools": ["tide_table"]}}],
         None, 400, ["mcp_servers[1].tool_configuration.allowed_tools", "'tide_table'"]),
    ]  # fmt: skip
    for servers, tools, status, named in cases:
        body = {
            "model": MODEL_NAME,
            "messages": ASK,
            "mcp_servers": servers,
            **({"tools": tools} if tools else {}),
        }
        for path, fields in [("/v1/messages/count_tokens", {}), ("/v1/messages", {"max_tokens": 4})]:
            code, message = _refusal(server, path, {**body, **fields})
            assert code == status and all(name in message for name in named), (path, code, message)
    # Left out with allowed_tools, the odd server's other tools are offered.
    allowed = [{**odd, "tool_configuration": {"allowed_tools": ["moon_phase"]}}]
    counted = client.beta.messages.count_tokens(
        model=MODEL_NAME, messages=ASK, mcp_servers=allowed, betas=BETA
    )
    assert counted.input_tokens > client.messages.count_tokens(model=MODEL_NAME, messages=ASK).input_tokens
    assert len(mcp_tool_server.calls) == calls


def test_a_later_turn_sees_the_earlier_ones_as_history_would():
    """An MCP turn's thinking, calls (their input as JSON, non-ASCII kept) and results reach the later
    turns' prompt as the same blocks sent back by the client do (convert.py's assistant messages)."""
    from xlaserve.entrypoints.anthropic.convert import assistant_history

    use = {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "tide_table", "input": {"port": "Brest é"},
           "server_name": "tides"}  # fmt: skip
    result = {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "is_error": False,
              "content": [{"type": "text", "text": "06:12"}]}  # fmt: skip
    blocks = [{"type": "thinking", "thinking": "Look it up.", "signature": ""}, use, result]
    call = {"id": "mcptoolu_1", "type": "function",
            "function": {"name": "tide_table", "arguments": '{"port": "Brest é"}'}}  # fmt: skip
    assert assistant_history(blocks) == [
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "mcptoolu_1", "content": "06:12"},
    ]

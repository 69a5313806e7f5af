"""Remote MCP tools in the Responses API (the session's server, started with --tool-server naming the
suite's MCP server and an address where nothing listens), driven by the official `openai` client: the
tools are listed (allowed_tools applied), the model's calls are made by the server and fed back, and
every output item says what happened; an MCP server outside --tool-server is refused before any
connection, and the other bad tool specs are 400s naming the field."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from helpers.mcp_server import ToolServer, tide_table
from helpers.sdk_clients import strict_openai
from helpers.server_harness import MODEL_NAME, metric, metrics, wait_for_metrics

ASK = "When is high tide in Brest? Use the tide table."


def mcp_tool(url: str, **fields) -> dict:
    return {"type": "mcp", "server_label": "tides", "server_url": url, "require_approval": "never", **fields}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return strict_openai(server)


def tide_request(url: str, max_output_tokens: int, **fields) -> dict:
    """ASK with the tide table alone offered and a call of it required first, greedy."""
    return dict(
        model=MODEL_NAME,
        input=ASK,
        tools=[mcp_tool(url, allowed_tools=["tide_table"], **fields)],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_output_tokens=max_output_tokens,  # over every turn of the response
    )


def test_tools_are_listed_called_and_fed_back(server, client, mcp_tool_server):
    mcp_tool_server.calls.clear()
    response = client.responses.create(**tide_request(mcp_tool_server.url, 160))
    kinds = [item.type for item in response.output]
    # What follows the calls is the model's (SmolLM2 under auto may call again, or answer).
    assert kinds[0] == "mcp_list_tools" and kinds[1] == "mcp_call", kinds
    listed = response.output[0]
    assert listed.server_label == "tides" and [t.name for t in listed.tools] == ["tide_table"]
    assert listed.tools[0].input_schema["required"] == ["port"]
    assert listed.tools[0].annotations == {"readOnlyHint": True}  # the server's hints, as listed
    calls = [item for item in response.output if item.type == "mcp_call"]
    # Every call the model made reached the MCP server, in order, and its output is the tool's answer.
    assert [(name, args) for name, args in mcp_tool_server.calls] == [
        ("tide_table", json.loads(call.arguments)) for call in calls
    ]
    for call in calls:
        assert call.server_label == "tides" and call.name == "tide_table" and call.error is None
        assert call.output == tide_table(json.loads(call.arguments)["port"])
    assert response.status == "completed"
    assert response.usage.output_tokens <= 160  # max_output_tokens bounds the turns together (OpenAI's)
    # Every model turn's prompt is counted: each after a call holds the one before it.
    prompt_ids = httpx.post(
        server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": ASK}, headers=server.headers
    ).json()["tokens"]
    assert response.usage.input_tokens > (len(calls) + 1) * len(prompt_ids)


def test_a_streamed_response_is_the_whole_ones_event_by_event(server, client, mcp_tool_server):
    request = tide_request(mcp_tool_server.url, 80) | {"store": False}
    whole = client.responses.create(**request)
    mcp_tool_server.calls.clear()
    with client.responses.create(**request, stream=True) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert (
        kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}"
    )
    final = events[-1].response
    # The same output as the response made whole (greedy, batch invariant), ids aside, and the
    # items streamed are the final response's.
    assert [_no_id(i) for i in final.output] == [_no_id(i) for i in whole.output]
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens <= 80
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in final.output]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == list(range(len(done)))
    # Each item's own events, in order: the listing, then each call's arguments and the call itself.
    listed = final.output[0]
    assert _events_of(events, listed.id) == [
        "response.output_item.added",
        "response.mcp_list_tools.in_progress",
        "response.mcp_list_tools.completed",
        "response.output_item.done",
    ]
    calls = [i for i in final.output if i.type == "mcp_call"]
    assert calls
    for call in calls:
        kinds = _events_of(events, call.id)
        deltas = [
            e.delta for e in events if e.type == "response.mcp_call_arguments.delta" and e.item_id == call.id
        ]
        assert kinds == [
            "response.output_item.added",
            *["response.mcp_call_arguments.delta"] * len(deltas),
            "response.mcp_call_arguments.done",
            "response.mcp_call.in_progress",
            "response.mcp_call.completed",
            "response.output_item.done",
        ]
        assert "".join(deltas) == call.arguments
        assert call.output == tide_table(json.loads(call.arguments)["port"]) and call.status == "completed"
    assert [(name, args) for name, args in mcp_tool_server.calls] == [
        ("tide_table", json.loads(call.arguments)) for call in calls
    ]


def test_a_client_leaving_a_streamed_response_ends_its_request(server, client, mcp_tool_server):
    request = dict(
        model=MODEL_NAME,
        input="Tell me a long story about the sea.",
        tools=[mcp_tool(mcp_tool_server.url, allowed_tools=["tide_table"])],
        tool_choice="none",
        temperature=0.0,
        max_output_tokens=250,  # the session's context is 512 tokens
        store=False,
    )
    whole = client.responses.create(**request).usage.output_tokens
    before = metrics(server)
    stream = client.responses.create(**request, stream=True)
    texts = 0
    for event in stream:
        texts += event.type == "response.output_text.delta"
        if texts == 3:
            break
    busy = wait_for_metrics(server, lambda m: metric(m, "num_requests_running") == 1, "the turn running")
    assert metric(busy, "kv_cache_usage_perc") > 0
    stream.close()
    idle = wait_for_metrics(server, lambda m: metric(m, "num_requests_running") == 0, "the turn aborted")
    assert metric(idle, "kv_cache_usage_perc") == 0  # its blocks freed (prefix caching keeps none in use)
    # Aborted, not run to its end unread (`whole`: the tokens it makes when read to its end).
    generated = metric(idle, "generation_tokens_total") - metric(before, "generation_tokens_total")
    assert 3 <= generated < whole, (generated, whole)
    again = client.responses.create(
        model=MODEL_NAME, input=ASK, tools=[mcp_tool(mcp_tool_server.url)], max_output_tokens=4
    )
    assert again.output[0].type == "mcp_list_tools"


def test_a_background_response_with_mcp_tools_is_the_foreground_one(server, client, mcp_tool_server):
    request = tide_request(mcp_tool_server.url, 80)
    whole = client.responses.create(**request)
    queued = client.responses.create(**request, background=True)
    assert queued.status == "queued" and queued.background
    deadline = time.monotonic() + 120
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert [_no_id(i) for i in done.output] == [_no_id(i) for i in whole.output]
    assert done.usage.output_tokens == whole.usage.output_tokens


def _no_id(item) -> dict:
    return item.model_dump(exclude={"id", "call_id"})  # both drawn at random


def _events_of(events, item_id: str) -> list[str]:
    """The types of the events about item `item_id`, in order."""
    return [
        e.type
        for e in events
        if getattr(e, "item_id", None) == item_id or getattr(getattr(e, "item", None), "id", None) == item_id
    ]


def test_headers_and_the_token_reach_the_mcp_server_and_are_never_echoed(server, client, mcp_tool_server):
    first = len(mcp_tool_server.headers)
    tool = mcp_tool(mcp_tool_server.url, headers={"X-Api-Key": "key-123"}, authorization="token-456")
    response = client.responses.create(model=MODEL_NAME, input=ASK, tools=[tool], max_output_tokens=4)
    seen = mcp_tool_server.headers[first:]
    assert seen and all(h.get("x-api-key") == "key-123" for h in seen)  # every request of the session
    assert all(h.get("authorization") == "Bearer token-456" for h in seen)
    # Secrets stay out of the response object, streamed or stored.
    echoed = (
        json.dumps(response.model_dump())
        + httpx.get(f"{server.url}/v1/responses/{response.id}", headers=server.headers).text
    )
    assert "key-123" not in echoed and "token-456" not in echoed
    assert response.tools[0].server_label == "tides"


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


@pytest.mark.parametrize("stream", [False, True])
def test_an_allowed_server_that_is_down_is_424(server, dead_tool_server_address, stream):
    # Streamed too: the tools are listed before the stream's headers go out.
    tools = [mcp_tool(f"http://{dead_tool_server_address}/mcp")]
    body = {"model": MODEL_NAME, "input": ASK, "tools": tools, "stream": stream}
    response = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers, timeout=120)
    assert response.status_code == 424, response.text
    assert response.json()["error"]["param"] == "tools[0].server_url"


def approval_request(response):
    (asked,) = [item for item in response.output if item.type == "mcp_approval_request"]
    return asked


def test_an_approved_call_waits_for_the_client_and_a_declined_one_is_never_made(
    server, client, mcp_tool_server
):
    tools = [mcp_tool(mcp_tool_server.url, allowed_tools=["tide_table"], require_approval="always")]
    mcp_tool_server.calls.clear()
    first = client.responses.create(**tide_request(mcp_tool_server.url, 80, require_approval="always"))
    # The model's call is asked, not made: the response ends with it.
    assert [item.type for item in first.output] == ["mcp_list_tools", "mcp_approval_request"]
    asked = approval_request(first)
    assert asked.server_label == "tides" and asked.name == "tide_table" and first.status == "completed"
    port = json.loads(asked.arguments)["port"]
    assert mcp_tool_server.calls == []

    def answer(approve: bool, **fields):
        item = {"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": approve}
        return client.responses.create(
            model=MODEL_NAME,
            previous_response_id=first.id,
            input=[item],
            tools=tools,
            tool_choice="none",
            temperature=0.0,
            max_output_tokens=24,
            **fields,
        )

    declined = answer(False)
    assert mcp_tool_server.calls == [] and [i.type for i in declined.output][:1] == ["mcp_list_tools"]
    assert not [i for i in declined.output if i.type == "mcp_call"]
    approved = answer(True)
    made = approved.output[1]
    assert made.type == "mcp_call" and made.approval_request_id == asked.id
    assert made.arguments == asked.arguments and made.output == tide_table(port) and made.error is None
    assert mcp_tool_server.calls == [("tide_table", {"port": port})]
    assert approved.output[-1].type == "message"  # tool_choice none: the model answers with the output
    # The conversation goes on from the approved answer (its stored turns are a valid chat).
    follow_up = client.responses.create(
        model=MODEL_NAME, previous_response_id=approved.id, input="Thanks.", tools=tools, max_output_tokens=8
    )
    assert follow_up.status in ("completed", "incomplete") and follow_up.output[-1].type == "message"
    # Streamed, the same two answers (the second made once more), item for item.
    with client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input=[{"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": True}],
        tools=tools,
        tool_choice="none",
        temperature=0.0,
        max_output_tokens=24,
        stream=True,
    ) as stream:
        events = list(stream)
    final = events[-1].response
    assert [_no_id(i) for i in final.output] == [_no_id(i) for i in approved.output]
    assert _events_of(events, final.output[1].id) == [
        "response.output_item.added",
        "response.mcp_call_arguments.done",
        "response.mcp_call.in_progress",
        "response.mcp_call.completed",
        "response.output_item.done",
    ]
    # An answer must name a request that waits: an unknown id, or one the stored conversation answered.
    for previous in (first.id, approved.id):
        body = {
            "model": MODEL_NAME,
            "previous_response_id": previous,
            "input": [
                {
                    "type": "mcp_approval_response",
                    "approval_request_id": "mcpr_x" if previous == first.id else asked.id,
                    "approve": True,
                }
            ],
            "tools": tools,
        }
        response = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "input[0].approval_request_id"
    assert len(mcp_tool_server.calls) == 2


def test_a_filter_by_read_only_hint_asks_for_the_other_tools_only(server, client, mcp_tool_server):
    # tide_table is marked read-only by its server, set_alarm is not: only the latter waits.
    only = {"allowed_tools": ["tide_table", "set_alarm"]}
    tools = [mcp_tool(mcp_tool_server.url, require_approval={"never": {"read_only": True}}, **only)]
    mcp_tool_server.calls.clear()
    kinds = {}
    for name in ("tide_table", "set_alarm"):
        response = client.responses.create(
            model=MODEL_NAME,
            input=ASK,
            tools=tools,
            tool_choice={"type": "function", "name": name},
            temperature=0.0,
            max_output_tokens=120,
        )
        kinds[name] = [item.type for item in response.output][1]
    assert kinds == {"tide_table": "mcp_call", "set_alarm": "mcp_approval_request"}
    assert [name for name, _ in mcp_tool_server.calls] == ["tide_table"]


BAD = [  # (tools, other fields, the param named)
    ([mcp_tool("ftp://127.0.0.1:21/mcp")], {}, "tools[0].server_url"),
    ([mcp_tool("not a url")], {}, "tools[0].server_url"),
    ([mcp_tool("http://169.254.169.254/latest/meta-data")], {}, "tools[0].server_url"),
    ([mcp_tool("http://x/mcp", require_approval="sometimes")], {}, "tools[0].require_approval"),
    (
        [mcp_tool("http://x/mcp", require_approval={"always": {"tool_names": ["bad name!"]}})],
        {},
        "tools[0].require_approval.always.tool_names[0]",
    ),
    (
        [mcp_tool("http://x/mcp")],
        {"input": [{"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": True}]},
        "input[0].approval_request_id",
    ),
    ([mcp_tool("http://x/mcp", server_label="a b")], {}, "tools[0].server_label"),
    ([mcp_tool("http://x/mcp", allowed_tools=["bad name!"])], {}, "tools[0].allowed_tools[0]"),
    ([mcp_tool("http://x/mcp", headers={"X-Key": "a\r\nHost: evil"})], {}, "tools[0].headers"),
    ([mcp_tool("http://x/mcp", headers={"bad name": "b"})], {}, "tools[0].headers"),
    ([mcp_tool("http://x/mcp", headers={"Host": "evil"})], {}, "tools[0].headers"),
    ([mcp_tool("http://x/mcp", headers={"X-Big": "v" * 8193})], {}, "tools[0].headers"),
    (
        [mcp_tool("http://x/mcp", headers={"Authorization": "a"}, authorization="b")],
        {},
        "tools[0].headers",
    ),
    ([mcp_tool("http://x/mcp", headers={f"X-{i}": "v" for i in range(33)})], {}, "tools[0].headers"),
    ([mcp_tool("http://x/mcp", authorization="x" * 8193)], {}, "tools[0].authorization"),
    ([{"type": "mcp", "server_label": "t"}], {}, "tools[0].server_url"),
    ([{"type": "mcpx", "server_label": "t"}], {}, "tools[0].type"),
    ([mcp_tool("http://x/mcp", allowed_tools=["bad name!"])], {"stream": True}, "tools[0].allowed_tools[0]"),
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


def test_a_listed_tool_name_outside_the_pattern_is_424_naming_server_and_tool(
    server, client, mcp_tool_server
):
    """The odd server lists tide.table (outside ^[A-Za-z0-9_-]{1,64}$), which no prompt may offer: a 424
    naming the tool, its server and allowed_tools, streamed or not; left out with allowed_tools, the
    server's other tools are offered. No tool is called."""
    odd = {
        "type": "mcp",
        "server_label": "odd",
        "server_url": mcp_tool_server.odd_url,
        "require_approval": "never",
    }
    calls = len(mcp_tool_server.calls)
    for stream in (False, True):
        body = {"model": MODEL_NAME, "input": ASK, "tools": [odd], "max_output_tokens": 4, "stream": stream}
        response = httpx.post(server.url + "/v1/responses", json=body, headers=server.headers, timeout=60)
        error = response.json()["error"]
        assert response.status_code == 424 and error["param"] == "tools[0]", response.text
        assert all(name in error["message"] for name in ("'odd'", "'tide.table'", "tools[0].allowed_tools"))
    allowed = client.responses.create(
        model=MODEL_NAME, input=ASK, max_output_tokens=4, tools=[{**odd, "allowed_tools": ["moon_phase"]}]
    )
    assert [t.name for t in allowed.output[0].tools] == ["moon_phase"]
    assert len(mcp_tool_server.calls) == calls

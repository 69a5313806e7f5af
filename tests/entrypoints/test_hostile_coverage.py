"""The hostile-input suite covers every request field: a check that fails, naming the field, when a route's
request body (or query) has a field no hostile case breaks.

The fields come from the app's own OpenAPI schema, built on a stand-in engine with every optional route
mounted (LoRA, admin, profiler), walked from each route's body down through the nested models users send
(message parts, tools, response_format, stream_options...): a field is a (schema model, property) pair,
so the routes sharing a model (/score and /v1/score, a chat message on /tokenize and on /pooling) share
its fields. A hostile case is a (route, body, param) triple from the suite's tables (test_server_hostile,
test_pooling_server, test_admin_api, and CASES below, for what those leave out): its 4xx names `param`,
which covers every field on its path ("messages[0].content[0].text": the request's `messages`, the
message's `content`, the text part's `text`), the body picking the union member it passes through.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
import test_admin_api
import test_pooling_server
import test_server_hostile as hostile
from test_server_hostile import (
    ANTHROPIC_BODY,
    BODIES,
    CHAT,
    DROP,
    MESSAGES,
    check_error,
    check_still_serving,
    send,
)

# -- the fields: every route's request body and query, from the app's OpenAPI schema ------------------


@pytest.fixture(scope="module")
def schema() -> dict:
    """The OpenAPI schema of an app with every route mounted (its engine a stand-in: nothing runs)."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from xlaserve.entrypoints.app import build_app
    from xlaserve.entrypoints.serving.state import ServerState

    engine = SimpleNamespace(
        tokenizer=None, model="tiny", max_model_len=64, vocab_size=128, is_errored=False,
        input_processor=SimpleNamespace(max_logprobs=5),
    )  # fmt: skip
    state = ServerState(
        engine=engine, served_model_names=["tiny"], enable_admin_api=True, enable_profiler=True
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XLASERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
        return TestClient(build_app(state)).get("/openapi.json").json()


def _ref(node: dict) -> str | None:
    return node["$ref"].rsplit("/", 1)[1] if "$ref" in node else None


def _members(components: dict, node: dict, name: str | None = None):
    """(model name, schema) of every schema `node` may be: through $ref and anyOf/oneOf/allOf."""
    if (ref := _ref(node)) is not None:
        yield from _members(components, components[ref], ref)
        return
    yield name, node
    for key in ("anyOf", "oneOf", "allOf"):
        for member in node.get(key, []):
            yield from _members(components, member)


def _children(components: dict, node: dict):
    """(segment, model name, property schema) of what `node` holds one level down: "[]" an array's
    items, "{}" a free-form object's values, else a property of a model."""
    for name, member in _members(components, node):
        if isinstance(member.get("items"), dict):
            yield "[]", None, member["items"]
        if isinstance(member.get("additionalProperties"), dict):
            yield "{}", None, member["additionalProperties"]
        for prop, sub in member.get("properties", {}).items():
            yield prop, name, sub


def request_bodies(schema: dict) -> dict[str, dict]:
    """'METHOD /path' -> its JSON body's schema, for every route that takes one."""
    bodies = {}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            content = operation.get("requestBody", {}).get("content", {})
            if "application/json" in content:
                bodies[f"{method.upper()} {path}"] = content["application/json"]["schema"]
    return bodies


def query_fields(schema: dict) -> set[tuple[str, str]]:
    """('METHOD /path', name) of every query parameter (path parameters are names a route looks up)."""
    return {
        (f"{method.upper()} {path}", parameter["name"])
        for path, operations in schema["paths"].items()
        for method, operation in operations.items()
        for parameter in operation.get("parameters", [])
        if parameter["in"] == "query"
    }


def body_fields(schema: dict) -> set[tuple[str, str]]:
    """(model, property) of every field reachable from a route's body."""
    components, fields, seen = schema["components"]["schemas"], set(), set()
    pending = list(request_bodies(schema).values())
    while pending:
        node = pending.pop()
        if (ref := _ref(node)) is not None:
            if ref in seen:
                continue
            seen.add(ref)
        for segment, model, sub in _children(components, node):
            if model is not None:
                fields.add((model, segment))
            pending.append(sub)
    return fields


# -- what the cases cover -----------------------------------------------------------------------------


def _segments(param: str) -> list[str | int]:
    """A param's path: messages[0].content -> ["messages", 0, "content"]."""
    return [int(i) if i else name for i, name in re.findall(r"\[(\d+)\]|([^.\[\]]+)", param)]


def _tags(model: dict) -> dict:
    """A model's tags: its properties of one allowed value ({"type": "text"}), which pick it in a union."""
    tags = {}
    for prop, sub in model.get("properties", {}).items():
        allowed = [sub["const"]] if "const" in sub else sub.get("enum", [])
        if len(allowed) == 1:
            tags[prop] = allowed[0]
    return tags


def _fitting(models: list[tuple[str, dict]], value) -> list[tuple[str, dict]]:
    """The union members `value` was meant to be: those its tags pick, else those no tag of it rules
    out and whose required keys it has, else those no tag rules out, else all (a hostile value may
    break what would pick one)."""
    value = value if isinstance(value, dict) else {}

    def agrees(model: dict) -> bool:
        return all(value.get(prop, tag) == tag for prop, tag in _tags(model).items())

    picked = [(n, m) for n, m in models if _tags(m) and all(value.get(p) == t for p, t in _tags(m).items())]
    possible = [(n, m) for n, m in models if agrees(m)]
    complete = [(n, m) for n, m in possible if all(key in value for key in m.get("required", []))]
    return picked or complete or possible or models


def covered_by(components: dict, body_schema: dict, body: dict, param: str) -> set[tuple[str, str]]:
    """The (model, property) fields a 4xx naming `param` for `body` covers: every field on the param's
    path, through the union members the body's values may be (all of them where none fits)."""
    covered, nodes = set(), [(body_schema, body)]
    for segment in _segments(param):
        reached = []
        for node, value in nodes:
            members = list(_members(components, node))
            models = [(name, m) for name, m in members if "properties" in m]
            for name, member in [(name, m) for name, m in members if "properties" not in m] + _fitting(
                models, value
            ):
                if isinstance(segment, int) and isinstance(member.get("items"), dict):
                    item = value[segment] if isinstance(value, list) and segment < len(value) else None
                    reached.append((member["items"], item))
                elif isinstance(segment, str) and segment in member.get("properties", {}):
                    covered.add((name, segment))
                    # A union's tag is one field of all its members: breaking it reaches every member.
                    if any(segment in _tags(m) for _, m in models):
                        covered |= {(n, segment) for n, m in models if segment in m.get("properties", {})}
                    reached.append((member["properties"][segment], _get(value, segment)))
                elif isinstance(segment, str) and isinstance(member.get("additionalProperties"), dict):
                    reached.append((member["additionalProperties"], _get(value, segment)))
        nodes = reached
    return covered


def _get(value, key: str):
    return value.get(key) if isinstance(value, dict) else None


def _over(base: dict, fields: dict) -> dict:
    """`base` with `fields` over it (DROP: leave the field out)."""
    return {k: v for k, v in {**base, **fields}.items() if v != DROP}


def hostile_cases():
    """(route path, body, param) of every hostile case of the suite's tables that names a field."""
    for endpoint, kinds in hostile.FIELD_TYPES.items():
        path, base = BODIES[endpoint]
        for kind, fields in kinds.items():
            for field in fields:
                yield path, {**base, field: hostile.WRONG_TYPES[kind][0]}, field
    for endpoint, fields, param in [*hostile.STRUCTURE_CASES, *hostile.INVALID_SPEC_CASES]:
        yield BODIES[endpoint][0], _over(BODIES[endpoint][1], fields), param
    for endpoint, field, value in hostile.RANGE_CASES:
        yield BODIES[endpoint][0], _over(BODIES[endpoint][1], {field: value}), field
    for endpoint, fields, param in hostile.TEXT_FIELDS:
        yield BODIES[endpoint][0], _over(BODIES[endpoint][1], fields), param
    for fields, param in hostile.TOOL_CASES:
        yield BODIES["chat"][0], _over(BODIES["chat"][1], fields), param
    for fields, param, _ in hostile.RESPONSES_CASES:
        yield BODIES["responses"][0], _over(BODIES["responses"][1], fields), param
    for kind, fields in hostile.ANTHROPIC_FIELD_TYPES.items():
        for field in fields:
            yield MESSAGES, {**ANTHROPIC_BODY, field: hostile.WRONG_TYPES[kind][0]}, field
    for case in hostile.ANTHROPIC_BAD_CASES:
        path, fields, field = case.values
        yield path, _over(ANTHROPIC_BODY, fields), field
    for fields, field in hostile.ANTHROPIC_TEXT_FIELDS:
        yield MESSAGES, {**ANTHROPIC_BODY, **fields}, field
    for path, body, param, _ in [*test_pooling_server.BAD_MESSAGES, *test_pooling_server.BAD_INPUT]:
        yield path, body, param
    for path in ("/v1/embeddings", "/pooling"):
        for field, values in test_pooling_server.CHAT_FIELD_TYPES.items():
            yield path, {"messages": test_pooling_server.CHAT, field: values[0]}, field
    for body, param in test_admin_api.UPDATE_WEIGHTS_BAD:
        yield "/update_weights_from_disk", body, param
    for path, fields, param in CASES:
        yield path, _over(BASES[path], fields), param
    for fields, field in ANTHROPIC_CASES:
        yield MESSAGES, _over(ANTHROPIC_BODY, fields), field


def covered(schema: dict) -> set[tuple[str, str]]:
    components, bodies = schema["components"]["schemas"], request_bodies(schema)
    fields = set()
    for path, body, param in hostile_cases():
        fields |= covered_by(components, bodies[f"POST {path}"], body, param)
    queries = [
        *QUERY_CASES,
        *[("POST /sleep", {"level": level}, "level") for level in test_admin_api.SLEEP_LEVELS_BAD],
        *[("POST /sleep", {"mode": mode}, "mode") for mode in test_admin_api.SLEEP_MODES_BAD],
        *[
            ("POST /reset_prefix_cache", {"reset_running_requests": value}, "reset_running_requests")
            for value in test_admin_api.RESET_RUNNING_REQUESTS_BAD
        ],
    ]
    return fields | {(route, param) for route, _, param in queries}


# -- the cases the other tables leave out (sent to the session's server) -------------------------------

BASES = {  # a valid body per route (the pooling routes': valid, refused only once their fields are)
    **{path: body for path, body in BODIES.values() if path != "/tokenize"},
    "/v1/embeddings": {"input": "Hi"},
    "/pooling": {"input": "Hi"},
    "/classify": {"input": "Hi"},
    "/score": {"text_1": "a", "text_2": "b"},
    "/rerank": {"query": "a", "documents": ["b"]},
}
# The pooling routes' fields of the wrong JSON type (or outside their values): refused before the route
# finds this server's model generates (test_pooling_server.py sends the rest to a pooling server).
POOLING_FIELD_TYPES = {
    "/classify": {
        "input": 5, "messages": "Hi", "add_generation_prompt": "yes", "add_special_tokens": "yes",
        "chat_template": 5, "chat_template_kwargs": "x", "continue_final_message": "yes", "priority": "1",
        "truncate_prompt_tokens": "2", "use_activation": "yes", "user": 5, "cache_salt": 5,
    },
    "/v1/embeddings": {"model": 5, "normalize": "yes", "priority": "1", "user": 5},
    "/pooling": {
        "activation": "yes", "encoding_format": 5, "model": 5, "normalize": "yes", "priority": "1", "user": 5,
        "truncation_side": "middle",
    },
    "/rerank": {
        "query": 5, "documents": 5, "add_special_tokens": "yes", "model": 5, "priority": "1",
        "return_documents": "yes", "top_n": "1", "user": 5, "truncation_side": 5,
    },
    "/score": {
        "text_2": 5, "add_special_tokens": "yes", "model": 5, "priority": "1", "use_activation": "yes",
        "user": 5, "data_1": 5, "truncation_side": "middle",
    },
}  # fmt: skip
_ITEMS = {  # a valid Responses input item of each type
    "function_call": hostile._CALL_ITEM,
    "function_call_output": {"type": "function_call_output", "call_id": "call_1", "output": "x"},
    "mcp_call": hostile._MCP_CALL,
    "mcp_approval_request": {**hostile._MCP_CALL, "type": "mcp_approval_request", "id": "mcpr_1"},
    "mcp_approval_response": {
        "type": "mcp_approval_response",
        "approval_request_id": "mcpr_1",
        "approve": True,
    },
    "mcp_list_tools": {"type": "mcp_list_tools", "server_label": "s", "tools": []},
    "reasoning": {"type": "reasoning", "summary": []},
    "message": {"type": "message", "role": "user", "content": "Hi"},
}
_ITEM_FIELDS = {  # item type -> its fields of the wrong type (or out of its values)
    "function_call": {"id": 5, "status": "done", "caller": {"type": "direct", "caller_id": 5}},
    "mcp_call": {
        "approval_request_id": 5, "arguments": 5, "error": 5, "output": 5, "server_label": 5,
        "status": "done",
    },
    "mcp_approval_request": {"id": 5, "name": 5, "server_label": 5},
    "mcp_approval_response": {"id": 5, "reason": 5},
    "mcp_list_tools": {"error": 5, "id": 5, "server_label": 5},
    "reasoning": {"encrypted_content": 5, "id": 5, "status": "done"},
    "message": {"id": 5, "status": "done"},
}  # fmt: skip
_OUTPUT = {
    "caller": "me",
    "id": 5,
    "name": 5,
    "namespace": 5,
    "status": "done",
}  # of a function call's output
_PART = {"type": "output_text", "text": "x"}
_SUMMARY = {"type": "summary_text", "text": "x"}
_MCP_TOOL = {**hostile._MCP_TOOL, "require_approval": {"always": {"read_only": True}}}


def _image(image_url) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": image_url}]}]


def _calls(**call) -> list[dict]:
    return [*CHAT, {**hostile.ASKED, "tool_calls": [{**hostile.CALL, **call}]}]


CASES = [  # (route path, fields over its base body, the param named)
    *[(path, {field: value}, field)
      for path, fields in POOLING_FIELD_TYPES.items() for field, value in fields.items()],
    *[("/v1/responses", {"input": [{**_ITEMS[kind], field: value}]}, f"input[0].{field}")
      for kind, fields in _ITEM_FIELDS.items() for field, value in fields.items() if field != "caller"],
    ("/v1/responses", {"input": [{**hostile._CALL_ITEM, "caller": {"type": "direct", "caller_id": 5}}]},
     "input[0].caller.caller_id"),
    *[("/v1/responses", {"input": [hostile._CALL_ITEM, {**_ITEMS["function_call_output"], field: value}]},
       f"input[1].{field}") for field, value in _OUTPUT.items()],
    *[("/v1/responses", {"input": [{"role": "assistant", "content": [{**_PART, field: 5}]}]},
       f"input[0].content[0].{field}") for field in ("text", "annotations", "logprobs")],
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": 5}]}]},
     "input[0].content[0].file_id"),
    ("/v1/responses", {"input": [{**_ITEMS["reasoning"], "summary": [{**_SUMMARY, "text": 5}]}]},
     "input[0].summary[0].text"),
    ("/v1/responses",
     {"input": [{**_ITEMS["reasoning"], "summary": [{**_SUMMARY, "type": "reasoning_text"}]}]},
     "input[0].summary[0].type"),
    *[("/v1/responses", {"tools": [{**hostile.RESPONSES_TOOL, field: value}]}, f"tools[0].{field}")
      for field, value in (("description", 5), ("strict", "yes"))],
    *[("/v1/responses", {"tools": [{**_MCP_TOOL, field: 5}]}, f"tools[0].{field}")
      for field in ("allowed_tools", "server_description", "server_label")],
    ("/v1/responses", {"tools": [{**_MCP_TOOL, "require_approval": {"never": "x"}}]},
     "tools[0].require_approval.never"),
    ("/v1/responses", {"tools": [{**_MCP_TOOL, "require_approval": {"always": {"read_only": "yes"}}}]},
     "tools[0].require_approval.always.read_only"),
    ("/v1/responses",
     {"tools": [hostile.RESPONSES_TOOL], "tool_choice": {"type": "x", "name": "get_weather"}},
     "tool_choice.type"),
    ("/v1/responses", {"reasoning": {"summary": 5}}, "reasoning.summary"),
    ("/v1/responses", {"reasoning": {"generate_summary": "long"}}, "reasoning.generate_summary"),
    *[("/v1/responses", {"text": {"format": {**hostile._FORMAT, field: value}}}, f"text.format.{field}")
      for field, value in (("description", 5), ("strict", "yes"))],
    ("/v1/responses", {"stream": True, "stream_options": {"include_obfuscation": "yes"}},
     "stream_options.include_obfuscation"),
    *[("/v1/chat/completions", {"messages": _calls(**call)}, f"messages[1].tool_calls[0].{param}")
      for call, param in (({"id": 5}, "id"), ({"type": "x"}, "type"),
                          ({"function": {"name": 5, "arguments": "{}"}}, "function.name"))],
    *[("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", field: value}}]},
       f"tools[0].function.{field}") for field, value in (("description", 5), ("strict", "yes"))],
    ("/v1/chat/completions",
     {"tools": [hostile.TOOL], "tool_choice": {"type": "x", "function": {"name": "f"}}},
     "tool_choice.type"),
    ("/v1/chat/completions", {"messages": _image({"url": 5})}, "messages[0].content[0].image_url.url"),
    ("/v1/chat/completions", {"messages": _image({"url": "x", "detail": "ultra"})},
     "messages[0].content[0].image_url.detail"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "description": 5}}},
     "response_format.json_schema.description"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", {"kv_transfer_params": {"do_remote_prefill": "yes"}},
     "kv_transfer_params.do_remote_prefill"),
    ("/v1/completions", {"structured_outputs": {"json_object": True, "whitespace_pattern": 5}},
     "structured_outputs.whitespace_pattern"),
    ("/v1/completions", {"structured_outputs": {"json": {}, "disable_additional_properties": "yes"}},
     "structured_outputs.disable_additional_properties"),
]  # fmt: skip

_TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
_RESULT = {"type": "tool_result", "tool_use_id": "toolu_1"}
_MCP_USE = {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "x", "server_name": "tides", "input": {}}
_IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
_WEATHER = {"name": "get_weather", "input_schema": {"type": "object"}}


def _user(*blocks) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


def _assistant(*blocks) -> list[dict]:
    return [*CHAT, {"role": "assistant", "content": list(blocks)}]


ANTHROPIC_CASES = [  # (fields over ANTHROPIC_BODY, the field its message names)
    *[({"messages": _user({**_IMAGE, "source": {**_IMAGE["source"], field: value}})},
       f"messages[0].content[0].source.{field}")
      for field, value in (("data", 5), ("media_type", "image/tiff"))],
    ({"messages": _user({**_IMAGE, "source": {"type": "file", "file_id": "f"}})},
     "messages[0].content[0].source.type"),
    ({"messages": _user({**_IMAGE, "source": {"type": "url", "url": 5}})},
     "messages[0].content[0].source.url"),
    *[({"messages": _user({**block, field: 5})}, f"messages[0].content[0].{field}")
      for block, field in ((_IMAGE, "cache_control"), ({"type": "text", "text": "Hi"}, "cache_control"),
                           ({"type": "text", "text": "Hi"}, "citations"))],
    *[({"messages": [*_assistant(_TOOL_USE), *_user({**_RESULT, field: 5})]},
       f"messages[2].content[0].{field}") for field in ("cache_control", "is_error")],
    *[({"messages": _assistant({**_TOOL_USE, field: 5})}, f"messages[1].content[0].{field}")
      for field in ("cache_control", "name")],
    *[({"messages": _assistant({**_MCP_USE, field: 5})}, f"messages[1].content[0].{field}")
      for field in ("cache_control", "id", "input", "name")],
    *[({"messages": _assistant(_MCP_USE, {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", field: 5})},
       f"messages[1].content[1].{field}") for field in ("cache_control", "content", "is_error")],
    ({"messages": _assistant({"type": "redacted_thinking", "data": 5})}, "messages[1].content[0].data"),
    *[({"messages": _assistant({"type": "thinking", "thinking": "x", field: 5})},
       f"messages[1].content[0].{field}")
      for field in ("signature", "thinking")],
    ({"tools": [{**_WEATHER, "cache_control": 5}]}, "tools[0].cache_control"),
    ({"tools": [{**_WEATHER, "type": "bash_20250124"}]}, "tools[0].type"),
    *[({"tools": [_WEATHER], "tool_choice": {**choice, "disable_parallel_tool_use": "yes"}},
       "tool_choice.disable_parallel_tool_use")
      for choice in ({"type": "auto"}, {"type": "tool", "name": "x"})],
    ({"thinking": {"type": "enabled", "budget_tokens": "1024"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
]  # fmt: skip

QUERY_CASES = [  # (route, query, the param named)
    ("GET /v1/responses/{response_id}", {"stream": "maybe"}, "stream"),
    ("GET /v1/responses/{response_id}", {"starting_after": "x"}, "starting_after"),
]

# (model, property) -> why no value can make it invalid. None today: the request models are strict (a
# wrong JSON type is a 400 for every field, accepted-and-ignored ones too: `citations`, `annotations`),
# and free-form values sit below a typed field (`metadata`'s values, `chat_template_kwargs`' keys are
# checked; a tool's `parameters` is a JSON schema, compiled). A field that takes anything goes here.
UNBREAKABLE: dict[tuple[str, str], str] = {}


def test_every_request_field_has_a_hostile_case(schema):
    """The rule the suite keeps: a new request field (of any route's body, at any depth, or a query)
    joins the hostile cases. Read from the app's own schema, a field added without one fails here."""
    fields = body_fields(schema) | query_fields(schema)
    # The walk reaches what users send inside lists and unions, and the queries.
    deep = {
        ("ImageURL", "url"),
        ("ToolCallParam", "id"),
        ("McpToolFilter", "read_only"),
        ("POST /sleep", "level"),
    }
    assert deep <= fields, deep - fields
    missing = sorted(fields - covered(schema) - set(UNBREAKABLE))
    assert not missing, f"{len(missing)} request fields without a hostile case: {missing}"
    assert not set(UNBREAKABLE) - fields, "an exempt field the schema no longer has"


def test_a_param_covers_the_fields_on_its_path_in_the_member_its_body_picks(schema):
    components, bodies = schema["components"]["schemas"], request_bodies(schema)

    def fields(path: str, body: dict, param: str) -> set[tuple[str, str]]:
        return covered_by(components, bodies[f"POST {path}"], body, param)

    image = {"messages": _image({"url": 5})}
    assert fields("/v1/chat/completions", image, "messages[0].content[0].image_url.url") == {
        ("ChatCompletionRequest", "messages"),
        ("ChatMessage", "content"),
        ("ImageURLContentPart", "image_url"),
        ("ImageURL", "url"),
    }
    # the body's tags pick the member: a json_schema format's name, not another format's
    json_format = {"text": {"format": {"type": "json_schema", "schema": {}}}}
    json_schema_format = "xlaserve__entrypoints__openai__responses_protocol__JsonSchemaFormat"
    assert fields("/v1/responses", json_format, "text.format.name") == {
        ("ResponsesRequest", "text"),
        ("TextConfig", "format"),
        (json_schema_format, "name"),
    }
    # without tags, the keys it has: a prompt's add_special_tokens, not a chat's
    tokenize = {"prompt": "Hi", "add_special_tokens": "yes"}
    assert fields("/tokenize", tokenize, "add_special_tokens") == {
        ("TokenizeCompletionRequest", "add_special_tokens")
    }
    # an unknown tag: the union's tag, in each member
    assert ("TextBlockParam", "type") in fields(
        MESSAGES, {"messages": _user({"type": "x"})}, "messages[0].content[0].type"
    )
    # a field the schema does not have covers nothing beyond its parent
    assert fields("/v1/completions", {"stream_options": {"x": 1}}, "stream_options.x") == {
        ("CompletionRequest", "stream_options")
    }


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        yield client


@pytest.mark.parametrize("path, fields, param", CASES, ids=[f"{p}-{json.dumps(f)[:60]}" for p, f, _ in CASES])
def test_bad_field_is_400_naming_it(client, path, fields, param):
    response, port = send(client, path, _over(BASES[path], fields))
    error = check_error(response, 400)
    assert error["param"] == param, error
    check_still_serving(client, port)


def names_exactly(message: str, field: str) -> bool:
    """Whether an Anthropic error's message names `field` itself (not a field beside or below it)."""
    return re.search(rf"(?<![\w.\[\]]){re.escape(field)}(?![\w.\[])", message) is not None


@pytest.mark.parametrize("fields, field", ANTHROPIC_CASES, ids=[f for _, f in ANTHROPIC_CASES])
def test_anthropic_bad_field_is_400_naming_it(client, fields, field):
    response, port = send(client, MESSAGES, _over(ANTHROPIC_BODY, fields))
    error = hostile.check_anthropic_error(response, 400)
    assert names_exactly(error["message"], field), error
    check_still_serving(client, port)


@pytest.mark.parametrize("route, query, param", QUERY_CASES, ids=[p for _, _, p in QUERY_CASES])
def test_bad_query_is_400_naming_it(client, route, query, param):
    response = client.request(*route.split(), params=query)
    assert check_error(response, 400)["param"] == param

"""Hostile input against the real server, endpoint by endpoint and field by field: wrong JSON types,
numbers out of range, invalid Unicode (lone surrogates escaped in JSON, raw bytes that are not UTF-8),
NUL bytes, malformed bodies, bodies over the limit (declared or chunked) and malformed HTTP.

Every answer is a 4xx in OpenAI's error shape, `param` naming the field as the client sent it, and
the keep-alive connection it came on serves the next request. Two kinds of request cannot keep their
connection: a body refused unread (413), and HTTP whose framing is broken (h11's 400 and 431). Those
are answered in the same JSON, the connection closes cleanly, and the server keeps serving.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest

from helpers.server_harness import MODEL_NAME
from xlaserve.entrypoints.serving.guard import MAX_BODY_BYTES, MAX_HEADER_BYTES

# What a client-facing message must never show: exception or class names, tracebacks, pids, paths.
INTERNALS = re.compile(r"Traceback|\w+(Request|Error|Exception)\b|\bpid\b|/work/|\.py\b")

CHAT = [{"role": "user", "content": "Hi"}]
DROP = "<drop>"  # in a case's fields: leave this field of the valid body out
BODIES = {  # a valid, cheap body per endpoint, to break one field at a time
    "completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    "chat": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    "tokenize": ("/tokenize", {"prompt": "Hi"}),
    "tokenize-chat": ("/tokenize", {"messages": CHAT}),
    "detokenize": ("/detokenize", {"tokens": [1, 2]}),
    # LoRA is off on this server: a valid body is a 400 too, but only once every field is valid.
    "load-lora": ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "adapter"}),
    "unload-lora": ("/v1/unload_lora_adapter", {"lora_name": "x"}),
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 1, "store": False}),
}


# -- helpers -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server):
    """One client, so one keep-alive connection, for the whole module."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        yield client


def local_port(response: httpx.Response) -> int | None:
    """The client's port of the connection a response came on (None once it is closed)."""
    try:
        return response.extensions["network_stream"].get_extra_info("client_addr")[1]
    except OSError:
        return None


def send(client: httpx.Client, path: str, body=None, *, content=None, headers=None, method="POST"):
    """(response, the port of its connection), read before anything can close it."""
    response = client.request(
        method, path, json=body if content is None else None, content=content, headers=headers
    )
    return response, local_port(response)


def names(param: str | None, field: str) -> bool:
    return param is not None and (param == field or param.startswith((field + "[", field + ".")))


def check_error(response: httpx.Response, status: int, field: str | None = None) -> dict:
    """A 4xx of `status` in OpenAI's error shape, its `param` naming `field` (when one is given)."""
    assert 400 <= status < 500
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" or status in (401, 404)
    assert len(error["message"]) <= 500 and not INTERNALS.search(error["message"]), error["message"]
    if field is not None:
        assert names(error["param"], field), error
    return error


def check_still_serving(client: httpx.Client, port: int | None) -> None:
    """The keep-alive connection on `port` answers a normal request."""
    assert port is not None, "the server closed the connection"
    response, next_port = send(client, "/tokenize", {"prompt": "still here"})
    assert response.status_code == 200 and response.json()["count"] > 0
    assert next_port == port, "the server closed the keep-alive connection"


def body_with(body: dict, raw: bytes) -> bytes:
    """The JSON of `body` with its "@" placeholder replaced by raw bytes (escapes, invalid UTF-8)."""
    return json.dumps(body).encode().replace(b"@", raw)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def raw_exchange(
    server, head: bytes, body: bytes = b"", timeout: float = 30
) -> tuple[int, dict, bytes, bool]:
    """Send raw bytes on a fresh connection; (status, headers, body, whether it was then closed)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        try:
            sock.sendall(head + body)
        except OSError:  # the server may answer and close before reading it all
            pass
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"closed without an answer after {data!r}"
            data += chunk
        head_bytes, rest = data.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
        while len(rest) < int(headers["content-length"]):
            chunk = sock.recv(65536)
            assert chunk, "closed in the middle of the answer"
            rest += chunk
        try:
            is_closed = sock.recv(1) == b""
        except ConnectionResetError:  # closed with the client's bytes unread: a reset, still closed
            is_closed = True
        except TimeoutError:
            is_closed = False
        return int(status_line.split()[1]), headers, rest, is_closed


def check_raw_error(server, client, head: bytes, body: bytes, status: int) -> dict:
    """A malformed request answered in OpenAI's JSON; the connection closed; the server serving."""
    code, headers, payload, is_closed = raw_exchange(server, head, body, timeout=10)
    assert code == status, payload[:500]
    assert headers["content-type"] == "application/json" and headers.get("connection") == "close"
    assert is_closed, "the connection stayed open after malformed HTTP"
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"} and not INTERNALS.search(error["message"])
    response = client.post("/tokenize", json={"prompt": "still here"})
    assert response.status_code == 200
    return error


# -- wrong JSON types, field by field ----------------------------------------------------------------

# OpenAI's API is strict: no strings for numbers, no bools for integers, no 0/1 for booleans; numbers
# (temperature, ...) do take integers, tested below.
WRONG_TYPES = {
    "integer": ["16", True, 1.5, [16], {"value": 16}],
    "number": ["0.5", True, [0.5], {"value": 0.5}],
    "boolean": ["yes", 1, [True], {"value": True}],
    "string": [5, True, ["x"], {"name": "x"}],
    "object": ["x", 5, True, [{}]],
}
_SAMPLING = {
    "integer": ["n", "seed", "top_k", "min_tokens", "priority", "prompt_logprobs", "truncate_prompt_tokens"],
    "number": [
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "repetition_penalty",
        "length_penalty",
    ],
    "boolean": [
        "stream",
        "echo",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "use_beam_search",
        "return_token_ids",
        "return_tokens_as_token_ids",
    ],
    "string": ["model", "user", "cache_salt", "request_id"],
    "object": ["response_format", "structured_outputs", "kv_transfer_params", "logit_bias"],
}
FIELD_TYPES = {
    "completions": {
        **_SAMPLING,
        "integer": [*_SAMPLING["integer"], "max_tokens", "logprobs"],
        "boolean": [*_SAMPLING["boolean"], "add_special_tokens"],
    },
    "chat": {
        **_SAMPLING,
        "integer": [*_SAMPLING["integer"], "max_tokens", "max_completion_tokens", "top_logprobs"],
        "boolean": [
            *_SAMPLING["boolean"],
            "logprobs",
            "add_generation_prompt",
            "continue_final_message",
            "parallel_tool_calls",
            "include_reasoning",
            "store",
        ],
        "string": [
            *_SAMPLING["string"],
            "chat_template",
            "reasoning_effort",
            "verbosity",
            "prompt_cache_key",
            "safety_identifier",
            "service_tier",
        ],
        "object": [*_SAMPLING["object"], "chat_template_kwargs", "metadata", "mm_processor_kwargs"],
    },
    "tokenize": {"boolean": ["add_special_tokens", "return_token_strs"], "string": ["model"]},
    "tokenize-chat": {
        "boolean": [
            "add_special_tokens",
            "add_generation_prompt",
            "continue_final_message",
            "return_token_strs",
        ],
        "string": ["model", "chat_template"],
        "object": ["chat_template_kwargs"],
    },
    "detokenize": {"string": ["model"]},
    "load-lora": {"string": ["lora_name", "lora_path"]},
    "unload-lora": {"string": ["lora_name"], "integer": ["lora_int_id"]},
    "responses": {
        "integer": ["max_output_tokens", "seed", "top_k", "min_tokens", "priority", "max_tool_calls"],
        "number": [
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "min_p",
            "repetition_penalty",
        ],
        "boolean": ["stream", "store", "parallel_tool_calls", "ignore_eos", "include_reasoning"],
        "string": [
            "model",
            "instructions",
            "previous_response_id",
            "user",
            "cache_salt",
            "prompt_cache_key",
            "safety_identifier",
            "request_id",
            "service_tier",
            "truncation",
        ],
        "object": [
            "text",
            "reasoning",
            "metadata",
            "stream_options",
            "kv_transfer_params",
            "chat_template_kwargs",
        ],
    },
}
TYPE_CASES = [
    pytest.param(endpoint, field, value, id=f"{endpoint}-{field}-{json.dumps(value)}")
    for endpoint, kinds in FIELD_TYPES.items()
    for kind, fields in kinds.items()
    for field in fields
    for value in WRONG_TYPES[kind]
]


@pytest.mark.parametrize("endpoint, field, value", TYPE_CASES)
def test_wrong_type_is_400_naming_the_field(client, endpoint, field, value):
    path, body = BODIES[endpoint]
    response, port = send(client, path, {**body, field: value})
    error = check_error(response, 400, field)
    assert error["param"] == field
    check_still_serving(client, port)


# The structured fields: what goes wrong inside lists and objects is named down to the element.
STRUCTURE_CASES = [
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"stream": True, "prompt_logprobs": 0}, "prompt_logprobs"),
    ("chat", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"use_beam_search": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("completions", {"use_beam_search": True, "stream": True}, "stream"),
    ("chat", {"use_beam_search": True, "n": 11}, "n"),
    ("chat", {"n": 2, "temperature": 0}, "n"),  # vLLM's: greedy children would be one sequence
    ("completions", {"n": 2, "temperature": 0.0}, "n"),
    ("completions", {"prompt": {"text": "Hi"}}, "prompt"),
    ("completions", {"prompt": [True]}, "prompt"),
    ("completions", {"prompt": [1.5]}, "prompt"),
    ("completions", {"prompt": ["Hi", 5]}, "prompt"),
    ("completions", {"prompt": [[1, "a"]]}, "prompt"),
    ("completions", {"prompt": [[[1]]]}, "prompt"),
    ("completions", {"stop": 5}, "stop"),
    ("completions", {"stop": [5]}, "stop"),
    ("completions", {"stop": [["x"]]}, "stop"),
    ("completions", {"stop": {"s": "x"}}, "stop"),
    ("completions", {"stop_token_ids": 5}, "stop_token_ids"),
    ("completions", {"stop_token_ids": ["1"]}, "stop_token_ids[0]"),
    ("completions", {"stop_token_ids": [True]}, "stop_token_ids[0]"),
    ("completions", {"stream_options": "yes"}, "stream_options"),
    ("completions", {"stream_options": []}, "stream_options"),
    ("completions", {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("completions", {"stream_options": {"other": True}}, "stream_options.other"),
    ("chat", {"stop_token_ids": 5}, "stop_token_ids"),
    ("chat", {"stop_token_ids": ["1"]}, "stop_token_ids[0]"),
    ("chat", {"stream_options": "yes"}, "stream_options"),
    ("chat", {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("completions", {"request_id": ""}, "request_id"),
    ("chat", {"request_id": "x" * 129}, "request_id"),
    ("chat", {"request_id": "a b\n"}, "request_id"),
    ("tokenize-chat", {"tools": "get_weather"}, "tools"),
    ("tokenize-chat", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("chat", {"messages": "Hi"}, "messages"),
    ("chat", {"messages": {"role": "user"}}, "messages"),
    ("chat", {"messages": ["Hi"]}, "messages[0]"),
    ("chat", {"messages": [{"content": "Hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": 5, "content": "Hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": {"text": "Hi"}}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].image_url"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    # vLLM's parts this server has no model for (audio, precomputed embeddings): the part's type is named.
    ("chat", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].type"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": "AA"}]}]},
     "messages[0].content[0].type"),
    ("chat", {"messages": [{"role": "user", "content": [{"image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"},
                                                          "uuid": 5}]}]}, "messages[0].content[0].uuid"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"},
                                                          "uuid": "u" * 257}]}]},
     "messages[0].content[0].uuid"),
    ("chat", {"messages": [{"role": "user", "content": "Hi", "name": 5}]}, "messages[0].name"),
    ("chat", {"messages": [{"role": "user", "content": "Hi", "tool": "x"}]}, "messages[0].tool"),
    ("chat", {"messages": [*CHAT, {"role": "user", "content": 5}]}, "messages[1].content"),
    ("tokenize", {"prompt": 5}, "prompt"),
    ("tokenize", {"prompt": ["Hi"]}, "prompt"),
    ("tokenize", {"prompt": DROP, "model": MODEL_NAME}, "prompt"),  # neither prompt nor messages
    ("tokenize", {"prompt": "Hi", "messages": CHAT}, "prompt"),  # both: a chat with a stray field
    ("tokenize-chat", {"messages": "Hi"}, "messages"),
    ("tokenize-chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("detokenize", {"tokens": "1,2"}, "tokens"),
    ("detokenize", {"tokens": ["1"]}, "tokens[0]"),
    ("detokenize", {"tokens": [1, True]}, "tokens[1]"),
    ("detokenize", {"tokens": [1.0]}, "tokens[0]"),
    ("detokenize", {"tokens": [[1]]}, "tokens[0]"),
    ("detokenize", {"tokens": None}, "tokens"),
    # Structured outputs: OpenAI's response_format and vLLM's structured_outputs, member by member.
    ("chat", {"response_format": {"type": 5}}, "response_format.type"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": "s"}}, "response_format.json_schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format.json_schema.name"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [{}]}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ("completions", {"response_format": {"type": "json_object", "json_schema": 5}},
     "response_format.json_schema"),
    ("completions", {"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"json": ["x"]}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ("completions", {"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice[1]"),
    ("completions", {"structured_outputs": {"grammar": ["start"]}}, "structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ("completions", {"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag"),
    ("completions", {"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}},
     "structured_outputs.disable_any_whitespace"),
    ("completions", {"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ("chat", {"structured_outputs": {"choice": None, "json": None}}, "structured_outputs"),
    # Disaggregated prefill's params (this server is neither producer nor consumer): member by member,
    # then what only a producer or a consumer may be asked.
    ("completions", {"kv_transfer_params": {"do_remote_decode": "yes"}},
     "kv_transfer_params.do_remote_decode"),
    ("completions", {"kv_transfer_params": {"remote_port": "1"}}, "kv_transfer_params.remote_port"),
    ("completions", {"kv_transfer_params": {"remote_port": 0}}, "kv_transfer_params.remote_port"),
    ("completions", {"kv_transfer_params": {"remote_host": ""}}, "kv_transfer_params.remote_host"),
    ("completions", {"kv_transfer_params": {"remote_request_id": "r" * 257}},
     "kv_transfer_params.remote_request_id"),
    ("completions", {"kv_transfer_params": {"remote_engine": "x"}}, "kv_transfer_params.remote_engine"),
    ("completions", {"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ("chat", {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ("completions", {"kv_transfer_params": {"do_remote_decode": True}, "n": 2}, "kv_transfer_params"),
    ("completions", {"kv_transfer_params": {"do_remote_decode": True}, "prompt": ["a", "b"]},
     "kv_transfer_params"),
    # Fields valid alone, not together (vLLM's rules): stream_options without a stream; a cut that keeps
    # more of a long prompt than the context leaves it beside max_tokens (512 - 1), not the prompt's fault.
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"stream": False, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("completions", {"prompt": [5] * 600, "truncate_prompt_tokens": 512}, "truncate_prompt_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "Hi " * 600}], "truncate_prompt_tokens": 600},
     "truncate_prompt_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(
    "endpoint, fields, param",
    STRUCTURE_CASES,
    ids=[f"{e}-{json.dumps(f)[:60]}" for e, f, _ in STRUCTURE_CASES],
)
def test_wrong_structure_is_400_naming_the_element(client, endpoint, fields, param):
    path, body = BODIES[endpoint]
    body = {k: v for k, v in {**body, **fields}.items() if v != DROP}
    response, port = send(client, path, body)
    error = check_error(response, 400)
    assert error["param"] == param, error
    check_still_serving(client, port)


# -- numbers out of range ----------------------------------------------------------------------------

RANGE_CASES = [
    ("completions", "n", 0),
    ("completions", "n", 65),
    ("completions", "max_tokens", 0),
    ("completions", "max_tokens", -1),
    ("completions", "max_tokens", 2**31),
    ("completions", "max_tokens", 10**30),
    ("completions", "logprobs", -1),  # vLLM's whole vocabulary: past the session engine's max_logprobs
    ("completions", "logprobs", -2),
    ("completions", "logprobs", 21),
    ("completions", "seed", 2**63),
    ("completions", "seed", -(2**63) - 1),
    ("completions", "top_k", -2),
    ("completions", "min_tokens", -1),
    ("completions", "priority", 2**31),
    ("completions", "temperature", -0.1),
    ("completions", "temperature", 2.5),
    ("completions", "top_p", 0),
    ("completions", "top_p", 1.01),
    ("completions", "presence_penalty", 2.5),
    ("completions", "frequency_penalty", -3),
    ("completions", "min_p", 1.5),
    ("completions", "repetition_penalty", 0),
    ("completions", "repetition_penalty", 11),
    ("completions", "stop", ["x"] * 17),
    ("completions", "stop", ["x" * 1025]),
    ("completions", "stop_token_ids", [-1]),
    ("completions", "stop_token_ids", [1] * 65),
    ("completions", "user", "u" * 257),
    ("completions", "cache_salt", ""),
    ("completions", "prompt", ["Hi"] * 65),
    ("completions", "prompt", []),
    ("completions", "prompt", [[]]),
    ("completions", "prompt", [-1]),
    ("completions", "prompt", [2**31]),
    ("completions", "length_penalty", 10.5),
    ("completions", "logit_bias", {"abc": 1}),
    ("completions", "logit_bias", {"-5": 1}),
    ("completions", "logit_bias", {"10000000": 1}),
    ("completions", "logit_bias", {str(i): 1 for i in range(1025)}),
    ("completions", "truncate_prompt_tokens", 0),
    ("completions", "truncate_prompt_tokens", -2),
    ("chat", "truncate_prompt_tokens", 0),
    ("completions", "prompt_logprobs", 21),
    ("completions", "prompt_logprobs", -1),
    ("completions", "prompt_logprobs", -2),
    ("chat", "prompt_logprobs", 2**31),
    ("completions", "bad_words", [""]),
    ("completions", "bad_words", ["w"] * 129),
    ("completions", "bad_words", ["w" * 257]),
    ("chat", "bad_words", "Paris"),
    ("completions", "allowed_token_ids", []),
    ("completions", "allowed_token_ids", [-1]),
    ("completions", "allowed_token_ids", [10**7]),
    ("chat", "logit_bias", {"x": 1}),
    ("chat", "allowed_token_ids", [2**31]),
    ("chat", "messages", []),
    ("chat", "n", 65),
    ("chat", "length_penalty", -11),
    ("chat", "max_completion_tokens", 0),
    ("chat", "top_logprobs", 21),
    ("chat", "top_logprobs", -2),
    ("chat", "temperature", 2.01),
    ("chat", "reasoning_effort", "maximal"),
    ("chat", "verbosity", "none"),
    ("chat", "prompt_cache_key", "k" * 257),
    ("chat", "safety_identifier", "s" * 257),
    ("chat", "service_tier", "fastest"),
    ("chat", "metadata", {f"k{i}": "v" for i in range(17)}),
    ("chat", "metadata", {"k": "v" * 513}),
    ("detokenize", "tokens", [-1]),
    ("detokenize", "tokens", [2**31]),
    ("detokenize", "tokens", [10**30]),
    ("detokenize", "tokens", [10**6]),  # within int32, past the vocabulary: the route's own check
    ("load-lora", "lora_name", ""),
    ("load-lora", "lora_name", "n" * 257),
    ("load-lora", "lora_path", ""),
    ("load-lora", "lora_path", "p" * 4097),
    ("load-lora", "lora_name", DROP),
    ("load-lora", "lora_path", DROP),
    ("unload-lora", "lora_name", ""),
    ("unload-lora", "lora_name", DROP),
]


@pytest.mark.parametrize(
    "endpoint, field, value", RANGE_CASES, ids=[f"{e}-{f}-{json.dumps(v)[:30]}" for e, f, v in RANGE_CASES]
)
def test_out_of_range_is_400_naming_the_field(client, endpoint, field, value):
    path, body = BODIES[endpoint]
    body = {k: v for k, v in {**body, field: value}.items() if v != DROP}
    response, port = send(client, path, body)
    check_error(response, 400, field)
    check_still_serving(client, port)


@pytest.mark.parametrize("endpoint", ["load-lora", "unload-lora"])
def test_lora_endpoints_without_lora_are_400(client, endpoint):
    """Valid bodies on a server started without --enable-lora: a 400 saying so."""
    path, body = BODIES[endpoint]
    response, port = send(client, path, body)
    error = check_error(response, 400, "lora_name")
    assert "--enable-lora" in error["message"]
    check_still_serving(client, port)


def _schema_format(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# Well-formed JSON, but a schema, regex or grammar llguidance rejects (or one past a limit): each is a
# 400 naming the field, never an unconstrained answer.
INVALID_SPEC_CASES = [
    ("chat", _schema_format({"type": "foo"}), "response_format.json_schema.schema"),
    ("chat", _schema_format({"not": {"type": "string"}}), "response_format.json_schema.schema"),
    ("chat", _schema_format({"type": "string", "pattern": "(a"}), "response_format.json_schema.schema"),
    ("chat", _schema_format({"$ref": "#/$defs/nowhere"}), "response_format.json_schema.schema"),
    ("chat", _schema_format({"type": "string", "format": "no-such"}), "response_format.json_schema.schema"),
    ("chat", _schema_format(_nested(100)), "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"json": "[]"}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"json": {"minProperties": 2, "properties": {"a": {}}}}},
     "structured_outputs.json"),
    ("completions", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"regex": "a" * (256 * 1024 + 1)}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"grammar": 'root ::= "a" | ('}}, "structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"grammar": "start: /[/"}}, "structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("completions", {"structured_outputs": {"choice": [""]}}, "structured_outputs.choice"),
    ("completions", {"structured_outputs": {"choice": ["a"] * 1025}}, "structured_outputs.choice"),
    ("completions", {"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ("completions", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ("completions", {"structured_outputs": {"structural_tag": "[1"}}, "structured_outputs.structural_tag"),
    ("completions", {"structured_outputs": {"json_object": True, "whitespace_pattern": "("}},
     "structured_outputs.json_object"),
    ("completions", {"structured_outputs": {}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
]  # fmt: skip


@pytest.mark.parametrize(
    "endpoint, fields, param",
    INVALID_SPEC_CASES,
    ids=[f"{e}-{json.dumps(f)[:70]}" for e, f, _ in INVALID_SPEC_CASES],
)
def test_invalid_structured_output_is_400_naming_the_field(client, endpoint, fields, param):
    path, body = BODIES[endpoint]
    response, port = send(client, path, {**body, **fields})
    error = check_error(response, 400)
    assert error["param"] == param, error
    check_still_serving(client, port)


# -- tools, tool_choice, tool messages, chat_template_kwargs -----------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
ASKED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
TOOL_CASES = [
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [TOOL] * 129}, "tools"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    # a schema that does not compile, where it must be enforced
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [TOOL, {"type": "function", "function": {"name": "g", "parameters": {"$ref": "#/nope"}}}],
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tools[1].function.parameters"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": 1}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [ASKED, {"role": "tool", "content": "20C", "tool_call_id": "call_9"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "tool", "content": "20C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "Hi", "tool_call_id": "call_1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "Hi", "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
    ({"messages": [{**ASKED, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{**ASKED, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{**ASKED, "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{**ASKED, "tool_calls": "call"}]}, "messages[0].tool_calls"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs.chat_template"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs.not a name"),
    # a text-only model has no processor to set (a vision-language one's: test_server_videos.py)
    ({"mm_processor_kwargs": {"max_pixels": 1024}}, "mm_processor_kwargs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": None, "uuid": ""}]}]},
     "messages[0].content[0].uuid"),
    # A request's own template: this server does not trust them (--trust-request-chat-template).
    ({"chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ({"chat_template": ""}, "chat_template"),
    ({"chat_template": "x" * 65537}, "chat_template"),
    ({"functions": [{"name": "f"}]}, "functions"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param", TOOL_CASES, ids=[json.dumps(f)[:70] for f, _ in TOOL_CASES])
def test_bad_tools_are_400_naming_the_field(client, fields, param):
    path, body = BODIES["chat"]
    response, port = send(client, path, {**body, **fields})
    error = check_error(response, 400)
    assert error["param"] == param, error
    check_still_serving(client, port)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_numbers_are_400(client, literal):
    """Python's JSON parser takes NaN and Infinity (and 1e400 overflows to inf); OpenAI's does not."""
    content = b'{"prompt": "Hi", "max_tokens": 1, "temperature": ' + literal + b"}"
    response, port = send(
        client, "/v1/completions", content=content, headers={"Content-Type": "application/json"}
    )
    check_error(response, 400, "temperature")
    check_still_serving(client, port)


def test_numbers_take_integers(client):
    """Where OpenAI's schema says number, an integer is fine: strictness stops at integers and bools."""
    response, port = send(
        client, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "temperature": 0, "top_p": 1}
    )
    assert response.status_code == 200, response.text
    check_still_serving(client, port)


# -- invalid Unicode and NUL bytes -------------------------------------------------------------------

# A JSON escape of a lone surrogate parses to a Python str the tokenizer cannot take; raw bytes that
# are not UTF-8 are decoded to lone surrogates too, so both are caught, and named, the same way.
BAD_TEXT = {
    "escaped-high": rb"\ud800",
    "escaped-reversed-pair": rb"\udc00\ud800",
    "raw-ff": b"\xff",
    "raw-encoded-surrogate": b"\xed\xa0\x80",
    "raw-truncated": b"a\xc3",
}
TEXT_FIELDS = [  # (endpoint, body with "@" where the bad text goes, the param that must be named)
    ("completions", {"prompt": "ab@cd"}, "prompt"),
    ("completions", {"prompt": ["ok", "@"]}, "prompt"),
    ("completions", {"prompt": "Hi", "stop": "@"}, "stop"),
    ("completions", {"prompt": "Hi", "stop": ["ok", "@"]}, "stop"),
    ("completions", {"prompt": "Hi", "model": "@"}, "model"),
    ("completions", {"prompt": "Hi", "user": "@"}, "user"),
    ("load-lora", {"lora_name": "a@b"}, "lora_name"),
    ("load-lora", {"lora_path": "@"}, "lora_path"),
    ("completions", {"prompt": "Hi", "cache_salt": "@"}, "cache_salt"),
    ("chat", {"messages": [{"role": "user", "content": "@"}]}, "messages[0].content"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "@"}]}]},
        "messages[0].content[0].text",
    ),
    ("chat", {"messages": [{"role": "user", "content": "Hi", "name": "@"}]}, "messages[0].name"),
    ("chat", {"messages": CHAT, "stop": ["@"]}, "stop"),
    ("chat", {"messages": CHAT, "prompt_cache_key": "@"}, "prompt_cache_key"),
    ("tokenize", {"prompt": "@"}, "prompt"),
    ("tokenize-chat", {"messages": [{"role": "user", "content": "x@"}]}, "messages[0].content"),
    ("responses", {"input": "a@"}, "input"),
    ("responses", {"input": [{"role": "user", "content": "@"}]}, "input[0].content"),
    (
        "responses",
        {
            "input": [
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "@"}]}
            ]
        },
        "input[0].content[0].text",
    ),
    (
        "chat",
        {"messages": [*CHAT, {"role": "assistant", "content": "x", "reasoning_content": "@"}]},
        "messages[1].reasoning_content",
    ),
    ("responses", {"instructions": "@"}, "instructions"),
    ("responses", {"previous_response_id": "resp_@"}, "previous_response_id"),
    ("responses", {"metadata": {"k": "@"}}, "metadata.k"),
    ("detokenize", {"tokens": [1], "model": "@"}, "model"),
    (
        "chat",
        {
            "messages": CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"enum": ["@"]}},
            },
        },
        "response_format.json_schema.schema",
    ),
    ("completions", {"prompt": "Hi", "structured_outputs": {"regex": "a@"}}, "structured_outputs.regex"),
    (
        "completions",
        {"prompt": "Hi", "structured_outputs": {"json": {"const": "@"}}},
        "structured_outputs.json",
    ),
    (
        "completions",
        {"prompt": "Hi", "structured_outputs": {"choice": ["ok", "@"]}},
        "structured_outputs.choice[1]",
    ),
]
UNICODE_CASES = [
    pytest.param(endpoint, body, param, raw, id=f"{endpoint}-{param}-{json.dumps(body)[:40]}-{name}")
    for endpoint, body, param in TEXT_FIELDS
    for name, raw in BAD_TEXT.items()
]


@pytest.mark.parametrize("endpoint, body, param, raw", UNICODE_CASES)
def test_invalid_unicode_is_400_naming_the_field(client, endpoint, body, param, raw):
    path, base = BODIES[endpoint]
    content = body_with({**base, **body}, raw)
    response, port = send(client, path, content=content, headers={"Content-Type": "application/json"})
    error = check_error(response, 400)
    assert error["param"] == param and error["code"] == "invalid_unicode", error
    check_still_serving(client, port)


NUL_CASES = [  # NUL is a valid character: accepted and handled like any other
    ("completions", {"prompt": "a\x00b"}, 200),
    ("completions", {"prompt": "Hi", "stop": ["\x00"]}, 200),
    ("chat", {"messages": [{"role": "user", "content": "\x00"}]}, 200),
    ("tokenize", {"prompt": "\x00"}, 200),
    ("responses", {"input": "\x00"}, 200),
    (
        "responses",
        {
            "input": [
                *CHAT,
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "\x00"}]},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Again?"},
            ]
        },
        200,
    ),
    (
        "chat",
        {"messages": [*CHAT, {"role": "assistant", "content": "x", "reasoning_content": "\x00"}, *CHAT]},
        200,
    ),
    ("tokenize", {"prompt": "Hi", "model": "\x00"}, 404),
]


@pytest.mark.parametrize("endpoint, fields, status", NUL_CASES)
def test_nul_characters_are_handled(client, endpoint, fields, status):
    path, body = BODIES[endpoint]
    response, port = send(client, path, {**body, **fields})
    if status == 200:
        assert response.status_code == 200, response.text
    else:
        check_error(response, status, "model")
    check_still_serving(client, port)


ACCEPTED_CASES = [  # vLLM accepts these (some it ignores): so do we
    ("chat", {"metadata": {"k": "v"}, "store": True, "service_tier": "flex"}),
    ("chat", {"top_logprobs": 0}),  # without logprobs: asks for nothing
    ("chat", {"logit_bias": {"5": 250.5, "6": -1e9}}),  # clamped to [-100, 100]
    ("completions", {"use_beam_search": True, "n": 2, "temperature": 0}),  # beams are no greedy children
    ("responses", {"max_tool_calls": 3}),
    ("responses", {"service_tier": "priority"}),  # vLLM's five tiers, echoed
]


@pytest.mark.parametrize(
    "endpoint, fields", ACCEPTED_CASES, ids=[json.dumps(f)[:60] for _, f in ACCEPTED_CASES]
)
def test_vllms_accepted_fields_answer(client, endpoint, fields):
    path, body = BODIES[endpoint]
    response, port = send(client, path, {**body, **fields})
    assert response.status_code == 200, response.text
    if endpoint == "responses":  # echoed
        assert {field: response.json()[field] for field in fields} == fields
    check_still_serving(client, port)


# -- bodies that are not a JSON object ---------------------------------------------------------------

BAD_BODIES = {
    "not-json": b"prompt=Hi",
    "truncated": b'{"prompt": "Hi"',
    "trailing-garbage": b'{"prompt": "Hi"} x',
    "raw-nul-in-string": b'{"prompt": "a\x00b"}',
    "raw-nul-after": b'{"prompt": "Hi"}\x00',
    "invalid-utf8-key": b'{"pr\xffompt": "Hi"}',
    "invalid-utf8-outside-strings": b'{"prompt": "Hi"\xff}',
    "utf8-bom": b'\xef\xbb\xbf{"prompt": "Hi"}',
    "utf16": '{"prompt": "Hi"}'.encode("utf-16"),
    "array": b'["Hi"]',
    "string": b'"Hi"',
    "null": b"null",
    "number": b"1",
    "empty": b"",
    "deep-nesting": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge-integer": b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}",
    "duplicate-key": b'{"prompt": "Hi", "prompt": 5}',
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_body_is_400(client, path, name):
    response, port = send(
        client, path, content=BAD_BODIES[name], headers={"Content-Type": "application/json"}
    )
    check_error(response, 400)
    check_still_serving(client, port)


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_body_that_is_not_declared_json_is_415(client, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    response, port = send(client, "/tokenize", content=b'{"prompt": "Hi"}', headers=headers)
    error = check_error(response, 415)
    assert error["code"] == "invalid_content_type"
    check_still_serving(client, port)
    response, port = send(
        client,
        "/tokenize",
        content=b'{"prompt": "Hi"}',
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert response.status_code == 200


# -- routes and methods ------------------------------------------------------------------------------

ROUTE_CASES = [
    ("POST", "/v1/models", 405),
    ("DELETE", "/v1/completions", 405),
    ("GET", "/v1/chat/completions", 405),
    ("PUT", "/tokenize", 405),
    ("GET", "/v1/models/%FF%00", 404),
    ("GET", "/v1/models/" + "m" * 8000, 404),
    ("GET", "/v1/nothing/%ED%A0%80", 404),
    ("PUT", "/v1/responses", 405),
    ("GET", "/v1/responses", 405),
    ("POST", "/v1/responses/resp_1", 405),
    ("GET", "/v1/responses/resp_nothing", 404),
    ("DELETE", "/v1/responses/resp_nothing", 404),
    ("GET", "/v1/responses/%FF%00", 404),
    ("DELETE", "/v1/responses/%ED%A0%80", 404),
    ("GET", "/v1/responses/" + "r" * 8000, 404),
    ("GET", "/v1/responses/resp_nothing/cancel", 405),
    ("POST", "/v1/responses/resp_nothing/cancel", 404),
    ("POST", "/v1/responses/%FF%00/cancel", 404),
    ("GET", "/v1/responses/resp_nothing?stream=true&starting_after=3", 404),
    ("GET", "/v1/responses/resp_nothing?stream=maybe", 400),
    ("GET", "/v1/responses/resp_nothing?stream=true&starting_after=x", 400),
    ("POST", "/tokenizer_info", 405),
    ("DELETE", "/tokenizer_info", 405),
    ("GET", "/tokenizer_info/%FF%00", 404),
    ("POST", "/load", 405),
]


@pytest.mark.parametrize(
    "method, path, status", ROUTE_CASES, ids=[f"{m}-{p[:30]}" for m, p, _ in ROUTE_CASES]
)
def test_wrong_route_or_method_is_4xx(client, method, path, status):
    response, port = send(client, path, method=method, content=b"")
    check_error(response, status)
    check_still_serving(client, port)


def test_models_ignore_hostile_extras(client):
    """A GET with a body, a query string of junk: /v1/models answers as usual."""
    response, port = send(client, "/v1/models?%FF=%00&x=" + "y" * 2000, method="GET", content=b"\xff" * 1000)
    assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL_NAME
    check_still_serving(client, port)


def test_tokenizer_info_ignores_hostile_extras_and_needs_the_key(client):
    """GET /tokenizer_info (on with --enable-tokenizer-info-endpoint): junk in the query and body is
    ignored; without the key, a 401."""
    response, port = send(
        client, "/tokenizer_info?%FF=%00&x=" + "y" * 2000, method="GET", content=b"\xff" * 99
    )
    assert response.status_code == 200 and response.json()["eos_token"] == "<|im_end|>"
    check_still_serving(client, port)
    response, port = send(client, "/tokenizer_info", method="GET", headers={"Authorization": "Bearer nope"})
    check_error(response, 401)
    check_still_serving(client, port)


# -- bodies over the limit ---------------------------------------------------------------------------


def test_declared_length_over_limit_is_413_before_the_body(server, client):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: {server.headers['Authorization']}\r\nContent-Length: {40 * 2**20}\r\n\r\n".encode()
    )
    status, headers, payload, is_closed = raw_exchange(server, head, timeout=10)  # no body sent at all
    assert status == 413 and headers["connection"] == "close" and is_closed
    error = json.loads(payload)["error"]
    assert error["code"] == "request_too_large" and str(MAX_BODY_BYTES) in error["message"]
    assert client.post("/tokenize", json={"prompt": "still here"}).status_code == 200


@pytest.mark.parametrize("declared", [False, True], ids=["chunked", "content-length"])
def test_streamed_body_over_limit_is_413_unread(server, client, declared):
    """256 MiB offered, chunked or declared: the server stops reading at its limit, its memory stays flat."""
    total = 256 * 2**20
    num_sent = 0

    def body():
        nonlocal num_sent
        yield b'{"prompt": "'
        chunk = b"x" * 2**20
        while num_sent < total:
            num_sent += len(chunk)
            yield chunk

    rss_before = rss_bytes(server.proc.pid)
    headers = {"Content-Type": "application/json"}
    if declared:
        headers["Content-Length"] = str(total + len(b'{"prompt": "'))
    response = client.post("/v1/completions", content=body(), headers=headers)
    error = check_error(response, 413)
    assert error["code"] == "request_too_large" and response.headers["connection"] == "close"
    assert num_sent < total // 2, f"the client got to send {num_sent} bytes"
    assert rss_bytes(server.proc.pid) - rss_before < total // 4
    assert client.post("/tokenize", json={"prompt": "still here"}).status_code == 200


def test_body_under_limit_is_read_and_judged(client):
    """A 30 MiB prompt is within the body limit: it is read and refused for the context length."""
    response, port = send(client, "/v1/completions", {"prompt": "word " * (6 * 2**20), "max_tokens": 1})
    error = check_error(response, 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    check_still_serving(client, port)


# -- malformed HTTP ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_bytes", [32 * 2**10, 64 * 2**10])
def test_oversized_header_is_431(client, num_bytes):
    """A head that arrives whole passes h11's bound and the app refuses it, keeping the connection; one
    the server reads in pieces (a 64 KiB head can span two loopback segments) h11 refuses, closing it."""
    response, port = send(client, "/tokenize", {"prompt": "Hi"}, headers={"X-Big": "a" * num_bytes})
    error = check_error(response, 431)
    assert error["code"] == "headers_too_large" and str(MAX_HEADER_BYTES) in error["message"]
    if response.headers.get("connection") == "close":
        assert client.post("/tokenize", json={"prompt": "still here"}).status_code == 200
    else:
        check_still_serving(client, port)


def test_oversized_header_in_pieces_is_431(server, client):
    """A head still incomplete past the bound is refused by h11 before any app runs."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 4096)
    error = check_raw_error(server, client, head, b"", 431)  # no end of headers: h11 cannot parse on
    assert error["code"] == "headers_too_large"


def _request(server, headers: bytes) -> bytes:
    """The head of a POST /tokenize with these extra header lines."""
    auth = server.headers["Authorization"].encode()
    return b"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth + b"\r\n" + headers + b"\r\n"


MALFORMED = {
    "content-length-letters": b"Content-Length: abc\r\n",
    "content-length-negative": b"Content-Length: -1\r\n",
    "content-length-conflicting": b"Content-Length: 5\r\nContent-Length: 6\r\n",
    "transfer-encoding-gzip": b"Transfer-Encoding: gzip\r\n",
    "header-name-with-space": b"Bad Name: x\r\n",
    "header-value-with-nul": b"X-Nul: a\x00b\r\n",
    "header-without-colon": b"NoColonHere\r\n",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_headers_are_400_json_and_close(server, client, name):
    error = check_raw_error(server, client, _request(server, MALFORMED[name]), b'{"prompt": "Hi"}', 400)
    assert error["code"] == "invalid_http"


@pytest.mark.parametrize(
    "head",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\n\r\n",
        b"GET /v1/models\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
def test_malformed_request_line_is_400_json_and_close(server, client, head):
    assert check_raw_error(server, client, head, b"", 400)["code"] == "invalid_http"


def test_broken_chunked_body_is_400_json_and_close(server, client):
    """The framing breaks while the app is already reading the body."""
    head = _request(server, b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n")
    assert check_raw_error(server, client, head, b'5\r\n{"pro\r\nzz\r\n', 400)["code"] == "invalid_http"


def test_short_content_length_leaves_a_malformed_next_request(server, client):
    """A body longer than its Content-Length: the request is judged on what was declared (not JSON),
    then the rest is read as the next request, which is malformed: both answered, then closed."""
    head = _request(server, b"Content-Type: application/json\r\nContent-Length: 5\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head + b'{"prompt": "Hi"}\r\n\r\n')
        data = b""
        deadline = time.monotonic() + 10
        while (chunk := sock.recv(65536)) and time.monotonic() < deadline:
            data += chunk
    answers = data.split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"400", b"400"], data
    assert all(b"application/json" in a for a in answers)
    assert client.post("/tokenize", json={"prompt": "still here"}).status_code == 200


# -- and after all that ------------------------------------------------------------------------------


def test_server_still_generates(server):
    assert httpx.get(server.url + "/health").status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)
    response = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=4)
    assert response.choices[0].text and response.usage.completion_tokens >= 1


# -- the Responses API (/v1/responses) ---------------------------------------------------------------

RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
_MCP_TOOL = {"type": "mcp", "server_label": "s", "server_url": "http://x/mcp"}
_MCP_CALL = {"type": "mcp_call", "id": "mcp_1", "server_label": "s", "name": "t", "arguments": "{}"}
_CALL_ITEM = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "P"}',
}
_FORMAT = {"type": "json_schema", "name": "x", "schema": {"type": "object"}}
_VIDEO = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
RESPONSES_CASES = [  # (fields over the valid body, the param named, the status)
    ({"input": DROP}, "input", 400),
    ({"input": 5}, "input", 400),
    ({"input": None}, "input", 400),
    ({"input": {"role": "user", "content": "Hi"}}, "input", 400),
    ({"input": []}, "input", 400),
    ({"input": ["Hi"]}, "input[0]", 400),
    ({"input": [{"content": "Hi"}]}, "input[0].role", 400),
    ({"input": [{"role": "tool", "content": "Hi"}]}, "input[0].role", 400),
    ({"input": [{"role": "user"}]}, "input[0].content", 400),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text", 400),
    # An image to this text-only model, and the image part's own fields.
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x;base64,AA"}]}]},
     "input[0].content[0].image_url", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0].image_url", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": 5}]}]},
     "input[0].content[0].image_url", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x", "detail": 1}]}]},
     "input[0].content[0].detail", 400),
    ({"input": [{"role": "user", "content": "Hi", "extra": 1}]}, "input[0].extra", 400),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", 400),
    ({"input": [{"type": 5}]}, "input[0].type", 400),
    ({"input": [{**_CALL_ITEM, "arguments": "{oops"}]}, "input[0].arguments", 400),
    ({"input": [{**_CALL_ITEM, "arguments": {"city": "P"}}]}, "input[0].arguments", 400),
    ({"input": [{**_CALL_ITEM, "name": "a b"}]}, "input[0].name", 400),
    ({"input": [{**_CALL_ITEM, "call_id": ""}]}, "input[0].call_id", 400),
    ({"input": [{**_CALL_ITEM, "async": "yes"}]}, "input[0].async", 400),
    ({"input": [{**_CALL_ITEM, "caller": {"type": "robot"}}]}, "input[0].caller.type", 400),
    ({"input": [{**_CALL_ITEM, "namespace": "n" * 257}]}, "input[0].namespace", 400),
    ({"input": [{"role": "assistant", "content": "Hi", "phase": "final"}]}, "input[0].phase", 400),
    ({"input": [_CALL_ITEM, _CALL_ITEM]}, "input[1].call_id", 400),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]},
     "input[0].call_id", 400),
    ({"input": [_CALL_ITEM, {"type": "function_call_output", "call_id": "call_1", "output": 5}]},
     "input[1].output", 400),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", 400),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, "input[0].summary", 400),
    # A reasoning item's text reaches the template (the thinking of the assistant turn it begins).
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": 5}]}]},
     "input[0].content[0].text", 400),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "summary_text", "text": "x"}]}]},
     "input[0].content[0].type", 400),
    ({"input": ["x"] * 4097}, "input", 400),
    ({"max_output_tokens": 0}, "max_output_tokens", 400),
    ({"max_output_tokens": 2**31}, "max_output_tokens", 400),
    ({"max_output_tokens": 10_000}, "max_output_tokens", 400),
    ({"input": "word " * 100_000}, "input", 400),
    ({"temperature": 2.5}, "temperature", 400),
    ({"top_p": 0}, "top_p", 400),
    ({"seed": 2**63}, "seed", 400),
    ({"stop": ["x"] * 17}, "stop", 400),
    ({"stop_token_ids": 5}, "stop_token_ids", 400),
    ({"stop_token_ids": [1.5]}, "stop_token_ids[0]", 400),
    ({"stop_token_ids": [1] * 65}, "stop_token_ids", 400),
    ({"safety_identifier": "x" * 257}, "safety_identifier", 400),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", 400),
    ({"metadata": {"k": "v" * 513}}, "metadata.k", 400),
    ({"metadata": {"k": 5}}, "metadata.k", 400),
    ({"truncation": "middle"}, "truncation", 400),
    ({"background": True}, "store", 400),  # the base body says store: false
    ({"background": "soon", "store": True}, "background", 400),
    # MCP items and tools (the allow-list is checked first: no --tool-server here matches x).
    ({"input": [{"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": True}]},
     "input[0].approval_request_id", 400),
    ({"input": [{"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": "yes"}]},
     "input[0].approve", 400),
    ({"input": [{"type": "mcp_approval_response", "approve": True}]}, "input[0].approval_request_id", 400),
    ({"input": [{**_MCP_CALL, "name": "a b"}]}, "input[0].name", 400),
    ({"input": [{**_MCP_CALL, "id": ""}]}, "input[0].id", 400),
    ({"input": [{**_MCP_CALL, "type": "mcp_approval_request", "arguments": 5}]}, "input[0].arguments", 400),
    ({"input": [_MCP_CALL, _MCP_CALL]}, "input[1].id", 400),
    ({"input": [{"type": "mcp_list_tools", "server_label": "s", "tools": "x"}]}, "input[0].tools", 400),
    ({"tools": [{**_MCP_TOOL, "headers": {"k": 5}}]}, "tools[0].headers.k", 400),
    ({"tools": [{**_MCP_TOOL, "headers": {f"k{i}": "v" for i in range(33)}}]}, "tools[0].headers", 400),
    ({"tools": [{**_MCP_TOOL, "authorization": "a\r\nb"}]}, "tools[0].authorization", 400),
    ({"tools": [{**_MCP_TOOL, "require_approval": "later"}]}, "tools[0].require_approval", 400),
    ({"tools": [{**_MCP_TOOL, "require_approval": {"always": {"tool_names": "t"}}}]},
     "tools[0].require_approval.always.tool_names", 400),
    ({"tools": [{**_MCP_TOOL, "require_approval": {"sometimes": {}}}]},
     "tools[0].require_approval.sometimes", 400),
    ({"tools": [_MCP_TOOL]}, "tools[0].server_url", 400),
    # Disaggregated prefill's params, as on the chat route (this server is neither producer nor consumer).
    ({"kv_transfer_params": {"remote_port": 0}}, "kv_transfer_params.remote_port", 400),
    ({"kv_transfer_params": {"remote_engine": "x"}}, "kv_transfer_params.remote_engine", 400),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params", 400),
    ({"kv_transfer_params": {"do_remote_prefill": True}, "tools": [_MCP_TOOL]}, "kv_transfer_params", 400),
    ({"service_tier": "fastest"}, "service_tier", 400),
    ({"include": "x"}, "include", 400),
    ({"top_logprobs": 21}, "top_logprobs", 400),
    ({"top_logprobs": -1}, "top_logprobs", 400),  # the whole vocabulary, past max_logprobs
    ({"top_logprobs": -2}, "top_logprobs", 400),
    ({"max_tool_calls": -1}, "max_tool_calls", 400),
    ({"include": ["message.output_text.logprobs", "x"]}, "include[1]", 400),
    ({"prompt": {"id": "p"}}, "prompt", 400),
    ({"conversation": "conv_1"}, "conversation", 400),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", 400),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", 400),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", 400),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", 400),
    ({"text": {"format": {**_FORMAT, "schema": "{}"}}}, "text.format.schema", 400),
    ({"text": {"format": {**_FORMAT, "schema": {"type": "foo"}}}}, "text.format.schema", 400),
    ({"text": {"format": {**_FORMAT, "schema": {"$ref": "#/nowhere"}}}}, "text.format.schema", 400),
    ({"text": {"format": {"type": "json_schema", "json_schema": _FORMAT}}}, "text.format.name", 400),
    ({"text": {"verbosity": "loud"}}, "text.verbosity", 400),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", 400),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name", 400),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", 400),
    ({"tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, "tools[0].parameters", 400),
    ({"tools": [RESPONSES_TOOL, RESPONSES_TOOL]}, "tools[1].name", 400),
    ({"tools": [RESPONSES_TOOL] * 129}, "tools", 400),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "foo"}}], "tool_choice": "required"},
     "tools[0].parameters", 400),
    ({"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "get_time"}},
     "tool_choice.name", 400),
    ({"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.name", 400),
    ({"tools": [RESPONSES_TOOL], "tool_choice": "sometimes"}, "tool_choice", 400),
    ({"tools": [RESPONSES_TOOL], "tool_choice": 1}, "tool_choice", 400),
    ({"tool_choice": "required"}, "tool_choice", 400),
    ({"tools": [RESPONSES_TOOL], "tool_choice": "required", "text": {"format": _FORMAT}}, "tool_choice", 400),
    ({"previous_response_id": "resp_nothing"}, "previous_response_id", 404),
    ({"previous_response_id": ""}, "previous_response_id", 400),
    ({"model": "gpt-nothing"}, "model", 404),
    # vLLM's request_id has the X-Request-Id header's bounds, as on the chat route
    ({"request_id": "r" * 129}, "request_id", 400),
    ({"request_id": "tab\there"}, "request_id", 400),
    ({"request_id": ""}, "request_id", 400),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", 400),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs.not a name", 400),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", 400),
    # chat's video_url part: this server's model takes text only; a part of the wrong shape or role
    ({"input": [{"role": "user", "content": [_VIDEO]}]}, "input[0].content[0].video_url", 400),
    ({"input": [{"role": "user", "content": [{"type": "video_url", "video_url": "data:,"}]}]},
     "input[0].content[0].video_url", 400),
    ({"input": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": 5}}]}]},
     "input[0].content[0].video_url.url", 400),
    ({"input": [{"role": "assistant", "content": [_VIDEO]}]}, "input[0].content[0]", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_video", "video_url": "x"}]}]},
     "input[0].content[0].type", 400),
]  # fmt: skip


@pytest.mark.parametrize(
    "fields, param, status", RESPONSES_CASES, ids=[f"{json.dumps(f)[:60]}" for f, _, _ in RESPONSES_CASES]
)
def test_responses_bad_request_names_the_field(client, fields, param, status):
    path, body = BODIES["responses"]
    body = {k: v for k, v in {**body, **fields}.items() if v != DROP}
    response, port = send(client, path, body)
    error = check_error(response, status)
    assert error["param"] == param, error
    check_still_serving(client, port)


@pytest.mark.parametrize("name", ["not-json", "truncated", "array", "empty", "deep-nesting", "duplicate-key"])
def test_responses_bad_body_is_400(client, name):
    response, port = send(
        client, "/v1/responses", content=BAD_BODIES[name], headers={"Content-Type": "application/json"}
    )
    check_error(response, 400)
    check_still_serving(client, port)


def test_responses_routes_need_the_key(client):
    unauthorized = {"Authorization": "Bearer nope"}
    for method, path in (
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/r"),
        ("DELETE", "/v1/responses/r"),
    ):
        response, port = send(client, path, BODIES["responses"][1], method=method, headers=unauthorized)
        check_error(response, 401)
        check_still_serving(client, port)


def test_responses_stream_refused_before_it_starts(client):
    """An invalid streamed request is a plain 400, not an event stream."""
    body = {"input": "Hi", "stream": True, "max_output_tokens": 10_000}
    response, port = send(client, "/v1/responses", body)
    check_error(response, 400, "max_output_tokens")
    check_still_serving(client, port)


# -- Anthropic's Messages API ------------------------------------------------------------------------

# The same guards on /v1/messages and /v1/messages/count_tokens, answered in Anthropic's error shape:
# `{"type": "error", "error": {"type", "message"}}`, the message naming the field (there is no param).
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
ANTHROPIC_BODY = {"model": MODEL_NAME, "max_tokens": 1, "messages": CHAT}
WEATHER_TOOL = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
}


def check_anthropic_error(response: httpx.Response, status: int, field: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    error = body["error"]
    assert set(error) == {"type", "message"} and error["type"] == ANTHROPIC_TYPES[status], error
    assert len(error["message"]) <= 500 and not INTERNALS.search(error["message"]), error["message"]
    if field is not None:
        assert field in error["message"], error
    return error


ANTHROPIC_FIELD_TYPES = {
    "integer": ["max_tokens", "top_k"],
    "number": ["temperature", "top_p"],
    "boolean": ["stream"],
    "string": ["model"],
    "object": ["metadata", "tool_choice", "kv_transfer_params", "chat_template_kwargs"],
}
ANTHROPIC_TYPE_CASES = [
    pytest.param(field, value, id=f"{field}-{json.dumps(value)}")
    for kind, fields in ANTHROPIC_FIELD_TYPES.items()
    for field in fields
    for value in WRONG_TYPES[kind]
]


@pytest.mark.parametrize("field, value", ANTHROPIC_TYPE_CASES)
def test_anthropic_wrong_type_is_400_naming_the_field(client, field, value):
    response, port = send(client, MESSAGES, {**ANTHROPIC_BODY, field: value})
    check_anthropic_error(response, 400, field)
    check_still_serving(client, port)


def _user(*blocks) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


def _without(block: dict, key: str) -> dict:
    return {k: v for k, v in block.items() if k != key}


_TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
_CALLED = [*CHAT, {"role": "assistant", "content": [_TOOL_USE]}]
# An MCP server (the MCP connector's) outside --tool-server: the suite's MCP server listens elsewhere.
_MCP = {"type": "url", "url": "http://127.0.0.1:9/mcp", "name": "tides"}

# Each a body's fields over ANTHROPIC_BODY (DROP: leave the field out) and the field the message names.
ANTHROPIC_BAD = [
    ({"max_tokens": DROP}, "max_tokens"),
    ({"model": DROP}, "model"),
    ({"messages": DROP}, "messages"),
    ({"messages": []}, "messages"),
    ({"max_tokens": -1}, "max_tokens"),  # 0 is cache pre-warming
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"stop_sequences": [5]}, "stop_sequences[0]"),
    ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
    ({"system": 5}, "system"),
    ({"system": [{"type": "text"}]}, "system[0].text"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id"),
    ({"metadata": {"tenant": "x"}}, "metadata.tenant"),
    # Accepted and ignored where they mean nothing here, checked all the same.
    ({"cache_control": {"type": "persistent"}}, "cache_control.type"),
    ({"cache_control": {"type": "ephemeral", "ttl": "1d"}}, "cache_control.ttl"),
    ({"speed": "warp"}, "speed"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"inference_geo": 5}, "inference_geo"),
    ({"inference_geo": "x" * 65}, "inference_geo"),
    ({"cache_salt": ""}, "cache_salt"),  # vLLM's, as on the chat route
    ({"cache_salt": 5}, "cache_salt"),
    ({"cache_salt": "s" * 257}, "cache_salt"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"thinking": {"type": "enabled"}}, "thinking"),
    ({"thinking": {"type": "enabled", "budget_tokens": "1024"}}, "thinking"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": _user("Hi")}, "messages[0].content[0]"),
    ({"messages": _user({"type": "image", "source": {}})}, "messages[0].content[0].source"),
    ({"messages": _user({"type": "text", "text": 5})}, "messages[0].content[0].text"),
    ({"messages": _user({"type": "text", "text": "Hi", "extra": 1})}, "messages[0].content[0].extra"),
    ({"messages": [*CHAT, {"role": "assistant", "content": [_without(_TOOL_USE, "id")]}]},
     "messages[1].content[0].id"),
    ({"messages": [*CHAT, {"role": "assistant", "content": [{**_TOOL_USE, "input": "{}"}]}]},
     "messages[1].content[0].input"),
    ({"messages": _user({"type": "tool_result"})}, "messages[0].content[0].tool_use_id"),
    ({"messages": [*_CALLED, *_user({"type": "tool_result", "tool_use_id": "toolu_1", "content": 5})]},
     "messages[2].content[0].content"),
    # What only the server can judge: ids, roles, names and schemas.
    ({"messages": [*_CALLED, *_user({"type": "tool_result", "tool_use_id": "toolu_9"})]},
     "messages[2].content[0].tool_use_id"),
    ({"messages": _user({"type": "tool_result", "tool_use_id": "toolu_1"})},
     "messages[0].content[0].tool_use_id"),
    ({"messages": _user(_TOOL_USE)}, "messages[0].content[0]"),
    ({"messages": [*_CALLED, {"role": "assistant", "content": [_TOOL_USE]}]}, "messages[2].content[0].id"),
    ({"tools": [{"input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"name": "a b", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "x", "input_schema": {"type": "object"}, "strict": "yes"}]}, "tools[0].strict"),
    ({"tools": [{"name": "x", "input_schema": {"type": "object"}, "eager_input_streaming": 1}]},
     "tools[0].eager_input_streaming"),
    ({"tools": [{"name": "x", "input_schema": "{}"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "x", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "x", "input_schema": {"type": "object", "properties": {"a": {"type": "foo"}}}}]},
     "tools[0].input_schema"),
    ({"tools": [{"name": "x", "input_schema": {"$ref": "#/$defs/nowhere"}}]}, "tools[0].input_schema"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].name"),
    ({"tools": [WEATHER_TOOL] * 129}, "tools"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use"),
    # output_config (structured output) and thinking, as the current SDK sends them.
    ({"output_config": "json"}, "output_config"),
    ({"output_config": {"mode": "json"}}, "output_config.mode"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": {"format": "json"}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": "{}"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "foo"}}}},
     "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#/nowhere"}}}},
     "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}, "name": "x"}}},
     "output_config.format.name"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
      "tools": [WEATHER_TOOL], "tool_choice": {"type": "any"}}, "output_config.format"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking"),
    ({"thinking": {"type": "adaptive", "budget_tokens": 1024}}, "thinking"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "loud"}}, "thinking"),
    ({"thinking": "enabled"}, "thinking"),
    # mcp_servers (the MCP connector): shapes, URLs outside --tool-server, refused before any connection.
    ({"mcp_servers": "x"}, "mcp_servers"),
    ({"mcp_servers": [{**_MCP, "type": "sse"}]}, "mcp_servers[0].type"),
    ({"mcp_servers": [_without(_MCP, "url")]}, "mcp_servers[0].url"),
    ({"mcp_servers": [{**_MCP, "url": "ftp://127.0.0.1:21/mcp"}]}, "mcp_servers[0].url"),
    ({"mcp_servers": [{**_MCP, "url": "not a url"}]}, "mcp_servers[0].url"),
    ({"mcp_servers": [{**_MCP, "url": "http://169.254.169.254/latest/meta-data"}]}, "mcp_servers[0].url"),
    ({"mcp_servers": [_without(_MCP, "name")]}, "mcp_servers[0].name"),
    ({"mcp_servers": [{**_MCP, "name": "a b"}]}, "mcp_servers[0].name"),
    ({"mcp_servers": [{**_MCP, "authorization_token": "a\r\nHost: evil"}]},
     "mcp_servers[0].authorization_token"),
    ({"mcp_servers": [{**_MCP, "authorization_token": "x" * 8193}]}, "mcp_servers[0].authorization_token"),
    ({"mcp_servers": [{**_MCP, "headers": {"X-Key": "a"}}]}, "mcp_servers[0].headers"),
    ({"mcp_servers": [{**_MCP, "tool_configuration": {"enabled": "yes"}}]},
     "mcp_servers[0].tool_configuration.enabled"),
    ({"mcp_servers": [{**_MCP, "tool_configuration": {"allowed_tools": ["bad name!"]}}]},
     "mcp_servers[0].tool_configuration.allowed_tools[0]"),
    ({"mcp_servers": [{**_MCP, "tool_configuration": {"allowed_tools": "tide_table"}}]},
     "mcp_servers[0].tool_configuration.allowed_tools"),
    ({"mcp_servers": [_MCP] * 17}, "mcp_servers"),
    ({"mcp_servers": [_MCP], "max_tokens": 0}, "max_tokens"),
    # Disaggregated prefill's params, as on the chat route (this server is neither producer nor consumer).
    ({"kv_transfer_params": {"remote_port": 0}}, "kv_transfer_params.remote_port"),
    ({"kv_transfer_params": {"do_remote_decode": "yes"}}, "kv_transfer_params.do_remote_decode"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"kv_transfer_params": {"do_remote_prefill": True}, "mcp_servers": [_MCP]}, "kv_transfer_params"),
    # vLLM's chat_template_kwargs, checked as on the chat route; Anthropic defines no video block
    ({"chat_template_kwargs": {"tokenize": True}}, "'tokenize' cannot be set through chat_template_kwargs"),
    ({"chat_template_kwargs": {"not a name": 1}}, "'not a name' cannot be set through chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"messages": _user({"type": "video", "source": {"type": "url", "url": "http://x/v.mp4"}})},
     "messages[0].content[0].type"),
    ({"messages": _user({"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1"})}, "messages[0].content[0]"),
    ({"messages": [*CHAT, {"role": "assistant", "content": [
        {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_9"}]}]}, "messages[1].content[0].tool_use_id"),
    ({"messages": [*CHAT, {"role": "assistant", "content": [
        {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "x", "input": {}}]}]},
     "messages[1].content[0].server_name"),
]  # fmt: skip


# The fields /v1/messages takes and count_tokens does not (it takes the MCP connector's servers).
_GENERATION_FIELDS = {
    "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "metadata", "stream",
    "kv_transfer_params", "service_tier", "inference_geo", "cache_salt",
}  # fmt: skip
ANTHROPIC_BAD_CASES = [
    pytest.param(path, fields, field, id=f"{path.rsplit('/', 1)[1]}-{json.dumps(fields)[:70]}")
    for path in (MESSAGES, COUNT_TOKENS)
    for fields, field in ANTHROPIC_BAD
    if not (path == COUNT_TOKENS and fields.get("max_tokens") == DROP)
]


@pytest.mark.parametrize("path, fields, field", ANTHROPIC_BAD_CASES)
def test_anthropic_bad_request_is_400_naming_the_field(client, path, fields, field):
    """count_tokens takes no generation fields: sent one, it names it as unknown."""
    base = ANTHROPIC_BODY if path == MESSAGES else _without(ANTHROPIC_BODY, "max_tokens")
    if path == COUNT_TOKENS and field.split(".")[0].split("[")[0] in _GENERATION_FIELDS:
        field = field.split(".")[0].split("[")[0]
    body = {k: v for k, v in {**base, **fields}.items() if v != DROP}
    response, port = send(client, path, body)
    check_anthropic_error(response, 400, field)
    check_still_serving(client, port)


ANTHROPIC_TEXT_FIELDS = [  # a body with "@" where the bad text goes, the field to be named
    ({"messages": [{"role": "user", "content": "ab@"}]}, "messages[0].content[0].text"),
    ({"messages": _user({"type": "text", "text": "@"})}, "messages[0].content[0].text"),
    ({"system": "@"}, "system[0].text"),
    ({"stop_sequences": ["@"]}, "stop_sequences[0]"),
    ({"model": "@"}, "model"),
    ({"inference_geo": "@"}, "inference_geo"),
    ({"tools": [{"name": "x", "description": "@", "input_schema": {"type": "object"}}]},
     "tools[0].description"),
    ({"tools": [{"name": "x", "input_schema": {"enum": ["@"]}}]}, "tools[0].input_schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"enum": ["@"]}}}},
     "output_config.format.schema"),
]  # fmt: skip


@pytest.mark.parametrize("raw", list(BAD_TEXT.values()), ids=list(BAD_TEXT))
@pytest.mark.parametrize("fields, field", ANTHROPIC_TEXT_FIELDS, ids=[f for _, f in ANTHROPIC_TEXT_FIELDS])
def test_anthropic_invalid_unicode_is_400_naming_the_field(client, fields, field, raw):
    content = body_with({**ANTHROPIC_BODY, **fields}, raw)
    response, port = send(client, MESSAGES, content=content, headers={"Content-Type": "application/json"})
    error = check_anthropic_error(response, 400, field)
    assert "Unicode" in error["message"]
    check_still_serving(client, port)


@pytest.mark.parametrize("path", [MESSAGES, COUNT_TOKENS])
@pytest.mark.parametrize("name", ["not-json", "truncated", "array", "empty", "deep-nesting", "duplicate-key"])
def test_anthropic_bad_body_is_400(client, path, name):
    response, port = send(
        client, path, content=BAD_BODIES[name], headers={"Content-Type": "application/json"}
    )
    check_anthropic_error(response, 400)
    check_still_serving(client, port)


def test_anthropic_routes_answer_every_status_in_their_shape(server, client):
    response, port = send(client, MESSAGES, {**ANTHROPIC_BODY, "model": "claude-nothing"})
    check_anthropic_error(response, 404, "claude-nothing")
    check_still_serving(client, port)
    response, port = send(client, MESSAGES, method="GET", content=b"")
    check_anthropic_error(response, 405)
    response, port = send(client, COUNT_TOKENS, content=b"{}", headers={"Content-Type": "text/plain"})
    check_anthropic_error(response, 415)
    check_still_serving(client, port)
    response, port = send(client, MESSAGES, ANTHROPIC_BODY, headers={"Authorization": "Bearer nope"})
    check_anthropic_error(response, 401)
    check_still_serving(client, port)
    head = (
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"x-api-key: {server.api_key}\r\nContent-Length: {40 * 2**20}\r\n\r\n".encode()
    )
    status, headers, payload, is_closed = raw_exchange(server, head, timeout=10)
    assert status == 413 and is_closed
    assert json.loads(payload)["error"]["type"] == "request_too_large"


def test_anthropic_context_length_is_400(client):
    response, port = send(client, MESSAGES, {**ANTHROPIC_BODY, "max_tokens": 10_000})
    error = check_anthropic_error(response, 400, "maximum context length is 512 tokens")
    assert "10000 for the completion" in error["message"]
    response, port = send(
        client,
        COUNT_TOKENS,
        {"model": MODEL_NAME, "messages": _user(*[{"type": "text", "text": "word " * 100_000}])},
    )
    check_anthropic_error(response, 400, "messages")
    check_still_serving(client, port)


# The pooling routes on this generating server: refused, naming the runner (a pooling server's own
# hostile input is sent in test_pooling_server.py, which starts one).
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/embeddings", {"input": "Hi"}),
        ("/pooling", {"input": [1, 2]}),
        ("/v1/embeddings", {"messages": CHAT}),
        ("/pooling", {"messages": CHAT, "add_generation_prompt": False}),
        ("/classify", {"input": ["Hi"]}),
        ("/classify", {"messages": CHAT}),
        ("/score", {"text_1": "a", "text_2": ["b"]}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/score", {"queries": "a", "items": ["b"], "truncation_side": "right", "cache_salt": "s"}),
        ("/v1/score", {"data_1": ["a"], "data_2": ["b"]}),
        ("/v1/embeddings", {"input": "Hi", "encoding_format": "bytes", "embed_dtype": "fp8_e4m3"}),
        ("/pooling", {"input": "Hi", "encoding_format": "base64", "endianness": "big"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 1}),
        ("/v2/rerank", {"query": "a", "documents": ["b"], "return_documents": False}),
    ],
)
def test_pooling_routes_on_a_generating_server_are_400_naming_the_runner(client, path, body):
    response, port = send(client, path, {"model": MODEL_NAME, **body})
    error = check_error(response, 400, "model")
    assert "runner='generate'" in error["message"] and "--runner pooling" in error["message"]
    check_still_serving(client, port)


def test_anthropic_structured_output_stream_refused_before_it_starts(client):
    """A bad output format on a streamed request is a plain 400, not an event stream."""
    fields = {"stream": True, "output_config": {"format": {"type": "json_schema", "schema": {"type": "foo"}}}}
    response, port = send(client, MESSAGES, {**ANTHROPIC_BODY, **fields})
    check_anthropic_error(response, 400, "output_config.format.schema")
    check_still_serving(client, port)


# -- SageMaker's routes (/ping, /invocations) ---------------------------------------------------------

INVOCATIONS = "/invocations"
INVOCATION_CASES = [  # (body, the param named, the status); the shape picks chat or completions
    ({}, None, 400),
    ({"input": "Hi"}, None, 400),
    ({"text": "Hi", "max_tokens": 1}, None, 400),
    ({"messages": "Hi"}, "messages", 400),
    ({"messages": []}, "messages", 400),
    ({"messages": None}, "messages", 400),
    ({"messages": [{"role": "user", "content": 5}], "max_tokens": 1}, "messages[0].content", 400),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens", 400),
    ({"messages": CHAT, "max_tokens": 10_000}, "max_tokens", 400),
    ({"messages": CHAT, "max_tokens": 10_000, "stream": True}, "max_tokens", 400),
    ({"messages": CHAT, "temperature": "hot"}, "temperature", 400),
    ({"messages": CHAT, "prompt": "Hi"}, "prompt", 400),
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice", 400),
    ({"messages": CHAT, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", 400),
    ({"prompt": 5}, "prompt", 400),
    ({"prompt": None}, "prompt", 400),
    ({"prompt": [[-1]]}, "prompt", 400),
    ({"prompt": "Hi", "n": 0}, "n", 400),
    ({"prompt": "Hi", "logprobs": 100}, "logprobs", 400),
    ({"prompt": "Hi", "unknown": 1}, "unknown", 400),
    ({"prompt": "word " * 100_000}, "prompt", 400),
    ({"prompt": "Hi", "model": "gpt-nothing"}, "model", 404),
    ({"messages": CHAT, "model": "gpt-nothing"}, "model", 404),
]  # fmt: skip


@pytest.mark.parametrize(
    "body, param, status", INVOCATION_CASES, ids=[json.dumps(b)[:60] for b, _, _ in INVOCATION_CASES]
)
def test_invocations_bad_request_names_the_field(client, body, param, status):
    response, port = send(client, INVOCATIONS, body)
    error = check_error(response, status)
    assert error["param"] == param, error
    if param is None:
        assert "'messages'" in error["message"] and "'prompt'" in error["message"]
    check_still_serving(client, port)


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_invocations_bad_body_is_400(client, name):
    response, port = send(
        client, INVOCATIONS, content=BAD_BODIES[name], headers={"Content-Type": "application/json"}
    )
    check_error(response, 400)
    check_still_serving(client, port)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "ab@"}, "prompt"),
        ({"messages": [{"role": "user", "content": "@"}], "max_tokens": 1}, "messages[0].content"),
        ({"prompt": "Hi", "stop": ["@"]}, "stop"),
    ],
)
@pytest.mark.parametrize("raw", list(BAD_TEXT.values()), ids=list(BAD_TEXT))
def test_invocations_invalid_unicode_is_400_naming_the_field(client, body, param, raw):
    response, port = send(
        client, INVOCATIONS, content=body_with(body, raw), headers={"Content-Type": "application/json"}
    )
    error = check_error(response, 400)
    assert error["param"] == param and error["code"] == "invalid_unicode", error
    check_still_serving(client, port)


@pytest.mark.parametrize(
    "method, path, status",
    [("GET", INVOCATIONS, 405), ("PUT", INVOCATIONS, 405), ("DELETE", "/ping", 405), ("PUT", "/ping", 405)],
)
def test_sagemaker_wrong_method_is_405(client, method, path, status):
    response, port = send(client, path, method=method, content=b"")
    check_error(response, status)
    check_still_serving(client, port)


def test_invocations_needs_the_key_and_json(client):
    body = {"prompt": "Hi", "max_tokens": 1}
    response, port = send(client, INVOCATIONS, body, headers={"Authorization": "Bearer nope"})
    check_error(response, 401)
    check_still_serving(client, port)
    response, port = send(
        client, INVOCATIONS, content=json.dumps(body).encode(), headers={"Content-Type": "text/plain"}
    )
    assert check_error(response, 415)["code"] == "invalid_content_type"
    check_still_serving(client, port)
    response, port = send(client, INVOCATIONS, {**body, "max_tokens": 1})
    assert response.status_code == 200 and response.json()["object"] == "text_completion"
    ping = httpx.get(str(client.base_url) + "/ping")
    assert ping.status_code == 200


@pytest.mark.parametrize("value", [True, False])
def test_spaces_between_special_tokens_reaches_the_sampling_params(value):
    """vLLM's request field (lm-eval's vLLM backend sends it): taken, not ignored, on both routes."""
    from xlaserve.entrypoints.openai.protocol import CompletionRequest
    from xlaserve.entrypoints.serving.chat_protocol import ChatCompletionRequest
    from xlaserve.entrypoints.serving.engine_io import make_sampling_params

    fields = {"model": MODEL_NAME, "spaces_between_special_tokens": value}
    requests = [
        CompletionRequest(prompt="hi", **fields),
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields),
    ]
    assert [make_sampling_params(r, 4, None).spaces_between_special_tokens for r in requests] == [value] * 2

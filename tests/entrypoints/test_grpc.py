"""`xlaserve serve --grpc-port`: the xlaserve.v1.Generation service on the session's server, driven by
a real grpc channel: streamed outputs equal the HTTP API's for the same prompt, the health service
and reflection answer, the API key is required, and hostile requests get INVALID_ARGUMENT naming the
field while the server keeps serving."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from helpers.server_harness import MODEL_NAME
from xlaserve.entrypoints.grpc.protos import protos_and_services
from xlaserve.entrypoints.grpc.server import SERVICE_NAME

pb, services = protos_and_services()
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return services.GenerationStub(channel)


@pytest.fixture(scope="module")
def auth(server):
    return (("authorization", f"Bearer {server.api_key}"),)


def generate(stub, auth, **fields) -> list:
    return list(stub.Generate(pb.GenerateRequest(**fields), metadata=auth, timeout=TIMEOUT_S))


def greedy(max_tokens: int, **fields):
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)


def http_completion(server, prompt, max_tokens: int, **fields) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    response = httpx.post(
        server.url + "/v1/completions", json=body, headers=server.headers, timeout=TIMEOUT_S
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_health_needs_no_key_and_reports_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_service_and_its_methods(channel):
    database = ProtoReflectionDescriptorDatabase(channel)
    # Open without the key, as the HTTP API's /openapi.json is: it describes the service, runs nothing.
    assert SERVICE_NAME in database.get_services()
    service = database.FindFileContainingSymbol(SERVICE_NAME).service[0]
    assert [m.name for m in service.method] == ["Generate", "Abort", "GetModelInfo"]


def test_streamed_tokens_equal_the_http_apis(server, stub, auth):
    prompt_ids = httpx.post(
        server.url + "/tokenize",
        json={"model": MODEL_NAME, "prompt": "The capital of France is"},
        headers=server.headers,
    ).json()["tokens"]
    params = greedy(12, logprobs=0)
    responses = generate(stub, auth, token_ids=pb.TokenIds(ids=prompt_ids), sampling_params=params)
    assert len(responses) > 1, "the outputs did not stream"
    assert list(responses[0].prompt_token_ids) == prompt_ids
    assert all(not r.prompt_token_ids for r in responses[1:])
    assert [r.finished for r in responses] == [False] * (len(responses) - 1) + [True]
    assert responses[-1].finish_reason == "length"
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id.startswith("grpc-")
    tokens = [t for r in responses for t in r.token_ids]
    positions = [p for r in responses for p in r.logprobs]
    assert len(tokens) == len(positions) == 12
    assert [p.entries[0].token_id for p in positions] == tokens
    expected = http_completion(server, prompt_ids, 12, logprobs=0)["choices"][0]
    assert "".join(r.text for r in responses) == expected["text"]
    # Token for token: the HTTP API names each sampled token by its text, with its logprob.
    assert [p.entries[0].decoded_token for p in positions] == expected["logprobs"]["tokens"]
    for position, logprob in zip(positions, expected["logprobs"]["token_logprobs"], strict=True):
        assert position.entries[0].logprob == pytest.approx(logprob, abs=1e-5)


def test_text_prompt_with_logprobs_and_a_choice(stub, auth):
    responses = generate(
        stub,
        auth,
        text="Is the sky blue? Answer:",
        sampling_params=greedy(8, logprobs=2, choice=["yes", "no"]),
    )
    text = "".join(r.text for r in responses)
    assert text in ("yes", "no")
    tokens = [t for r in responses for t in r.token_ids]
    logprobs = [entry for r in responses for entry in r.logprobs]
    assert len(logprobs) == len(tokens)
    for token, position in zip(tokens, logprobs, strict=True):
        assert position.entries[0].token_id == token  # the sampled token first, then the top-2
        assert 2 <= len(position.entries) <= 3 and all(e.logprob <= 0 for e in position.entries)


def test_model_info(server, stub, auth):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth, timeout=10)
    models = httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"]
    assert info.model == MODEL_NAME and list(info.served_model_names) == [MODEL_NAME]
    assert info.max_model_len == models[0]["max_model_len"]
    assert info.vocab_size == 49152 and info.version


def test_abort_ends_the_stream_and_the_server_keeps_serving(server, stub, auth):
    request_id = "grpc-test-abort"
    stream = stub.Generate(
        pb.GenerateRequest(
            request_id=request_id, text="Count to a thousand:", sampling_params=greedy(200, ignore_eos=True)
        ),
        metadata=auth,
        timeout=TIMEOUT_S,
    )
    first = next(stream)
    assert first.request_id == request_id and not first.finished
    stub.Abort(pb.AbortRequest(request_id=request_id), metadata=auth, timeout=10)
    rest = list(stream)
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
    assert sum(len(r.token_ids) for r in [first, *rest]) < 200
    assert generate(stub, auth, text="Hello", sampling_params=greedy(2))[-1].finished


def test_cancelled_call_aborts_its_request(server, stub, auth):
    stream = stub.Generate(
        pb.GenerateRequest(text="Count to a thousand:", sampling_params=greedy(300, ignore_eos=True)),
        metadata=auth,
        timeout=TIMEOUT_S,
    )
    next(stream)
    stream.cancel()
    # The engine ends the request: nothing stays running once the server has seen the cancel.
    done = threading.Event()

    def running() -> float:
        text = httpx.get(server.url + "/metrics").text
        line = next(ln for ln in text.splitlines() if ln.startswith("xlaserve:num_requests_running"))
        return float(line.rsplit(" ", 1)[1])

    for _ in range(100):
        if running() == 0:
            done.set()
            break
        done.wait(0.1)
    assert done.is_set(), "the cancelled call's request kept running"


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong"),), (("authorization", "sk-xlaserve-test"),)],
    ids=["none", "wrong", "no-bearer"],
)
def test_calls_without_the_key_fail(stub, metadata):
    with pytest.raises(grpc.RpcError) as e:
        stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(text="Hi"), metadata=metadata, timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


HOSTILE = [  # (request fields, the field the message names)
    ({}, "prompt"),
    ({"text": ""}, "text"),
    ({"token_ids": pb.TokenIds(ids=[])}, "token_ids"),
    ({"token_ids": pb.TokenIds(ids=[1, 10**9])}, "prompt"),
    ({"token_ids": pb.TokenIds(ids=[-5])}, "prompt"),
    ({"text": "Hi", "sampling_params": pb.SamplingParams(temperature=-1)}, "sampling_params.temperature"),
    ({"text": "Hi", "sampling_params": pb.SamplingParams(top_p=0)}, "sampling_params.top_p"),
    ({"text": "Hi", "sampling_params": pb.SamplingParams(max_tokens=0)}, "sampling_params.max_tokens"),
    ({"text": "Hi", "sampling_params": pb.SamplingParams(max_tokens=10**6)}, "max_tokens"),
    ({"text": "word " * 5000}, "text"),
    (
        {"text": "Hi", "sampling_params": pb.SamplingParams(json_schema="{not json")},
        "sampling_params.json_schema",
    ),
    ({"text": "Hi", "sampling_params": pb.SamplingParams(regex="(")}, "sampling_params.regex"),
    ({"text": "Hi", "sampling_params": pb.SamplingParams(regex="a", choice=["b"])}, "sampling_params"),
    ({"text": "Hi", "sampling_params": pb.SamplingParams(logprobs=10**4)}, "sampling_params.logprobs"),
]


@pytest.mark.parametrize("fields,field", HOSTILE, ids=[f"{i}-{f}" for i, (_, f) in enumerate(HOSTILE)])
def test_bad_requests_are_invalid_argument_naming_the_field(stub, auth, fields, field):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, auth, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    details = e.value.details()
    assert details.startswith(f"{field}: ") or f"{field}" in details.split(":", 1)[0], details
    assert not details.startswith(f"{field}: {field}"), details  # the field named once
    assert len(details) <= 600 and "Traceback" not in details


def test_still_serving_after_hostile_requests(stub, auth):
    responses = generate(stub, auth, text="The capital of France is", sampling_params=greedy(3))
    assert sum(len(r.token_ids) for r in responses) == 3

"""`xlaserve serve --grpc-port PORT`: the `xlaserve.v1.Generation` service (xlaserve_grpc.proto) on
grpc.aio, in the HTTP server's event loop and over the same engine, with the standard health service
and server reflection.

A request takes the HTTP routes' way into the engine (serving/engine_io.py): the same sampling
checks, the same context check, the same engine errors, each mapped to its gRPC status; so a request
the HTTP API refuses with a 400 naming a field is INVALID_ARGUMENT here with the same message.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from xlaserve.engine.structured_output import check_grammar
from xlaserve.entrypoints.app import server_version
from xlaserve.entrypoints.grpc.protos import protos_and_services
from xlaserve.entrypoints.serving.engine_io import (
    check_context,
    check_num_logprobs,
    default_max_tokens,
    engine_error,
    new_id,
    submit,
    tokenize_text,
)
from xlaserve.entrypoints.serving.errors import APIError, bad_request, param_of_value_error
from xlaserve.entrypoints.serving.state import ServerState
from xlaserve.outputs import RequestOutput
from xlaserve.sampling_params import SamplingParams
from xlaserve.structured_outputs_params import StructuredOutputsError, StructuredOutputsParams

logger = logging.getLogger("xlaserve.entrypoints.grpc")

SERVICE_NAME = "xlaserve.v1.Generation"
# Health and reflection answer without the API key: probes (Kubernetes' grpc probe) send none, and
# reflection describes the service as the HTTP API's open /openapi.json does, running nothing.
_OPEN_METHODS = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
# The HTTP status of an APIError -> its gRPC status.
_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
}
# SamplingParams fields a proto3 `optional` carries as is (unset: SamplingParams' default).
_OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "skip_special_tokens",
)
_STRUCTURED_FIELDS = ("json_schema", "regex", "grammar")
_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


def _grpc_status(error: APIError) -> grpc.StatusCode:
    if error.code == "queue_full":
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return _STATUS.get(error.status_code, grpc.StatusCode.INTERNAL)


def _message(error: APIError) -> str:
    """The HTTP error's message, led by the field it names (gRPC statuses have no `param`) unless the
    message already starts with it."""
    if not error.param or error.message.startswith(error.param):
        return error.message
    return f"{error.param}: {error.message}"


def sampling_params(fields, state: ServerState, num_prompt_tokens: int) -> SamplingParams:
    """The request's SamplingParams message as the engine's SamplingParams, what it leaves unset from
    the server's defaults (the model's generation config); a bad value is a 400-style APIError naming the
    field as `sampling_params.NAME`."""
    kwargs = dict(state.default_sampling)
    if "max_tokens" in kwargs:
        kwargs["max_tokens"] = default_max_tokens(state, None, num_prompt_tokens)
    kwargs |= {name: getattr(fields, name) for name in _OPTIONAL_FIELDS if fields.HasField(name)}
    kwargs.update(
        stop=list(fields.stop) or None,
        stop_token_ids=list(fields.stop_token_ids) or None,
        ignore_eos=fields.ignore_eos,
        include_stop_str_in_output=fields.include_stop_str_in_output,
    )
    structured = {name: getattr(fields, name) for name in _STRUCTURED_FIELDS if fields.HasField(name)}
    if fields.choice:
        structured["choice"] = list(fields.choice)
    if structured:
        spec = {("json" if name == "json_schema" else name): value for name, value in structured.items()}
        try:
            kwargs["structured_outputs"] = StructuredOutputsParams(**spec)
            check_grammar(kwargs["structured_outputs"])
        except StructuredOutputsError as e:
            param = "json_schema" if e.member == "json" else e.member
            raise bad_request(f"{e.reason}", f"sampling_params.{param}") from None
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        name = param_of_value_error(e, _SAMPLING_FIELDS)
        raise bad_request(str(e), "sampling_params" + (f".{name}" if name else "")) from None
    # The engine's --max-logprobs, which SamplingParams alone does not know.
    check_num_logprobs(state.engine, **{"sampling_params.logprobs": params.logprobs})
    return params


class GenerationService:
    """The Generation service's methods, over the server's engine (registered through the proto's
    generic handler, so no generated code is kept in the repository)."""

    def __init__(self, state: ServerState, pb):
        self.state = state
        self.pb = pb

    def _prompt_ids(self, request) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "text":
            return tokenize_text(self.state.engine, request.text, add_special_tokens=True, param="text")
        if which == "token_ids":
            return list(request.token_ids.ids)
        raise bad_request("a GenerateRequest needs a prompt: set 'text' or 'token_ids'", "prompt")

    async def Generate(self, request, context):  # noqa: N802 - the proto's method name
        request_id = request.request_id or new_id("grpc")
        try:
            ids = self._prompt_ids(request)
            params = sampling_params(request.sampling_params, self.state, len(ids))
            param = "token_ids" if request.WhichOneof("prompt") == "token_ids" else "text"
            check_context(self.state.engine, len(ids), params.max_tokens, param)
            stream = submit(self.state, ids, params, request_id, stream=True, priority=request.priority)
        except APIError as e:
            await context.abort(_grpc_status(e), _message(e))
        try:
            first = True
            async for output in stream:
                yield self._response(output, first)
                first = False
        except Exception as e:  # noqa: BLE001 - every engine failure becomes a status
            await context.abort(_grpc_status(engine_error(e)), _message(engine_error(e)))
        finally:
            stream.close()  # the call was cancelled (the client left): abort the request

    def _response(self, output: RequestOutput, first: bool):
        completion = output.outputs[0]
        logprobs = []
        for position in completion.logprobs or ():
            entries = [
                self.pb.TopLogprob(
                    token_id=token_id,
                    logprob=lp.logprob,
                    rank=lp.rank or 0,
                    decoded_token=lp.decoded_token or "",
                )
                for token_id, lp in position.items()
            ]
            logprobs.append(self.pb.TokenLogprobs(entries=entries))
        return self.pb.GenerateResponse(
            request_id=output.request_id,
            prompt_token_ids=output.prompt_token_ids if first else (),
            token_ids=completion.token_ids,
            text=completion.text,
            logprobs=logprobs,
            finished=output.finished,
            finish_reason=completion.finish_reason or "",
            num_cached_tokens=output.num_cached_tokens,
        )

    async def Abort(self, request, context):  # noqa: N802
        if request.request_id:
            self.state.engine.abort(request.request_id)
        return self.pb.AbortResponse()

    async def GetModelInfo(self, request, context):  # noqa: N802
        engine = self.state.engine
        tokenizer = engine.tokenizer
        return self.pb.ModelInfo(
            model=self.state.model_name,
            served_model_names=self.state.served_model_names,
            max_model_len=engine.max_model_len,
            vocab_size=len(tokenizer) if tokenizer is not None else 0,
            version=server_version(),
        )


class _ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every call but the health service's carries `authorization: Bearer KEY`, as the HTTP routes."""

    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}"

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_OPEN_METHODS):
            return await continuation(handler_call_details)
        metadata_ = dict(handler_call_details.invocation_metadata or ())
        if metadata_.get("authorization") == self._expected:
            return await continuation(handler_call_details)
        return _refuse(await continuation(handler_call_details))


def _refuse(handler):
    """`handler`'s kind of method, answering UNAUTHENTICATED without running it."""
    message = "missing or invalid API key: send the metadata 'authorization: Bearer KEY'"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as the method is

    if handler is None:
        return None
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            streaming, handler.request_deserializer, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        unary, handler.request_deserializer, handler.response_serializer
    )


async def start_grpc_server(state: ServerState, host: str, port: int) -> grpc.aio.Server:
    """Serve the Generation service, health and reflection on host:port (started when this returns)."""
    pb, services = protos_and_services()
    interceptors = [_ApiKeyInterceptor(state.api_key)] if state.api_key else []
    server = grpc.aio.server(interceptors=interceptors)
    services.add_GenerationServicer_to_server(GenerationService(state, pb), server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"--grpc-port: cannot listen on {address}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("gRPC: %s, health and reflection on %s", SERVICE_NAME, address)
    return server

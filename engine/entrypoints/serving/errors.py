"""Every error as OpenAI's JSON: `{"error": {"message", "type", "param", "code"}}`, or, on Anthropic's
routes (/v1/messages...), as Anthropic's: `{"type": "error", "error": {"type", "message"}}`. Both APIs
raise the same `APIError`; the route's path picks the format, so shared code never asks which API
called it.

Schema violations and malformed JSON are 400 (not FastAPI's 422), with `param` naming the field as
the client sent it and a message of bounded length that never echoes the request body. Messages name
the fault, never internals (exception text, process ids, class names): anything unexpected is logged
with its details and answered with a generic 500 (see `internal_error`).
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from xlaserve.entrypoints.serving.chat_protocol import UNION_TAGS
from xlaserve.entrypoints.serving.protocol import UNSUPPORTED_FIELDS, ErrorInfo, ErrorResponse

MAX_MESSAGE_CHARS = 400
_MAX_ERRORS_LISTED = 3
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}
# pydantic's type errors, worded as OpenAI words them: "expected an integer, but got a string".
_EXPECTED_TYPES = {
    "int_type": "an integer",
    "bool_type": "a boolean",
    "string_type": "a string",
    "float_type": "a number",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
# Anthropic's error types by status (its API answers overload with 529; this server says 503).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"
# Sent by Anthropic's SDKs on every request, never by OpenAI's: the shared model routes answer (and
# fail) in Anthropic's shape when it is there (app.py).
ANTHROPIC_VERSION_HEADER = "anthropic-version"
_MODELS_PREFIX = "/v1/models"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


class APIError(Exception):
    """An error the server answers with; raise it anywhere inside a route."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = _bound(message)
        self.param = param
        self.code = code

    def to_response(self) -> ErrorResponse:
        kind = _TYPES.get(self.status_code, "invalid_request_error")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        )

    def to_anthropic(self) -> dict:
        """Anthropic's shape: no param or code, so a field is named in the message only."""
        kind = _ANTHROPIC_TYPES.get(self.status_code, "api_error" if self.status_code >= 500 else None)
        return {"type": "error", "error": {"type": kind or "invalid_request_error", "message": self.message}}

    def to_json_response(self, path: str = "", request_headers=None) -> JSONResponse:
        """The response in the format of the API `path` (asked with `request_headers`) belongs to."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status_code == 401 else None
        anthropic = is_anthropic(path, request_headers)
        body = self.to_anthropic() if anthropic else self.to_response().model_dump()
        return JSONResponse(body, status_code=self.status_code, headers=headers)


def is_anthropic(path: str, request_headers=None) -> bool:
    """Anthropic's routes, and the model routes asked by Anthropic's SDK."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return True
    is_models = path == _MODELS_PREFIX or path.startswith(_MODELS_PREFIX + "/")
    return is_models and request_headers is not None and ANTHROPIC_VERSION_HEADER in request_headers


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def param_of_value_error(error: ValueError, fields: set[str], default: str | None = None) -> str | None:
    """The field a SamplingParams-style ValueError names ("top_p must be in (0, 1]" -> "top_p")."""
    explicit = getattr(error, "param", None)
    if explicit:
        return explicit
    match = _IDENTIFIER.match(str(error))
    if match and match.group(0) in fields:
        return match.group(0)
    return default


def internal_error() -> APIError:
    """The answer to a failure that is the server's fault; the caller logs what happened."""
    return APIError(500, "internal server error (the server log has the details)", code="internal_error")


def _bound(message: str) -> str:
    # A lone surrogate from the request (a model name, a key) would make the JSON encoder fail.
    message = str(message).encode("utf-8", "backslashreplace").decode("utf-8")
    message = " ".join(message.split())
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return message


def loc_to_param(loc: tuple, union_tags: frozenset[str] = UNION_TAGS) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content" (union branch names dropped).

    `union_tags`: the discriminated unions' tags of the models validated (each API's protocol lists
    its own); the default knows the shared chat request's."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if item in union_tags:
            continue  # the body model a discriminated union picked: not a field the client sent
        if isinstance(item, int):
            if not parts:
                break
            parts[-1] += f"[{item}]"
            continue
        item = str(item)
        if not _IDENTIFIER.fullmatch(item) or item in _TYPE_NAMES:
            break  # a union branch ("list[int]", "str", "function-after[...]"): the field is named already
        parts.append(item)
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError, union_tags: frozenset[str] = UNION_TAGS) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {reason}".rstrip(": "), code="invalid_json")
    # A union lists every branch's error; invalid Unicode is the fault to name whichever branch found it.
    unicode = next((e for e in errors if e.get("type") == "string_unicode"), None)
    if unicode is not None:
        param = loc_to_param(tuple(unicode.get("loc", ())), union_tags)
        return bad_request(
            f"'{param or 'body'}' is not valid Unicode: it holds a lone surrogate or bytes not in UTF-8",
            param,
            code="invalid_unicode",
        )
    param = loc_to_param(tuple(first.get("loc", ())), union_tags)
    if first.get("type") == "extra_forbidden" and param is not None:
        field = param.split(".")[-1]
        if field in UNSUPPORTED_FIELDS:
            return bad_request(
                f"'{field}' is not supported by this server yet", param, code="unsupported_field"
            )
        return bad_request(f"Unrecognized request argument supplied: {param}", param, code="unknown_field")
    if first.get("type") == "missing" and param is not None:
        return bad_request(f"'{param}' is a required property", param, code="missing_field")
    if param is None and first.get("type") == "missing":
        return bad_request("the request body is empty: send a JSON object", code="invalid_body")
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return bad_request("the request body must be a JSON object", code="invalid_body")
    if len(errors) == 1 and param is not None and first.get("type") in _EXPECTED_TYPES:
        return bad_request(
            f"Invalid type for '{param}': expected {_EXPECTED_TYPES[first['type']]}, "
            f"but got {_json_type(first.get('input'))} instead.",
            param,
            code="invalid_type",
        )
    seen, messages = set(), []
    for error in errors:
        error_param = loc_to_param(tuple(error.get("loc", ())), union_tags) or "body"
        text = f"{error_param}: {error.get('msg', 'invalid value')}"
        if text not in seen:
            seen.add(text)
            messages.append(text)
    more = f" (and {len(messages) - _MAX_ERRORS_LISTED} more)" if len(messages) > _MAX_ERRORS_LISTED else ""
    return bad_request("; ".join(messages[:_MAX_ERRORS_LISTED]) + more, param)


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def install_error_handlers(app: FastAPI, union_tags: frozenset[str] = UNION_TAGS) -> None:
    """APIError, validation errors and Starlette's HTTP errors answered in the route's format;
    `union_tags`: every union tag of the app's request models (see loc_to_param)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.to_json_response(request.url.path, request.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return validation_error(exc, union_tags).to_json_response(request.url.path, request.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.url.path!r}" if len(request.url.path) < 200 else "no such route"
        return APIError(exc.status_code, message).to_json_response(request.url.path, request.headers)

    # No handler for Exception: Starlette runs it outermost and then re-raises, which makes uvicorn
    # drop the keep-alive connection. GuardMiddleware answers unexpected errors instead.

"""What a content block's stream is made of, and the stop reason of a finished message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xlaserve.entrypoints.anthropic.protocol import StopReason
from xlaserve.outputs import CompletionOutput


@dataclass
class Piece:
    """A run of one block's content. A tool_use piece with an `id` starts a call (its `text` the first
    part of the input's JSON, maybe empty); one without continues the current call's JSON. An
    mcp_tool_use piece is a tool_use piece of an MCP server's tool (`server_name`), made by this server."""

    kind: Literal["text", "thinking", "tool_use", "mcp_tool_use"]
    text: str = ""
    id: str | None = None
    name: str | None = None
    server_name: str | None = None


# A pre-warming request's (max_tokens 0) stop: the limit, reached before any content.
PREWARMED: tuple[StopReason, None] = ("max_tokens", None)


def stop_reason(completion: CompletionOutput, has_tool_use: bool) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence): a length cut is max_tokens even mid-call (the client should not
    run a cut call); a matched stop string is stop_sequence; a finished call is tool_use; anything else
    (EOS, a stop token) ended the turn."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    if has_tool_use:
        return "tool_use", None
    return "end_turn", None

"""The model's text as Anthropic content: text, thinking and tool_use pieces, read whole (a response)
or delta by delta (a stream), and the stop reason."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Literal

from xlaserve.entrypoints.anthropic.protocol import (
    ResponseBlock,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from xlaserve.outputs import CompletionOutput


@dataclass
class Piece:
    """A run of one block's content. A tool_use piece with an `id` starts a call (its `text` the first
    part of the input's JSON, maybe empty); one without continues the current call's JSON."""

    kind: Literal["text", "thinking", "tool_use"]
    text: str = ""
    id: str | None = None
    name: str | None = None


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class TextReader:
    """Everything the model says is text."""

    def feed(self, delta: str) -> list[Piece]:
        return [Piece("text", delta)] if delta else []

    def flush(self) -> list[Piece]:
        return []


def blocks_of(pieces: list[Piece]) -> list[ResponseBlock]:
    """Pieces joined into the blocks a response carries (a tool's JSON parsed into its input)."""
    blocks: list[ResponseBlock] = []
    arguments: list[str] = []
    for piece in pieces:
        last = blocks[-1] if blocks else None
        if piece.kind == "tool_use":
            if piece.id is not None:
                _close(blocks, arguments)
                blocks.append(ToolUseBlock(id=piece.id, name=piece.name or "", input={}))
                arguments = [piece.text]
            else:
                arguments.append(piece.text)
        elif piece.kind == "text" and isinstance(last, TextBlock):
            last.text += piece.text
        elif piece.kind == "thinking" and isinstance(last, ThinkingBlock):
            last.thinking += piece.text
        else:
            _close(blocks, arguments)
            arguments = []
            blocks.append(
                TextBlock(text=piece.text) if piece.kind == "text" else ThinkingBlock(thinking=piece.text)
            )
    _close(blocks, arguments)
    return blocks


def _close(blocks: list[ResponseBlock], arguments: list[str]) -> None:
    if blocks and isinstance(blocks[-1], ToolUseBlock) and arguments:
        text = "".join(arguments)
        blocks[-1].input = json.loads(text) if text.strip() else {}


def stop_reason(completion: CompletionOutput, has_tool_use: bool) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence): a length cut is max_tokens even mid-call; a matched stop string
    is stop_sequence; a finished call is tool_use; anything else ended the turn."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    if has_tool_use:
        return "tool_use", None
    return "end_turn", None

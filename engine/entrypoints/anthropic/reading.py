"""A chat choice's parse (the chat path's ChoiceParser: the reasoning parser, then the tool parser on
the answer) as Anthropic content: thinking, text and tool_use blocks whole, or pieces of them as the
stream goes.

With a forced tool_choice (any, or a named tool) the parser is forced (serving/chat_path.py): the content
is the thinking and tool_use blocks only, the calls as the stream's own pieces put together, and each
call's input read from its JSON as Anthropic's SDK reads a stream (the partial parse of a cut call), so a
stream and a message always agree."""

from __future__ import annotations

import json
import logging

from pydantic_core import from_json

from xlaserve.entrypoints.anthropic.output import Piece
from xlaserve.entrypoints.anthropic.protocol import ResponseBlock, TextBlock, ThinkingBlock, ToolUseBlock
from xlaserve.entrypoints.serving.chat_parsing import ChoiceDelta, ChoiceParser

logger = logging.getLogger("xlaserve.entrypoints.anthropic")


class ChoiceReader:
    def __init__(self, parser: ChoiceParser):
        self.parser = parser

    def blocks(self, text: str) -> list[ResponseBlock]:
        """The whole output as blocks: thinking, then text, then each call."""
        parsed = self.parser.parse(text)
        blocks: list[ResponseBlock] = []
        if parsed.reasoning:
            blocks.append(ThinkingBlock(thinking=parsed.reasoning))
        if self.parser.is_forced:
            calls = [
                ToolUseBlock(id=c.id, name=c.function.name, input=partial_object(c.function.arguments))
                for c in parsed.tool_calls
            ]
            return blocks + calls
        content = parsed.content or ""
        calls = []
        for call in parsed.tool_calls:
            arguments = _object(call.function.arguments)
            if arguments is None:  # not an object after all: the model's words, kept as text
                content += call.function.arguments
            else:
                calls.append(ToolUseBlock(id=call.id, name=call.function.name, input=arguments))
        if content:
            blocks.append(TextBlock(text=content))
        return blocks + calls

    def feed(self, delta: str) -> list[Piece]:
        return _pieces(self.parser.feed(delta)) if delta else []

    def flush(self) -> list[Piece]:
        return _pieces(self.parser.finish())


def partial_object(text: str) -> dict:
    """A call's input from its JSON text so far, as Anthropic's SDK reads a stream (the partial parse)."""
    if not text:
        return {}
    try:
        value = from_json(text, allow_partial=True)
    except ValueError:
        logger.warning("a forced tool call's arguments are not JSON; its input is left empty")
        return {}
    return value if isinstance(value, dict) else {}


def _object(arguments: str) -> dict | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        logger.warning("a parsed tool call's arguments are not JSON; returned as text")
        return None
    return value if isinstance(value, dict) else None


def _pieces(delta: ChoiceDelta) -> list[Piece]:
    pieces = []
    if delta.reasoning:
        pieces.append(Piece("thinking", delta.reasoning))
    if delta.content:
        pieces.append(Piece("text", delta.content))
    for call in delta.tool_calls:
        arguments = call.function.arguments or ""
        if call.id is not None:
            pieces.append(Piece("tool_use", arguments, id=call.id, name=call.function.name))
        elif arguments:
            pieces.append(Piece("tool_use", arguments))
    return pieces

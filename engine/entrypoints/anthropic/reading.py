"""Which reader turns a request's output into content: plain text, or (with tools and a reasoning
parser) tool_use and thinking pieces."""

from __future__ import annotations

from xlaserve.entrypoints.anthropic.output import TextReader
from xlaserve.entrypoints.anthropic.protocol import MessagesRequest
from xlaserve.entrypoints.openai.serving import ServerState


def make_reader(state: ServerState, req: MessagesRequest):
    reader = TextReader()
    reader.constraint = None
    return reader

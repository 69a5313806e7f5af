"""The tool-call shapes of chat responses and stream chunks (OpenAI's), apart from protocol.py so that
other front ends (the Anthropic API) can share them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from xlaserve.entrypoints.serving.protocol import OmitsNones


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCallOut(OmitsNones):
    name: str | None = None  # only in a call's first delta
    arguments: str | None = None

    omit_if_none = ("name", "arguments")


class DeltaToolCallOut(OmitsNones):
    """A piece of a streamed call: the first has its id, type and name, later ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCallOut

    omit_if_none = ("id", "type")

"""The tool-call shapes of chat responses and stream chunks (OpenAI's), apart from protocol.py so that
other front ends (the Anthropic API) can share them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, model_serializer


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


def without_nones(handler, model, keys) -> dict:
    """The model's dict without the `keys` whose value is None (OpenAI leaves absent fields out)."""
    data = handler(model)
    return {k: v for k, v in data.items() if v is not None or k not in keys}


class DeltaFunctionCallOut(BaseModel):
    name: str | None = None  # only in a call's first delta
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler):
        return without_nones(handler, self, ("name", "arguments"))


class DeltaToolCallOut(BaseModel):
    """A piece of a streamed call: the first has its id, type and name, later ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCallOut

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler):
        return without_nones(handler, self, ("id", "type"))

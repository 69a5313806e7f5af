"""GET /v1/models and /v1/models/{id} as Anthropic's SDK reads them (`client.models.list()`, `.retrieve()`):
the route is OpenAI's too (openai/routes.py), and app.py answers in this shape when the request carries
the `anthropic-version` header, which Anthropic's SDKs always send and OpenAI's never do. vLLM serves
OpenAI's shape only, which Anthropic's SDK refuses (no `type`, `display_name` or `created_at`)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel

from xlaserve.entrypoints.serving.state import ServerState, check_model


class ModelInfo(BaseModel):
    type: Literal["model"] = "model"
    id: str
    display_name: str
    created_at: str  # RFC 3339: when the server started
    lifecycle: Literal["active"] = "active"
    # One context holds the prompt and the answer: either may take all of it but the other's minimum.
    max_input_tokens: int
    max_tokens: int


class ModelsPage(BaseModel):
    """Every model in one page (a server serves a handful): has_more is false, paging fields ignored."""

    data: list[ModelInfo]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


def model_info(state: ServerState, model_id: str) -> ModelInfo:
    """A served name's (or a LoRA adapter's), 404 for any other name (Anthropic's error shape)."""
    return _info(state, check_model(state, model_id))


def _info(state: ServerState, name: str) -> ModelInfo:
    started = datetime.fromtimestamp(state.started_at, tz=timezone.utc).isoformat().replace("+00:00", "Z")
    max_model_len = state.engine.max_model_len
    return ModelInfo(
        id=name,
        display_name=name,
        created_at=started,
        max_input_tokens=max_model_len - 1,
        max_tokens=max_model_len - 1,
    )


def models_page(state: ServerState) -> ModelsPage:
    adapters = [] if state.loras is None else [lora.lora_name for lora in state.loras.all()]
    data = [_info(state, name) for name in [*state.served_model_names, *adapters]]
    return ModelsPage(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None)

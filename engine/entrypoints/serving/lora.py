"""LoRA adapters on the server (vLLM's interface): a request picks an adapter by its `model`;
`/v1/models` lists the adapters with the base model as `parent`; with runtime updating allowed
(XLASERVE_ALLOW_RUNTIME_LORA_UPDATING, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, set to 1 or true)
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` add and remove adapters by name.

Each loaded adapter gets a new `lora_int_id`, so an adapter unloaded and loaded again under the same
name never shares prefix-cache blocks or a host copy with its former self.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Annotated

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import Field

from xlaserve.entrypoints.serving.errors import APIError, bad_request
from xlaserve.entrypoints.serving.protocol import ErrorResponse, StrictModel, Text
from xlaserve.lora_request import LoRARequest
from xlaserve.models.lora_adapter import LoRAAdapterError, check_fits, read_adapter_config

logger = logging.getLogger("xlaserve.entrypoints.serving")

RUNTIME_UPDATING_VARS = ("XLASERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_VARS)


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: Annotated[Text, Field(min_length=1, max_length=256)]
    lora_path: Annotated[Text, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: Annotated[Text, Field(min_length=1, max_length=256)]
    lora_int_id: int | None = None


class LoRARegistry:
    """The adapters this server serves, by name."""

    def __init__(self, max_lora_rank: int, reserved_names: list[str]):
        self.max_lora_rank = max_lora_rank
        self.reserved_names = set(reserved_names)  # the base model's served names
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._slots = None  # (layout, layer_stacks) once the engine is up: see set_model

    def set_model(self, layout: dict | None, layer_stacks: dict | None) -> None:
        """The engine's adapter slots (EngineReady): from now on an adapter whose modules or layers the
        model lacks is refused when it loads; the adapters already registered are checked now."""
        if layout is None or layer_stacks is None:
            return
        self._slots = (
            {s: {m: tuple(shape) for m, shape in ms.items()} for s, ms in layout.items()},
            {s: tuple(layers) for s, layers in layer_stacks.items()},
        )
        for lora in self._by_name.values():
            check_fits(read_adapter_config(lora.lora_name, lora.lora_path, self.max_lora_rank), *self._slots)

    def __contains__(self, name: str | None) -> bool:
        return name in self._by_name

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name)

    def all(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Validate the adapter (LoRAAdapterError naming the field) and serve it under `name`."""
        if name in self.reserved_names:
            raise LoRAAdapterError(f"lora_name: {name!r} is the base model's name", "lora_name")
        if name in self._by_name:
            raise LoRAAdapterError(
                f"lora_name: the LoRA adapter {name!r} has already been loaded", "lora_name"
            )
        config = read_adapter_config(name, path, self.max_lora_rank)
        if self._slots is not None:
            check_fits(config, *self._slots)
        lora = LoRARequest(name, next(self._ids), os.path.abspath(path), base_model_name)
        self._by_name[name] = lora
        logger.info("LoRA adapter %r from %s (id %d)", name, lora.lora_path, lora.lora_int_id)
        return lora

    def remove(self, name: str) -> LoRARequest | None:
        return self._by_name.pop(name, None)


# 200: vLLM's plain-text "Success: ..." line; errors stay OpenAI's JSON.
_TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}


def _errors(*codes: int) -> dict:
    return {code: {"model": ErrorResponse} for code in codes}


def add_lora_routes(app: FastAPI, registry: LoRARegistry | None) -> None:
    """The load and unload endpoints, only when runtime updating is allowed (else they are 404s)."""
    if not runtime_updating_allowed():
        return

    def require_lora() -> LoRARegistry:
        if registry is None:
            raise bad_request("LoRA is not enabled on this server (start it with --enable-lora)", "lora_name")
        return registry

    @app.post(
        "/v1/load_lora_adapter", response_model=None, responses={**_TEXT, **_errors(400, 401, 413, 415)}
    )
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            require_lora().add(request.lora_name, request.lora_path)
        except LoRAAdapterError as e:
            raise bad_request(str(e), "lora_name" if e.field == "lora_name" else "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post(
        "/v1/unload_lora_adapter",
        response_model=None,
        responses={**_TEXT, **_errors(400, 401, 404, 413, 415)},
    )
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        loras = require_lora()
        lora = loras.get(request.lora_name)
        if lora is None or (request.lora_int_id is not None and request.lora_int_id != lora.lora_int_id):
            raise APIError(
                404,
                f"The LoRA adapter '{request.lora_name}' cannot be found",
                param="lora_name",
                code="model_not_found",
            )
        loras.remove(request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

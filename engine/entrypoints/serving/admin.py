"""The research stack's admin routes (vLLM's development endpoints, sglang's weight update), off unless
the server was started with `--enable-admin-api`, which needs `--api-key`: a caller that can swap the
weights or put the engine to sleep must hold the key.

- `POST /update_weights_from_disk` `{"model_path": DIR}`: the checkpoint at DIR (same architecture and
  shapes) replaces the weights, without a restart or a recompile; the prefix cache is reset.
- `POST /sleep?level=1|2&mode=abort|wait|keep`: the KV cache's device memory is freed (level 2: the
  weights' too, kept on the host); requests meanwhile get a 400 saying the engine is asleep. The
  requests in flight go by `mode`, vLLM's: abort (the default) ends them with finish_reason "abort";
  wait lets them finish first; keep holds them, to recompute after wake-up. `POST /wake_up` restores it.
  `GET /is_sleeping`.
- `POST /reset_prefix_cache?reset_running_requests=true|false`: `{"success": bool}`, vLLM's; with
  reset_running_requests (RL clients send it after a weight update) the running requests are
  preempted and recompute their K/V.

A caller's error (no such directory, another architecture, already asleep) is a 400 in the OpenAI
error format naming what is wrong.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Query
from pydantic import Field

from xlaserve.engine.protocol import SleepMode
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.protocol import ErrorResponse, StrictModel, Text
from xlaserve.entrypoints.serving.state import ServerState

_ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}}


class UpdateWeightsFromDiskRequest(StrictModel):
    model_path: Annotated[Text, Field(min_length=1, max_length=4096)]


def add_profiler_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's POST /start_profile and /stop_profile, mounted when the engine has a profiler_dir
    (--profiler-dir, XLASERVE_PROFILER_DIR): a jax.profiler trace of the engine core's process."""
    engine = state.engine

    @app.post("/start_profile", responses=_ERRORS)
    async def start_profile() -> dict:
        try:
            await engine.start_profile()
        except ValueError as e:
            raise bad_request(str(e)) from e
        return {"profiling": True}

    @app.post("/stop_profile", responses=_ERRORS)
    async def stop_profile() -> dict:
        try:
            folder = await engine.stop_profile()
        except ValueError as e:
            raise bad_request(str(e)) from e
        return {"profiling": False, "profiler_dir": folder}


def add_admin_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    async def call(method, *args):
        try:
            return await method(*args)
        except ValueError as e:
            raise bad_request(str(e)) from e

    @app.post("/update_weights_from_disk", responses=_ERRORS)
    async def update_weights_from_disk(request: UpdateWeightsFromDiskRequest) -> dict:
        names = await call(engine.update_weights_from_path, request.model_path)
        return {"success": True, "message": f"updated {len(names)} weights", "num_weights": len(names)}

    @app.post("/sleep", responses=_ERRORS)
    async def sleep(level: Annotated[int, Query(ge=1, le=2)] = 1, mode: SleepMode = "abort") -> dict:
        report = await call(engine.sleep, level, mode)
        return {"level": level, "freed_bytes": report["device_bytes"], "seconds": report["seconds"]}

    @app.post("/wake_up", responses=_ERRORS)
    async def wake_up() -> dict:
        report = await call(engine.wake_up)
        return {"placed_bytes": report["device_bytes"], "seconds": report["seconds"]}

    @app.get("/is_sleeping", responses=_ERRORS)
    async def is_sleeping() -> dict:
        return {"is_sleeping": await engine.is_sleeping()}

    @app.post("/reset_prefix_cache", responses=_ERRORS)
    async def reset_prefix_cache(reset_running_requests: bool = False) -> dict:
        return {"success": await engine.reset_prefix_cache(reset_running_requests)}

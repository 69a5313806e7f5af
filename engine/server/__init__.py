"""The OpenAI-compatible HTTP server (`xlaserve serve`): FastAPI routes over `AsyncLLM`."""

from engine.server.app import build_app
from engine.server.serving import ServerState

__all__ = ["ServerState", "build_app"]

"""The OpenAI-compatible HTTP server (`xlaserve serve`): FastAPI routes over `AsyncLLM`."""

from xlaserve.entrypoints.openai.app import build_app
from xlaserve.entrypoints.openai.serving import ServerState

__all__ = ["ServerState", "build_app"]

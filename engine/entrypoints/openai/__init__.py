"""The OpenAI-compatible HTTP server (`xlaserve serve`): FastAPI routes (app.py) over `AsyncLLM`.

Nothing is imported here: the CLI imports `api_server` for its flags, and must not pay for FastAPI
until a server starts."""

"""What the HTTP server's two APIs share (OpenAI's in openai/, Anthropic's in anthropic/): the server's
state, the request model both build (protocol.py), errors in either API's format, the chat template,
tool planning and the tool-call and reasoning parsers, the request guard, metrics and LoRA adapters.

It imports neither API package, and neither imports the other (tests/layout/test_layers.py): the
server's app (entrypoints/app.py) is the one place both are mounted. Nothing is imported here: the
CLI reaches the parsers' registries without paying for FastAPI."""

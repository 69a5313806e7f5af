"""OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize): its wire
shapes and routes over the shared serving code (serving/). Mounted by the server's app
(entrypoints/app.py); it imports nothing from anthropic/.

Nothing is imported here: the package's modules import FastAPI, which the CLI must not pay for until
a server starts."""

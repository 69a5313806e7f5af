"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): its wire shapes, converted into
the shared chat request (serving/) and back. Mounted by the server's app (entrypoints/app.py); it
imports nothing from openai/."""

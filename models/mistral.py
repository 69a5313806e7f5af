"""Mistral (7B v0.1-v0.3, Nemo, Small): the Llama layer; v0.1 limits every layer to a sliding window.

The window comes from the config (`sliding_window`, every layer); the paged cache keeps all keys,
and the attention op masks those older than the window.
"""

from __future__ import annotations

from xlaserve.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass

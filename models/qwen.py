"""Qwen2 / Qwen2.5 and Qwen3 (dense): the Llama layer with Qwen's attention changes.

Qwen2: biases on the q/k/v projections (none on o_proj). Qwen3: no biases, an RMSNorm over each
head of q and k before RoPE. Both may slide a window on the layers from `max_window_layers` on
(`use_sliding_window`). All of it is read from the config by the shared `Attention`.
"""

from __future__ import annotations

from xlaserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass

"""KV heads for tensor parallelism wider than the model's KV heads, as vLLM does it.

With tensor_parallel_size = r * num_kv_heads, every rank needs the one KV head its query heads
read. Each KV head's projection is repeated r times, so the model (and its KV cache) has
tensor_parallel_size KV heads and shards evenly: no rank ever gathers another's cache.
"""

from __future__ import annotations

import re

import numpy as np

_KV_PROJ = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")


def replicate_kv_heads(model_config, tensors: dict[str, np.ndarray], tensor_parallel_size: int):
    """-> (model_config, tensors) with KV heads repeated up to tensor_parallel_size if needed."""
    num_kv = model_config.num_kv_heads
    if tensor_parallel_size <= num_kv:
        return model_config, tensors
    repeat = tensor_parallel_size // num_kv
    head_dim = model_config.head_dim
    out = dict(tensors)
    for name, array in tensors.items():
        if _KV_PROJ.search(name):
            # HF layout [num_kv * head_dim, ...]: repeat whole heads, keeping each copy adjacent so
            # query head h still reads KV head h // (num_heads / num_kv_heads).
            heads = array.reshape(num_kv, head_dim, *array.shape[1:])
            out[name] = np.repeat(heads, repeat, axis=0).reshape(num_kv * repeat * head_dim, *array.shape[1:])
    return model_config.replace(num_kv_heads=num_kv * repeat), out

"""KV heads for tensor parallelism wider than the model's KV heads, as vLLM does it.

With tensor_parallel_size = r * num_kv_heads, every rank needs the one KV head its query heads
read. Each KV head's projection is repeated r times, so the model (and its KV cache) has
tensor_parallel_size KV heads and shards evenly: no rank ever gathers another's cache.
"""

from __future__ import annotations

import re

import numpy as np

_KV_PROJ = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")


def _is_kv_projection(name) -> bool:
    if isinstance(name, tuple):  # a converted checkpoint's parameter path
        return name[-2:] in {
            ("k_proj", "kernel"),
            ("k_proj", "bias"),
            ("v_proj", "kernel"),
            ("v_proj", "bias"),
        }
    return _KV_PROJ.search(name) is not None


def _repeat_heads(array: np.ndarray, axis: int, num_kv: int, repeat: int) -> np.ndarray:
    """Repeat each of the `num_kv` head blocks along `axis` `repeat` times, copies adjacent, so
    query head h still reads KV head h // (num_heads / num_kv_heads)."""
    array = np.moveaxis(array, axis, 0)
    heads = array.reshape(num_kv, -1, *array.shape[1:])
    repeated = np.repeat(heads, repeat, axis=0).reshape(-1, *array.shape[1:])
    return np.moveaxis(repeated, 0, axis)


def replicate_kv_heads(model_config, tensors, tensor_parallel_size: int):
    """-> (model_config, tensors) with KV heads repeated up to tensor_parallel_size if needed.

    `tensors`: HF names -> HF layout (the heads on axis 0 of [kv_heads * head_dim, ...]), a converted
    checkpoint's paths -> our layout (the heads on the last axis), or `DummyWeights` (drawn later in
    the widened shapes)."""
    num_kv = model_config.num_kv_heads
    if tensor_parallel_size <= num_kv:
        return model_config, tensors
    repeat = tensor_parallel_size // num_kv
    model_config = model_config.replace(num_kv_heads=num_kv * repeat)
    if not isinstance(tensors, dict):
        return model_config, tensors
    out = type(tensors)(tensors)
    for name, array in tensors.items():
        if _is_kv_projection(name):
            out[name] = _repeat_heads(np.asarray(array), -1 if isinstance(name, tuple) else 0, num_kv, repeat)
    return model_config, out

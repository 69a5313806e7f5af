"""KV heads for tensor parallelism wider than the model's KV heads, as vLLM does it.

With tensor_parallel_size = r * num_kv_heads, every rank needs the one KV head its query heads
read. Each KV head's projection is repeated r times, so the model (and its KV cache) has
tensor_parallel_size KV heads and shards evenly: no rank ever gathers another's cache. A k_norm over
all KV heads at once (OLMo, MiniMax-M2: num_kv_heads * head_dim weights) has its heads' weights
repeated with them; its mean over r equal copies of each head is the mean over the heads, so the
norm is unchanged.
"""

from __future__ import annotations

import re

import numpy as np

from xlaserve.sharding.vocab import lazily

_KV_PROJ = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
_FUSED_QKV = re.compile(r"\.qkv_proj\.(weight|bias)$")  # Phi-3: HF rows q, then k, then v
_K_NORM = re.compile(r"\.k_norm\.weight$")


def _is_kv_projection(name) -> bool:
    if isinstance(name, tuple):  # a converted checkpoint's parameter path
        return name[-2:] in {
            ("k_proj", "kernel"),
            ("k_proj", "bias"),
            ("v_proj", "kernel"),
            ("v_proj", "bias"),
        }
    return _KV_PROJ.search(name) is not None


def is_whole_k_norm(name, model_config) -> bool:
    """k_norm over every KV head at once (not Qwen3's per-head one, `qk_norm`)."""
    if model_config.qk_norm:
        return False
    if isinstance(name, tuple):
        return name[-2:] == ("k_norm", "weight")
    return _K_NORM.search(name) is not None


def _is_fused_qkv(name) -> bool:
    if isinstance(name, tuple):
        return name[-2:] in {("qkv_proj", "kernel"), ("qkv_proj", "bias")}
    return _FUSED_QKV.search(name) is not None


def _repeat_heads(array: np.ndarray, axis: int, num_kv: int, repeat: int) -> np.ndarray:
    """Repeat each of the `num_kv` head blocks along `axis` `repeat` times, copies adjacent, so
    query head h still reads KV head h // (num_heads / num_kv_heads)."""
    array = np.moveaxis(array, axis, 0)
    heads = array.reshape(num_kv, -1, *array.shape[1:])
    repeated = np.repeat(heads, repeat, axis=0).reshape(-1, *array.shape[1:])
    return np.moveaxis(repeated, 0, axis)


def _repeat_fused_hf(array: np.ndarray, num_heads: int, num_kv: int, repeat: int) -> np.ndarray:
    """HF's fused qkv_proj ([(H + 2 K) * head_dim, ...]: q rows, k rows, v rows) with its k and v
    heads repeated."""
    q_rows = array.shape[0] * num_heads // (num_heads + 2 * num_kv)
    q, k, v = np.split(array, [q_rows, q_rows + (array.shape[0] - q_rows) // 2])
    return np.concatenate([q, _repeat_heads(k, 0, num_kv, repeat), _repeat_heads(v, 0, num_kv, repeat)])


def _repeat_fused_grouped(array: np.ndarray, num_heads: int, num_kv: int, repeat: int) -> np.ndarray:
    """Our fused qkv_proj (last axis: per KV head, its G query heads then k then v; see models/phi3.py)
    regrouped for num_kv * repeat KV heads: each group's query heads split in `repeat` groups, each
    with a copy of the group's k and v."""
    group = num_heads // num_kv
    lead = array.shape[:-1]
    grouped = array.reshape(*lead, num_kv, group + 2, -1)  # [..., K, G + 2, head_dim]
    head_dim = grouped.shape[-1]
    q = grouped[..., :group, :].reshape(*lead, num_kv, repeat, group // repeat, head_dim)
    kv = np.broadcast_to(grouped[..., None, group:, :], (*lead, num_kv, repeat, 2, head_dim))
    return np.concatenate([q, kv], axis=-2).reshape(*lead, -1)


def checkpoint_heads_size(name, size: int, model_config, num_kv_heads: int) -> int:
    """The inverse of `replicate_kv_heads` for one tensor's heads axis: `size` as the model holds it
    (model_config's KV heads, repeated) -> as a checkpoint of `num_kv_heads` holds it, for checking an
    update's shapes against the model's (worker/weight_update.py). Other tensors: `size` itself."""
    num_wide = model_config.num_kv_heads
    if num_wide == num_kv_heads:
        return size
    if _is_kv_projection(name) or is_whole_k_norm(name, model_config):
        return size // num_wide * num_kv_heads
    if _is_fused_qkv(name):  # q's rows as they are, k's and v's repeated
        return size - 2 * (num_wide - num_kv_heads) * model_config.head_dim
    return size


def replicate_kv_heads(model_config, tensors, tensor_parallel_size: int):
    """-> (model_config, tensors) with KV heads repeated up to tensor_parallel_size if needed.

    `tensors`: HF names -> HF layout (the heads on axis 0 of [kv_heads * head_dim, ...]), a converted
    checkpoint's paths -> our layout (the heads on the last axis), or `DummyWeights` (drawn later in
    the widened shapes). Fused qkv projections (Phi-3) have their k and v parts repeated."""
    num_kv, num_heads = model_config.num_kv_heads, model_config.num_heads
    if tensor_parallel_size <= num_kv:
        return model_config, tensors
    repeat = tensor_parallel_size // num_kv
    model_config = model_config.replace(num_kv_heads=num_kv * repeat)
    if not isinstance(tensors, dict):
        return model_config, tensors
    out = type(tensors)(tensors)
    for name, array in tensors.items():
        if isinstance(name, tuple):  # a converted checkpoint's, in memory
            if _is_kv_projection(name) or is_whole_k_norm(name, model_config):
                out[name] = _repeat_heads(np.asarray(array), -1, num_kv, repeat)
            elif _is_fused_qkv(name):
                out[name] = _repeat_fused_grouped(np.asarray(array), num_heads, num_kv, repeat)
            continue
        # HF layout: the heads' rows on axis 0, repeated when the tensor is read.
        rows, *rest = np.shape(array)
        if _is_kv_projection(name) or is_whole_k_norm(name, model_config):
            shape = (rows * repeat, *rest)
            out[name] = lazily(array, lambda a: _repeat_heads(a, 0, num_kv, repeat), shape)
        elif _is_fused_qkv(name):
            q_rows = rows * num_heads // (num_heads + 2 * num_kv)
            shape = (q_rows + (rows - q_rows) * repeat, *rest)
            out[name] = lazily(array, lambda a: _repeat_fused_hf(a, num_heads, num_kv, repeat), shape)
    return model_config, out

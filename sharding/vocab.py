"""Vocabulary padding for the vocabulary-parallel embedding and LM head, as vLLM pads.

Tensor parallelism splits the embedding's rows and the LM head's columns over the "tensor" axis, so
the vocabulary must split evenly; fine-tunes with added tokens often have 32001 or 32002. Under
TP the vocabulary is rounded up to a multiple of lcm(64, tp): vLLM's padding of 64
(DEFAULT_VOCAB_PADDING_SIZE, so vocabularies pad to the same size as there) made divisible by tp.
The padding rows are zeros; their ids never reach the model (the input processor checks prompt
ids against the real vocabulary) and their logits are masked to -inf before sampling and logprobs
(`mask_padded_vocab`). One device splits nothing, so there the vocabulary stays as it is and the
logits keep their real width.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

# Where the vocabulary lies in each tensor that has one: HF names ([V, D] both), and our paths.
# Mamba2's checkpoints name the embedding backbone.embeddings (renamed after padding: models/mamba2.py),
# LLaVA's its decoder's model.language_model.* (transformers 5) or language_model.* (4).
_HF_VOCAB_AXIS = {
    "model.embed_tokens.weight": 0,
    "backbone.embeddings.weight": 0,
    "lm_head.weight": 0,
    "model.language_model.embed_tokens.weight": 0,
    "language_model.model.embed_tokens.weight": 0,
    "language_model.lm_head.weight": 0,
}
_OUR_VOCAB_AXIS = {("embed_tokens", "weight"): 0, ("lm_head", "kernel"): 1}


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int) -> int:
    """The number of embedding rows and logits: `vocab_size` itself on one device, else rounded up
    to a multiple of lcm(64, tensor_parallel_size)."""
    if tensor_parallel_size == 1:
        return vocab_size
    multiple = math.lcm(VOCAB_PADDING, tensor_parallel_size)
    return -(-vocab_size // multiple) * multiple


def pad_vocab(tensors, vocab_size: int, padded_size: int):
    """`tensors` with zero rows appended to the embedding and the LM head up to `padded_size`.

    `tensors`: HF names -> HF layout, a converted checkpoint's paths -> our layout (`lm_head` kernel
    [D, V]), or `DummyWeights` (drawn later in the padded shapes: returned as they are)."""
    if padded_size == vocab_size or not isinstance(tensors, dict):
        return tensors
    out = type(tensors)(tensors)
    for name, array in tensors.items():
        axis = _OUR_VOCAB_AXIS.get(name) if isinstance(name, tuple) else _HF_VOCAB_AXIS.get(name)
        if axis is None:
            continue
        if hasattr(array, "q"):  # a GGUF table kept quantized (models/quantization.py): rows of each part
            zero = None if array.zero is None else _pad(array.zero, axis, padded_size - vocab_size)
            pads = [_pad(a, axis, padded_size - vocab_size) for a in (array.q, array.scale)]
            out[name] = dataclasses.replace(array, q=pads[0], scale=pads[1], zero=zero)
            continue
        shape = list(np.shape(array))
        if shape[axis] != vocab_size:
            raise ValueError(
                f"tensor {name} has {shape[axis]} vocabulary entries; the config says {vocab_size}"
            )
        shape[axis] = padded_size
        out[name] = lazily(array, lambda a, axis=axis: _pad(a, axis, padded_size - vocab_size), tuple(shape))
    return out


def checkpoint_vocab_rows(name: str, rows: int, vocab_size: int, padded_size: int) -> int:
    """The inverse of `pad_vocab` for Hugging Face tensor `name`'s axis 0: `rows` as the model holds
    them (padded to `padded_size`) -> as the checkpoint holds them (`vocab_size`). Other tensors:
    `rows` itself."""
    if padded_size == vocab_size or name not in _HF_VOCAB_AXIS:
        return rows
    return rows - (padded_size - vocab_size)


def lazily(array, compute, shape: tuple[int, ...]):
    """`compute(array)` (of `shape`): now, or for a checkpoint's tensor when it is read (its `derived`,
    models/safetensors_loader.py), so a load still reads one parameter's tensors at a time: the
    vocabulary's padding here, KV heads' repetition (sharding/kv_heads.py)."""
    derived = getattr(array, "derived", None)
    return compute(np.asarray(array)) if derived is None else derived(compute, shape)


def _pad(array: np.ndarray, axis: int, extra: int) -> np.ndarray:
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, extra)
    return np.pad(array, widths)


def mask_padded_vocab(logits: jax.Array, vocab_size: int) -> jax.Array:
    """[N, V_padded] -> the same with the padding ids' logits at -inf, so that no sampler, top-k or
    logprob ever sees them. An elementwise select against a static bound: the shape stays static
    and the logits keep their vocabulary-sharded layout (slicing to the real width would leave a
    width that no longer splits evenly, and a reshard). A no-op when nothing is padded."""
    if logits.shape[-1] == vocab_size:
        return logits
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(ids < vocab_size, logits, -jnp.inf)

"""Hugging Face tensors -> the parameter pytree of an NNX model.

Our modules name parameters as Hugging Face does, so the mapping is mechanical: a path
``layers/self_attn/q_proj/kernel`` reads ``model.layers.{i}.self_attn.q_proj.weight`` for every layer
i, transposed ([out, in] -> [in, out]) and stacked on a leading layer axis.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from models.config import TransformerConfig

# Tensors a checkpoint may carry that no module reads.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name(path: tuple[str, ...], layer: int | None) -> str:
    """The Hugging Face tensor name of one of our parameter paths (a layer's, when `layer` is set)."""
    *module, leaf = path
    leaf = "weight" if leaf == "kernel" else leaf
    if module[0] == "lm_head":
        return ".".join([*module, leaf])
    if layer is not None:
        module = [module[0], str(layer), *module[1:]]
    return ".".join(["model", *module, leaf])


def _flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, (*prefix, str(key))))
        else:
            flat[(*prefix, str(key))] = value
    return flat


def _unflatten(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def load_params(
    model_class: type,
    cfg: TransformerConfig,
    tensors: dict[str, np.ndarray],
    *,
    dtype: jnp.dtype,
    make_model: Callable[[], nnx.Module],
    place: Callable[[tuple[str, ...], np.ndarray], jax.Array] | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Build `make_model()` abstractly, then fill every parameter from `tensors`.

    Missing or unexpected tensors are an error naming them. `place` puts one host array on its
    device(s) (the sharding layer passes one); by default `jax.device_put`.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
    expected = _flatten(nnx.to_pure_dict(abstract))
    place = place or (lambda path, array: jax.device_put(array))
    used: set[str] = set()
    missing: list[str] = []
    flat: dict[tuple[str, ...], jax.Array] = {}
    for path, spec in tqdm(expected.items(), desc="Placing weights", unit="tensor", leave=False):
        is_stacked = path[0] == "layers"
        names = [hf_name(path, i) for i in range(cfg.num_layers)] if is_stacked else [hf_name(path, None)]
        absent = [n for n in names if n not in tensors]
        if absent:
            missing.extend(absent)
            continue
        used.update(names)
        arrays = [tensors[n].T if path[-1] == "kernel" else tensors[n] for n in names]
        array = np.stack(arrays) if is_stacked else arrays[0]
        if array.shape != spec.shape:
            raise ValueError(f"tensor {names[0]} has shape {array.shape}, the model expects {spec.shape}")
        flat[path] = place(path, np.asarray(array, dtype=dtype))
    unexpected = sorted(
        n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES) and not _is_tied_head(n, cfg)
    )
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {model_class.__name__}: "
            f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}; "
            f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    abstract.replace_by_pure_dict(_unflatten(flat))
    return graphdef, abstract


def _is_tied_head(name: str, cfg: TransformerConfig) -> bool:
    return cfg.tie_word_embeddings and name == "lm_head.weight"

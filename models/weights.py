"""Hugging Face tensors -> the parameter pytree of an NNX model.

Our modules name parameters as Hugging Face does, so the mapping is mechanical: a path
``layers/self_attn/q_proj/kernel`` reads ``model.layers.{i}.self_attn.q_proj.weight`` for every layer
i, transposed ([out, in] -> [in, out]) and stacked on a leading layer axis. (Phi3 keeps HF's fused
``qkv_proj`` and ``gate_up_proj`` as modules, so it maps the same way.) A converted checkpoint
(`xlaserve convert`, orbax) already holds this pytree: `ConvertedParams` skip the mapping.
`--load-format dummy` reads no tensors at all: `DummyWeights` draws every parameter on its devices.

Two optional hooks on the model class cover what is not one-to-one:
- ``prepare_hf_tensors(cfg, tensors) -> tensors``: rewrites the checkpoint first (MoE: one tensor
  per expert -> one [num_experts, out, in] stack; a kernel's last two axes are transposed);
- ``layer_stacks(cfg) -> {module: range}``: several layer stacks, each holding a range of the
  checkpoint's layers (DeepSeek: dense layers, then MoE layers); default ``{"layers": all}``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from xlaserve.models.config import TransformerConfig
from xlaserve.models.orbax_checkpoint import ConvertedParams

# Tensors a checkpoint may carry that no module reads.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class DummyWeights:
    """`--load-format dummy` (vLLM's name): every parameter drawn uniformly from [-scale, scale] on
    its devices, in its sharding; nothing is read or copied from the host. For benchmarks of shapes
    whose weights are not at hand: the config and tokenizer come from the model directory."""

    seed: int = 0
    scale: float = 1e-3  # vLLM's dummy range

    def draw(self, index: int, shape: tuple[int, ...], dtype, sharding) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(self.seed), index)
        return _uniform_fn(tuple(shape), jnp.dtype(dtype), self.scale, sharding)(key)


@functools.cache
def _uniform_fn(shape: tuple[int, ...], dtype, scale: float, sharding) -> Callable:
    """One compiled draw per distinct (shape, dtype, sharding): layers share theirs."""
    return jax.jit(
        lambda key: jax.random.uniform(key, shape, jnp.float32, -scale, scale).astype(dtype),
        out_shardings=sharding,
    )


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
    sharding: Callable[[tuple[str, ...], tuple[int, ...]], jax.sharding.Sharding] | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Build `make_model()` abstractly, then fill every parameter from `tensors`.

    `tensors`: HF names -> HF-layout arrays, or `ConvertedParams` (our paths and layout, from
    `xlaserve convert`), placed as they are. Missing or unexpected tensors are an error naming them.
    `place` puts one host array on its device(s) (the sharding layer passes one); by default
    `jax.device_put`. `DummyWeights` draw each parameter directly in `sharding(path, shape)` (by
    default on the first device).
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
    expected = _flatten(nnx.to_pure_dict(abstract))
    if isinstance(tensors, DummyWeights):
        sharding = sharding or (lambda path, shape: jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        flat = {
            path: tensors.draw(i, spec.shape, dtype, sharding(path, spec.shape))
            for i, (path, spec) in enumerate(
                tqdm(expected.items(), desc="Drawing dummy weights", unit="tensor")
            )
        }
        abstract.replace_by_pure_dict(_unflatten(flat))
        return graphdef, abstract
    if isinstance(tensors, ConvertedParams):
        place = place or (lambda path, array: jax.device_put(array))
        flat = _place_converted(model_class, expected, tensors, dtype, place)
        abstract.replace_by_pure_dict(_unflatten(flat))
        return graphdef, abstract
    if hasattr(model_class, "prepare_hf_tensors"):
        tensors = model_class.prepare_hf_tensors(cfg, tensors)
    stacks = layer_stacks(model_class, cfg)
    place = place or (lambda path, array: jax.device_put(array))
    used: set[str] = set()
    missing: list[str] = []
    flat: dict[tuple[str, ...], jax.Array] = {}
    for path, spec in tqdm(expected.items(), desc="Placing weights", unit="tensor", leave=False):
        is_stacked = path[0] in stacks
        if is_stacked:
            names = [hf_name(("layers", *path[1:]), i) for i in stacks[path[0]]]
        else:
            names = [hf_name(path, None)]
        absent = [n for n in names if n not in tensors]
        if absent:
            missing.extend(absent)
            continue
        used.update(names)
        arrays = [np.swapaxes(tensors[n], -1, -2) if path[-1] == "kernel" else tensors[n] for n in names]
        array = np.stack(arrays) if is_stacked else arrays[0]
        if array.shape != spec.shape:
            raise ValueError(f"tensor {names[0]} has shape {array.shape}, the model expects {spec.shape}")
        flat[path] = place(path, np.asarray(array, dtype=dtype))
    unexpected = sorted(
        n
        for n in tensors
        if n not in used and not n.endswith(_IGNORED_SUFFIXES) and not _is_tied_head(n, cfg)
    )
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {model_class.__name__}: "
            f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}; "
            f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    abstract.replace_by_pure_dict(_unflatten(flat))
    return graphdef, abstract


def layer_stacks(model_class: type, cfg: TransformerConfig) -> dict[str, range]:
    """Our stacked modules (a leading layer axis on each parameter) -> the checkpoint layers each holds."""
    if hasattr(model_class, "layer_stacks"):
        return model_class.layer_stacks(cfg)
    return {"layers": range(cfg.num_layers)}


def _place_converted(model_class, expected: dict, params: ConvertedParams, dtype, place) -> dict:
    missing = ["/".join(p) for p in expected if p not in params]
    unexpected = sorted("/".join(p) for p in params if p not in expected)
    if missing or unexpected:
        raise ValueError(
            f"converted checkpoint does not match {model_class.__name__}: "
            f"missing parameters {missing[:8]}; unexpected parameters {unexpected[:8]}"
        )
    flat = {}
    for path, spec in expected.items():
        if params[path].shape != spec.shape:
            raise ValueError(
                f"parameter {'/'.join(path)} has shape {params[path].shape}, the model expects {spec.shape}"
            )
        flat[path] = place(path, np.asarray(params[path], dtype=dtype))
    return flat


def _is_tied_head(name: str, cfg: TransformerConfig) -> bool:
    return cfg.tie_word_embeddings and name == "lm_head.weight"

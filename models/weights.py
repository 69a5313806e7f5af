"""Hugging Face tensors -> the parameter pytree of an NNX model.

Our modules name parameters as Hugging Face does, so the mapping is mechanical: a path
``layers/self_attn/q_proj/kernel`` reads ``model.layers.{i}.self_attn.q_proj.weight`` for every layer
i, transposed ([out, in] -> [in, out]) and stacked on a leading layer axis. (Phi3 keeps HF's fused
``qkv_proj`` and ``gate_up_proj`` as modules, so it maps the same way.) A converted checkpoint
(`xlaserve convert`, orbax) already holds this pytree: `ConvertedParams` skip the mapping.
`--load-format dummy` reads no tensors at all: `DummyWeights` draws every parameter on its devices.

Two hooks of the model class (`CausalLM`, models/interfaces.py) cover what is not one-to-one:
- ``prepare_hf_tensors(cfg, tensors) -> tensors``: rewrites the checkpoint first (MoE: one tensor
  per expert -> one [num_experts, out, in] stack; a kernel's last two axes are transposed);
- ``layer_stacks(cfg) -> {module: range}``: the layer stacks, each holding a range of the
  checkpoint's layers (``{"layers": all}``; DeepSeek: dense layers, then MoE layers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from xlaserve.models.config import TransformerConfig
from xlaserve.models.gguf_quant import GGUFBlocks
from xlaserve.models.interfaces import CausalLM
from xlaserve.models.loader import DummyWeights
from xlaserve.models.orbax_checkpoint import ConvertedParams, flatten_tree
from xlaserve.models.quantization import (
    SCALE,
    ZERO,
    QuantizedTensor,
    QuantScheme,
    is_quantized_kernel,
    quantize_modules,
    quantized_parts,
)
from xlaserve.models.safetensors_loader import CheckpointTensor

# Tensors a checkpoint may carry that no module reads.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _draw_dummy(weights: DummyWeights, index: int, shape: tuple[int, ...], dtype, sharding) -> jax.Array:
    """Parameter number `index`, drawn uniformly from [-scale, scale] directly in its sharding."""
    key = jax.random.fold_in(jax.random.key(weights.seed), index)
    return _uniform_fn(tuple(shape), jnp.dtype(dtype), weights.scale, sharding)(key)


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


def _unflatten(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def load_params(
    model_class: type[CausalLM],
    cfg: TransformerConfig,
    tensors: dict[str, np.ndarray],
    *,
    dtype: jnp.dtype,
    make_model: Callable[[], nnx.Module],
    place: Callable[[tuple[str, ...], np.ndarray], jax.Array] | None = None,
    sharding: Callable[[tuple[str, ...], tuple[int, ...]], jax.sharding.Sharding] | None = None,
    quantization: QuantScheme | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Build `make_model()` abstractly, then fill every parameter from `tensors`.

    `tensors`: HF names -> HF-layout arrays, or `ConvertedParams` (our paths and layout, from
    `xlaserve convert`), placed as they are. Missing or unexpected tensors are an error naming them.
    `place` puts one host array on its device(s) (the sharding layer passes one); by default
    `jax.device_put`. A `place` with a `holds(path)` attribute (a pipeline stage's) is given only the
    shape and dtype (a `jax.ShapeDtypeStruct`) of a parameter it does not hold, whose tensors are
    never read; with a `held_layers(path)` attribute (a slice of a layer stack), only those layers of
    a stacked parameter are read and given to it. A checkpoint's tensors are read one parameter at a
    time, as it is placed (a safetensors checkpoint's and a GGUF's lazily: models/safetensors_loader.py,
    models/gguf_loader.py). `DummyWeights` draw each parameter directly in `sharding(path, shape)` (by
    default on the first device). `quantization`: the model's
    projections are stored quantized in this scheme (models/quantization.py): float tensors are
    quantized here, on the host, and a checkpoint's `QuantizedTensor`s placed as they are when they
    match it.
    """
    is_hf = not isinstance(tensors, (DummyWeights, ConvertedParams))
    if is_hf:
        tensors = model_class.prepare_hf_tensors(cfg, tensors)
    stacks = model_class.layer_stacks(cfg)
    keep_quantized = None
    if quantization is not None and quantization.checkpoint_only and is_hf:
        # A checkpoint released quantized: only the modules whose weights it stores quantized are.
        def keep_quantized(module_path: tuple[str, ...]) -> tuple[int, tuple[int, int] | None] | int:
            layer = stacks[module_path[0]][0] if module_path[0] in stacks else None
            name = hf_name(
                ("layers", *module_path[1:], "kernel") if layer is not None else (*module_path, "kernel"),
                layer,
            )
            tensor = tensors.get(name)
            if not isinstance(tensor, (QuantizedTensor, GGUFBlocks)):
                return 0
            return tensor.bits, None if tensor.block is None else tensor.block[::-1]  # [in, out]

    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: quantize_modules(make_model(), quantization, keep_quantized))
    )
    expected = flatten_tree(nnx.to_pure_dict(abstract))
    if isinstance(tensors, DummyWeights):
        sharding = sharding or (lambda path, shape: jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        flat = {
            path: _draw_dummy(tensors, i, spec.shape, _draw_dtype(spec, dtype), sharding(path, spec.shape))
            for i, (path, spec) in enumerate(
                tqdm(expected.items(), desc="Drawing dummy weights", unit="tensor")
            )
        }
        abstract.replace_by_pure_dict(_unflatten(flat))
        return graphdef, abstract
    if isinstance(tensors, ConvertedParams):
        place = place or (lambda path, array: jax.device_put(array))
        flat = _place_converted(model_class, cfg, expected, tensors, dtype, place, quantization)
        abstract.replace_by_pure_dict(_unflatten(flat))
        return graphdef, abstract
    holds = getattr(place, "holds", None)  # a pipeline stage's place (worker/pipeline_stage.py)
    held_layers = getattr(place, "held_layers", None)  # and the part of a layer stack it holds
    place = _one_in_flight(place or (lambda path, array: jax.device_put(array)))
    used: set[str] = set()
    missing: list[str] = []
    flat: dict[tuple[str, ...], jax.Array] = {}
    for path, spec in tqdm(expected.items(), desc="Placing weights", unit="tensor", leave=False):
        if path[-1] in (SCALE, ZERO):
            continue  # placed with their kernel
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
        # A stage reads only its own layers' tensors (every layer is read, and checked, by its stage).
        held = held_layers(path) if is_stacked and held_layers is not None else slice(None)
        num_held = len(names[held]) if is_stacked else None  # None: the whole (unstacked) array
        read = names[held] or names[:1]  # a stage without a layer of this stack: one, for its shape
        if holds is not None and not holds(path) and is_quantized_kernel(path, expected):
            for part_path in (path, (*path[:-1], SCALE), (*path[:-1], ZERO)):
                if part_path in expected:  # placeholders of the codes, scales and zeros, unread
                    part = expected[part_path]
                    flat[part_path] = place(part_path, jax.ShapeDtypeStruct(part.shape, part.dtype))
            continue
        if holds is not None and not holds(path):
            shape = tuple(tensors[names[0]].shape)  # the header's: checked as a placed one's, unread
            if path[-1] == "kernel":
                shape = (*shape[:-2], shape[-1], shape[-2])
            if shape != spec.shape:
                raise ValueError(f"tensor {names[0]} has shape {shape}, the model expects {spec.shape}")
            flat[path] = place(path, jax.ShapeDtypeStruct(spec.shape, spec.dtype))  # its placeholder
            continue
        # Read here, one parameter's tensors at a time (a safetensors checkpoint's and a GGUF's are
        # read lazily): the host copies are dropped once the parameter is placed.
        arrays = [_our_layout(_host(tensors[n]), path) for n in read]
        if is_quantized_kernel(path, expected):
            for part_path, part in quantized_parts(path, arrays, is_stacked, expected, quantization).items():
                part = part if num_held is None else part[:num_held]
                _check_shape(read[0], part, _held_shape(expected[part_path].shape, num_held))
                flat[part_path] = place(part_path, part)
            continue
        arrays = [a.dequantized() if isinstance(a, QuantizedTensor) else a for a in arrays]
        array = _assemble(read, arrays, dtype, is_stacked)
        array = array if num_held is None else array[:num_held]
        _check_shape(read[0], array, _held_shape(spec.shape, num_held))
        flat[path] = place(path, array)
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


def _one_in_flight(place: Callable) -> Callable:
    """`place` that waits for the previous parameter's transfer before going on: a transfer holds its
    host array until it completes (a device_put is asynchronous), so without the wait every parameter's
    host copy could be alive at once. Reading the next parameter still overlaps this one's transfer."""
    previous: list = []

    def placed(path, array):
        out = place(path, array)
        if previous:
            jax.block_until_ready(previous.pop())
        previous.append(out)
        return out

    return placed


def _host(tensor):
    """A checkpoint tensor as a host array (a `CheckpointTensor` read from its file now, a GGUF's
    `GGUFBlocks` read and decoded into a `QuantizedTensor`)."""
    return tensor.read() if isinstance(tensor, (CheckpointTensor, GGUFBlocks)) else tensor


def _our_layout(tensor, path: tuple[str, ...]):
    """A checkpoint tensor in our layout: kernels [.., in, out] (HF stores [.., out, in])."""
    if path[-1] != "kernel":
        return tensor
    return tensor.transposed() if isinstance(tensor, QuantizedTensor) else np.swapaxes(tensor, -1, -2)


def _assemble(names: list[str], arrays: list[np.ndarray], dtype, stacked: bool) -> np.ndarray:
    """`arrays` (our layout: a kernel is a transposed view of the checkpoint's) as one C-contiguous
    array of `dtype`, stacked along a new first axis when `stacked`. Each is cast in its own memory
    order first, then moved into place: a transposed view cast as it is reads with a stride (measured on
    SmolLM2's 30 stacked [576, 1536] kernels to bfloat16: 0.46 s through np.stack then a cast, 0.04 s
    this way)."""
    if not stacked:
        return np.ascontiguousarray(np.asarray(arrays[0]).astype(dtype, order="K", copy=False))
    shape = np.shape(arrays[0])
    out = np.empty((len(arrays), *shape), dtype)
    for i, (name, array) in enumerate(zip(names, arrays)):
        if np.shape(array) != shape:
            raise ValueError(f"tensor {name} has shape {np.shape(array)}, unlike {names[0]}'s {shape}")
        out[i] = np.asarray(array).astype(dtype, order="K", copy=False)
    return out


def _check_shape(name: str, array: np.ndarray, shape: tuple[int, ...]) -> None:
    if array.shape != shape:
        raise ValueError(f"tensor {name} has shape {array.shape}, the model expects {shape}")


def _held_shape(shape: tuple[int, ...], num_held: int | None) -> tuple[int, ...]:
    """A parameter's shape as a stage holds it: `num_held` layers of a stack (None: the whole)."""
    return shape if num_held is None else (num_held, *shape[1:])


def _draw_dtype(spec, dtype):
    """Dummy weights: a quantized kernel is drawn in its own dtype, its scales in float32."""
    return spec.dtype if spec.dtype.itemsize == 1 or spec.dtype == jnp.float32 else dtype


def _place_converted(
    model_class, cfg, expected: dict, params: ConvertedParams, dtype, place, quantization
) -> dict:
    if quantization is not None:  # a converted (float) checkpoint quantized as it is placed
        table = ("embed_tokens", "weight")
        if table in params and table not in expected:  # the quantized table is held as [D, V]
            params = ConvertedParams(
                {p: a for p, a in params.items() if p != table}
                | {("embed_tokens", "kernel"): params[table].T}
            )
        params = ConvertedParams(
            {p: a for p, a in params.items()}
            | {p: None for p in expected if p[-1] in (SCALE, ZERO) and p not in params}
        )
    missing = ["/".join(p) for p in expected if p not in params]
    unexpected = sorted("/".join(p) for p in params if p not in expected)
    if missing or unexpected:
        raise ValueError(
            f"converted checkpoint does not match {model_class.__name__}: "
            f"missing parameters {missing[:8]}; unexpected parameters {unexpected[:8]}"
        )
    held_layers = getattr(place, "held_layers", None)  # a pipeline stage's part of each layer stack
    stacks = model_class.layer_stacks(cfg)
    flat = {}
    for path, spec in expected.items():
        if path[-1] in (SCALE, ZERO) and params[path] is None:
            continue
        is_stacked = path[0] in stacks
        held = held_layers(path) if is_stacked and held_layers is not None else None
        if is_quantized_kernel(path, expected) and params[path].dtype.itemsize != 1:
            layers = list(params[path]) if is_stacked else [params[path]]
            for part_path, part in quantized_parts(path, layers, is_stacked, expected, quantization).items():
                flat[part_path] = place(part_path, part if held is None else part[held])
            continue
        if params[path].shape != spec.shape:
            raise ValueError(
                f"parameter {'/'.join(path)} has shape {params[path].shape}, the model expects {spec.shape}"
            )
        value = params[path] if held is None else params[path][held]
        flat[path] = place(path, np.asarray(value, dtype=dtype))
    return flat


def _is_tied_head(name: str, cfg: TransformerConfig) -> bool:
    return cfg.tie_word_embeddings and name == "lm_head.weight"

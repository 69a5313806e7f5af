"""New weights into a running engine (the research stack).

`update_weights(runner, weights)`: `weights` are Hugging Face names -> arrays (vLLM's `load_weights`
shape), a full checkpoint or a part of one. They go through the rules a checkpoint load applies
(models/weights.py and the sharding layer): KV heads repeated for tensor parallelism, the vocabulary
padded, a family's own rewrite (MoE: one tensor per expert -> one stack), our [in, out] layout, the
model's dtype, the layer stacks (stored as uint16 words on CPU), and each parameter's sharding. Every
name and shape is checked before anything changes: an unknown name or a wrong shape is a ValueError
naming the weight and both shapes, and the engine keeps its weights. Only parameters change, into
arrays of the same shapes, dtypes and shardings, so no program recompiles.

An engine that quantizes at load (`quantization="int8"|"fp8"`) quantizes the new float weights as the
load does (models/quantization.py: `quantized_parts`, per layer, on the host: int8's max/127 per
channel, fp8's least-error scale search, the tables in int8 under fp8), so its kernels and scales are
the bits a fresh engine on the new checkpoint holds. An engine whose weights arrived quantized (a
checkpoint released in FP8, a GGUF's blocks under `quantization="gguf"`) is refused: its scales are
the checkpoint's, and float weights could only be requantized into another format than a fresh
engine on the new checkpoint would hold.

A runner's weights are one or more `ParamSet`s (`runner.param_sets()`): a ModelRunner's whole model,
or each pipeline stage's (worker/pipeline_runner.py: its own layers on its own devices, empty
placeholders for the modules it does not run). A name is routed to every set that holds it: a layer's
weight to the stage of that layer, at its index in that stage's stack; the embedding to stage 0 and,
tied to the head, to the last stage too; the final norm and an untied head to the last. A
vision-language model's tower and projector in text-only mode (`ModelConfig.text_only_mode`) are held by
no set: a trainer's full checkpoint is accepted with them, and they are skipped (returned among the
names, as a stage that does not hold a weight skips it). Every set's writes are checked before any set
changes. With the stages across processes a set of another process's
stage has no params here: its names are known (every stage's model has the whole model's structure), so
they are not unknown, but their shapes and writes are that process's. There `prepare_update` checks and
builds this process's sets without installing them, and `commit_update` (or `abort_update`) follows once
every process has prepared (executor/pipeline.py): a tensor refused on any process changes no stage.

(Handing device memory back and restoring it, the research stack's other half: worker/sleep_mode.py.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import cpu_dot, cpu_ops
from xlaserve.kernels.dtype_ops import is_16bit_float
from xlaserve.models.prequantized import quantization_scheme
from xlaserve.models.quantization import SCALE, ZERO, QuantScheme, is_quantized_kernel, quantized_parts
from xlaserve.models.registry import get_model_class, model_config_from_hf
from xlaserve.models.weights import _unflatten, flatten_tree, hf_name
from xlaserve.sharding.layout import checkpoint_shape, lay_out_for_mesh
from xlaserve.worker.pipeline_stage import StageLayout

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ParamSet:
    """The weights one program reads, as the research stack sees them: a ModelRunner's whole model, or
    one pipeline stage's (`stage`: its layers; the modules it does not run are empty placeholders)."""

    params: nnx.State | None  # None: another process's stage (pipeline stages across processes)
    head_dv: object | None = None  # the tied LM head's [D, V] copy, where this set computes logits
    stage: StageLayout | None = None  # None: every layer and module

    @property
    def is_local(self) -> bool:
        return self.params is not None


def named_arrays(weights: Mapping | Iterable) -> dict[str, object]:
    """update_weights' `weights` (a mapping, or (name, array) pairs) as a dict; a name must be a str."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    out: dict[str, object] = {}
    for name, array in items:
        if not isinstance(name, str):
            raise ValueError(f"weights: a name must be a Hugging Face tensor name (str), got {name!r}")
        out[name] = array
    return out


def _targets(model_class, cfg, flats: list[dict | None], sets: list[ParamSet]) -> dict[str, list[tuple]]:
    """Every tensor name (after the family's rewrite) -> where it lives: (the set's index, our parameter
    path, its index in that set's stack or None) for each set holding it (none for a module no set
    holds: vLLM's text-only mode places no encoder module, whose tensors are then accepted and
    skipped). `flats`: each set's parameters by path (None: another process's stage, whose paths are
    any stage's)."""
    stacks = model_class.layer_stacks(cfg)
    paths = next(flat for flat in flats if flat is not None)
    targets: dict[str, list[tuple]] = {}
    for i, (flat, weights) in enumerate(zip(flats, sets)):
        stage = weights.stage
        for path in paths if flat is None else flat:
            if path[-1] in (SCALE, ZERO):
                continue
            if path[0] in stacks:
                layers = stacks[path[0]]
                for index, layer in enumerate(layers if stage is None else layers[stage.stack_slice(layers)]):
                    targets.setdefault(hf_name(("layers", *path[1:]), layer), []).append((i, path, index))
            elif stage is None or stage.holds(path[0], cfg.tie_word_embeddings):  # not a placeholder
                targets.setdefault(hf_name(path, None), []).append((i, path, None))
            else:  # known, so not refused: held by another set, or by none (text-only mode's encoder)
                targets.setdefault(hf_name(path, None), [])
    return targets


def _our_layout(array, path: tuple[str, ...]):
    """A value in our layout (kernels [.., in, out]): a jax array stays one, anything else is read into
    a host array here."""
    if isinstance(array, jax.Array):
        return jnp.swapaxes(array, -1, -2) if path[-1] == "kernel" else array
    array = np.asarray(array)
    return np.swapaxes(array, -1, -2) if path[-1] == "kernel" else array


def _layout_shape(shape: tuple[int, ...], path: tuple[str, ...]) -> tuple[int, ...]:
    """`_our_layout`'s shape, from the value's shape alone (nothing read)."""
    shape = tuple(shape)
    return (*shape[:-2], shape[-1], shape[-2]) if path[-1] == "kernel" else shape


def _converted(path, parts, flat: dict, scheme: QuantScheme | None) -> dict[tuple[str, ...], list]:
    """One parameter's writes (index or None, value in the checkpoint's layout) as the values
    `_write` takes, in our layout: a kernel the model keeps quantized as its codes and scales (and
    zeros), each a list of its own."""
    if not is_quantized_kernel(path, flat):
        return {path: [(index, _our_layout(value, path)) for index, value in parts]}
    out: dict[tuple[str, ...], list] = {}
    for index, value in parts:  # quantized on the host, as the load does (a jax array fetched)
        for part_path, part in _quantized(
            path, index, _our_layout(np.asarray(value), path), flat, scheme
        ).items():
            out.setdefault(part_path, []).append((index, part))
    return out


def update_weights(runner, weights: Mapping | Iterable) -> list[str]:
    """Replace the runner's parameters named in `weights` (the module docstring); -> the names
    updated. Nothing changes, on any of the runner's parameter sets, unless every name and shape checks
    out. A MoE layer's experts are rewritten into one stack by the family, so they are updated
    together. An engine that quantizes at load quantizes them as the load does; one whose checkpoint
    came quantized is refused."""
    weights = named_arrays(weights)
    sets, names = _updated_sets(runner, weights)
    # An MTP drafter's layer (the checkpoint's `mtp.*` tensors, which the target's load leaves out).
    drafter = runner.drafter
    drafted = None if drafter is None else drafter.updated_weights(weights)
    runner.set_param_sets(sets)
    if drafted is not None:
        drafter.own_weights = drafted
    return names


def prepare_update(runner, weights: Mapping | Iterable) -> list[str]:
    """`update_weights`' checks and new arrays for this process's stages, held until `commit_update`
    (pipeline stages across processes: every process prepares before any installs)."""
    runner.prepared_update, names = _updated_sets(runner, weights)
    return names


def prepare_update_from_path(runner, path: str) -> list[str]:
    """`prepare_update` with every tensor of the checkpoint at `path` (`update_weights_from_path`)."""
    return prepare_update(runner, _checkpoint_tensors(runner, path))


def commit_update(runner) -> None:
    """Install what `prepare_update` built (nothing recompiles: the same shapes and shardings)."""
    sets, runner.prepared_update = runner.prepared_update, None
    runner.set_param_sets(sets)


def abort_update(runner) -> None:
    """Drop what `prepare_update` built (a process refused its part): the weights stay."""
    runner.prepared_update = None


def _updated_sets(runner, weights: Mapping | Iterable) -> tuple[list[ParamSet], list[str]]:
    """The runner's parameter sets with `weights` written in (the sets of another process's stages
    as they are), and the names updated; a ValueError before anything is built for a name or shape
    that does not check out."""
    updates = named_arrays(weights)
    if not updates:
        return runner.param_sets(), []
    scheme = _quantized_at_load(runner.config.model.quantization, runner.hf_config)
    hf_cfg = model_config_from_hf(runner.hf_config)
    model_class = get_model_class(hf_cfg.architecture)
    tp = runner.config.parallel.tensor_parallel_size
    sets = runner.param_sets()
    flats = [flatten_tree(nnx.to_pure_dict(weights.params)) if weights.is_local else None for weights in sets]
    # The checkpoint's own shapes (before KV-head repetition and vocabulary padding): what a caller
    # holds, so the errors name them.
    targets = _targets(model_class, runner.model_config, flats, sets)
    tied = hf_cfg.tie_word_embeddings
    host = {}
    for name, array in updates.items():
        if tied and name == "lm_head.weight":
            raise ValueError("weights: lm_head.weight is tied to model.embed_tokens.weight here: update that")
        # The targets this process holds (another process checks and writes the others' stages).
        where = [target for target in targets.get(name, []) if flats[target[0]] is not None]
        if name in targets and not where:
            continue
        # Checked by its shape, converted only when its parameter is written (`_converted`): a
        # checkpoint's tensors (models/safetensors_loader.py, models/gguf_loader.py) are read then, one
        # parameter's at a time. A jax array (a trainer's, on its own mesh) stays on the devices:
        # resharded there, never fetched, unless a rewrite below needs the host (KV heads repeated,
        # the vocabulary padded, a MoE layer's experts stacked) or the kernel is kept quantized
        # (quantized on the host, as the load does: `_quantized`).
        array = array if hasattr(array, "shape") and hasattr(array, "dtype") else np.asarray(array)
        if where:  # a name only the family's rewrite makes (MoE experts) is checked after it
            i, path, index = where[0]
            ours = flats[i][path].shape[1:] if index is not None else flats[i][path].shape
            shape = checkpoint_shape(name, _layout_shape(ours, path), runner.model_config, hf_cfg, tp)
            if tuple(array.shape) != shape:
                raise ValueError(f"weights: {name!r} has shape {tuple(array.shape)}, the model's is {shape}")
        host[name] = array
    # The load's rewrites, in its order (worker/model_loader.py): the mesh's (sharding/layout.py: heads,
    # vocabulary), then the family's.
    _, host, _ = lay_out_for_mesh(hf_cfg, host, tp)
    host = model_class.prepare_hf_tensors(runner.model_config, host)
    # Per set: path -> [(index in its stack or None, value in the checkpoint's layout)], every shape
    # checked before any is converted or written.
    writes: list[dict[tuple[str, ...], list[tuple[int | None, object]]]] = [{} for _ in sets]
    for name, array in host.items():
        if name not in targets:
            raise ValueError(
                f"weights: {name!r} is not a weight of this {hf_cfg.architecture} "
                f"(e.g. {next(iter(targets))!r})"
            )
        for i, path, index in targets[name]:
            if flats[i] is None:  # another process's stage
                continue
            old = flats[i][path]
            shape = _layout_shape(np.shape(array), path)
            want = tuple(old.shape[1:] if index is not None else old.shape)
            if shape != want:
                raise ValueError(f"weights: {name!r} has shape {shape} here, the model's is {want}")
            writes[i].setdefault(path, []).append((index, array))
    new_sets = [
        _written(weights, flat, set_writes, runner.dtype, scheme) if set_writes else weights
        for weights, flat, set_writes in zip(sets, flats, writes)
    ]
    logger.info(
        "%d weights ready to install (%d parameters in %d of %d parameter sets)",
        len(updates),
        sum(map(len, writes)),
        sum(map(bool, writes)),
        len(sets),
    )
    return new_sets, sorted(updates)


def _written(weights: ParamSet, flat: dict, writes: dict, dtype, scheme: QuantScheme | None) -> ParamSet:
    """`weights` with `writes` (path -> [(index or None, value)], all checked) written in: new arrays of
    the same shapes, dtypes and shardings, and the tied head's copy made again if the table changed.
    One parameter at a time: its values converted (read from a checkpoint's file, quantized), written
    into its new array, and their host copies dropped before the next."""
    new_flat = dict(flat)
    for path, parts in writes.items():
        for part_path, part_values in _converted(path, parts, flat, scheme).items():
            new_flat[part_path] = _write(flat[part_path], part_values, dtype)
    params = jax.tree.map(lambda x: x, weights.params)  # the same structure (the programs' signature)
    params.replace_by_pure_dict(_unflatten(new_flat))
    head_dv = weights.head_dv
    table = ("embed_tokens", "weight")
    if head_dv is not None and table in writes:  # the tied head's transposed copy (worker/model_loader.py)
        if cpu_dot.is_packed(head_dv):  # packed for the CPU's dot: on the host, nothing compiled
            head_dv = cpu_dot.PackedWeight.pack(np.asarray(new_flat[table]).T, head_dv.strips.sharding)
        else:
            head_dv = jax.device_put(jnp.transpose(new_flat[table]), head_dv.sharding)  # on the devices
    return dataclasses.replace(weights, params=params, head_dv=head_dv)


def _quantized_at_load(method: str | None, hf_config: dict) -> QuantScheme | None:
    """The scheme an engine started with `--quantization method` on a checkpoint of `hf_config`
    quantizes float weights in (None: its weights are float); ValueError where its weights arrived
    quantized (the module docstring)."""
    if method == "gguf":
        raise ValueError(
            "update_weights: this engine keeps a GGUF's own quantized blocks (quantization='gguf'); "
            "float weights cannot be put back into llama.cpp's codes as the file held them: start an "
            "engine on the new file, or run this one without quantization='gguf' (or with 'int8'/'fp8')"
        )
    scheme, _ = quantization_scheme(method, hf_config, {})
    if scheme is not None and scheme.checkpoint_only:
        raise ValueError(
            f"update_weights: this engine's weights came quantized from its checkpoint ({scheme.describe()}, "
            "config.json's quantization_config), with the checkpoint's own scales; updating them in place "
            "is not supported: start an engine on the new checkpoint, or start this one from float weights "
            "with quantization='int8' or 'fp8', which quantizes updates as it loads"
        )
    return scheme


def _quantized(path, index, value, flat, scheme: QuantScheme) -> dict[tuple[str, ...], np.ndarray]:
    """One float kernel (a layer's, or a whole one), [.., in, out], as the load stores it: its codes
    and scales (models/quantization.py: `quantized_parts`, the loader's own function, on the host;
    a jax array is fetched for it)."""
    parts = quantized_parts(path, [np.asarray(value)], False, flat, scheme)
    for part_path, part in parts.items():
        old = flat[part_path]
        shape = tuple(old.shape[1:] if index is not None else old.shape)
        if part.shape != shape or part.dtype != old.dtype:  # the scheme is the load's: never expected
            raise ValueError(
                f"weights: {'.'.join(part_path)} quantized to {part.shape} {part.dtype}, "
                f"the model holds {shape} {old.dtype}"
            )
    return parts


def update_weights_from_path(runner, path: str) -> list[str]:
    """`update_weights` with every tensor of the checkpoint at `path` (a model directory or a GGUF file,
    as a start reads it, or a directory of weights alone): it must be the same architecture and shapes."""
    return update_weights(runner, _checkpoint_tensors(runner, path))


def _checkpoint_tensors(runner, path: str):
    """The tensors of the checkpoint at `path`, of the runner's architecture (else a ValueError). A
    directory without config.json holds weights alone (a trainer's `torch.save(state_dict)` as
    pytorch_model.bin or its shards and index, or safetensors): read as a start reads a model
    directory's (models/loader.py `read_weights`, lazily), their names and shapes the only check."""
    from xlaserve.models.loader import load_checkpoint, read_weights

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        return read_weights(path, progress=False)
    checkpoint = load_checkpoint(path, skip_tokenizer_init=True)
    ours, theirs = runner.hf_config.get("architectures"), checkpoint.hf_config.get("architectures")
    if ours != theirs:
        raise ValueError(f"update_weights_from_path: {path} holds {theirs}, this engine runs {ours}")
    return checkpoint.tensors


def _write(old: jax.Array, parts: list[tuple[int | None, object]], dtype) -> jax.Array:
    """`old` with `parts` written in (a whole array, or layers of a stack), placed in its sharding.
    Host arrays are assembled on the host (nothing compiles); jax arrays on the devices (small
    conversion programs, once per shape), always copied: the caller's array (a trainer's parameter,
    which its next step may donate) must never become the engine's buffer."""
    if cpu_dot.is_packed(old):
        return _write_packed(old, parts)
    on_device = any(isinstance(value, jax.Array) for _, value in parts)
    xp = jnp if on_device else np
    words = old.dtype == np.uint16 and is_16bit_float(dtype)  # a CPU layer stack, stored as words
    layer = _layer_sharding(old.sharding)

    def stored(value, sharding):
        if on_device:
            value = jax.device_put(jnp.asarray(value), sharding, may_alias=False)
            value = value.astype(dtype if words else old.dtype)
            return jax.lax.bitcast_convert_type(value, jnp.uint16) if words else value
        if words:
            return np.asarray(value, dtype=np.dtype(dtype)).view(np.uint16)
        return np.asarray(value, dtype=old.dtype)

    if len(parts) == 1 and parts[0][0] is None:
        new = stored(parts[0][1], old.sharding)
    elif len(parts) == old.shape[0] and all(i is not None for i, _ in parts):
        new = xp.stack([stored(v, layer) for _, v in sorted(parts, key=lambda p: p[0])])
    elif on_device:  # the layers not named keep their values
        new = old
        for index, value in parts:
            new = new.at[index].set(stored(value, layer))
    else:
        return _patched(old, {index: stored(value, layer) for index, value in parts})
    if isinstance(new, np.ndarray):  # each device takes its shard (this process's devices only)
        return jax.make_array_from_callback(old.shape, old.sharding, lambda index: new[index])
    return jax.device_put(new, old.sharding)


def shard_key(index: tuple, shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(n) for s, n in zip(index, shape))


def _patched(old: jax.Array, layers: dict[int, np.ndarray]) -> jax.Array:
    """`old` (a layer stack) with `layers` (index -> one layer's host value) written over, built shard by
    shard from the shards this process holds: across hosts no process holds the whole array."""
    shards = {shard_key(s.index, old.shape): s.data for s in old.addressable_shards}

    def shard(index):
        data = np.array(shards[shard_key(index, old.shape)])
        rows = range(*index[0].indices(old.shape[0]))
        for i, value in layers.items():
            if i in rows:
                data[i - rows.start] = value[index[1:]]
        return data

    return jax.make_array_from_callback(old.shape, old.sharding, shard)


def _write_packed(old: cpu_dot.PackedWeight, parts: list[tuple[int | None, object]]) -> cpu_dot.PackedWeight:
    """`_write` for a weight packed for the CPU's dot (kernels/cpu_dot.py; one CPU device, so the host's
    memory): the new values packed on the host and written over the layers they name, the other layers'
    strips kept as they are. Nothing is unpacked and nothing compiles; the pack copies the caller's arrays."""
    sharding = old.strips.sharding
    if len(parts) == 1 and parts[0][0] is None:
        return cpu_dot.PackedWeight.pack(np.asarray(parts[0][1]), sharding)
    strips = np.array(old.strips)
    for index, value in parts:
        strips[index] = cpu_ops.pack_for_dot(np.asarray(value))
    return dataclasses.replace(old, strips=jax.device_put(strips, sharding))


def _layer_sharding(stack_sharding):
    """The sharding of one layer of a stack sharded as `stack_sharding` (the layer axis dropped)."""
    if isinstance(stack_sharding, jax.sharding.NamedSharding):
        spec = jax.sharding.PartitionSpec(*stack_sharding.spec[1:])
        return jax.sharding.NamedSharding(stack_sharding.mesh, spec)
    return stack_sharding

"""Meshes and placement: parameters and the KV cache laid out by the rules in sharding/rules.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlaserve.sharding.rules import (
    KV_CACHE_AXES,
    STATE_CACHE_AXES,
    logical_to_mesh,
    lora_logical_axes,
    param_logical_axes,
    to_partition_spec,
)


def make_mesh(tensor_parallel_size: int, devices=None, context_parallel_size: int = 1) -> Mesh:
    """A 1-D ("tensor",) mesh over `devices` (default: all devices, local and remote); with
    `context_parallel_size` > 1 (prefill context parallel), a ("context", "tensor") mesh: that many
    groups of tensor_parallel_size devices, each computing its share of a step's tokens."""
    devices = list(jax.devices() if devices is None else devices)
    num_devices = tensor_parallel_size * context_parallel_size
    if num_devices > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x prefill_context_parallel_size="
            f"{context_parallel_size} exceeds the {len(devices)} available devices"
            if context_parallel_size > 1
            else f"tensor_parallel_size={tensor_parallel_size} exceeds the {len(devices)} available devices"
        )
    if context_parallel_size == 1:
        return Mesh(np.array(devices[:tensor_parallel_size]), ("tensor",))
    grid = np.array(devices[:num_devices]).reshape(context_parallel_size, tensor_parallel_size)
    return Mesh(grid, ("context", "tensor"))


class Placement:
    """Where every array of one engine lives: its mesh and the logical->mesh rules for a model.

    `stacked_modules`: the model's top-level modules whose parameters carry a leading layer axis
    (the loader's layer stacks), so that a stacked norm [L, D] counts as the vector it is per layer.
    """

    def __init__(
        self,
        mesh: Mesh,
        model_config,
        enable_expert_parallel: bool = False,
        stacked_modules: tuple[str, ...] = ("layers",),
    ):
        self.mesh = mesh
        self.tensor_parallel_size = mesh.shape["tensor"]
        self._check_divisible(model_config, self.tensor_parallel_size, enable_expert_parallel)
        self.rules = logical_to_mesh(enable_expert_parallel)
        self.stacked_modules = frozenset(stacked_modules)
        self.replicated = NamedSharding(mesh, PartitionSpec())

    @staticmethod
    def _check_divisible(cfg, tp: int, enable_expert_parallel: bool) -> None:
        def require(count: int, what: str) -> None:
            if count % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide {what}={count}")

        if tp == 1:
            return
        require(cfg.num_heads, "num_attention_heads")
        # The vocabulary needs no check: sharding/vocab.py pads it to a multiple of the TP size.
        if cfg.num_kv_heads and cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={tp} and num_key_value_heads={cfg.num_kv_heads}: one must divide "
                "the other"
            )
        if cfg.intermediate_size:
            require(cfg.intermediate_size, "intermediate_size")
        # Gated DeltaNet splits by key head (each with its value heads), Mamba2 by head: whole groups
        # of heads a rank, a group's B and C copied when there are more ranks than groups
        # (models/mamba2.py; a pure Mamba2's heads are num_heads, checked above).
        for name in ("linear_num_key_heads", "mamba_n_heads"):
            if getattr(cfg, name, 0):
                require(getattr(cfg, name), name)
        vision = getattr(cfg, "vision", None)  # LLaVA's tower, and its projector over hidden_size
        if vision is not None:
            require(vision.num_heads, "vision_config.num_attention_heads")
            require(vision.intermediate_size, "vision_config.intermediate_size")
            require(cfg.hidden_size, "hidden_size")
        groups = getattr(cfg, "mamba_n_groups", 0) or getattr(cfg, "n_groups", 0)
        if groups and groups % tp and tp % groups:
            raise ValueError(f"tensor_parallel_size={tp} and n_groups={groups}: one must divide the other")
        num_experts = getattr(cfg, "num_experts", 0) or 0
        if num_experts and enable_expert_parallel:
            require(num_experts, "num_experts")
        moe_size = getattr(cfg, "moe_intermediate_size", 0) or 0
        if moe_size and not enable_expert_parallel:
            require(moe_size, "moe_intermediate_size")

    def param_sharding(self, path: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
        """The sharding of the parameter at `path`; under tensor parallelism a matrix that no rule in
        sharding/rules.py names is an error naming it, never a silent replica."""
        name = "/".join(path)
        logical = param_logical_axes(path, len(shape), is_stacked=path[0] in self.stacked_modules)
        if logical is None:
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    f"parameter {name} {list(shape)} matches no sharding rule: under "
                    f"tensor_parallel_size={self.tensor_parallel_size} it would be replicated whole on "
                    f"every device; add its (module, parameter) = {tuple(path[-2:])} to PARAM_AXES in "
                    "sharding/rules.py (with axes mapped to no mesh axis if it must stay whole)"
                )
            logical = (None,) * len(shape)
        spec = to_partition_spec(logical, self.rules)
        for size, logical_axis, mesh_axis in zip(shape, logical, spec):
            if mesh_axis is not None and size % self.mesh.shape[mesh_axis]:
                raise ValueError(
                    f"parameter {name} {list(shape)}: its {logical_axis} dimension ({size}) does not split "
                    f"over the {self.mesh.shape[mesh_axis]} devices of mesh axis {mesh_axis!r}"
                )
        return NamedSharding(self.mesh, spec)

    def place_param(self, path: tuple[str, ...], array: np.ndarray) -> jax.Array:
        """Put one host array on the mesh; each device receives only its own shard."""
        sharding = self.param_sharding(path, array.shape)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    def lora_sharding(self, module: str, which: str) -> NamedSharding:
        """Where a LoRA slot stack goes: `which` "a" ([L, in, S, r]) or "b" ([L, S, r, out])."""
        return NamedSharding(self.mesh, to_partition_spec(lora_logical_axes(module, which), self.rules))

    def kv_cache_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, to_partition_spec(KV_CACHE_AXES, self.rules))

    def state_cache_sharding(self, kind: str) -> NamedSharding:
        """A recurrent layer's state arrays: `kind` "conv_state" or "recurrent_state"."""
        return NamedSharding(self.mesh, to_partition_spec(STATE_CACHE_AXES[kind], self.rules))

    def zeros(self, shape: tuple[int, ...], dtype, sharding: NamedSharding) -> jax.Array:
        return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()

    def put_replicated(self, tree):
        return jax.device_put(tree, self.replicated)

    def step_inputs(self, tree):
        """A step's host arrays, ready to pass to a jitted step function. In one process they go as
        they are: jit transfers host arrays itself, ~4x faster than a `device_put` of a pytree of a
        dozen small arrays. Across processes they must be global arrays: replicated explicitly."""
        return tree if jax.process_count() == 1 else self.put_replicated(tree)

    def own_inputs(self, tree):
        """`step_inputs` for host work one process does on its own, outside the steps (a LoRA slot
        written while preparing one): each process places its own copies, with no exchange between the
        processes (a `device_put` across them checks the values with the others, which are not there)."""
        if jax.process_count() == 1:
            return tree

        def place(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, self.replicated, lambda index: x[index])

        return jax.tree.map(place, tree)


@functools.cache
def _zeros_fn(shape: tuple[int, ...], dtype, sharding: NamedSharding):
    """One compiled fill per (shape, dtype, sharding): a KV cache allocated again (`wake_up`) reuses it."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)

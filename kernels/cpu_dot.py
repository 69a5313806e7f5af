"""Bfloat16 weights packed for the CPU's batch-invariant dot (`cpu_ops.bf16_matmul`), read in place.

On one CPU device, a bfloat16 model's stacked projections (worker/model_loader.py picks
the unquantized `Linear`s of its layer stacks) and its LM head are packed once at load into the
op's strips (`cpu_ops.pack_for_dot`) and held as a `PackedWeight`. The layer scan (`dtype_ops.scan`)
hands each layer its stack whole, with the layer's index, instead of a slice (XLA copied every
layer's slice at every step), and `dtype_ops.matmul` sends x @ it to the op. Each output's sum runs in
an order fixed by K alone, so a row has the same bits at every M: no rows are padded for XLA's dot,
and a batch-1 step reads each weight once. The few callers that need the matrix itself (MLA's
absorbed projection) get it back with `astype` (`dense`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.kernels import cpu_ops


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A stack of [K, N] bfloat16 weights as strips, or one layer of it (inside the layer scan), or
    one weight (a stack of one, `is_stack` False: an LM head)."""

    strips: jax.Array  # [L, S, K' / 2, 64, 2] uint16 (`cpu_ops.pack_for_dot`)
    layer: jax.Array | None  # int32 []: the layer a scan's body reads; None: the whole stack
    depth: int = dataclasses.field(metadata=dict(static=True))  # K
    columns: int = dataclasses.field(metadata=dict(static=True))  # N
    is_stack: bool = dataclasses.field(default=True, metadata=dict(static=True))

    @classmethod
    def pack(cls, w: jax.Array | np.ndarray, sharding=None) -> PackedWeight:
        """w [L, K, N] (a stack) or [K, N] bfloat16, or its uint16 words -> packed. A numpy array is
        packed on the host and placed with `sharding` (a weight update: nothing compiles)."""
        strips = cpu_ops.pack_for_dot(w if w.ndim == 3 else w[None])
        if isinstance(strips, np.ndarray):
            strips = jax.device_put(np.ascontiguousarray(strips), sharding)
        return cls(strips, None, w.shape[-2], w.shape[-1], is_stack=w.ndim == 3)

    def at(self, layer: jax.Array) -> PackedWeight:
        return dataclasses.replace(self, layer=layer)

    def __getitem__(self, key):  # `Variable[...]` hands the weight itself to its module
        if key is not Ellipsis:
            raise TypeError(f"a packed weight is read whole (`[...]`), not indexed with {key!r}")
        return self

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.layer is not None or not self.is_stack:
            return (self.depth, self.columns)
        return (len(self.strips), self.depth, self.columns)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def words(self, on_host: bool = False) -> jax.Array | np.ndarray:
        """The uint16 words of what it holds, as `shape`: the inverse of `pack` (`on_host`: a numpy
        array, nothing compiled)."""
        if on_host:
            strips = np.asarray(self.strips)
        elif self.layer is None:
            strips = self.strips
        else:
            strips = jax.lax.dynamic_index_in_dim(self.strips, self.layer, 0)
        xp = np if on_host else jnp
        num_layers, num_strips, pairs = strips.shape[:3]
        dense = xp.transpose(strips, (0, 2, 4, 1, 3)).reshape(
            num_layers, pairs * 2, num_strips * cpu_ops.STRIP
        )
        dense = dense[:, : self.depth, : self.columns]
        return dense if self.layer is None and self.is_stack else dense[0]

    def dense(self) -> jax.Array:
        return jax.lax.bitcast_convert_type(self.words(), jnp.bfloat16)

    def astype(self, dtype) -> jax.Array:
        return self.dense().astype(dtype)


def matmul(x: jax.Array, w: PackedWeight, out_dtype) -> jax.Array:
    """x [..., K] @ w's layer (or its one weight) -> [..., N] in `out_dtype`."""
    if w.layer is None and w.is_stack:
        raise ValueError(f"a stack of {len(w.strips)} packed weights multiplied whole: pick a layer (`at`)")
    if x.dtype != jnp.bfloat16:  # the op multiplies bfloat16 rows only
        return jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(out_dtype)
    rows = x.reshape(-1, w.depth)
    y = cpu_ops.bf16_matmul(rows, w.strips, 0 if w.layer is None else w.layer, w.columns)
    return y.reshape(*x.shape[:-1], w.columns).astype(out_dtype)


def is_packed(a) -> bool:
    return isinstance(a, PackedWeight)


def usable(dtype, num_devices: int) -> bool:
    """Whether a model of `dtype` on `num_devices` gets packed weights: one CPU device (the op is not
    partitioned), bfloat16, and the op built."""
    return (
        jax.default_backend() == "cpu"
        and num_devices == 1
        and jnp.dtype(dtype) == jnp.bfloat16
        and cpu_ops.available(cpu_ops.BF16_MATMUL_TARGET)
    )

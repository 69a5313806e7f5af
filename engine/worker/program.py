"""Program: one jitted device function and the executables warm-up made for it, one per signature.

A step calls the executable warm-up compiled, or loaded from disk (worker/program_store.py), for its
arguments' shapes directly: no trace, no lowering, no cache lookup, on the first call as on later ones.
A call whose signature warm-up did not see goes to the jitted function, which compiles it (and the
compile guard reports it).
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def leaf_signature(leaf) -> tuple:
    """What an executable requires of one argument: shape and dtype for arrays (and shape structs),
    the type for Python scalars (jit traces them weakly typed)."""
    shape = getattr(leaf, "shape", None)
    if shape is None:
        return (type(leaf).__name__,)
    return (tuple(shape), str(leaf.dtype))


class Program:
    """`jitted` (a `jax.jit` function) plus its executables by call signature.

    `num_fixed_args`: leading arguments that never change shape (the weights, the KV cache); the
    signature skips them, so a step pays for flattening only its small per-step arrays.
    `static_argnames`: the jitted function's static keyword arguments: part of the signature, and
    not passed to an executable (it was compiled for their values)."""

    def __init__(self, name: str, jitted, num_fixed_args: int = 1, static_argnames: tuple[str, ...] = ()):
        self.name = name
        self.jitted = jitted
        self.num_fixed_args = num_fixed_args
        self.static_argnames = static_argnames
        self.executables: dict[tuple, Callable] = {}

    def signature(self, args: tuple, kwargs: dict) -> tuple:
        static = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        dynamic = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jax.tree.flatten((args[self.num_fixed_args :], dynamic))
        return (static, treedef, tuple(leaf_signature(leaf) for leaf in leaves))

    def add(self, args: tuple, kwargs: dict, executable) -> None:
        """Route calls shaped like (args, kwargs) (arrays or shape structs) to `executable`."""
        self.executables[self.signature(args, kwargs)] = executable

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        executable = self.executables.get(self.signature(args, kwargs)) if self.executables else None
        if executable is None:
            return self.jitted(*args, **kwargs)
        if self.static_argnames:
            kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return executable(*args, **kwargs)

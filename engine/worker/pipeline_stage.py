"""Pipeline stages: which layers each stage holds, and how a stage's weights are cut from the checkpoint.

The layers split into `pipeline_parallel_size` contiguous ranges (as vLLM's `get_pp_indices`: the
remainder goes one layer each to the stages before the last, which also holds the LM head). Stage 0
also holds the embedding (and a vision-language model's encoder, which only it runs), the last stage the
final norm and the LM head (and the embedding again when the head is tied to it). A module a stage does
not run is kept as an empty placeholder array (vLLM's `PPMissingLayer`): the stage's model has the full
model's structure, so one graph definition and the family's own code run every stage.

In vLLM's text-only mode (`ModelConfig.text_only_mode`) no stage runs the encoder: no stage holds it, and
an engine without stages loads as one stage of every layer (worker/model_loader.py), so the tower's and
projector's weights never reach a device there either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """One stage of a pipeline: its decoder layers (HF indices) and its place in the pipeline."""

    index: int
    num_stages: int
    layers: range
    encoder_modules: tuple[str, ...] = ()  # a vision-language model's tower and projector: the first's
    text_only: bool = False  # vLLM's text-only mode: not even the first stage holds the encoder modules

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def holds(self, module: str, tie_word_embeddings: bool) -> bool:
        """Whether this stage runs the top-level, unstacked module `module`."""
        if module == "embed_tokens":
            return self.is_first or (self.is_last and tie_word_embeddings)
        if module in ("norm", "lm_head"):
            return self.is_last
        if module in self.encoder_modules:  # the images are encoded where they are merged
            return self.is_first and not self.text_only
        return True  # anything else a family adds at the top is kept on every stage

    def stack_slice(self, stack: Sequence[int]) -> slice:
        """The part of a layer stack holding the HF layers `stack` (increasing: a range, or a hybrid
        model's every P-th layer) that falls in this stage (maybe empty): one contiguous run of them."""
        inside = [index for index, layer in enumerate(stack) if layer in self.layers]
        return slice(inside[0], inside[-1] + 1) if inside else slice(0, 0)


def split_layers(
    num_layers: int, num_stages: int, encoder_modules: tuple[str, ...] = (), text_only: bool = False
) -> list[StageLayout]:
    """Contiguous stages of near-equal size, one layer more on each of the `remainder` stages before the
    last (ValueError naming pipeline_parallel_size when a stage would be left without a layer).
    `encoder_modules`: the model's (models/interfaces.py), held by the first stage only (by none with
    `text_only`)."""
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers "
            "(each stage needs at least one)"
        )
    size, remainder = divmod(num_layers, num_stages)
    larger = range(num_stages - 1 - remainder, num_stages - 1)
    stages, start = [], 0
    for index in range(num_stages):
        stop = start + size + (index in larger)
        stages.append(StageLayout(index, num_stages, range(start, stop), encoder_modules, text_only))
        start = stop
    return stages


def stage_devices(devices: list, tensor_parallel_size: int, num_stages: int) -> list[list]:
    """Each stage's tensor_parallel_size devices, in order; ValueError naming both sizes when too few, when
    a stage would span processes, or when a process (jax.distributed) would hold no stage."""
    needed = tensor_parallel_size * num_stages
    if needed > len(devices):
        raise ValueError(
            f"pipeline_parallel_size={num_stages} x tensor_parallel_size={tensor_parallel_size} needs "
            f"{needed} devices, {len(devices)} available"
        )
    groups = [devices[i * tensor_parallel_size : (i + 1) * tensor_parallel_size] for i in range(num_stages)]
    for index, group in enumerate(groups):
        # A stage's program runs in one process (several processes would each have to run it, and a
        # stage's tensor-parallel all-reduces would cross hosts): only the hand-over between stages may.
        processes = sorted({d.process_index for d in group})
        if len(processes) > 1:
            raise ValueError(
                f"pipeline_parallel_size={num_stages} x tensor_parallel_size={tensor_parallel_size}: stage "
                f"{index}'s devices span processes {processes}; each stage must lie in one process "
                "(tensor_parallel_size at most one process's devices, dividing them)"
            )
    # Every process runs the step: one without a stage would only wait on the others.
    idle = sorted({d.process_index for d in devices} - {group[0].process_index for group in groups})
    if idle:
        raise ValueError(
            f"pipeline_parallel_size={num_stages} x tensor_parallel_size={tensor_parallel_size} leaves "
            f"process(es) {idle} without a stage: the stages must use every process's devices"
        )
    return groups


def placeholder(ndim: int, dtype, sharding) -> jax.Array:
    """An empty array standing in for a weight this stage does not hold (never read)."""
    return jax.device_put(np.zeros((0,) * ndim, dtype), sharding)


def stage_place(
    place: Callable[[tuple[str, ...], np.ndarray], jax.Array],
    layout: StageLayout,
    stacks: dict[str, Sequence[int]],
    tie_word_embeddings: bool,
    replicated,
) -> Callable[[tuple[str, ...], np.ndarray], jax.Array]:
    """`place` for one stage: a stacked weight comes cut to the stage's layers (load_params reads only
    those: `held_layers`), a module the stage does not run becomes a placeholder, so only the stage's
    own weights are read from the checkpoint and reach its devices."""

    def placed(path: tuple[str, ...], array: np.ndarray) -> jax.Array:
        if path[0] not in stacks and not layout.holds(path[0], tie_word_embeddings):
            return placeholder(array.ndim, array.dtype, replicated)
        return place(path, array)

    # What load_params asks before it reads a parameter's tensors: a module this stage does not run
    # (text-only mode's encoder) is never read from the checkpoint, only its placeholder made; of a
    # layer stack, only the stage's layers are.
    placed.holds = lambda path: path[0] in stacks or layout.holds(path[0], tie_word_embeddings)
    placed.held_layers = lambda path: layout.stack_slice(stacks[path[0]])
    return placed


def slice_to_stage(
    params, layout: StageLayout, stacks: dict[str, Sequence[int]], tie_word_embeddings: bool, replicated
):
    """A whole model's placed params cut to one stage (dummy weights, drawn whole on the devices)."""

    def cut(path, leaf):
        top = str(getattr(path[0], "key", path[0]))
        if top in stacks:
            return leaf[layout.stack_slice(stacks[top])]
        if not layout.holds(top, tie_word_embeddings):
            return placeholder(leaf.ndim, leaf.dtype, replicated)
        return leaf

    return jax.tree_util.tree_map_with_path(cut, params)

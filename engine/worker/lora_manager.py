"""LoRAManager: the adapter slots on the device, and the adapters kept in host memory.

Per layer stack and target module, A [L, in, S, R] and B [L, S, R, out] (S = max_loras slots,
R = max_lora_rank) are allocated once, zeros, sharded like the module's kernel: A on the kernel's
input axis (row-parallel o_proj, down_proj), B on its output axis (column-parallel q/k/v, gate, up).
Slots are numbered 1..S here and in each token's slot id (device index s - 1); 0 is the base model,
which needs no device slot (models/lora.py). An adapter a step needs is written into a free slot (or the
least recently used one no request of the step needs) by one jitted update with the stacks donated,
compiled at warm-up, so loading or swapping adapters never recompiles the step. The scheduler admits
at most max_loras adapters among running requests, so a step never needs more slots than there are.

Host copies (already in the slots' layout) are kept for up to max_cpu_loras adapters, least
recently used first out, so swapping an adapter back in does not read its files again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from xlaserve.config import LoRAConfig
from xlaserve.kernels import cpu_dot
from xlaserve.kernels.dtype_ops import is_16bit_float, word_dtype
from xlaserve.lora_request import LoRARequest
from xlaserve.models.lora import LoRABatch, LoRAWeights
from xlaserve.models.lora_adapter import (
    LORA_TARGET_MODULES,
    AdapterConfig,
    SlotLayout,
    check_fits,
    load_adapter,
    read_adapter_config,
)
from xlaserve.worker.input_batch import isolate_failures
from xlaserve.worker.pipeline_stage import StageLayout

logger = logging.getLogger(__name__)


def slot_layout(params, stack_names) -> SlotLayout:
    """stack -> module path inside a layer -> (num_layers, in, out), for every supported projection."""
    layout: SlotLayout = {}
    # A kernel packed for the CPU's dot (kernels/cpu_dot.py) is one leaf, with its [L, in, out] shape.
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=cpu_dot.is_packed)[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if keys[0] in stack_names and keys[-1] in ("kernel", "value") and len(leaf.shape) == 3:
            names = keys[1:-1] if keys[-1] == "kernel" else keys[1:-2]
            if names and names[-1] in LORA_TARGET_MODULES:
                layout.setdefault(keys[0], {})[".".join(names)] = tuple(leaf.shape)
    return layout


@dataclasses.dataclass(frozen=True)
class SlotHolder:
    """Where one set of slot stacks lives: a model's placed params (their projections' shapes) and
    placement, and the pipeline stage whose layers it holds (None: every layer)."""

    params: object
    placement: object  # sharding/mesh.py Placement
    stage: StageLayout | None = None

    def layers(self, stack: range) -> slice:
        """The part of a layer stack (its HF layers `stack`) held here."""
        return slice(None) if self.stage is None else self.stage.stack_slice(stack)


def _write_slot(stacks: dict[str, LoRAWeights], slot, new: dict[str, LoRAWeights]) -> dict[str, LoRAWeights]:
    """Every module's A[:, :, slot] and B[:, slot] = new's ([L, in, R] and [L, R, out])."""
    return {
        name: LoRAWeights(
            a={k: v.at[:, :, slot].set(new[name].a[k]) for k, v in stack.a.items()},
            b={k: v.at[:, slot].set(new[name].b[k]) for k, v in stack.b.items()},
        )
        for name, stack in stacks.items()
    }


class LoRAManager:
    def __init__(
        self, lora_config: LoRAConfig, model_class, model_config, dtype, holders: list[SlotHolder | None]
    ):
        """`holders`: one for a runner's model, one per stage for a pipeline's (in the stages' order:
        `batch(slot_ids, stage)` indexes them; None for another process's stage, which holds its slots
        there)."""
        layer_classes = getattr(model_class, "layer_classes", tuple)()
        if not layer_classes or not all(getattr(c, "supports_lora", False) for c in layer_classes):
            raise ValueError(
                f"enable_lora: {model_class.__name__} does not support LoRA adapters yet "
                "(supported: the Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, Mixtral, Qwen3-MoE, "
                "Qwen3.5, Qwen3-Next and Granite 4.0-H families)"
            )
        self.max_loras = lora_config.max_loras
        self.max_rank = lora_config.max_lora_rank
        self.max_cpu_loras = lora_config.num_cpu_loras
        self.layer_stacks = model_class.layer_stacks(model_config)
        self._prepare = lambda tensors: model_class.prepare_hf_tensors(model_config, tensors)
        # The whole model's layout (the adapters' files and the front end's checks see every layer),
        # from the holders' projections: a stage's stacks hold only its layers, maybe none of a stack
        # (an empty slice of it: every stage's model has every stack's projections).
        self.layout = {}
        for holder in filter(None, holders):
            for stack, modules in slot_layout(holder.params, tuple(self.layer_stacks)).items():
                num_layers = len(self.layer_stacks[stack])
                for module, (_, din, dout) in modules.items():
                    self.layout.setdefault(stack, {})[module] = (num_layers, din, dout)
        if not any(self.layout.values()):
            raise ValueError(f"enable_lora: {model_class.__name__} has no projection an adapter could target")
        # On CPU in 16 bits the slots are stored as words, like the layer stacks (kernels/dtype_ops.py).
        self.dtype = jnp.dtype(dtype)
        self._as_words = jax.default_backend() == "cpu" and is_16bit_float(self.dtype)
        store = word_dtype(self.dtype) if self._as_words else self.dtype
        num_slots = self.max_loras  # on the device; the bookkeeping below adds slot 0, the base model
        self.holders = holders
        # Per holder, stack -> its slots (the stacks it holds no layer of are left out).
        self.stacks: list[dict[str, LoRAWeights]] = []
        self._host_dtype = np.dtype(self.dtype)
        for holder in holders:
            stacks = {}
            for stack, modules in self.layout.items() if holder is not None else ():
                num_layers = len(self.layer_stacks[stack][holder.layers(self.layer_stacks[stack])])
                if not num_layers:
                    continue
                a, b = {}, {}
                for module, (_, din, dout) in modules.items():
                    name, placement = module.rsplit(".", 1)[-1], holder.placement
                    a[module] = placement.zeros(
                        (num_layers, din, num_slots, self.max_rank), store, placement.lora_sharding(name, "a")
                    )
                    b[module] = placement.zeros(
                        (num_layers, num_slots, self.max_rank, dout),
                        store,
                        placement.lora_sharding(name, "b"),
                    )
                stacks[stack] = LoRAWeights(a, b)
            self.stacks.append(stacks)
        self._write = jax.jit(_write_slot, donate_argnums=0)
        self._slot_owner: list[int | None] = [None] * (num_slots + 1)  # slot -> lora_int_id (0: base)
        self._slot_used: list[float] = [0.0] * (num_slots + 1)
        self._host: OrderedDict[int, dict] = OrderedDict()  # lora_int_id -> weights in slot layout
        self._configs: dict[int, tuple[LoRARequest, AdapterConfig]] = {}
        self.num_loads = 0  # adapters written into a slot
        # (slot, adapter) written since `take_loads`: across processes the followers, which never
        # prepare a step, write the same slots before it (executor/multihost.py).
        self.loads: list[tuple[int, LoRARequest]] = []

    @property
    def num_host_loras(self) -> int:
        """Adapters held in host memory (at most max_cpu_loras)."""
        return len(self._host)

    # -- adapters ---------------------------------------------------------------------------------

    def check(self, lora: LoRARequest) -> AdapterConfig:
        """Validate the adapter's config and tensor names (cached per id): a LoRAAdapterError naming
        the adapter and the field when it cannot be served."""
        cached = self._configs.get(lora.lora_int_id)
        if cached is not None and cached[0] == lora:
            return cached[1]
        config = read_adapter_config(lora.lora_name, lora.lora_path, self.max_rank)
        check_fits(config, self.layout, self.layer_stacks)
        if cached is not None:  # the same id for another adapter: forget the old one's copies
            self._host.pop(lora.lora_int_id, None)
            self._slot_owner = [None if owner == lora.lora_int_id else owner for owner in self._slot_owner]
        self._configs[lora.lora_int_id] = (lora, config)
        return config

    def _host_weights(self, lora: LoRARequest) -> dict:
        weights = self._host.get(lora.lora_int_id)
        if weights is None:
            weights = load_adapter(
                self.check(lora), self.layout, self.layer_stacks, self._prepare, self.max_rank
            )
            self._host[lora.lora_int_id] = weights
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(lora.lora_int_id)
        return weights

    def _new_slot_values(self, weights: dict | None) -> dict[str, LoRAWeights]:
        """The host arrays one slot takes: the adapter's, zeros for the modules it does not target."""
        out = {}
        for stack, modules in self.layout.items():
            a, b = {}, {}
            for module, (num_layers, din, dout) in modules.items():
                pair = (weights or {}).get(stack, {}).get(module)
                if pair is None:
                    pair = (
                        np.zeros((num_layers, din, self.max_rank)),
                        np.zeros((num_layers, self.max_rank, dout)),
                    )
                a[module], b[module] = (self._store(x) for x in pair)
            out[stack] = LoRAWeights(a, b)
        return out

    def _store(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(self._host_dtype)
        return x.view(np.uint16) if self._as_words else x

    def _load_into_slot(self, slot: int, weights: dict | None) -> None:
        """Write the adapter's slot values (None: zeros) into `slot` of every holder, each its layers'
        part (cut on the host, as a stage's weights are)."""
        new = self._new_slot_values(weights)
        for i, (holder, stacks) in enumerate(zip(self.holders, self.stacks)):
            if holder is None:  # another process's stage: that process writes its slot
                continue
            part = {}
            for stack in stacks:
                layers = holder.layers(self.layer_stacks[stack])
                part[stack] = jax.tree.map(lambda x, layers=layers: x[layers], new[stack])
            ready = holder.placement.own_inputs  # across processes: replicated, placed by each alone
            self.stacks[i] = self._write(stacks, ready(np.int32(slot - 1)), ready(part))

    # -- per step ---------------------------------------------------------------------------------

    def slot_of(self, lora: LoRARequest, needed: set[int]) -> int:
        """The slot holding `lora`, writing it into one first if none does; `needed`: the ids this step
        uses, whose slots must not be taken."""
        lora_id = lora.lora_int_id
        if lora_id in self._slot_owner[1:]:
            slot = self._slot_owner.index(lora_id, 1)
        else:
            free = [s for s in range(1, len(self._slot_owner)) if self._slot_owner[s] not in needed]
            if not free:
                raise RuntimeError(
                    f"no free LoRA slot for adapter {lora.lora_name!r}: max_loras={self.max_loras}"
                )
            slot = min(free, key=lambda s: (self._slot_owner[s] is not None, self._slot_used[s]))
            self.put_in_slot(slot, lora)
            if jax.process_count() > 1:
                self.loads.append((slot, lora))
        self._slot_used[slot] = time.monotonic()
        return slot

    def put_in_slot(self, slot: int, lora: LoRARequest) -> None:
        """Write `lora` into `slot` (a follower process: the slot process 0 chose)."""
        t0 = time.perf_counter()
        self._slot_owner[slot] = None  # if loading fails, the slot holds nothing valid
        self._load_into_slot(slot, self._host_weights(lora))
        self._slot_owner[slot] = lora.lora_int_id
        self.num_loads += 1
        logger.info("LoRA adapter %r in slot %d (%.3fs)", lora.lora_name, slot, time.perf_counter() - t0)

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        loads, self.loads = self.loads, []
        return loads

    def step_slot_ids(self, scheduled, num_tokens: int, failed: set[str]) -> np.ndarray:
        """Each token's slot ([num_tokens] int32; padding and base-model tokens 0), writing the step's
        adapters into slots first. A request whose adapter cannot be loaded is added to `failed`."""
        slot_ids = np.zeros(num_tokens, np.int32)
        needed = {s.request.lora_id for s in scheduled if s.request.lora_request is not None}
        offset = 0
        for s in scheduled:
            if s.request.lora_request is not None:
                isolate_failures(
                    failed, s, "loading its LoRA adapter", self._fill, slot_ids, offset, s, needed
                )
            offset += s.num_new_tokens
        return slot_ids

    def _fill(self, slot_ids: np.ndarray, offset: int, s, needed: set[int]) -> None:
        slot_ids[offset : offset + s.num_new_tokens] = self.slot_of(s.request.lora_request, needed)

    def batch(self, slot_ids, stage: int = 0) -> LoRABatch:
        """What the forward (of pipeline stage `stage`) takes: its slots and each token's slot ([T] int32)."""
        return LoRABatch(self.stacks[stage], slot_ids)

    def warm_up(self) -> None:
        """Compile the slot update of every holder (a write of zeros into slot 1) before the compile
        guard arms."""
        self._load_into_slot(1, None)
        jax.block_until_ready(self.stacks)

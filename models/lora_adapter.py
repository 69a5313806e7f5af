"""PEFT LoRA adapters on the host: read and validate a directory, and lay its weights out for the slots.

A PEFT directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors`, whose tensors are named like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (A: [r, in], B: [out, r], PyTorch's
[out, in] layout). We keep A as [in, r] and B as [r, out] scaled by alpha / r (rsLoRA: alpha / sqrt(r)),
both padded with zeros to the engine's max rank, so every adapter fits the same slot shapes.

Everything an adapter asks for that we do not apply is an error naming the adapter and the field,
never ignored: a target other than the attention and MLP projections (embed_tokens, lm_head), a rank
above --max-lora-rank, DoRA, trained biases, per-module rank or alpha patterns, modules_to_save.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Hugging Face module names an adapter may target, as our decoder layers name them too.
LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",  # Phi-3's fused q, k, v (regrouped per KV head at load: models/phi3.py)
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",  # Phi-3's fused gate and up (interleaved at load)
)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# layers.{i}.{module path}.lora_{A|B}[.{adapter name}].weight, after any prefix.
_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.([\w.]+?)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: the message names the adapter and the field (`field`)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class AdapterConfig:
    name: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(name: str, path: str, max_rank: int) -> AdapterConfig:
    """Validate `path`'s adapter_config.json and its tensors' names and ranks (the safetensors header
    only): a LoRAAdapterError naming the adapter and the field for anything we cannot apply."""

    def fail(field: str, message: str):
        raise LoRAAdapterError(f"LoRA adapter {name!r} ({path}): {field}: {message}", field)

    config_file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isdir(path):
        fail("path", "not a directory")
    if not os.path.isfile(config_file):
        fail("path", f"no {ADAPTER_CONFIG} in it")
    if not os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS)):
        fail("path", f"no {ADAPTER_WEIGHTS} in it (only safetensors adapters are read)")
    try:
        with open(config_file) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        fail(ADAPTER_CONFIG, f"not readable JSON ({e})")
    if not isinstance(hf, dict):
        fail(ADAPTER_CONFIG, "must hold a JSON object")
    if hf.get("peft_type", "LORA") != "LORA":
        fail("peft_type", f"only LORA is supported, got {hf.get('peft_type')!r}")
    rank = hf.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        fail("r", f"must be a positive integer, got {rank!r}")
    if rank > max_rank:
        fail("r", f"rank {rank} is above max_lora_rank={max_rank} (--max-lora-rank)")
    alpha = hf.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        fail("lora_alpha", f"must be a number, got {alpha!r}")
    for field, bad in (
        ("use_dora", bool(hf.get("use_dora"))),
        ("bias", hf.get("bias", "none") != "none"),
        ("modules_to_save", bool(hf.get("modules_to_save"))),
        ("rank_pattern", bool(hf.get("rank_pattern"))),
        ("alpha_pattern", bool(hf.get("alpha_pattern"))),
    ):
        if bad:
            fail(field, f"{hf.get(field)!r} is not supported")
    targets = hf.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(LORA_TARGET_MODULES))
        if unsupported:
            fail("target_modules", f"{unsupported} not supported; supported: {list(LORA_TARGET_MODULES)}")
    for key, shape in _tensor_shapes(path).items():
        match = _TENSOR_NAME.search(key)
        module = match.group(2).rsplit(".", 1)[-1] if match else key.split(".lora_")[0].rsplit(".", 1)[-1]
        if match is None or module not in LORA_TARGET_MODULES:
            fail(
                "target_modules",
                f"tensor {key!r} targets {module!r}, which is not supported; "
                f"supported: {list(LORA_TARGET_MODULES)}",
            )
        tensor_rank = shape[0] if match.group(3) == "A" else shape[-1]
        if len(shape) != 2 or tensor_rank != rank:
            fail("r", f"tensor {key!r} {list(shape)} does not have rank r={rank}")
    return AdapterConfig(name, path, rank, float(alpha), bool(hf.get("use_rslora", False)))


def _tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(os.path.join(path, ADAPTER_WEIGHTS), framework="numpy") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


# A model's slots, as the runner lays them out: stack name -> module path -> (num_layers, in, out).
SlotLayout = dict[str, dict[str, tuple[int, int, int]]]


def check_fits(config: AdapterConfig, layout: SlotLayout, layer_stacks: dict[str, Sequence[int]]) -> None:
    """Every tensor of the adapter (the safetensors header only) names a layer of this model and a
    projection it has a slot for, with the projection's shape: else a LoRAAdapterError naming the
    module. This is where a target the family lacks is refused when the adapter is checked: a MoE's
    routed experts (`mlp.experts.3.gate_proj`), a q_proj on a model whose q, k, v are fused."""

    def fail(field: str, message: str):
        raise LoRAAdapterError(f"LoRA adapter {config.name!r} ({config.path}): {field}: {message}", field)

    where = {layer: (stack, i) for stack, layers in layer_stacks.items() for i, layer in enumerate(layers)}
    for key, shape in _tensor_shapes(config.path).items():
        match = _TENSOR_NAME.search(key)
        if match is None:
            fail("target_modules", f"tensor {key!r} is not a supported target")
        layer, module, side = int(match.group(1)), match.group(2), match.group(3)
        if layer not in where:
            fail(
                "target_modules", f"tensor {key!r}: layer {layer} is not a layer of this model ({len(where)})"
            )
        stack = where[layer][0]
        if module not in layout[stack]:
            why = (
                " (a mixture of experts' routed experts are no LoRA target)" if ".experts." in module else ""
            )
            fail(
                "target_modules",
                f"module {module!r} (layer {layer}) is not supported by this model{why}; "
                f"supported: {sorted(layout[stack])}",
            )
        _, din, dout = layout[stack][module]
        if tuple(shape[1:] if side == "A" else shape[:1]) != ((din,) if side == "A" else (dout,)):
            fail(
                "adapter_model.safetensors",
                f"tensor {key!r} {list(shape)} does not fit the model's [{dout}, {din}] {module!r}",
            )


def load_adapter(
    config: AdapterConfig,
    layout: SlotLayout,
    layer_stacks: dict[str, Sequence[int]],
    prepare_hf_tensors,
    max_rank: int,
) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The adapter's weights in the slots' layout, as float32: stack -> module path -> (A [L, in, R],
    B [L, R, out] scaled), R = max_rank, for the modules it targets (the others are zeros).

    `prepare_hf_tensors(tensors)`: the family's checkpoint rewrite, applied to each B as if it were
    the module's weight, so a fused projection's B is regrouped like its kernel (Phi-3)."""
    from safetensors.numpy import load_file

    def fail(field: str, message: str):
        raise LoRAAdapterError(f"LoRA adapter {config.name!r} ({config.path}): {field}: {message}", field)

    where = {layer: (stack, i) for stack, layers in layer_stacks.items() for i, layer in enumerate(layers)}
    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    tensors = load_file(os.path.join(config.path, ADAPTER_WEIGHTS))
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, array in tensors.items():
        match = _TENSOR_NAME.search(key)
        if match is None:
            fail("target_modules", f"tensor {key!r} is not a supported target")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = array
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            fail(
                "adapter_model.safetensors", f"layer {layer} {module}: lora_A and lora_B must both be present"
            )
        if layer not in where:
            fail("target_modules", f"layer {layer} is not a layer of this model ({len(where)} layers)")
        stack, index = where[layer]
        if module not in layout[stack]:
            fail("target_modules", f"{module!r} is not a projection of this model: {sorted(layout[stack])}")
        num_layers, din, dout = layout[stack][module]
        a = np.asarray(ab["A"], np.float32).T  # [in, r]
        name = f"model.layers.{layer}.{module}.weight"
        b = np.asarray(prepare_hf_tensors({name: np.asarray(ab["B"], np.float32)})[name]).T  # [r, out]
        if a.shape[0] != din or b.shape[1] != dout:
            fail(
                "adapter_model.safetensors",
                f"layer {layer} {module}: A {list(ab['A'].shape)}, B {list(ab['B'].shape)} do not fit the "
                f"model's [{dout}, {din}] projection",
            )
        if stack not in out or module not in out[stack]:
            out.setdefault(stack, {})[module] = (
                np.zeros((num_layers, din, max_rank), np.float32),
                np.zeros((num_layers, max_rank, dout), np.float32),
            )
        stack_a, stack_b = out[stack][module]
        stack_a[index, :, : config.rank] = a
        stack_b[index, : config.rank] = b * config.scaling
    return out

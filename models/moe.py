"""Mixture of experts, shared by Mixtral, Qwen3-MoE and DeepSeek V2/V3.

A router scores every expert for every token and keeps the top k; the chosen (token, expert)
pairs are sorted by expert so each expert's tokens are contiguous, and the experts' SwiGLU MLPs run
as three grouped matmuls (`jax.lax.ragged_dot`) over that sorted array. No expert is looped over,
and no token goes through an expert that did not choose it (on GPU/TPU; XLA's CPU lowering of
ragged_dot is a masked dense matmul). DeepSeek adds shared experts that every token goes through.

Checkpoints store one tensor per expert ("...experts.{e}.w1.weight"); `stack_expert_tensors`
stacks them into the [num_experts, out, in] arrays the loader expects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels.dtype_ops import matmul
from xlaserve.kernels.invariant import invariant_softmax, invariant_sum
from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import GatedMLP
from xlaserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from xlaserve.models.quantization import QuantizedKernel, stack_tensors
from xlaserve.models.safetensors_loader import CheckpointTensor, DerivedTensor, split_halves

SCORING_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class MoEConfig(TransformerConfig):
    """A decoder whose MLP is a routed mixture of experts.

    Routing: scores = softmax or sigmoid of the router logits; with `n_group` > 1 only the
    `topk_group` best groups of experts compete (a group's score: its best expert's, or, with
    "top2_sum", its best two's sum, DeepSeek V3's); the top `num_experts_per_tok` experts are kept,
    chosen on `scores + e_score_correction_bias` when the checkpoint has that bias; their weights are
    their scores, renormalized to sum to 1 when `norm_topk_prob`, times `routed_scaling_factor`.
    """

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    routed_scaling_factor: float = 1.0
    has_score_correction_bias: bool = False
    n_shared_experts: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"n_group={self.n_group} must divide num_experts={self.num_experts} and "
                f"topk_group={self.topk_group} must be in [1, n_group]"
            )
        if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
            raise ValueError(
                f"topk_group={self.topk_group} groups of {self.num_experts // self.n_group} experts hold "
                f"fewer than num_experts_per_tok={self.num_experts_per_tok}"
            )

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        """The routing fields every family spells alike; the family adds `num_experts` (each names it
        differently), and `norm_topk_prob` keeps the family's default when the config omits it."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
        fields = {
            **super().fields_from_hf(hf),
            "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf.get("moe_intermediate_size") or hf["intermediate_size"],
        }
        if "norm_topk_prob" in hf:
            fields["norm_topk_prob"] = bool(hf["norm_topk_prob"])
        return fields


def check_all_layers_sparse(family: str, hf: dict[str, Any]) -> None:
    """Refuse a Qwen-style config with dense MLP layers among the sparse ones (one layer stack only)."""
    if hf.get("mlp_only_layers") or (hf.get("decoder_sparse_step") or 1) != 1:
        raise ValueError(
            f"{family} with dense layers (mlp_only_layers={hf.get('mlp_only_layers')}, "
            f"decoder_sparse_step={hf.get('decoder_sparse_step')}) is not supported: every layer "
            "must be sparse, as in the released models"
        )


# -- routing ---------------------------------------------------------------------------------------


def route(
    cfg: MoEConfig,
    logits: jax.Array,  # [T, E] float32
    correction_bias: jax.Array | None = None,  # [E]
) -> tuple[jax.Array, jax.Array]:  # weights [T, K] float32, expert ids [T, K] int32
    """Pick each token's experts and their weights (see MoEConfig for the rule)."""
    num_tokens, num_experts = logits.shape
    scores = invariant_softmax(logits) if cfg.scoring_func == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if cfg.topk_group < cfg.n_group:
        grouped = choice.reshape(num_tokens, cfg.n_group, num_experts // cfg.n_group)
        if cfg.group_score == "max":
            group_scores = grouped.max(axis=-1)
        else:
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        _, best_groups = jax.lax.top_k(group_scores, cfg.topk_group)  # [T, topk_group]
        is_kept_group = jax.nn.one_hot(best_groups, cfg.n_group, dtype=jnp.bool_).any(axis=1)  # [T, G]
        is_kept = jnp.repeat(is_kept_group, num_experts // cfg.n_group, axis=1)  # [T, E]
        # DeepSeek V2 zeroes the dropped groups' softmax scores; V3 sends its biased sigmoid ones to -inf.
        choice = jnp.where(is_kept, choice, -jnp.inf if cfg.scoring_func == "sigmoid" else 0.0)
    _, expert_ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if cfg.norm_topk_prob:
        denominator = invariant_sum(weights, keepdims=True)
        weights = weights / (denominator + 1e-20 if cfg.scoring_func == "sigmoid" else denominator)
    return weights * cfg.routed_scaling_factor, expert_ids.astype(jnp.int32)


# -- experts ---------------------------------------------------------------------------------------


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def grouped_expert_mlp(
    x: jax.Array,  # [T, D]
    weights: jax.Array,  # [T, K] routing weights
    expert_ids: jax.Array,  # [T, K] int32
    w_gate: jax.Array,  # [E, D, F]
    w_up: jax.Array,  # [E, D, F]
    w_down: jax.Array,  # [E, F, D]
    *,
    glu=swiglu,  # (gate, up) -> the down projection's input
    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,  # [E, F], [E, F], [E, D] (gpt-oss)
) -> jax.Array:  # [T, D]
    """sum_k weights[t, k] * down_e(glu(gate_e(x_t), up_e(x_t))) with e = expert_ids[t, k].

    The T*K (token, expert) pairs are sorted by expert, so `group_sizes[e]` consecutive rows belong
    to expert e and each projection is one `ragged_dot` (plus, with `biases`, each row's expert's
    bias); the results are unsorted and summed over k in a fixed order (deterministic, unlike a
    scatter-add).
    """
    num_tokens, top_k = expert_ids.shape
    num_experts = w_gate.shape[0]
    flat_ids = expert_ids.reshape(-1)  # [T*K]
    order = jnp.argsort(flat_ids, stable=True)  # [T*K]: pair index, sorted by expert
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)  # [E]
    x_sorted = x[order // top_k]  # [T*K, D]
    gate = jax.lax.ragged_dot(x_sorted, w_gate, group_sizes)
    up = jax.lax.ragged_dot(x_sorted, w_up, group_sizes)
    if biases is not None:
        sorted_ids = flat_ids[order]  # [T*K]: each row's expert
        gate, up = gate + biases[0][sorted_ids], up + biases[1][sorted_ids]
    out_sorted = jax.lax.ragged_dot(glu(gate, up), w_down, group_sizes)  # [T*K, D]
    if biases is not None:
        out_sorted = out_sorted + biases[2][sorted_ids]
    out_pairs = jnp.zeros_like(out_sorted).at[order].set(out_sorted)  # back to [t, k] order
    out_tkd = out_pairs.reshape(num_tokens, top_k, -1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", out_tkd, weights.astype(jnp.float32)).astype(x.dtype)


class Router(nnx.Module):
    """The router ("gate"): logits = x @ W (+ b, gpt-oss) in float32, W stored [D, E]; DeepSeek V3's
    score bias."""

    def __init__(self, cfg: MoEConfig, *, dtype, rngs: nnx.Rngs, use_bias: bool = False):
        init = jax.nn.initializers.normal(0.02)
        self.kernel = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.num_experts), dtype))
        self.bias = nnx.Param(jnp.zeros((cfg.num_experts,), dtype)) if use_bias else None
        self.e_score_correction_bias = (
            nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32)) if cfg.has_score_correction_bias else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, E] float32
        # A float32 dot through `matmul`: a decode step's few rows are padded with batch invariance on (XLA
        # CPU's one-row dot rounds otherwise than the same row among others, and routing follows).
        logits = matmul(x.astype(jnp.float32), self.kernel[...].astype(jnp.float32))
        return logits if self.bias is None else logits + self.bias[...].astype(jnp.float32)


class ExpertLinear(QuantizedKernel, nnx.Module):
    """One [in, out] matrix per expert, stacked: kernel [E, in, out] (quantizable: scales [E, out]),
    and with `use_bias` a bias per expert, [E, out]."""

    def __init__(self, num_experts: int, din: int, dout: int, *, dtype, rngs: nnx.Rngs, use_bias=False):
        init = jax.nn.initializers.normal(0.02)
        self.kernel = nnx.Param(init(rngs.params(), (num_experts, din, dout), dtype))
        self.bias = nnx.Param(jnp.zeros((num_experts, dout), dtype)) if use_bias else None


class SparseMoeBlock(nnx.Module):
    """Routed experts (plus shared experts when the family has them), in place of the dense MLP."""

    def __init__(self, cfg: MoEConfig, *, dtype, rngs: nnx.Rngs):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.gate = Router(cfg, dtype=dtype, rngs=rngs)
        self.experts_gate = ExpertLinear(e, d, f, dtype=dtype, rngs=rngs)
        self.experts_up = ExpertLinear(e, d, f, dtype=dtype, rngs=rngs)
        self.experts_down = ExpertLinear(e, f, d, dtype=dtype, rngs=rngs)
        self.shared_experts = (
            GatedMLP(cfg.replace(intermediate_size=f * cfg.n_shared_experts), dtype=dtype, rngs=rngs)
            if cfg.n_shared_experts
            else None
        )
        self.cfg = cfg

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        """LoRA adapters reach the shared experts' dense projections only (they are `Linear`s); the
        routed experts and the router are no LoRA target (an adapter naming them is refused when it is
        checked: worker/lora_manager.py)."""
        bias = None if self.gate.e_score_correction_bias is None else self.gate.e_score_correction_bias[...]
        weights, expert_ids = route(self.cfg, self.gate(x), bias)
        out = grouped_expert_mlp(
            x,
            weights,
            expert_ids,
            # A quantized expert stack is dequantized inside the step (fused into ragged_dot's operand).
            self.experts_gate.dequantized_kernel(x.dtype),
            self.experts_up.dequantized_kernel(x.dtype),
            self.experts_down.dequantized_kernel(x.dtype),
        )
        if self.shared_experts is None:
            return out
        return out + self.shared_experts(x)


class MoEDecoderLayer(LlamaDecoderLayer):
    """The Llama decoder layer with a SparseMoeBlock as its MLP (Mixtral, Qwen3-MoE)."""

    mlp_class = SparseMoeBlock


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama model with MoE layers (a family's layer class may change their attention or MLP),
    its checkpoint's per-expert tensors stacked at load."""

    layer_class = MoEDecoderLayer

    @classmethod
    def prepare_hf_tensors(cls, cfg: MoEConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return stack_expert_tensors(tensors, cfg.num_experts)


# -- checkpoints -----------------------------------------------------------------------------------

# Per-expert projection names in checkpoints -> ours (Mixtral's w1/w3/w2, everyone else's *_proj).
_EXPERT_PROJECTIONS = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
_PER_EXPERT = re.compile(
    r"^(?P<block>.+\.layers\.\d+\.\w+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$"
)
_FUSED = re.compile(r"^(?P<block>.+\.layers\.\d+\.\w+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def _stacked(experts: list):
    """The experts' tensors as one [E, ...]: for a checkpoint's, read when used (a `DerivedTensor` that
    reads them one by one into its array), so a start holds one parameter's experts at a time, not
    every layer's from the rewrite on; any other (a trainer's arrays, `QuantizedTensor`s) now."""
    first = experts[0]
    lazy = all(
        isinstance(e, CheckpointTensor) and e.shape == first.shape and e.dtype == first.dtype for e in experts
    )
    if not lazy:
        return stack_tensors(experts)

    def stack() -> np.ndarray:
        out = np.empty((len(experts), *first.shape), first.dtype)
        for i, expert in enumerate(experts):
            out[i] = expert.read()
        return out

    return DerivedTensor(stack, (len(experts), *first.shape), first.dtype, source=first.path)


def stack_expert_tensors(tensors: dict[str, np.ndarray], num_experts: int) -> dict[str, np.ndarray]:
    """Per-expert checkpoint tensors -> one [E, out, in] tensor per projection and layer.

    "{block}.experts.{e}.w1.weight" (or gate_proj) for e < E become "{block}.experts_gate.weight";
    transformers 5's fused in-memory layout ("{block}.experts.gate_up_proj" [E, 2F, D],
    "{block}.experts.down_proj" [E, D, F]) is accepted too. A missing expert is an error naming it.
    """
    out: dict[str, np.ndarray] = {}
    per_expert: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, array in tensors.items():
        if (m := _PER_EXPERT.match(name)) and m["proj"] in _EXPERT_PROJECTIONS:
            key = (m["block"], m["proj"])
            per_expert.setdefault(key, {})[int(m["expert"])] = array
        elif m := _FUSED.match(name):
            if m["proj"] == "down_proj":
                out[f"{m['block']}.experts_down.weight"] = array
            else:
                gate, up = split_halves(array, axis=1)
                out[f"{m['block']}.experts_gate.weight"] = gate
                out[f"{m['block']}.experts_up.weight"] = up
        else:
            out[name] = array
    missing = []
    for (block, proj), experts in sorted(per_expert.items()):
        absent = [e for e in range(num_experts) if e not in experts]
        missing += [f"{block}.experts.{e}.{proj}.weight" for e in absent]
        if not absent:
            ours = _EXPERT_PROJECTIONS[proj]
            out[f"{block}.experts_{ours}.weight"] = _stacked([experts[e] for e in range(num_experts)])
            # Experts past num_experts stay under their own names: the loader reports them as unexpected.
        for e in sorted(set(experts) - set(range(num_experts))):
            out[f"{block}.experts.{e}.{proj}.weight"] = experts[e]
    if missing:
        raise ValueError(
            f"checkpoint is missing expert tensors {missing[:8]}{'...' if len(missing) > 8 else ''}"
        )
    return out

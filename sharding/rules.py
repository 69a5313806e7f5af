"""Logical axis names for parameters and the KV cache, and the one set of rules mapping them to
mesh axes. Models never name devices: a parameter's logical axes are looked up here by the tail
of its path (module name, parameter name), which every family shares with Hugging Face.

Under tensor parallelism every parameter of two or more dimensions (per layer) must have a rule:
one that matches none would otherwise be replicated on every device without a word, costing its
whole size on each device and, for a weight its neighbours expect split, a gather in every step.
A weight that is meant to be whole everywhere says so with a rule whose axes map to no mesh axis.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

# (module, parameter) -> logical axes of the parameter, without the leading stacked-layer axis. A
# key of three names, (parent, module, parameter), is looked up first: a module name several kinds of
# layer share (a conv, an out_proj) gets its rule from the layer around it.
PARAM_AXES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    # The vocabulary-parallel embedding and LM head: sharding/vocab.py pads the vocabulary so it
    # splits evenly.
    ("embed_tokens", "weight"): ("vocab", "embed"),
    ("embed_tokens", "kernel"): ("embed", "vocab"),  # a quantized table, stored as the head's [D, V]
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "q_heads"),
    ("q_proj", "bias"): ("q_heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("q_heads", "embed"),
    # Fused projections (Phi-3). The loader regroups their columns (models/phi3.py) so that a
    # contiguous split is a split by head: qkv_proj holds, per KV head, its query heads then its k
    # and v; gate_up_proj interleaves gate and up column by column. Each device then holds its own
    # heads' q, k, v and its own slice of gate and up, as with the separate projections.
    ("qkv_proj", "kernel"): ("embed", "kv_heads"),
    ("qkv_proj", "bias"): ("kv_heads",),
    ("gate_up_proj", "kernel"): ("embed", "mlp"),
    ("gate_up_proj", "bias"): ("mlp",),
    # Multi-head latent attention (DeepSeek): the up-projections out of the shared latents are
    # column-parallel over heads; the down-projections into them (q_a_proj, kv_a_proj_with_mqa) and
    # the latent cache stay replicated, since every head reads the same latents (under decode context
    # parallel the latent cache is interleaved over the ranks instead: sharding/context_parallel.py).
    ("q_b_proj", "kernel"): ("q_lora", "q_heads"),
    ("kv_b_proj", "kernel"): ("kv_lora", "q_heads"),
    ("q_a_proj", "kernel"): ("embed", "q_lora"),
    ("kv_a_proj_with_mqa", "kernel"): ("embed", "kv_lora"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "bias"): ("mlp",),
    ("down_proj", "kernel"): ("mlp", "embed"),
    # Mixture of experts: [experts, in, out] stacks, and the router, replicated: every device
    # routes every token (its [D, E] weight is small).
    ("experts_gate", "kernel"): ("expert", "embed", "expert_mlp"),
    ("experts_up", "kernel"): ("expert", "embed", "expert_mlp"),
    ("experts_down", "kernel"): ("expert", "expert_mlp", "embed"),
    ("gate", "kernel"): ("embed", "router"),
    ("shared_expert_gate", "kernel"): ("embed", "router"),  # Qwen3-Next's one logit per token
    # gpt-oss: biases per expert, split like the experts' outputs; a sink logit per query head.
    ("experts_gate", "bias"): ("expert", "expert_mlp"),
    ("experts_up", "bias"): ("expert", "expert_mlp"),
    ("experts_down", "bias"): ("expert", "embed"),
    ("self_attn", "sinks"): ("q_heads",),
    # Gated DeltaNet (Qwen3.5, Qwen3-Next): split by key head, each with its value heads. q, k, v are
    # grouped per key head in in_proj_qkv's columns and the conv's channels (models/qwen3_5.py), so a
    # contiguous split is whole key heads; z, b, a, the decay's parameters and the recurrent state
    # split by value head (in the same groups); out_proj is row-parallel, summed like o_proj.
    ("in_proj_qkv", "kernel"): ("embed", "linear_heads"),
    ("in_proj_z", "kernel"): ("embed", "linear_heads"),
    ("in_proj_b", "kernel"): ("embed", "linear_heads"),
    ("in_proj_a", "kernel"): ("embed", "linear_heads"),
    ("linear_attn", "conv1d", "weight"): ("linear_heads", None, None),
    ("linear_attn", "dt_bias"): ("linear_heads",),
    ("linear_attn", "A_log"): ("linear_heads",),
    ("linear_attn", "out_proj", "kernel"): ("linear_heads", "embed"),
    # LLaVA's CLIP vision tower (models/llava.py): its attention and MLP split like the decoder's (q, k,
    # v by head through the rules above, out_proj and fc2 row-parallel), the patch convolution and the
    # position table whole; the projector column- then row-parallel over the text's hidden size.
    ("self_attn", "out_proj", "kernel"): ("q_heads", "embed"),
    ("fc1", "kernel"): ("embed", "mlp"),
    ("fc1", "bias"): ("mlp",),
    ("fc2", "kernel"): ("mlp", "embed"),
    ("embeddings", "patch_embedding", "weight"): (None, None, None, None),
    ("embeddings", "position_embedding", "weight"): (None, None),
    ("multi_modal_projector", "linear_1", "kernel"): ("embed", "mlp"),
    ("multi_modal_projector", "linear_1", "bias"): ("mlp",),
    ("multi_modal_projector", "linear_2", "kernel"): ("mlp", "embed"),
    # Gemma 3's SigLIP tower (a patch bias) and its projector's one matrix [vision, text hidden]: whole
    # (the pooled image rows are few; the decoder's embeddings are replicated anyway).
    ("embeddings", "patch_embedding", "bias"): (None,),
    ("multi_modal_projector", "mm_input_projection_weight"): (None, None),
    # Qwen2.5-VL's windowed tower (models/qwen_vl_tower.py): its MLP split by channel through the gate/up/down
    # rules above and the merger's fc1/fc2 like CLIP's; its fused qkv and proj and the patch matrix whole
    # (the attention runs over the step's patches only, and a contiguous split of q|k|v is not by head).
    ("patch_embed", "kernel"): (None, None),
    ("attn", "qkv", "kernel"): (None, None),
    ("attn", "qkv", "bias"): (None,),
    ("attn", "proj", "kernel"): (None, None),
    ("attn", "proj", "bias"): (None,),
    # Qwen3-VL's (models/qwen3_vl.py): its plain MLP and mergers split like CLIP's fc1/fc2, the patch
    # bias and the learned position table whole.
    ("linear_fc1", "kernel"): ("embed", "mlp"),
    ("linear_fc1", "bias"): ("mlp",),
    ("linear_fc2", "kernel"): ("mlp", "embed"),
    ("patch_embed", "bias"): (None,),
    ("pos_embed", "weight"): (None, None),
    # The MTP layer's wrapper (models/mtp.py): fc over [embedding | hidden state] and its two input norms,
    # whole (one [2D, D] matrix a step; its decoder layer splits as the target's layers do).
    ("fc", "kernel"): (None, None),
    ("pre_fc_norm_embedding", "weight"): (None,),
    ("pre_fc_norm_hidden", "weight"): (None,),
    # Mamba2's mixer (`mixer` in Mamba2, `mamba` in Granite 4.0-H and Falcon-H1): in_proj's outputs and
    # the conv's channels are grouped per SSM group (models/mamba2.py), so a contiguous split is whole
    # groups of heads with their B and C; the per-head vectors and the SSM state split by head; the
    # gated norm's weight by channel; out_proj row-parallel. (A_log stays a replicated vector without
    # a rule: Mamba (1)'s, under the same names, is [channels, N].)
    **{
        rule: axes
        for parent in ("mixer", "mamba")
        for rule, axes in {
            (parent, "in_proj", "kernel"): ("embed", "linear_heads"),
            (parent, "in_proj", "bias"): ("linear_heads",),
            (parent, "conv1d", "weight"): ("linear_heads", None, None),
            (parent, "conv1d", "bias"): ("linear_heads",),
            (parent, "dt_bias"): ("linear_heads",),
            (parent, "D"): ("linear_heads",),
            (parent, "norm", "weight"): ("linear_heads",),
            (parent, "out_proj", "kernel"): ("linear_heads", "embed"),
            (parent, "out_proj", "bias"): (None,),
        }.items()
    },
}

# Parameters beside a quantized kernel (models/quantization.py), sharded by the kernel's rule.
QUANT_PARAMS = ("kernel_scale", "kernel_zero")

# The KV cache: [num_layers * num_blocks, block_size, num_kv_heads, head_dim].
KV_CACHE_AXES = ("blocks", None, "kv_heads", None)
# A recurrent layer's state per slot (kernels/hybrid_cache.py, kernels/ssd.py), split like the layer:
# its last conv inputs [rows, 1, K - 1, conv_dim] by channel, its state [rows, heads, ...] by head.
STATE_CACHE_AXES = {
    "conv_state": (None, None, None, "linear_heads"),
    "recurrent_state": (None, "linear_heads", None, None),
}


def logical_to_mesh(enable_expert_parallel: bool) -> dict[str, str | None]:
    """Tensor parallelism shards heads, the MLP and the vocabulary over the "tensor" axis (KV heads
    too: sharding/kv_heads.py repeats them when there are fewer than ranks). With expert
    parallelism whole experts go to ranks; without it each expert's MLP is split."""
    return {
        "vocab": "tensor",
        "q_heads": "tensor",
        "kv_heads": "tensor",
        "mlp": "tensor",
        "linear_heads": "tensor",
        "expert": "tensor" if enable_expert_parallel else None,
        "expert_mlp": None if enable_expert_parallel else "tensor",
        "embed": None,
        "q_lora": None,
        "kv_lora": None,
        "router": None,
        "blocks": None,
    }


def param_logical_axes(
    path: tuple[str, ...], ndim: int, *, is_stacked: bool
) -> tuple[str | None, ...] | None:
    """Logical axes of the parameter at `path` with `ndim` dims (one of them the leading layer axis
    when `is_stacked`). A parameter no rule names is replicated when it is a vector per layer (norms,
    biases of replicated projections); for a matrix the answer is None: the caller decides whether
    that is an error (under tensor parallelism it is)."""
    layer_ndim = ndim - int(is_stacked)
    axes = _rule(path)
    if path[-1] in QUANT_PARAMS and (kernel_axes := _rule((*path[:-1], "kernel"))):
        # A quantized kernel's scales (and zeros), [.., in / b, out / b]: split like its output
        # channels, whole along its input (one block per channel, or few blocks).
        axes = (*kernel_axes[:-2], None, kernel_axes[-1])
    if axes is None:
        return (None,) * ndim if layer_ndim < 2 else None
    if len(axes) != layer_ndim:
        raise ValueError(
            f"parameter {'/'.join(path)} has {layer_ndim} dims per layer; its rule {axes} expects {len(axes)}"
        )
    return (None,) * (ndim - layer_ndim) + tuple(axes)


def _rule(path: tuple[str, ...]) -> tuple[str | None, ...] | None:
    """The rule of the parameter at `path`: by its last three names, else its last two."""
    return PARAM_AXES.get(tuple(path[-3:])) or PARAM_AXES.get(tuple(path[-2:]))


def lora_logical_axes(module: str, which: str) -> tuple[str | None, ...]:
    """A LoRA slot stack of `module` (models/lora.py) follows its kernel: A [L, in, S, r] is split on
    the kernel's input axis (row-parallel o_proj, down_proj: x arrives split, and x @ A is summed
    across devices like x @ W), B [L, S, r, out] on its output axis (column-parallel q, k, v, gate,
    up: each device computes its own columns of the delta). The rank axis is never split."""
    din, dout = PARAM_AXES.get((module, "kernel"), (None, None))
    return (None, din, None, None) if which == "a" else (None, None, None, dout)


def to_partition_spec(logical: tuple[str | None, ...], rules: dict[str, str | None]) -> PartitionSpec:
    unknown = [axis for axis in logical if axis is not None and axis not in rules]
    if unknown:  # a misspelt axis would otherwise mean "replicated"
        raise ValueError(f"logical axes {unknown} have no mesh rule; known: {sorted(rules)}")
    return PartitionSpec(*(None if axis is None else rules[axis] for axis in logical))

"""The architecture of a decoder-only transformer, read from a Hugging Face config dict.

One frozen (hashable, so jit can key on it) dataclass for every family: the fields past the Llama
core are the switches the families differ by, each defaulting to Llama's behaviour.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@dataclass(frozen=True)
class TransformerConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None  # a frozen dict, hashable for jit
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # -- what the families differ by (the defaults are Llama's) --
    attention_out_bias: bool = False  # o_proj (Llama, Qwen3, Gemma: = attention_bias; Qwen2: none)
    hidden_act: str = "silu"  # the gate activation: silu, gelu_pytorch_tanh (Gemma), gelu
    qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3, Gemma3)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma's (1 + w)
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # attention scale is its **-0.5 (Gemma); else head_dim's
    attn_logit_softcap: float | None = None  # scores s -> c * tanh(s / c) (Gemma2)
    final_logit_softcap: float | None = None  # logits likewise (Gemma2, Gemma3)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims (Phi3)
    sliding_window: int | None = None  # keys visible to a query on a sliding layer, itself included
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all full
    local_rope_theta: float | None = None  # RoPE base of sliding layers (Gemma3), unscaled

    def __post_init__(self):
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported: expected {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> TransformerConfig:
        architecture = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        is_gemma, is_gemma2 = architecture in _GEMMA, architecture == "Gemma2ForCausalLM"
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        rope, local_rope_theta = _rope_parameters(hf)
        scaling = hf.get("rope_scaling") or rope
        if scaling:
            scaling = {k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items()}
            scaling.pop("rope_theta", None)
            scaling.pop("partial_rotary_factor", None)
            rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
            scaling["rope_type"] = rope_type
            if rope_type == "longrope":  # Phi3's config.json keeps it beside rope_scaling
                original = hf.get("original_max_position_embeddings")
                scaling.setdefault("original_max_position_embeddings", original)
            scaling = None if rope_type == "default" else tuple(sorted(scaling.items()))
        rope_theta = rope.get("rope_theta", hf.get("rope_theta"))
        # Qwen2 hard-codes biases on q/k/v (and none on o_proj) instead of reading attention_bias.
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = is_qwen2 or bool(hf.get("attention_bias", False))
        sliding_window = hf.get("sliding_window")
        if hf.get("use_sliding_window") is False:  # Qwen's switch; its config.json still carries a size
            sliding_window = None
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(10000.0 if rope_theta is None else rope_theta),
            rope_scaling=scaling or None,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            attention_out_bias=attention_bias and not is_qwen2,
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            norm_offset=1.0 if is_gemma else 0.0,
            embed_scale=hf["hidden_size"] ** 0.5 if is_gemma else 1.0,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if is_gemma else None,
            # Hugging Face's Gemma3 attention ignores attn_logit_softcapping (its configs set none).
            attn_logit_softcap=hf.get("attn_logit_softcapping") if is_gemma2 else None,
            final_logit_softcap=hf.get("final_logit_softcapping") if is_gemma else None,
            partial_rotary_factor=float(
                hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 1.0)
            ),
            sliding_window=sliding_window,
            layer_types=_layer_types(hf, architecture, num_layers, sliding_window),
            local_rope_theta=local_rope_theta,
        )

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer: its sliding window, or None for full attention."""
        types = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)


def _rope_parameters(hf: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """(RoPE parameters of full-attention layers, RoPE base of sliding layers or None).

    transformers 5 nests them per layer type when they differ (Gemma3:
    {"sliding_attention": {...}, "full_attention": {...}}); older configs say rope_local_base_freq.
    """
    rope = dict(hf.get("rope_parameters") or {})
    if "full_attention" in rope:
        local = rope.get("sliding_attention") or {}
        return dict(rope["full_attention"] or {}), local.get("rope_theta")
    return rope, hf.get("rope_local_base_freq")


def _layer_types(
    hf: dict[str, Any], architecture: str, num_layers: int, window: int | None
) -> tuple[str, ...]:
    """Which layers use the sliding window; Hugging Face's per-family defaults when the config omits it."""
    if not window:
        return ()
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    if architecture == "Gemma2ForCausalLM":
        is_sliding = [(i + 1) % 2 != 0 for i in range(num_layers)]
    elif architecture == "Gemma3ForCausalLM":
        pattern = hf.get("sliding_window_pattern", 6)
        is_sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif "max_window_layers" in hf:  # Qwen: the layers from max_window_layers on slide
        is_sliding = [i >= hf["max_window_layers"] for i in range(num_layers)]
    else:  # Mistral, Phi3, Mixtral: every layer
        is_sliding = [True] * num_layers
    return tuple("sliding_attention" if s else "full_attention" for s in is_sliding)

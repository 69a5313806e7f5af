"""The architecture of a decoder-only transformer, read from a Hugging Face config dict.

One frozen (hashable, so jit can key on it) dataclass: the fields past the Llama core are the
switches the families differ by, each defaulting to Llama's behaviour. Here is only the mapping every
family shares; a family that reads its config.json differently (Gemma's norms and soft caps, Qwen's
sliding layers, MoE routing) subclasses `TransformerConfig` in its own file, extends
`fields_from_hf`, and names the subclass as its model class's `config_class`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class TransformerConfig:
    architecture: str  # the config's `architectures[0]` ("" when it names none)
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
    attn_output_gate: bool = False  # q_proj also gives a gate per head: out * sigmoid(gate) (Qwen3.5)
    attention_sinks: bool = False  # a learned logit per query head in each softmax's denominator (gpt-oss)
    nope_layers: tuple[int, ...] = ()  # layers whose q and k are not rotated (SmolLM3's every fourth)
    clip_qkv: float | None = None  # q, k and v clamped to [-c, c] after projection (OLMoE)

    def __post_init__(self):
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported: expected {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        rope_type = self.rope_scaling_dict.get("rope_type", self.rope_scaling_dict.get("type"))
        if self.nope_layers and rope_type in ("dynamic", "longrope"):  # their angles ignore the layer's
            raise ValueError(f"layers without RoPE beside {rope_type!r} RoPE scaling are not supported")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> TransformerConfig:
        """This class's reading of a Hugging Face config dict (see `fields_from_hf`)."""
        return cls(**cls.fields_from_hf(hf))

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        """The field values of a config dict, as Llama (and any family spelling things alike) reads it.

        A family whose config says more, or means something else, subclasses this dataclass in its
        own file and extends the dict: `{**super().fields_from_hf(hf), "qk_norm": True}`.
        """
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        rope = read_rope_parameters(hf)
        scaling = rope.scaling
        if scaling is not None:  # a frozen, hashable form (jit keys on the config)
            scaling = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
        attention_bias = bool(hf.get("attention_bias", False))
        sliding_window = hf.get("sliding_window")
        return dict(
            architecture=(hf.get("architectures") or [""])[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            attention_out_bias=attention_bias,
            hidden_act=hf.get("hidden_act") or "silu",
            partial_rotary_factor=rope.partial_rotary_factor,
            sliding_window=sliding_window,
            layer_types=cls.layer_types_from_hf(hf, num_layers) if sliding_window else (),
            local_rope_theta=rope.local_theta,
        )

    @classmethod
    def layer_types_from_hf(cls, hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
        """Per layer "full_attention" or "sliding_attention", for a config with a sliding window: its
        own `layer_types`, else Hugging Face's default for the family. Here every layer slides
        (Mistral, Phi3, Mixtral); a family with a pattern overrides `default_sliding_layers`."""
        if hf.get("layer_types"):
            return tuple(hf["layer_types"])
        is_sliding = cls.default_sliding_layers(hf, num_layers)
        return tuple("sliding_attention" if s else "full_attention" for s in is_sliding)

    @classmethod
    def default_sliding_layers(cls, hf: dict[str, Any], num_layers: int) -> list[bool]:
        """Which layers slide when the config has a window but no `layer_types`: all of them."""
        return [True] * num_layers

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
    def mrope(self) -> bool:
        """Whether the decoder rotates by multimodal positions [3, T] (Qwen2.5-VL's M-RoPE)."""
        return False

    @property
    def encoder_output_width(self) -> int:
        """A vision-language model's values per image token in the encoder cache: the decoder's width
        (Qwen3-VL: also its deepstack features, one width per layer they join)."""
        return self.hidden_size

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    def for_tensor_parallel(self, tensor_parallel_size: int) -> TransformerConfig:
        """The config the model is built with under `tensor_parallel_size`: this one, unless the family
        widens something that must split evenly (Mamba2's B and C groups, copied as KV heads are)."""
        return self

    def checkpoint_rows(self, name: str, rows: int, checkpoint_config: TransformerConfig) -> int:
        """The inverse of `for_tensor_parallel` (and of the copies the family's `prepare_hf_tensors`
        makes with it) for one tensor: the `rows` of Hugging Face tensor `name` (axis 0) as the model
        built with this config holds them -> as a checkpoint of `checkpoint_config` holds them
        (sharding/layout.py `checkpoint_shape`). A family that widens overrides both."""
        return rows


@dataclass(frozen=True)
class RopeParameters:
    """A config's RoPE, from either spelling (see `read_rope_parameters`)."""

    theta: float  # the base of full-attention layers
    scaling: dict[str, Any] | None  # {"rope_type": ..., its parameters}; None for plain RoPE
    partial_rotary_factor: float  # the fraction of head_dim that rotates
    local_theta: float | None  # the unscaled base of sliding layers when they have their own


def read_rope_parameters(hf: dict[str, Any]) -> RopeParameters:
    """The RoPE of a Hugging Face config dict; the one place that reads its spellings.

    transformers 5 writes `rope_parameters` (rope_theta, rope_type and the type's parameters), nested
    per layer type when those differ (Gemma3: {"sliding_attention": {...}, "full_attention": {...}});
    older configs write `rope_theta`, `rope_scaling` (with "type" or "rope_type") and
    `rope_local_base_freq`. Either way the full-attention layers' values come out on top.
    """
    rope = dict(hf.get("rope_parameters") or {})
    local_theta = hf.get("rope_local_base_freq")
    if "full_attention" in rope:
        local_theta = (rope.get("sliding_attention") or {}).get("rope_theta")
        rope = dict(rope["full_attention"] or {})
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    partial = hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 1.0)
    scaling = dict(hf.get("rope_scaling") or rope)
    scaling.pop("rope_theta", None)
    scaling.pop("partial_rotary_factor", None)
    rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
    if rope_type == "mrope":  # Qwen2-VL's older spelling: multimodal positions, the default frequencies
        rope_type = "default"
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":  # Phi3's config.json keeps it beside rope_scaling
        scaling.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    return RopeParameters(
        theta=float(10000.0 if theta is None else theta),
        scaling=None if rope_type == "default" else scaling,
        partial_rotary_factor=float(partial),
        local_theta=local_theta,
    )

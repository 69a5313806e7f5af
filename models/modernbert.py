"""ModernBERT: an encoder-only backbone of pre-norm layers with rotary positions, alternating global and
local (sliding-window) attention, GeGLU MLPs and bias-free LayerNorms, behind a pooling engine.

It runs as models/encoder.py's encoders do (one compiled forward per token bucket, each prompt whole in
one step, the placeholder cache), through the same bidirectional attention, given each layer's window:
on a local layer a token sees the keys of its sequence within `local_attention // 2` positions either
side (Hugging Face's `sliding_window`, inclusive), on a global layer all of them. Each layer's kind
rides the layer scan as data (its window, its RoPE frequencies, whether it normalizes its input: the
first layer's `attn_norm` is an identity), so one scanned layer serves both kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels.dtype_ops import scan
from xlaserve.models.config import TransformerConfig
from xlaserve.models.encoder import EncoderOnlyLM, LayerNorm, bidirectional_attention, sequence_bounds
from xlaserve.models.layers import Embedding, Linear, activation
from xlaserve.models.rope import apply_rope, base_inv_freq

_GLOBAL_THETA, _LOCAL_THETA = 160_000.0, 10_000.0  # Hugging Face's defaults


@dataclass(frozen=True)
class ModernBertConfig(TransformerConfig):
    half_window: int = 64  # a local layer's token sees keys up to this many positions away, either side
    norm_bias: bool = False
    type_vocab_size: int = 0  # no token types
    sep_token_id: int | None = None
    pad_token_id: int | None = None

    @classmethod
    def fields_from_hf(cls, hf: dict[str, Any]) -> dict[str, Any]:
        num_heads, num_layers = hf["num_attention_heads"], hf["num_hidden_layers"]
        every = hf.get("global_attn_every_n_layers", 3)
        layer_types = tuple(hf.get("layer_types") or ())
        if not layer_types:  # Hugging Face's default: every `every`-th layer global, from the first
            kinds = ("full_attention", "sliding_attention")
            layer_types = tuple(kinds[bool(i % every)] for i in range(num_layers))
        rope = hf.get("rope_parameters") or {}
        global_theta = hf.get("global_rope_theta", _GLOBAL_THETA)
        local_theta = hf.get("local_rope_theta", _LOCAL_THETA)
        local_attention = hf.get("local_attention", 128)
        return dict(
            architecture=(hf.get("architectures") or [""])[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("norm_eps", 1e-5),
            rope_theta=(rope.get("full_attention") or {}).get("rope_theta", global_theta),
            local_rope_theta=(rope.get("sliding_attention") or {}).get("rope_theta", local_theta),
            rope_scaling=None,
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_word_embeddings=True,
            attention_bias=hf.get("attention_bias", False),
            attention_out_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            hidden_act=hf.get("hidden_activation") or "gelu",
            sliding_window=local_attention,
            layer_types=layer_types,
            half_window=local_attention // 2,
            norm_bias=hf.get("norm_bias", False),
            sep_token_id=hf.get("sep_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )


class ModernBertLayer(nnx.Module):
    """x += attn(norm(x)) (the first layer: no norm); x += down(act(input) * gate), (input, gate) =
    split(up(norm(x)))."""

    def __init__(self, cfg: ModernBertConfig, *, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.attn_norm = LayerNorm(d, cfg.rms_norm_eps, dtype=dtype, use_bias=cfg.norm_bias)
        self.qkv_proj = Linear(d, 3 * d, use_bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(d, d, use_bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.mlp_norm = LayerNorm(d, cfg.rms_norm_eps, dtype=dtype, use_bias=cfg.norm_bias)
        self.up_proj = Linear(d, 2 * f, use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.act = activation(cfg.hidden_act)

    def __call__(self, x, seq_start, seq_len, positions, kind):  # x [T, D]
        inv_freq, half_window, has_attn_norm = kind
        t = x.shape[0]
        h = jnp.where(has_attn_norm, self.attn_norm(x), x)
        q, k, v = jnp.split(self.qkv_proj(h).reshape(t, 3 * self.num_heads, self.head_dim), 3, axis=1)
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        attn = bidirectional_attention(q, k, v, seq_start, seq_len, self.scale, half_window=half_window)
        x = x + self.o_proj(attn.reshape(t, -1))
        up, gate = jnp.split(self.up_proj(self.mlp_norm(x)), 2, axis=-1)
        return x + self.down_proj(self.act(up) * gate)


class ModernBertModel(EncoderOnlyLM):
    """Token embeddings and their norm, the layers under one scan, a final norm."""

    config_class: ClassVar[type[TransformerConfig]] = ModernBertConfig

    def __init__(self, cfg: ModernBertConfig, backend, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed_tokens = Embedding(cfg.vocab_size, d, dtype=dtype, rngs=rngs)
        self.embed_norm = LayerNorm(d, cfg.rms_norm_eps, dtype=dtype, use_bias=cfg.norm_bias)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> nnx.Module:
            return ModernBertLayer(cfg, dtype=dtype, rngs=rngs)

        self.layers = make_layers(rngs)
        self.final_norm = LayerNorm(d, cfg.rms_norm_eps, dtype=dtype, use_bias=cfg.norm_bias)

    @staticmethod
    def layer_kinds(cfg: ModernBertConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per layer: RoPE inverse frequencies [L, Dh / 2], the attention half-window [L] (local layers;
        global: past any sequence), whether the layer normalizes its attention input [L]."""
        windows = cfg.layer_sliding_windows
        local = base_inv_freq(cfg.head_dim, cfg.local_rope_theta)
        full = base_inv_freq(cfg.head_dim, cfg.rope_theta)
        inv_freqs = np.stack([full if w is None else local for w in windows]).astype(np.float32)
        everything = np.iinfo(np.int32).max
        half = np.asarray([everything if w is None else cfg.half_window for w in windows], np.int32)
        return inv_freqs, half, np.arange(cfg.num_layers) > 0

    @classmethod
    def prepare_hf_tensors(cls, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Checkpoint names -> ours. The first layer's attention norm is an identity in the checkpoint
        (no tensors): ours is skipped there (`layer_kinds`), and stands as ones (and zeros) to stack."""
        out = {}
        for name, tensor in tensors.items():
            short = name[len("model.") :] if name.startswith("model.") else name
            if short.startswith(("head.", "decoder.", "classifier.")):
                continue
            out[_our_name(short)] = tensor
        d = cfg.hidden_size
        out.setdefault("model.layers.0.attn_norm.weight", np.ones((d,), np.float32))
        if cfg.norm_bias:
            out.setdefault("model.layers.0.attn_norm.bias", np.zeros((d,), np.float32))
        return out

    def __call__(self, input_ids, positions, kv_cache, md, lora=None):
        """-> (hidden [T, D] after the final norm, kv_cache untouched); as EncoderOnlyLM's."""
        if lora is not None:
            raise ValueError("LoRA adapters are not supported on encoder-only models")
        seq_start, seq_len = sequence_bounds(md, input_ids.shape[0])
        x = self.embed_norm(self.embed_tokens(input_ids))
        layer_def, layer_state = nnx.split(self.layers)
        kinds = tuple(jnp.asarray(a) for a in self.layer_kinds(self.cfg))

        def body(x, state_and_kind):
            state, kind = state_and_kind
            return nnx.merge(layer_def, state)(x, seq_start, seq_len, positions, kind), None

        x, _ = scan(body, x, (layer_state, kinds), words_of=x.dtype)
        return self.final_norm(x), kv_cache


_NAMES = {
    "embeddings.tok_embeddings": "model.embed_tokens",
    "embeddings.norm": "model.embed_norm",
    "final_norm": "model.final_norm",
}
_LAYER = {"attn_norm": "attn_norm", "attn.Wqkv": "qkv_proj", "attn.Wo": "o_proj", "mlp_norm": "mlp_norm",
          "mlp.Wi": "up_proj", "mlp.Wo": "down_proj"}  # fmt: skip


def _our_name(short: str) -> str:
    """`embeddings.norm.weight` -> `model.embed_norm.weight`, `layers.3.attn.Wqkv.weight` ->
    `model.layers.3.qkv_proj.weight`; names we do not know are kept (the loader reports them)."""
    module, _, leaf = short.rpartition(".")
    if module in _NAMES:
        return f"{_NAMES[module]}.{leaf}"
    parts = module.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{leaf}"
    return short


def split_classifier(hf_config: dict, tensors: dict) -> tuple[dict, dict, dict]:
    """ModernBertForSequenceClassification -> (hf_config naming the backbone, the backbone's tensors,
    the head's arguments for the pooler's ClassifierHead): dense (bias if `classifier_bias`) ->
    `classifier_activation` -> LayerNorm -> classifier, on the state that `classifier_pooling` (cls or
    mean) pools."""
    names = {"dense_weight": "head.dense.weight", "norm_weight": "head.norm.weight"}
    names["out_weight"] = "classifier.weight"
    optional = {"dense_bias": "head.dense.bias", "norm_bias": "head.norm.bias", "out_bias": "classifier.bias"}
    missing = [n for n in names.values() if n not in tensors]
    if missing:
        raise ValueError(f"ModernBertForSequenceClassification: the checkpoint lacks its head's {missing}")
    pooling = hf_config.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ValueError(f"ModernBERT's classifier_pooling must be 'cls' or 'mean', got {pooling!r}")
    tensors = dict(tensors)
    head = {key: np.asarray(tensors.pop(name), np.float32) for key, name in names.items()}
    present = {key: name for key, name in optional.items() if name in tensors}
    head |= {key: np.asarray(tensors.pop(name), np.float32) for key, name in present.items()}
    head |= {
        "dense_activation": hf_config.get("classifier_activation") or "gelu",
        "norm_eps": hf_config.get("norm_eps", 1e-5),
        "pooling_type": pooling.upper(),
    }
    return {**hf_config, "architectures": ["ModernBertModel"]}, tensors, head

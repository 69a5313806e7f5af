"""Multi-token prediction (MTP) layers: the draft network a checkpoint ships beside its decoder
(Qwen3.5's, Qwen3-Next's and Qwen3.5-MoE's `mtp.*` tensors), for speculative decoding with
`{"method": "mtp"}` (worker/mtp.py).

At position i the layer reads the token at i + 1 and the target's last hidden state at i (after its
final norm), and predicts the token at i + 2:

    x = fc([norm_e(embed(token_{i+1})) | norm_h(hidden_i)])      [2D] -> [D], no bias
    x = decoder layer(x)                                         one full-attention layer, own K/V
    h = norm(x);  logits = lm_head(h)

The embedding and LM head are the target's (not held here). Drafting past the first token feeds the
layer its own output `h` in place of the target's hidden state. Its K/V cache is one attention layer's,
indexed by the target's block ids (the draft model's arrangement: worker/draft_model.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache, KVCacheSpec
from xlaserve.models.config import TransformerConfig
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.hybrid import FULL
from xlaserve.models.layers import Linear, RMSNorm, layer_specs, with_shared_rope
from xlaserve.models.qwen3_5 import Qwen3_5AttentionLayer, Qwen3_5ForCausalLM
from xlaserve.models.qwen3_next import Qwen3NextAttentionLayer, Qwen3NextForCausalLM

_MTP_LAYER = re.compile(r"^mtp\.layers\.0\.")


class _PlainCacheLayer:
    """A hybrid family's attention layer over a plain K/V cache (the MTP layer has no state)."""

    def __call__(self, x, positions, cache: KVCache, md: AttentionMetadata, spec):
        h, cache = self.self_attn(self.input_layernorm(x), positions, cache, md, spec)
        return self.finish(x, h), cache


class Qwen3_5MTPLayer(_PlainCacheLayer, Qwen3_5AttentionLayer):
    pass


class Qwen3NextMTPLayer(_PlainCacheLayer, Qwen3NextAttentionLayer):
    pass


class MultiTokenPredictor(nnx.Module):
    """The MTP module (module doc); `text_class` is the target's decoder class, whose rewriting of a
    layer's tensors (expert stacking, grouping) the MTP layer's tensors go through."""

    layer_class: ClassVar[type[nnx.Module]]
    text_class: ClassVar[type[DecoderOnlyLM]]

    def __init__(
        self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype=jnp.float32, rngs: nnx.Rngs
    ):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.pre_fc_norm_embedding = RMSNorm(d, eps, offset=1.0, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(d, eps, offset=1.0, dtype=dtype)
        self.fc = Linear(2 * d, d, dtype=dtype, rngs=rngs)
        self.layer = type(self).layer_class(cfg, backend, dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(d, eps, offset=1.0, dtype=dtype)

    @classmethod
    def kv_cache_spec(cls, cfg: TransformerConfig) -> KVCacheSpec:
        """One attention layer's K/V (the target's heads and head size)."""
        return dataclasses.replace(DecoderOnlyLM.kv_cache_spec(cfg), num_layers=1)

    @classmethod
    def layer_stacks(cls, cfg) -> dict[str, range]:
        return {}

    @classmethod
    def prepare_hf_tensors(cls, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The checkpoint's `mtp.*` tensors under our names (`model.fc.weight`, `model.layer.*`): the
        layer's through the target's own rewriting (as `model.layers.0.*`, then renamed)."""
        layer = {
            _MTP_LAYER.sub("model.layers.0.", name): t
            for name, t in tensors.items()
            if _MTP_LAYER.match(name)
        }
        out = {
            name.replace("model.layers.0.", "model.layer.", 1): t
            for name, t in cls.text_class.prepare_hf_tensors(cfg, layer).items()
        }
        for name, t in tensors.items():
            if name.startswith("mtp.") and not _MTP_LAYER.match(name):
                out["model." + name[len("mtp.") :]] = t
        return out

    def __call__(
        self,
        embeds: jax.Array,  # [T, D] the target's embeddings of the next tokens
        hidden: jax.Array,  # [T, D] the target's (or this layer's own) hidden states
        positions: jax.Array,  # [T]
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # (h [T, D] after the final norm, the updated cache)
        x = jnp.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        md = with_shared_rope(self.cfg, positions, md)
        # The layer reads as the target's first attention layer does (its rotary frequencies, no window).
        first = self.cfg.mixer_types.index(FULL)
        spec = jax.tree.map(lambda a: jnp.asarray(a[first]), layer_specs(self.cfg))
        cache_array = kv_cache.k
        md_layer = md.for_layer(0, cache_array.shape[0], cache_array.shape[1])
        x, kv_cache = self.layer(x, positions, kv_cache, md_layer, spec)
        return self.norm(x), kv_cache


class Qwen3_5MTP(MultiTokenPredictor):
    layer_class = Qwen3_5MTPLayer
    text_class = Qwen3_5ForCausalLM


class Qwen3NextMTP(MultiTokenPredictor):
    layer_class = Qwen3NextMTPLayer
    text_class = Qwen3NextForCausalLM


def mtp_class(target_class: type) -> type[MultiTokenPredictor] | None:
    """The MTP module of a target model class; None: the family has none here."""
    if issubclass(target_class, Qwen3NextForCausalLM):
        return Qwen3NextMTP
    if issubclass(target_class, Qwen3_5ForCausalLM):
        return Qwen3_5MTP
    return None


def num_mtp_layers(hf_config: dict) -> int:
    """The MTP layers config.json declares (Qwen3.5's and Qwen3-Next's `mtp_num_hidden_layers`)."""
    text = hf_config.get("text_config") or hf_config
    return int(text.get("mtp_num_hidden_layers", hf_config.get("mtp_num_hidden_layers", 0)) or 0)

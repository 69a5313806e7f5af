"""Multi-token prediction (MTP) layers: the draft network a checkpoint ships beside its decoder
(Qwen3.5's, Qwen3-Next's and Qwen3.5-MoE's `mtp.*` tensors; DeepSeek V3's, R1's and GLM-4.5's
decoder layer `model.layers.{num_hidden_layers}.*`), for speculative decoding with `{"method": "mtp"}`
(worker/mtp.py).

At position i the layer reads the token at i + 1 and the target's last hidden state at i (after its
final norm), and predicts the token at i + 2:

    x = fc([norm_e(embed(token_{i+1})) | norm_h(hidden_i)])      [2D] -> [D], no bias
    x = decoder layer(x)                                         one of the family's layers, own K/V
    h = norm(x);  logits = lm_head(h)

Each family gives its layer, its norms' offset (Qwen's 1 + w, DeepSeek's plain w), its tensors' names
and its config's count of MTP layers (`MultiTokenPredictor`'s class attributes). DeepSeek's names are
vLLM's deepseek_mtp's: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` around the layer's own
`self_attn` (MLA) and `mlp` (MoE); like vLLM and SGLang it zeroes the embedding read at position 0.
The embedding and LM head are the target's (not held here: DeepSeek's copies of them in the layer,
`embed_tokens` and `shared_head.head`, are skipped at load). Drafting past the first token feeds the
layer its own output `h` in place of the target's hidden state. Its K/V cache is one layer of the
target's kind (K and V; DeepSeek's latent cache), indexed by the target's block ids (the draft model's
arrangement: worker/draft_model.py).
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCache
from xlaserve.models.config import TransformerConfig
from xlaserve.models.decoder import DecoderOnlyLM
from xlaserve.models.deepseek import DeepseekConfig, DeepseekDecoderLayer, DeepseekV3ForCausalLM
from xlaserve.models.draft_layer import OneLayerDrafter
from xlaserve.models.glm4_moe import Glm4MoeForCausalLM
from xlaserve.models.hybrid import FULL
from xlaserve.models.layers import Linear, RMSNorm
from xlaserve.models.moe import MoEDecoderLayer
from xlaserve.models.qwen3_5 import Qwen3_5AttentionLayer, Qwen3_5ForCausalLM
from xlaserve.models.qwen3_next import Qwen3NextAttentionLayer, Qwen3NextForCausalLM


class _PlainCacheLayer:
    """A hybrid family's attention layer over a plain K/V cache (the MTP layer has no state)."""

    def __call__(self, x, positions, cache: KVCache, md: AttentionMetadata, spec):
        h, cache = self.self_attn(self.input_layernorm(x), positions, cache, md, spec)
        return self.finish(x, h), cache


class Qwen3_5MTPLayer(_PlainCacheLayer, Qwen3_5AttentionLayer):
    pass


class Qwen3NextMTPLayer(_PlainCacheLayer, Qwen3NextAttentionLayer):
    pass


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """DeepSeek's decoder layer at index num_hidden_layers: an MoE one, as the config clamps
    first_k_dense_replace to num_hidden_layers."""

    def __init__(self, cfg: DeepseekConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, backend, is_moe=True, dtype=dtype, rngs=rngs)


class MultiTokenPredictor(OneLayerDrafter):
    """The MTP module (module doc); `text_class` is the target's decoder class, whose rewriting of a
    layer's tensors (expert stacking, grouping) the MTP layer's tensors go through."""

    layer_class: ClassVar[type[nnx.Module]]
    text_class: ClassVar[type[DecoderOnlyLM]]
    norm_offset: ClassVar[float] = 1.0  # the three norms': Qwen's zero-centred (1 + w)
    num_layers_key: ClassVar[str] = "mtp_num_hidden_layers"  # config.json's count of MTP layers
    zero_first_embedding: ClassVar[bool] = False  # the embedding read at position 0 zeroed (vLLM's DeepSeek)

    def __init__(
        self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype=jnp.float32, rngs: nnx.Rngs
    ):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        offset = type(self).norm_offset
        self.pre_fc_norm_embedding = RMSNorm(d, eps, offset=offset, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(d, eps, offset=offset, dtype=dtype)
        self.fc = Linear(2 * d, d, dtype=dtype, rngs=rngs)
        self.layer = type(self).layer_class(cfg, backend, dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(d, eps, offset=offset, dtype=dtype)

    @classmethod
    def num_layers(cls, hf_config: dict) -> int:
        """The MTP layers config.json declares (under `text_config` in a multimodal release's)."""
        text = hf_config.get("text_config") or hf_config
        return int(text.get(cls.num_layers_key, hf_config.get(cls.num_layers_key, 0)) or 0)

    @classmethod
    def spec_layer(cls, cfg) -> int:
        """The target layer whose LayerSpec (rotary frequencies, window) the MTP layer reads with: the
        first full-attention one, none of the linear-attention ones."""
        return cfg.mixer_types.index(FULL)

    @classmethod
    def hf_prefix(cls, cfg) -> str:
        """Every checkpoint tensor of the MTP module starts with this."""
        return "mtp."

    @classmethod
    def hf_names(cls, cfg) -> tuple[str, dict[str, str], tuple[str, ...]]:
        """(the decoder layer's prefix, the other tensors' prefixes -> ours, prefixes skipped)."""
        wrapper = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
        return "mtp.layers.0.", {f"mtp.{n}.": f"model.{n}." for n in wrapper}, ()

    @classmethod
    def prepare_hf_tensors(cls, cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The checkpoint's MTP tensors under our names (`model.fc.weight`, `model.layer.*`): the
        layer's through the target's own rewriting (as `model.layers.0.*`, then renamed). A name
        none of `hf_names` covers is kept as it is, for the loader to refuse as unexpected."""
        layer_prefix, renames, skipped = cls.hf_names(cfg)
        layer, out = {}, {}
        for name, t in tensors.items():
            if name.startswith(skipped):
                continue
            wrapper = next((p for p in renames if name.startswith(p)), None)
            if wrapper is not None:
                out[renames[wrapper] + name[len(wrapper) :]] = t
            elif name.startswith(layer_prefix):
                layer["model.layers.0." + name[len(layer_prefix) :]] = t
            else:
                out[name] = t
        for name, t in cls.text_class.prepare_hf_tensors(cfg, layer).items():
            out[name.replace("model.layers.0.", "model.layer.", 1)] = t
        return out

    # -- the drafting interface worker/mtp.py's step calls (models/eagle3.py's drafter has it too) ---

    def embed(self, target, ids: jax.Array) -> jax.Array:
        return target.embed(ids)

    def combine(self, hidden: jax.Array) -> jax.Array:
        """The target's hidden states as the layer reads them: as they are."""
        return hidden

    def draft_logits(self, target, h: jax.Array, head_dv) -> jax.Array:
        return target.compute_logits(h, head_dv)

    def __call__(
        self,
        embeds: jax.Array,  # [T, D] the target's embeddings of the next tokens
        hidden: jax.Array,  # [T, D] the target's (or this layer's own) hidden states
        positions: jax.Array,  # [T]
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array, KVCache]:  # (h [T, D] after the final norm, h again: the next
        # draft's hidden state, the updated cache)
        if self.zero_first_embedding:
            embeds = jnp.where((positions == 0)[:, None], jnp.zeros_like(embeds), embeds)
        x = jnp.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        md_layer, spec = self.one_layer_inputs(positions, kv_cache, md, self.spec_layer(self.cfg))
        x, kv_cache = self.layer(x, positions, kv_cache, md_layer, spec)
        h = self.norm(x)
        return h, h, kv_cache


class Qwen3_5MTP(MultiTokenPredictor):
    layer_class = Qwen3_5MTPLayer
    text_class = Qwen3_5ForCausalLM


class Qwen3NextMTP(MultiTokenPredictor):
    layer_class = Qwen3NextMTPLayer
    text_class = Qwen3NextForCausalLM


class DeepseekMTP(MultiTokenPredictor):
    """vLLM's deepseek_mtp (module doc): the layer stored as decoder layer `num_hidden_layers`."""

    layer_class = DeepseekMTPLayer
    text_class = DeepseekV3ForCausalLM
    norm_offset = 0.0
    num_layers_key = "num_nextn_predict_layers"
    zero_first_embedding = True
    cache_model_class = DeepseekV3ForCausalLM  # one layer of the target's latent cache (MLA's)

    @classmethod
    def spec_layer(cls, cfg) -> int:
        return 0  # MLA reads no LayerSpec (its RoPE is its own)

    @classmethod
    def hf_prefix(cls, cfg) -> str:
        return f"model.layers.{cfg.num_layers}."

    @classmethod
    def hf_names(cls, cfg) -> tuple[str, dict[str, str], tuple[str, ...]]:
        p = cls.hf_prefix(cfg)
        renames = {
            f"{p}eh_proj.": "model.fc.",
            f"{p}enorm.": "model.pre_fc_norm_embedding.",
            f"{p}hnorm.": "model.pre_fc_norm_hidden.",
            f"{p}shared_head.norm.": "model.norm.",
        }
        # Copies of the target's embedding and LM head (the releases store them equal): the target's serve.
        return p, renames, (f"{p}embed_tokens.", f"{p}shared_head.head.")


class Glm4MoeMTP(DeepseekMTP):
    """vLLM's glm4_moe_mtp: DeepSeek V3's tensors and wiring (the embedding zeroed at position 0 too)
    around GLM-4.5's MoE decoder layer (GQA attention over one layer of plain K/V)."""

    layer_class = MoEDecoderLayer
    text_class = Glm4MoeForCausalLM
    cache_model_class = Glm4MoeForCausalLM


def mtp_class(target_class: type) -> type[MultiTokenPredictor] | None:
    """The MTP module of a target model class; None: the family has none here (DeepSeek V2's
    checkpoints declare no MTP layer: refused by their count, 0)."""
    if issubclass(target_class, DeepseekV3ForCausalLM):
        return DeepseekMTP
    if issubclass(target_class, Glm4MoeForCausalLM):
        return Glm4MoeMTP
    if issubclass(target_class, Qwen3NextForCausalLM):
        return Qwen3NextMTP
    if issubclass(target_class, Qwen3_5ForCausalLM):
        return Qwen3_5MTP
    return None

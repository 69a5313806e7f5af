"""Model registry: the Hugging Face `architectures` string -> the Flax NNX module that implements it."""

from __future__ import annotations

from typing import Any

from xlaserve.kernels import KVCacheSpec
from xlaserve.models.config import TransformerConfig
from xlaserve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from xlaserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from xlaserve.models.llama import LlamaForCausalLM
from xlaserve.models.mistral import MistralForCausalLM
from xlaserve.models.mixtral import MixtralForCausalLM
from xlaserve.models.phi3 import Phi3ForCausalLM
from xlaserve.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from xlaserve.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str):
    """The module class for an HF architecture; an unknown one lists the supported ones."""
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        ) from None


def model_config_from_hf(hf_config: dict[str, Any]) -> TransformerConfig:
    """The config of the architecture `hf_config` names, as its model class reads it: the class's
    `config_class` (a TransformerConfig subclass with the family's fields, e.g. MoE routing), or
    TransformerConfig."""
    architecture = TransformerConfig.from_hf(hf_config).architecture
    return getattr(get_model_class(architecture), "config_class", TransformerConfig).from_hf(hf_config)


def kv_cache_spec(model_class, cfg: TransformerConfig) -> KVCacheSpec:
    """The paged cache a model needs: its class's `kv_cache_spec(cfg)` (MLA: one latent cache), or
    K and V of [num_kv_heads, head_dim] per layer."""
    if hasattr(model_class, "kv_cache_spec"):
        return model_class.kv_cache_spec(cfg)
    return KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)

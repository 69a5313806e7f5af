"""Building an engine core from a config: the checkpoint, the context length, the devices.

Shared by the offline `LLM` (in-process) and the engine-core process behind the server."""

from __future__ import annotations

import logging
import time

import jax

from xlaserve.config import CompilationConfig, EngineConfig
from xlaserve.engine.dp_engine import make_engine_core
from xlaserve.engine.host_memory import keep_host_memory
from xlaserve.engine.structured_output import StructuredOutputManager
from xlaserve.models.config import TransformerConfig
from xlaserve.models.loader import load_checkpoint
from xlaserve.models.registry import model_config_from_hf
from xlaserve.sharding import distributed

logger = logging.getLogger(__name__)


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


def start_engine(config: EngineConfig):
    """Load the model and build its engine core -> (tokenizer or None, model config, max_model_len,
    core). max_model_len is the core's: the model's own limit may be lowered to what the KV cache
    holds."""
    keep_host_memory()  # before jax starts its CPU thread pools
    parallel = config.parallel
    if parallel.nnodes > 1:
        distributed.initialize(
            parallel.master_addr, parallel.master_port, parallel.nnodes, parallel.node_rank
        )
    setup_compilation_cache(config.compilation)
    t0 = time.perf_counter()
    checkpoint = load_checkpoint(
        config.model.model,
        load_format=config.model.load_format,
        seed=config.model.seed,
        skip_tokenizer_init=config.model.skip_tokenizer_init,
        quantization=config.model.quantization,
    )
    model_config = model_config_from_hf(checkpoint.hf_config)
    max_model_len = resolve_max_model_len(config.model.max_model_len, model_config)
    t1 = time.perf_counter()
    structured_output = StructuredOutputManager(
        checkpoint.tokenizer, model_config.vocab_size, eos_token_id(checkpoint.tokenizer, model_config)
    )
    core = make_engine_core(
        config, checkpoint.hf_config, checkpoint.tensors, max_model_len, structured_output=structured_output
    )
    # One line a person (and `xlaserve bench startup`) reads: where a start's seconds went.
    logger.info(
        "start-up: checkpoint %.1fs, engine %.1fs (placement, KV cache and warm-up: see above)",
        t1 - t0,
        time.perf_counter() - t1,
    )
    return checkpoint.tokenizer, model_config, core.max_model_len, core

"""Building an engine core from a config: the checkpoint, the context length, the devices.

Shared by the offline `LLM` (in-process) and the engine-core process behind the server."""

from __future__ import annotations

import jax

from xlaserve.config import EngineConfig
from xlaserve.engine.dp_engine import make_engine_core
from xlaserve.models.config import TransformerConfig
from xlaserve.models.loader import load_checkpoint
from xlaserve.sharding import distributed


def setup_compilation_cache(directory: str | None) -> None:
    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def resolve_max_model_len(requested: int | None, model_config: TransformerConfig) -> int:
    limit = model_config.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}")
    return requested


def start_engine(config: EngineConfig):
    """Load the model and build its engine core -> (tokenizer, model config, max_model_len, core).

    max_model_len is the core's: the model's own limit may be lowered to what the KV cache holds."""
    parallel = config.parallel
    if parallel.nnodes > 1:
        distributed.initialize(
            parallel.master_addr, parallel.master_port, parallel.nnodes, parallel.node_rank
        )
    setup_compilation_cache(config.compilation.compilation_cache_dir)
    checkpoint = load_checkpoint(
        config.model.model, load_format=config.model.load_format, seed=config.model.seed
    )
    model_config = TransformerConfig.from_hf(checkpoint.hf_config)
    max_model_len = resolve_max_model_len(config.model.max_model_len, model_config)
    core = make_engine_core(config, checkpoint.hf_config, checkpoint.tensors, max_model_len)
    return checkpoint.tokenizer, model_config, core.max_model_len, core

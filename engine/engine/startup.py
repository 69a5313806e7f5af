"""Building an engine core from a config: the checkpoint, the context length, the devices.

Shared by the offline `LLM` (in-process) and the engine-core process behind the server."""

from __future__ import annotations

import jax

from xlaserve.config import EngineConfig
from xlaserve.engine.dp_engine import make_engine_core
from xlaserve.engine.structured_output import StructuredOutputManager
from xlaserve.models.config import TransformerConfig
from xlaserve.models.loader import load_checkpoint
from xlaserve.models.registry import model_config_from_hf
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


def eos_token_id(tokenizer, model_config: TransformerConfig) -> int | None:
    """The id that ends a request: the tokenizer's EOS, else the model config's first (no tokenizer
    under skip_tokenizer_init, or one that names none)."""
    eos = None if tokenizer is None else tokenizer.eos_token_id
    if eos is None and model_config.eos_token_ids:
        eos = model_config.eos_token_ids[0]
    return eos


def start_engine(config: EngineConfig):
    """Load the model and build its engine core -> (tokenizer or None, model config, max_model_len,
    core)."""
    parallel = config.parallel
    if parallel.nnodes > 1:
        distributed.initialize(
            parallel.master_addr, parallel.master_port, parallel.nnodes, parallel.node_rank
        )
    setup_compilation_cache(config.compilation.compilation_cache_dir)
    checkpoint = load_checkpoint(
        config.model.model,
        load_format=config.model.load_format,
        seed=config.model.seed,
        skip_tokenizer_init=config.model.skip_tokenizer_init,
    )
    model_config = model_config_from_hf(checkpoint.hf_config)
    max_model_len = resolve_max_model_len(config.model.max_model_len, model_config)
    structured_output = StructuredOutputManager(
        checkpoint.tokenizer, model_config.vocab_size, eos_token_id(checkpoint.tokenizer, model_config)
    )
    core = make_engine_core(
        config, checkpoint.hf_config, checkpoint.tensors, max_model_len, structured_output=structured_output
    )
    return checkpoint.tokenizer, model_config, max_model_len, core

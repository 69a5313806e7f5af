"""Building an engine core from a config: the executor reads the model, the engine adds its
bookkeeping (scheduler, KV cache manager, structured outputs) around it.

Shared by the offline `LLM` (in-process) and the engine-core process behind the server. Nothing here
reads a checkpoint itself: loading belongs to the executor (xlaserve.executor.load_model), so this
module imports neither jax nor a loader."""

from __future__ import annotations

import logging
import time

from xlaserve.config import EngineConfig
from xlaserve.engine.core import EngineCore
from xlaserve.engine.dp_engine import DataParallelEngineCore, make_engine_core
from xlaserve.engine.host_memory import keep_host_memory
from xlaserve.engine.structured_output import StructuredOutputManager
from xlaserve.executor import ModelInfo, load_model

logger = logging.getLogger(__name__)


def start_engine(config: EngineConfig, devices=None) -> tuple[ModelInfo, EngineCore | DataParallelEngineCore]:
    """Load the model and build its engine core -> (what the front end needs of the model, core).
    The core's max_model_len is the one to serve: the model's own limit may be lowered to what the
    KV cache holds. `devices`: the engine's (default: all; `LLM(mesh=...)` gives a trainer's)."""
    keep_host_memory()  # before jax starts its CPU thread pools
    t0 = time.perf_counter()
    checkpoint = load_model(config)
    t1 = time.perf_counter()
    info = checkpoint.info
    structured_output = StructuredOutputManager(info.tokenizer, info.vocab_size, info.eos_token_id)
    core = make_engine_core(config, checkpoint, structured_output, devices)
    # One line a person (and `xlaserve bench startup`) reads: where a start's seconds went.
    logger.info(
        "start-up: checkpoint %.1fs, engine %.1fs (placement, KV cache and warm-up: see above)",
        t1 - t0,
        time.perf_counter() - t1,
    )
    return info, core

"""Engine configuration: frozen, validated dataclasses built from vLLM-named keyword arguments.

Runtime-derived values (the number of KV blocks, EOS ids, the model's own max length) are not
written back here: they live on the objects that derive them (the runner, the tokenizer).

Each field is declared once: its command-line spelling and help ride in its metadata as an `Arg`
(config_args.py, plain data), which entrypoints/arg_utils.py turns into a flag, with the type from
the annotation. `SpeculativeConfig` lives in speculative_config.py; both are re-exported here.

One module per group, as vLLM's vllm/config/: model.py (with what it reads apart: multimodal.py's media
limits, generation.py's default sampling), cache.py, scheduler.py, parallel.py, lora.py, compilation.py,
and engine.py's EngineConfig, which holds them and checks them against each other.
Callers import every name from `xlaserve.config`.
"""

from __future__ import annotations

from xlaserve.config.cache import KV_CACHE_DTYPES, CacheConfig
from xlaserve.config.compilation import CompilationConfig, default_compilation_cache_dir
from xlaserve.config.engine import CONFIG_GROUPS, EngineConfig
from xlaserve.config.kv_transfer import KV_ROLES, KVTransferConfig
from xlaserve.config.lora import LoRAConfig
from xlaserve.config.model import CONTENT_FORMATS, QUANTIZATION_METHODS, RUNNER_TYPES, ModelConfig
from xlaserve.config.multimodal import DEFAULT_IMAGES_PER_PROMPT, parse_mm_limits
from xlaserve.config.parallel import ParallelConfig
from xlaserve.config.scheduler import SchedulerConfig
from xlaserve.config_args import ARG_KEY, Arg, arg, not_a_flag
from xlaserve.speculative_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

__all__ = [
    "ARG_KEY",
    "CONTENT_FORMATS",
    "Arg",
    "CONFIG_GROUPS",
    "CacheConfig",
    "CompilationConfig",
    "DEFAULT_IMAGES_PER_PROMPT",
    "EngineConfig",
    "KV_CACHE_DTYPES",
    "KV_ROLES",
    "KVTransferConfig",
    "LoRAConfig",
    "MAX_SPECULATIVE_TOKENS",
    "ModelConfig",
    "ParallelConfig",
    "QUANTIZATION_METHODS",
    "RUNNER_TYPES",
    "SchedulerConfig",
    "SpeculativeConfig",
    "arg",
    "default_compilation_cache_dir",
    "not_a_flag",
    "parse_mm_limits",
]

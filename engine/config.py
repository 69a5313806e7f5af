"""Engine configuration: frozen, validated dataclasses built from vLLM-named keyword arguments.

Runtime-derived values (the number of KV blocks, EOS ids, the model's own max length) are not
written back here: they live on the objects that derive them (the runner, the tokenizer).

Each field is declared once: its command-line spelling and help ride in its metadata as an `Arg`
(config_args.py, plain data), which entrypoints/arg_utils.py turns into a flag, with the type from
the annotation. `SpeculativeConfig` lives in speculative_config.py; both are re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

# The argument spec and the speculative config have their own modules; callers import them from here.
from xlaserve.config_args import ARG_KEY, Arg, arg, not_a_flag  # noqa: F401 (Arg: re-exported)
from xlaserve.pooling_params import CONVERT_TYPES, PoolerConfig
from xlaserve.speculative_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig  # noqa: F401

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_POLICIES = ("fcfs", "priority")
_ATTENTION_BACKENDS = ("auto", "reference", "pallas", "jax-triton")
_LOAD_FORMATS = ("auto", "dummy")
RUNNER_TYPES = ("generate", "pooling")
# vLLM's names. int8/fp8: quantize a float checkpoint at load; gguf: keep a GGUF's quantized tensors;
# a checkpoint quantized at release (config.json's quantization_config) needs no flag.
QUANTIZATION_METHODS = ("int8", "fp8", "gguf", "compressed-tensors")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    # None or "smollm2": the embedded default model
    model: str | None = field(
        default=None, metadata=arg("HF directory, .gguf file, or 'smollm2' (the default)")
    )
    # auto: bfloat16 where the device computes it natively, else float32
    dtype: str = field(
        default="auto",
        metadata=arg("weights and activations (auto: bfloat16 where native, else float32)", choices=_DTYPES),
    )
    max_model_len: int | None = field(
        default=None, metadata=arg("the longest prompt + output (default: the model's own limit)")
    )
    seed: int = field(default=0, metadata=arg("the seed of requests without one (and of dummy weights)"))
    served_model_name: str | None = field(
        default=None, metadata=not_a_flag("the server's --served-model-name (several names)")
    )
    load_format: str = field(
        default="auto",
        metadata=arg(
            "dummy: random weights; config and tokenizer from the --model directory (benchmarks)",
            choices=_LOAD_FORMATS,
        ),
    )
    # No tokenizer (the directory need not have one): prompts are token ids, outputs token ids only.
    skip_tokenizer_init: bool = field(
        default=False,
        metadata=arg("load no tokenizer: prompts must be token ids, outputs carry token ids and no text"),
    )
    # A request's token ids and logprobs independent of its batch (kernels/invariant.py; README "Batch
    # invariance"). Read where the config is built (the front end), like the attention backend's.
    batch_invariant: bool = field(
        default_factory=lambda: (
            os.environ.get("XLASERVE_BATCH_INVARIANT", "1").lower() not in ("0", "false", "no", "off")
        ),
        metadata=arg(
            "a request's tokens and logprobs the same bits whatever runs beside it (default on; also "
            "XLASERVE_BATCH_INVARIANT=0)"
        ),
    )
    # QUANTIZATION_METHODS; None: as the checkpoint is (models/quantization.py, models/prequantized.py)
    quantization: str | None = field(
        default=None,
        metadata=arg(
            "weights kept quantized on the device: int8 or fp8 (per-channel scales, quantized at load); "
            "gguf: a quantized GGUF's own blocks. A checkpoint released quantized needs no flag",
            aliases=("-q",),
            choices=QUANTIZATION_METHODS,
        ),
    )

    # vLLM's runner: generate (sample tokens) or pooling (embeddings, classes, scores: the prompt's
    # hidden states pooled, no decoding; worker/pooler.py, README "Pooling models").
    runner: str = field(
        default="generate",
        metadata=arg(
            "generate: sample tokens; pooling: embed, classify or score prompts", choices=RUNNER_TYPES
        ),
    )
    convert: str = field(
        default="auto",
        metadata=arg(
            "what a pooling runner computes (auto: classify for a *ForSequenceClassification checkpoint, "
            "else embed)",
            choices=CONVERT_TYPES,
        ),
    )
    # A PoolerConfig; a dict or its JSON text (the flag) is converted.
    pooler_config: PoolerConfig | None = field(
        default=None,
        metadata=arg(
            'a pooling runner\'s defaults, as JSON: {"pooling_type": "LAST"|"MEAN"|"CLS"|"ALL", '
            '"normalize": true, "dimensions": 256, "activation": true}'
        ),
    )
    # vLLM's flag: images a prompt may carry (a vision-language model; engine/engine/mm_processor.py),
    # as JSON text or a dict; None: DEFAULT_IMAGES_PER_PROMPT. Checked where the config is built.
    limit_mm_per_prompt: str | None = field(
        default=None,
        metadata=arg('images per prompt of a vision-language model, as JSON: {"image": 2} (default 8)'),
    )

    def __post_init__(self):
        object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
        if isinstance(self.limit_mm_per_prompt, dict):  # kept as JSON text: the config stays hashable
            object.__setattr__(self, "limit_mm_per_prompt", json.dumps(self.limit_mm_per_prompt))
        parse_mm_limits(self.limit_mm_per_prompt)  # a bad value is an error at start
        _require(self.runner in RUNNER_TYPES, f"runner must be one of {RUNNER_TYPES}, got {self.runner!r}")
        _require(
            self.convert in CONVERT_TYPES, f"convert must be one of {CONVERT_TYPES}, got {self.convert!r}"
        )
        _require(
            self.runner == "pooling" or (self.convert == "auto" and self.pooler_config is None),
            f"convert and pooler_config need runner='pooling' (runner={self.runner!r})",
        )
        _require(
            self.quantization is None or self.quantization in QUANTIZATION_METHODS,
            f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}",
        )
        _require(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _require(
            self.load_format in _LOAD_FORMATS,
            f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )

    @property
    def pooling_type(self) -> str:
        """A pooling runner's pooling (pooler_config's, else ALL for reward models, LAST otherwise)."""
        if self.pooler_config is not None and self.pooler_config.pooling_type is not None:
            return self.pooler_config.pooling_type
        return "ALL" if self.convert == "reward" else "LAST"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=arg("tokens per KV cache block (8, 16, 32, 64 or 128)"))
    enable_prefix_caching: bool = field(
        default=True, metadata=arg("reuse the KV blocks of a shared prompt prefix (default: on)")
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=arg("the share of device memory the engine may use, weights included (GPU)")
    )
    # Bytes for the KV cache, on any platform. Unset: 512 MiB on CPU (`_DEFAULT_CPU_KV_CACHE_MEMORY`
    # in worker/model_runner.py); on GPU, gpu_memory_utilization of the device's memory, less what is in use.
    kv_cache_memory: int | None = field(default=None, metadata=arg("KV cache budget in bytes (CPU)"))
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=arg("KV cache blocks, whatever the memory budget (tests, benchmarks)")
    )
    # auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: one byte per value, twice the blocks.
    kv_cache_dtype: str = field(
        default="auto",
        metadata=arg(
            "KV cache storage; fp8: one byte per value, twice the blocks (default: auto, the model's dtype)",
            choices=KV_CACHE_DTYPES,
        ),
    )
    # GiB of host memory for blocks the device prefix cache evicts, loaded back on a later prefix hit
    # (core/kv_offload.py, worker/kv_offload.py; README "KV cache offload"). None: off.
    kv_offloading_size: float | None = field(
        default=None,
        metadata=arg(
            "GiB of host memory holding KV blocks evicted from the device cache, reloaded on a prefix "
            "hit (default: off)"
        ),
    )

    def __post_init__(self):
        _require(
            self.kv_offloading_size is None
            or (
                isinstance(self.kv_offloading_size, (int, float))
                and not isinstance(self.kv_offloading_size, bool)
                and 0 < self.kv_offloading_size < math.inf
            ),
            f"kv_offloading_size must be a number of GiB > 0, got {self.kv_offloading_size!r}",
        )
        _require(
            self.kv_offloading_size is None or self.enable_prefix_caching,
            "kv_offloading_size needs enable_prefix_caching: the host tier holds the blocks the prefix "
            "cache evicts, under their hashes",
        )
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _require(
            self.block_size in (8, 16, 32, 64, 128),
            f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}",
        )
        _require(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
            f"num_gpu_blocks_override must be >= 2, got {self.num_gpu_blocks_override}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata=arg("requests in one step (default: 64)"))
    max_num_batched_tokens: int = field(default=512, metadata=arg("tokens in one step (default: 512)"))
    policy: str = field(
        default="fcfs",
        metadata=arg(
            "who is admitted (and preempted) first: fcfs, or priority (a request's priority, then arrival)",
            flag="--scheduling-policy",
            choices=_POLICIES,
        ),
    )
    max_num_queued_reqs: int | None = field(  # bound on waiting requests (server: 503 past it)
        default=None, metadata=not_a_flag("the server's --max-num-queued-reqs")
    )
    # Fairness under long prompts (vLLM's names). A prefill chunk is capped at the threshold (None:
    # a quarter of max_num_batched_tokens; 0: no cap) and at most max_num_partial_prefills prompts
    # (max_long_partial_prefills of them longer than the threshold) are prefilled across steps at
    # once, so partial prefills take at most half of each step's budget by default: the other half
    # always serves decodes and short prompts, whose first token then comes within a step or two.
    long_prefill_token_threshold: int | None = field(
        default=None,
        metadata=arg(
            "cap on a prompt's prefill chunk per step, so one long prompt cannot take a whole step "
            "(default: max_num_batched_tokens / 4; 0: no cap)"
        ),
    )
    max_num_partial_prefills: int = field(
        default=2, metadata=arg("prompts prefilled across steps at once (default: 2)")
    )
    max_long_partial_prefills: int = field(
        default=2, metadata=arg("of those, prompts longer than the threshold (default: 2)")
    )
    # vLLM's async scheduling: the host schedules step N+1 while the device runs step N (None: on
    # wherever the executor supports it, i.e. one process; the engine core logs why where not).
    async_scheduling: bool | None = field(
        default=None,
        metadata=arg("schedule step N+1 while the device runs step N (default: on where supported)"),
    )

    def __post_init__(self):
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 16,
            f"max_num_batched_tokens must be >= 16, got {self.max_num_batched_tokens}",
        )
        _require(self.policy in _POLICIES, f"policy must be one of {_POLICIES}, got {self.policy!r}")
        _require(
            self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 0,
            f"long_prefill_token_threshold must be >= 0 (0: no cap), got {self.long_prefill_token_threshold}",
        )
        _require(
            self.max_num_partial_prefills >= 1,
            f"max_num_partial_prefills must be >= 1, got {self.max_num_partial_prefills}",
        )
        _require(
            1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills,
            f"max_long_partial_prefills must be in [1, max_num_partial_prefills="
            f"{self.max_num_partial_prefills}], got {self.max_long_partial_prefills}",
        )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(
        default=1, metadata=arg("devices one model is sharded over", aliases=("-tp",))
    )
    data_parallel_size: int = field(
        default=1, metadata=arg("engine cores side by side, each on its own devices", aliases=("-dp",))
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=arg(
            "pipeline stages: the layers split into this many contiguous stages, each on its own "
            "tensor_parallel_size devices",
            aliases=("-pp",),
        ),
    )
    enable_expert_parallel: bool = field(
        default=False, metadata=arg("shard a MoE's experts over the tensor-parallel devices")
    )
    # Multi-host (vLLM's multi-node names): one process per host, jax.distributed across them.
    nnodes: int = field(default=1, metadata=arg("processes (hosts) of a multi-host engine"))
    node_rank: int = field(default=0, metadata=arg("this process's rank; 0 runs the front end"))
    master_addr: str = field(
        default="127.0.0.1", metadata=arg("address of process 0 (jax.distributed coordinator)")
    )
    # jax.distributed's coordinator; the step channel uses master_port + 1
    master_port: int = field(default=29500, metadata=arg("coordinator port; the step channel uses +1"))

    def __post_init__(self):
        _require(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}",
        )
        _require(
            self.data_parallel_size >= 1, f"data_parallel_size must be >= 1, got {self.data_parallel_size}"
        )
        _require(
            self.pipeline_parallel_size >= 1,
            f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}",
        )
        # Not yet: stages across processes, and data-parallel ranks each of several stages.
        if self.pipeline_parallel_size > 1:
            _require(
                self.nnodes == 1,
                f"pipeline_parallel_size={self.pipeline_parallel_size} runs on one host for now (nnodes=1)",
            )
            _require(
                self.data_parallel_size == 1,
                f"pipeline_parallel_size={self.pipeline_parallel_size} cannot be combined with "
                f"data_parallel_size={self.data_parallel_size} yet",
            )
        _require(self.nnodes >= 1, f"nnodes must be >= 1, got {self.nnodes}")
        _require(
            0 <= self.node_rank < self.nnodes,
            f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}",
        )
        _require(
            self.nnodes == 1 or self.data_parallel_size == 1,
            f"data_parallel_size={self.data_parallel_size} with nnodes={self.nnodes} is not supported; "
            "use tensor parallelism across hosts",
        )


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names): adapters in fixed device slots, `max_loras` of them per step,
    each of rank at most `max_lora_rank`; `max_cpu_loras` adapters kept loaded in host memory."""

    enable_lora: bool = field(default=False, metadata=arg("serve LoRA adapters"))
    max_loras: int = field(default=1, metadata=arg("adapters in one step (device slots; default 1)"))
    max_lora_rank: int = field(default=16, metadata=arg("the largest adapter rank (default 16)"))
    max_cpu_loras: int | None = field(  # None: max_loras
        default=None, metadata=arg("adapters kept in host memory (default: max-loras)")
    )

    def __post_init__(self):
        _require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _require(
            1 <= self.max_lora_rank <= 512, f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}"
        )
        _require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
        )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


def default_compilation_cache_dir() -> str:
    """XLASERVE_COMPILATION_CACHE_DIR, else <XLASERVE_CACHE_ROOT, or ~/.cache/xlaserve>/xla."""
    explicit = os.environ.get("XLASERVE_COMPILATION_CACHE_DIR")
    if explicit:
        return explicit
    root = os.environ.get("XLASERVE_CACHE_ROOT") or os.path.join(
        os.path.expanduser("~"), ".cache", "xlaserve"
    )
    return os.path.join(root, "xla")


@dataclass(frozen=True)
class CompilationConfig:
    # The environment-derived defaults are read where the config is built: the front end, whose
    # config the engine core process receives whole.
    attention_backend: str = field(
        default_factory=lambda: os.environ.get("XLASERVE_ATTENTION_BACKEND", "auto"),
        metadata=arg("also XLASERVE_ATTENTION_BACKEND", choices=_ATTENTION_BACKENDS),
    )
    # The persistent XLA compilation cache: on by default, so a second start loads its programs
    # instead of compiling them. Several processes may share it (JAX locks it), and it is bounded:
    # past compilation_cache_max_size bytes the least recently used programs go.
    compilation_cache_dir: str | None = field(
        default_factory=lambda: default_compilation_cache_dir(),
        metadata=arg(
            "persistent XLA compilation cache (default ~/.cache/xlaserve/xla; XLASERVE_CACHE_ROOT moves it)"
        ),
    )
    disable_compilation_cache: bool = field(
        default_factory=lambda: os.environ.get("XLASERVE_DISABLE_COMPILATION_CACHE", "") not in ("", "0"),
        metadata=arg(
            "compile every program at start, caching nothing (also XLASERVE_DISABLE_COMPILATION_CACHE=1)"
        ),
    )
    compilation_cache_max_size: int = field(default=4 * 2**30, metadata=arg("bytes (default: 4 GiB)"))
    strict_compile_guard: bool = field(  # raise (instead of warn) if anything compiles after warm-up
        default=False, metadata=arg("fail a step that compiles after warm-up (default: warn)")
    )
    enforce_eager: bool = field(  # skip warm-up (compile buckets lazily)
        default=False, metadata=arg("skip warm-up compiles")
    )

    def __post_init__(self):
        _require(
            self.compilation_cache_max_size > 0,
            f"compilation_cache_max_size must be > 0 bytes, got {self.compilation_cache_max_size}",
        )
        _require(
            self.attention_backend in _ATTENTION_BACKENDS,
            f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    compilation: CompilationConfig
    speculative: SpeculativeConfig | None = field(
        default=None,
        metadata=arg(
            'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 1, "prompt_lookup_max": 4} (engine/SPEC_DECODE.md)',
            flag="--speculative-config",
        ),
    )
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self):
        if self.cache.kv_offloading_size is not None:
            # The transfers ride beside the step on one process; a draft model's own cache (indexed by
            # the same block ids) is not offloaded.
            _require(self.parallel.nnodes == 1, "kv_offloading_size runs on one host (nnodes=1)")
            _require(
                self.speculative is None or self.speculative.method != "draft_model",
                "kv_offloading_size cannot be combined with a draft model (its KV cache is not offloaded)",
            )
        pp = self.parallel.pipeline_parallel_size
        if pp > 1:  # what the pipelined executor (executor/pipeline.py) does not run yet
            for is_set, what in (
                (self.speculative is not None, "speculative_config"),
                (self.lora.enable_lora, "enable_lora"),
                (self.model.runner == "pooling", "runner='pooling'"),
                (self.cache.kv_offloading_size is not None, "kv_offloading_size"),
            ):
                _require(not is_set, f"pipeline_parallel_size={pp} cannot be combined with {what} yet")
        # Speculative decoding runs on the synchronous step: the next step's drafts come from this
        # step's accepted tokens, which async scheduling would not have yet.
        _require(
            self.speculative is None or self.scheduler.async_scheduling is not True,
            "async_scheduling cannot be combined with speculative_config; turn one of them off",
        )
        if self.model.runner == "pooling":
            _require(
                self.speculative is None, "runner='pooling' never decodes: speculative_config does not apply"
            )
            _require(self.parallel.nnodes == 1, "runner='pooling' runs on one host (nnodes=1)")
            if self.cache.enable_prefix_caching and self.model.pooling_type != "LAST":
                # A cached prefix's tokens are not computed again, and pooling over them needs their
                # hidden states: only LAST pooling (the last token is always computed) may skip them.
                object.__setattr__(
                    self, "cache", dataclasses.replace(self.cache, enable_prefix_caching=False)
                )

    def async_scheduling_off_reason(self) -> str | None:
        """Why async scheduling cannot run with this configuration (None: it can)."""
        if self.parallel.nnodes > 1:
            return "the multi-host executor runs each step synchronously (followers check every step)"
        if self.speculative is not None:
            return "speculative decoding proposes drafts from the accepted ids, known only after a step"
        return None

    @property
    def num_spec_tokens(self) -> int:
        """Drafts verified per request and step: speculative_config's k, 0 without speculation. A
        step then reads 1 + k positions per request (the scheduler's slots, the runner's verification,
        the grammar masks)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    @property
    def is_async_scheduling(self) -> bool:
        """Async scheduling is asked for (or left to its default, on) and possible here."""
        return self.scheduler.async_scheduling is not False and self.async_scheduling_off_reason() is None

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> EngineConfig:
        """Split vLLM-named keyword arguments among the sub-configs; unknown names are an error. A
        field is known by its name and by its flag's (`scheduling_policy` for `policy`)."""
        parts: dict[str, dict] = {name: {} for name in CONFIG_GROUPS}
        parts["model"]["model"] = model
        names: dict[str, tuple[str, str]] = {}
        for group, klass in CONFIG_GROUPS.items():
            for f in dataclasses.fields(klass):
                names[f.name] = (group, f.name)
                spec = f.metadata.get(ARG_KEY)
                if spec is not None:
                    names.setdefault(spec.kwarg_for(f.name), (group, f.name))
        speculative = SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"unknown engine argument {key!r}; known: {sorted(names)}")
            group, name = names[key]
            parts[group][name] = value
        return cls(
            **{group: CONFIG_GROUPS[group](**parts[group]) for group in CONFIG_GROUPS},
            speculative=speculative,
        )


# The sub-configs by their `EngineConfig` field name: what `from_kwargs` splits arguments among and
# what entrypoints/arg_utils.py reads flags from.
CONFIG_GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "compilation": CompilationConfig,
    "lora": LoRAConfig,
}


# Images per prompt when --limit-mm-per-prompt does not say (vLLM's flag; JSON like '{"image": 2}').
DEFAULT_IMAGES_PER_PROMPT = 8


def parse_mm_limits(value) -> dict[str, int]:
    """--limit-mm-per-prompt's JSON text (or a dict) -> {"image": n}; ValueError naming the field."""
    if value is None:
        return {"image": DEFAULT_IMAGES_PER_PROMPT}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f'limit_mm_per_prompt must be JSON like {{"image": 2}}, got {value!r}') from None
    if not isinstance(value, dict):
        raise ValueError(f'limit_mm_per_prompt must be an object like {{"image": 2}}, got {value!r}')
    unknown = sorted(set(value) - {"image"})
    if unknown:
        raise ValueError(f"limit_mm_per_prompt: modalities {unknown} are not supported; supported: ['image']")
    count = value.get("image", DEFAULT_IMAGES_PER_PROMPT)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"limit_mm_per_prompt.image must be an integer >= 0, got {count!r}")
    return {"image": count}

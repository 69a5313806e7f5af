"""The model to serve: its checkpoint, dtype, tokenizer, runner, quantization and limits."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from xlaserve.config import generation
from xlaserve.config.checks import require
from xlaserve.config.generation import GENERATION_CONFIG_FILE, GENERATION_CONFIG_KEYS
from xlaserve.config.multimodal import parse_mm_limits, video_num_frames_of
from xlaserve.config_args import arg, json_object, not_a_flag
from xlaserve.pooling_params import CONVERT_TYPES, PoolerConfig
from xlaserve.sampling_params import DEFAULT_MAX_LOGPROBS
from xlaserve.structured_outputs_params import is_int

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "dummy")
RUNNER_TYPES = ("generate", "pooling")
TOKENIZER_MODES = ("auto", "hf")
CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's --chat-template-content-format
# vLLM's --logprobs-mode values (worker/sampler.py).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


# vLLM's names. int8/fp8: quantize a float checkpoint at load; gguf: keep a GGUF's quantized tensors;
# a checkpoint quantized at release (config.json's quantization_config) needs no flag.
QUANTIZATION_METHODS = ("int8", "fp8", "gguf", "compressed-tensors")


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
    # vLLM's --tokenizer: the front end's and the core's (stop strings, grammars, EOS), the weights' own
    # vocabulary kept; None: the model's.
    tokenizer: str | None = field(
        default=None,
        metadata=arg("a tokenizer other than the model's: an HF directory (tokenizer.json) or a .gguf file"),
    )
    # vLLM's --tokenizer-mode: "hf" and "auto" are transformers' fast tokenizer, the only kind here.
    # transformers 5 has no slow tokenizers (AutoTokenizer ignores use_fast), and mistral-common's and
    # custom tokenizers are not wired in: those modes are refused by name.
    tokenizer_mode: str = field(
        default="auto",
        metadata=arg(
            "auto or hf: the model's Hugging Face (fast) tokenizer; vLLM's slow, mistral and custom modes "
            "are not supported",
            choices=TOKENIZER_MODES,
        ),
    )
    # vLLM's --trust-remote-code: the code a model directory ships for transformers (auto_map in its
    # tokenizer_config.json) may run when its tokenizer loads. The model itself always runs as one of
    # xlaserve's own classes (models/registry.py), never as code from the checkpoint.
    trust_remote_code: bool = field(
        default=False,
        metadata=arg(
            "let transformers run the Python files a model (or --tokenizer) directory ships for its "
            "tokenizer (auto_map); the model itself always runs as xlaserve's own code, never the "
            "checkpoint's"
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
    # Float32 dots batch-invariant too (kernels/dtype_ops.py: padded and tiled by rows): not by default,
    # since float32's one-row dot is a fast native product that padding costs (engine/PERFORMANCE.md).
    batch_invariant_float32: bool = field(
        default=False,
        metadata=arg(
            "with --batch-invariant, a float32 engine's dots too (padded and tiled by rows on CPU: about "
            "1.5x a batch-1 step's time there; 16-bit dtypes need nothing more)"
        ),
    )
    # vLLM's flag: what returned logprobs are of (worker/sampler.py): raw_* the model's distribution (after
    # a grammar's mask), processed_* the one each token was drawn from (penalties, temperature, min-p,
    # top-k, top-p applied), *_logits the logits instead of their log-softmax. Prompt logprobs: raw.
    logprobs_mode: str = field(
        default="raw_logprobs",
        metadata=arg(
            "what returned logprobs are of: raw_logprobs (the model's), processed_logprobs (the sampled-from "
            "distribution: penalties, temperature, top-k/p applied), raw_logits, processed_logits",
            choices=LOGPROBS_MODES,
        ),
    )
    # vLLM's flag: the most top logprobs a request may ask per token (logprobs, prompt_logprobs), and so
    # the static width of the sampler's top-k (worker/sampler.py): it keys the programs. -1: the vocabulary.
    max_logprobs: int = field(
        default=DEFAULT_MAX_LOGPROBS,
        metadata=arg(
            "the most logprobs (and prompt_logprobs) a request may ask per token; -1: the whole vocabulary "
            "(every sampling step then sorts it)"
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
            'a pooling runner\'s defaults, as JSON: {"pooling_type": "LAST"|"MEAN"|"CLS"|"ALL"|"STEP", '
            '"normalize": true, "dimensions": 256, "activation": true}; STEP also "step_tag_id": 12902, '
            '"returned_token_ids": [1, 0]'
        ),
    )
    # vLLM's hf_overrides: keys merged over the checkpoint's config.json when it loads (e.g. a Qwen3
    # reranker read as a sequence classifier: README "Pooling models"). Kept as JSON text (the config
    # stays hashable); a dict is converted.
    hf_overrides: str | None = field(
        default=None,
        metadata=arg(
            "keys merged over the checkpoint's config.json, as JSON: "
            '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}'
        ),
    )
    # vLLM's flags: where requests' default sampling comes from. "auto": the model directory's
    # generation_config.json (the model's authors' recommended temperature, top_p, ...), "vllm": the
    # engine's own defaults, or a folder holding a generation_config.json. The override's keys go over
    # either (JSON text; a dict is converted). Read by the front end (`sampling_defaults`).
    generation_config: str = field(
        default="auto",
        metadata=arg(
            "requests' default sampling: auto (the model's generation_config.json), vllm (the engine's "
            "own), or a folder with a generation_config.json"
        ),
    )
    override_generation_config: str | None = field(
        default=None,
        metadata=arg(
            'default sampling over --generation-config\'s, as JSON: {"temperature": 0.5, "max_new_tokens": '
            f"256}}; keys: {', '.join(GENERATION_CONFIG_KEYS)}"
        ),
    )
    # vLLM's flag: images a prompt may carry (a vision-language model; engine/engine/mm_processor.py),
    # as JSON text or a dict; None: config/multimodal.py's defaults. Checked where the config is built.
    limit_mm_per_prompt: str | None = field(
        default=None,
        metadata=arg(
            'images and videos per prompt of a vision-language model, JSON: {"image": 2, "video": 1} '
            '(defaults 8, 1), or vLLM\'s object form {"image": {"count": 2, "width": 512, "height": 512}}'
        ),
    )

    # vLLM's flag: the image processor's settings over the model directory's (a Qwen VL model's
    # {"max_pixels": 1003520}: its largest image, which sizes the encoder cache and the tower's buckets).
    # Kept as JSON text; read by the front end's processor and by the worker's model config alike.
    mm_processor_kwargs: str | None = field(
        default=None,
        metadata=arg(
            "the image processor's settings over the model directory's, as JSON: "
            '{"min_pixels": 3136, "max_pixels": 1003520}'
        ),
    )

    # vLLM's flag: how media are read; here a video's frames kept ({"video": {"num_frames": 32}}: sampled
    # uniformly, -1 every frame; engine/engine/video.py). Kept as JSON text; read by the front end only.
    media_io_kwargs: str | None = field(
        default=None,
        metadata=arg(
            'how videos are read, as JSON: {"video": {"num_frames": 32}} (frames kept, sampled uniformly; '
            "-1: all; default 32)"
        ),
    )

    def __post_init__(self):
        object.__setattr__(self, "pooler_config", PoolerConfig.parse(self.pooler_config))
        if self.media_io_kwargs is not None:
            kwargs = json_object(self.media_io_kwargs, "media_io_kwargs")
            object.__setattr__(self, "media_io_kwargs", json.dumps(kwargs, sort_keys=True))
            video_num_frames_of(kwargs)  # a bad value is an error at start
        if self.mm_processor_kwargs is not None:
            kwargs = json_object(self.mm_processor_kwargs, "mm_processor_kwargs")
            object.__setattr__(self, "mm_processor_kwargs", json.dumps(kwargs, sort_keys=True))
        if isinstance(self.limit_mm_per_prompt, dict):  # kept as JSON text: the config stays hashable
            object.__setattr__(self, "limit_mm_per_prompt", json.dumps(self.limit_mm_per_prompt))
        parse_mm_limits(self.limit_mm_per_prompt)  # a bad value is an error at start
        if self.override_generation_config is not None:
            override = generation.parse_override(self.override_generation_config)
            object.__setattr__(self, "override_generation_config", override)
        require(
            self.generation_config in ("auto", "vllm")
            or os.path.isfile(os.path.join(self.generation_config, GENERATION_CONFIG_FILE)),
            f"generation_config must be 'auto', 'vllm' or a folder holding a {GENERATION_CONFIG_FILE}, "
            f"got {self.generation_config!r}",
        )
        # Read once (config/generation.py); a value no request could take fails the start.
        folder = (
            self._model_folder() if self.generation_config in ("auto", "vllm") else self.generation_config
        )
        path, fields = generation.read_generation_config(folder)
        defaults_from = None if self.generation_config == "vllm" else fields  # "vllm": the engine's own
        defaults = generation.sampling_defaults(path, defaults_from, self.override_generation_config)
        object.__setattr__(self, "_sampling_defaults", defaults)
        object.__setattr__(self, "_generation_eos_token_ids", generation.eos_token_ids(fields, folder))
        if self.hf_overrides is not None:
            overrides = json_object(self.hf_overrides, "hf_overrides")
            object.__setattr__(self, "hf_overrides", json.dumps(overrides, sort_keys=True))
        require(
            self.tokenizer is None or os.path.exists(self.tokenizer),
            f"tokenizer must be a tokenizer directory or a .gguf file, got {self.tokenizer!r} (no such path)",
        )
        require(
            self.tokenizer_mode in TOKENIZER_MODES,
            f"tokenizer_mode must be one of {TOKENIZER_MODES}, got {self.tokenizer_mode!r} (transformers 5 "
            "has no slow tokenizers; mistral and custom tokenizers are not supported)",
        )
        require(self.runner in RUNNER_TYPES, f"runner must be one of {RUNNER_TYPES}, got {self.runner!r}")
        require(
            self.convert in CONVERT_TYPES, f"convert must be one of {CONVERT_TYPES}, got {self.convert!r}"
        )
        require(
            self.runner == "pooling" or (self.convert == "auto" and self.pooler_config is None),
            f"convert and pooler_config need runner='pooling' (runner={self.runner!r})",
        )
        require(
            self.quantization is None or self.quantization in QUANTIZATION_METHODS,
            f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}",
        )
        require(
            self.logprobs_mode in LOGPROBS_MODES,
            f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}",
        )
        require(
            is_int(self.max_logprobs) and self.max_logprobs >= -1,
            f"max_logprobs must be an int >= 0, or -1 (the vocabulary), got {self.max_logprobs!r}",
        )
        require(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        require(
            self.load_format in _LOAD_FORMATS,
            f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}",
        )
        require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )

    def max_logprobs_of(self, vocab_size: int) -> int:
        """max_logprobs resolved against the model's vocabulary: -1 is all of it, and no more than it."""
        return vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)

    def sampling_defaults(self) -> dict:
        """Requests' default sampling fields, as read when the config was made (a copy)."""
        return dict(self._sampling_defaults)

    def _model_folder(self) -> str | None:
        """The model's own directory (a GGUF file, the embedded default: None)."""
        model = None if self.model is None else os.path.expanduser(self.model)
        return model if model is not None and os.path.isdir(model) else None

    @property
    def generation_eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence by the model's generation config: a request stops at each, not only
        at the tokenizer's EOS (the input processor adds the others to its stop_token_ids, as vLLM's)."""
        return self._generation_eos_token_ids

    def log_sampling_defaults(self, defaults: dict) -> None:
        generation.log_sampling_defaults(defaults)

    @property
    def hf_overrides_dict(self) -> dict:
        return {} if self.hf_overrides is None else json.loads(self.hf_overrides)

    @property
    def video_num_frames(self) -> int:
        """The frames a video keeps (--media-io-kwargs' video.num_frames; -1: all)."""
        return video_num_frames_of({} if self.media_io_kwargs is None else json.loads(self.media_io_kwargs))

    @property
    def text_only_mode(self) -> bool:
        """vLLM's text-only mode: every --limit-mm-per-prompt modality at 0, so a vision-language model
        serves text only: its tower and projector are never placed on a device (worker/pipeline_stage.py
        `StageLayout.text_only`), and no encoder program or cache is made (worker/mm_encoder.py)."""
        return not any(parse_mm_limits(self.limit_mm_per_prompt).values())

    @property
    def mm_processor_kwargs_dict(self) -> dict:
        return {} if self.mm_processor_kwargs is None else json.loads(self.mm_processor_kwargs)

    @property
    def pooling_type(self) -> str:
        """A pooling runner's pooling (pooler_config's, else ALL for reward models, LAST otherwise)."""
        if self.pooler_config is not None and self.pooler_config.pooling_type is not None:
            return self.pooler_config.pooling_type
        return "ALL" if self.convert == "reward" else "LAST"

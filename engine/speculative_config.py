"""vLLM's `speculative_config`: which proposer drafts tokens, and how many a step verifies.

Plain data like the rest of the engine's configuration (config.py re-exports it): the proposers
live in core/spec_decode.py, worker/draft_model.py and worker/mtp.py, the design in SPEC_DECODE.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from xlaserve.config_args import json_object

_SPEC_METHODS = ("ngram", "draft_model", "mtp", "eagle3")
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
MAX_SPECULATIVE_TOKENS = 16


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: propose up to `num_speculative_tokens` tokens per step and verify
    them in one forward. ngram: the longest suffix of the request's tokens (between prompt_lookup_min
    and prompt_lookup_max long) found earlier in them proposes what followed it there. draft_model:
    `model`, a smaller model with the same vocabulary, proposes k tokens per step
    (worker/draft_model.py). mtp: the target checkpoint's multi-token prediction layer proposes them
    (worker/mtp.py). eagle3: `model`, an EAGLE-3 checkpoint (one decoder layer over three of the
    target's hidden states), proposes them (worker/eagle3.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: a smaller model with the same tokenizer; eagle3: its checkpoint

    def __post_init__(self):
        _require(
            self.method in _SPEC_METHODS,
            f"speculative_config.method must be one of {_SPEC_METHODS}, got {self.method!r}",
        )
        _require(
            isinstance(self.num_speculative_tokens, int)
            and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            f"speculative_config.num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
            f"got {self.num_speculative_tokens!r}",
        )
        _require(
            isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
            f"speculative_config.prompt_lookup_min must be >= 1, got {self.prompt_lookup_min!r}",
        )
        _require(
            isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
            f"speculative_config.prompt_lookup_max must be >= prompt_lookup_min={self.prompt_lookup_min}, "
            f"got {self.prompt_lookup_max!r}",
        )
        _require(
            self.method in ("draft_model", "eagle3") or self.model is None,
            f"speculative_config.model is for methods 'draft_model' and 'eagle3'; {self.method!r} takes none",
        )
        if self.method in ("draft_model", "eagle3"):
            _require(
                isinstance(self.model, str) and self.model,
                f"speculative_config.model is required for method {self.method!r} (a path to the draft)",
            )
            # The draft is loaded when the engine starts; a path that is not there is refused now, before
            # the target's weights are read. Its vocabulary is checked against the target's at load.
            _require(
                self.model == "smollm2" or os.path.exists(os.path.expanduser(self.model)),
                f"speculative_config.model: {self.model!r} does not exist (a directory with config.json, "
                "a .gguf file, or a directory written by `xlaserve convert`)",
            )

    @property
    def has_draft_cache(self) -> bool:
        """A draft network with a K/V cache of its own on the target's block ids (not n-gram's)."""
        return self.method in ("draft_model", "mtp", "eagle3")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A dict, its JSON text (the CLI's --speculative-config), a SpeculativeConfig, or None. A
        `model` in the speculators format names its method and, unless given, num_speculative_tokens."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        unknown = sorted(set(value) - set(_SPEC_KEYS))
        _require(not unknown, f"speculative_config: unknown field(s) {unknown}; known: {list(_SPEC_KEYS)}")
        if not {"method", "num_speculative_tokens"} <= value.keys():  # what a speculators model names
            found = read_speculators_config(value.get("model"))
            if found is not None:
                value = {**_speculators_settings(found), **value}
        _require("method" in value, f"speculative_config.method is required (one of {_SPEC_METHODS})")
        return cls(**value)


# A checkpoint of Red Hat's `speculators` library (which vLLM reads): config.json names its algorithm
# here and nests the draft layer's own config in `transformer_layer_config`.
SPECULATORS_KEY = "speculators_model_type"


def _speculators_settings(config: dict) -> dict:
    """The method and, where its proposal gives one, num_speculative_tokens a speculators config names."""
    settings = {"method": config[SPECULATORS_KEY]}
    proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    if proposals[0].get("speculative_tokens") is not None:
        settings["num_speculative_tokens"] = proposals[0]["speculative_tokens"]
    return settings


def read_speculators_config(model) -> dict | None:
    """config.json of a speculators-format checkpoint directory; None for anything else."""
    if not isinstance(model, str):
        return None
    path = os.path.join(os.path.expanduser(model), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json_object(f.read(), f"speculative_config.model ({path})")
    return config if SPECULATORS_KEY in config else None


def speculators_target(model, speculative_config) -> tuple:
    """(model, speculative_config) as the engine starts: a speculators checkpoint named as the model
    alone starts its verifier with it as the drafter (vLLM's `vllm serve <speculator>`), where the
    verifier is a local path (no model hub is read here); anything else as given."""
    found = read_speculators_config(model)
    if found is None:
        return model, speculative_config
    _require(
        speculative_config is None,
        f"model: {model!r} is a speculators checkpoint (a drafter); with a speculative_config, name the "
        "target model as the model",
    )
    verifier = ((found.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    _require(
        isinstance(verifier, str) and os.path.exists(os.path.expanduser(verifier)),
        f"model: {model!r} is a speculators checkpoint whose verifier {verifier!r} is not a local path "
        f"(no model hub is read): start on the target model with speculative_config={{'model': {model!r}}}",
    )
    return verifier, {"model": model, **_speculators_settings(found)}


def flatten_speculators_eagle3(config: dict) -> dict:
    """A speculators-format EAGLE-3 config.json as a released EAGLE-3 one: its transformer_layer_config
    with the EAGLE-3 fields over it, and norm_before_residual True unless it says otherwise (the
    library's and vLLM's default; released checkpoints' is False)."""
    _require(
        config.get(SPECULATORS_KEY) == "eagle3",
        f"speculative_config.model: a speculators checkpoint of type {config.get(SPECULATORS_KEY)!r}; "
        "'eagle3' is supported",
    )
    layer = config.get("transformer_layer_config")
    _require(
        isinstance(layer, dict),
        "speculative_config.model: a speculators checkpoint needs a transformer_layer_config object",
    )
    extra = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids")
    extra += ("norm_before_fc", "fc_norm", "norm_output")  # refused by the drafter where set
    flat = {**layer, **{k: config[k] for k in extra if config.get(k) is not None}}
    return flat | {
        "architectures": ["Eagle3LlamaForCausalLM"],
        "norm_before_residual": bool(config.get("norm_before_residual", True)),
    }

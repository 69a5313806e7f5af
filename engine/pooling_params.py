"""Pooling models' settings (vLLM's names): the engine's `PoolerConfig` and a request's `PoolingParams`.

Plain data like `SamplingParams` (the engine config holds a `PoolerConfig`). What they drive lives in
worker/pooler.py (the host math over the hidden states a step returns) and README "Pooling models".
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from xlaserve.config_args import json_object

# How a sequence's final-norm hidden states become one vector. LAST: the last prompt token (a
# decoder's natural summary, and prefix caching applies); MEAN: the mean over every prompt token;
# CLS: the first token; ALL: every token's (a matrix); STEP (a process reward model's): the rows at the
# prompt's `step_tag_id` tokens (every row without one), their columns cut to `returned_token_ids`.
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")
# What a pooling engine computes: `runner="pooling"` with `convert` (auto: classify for a
# *ForSequenceClassification checkpoint, embed otherwise).
CONVERT_TYPES = ("auto", "embed", "classify", "reward")
# What a request asks of it (vLLM's `pooling_task`): embed -> a (normalized) vector; classify ->
# class probabilities; score -> a classifier's probabilities used as a relevance score; encode -> the
# pooled hidden states as they are (ALL: one row per token); reward -> a reward model's raw outputs;
# token_embed / token_classify -> embed's and classify's output for every prompt token (one row
# each, whatever the engine's pooling_type).
POOLING_TASKS = ("embed", "classify", "score", "encode", "reward", "token_embed", "token_classify")
TOKEN_TASKS = ("token_embed", "token_classify")
# A pooling model's task -> the request tasks it serves (an embedding model scores by the cosine of
# two embeddings, which the entry point computes). token_classify: a *ForTokenClassification
# checkpoint (its head is trained on every token's state).
TASKS_OF_MODEL = {
    "embed": ("embed", "token_embed", "encode"),
    "classify": ("classify", "score", "token_classify", "encode"),
    "token_classify": ("token_classify", "encode"),
    "reward": ("reward", "encode"),
}


def output_width(task: str, num_labels: int, hidden_size: int | None) -> int | None:
    """The width of a `task`'s output rows (what STEP's returned_token_ids index): a classifier head's
    labels where the head runs (num_labels > 0; not for embed, token_embed or encode), else the hidden
    states'."""
    headless = not num_labels or task in ("embed", "token_embed", "encode")
    return hidden_size if headless else num_labels


def check_matryoshka(
    dimensions: int, is_matryoshka: bool, sizes: tuple[int, ...] | None, field: str = "dimensions"
) -> None:
    """vLLM's rule for cutting embeddings short: only a model trained for it (Matryoshka) keeps its
    quality when cut, and only at the sizes it lists where it lists them; ValueError naming `field`."""
    _require(
        is_matryoshka,
        f"{field} needs a Matryoshka model (config.json's is_matryoshka or matryoshka_dimensions; "
        f"hf_overrides can set them): this one's embeddings cut to {dimensions} would lose their quality",
    )
    _require(
        sizes is None or dimensions in sizes,
        f"{field} must be one of {list(sizes or ())} (the model's matryoshka_dimensions), got {dimensions}",
    )


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_step_settings(obj, prefix: str) -> None:
    """STEP pooling's `step_tag_id` (a token id) and `returned_token_ids` (a non-empty list of ids,
    stored as a tuple), on a PoolerConfig or a PoolingParams."""
    _require(
        obj.step_tag_id is None or _is_index(obj.step_tag_id),
        f"{prefix}step_tag_id must be a token id (an int >= 0), got {obj.step_tag_id!r}",
    )
    ids = obj.returned_token_ids
    _require(
        ids is None or (isinstance(ids, (list, tuple)) and len(ids) > 0 and all(map(_is_index, ids))),
        f"{prefix}returned_token_ids must be a non-empty list of ints >= 0, got {ids!r}",
    )
    if ids is not None:
        object.__setattr__(obj, "returned_token_ids", tuple(ids))


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's `pooler_config`: the engine's defaults for every pooling request (None: the task's).

    `pooling_type` (None: LAST, or ALL for reward), `normalize` (None: on for embed), `dimensions`
    (Matryoshka: keep the first n of each embedding, then normalize), `activation` (None: softmax for
    classify, sigmoid when there is one label); `softmax` is vLLM's older name of `activation`.
    STEP pooling only: `step_tag_id` (the token marking a step's end: the rows kept; None: every row)
    and `returned_token_ids` (the output's columns kept, in that order: a reward head's labels, or
    hidden dims; None: all), checked against the output's width when the engine loads the model."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    activation: bool | None = None
    softmax: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.pooling_type, str):
            object.__setattr__(self, "pooling_type", self.pooling_type.upper())
        _require(
            self.pooling_type is None or self.pooling_type in POOLING_TYPES,
            f"pooler_config.pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}",
        )
        _require(
            self.dimensions is None or (isinstance(self.dimensions, int) and self.dimensions >= 1),
            f"pooler_config.dimensions must be an int >= 1, got {self.dimensions!r}",
        )
        if self.activation is None and self.softmax is not None:
            object.__setattr__(self, "activation", self.softmax)
        _check_step_settings(self, "pooler_config.")
        for name in ("step_tag_id", "returned_token_ids"):
            _require(
                getattr(self, name) is None or self.pooling_type == "STEP",
                f"pooler_config.{name} needs pooling_type 'STEP', got pooling_type={self.pooling_type!r}",
            )

    @classmethod
    def parse(cls, value) -> PoolerConfig | None:
        """A dict, its JSON text (the CLI's --pooler-config), a PoolerConfig, or None."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        value = json_object(value, "pooler_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        _require(not unknown, f"pooler_config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's options (vLLM's `PoolingParams`); None: the engine's pooler_config.

    `task` is set by the entry point (`LLM.embed` -> "embed", ...). `dimensions` is checked against
    the model's hidden size at admission (the input processor), where it is known. `step_tag_id` and
    `returned_token_ids` (vLLM's) override the engine's STEP pooling settings for this request: an
    engine started with pooling_type STEP only, the ids bounded by the output's width at admission."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        _check_step_settings(self, "")
        _require(
            self.task in POOLING_TASKS, f"pooling_task must be one of {POOLING_TASKS}, got {self.task!r}"
        )
        _require(
            self.dimensions is None
            or (
                isinstance(self.dimensions, int)
                and not isinstance(self.dimensions, bool)
                and self.dimensions >= 1
            ),
            f"dimensions must be an int >= 1, got {self.dimensions!r}",
        )

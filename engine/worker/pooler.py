"""Pooling: a runner output beside sampling (README "Pooling models").

A pooling request runs through the same scheduler and the same compiled step as a generation
request (a decoder: chunked prefill of a long prompt, the paged KV cache; an encoder: each prompt whole
in one step, nothing cached, models/encoder.py), but never samples: the step's
forward already returns the final-norm hidden states (every token's [T, D], and each sequence's
last token's [R, D]), and `PoolingHook` brings the ones a pooling request needs to the host: the
last token's for LAST pooling, every computed token's otherwise, kept per request by position
until its prompt is complete. No program is added: the compile guard stays as it was.

The rest is host math in float32 numpy, once per request when its prompt completes (`Pooler`):
pool (LAST, MEAN, CLS, ALL; STEP: ALL's rows at the prompt's step tags, then, after the head, the
columns `returned_token_ids` names, as vLLM's StepPooler), then the task's head: embed -> Matryoshka
truncation and L2 normalization; classify / score -> the *ForSequenceClassification head
(`ClassifierHead`), softmax (sigmoid for one label); encode -> the pooled states as they are; reward ->
the head's raw outputs. MEAN is taken over the whole prompt's rows at once, so a chunked prompt pools
the same bits as a whole one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from xlaserve.config import ModelConfig
from xlaserve.models import modernbert
from xlaserve.models.bert import is_encoder_classifier, split_classifier
from xlaserve.pooling_params import TOKEN_TASKS, output_width
from xlaserve.worker.input_batch import isolate_failures
from xlaserve.worker.step_hooks import HostArrays, StepHook

_SEQ_CLS_SUFFIX = "ForSequenceClassification"
_TOKEN_CLS_SUFFIX = "ForTokenClassification"


def resolve_task(model_config: ModelConfig, architecture: str) -> str | None:
    """What a pooling engine computes (None: a generate engine): `convert`, or for auto, classify
    for a *ForSequenceClassification checkpoint, token_classify for a *ForTokenClassification one,
    and embed otherwise."""
    if model_config.runner != "pooling":
        return None
    if model_config.convert != "auto":
        return model_config.convert
    if architecture.endswith(_TOKEN_CLS_SUFFIX):
        return "token_classify"
    return "classify" if architecture.endswith(_SEQ_CLS_SUFFIX) else "embed"


def _classifier_suffix(architecture: str) -> str | None:
    return next((x for x in (_SEQ_CLS_SUFFIX, _TOKEN_CLS_SUFFIX) if architecture.endswith(x)), None)


def adapt_checkpoint(
    model_config: ModelConfig, hf_config: dict, tensors, tokenizer=None
) -> tuple[dict, Any, ClassifierHead | None]:
    """A *ForSequenceClassification or *ForTokenClassification checkpoint as its backbone plus its
    head, which the pooler applies on the host: a decoder's `score` [num_labels, D] (a token
    classifier's with its bias; hf_config then names the *ForCausalLM class, with a tied LM head,
    which the pooling runner's unused sampler reads); an encoder's dense -> tanh -> out layers, or a
    token classifier's one `classifier` layer (hf_config names its *Model backbone). Others as they
    are, head None. A decoder without `score` whose config has vLLM's `classifier_from_token` (a
    causal LM read as a classifier through hf_overrides): `_score_from_tokens`."""
    architectures = hf_config.get("architectures") or []
    suffix = _classifier_suffix(architectures[0]) if architectures else None
    if suffix is None:
        return hf_config, tensors, None
    architecture = architectures[0]
    if model_config.runner != "pooling":
        raise ValueError(f"{architecture} is a classifier: start the engine with runner='pooling'")
    encoder_split = _ENCODER_CLASSIFIERS.get(architecture) or (
        split_classifier if is_encoder_classifier(architecture) else None
    )
    if encoder_split is not None:
        if not isinstance(tensors, dict):
            raise ValueError(f"{architecture}: load it from its Hugging Face directory (safetensors)")
        hf_config, tensors, head = encoder_split(hf_config, tensors)
        return hf_config, tensors, ClassifierHead(**head)
    if isinstance(tensors, dict) and "score.weight" not in tensors and hf_config.get("classifier_from_token"):
        tensors = {**tensors, "score.weight": _score_from_tokens(architecture, hf_config, tensors, tokenizer)}
    if not isinstance(tensors, dict) or "score.weight" not in tensors:
        raise ValueError(f"{architecture}: the checkpoint has no score.weight (a classifier's head)")
    tensors = dict(tensors)
    score = np.asarray(tensors.pop("score.weight"), np.float32)
    bias = tensors.pop("score.bias", None)  # a token classifier's (HF: token_classification_bias)
    tensors.pop("lm_head.weight", None)
    causal = architecture[: -len(suffix)] + "ForCausalLM"
    hf_config = {**hf_config, "architectures": [causal], "tie_word_embeddings": True}
    return (
        hf_config,
        tensors,
        ClassifierHead(out_weight=score, out_bias=None if bias is None else np.asarray(bias, np.float32)),
    )


def _score_from_tokens(architecture: str, hf_config: dict, tensors: dict, tokenizer) -> np.ndarray:
    """vLLM's `classifier_from_token`: a causal LM's LM-head rows of those tokens as a classifier's
    `score` [num_tokens, D], one label per token (their logits); with `is_original_qwen3_reranker`
    (two tokens, "no" then "yes"), the one label yes - no, whose sigmoid is the two-way softmax's
    "yes" (Qwen3-Reranker's relevance)."""
    tokens = hf_config["classifier_from_token"]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"hf_overrides.classifier_from_token must be a list of tokens, got {tokens!r}")
    if tokenizer is None:
        raise ValueError("hf_overrides.classifier_from_token needs the model's tokenizer")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"hf_overrides.classifier_from_token: {unknown} are not tokens of this tokenizer")
    head = tensors.get("lm_head.weight")
    if head is None:  # a tied head: the embedding's rows
        head = tensors["model.embed_tokens.weight"]
    rows = np.asarray(np.asarray(head)[ids], np.float32)
    if hf_config.get("is_original_qwen3_reranker"):
        if len(ids) != 2:
            raise ValueError(
                f"{architecture}: is_original_qwen3_reranker needs two classifier_from_token (no, yes), "
                f"got {tokens}"
            )
        return rows[1:] - rows[:1]
    return rows


# An encoder classifier's head whose layout is not BERT's: its own split (models/<family>.py).
_ENCODER_CLASSIFIERS = {"ModernBertForSequenceClassification": modernbert.split_classifier}


def _gelu(x: np.ndarray) -> np.ndarray:  # the exact (erf) form, Hugging Face's "gelu"
    return 0.5 * x * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(x / math.sqrt(2.0)))


_HEAD_ACTIVATIONS = {"tanh": np.tanh, "gelu": _gelu}


@dataclass(frozen=True)
class ClassifierHead:
    """A sequence classifier's head on a pooled state, float32 on the host: `dense` -> its activation
    (tanh: an encoder's pooler or RoBERTa's head; GELU then a LayerNorm: ModernBERT's; absent for a
    decoder's `score`), then `out` [num_labels, D]. `pooling_type`: the pooling the head was trained on,
    when the model says (ModernBERT's classifier_pooling)."""

    out_weight: np.ndarray  # [num_labels, D]
    out_bias: np.ndarray | None = None  # [num_labels]
    dense_weight: np.ndarray | None = None  # [D, D] (HF's [out, in])
    dense_bias: np.ndarray | None = None  # [D]
    dense_activation: str = "tanh"
    norm_weight: np.ndarray | None = None  # [D]: a LayerNorm after the activation
    norm_bias: np.ndarray | None = None
    norm_eps: float = 1e-5
    pooling_type: str | None = None

    def __post_init__(self):
        if self.dense_activation not in _HEAD_ACTIVATIONS:
            raise ValueError(
                f"classifier activation {self.dense_activation!r} is not supported: "
                f"expected one of {sorted(_HEAD_ACTIVATIONS)}"
            )

    @property
    def num_labels(self) -> int:
        return self.out_weight.shape[0]

    def __call__(self, pooled: np.ndarray) -> np.ndarray:  # [.., D] -> [.., num_labels]
        if self.dense_weight is not None:
            pooled = pooled @ self.dense_weight.T
            if self.dense_bias is not None:
                pooled = pooled + self.dense_bias
            pooled = _HEAD_ACTIVATIONS[self.dense_activation](pooled).astype(np.float32)
        if self.norm_weight is not None:
            centred = pooled - pooled.mean(axis=-1, keepdims=True)
            var = (centred * centred).mean(axis=-1, keepdims=True)
            pooled = centred / np.sqrt(var + self.norm_eps) * self.norm_weight
            if self.norm_bias is not None:
                pooled = pooled + self.norm_bias
        logits = pooled @ self.out_weight.T
        return logits if self.out_bias is None else logits + self.out_bias


@dataclass(frozen=True)
class Pooler:
    """The engine's pooling defaults and head; `finish` turns one request's hidden states into its
    output."""

    task: str  # the model's: embed, classify or reward
    pooling_type: str  # LAST, MEAN, CLS, ALL, STEP
    normalize: bool | None
    dimensions: int | None
    activation: bool | None
    head: ClassifierHead | None  # a classifier's (adapt_checkpoint)
    # An encoder (models/encoder.py): each prompt computed whole in one step, no prefix cached.
    is_encoder: bool = False
    # STEP pooling: the token whose rows are kept (None: every row), the output's columns kept (None: all).
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None

    @classmethod
    def from_config(
        cls,
        model_config: ModelConfig,
        task: str,
        head: ClassifierHead | None,
        *,
        is_encoder: bool = False,
        model_defaults: dict | None = None,
        hidden_size: int | None = None,
    ) -> Pooler:
        """The user's pooler_config over `model_defaults` (a sentence-transformers directory's:
        models/sentence_transformers.py) over the model's own (CLS for an encoder; else LAST, ALL
        for reward). `hidden_size` bounds STEP's returned_token_ids where the task's output is the
        hidden states (a head's output: its labels bound them)."""
        pc = model_config.pooler_config
        defaults = model_defaults or {}
        pooling_type = next(
            t
            for t in (
                None if pc is None else pc.pooling_type,
                defaults.get("pooling_type"),
                None if head is None else head.pooling_type,
                "CLS" if is_encoder else None,
                model_config.pooling_type,
            )
            if t is not None
        )
        normalize = None if pc is None else pc.normalize
        returned = None if pc is None else pc.returned_token_ids
        width = output_width(task, 0 if head is None else head.num_labels, hidden_size)
        if returned is not None and width is not None and max(returned) >= width:
            raise ValueError(
                f"pooler_config.returned_token_ids must be < {width} (the width of this {task} model's "
                f"output), got {list(returned)}"
            )
        return cls(
            task,
            pooling_type,
            defaults.get("normalize") if normalize is None else normalize,
            None if pc is None else pc.dimensions,
            None if pc is None else pc.activation,
            head,
            is_encoder,
            None if pc is None else pc.step_tag_id,
            returned,
        )

    @property
    def is_prefix_cacheable(self) -> bool:
        """Whether a cached prefix may skip computing tokens: only a decoder's LAST pooling reads none
        of them (an encoder's every state depends on the whole prompt)."""
        return not self.is_encoder and self.pooling_type == "LAST"

    def needs_every_row(self, params) -> bool:
        """Whether a request's output reads every prompt token's hidden state (else the last one's)."""
        return self.pooling_type != "LAST" or params.task in TOKEN_TASKS

    def pool(self, rows: np.ndarray, prompt_token_ids=None, step_tag_id: int | None = None) -> np.ndarray:
        """rows [P, D] (every prompt token's hidden state; LAST: the last token's alone, [1, D]);
        STEP: the rows at the prompt's `step_tag_id` tokens (None: every row), [num_steps, D]."""
        if self.pooling_type == "STEP":
            if step_tag_id is None:
                return rows
            return rows[np.asarray(prompt_token_ids) == step_tag_id]
        if self.pooling_type == "MEAN":
            return rows.mean(axis=0, dtype=np.float32)
        if self.pooling_type == "CLS":
            return rows[0]
        if self.pooling_type == "ALL":
            return rows
        return rows[-1]

    def finish(self, params, rows: np.ndarray, prompt_token_ids=None) -> np.ndarray:
        """One request's output from its hidden states rows [P, D] float32, its PoolingParams and
        (STEP pooling) its prompt's token ids [P]. A token task's rows are its output's, one per token,
        whatever the pooling; STEP's settings are the request's, else the engine's."""
        task = params.task
        if task in TOKEN_TASKS:
            pooled = rows
        else:
            pooled = self.pool(rows, prompt_token_ids, _first(params.step_tag_id, self.step_tag_id))
        if self.head is not None and task not in ("embed", "token_embed", "encode"):
            pooled = self.head(pooled)  # [.., num_labels]
        returned = _first(params.returned_token_ids, self.returned_token_ids)
        if returned is not None and task not in TOKEN_TASKS:  # STEP: after the head, its labels
            pooled = pooled[..., list(returned)]
        if task == "encode":
            return pooled
        if task in ("classify", "score", "token_classify"):
            activation = _first(params.activation, self.activation, True)
            if not activation:
                return pooled
            if pooled.shape[-1] == 1:
                return 1.0 / (1.0 + np.exp(-pooled))
            shifted = np.exp(pooled - pooled.max(axis=-1, keepdims=True))
            return shifted / shifted.sum(axis=-1, keepdims=True)
        if task in ("embed", "token_embed"):
            dimensions = _first(params.dimensions, self.dimensions, None)
            if dimensions is not None:
                pooled = pooled[..., :dimensions]
            if _first(params.normalize, self.normalize, True):
                norm = np.linalg.norm(pooled, axis=-1, keepdims=True)
                pooled = pooled / np.maximum(norm, 1e-12)
        return pooled


def _first(*values):
    """The request's setting, else the engine's, else the task's default."""
    return next((v for v in values if v is not None), None)


class PoolingHook(StepHook):
    """Brings each pooling request's hidden states to the host and pools them when its prompt is
    complete (`ModelRunnerOutput.pooler_output`)."""

    name = "pooling"
    # No model inputs: it reads the last stage's hidden states, which a pipeline's forward returns too.
    runs_on_stages = True

    def __init__(self, pooler: Pooler):
        self.pooler = pooler
        # MEAN / CLS / ALL: request id -> (the request, its prompt's rows [P, D] float32, by position;
        # a preempted request recomputes into the same rows).
        self._rows: dict[str, tuple[Any, np.ndarray]] = {}

    def prepare(self, scheduled, num_tokens, num_seqs, failed) -> HostArrays:
        # Rows of a request that finished without completing its prompt (aborted, failed) go.
        for rid in [rid for rid, (req, _) in self._rows.items() if req.is_finished]:
            del self._rows[rid]
        # A step brings to the host only the states its pooling requests read: every token's for one
        # that pools over them (or a token task), each sequence's last token's for one that pools LAST.
        every = [
            self.pooler.needs_every_row(s.request.pooling_params)
            for s in scheduled
            if s.request.pooling_params is not None
        ]
        return {"every_row": np.asarray(any(every)), "last_row": np.asarray(not all(every))}

    def after_forward(self, hidden, hidden_rd, arrays) -> dict:
        wanted = {"pool_hidden": (arrays.get("every_row", False), hidden)}
        wanted["pool_last"] = (arrays.get("last_row", False), hidden_rd)
        return {name: array for name, (is_read, array) in wanted.items() if is_read}

    def read_output(self, scheduled, host: dict[str, np.ndarray], result) -> None:
        offset = 0
        for row, s in enumerate(scheduled):
            if s.request.pooling_params is not None and s.request_id not in result.failed_req_ids:
                isolate_failures(
                    result.failed_req_ids,
                    s,
                    "pooling its hidden states",
                    self._read,
                    host,
                    row,
                    offset,
                    s,
                    result,
                )
            offset += s.num_new_tokens

    def _read(self, host, row: int, offset: int, s, result) -> None:
        req = s.request
        if not self.pooler.needs_every_row(req.pooling_params):
            if s.is_pooling:
                last = np.asarray(host["pool_last"][row : row + 1], np.float32)
                result.pooler_output[req.request_id] = self.pooler.finish(req.pooling_params, last)
            return
        hidden = host["pool_hidden"]
        if req.request_id not in self._rows:
            self._rows[req.request_id] = (
                req,
                np.zeros((req.num_prompt_tokens, hidden.shape[-1]), np.float32),
            )
        rows = self._rows[req.request_id][1]
        start, n = s.num_computed_tokens, s.num_new_tokens
        rows[start : start + n] = hidden[offset : offset + n]
        if s.is_pooling:
            del self._rows[req.request_id]
            result.pooler_output[req.request_id] = self.pooler.finish(
                req.pooling_params, rows, req.prompt_token_ids
            )

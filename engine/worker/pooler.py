"""Pooling: a runner output beside sampling (README "Pooling models").

A pooling request runs through the same scheduler and the same compiled step as a generation
request (chunked prefill of a long prompt, the paged KV cache), but never samples: the step's
forward already returns the final-norm hidden states (every token's [T, D], and each sequence's
last token's [R, D]), and `PoolingHook` brings the ones a pooling request needs to the host: the
last token's for LAST pooling, every computed token's otherwise, kept per request by position
until its prompt is complete. No program is added: the compile guard stays as it was.

The rest is host math in float32 numpy, once per request when its prompt completes (`Pooler`):
pool (LAST, MEAN, CLS, ALL), then the task's head: embed -> Matryoshka truncation and L2
normalization; classify / score -> the *ForSequenceClassification `score` head, softmax (sigmoid
for one label); encode -> the pooled states as they are; reward -> the head's raw outputs. MEAN is
taken over the whole prompt's rows at once, so a chunked prompt pools the same bits as a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from xlaserve.config import ModelConfig
from xlaserve.worker.input_batch import isolate_failures
from xlaserve.worker.step_hooks import HostArrays, StepHook

_SEQ_CLS_SUFFIX = "ForSequenceClassification"


def resolve_task(model_config: ModelConfig, architecture: str) -> str | None:
    """What a pooling engine computes (None: a generate engine): `convert`, or for auto, classify
    for a *ForSequenceClassification checkpoint and embed otherwise."""
    if model_config.runner != "pooling":
        return None
    if model_config.convert != "auto":
        return model_config.convert
    return "classify" if architecture.endswith(_SEQ_CLS_SUFFIX) else "embed"


def adapt_checkpoint(
    model_config: ModelConfig, hf_config: dict, tensors
) -> tuple[dict, Any, np.ndarray | None]:
    """A *ForSequenceClassification decoder as its causal backbone plus its `score` head:
    (hf_config naming the *ForCausalLM class, with a tied LM head, which the pooling runner's unused
    sampler reads; the tensors without `score.weight`; that weight [num_labels, D] float32, or None)."""
    architectures = hf_config.get("architectures") or []
    if not architectures or not architectures[0].endswith(_SEQ_CLS_SUFFIX):
        return hf_config, tensors, None
    architecture = architectures[0]
    if model_config.runner != "pooling":
        raise ValueError(f"{architecture} is a classifier: start the engine with runner='pooling'")
    if not isinstance(tensors, dict) or "score.weight" not in tensors:
        raise ValueError(f"{architecture}: the checkpoint has no score.weight (a classifier's head)")
    tensors = dict(tensors)
    score = np.asarray(tensors.pop("score.weight"), np.float32)
    tensors.pop("lm_head.weight", None)
    causal = architecture[: -len(_SEQ_CLS_SUFFIX)] + "ForCausalLM"
    return {**hf_config, "architectures": [causal], "tie_word_embeddings": True}, tensors, score


@dataclass(frozen=True)
class Pooler:
    """The engine's pooling defaults and head; `finish` turns one request's hidden states into its
    output."""

    task: str  # the model's: embed, classify or reward
    pooling_type: str  # LAST, MEAN, CLS, ALL
    normalize: bool | None
    dimensions: int | None
    activation: bool | None
    score: np.ndarray | None  # [num_labels, D] float32: a classifier's head

    @classmethod
    def from_config(cls, model_config: ModelConfig, task: str, score: np.ndarray | None) -> Pooler:
        pc = model_config.pooler_config
        return cls(
            task,
            model_config.pooling_type,
            None if pc is None else pc.normalize,
            None if pc is None else pc.dimensions,
            None if pc is None else pc.activation,
            score,
        )

    def pool(self, rows: np.ndarray) -> np.ndarray:
        """rows [P, D] (every prompt token's hidden state; LAST: the last token's alone, [1, D])."""
        if self.pooling_type == "MEAN":
            return rows.mean(axis=0, dtype=np.float32)
        if self.pooling_type == "CLS":
            return rows[0]
        if self.pooling_type == "ALL":
            return rows
        return rows[-1]

    def finish(self, params, rows: np.ndarray) -> np.ndarray:
        """One request's output from its hidden states rows [P, D] float32 and its PoolingParams."""
        pooled = self.pool(rows)
        task = params.task
        if task == "encode":
            return pooled
        if self.score is not None and task != "embed":
            pooled = pooled @ self.score.T  # [.., num_labels]
        if task in ("classify", "score"):
            activation = _first(params.activation, self.activation, True)
            if not activation:
                return pooled
            if pooled.shape[-1] == 1:
                return 1.0 / (1.0 + np.exp(-pooled))
            shifted = np.exp(pooled - pooled.max(axis=-1, keepdims=True))
            return shifted / shifted.sum(axis=-1, keepdims=True)
        if task == "embed":
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

    def __init__(self, pooler: Pooler):
        self.pooler = pooler
        # MEAN / CLS / ALL: request id -> (the request, its prompt's rows [P, D] float32, by position;
        # a preempted request recomputes into the same rows).
        self._rows: dict[str, tuple[Any, np.ndarray]] = {}

    @property
    def is_last(self) -> bool:
        return self.pooler.pooling_type == "LAST"

    def prepare(self, scheduled, num_tokens, num_seqs, failed) -> HostArrays:
        # Rows of a request that finished without completing its prompt (aborted, failed) go.
        for rid in [rid for rid, (req, _) in self._rows.items() if req.is_finished]:
            del self._rows[rid]
        return {}

    def after_forward(self, hidden, hidden_rd, arrays) -> dict:
        return {"pool_last": hidden_rd} if self.is_last else {"pool_hidden": hidden}

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
        if self.is_last:
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
            result.pooler_output[req.request_id] = self.pooler.finish(req.pooling_params, rows)

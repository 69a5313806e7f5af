"""The offline `LLM`'s pooling API (runner="pooling"; README "Pooling models"): `encode`, `embed`,
`classify`, `reward`, `score`, and the loop that runs pooling requests to completion.

`PoolingMethods` is a part of `LLM` (entrypoints/llm.py), which builds on it: its methods use the
engine core, input processor, metrics and request counter `LLM.__init__` sets, and `LLM`'s checks of
the runner and the tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import closing

from tqdm import tqdm

from xlaserve.core.request import FinishReason
from xlaserve.engine.processor import PromptType
from xlaserve.entrypoints.pooling_io import cosine, pair_token_ids, score_pairs
from xlaserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from xlaserve.pooling_params import PoolingParams

# vLLM's use_tqdm: a bool, or a tqdm-like callable (a tqdm subclass, functools.partial(tqdm, file=...))
# that makes the bar; it is called with tqdm's arguments, and its bar needs update() and close() (and
# for generate, as vLLM's, format_dict["elapsed"] and a postfix to set).
UseTqdm = bool | Callable[..., tqdm]


def progress_bar(use_tqdm: UseTqdm, **tqdm_args) -> tqdm:
    """The bar `use_tqdm` asks for: the callable's, or tqdm's own made only when asked for (as vLLM's),
    with tqdm's defaults, so TQDM_DISABLE=1 turns it off; a disabled one otherwise."""
    if not use_tqdm:
        return tqdm(disable=True)
    return (use_tqdm if callable(use_tqdm) else tqdm)(**tqdm_args)


def speed_postfix(num_input_tokens: int, num_output_tokens: int, elapsed: float) -> str:
    """vLLM's postfix of generate's bar: the finished requests' tokens per second since it started, their
    prompts' (once per completion) and their outputs'."""
    speeds = (n / elapsed if elapsed > 0 else 0.0 for n in (num_input_tokens, num_output_tokens))
    return "est. speed input: {:.2f} toks/s, output: {:.2f} toks/s".format(*speeds)


def _as_list(prompts) -> list:
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)


def _one_score(data) -> float:
    if data.size != 1:
        raise ValueError(f"score needs a classifier with one label; this one has {data.size}")
    return float(data.reshape(-1)[0])


class PoolingMethods:
    """`LLM`'s pooling models' methods (module doc)."""

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        pooling_task: str | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[PoolingRequestOutput]:
        """The pooled output of each prompt for `pooling_task` (embed, classify, score, encode: the
        pooled hidden states as they are, reward; token_embed, token_classify: a row per prompt
        token), as `.outputs.data` (a numpy array). `pooling_params`: one for every prompt, or one
        each (as vLLM's), each with its own task unless `pooling_task` sets them all."""
        if pooling_task is None and pooling_params is None:
            raise ValueError(
                "pooling_task must be given (embed, classify, score, encode, reward, token_embed or "
                "token_classify)"
            )
        tokenized = [self.input_processor.tokenize(p) for p in _as_list(prompts)]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams(task=pooling_task)] * len(tokenized)
        else:
            params = list(pooling_params)
            if len(params) != len(tokenized):
                raise ValueError(
                    f"pooling_params: {len(params)} given for {len(tokenized)} prompts (one, or one each)"
                )
        if pooling_task is not None:
            params = [dataclasses.replace(p, task=pooling_task) for p in params]
        return [
            PoolingRequestOutput(rid, PoolingOutput(data), ids)
            for rid, ids, data in self._pool([ids for _, ids in tokenized], params, use_tqdm)
        ]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: UseTqdm = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), normalized unless the pooling params or
        the engine's pooler_config say otherwise; `dimensions` keeps the first n (Matryoshka)."""
        return [
            EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids)
            for o in self.encode(prompts, pooling_params, pooling_task="embed", use_tqdm=use_tqdm)
        ]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: UseTqdm = True,
    ) -> list[ClassificationRequestOutput]:
        """A *ForSequenceClassification model's class probabilities per prompt (`.outputs.probs`)."""
        return [
            ClassificationRequestOutput(
                o.request_id, ClassificationOutput(o.outputs.data.tolist()), o.prompt_token_ids
            )
            for o in self.encode(prompts, pooling_params, pooling_task="classify", use_tqdm=use_tqdm)
        ]

    def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: UseTqdm = True,
    ) -> list[PoolingRequestOutput]:
        """A reward model's outputs (convert="reward": every token's, unless pooler_config says)."""
        return self.encode(prompts, pooling_params, pooling_task="reward", use_tqdm=use_tqdm)

    def score(
        self,
        text_1: str | Sequence,
        text_2: str | Sequence,
        *,
        use_tqdm: UseTqdm = True,
    ) -> list[ScoringRequestOutput]:
        """Relevance of each (text_1, text_2) pair (one text_1 against each text_2, or pairwise):
        the cosine of their embeddings for an embedding model, a cross-encoder's probability for a
        classifier with one label. Items are strings or token id lists."""
        pairs = score_pairs(text_1, text_2)
        if self.input_processor.pooling_task == "classify":
            self._require_tokenizer("score()")
            ids = [pair_token_ids(self.tokenizer, a, b) for a, b in pairs]
            results = self._pool(ids, [PoolingParams(task="score")] * len(ids), use_tqdm)
            return [ScoringRequestOutput(rid, ScoringOutput(_one_score(data)), i) for rid, i, data in results]
        texts = [t for pair in pairs for t in pair]
        embeddings = self.embed(
            [{"prompt_token_ids": t} if not isinstance(t, str) else t for t in texts], use_tqdm=use_tqdm
        )
        return [
            ScoringRequestOutput(
                a.request_id,
                ScoringOutput(cosine(a.outputs.embedding, b.outputs.embedding)),
                a.prompt_token_ids + b.prompt_token_ids,
            )
            for a, b in zip(embeddings[::2], embeddings[1::2])
        ]

    def _pool(
        self, prompt_ids: list[list[int]], params: list[PoolingParams], use_tqdm: UseTqdm
    ) -> list[tuple]:
        """Run pooling requests to completion: [(request id, prompt ids, pooled numpy array)] in order,
        `params[i]` for prompt i. Everything is validated before anything is added."""
        self._require_runner("pooling", f"pooling_task {params[0].task!r}" if params else "pooling")
        if self.engine_core.is_sleeping:
            raise ValueError("the engine is asleep (sleep() was called): call wake_up() first")
        for ids in prompt_ids:
            self.input_processor.validate_prompt(ids)
        for p in {id(p): p for p in params}.values():  # a shared PoolingParams once
            self.input_processor.validate_pooling(p)
        order: dict[str, int] = {}
        try:
            for i, (ids, p) in enumerate(zip(prompt_ids, params, strict=True)):
                rid = str(next(self._request_counter))
                self.engine_core.add_request(self.input_processor.make_pooling_request(rid, ids, p))
                order[rid] = i
            results: list = [None] * len(order)
            with closing(progress_bar(use_tqdm, total=len(order), desc="Processed prompts")) as bar:
                while self.engine_core.has_unfinished_requests():
                    for output in self.engine_core.step():
                        if output.request_id not in order or not output.is_finished:
                            continue
                        if output.finish_reason != FinishReason.STOP:
                            raise RuntimeError(f"request {output.request_id} failed ({output.finish_reason})")
                        i = order[output.request_id]
                        results[i] = (output.request_id, prompt_ids[i], output.pooling_output)
                        bar.update(1)
                    self.metrics.record_scheduler(self.engine_core.make_stats())
            return results
        except BaseException:
            self.engine_core.abort_requests(list(order))
            raise

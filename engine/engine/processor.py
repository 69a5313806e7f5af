"""Input processing: prompts to validated Requests (tokenize, check limits, resolve seeds)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from xlaserve.core.request import Request, child_request_id
from xlaserve.engine.structured_output import check_grammar
from xlaserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class InputProcessor:
    """Turns a prompt and its SamplingParams into the core's Requests; bad input is a ValueError
    naming the field and the limit, raised before anything reaches the engine.

    `tokenizer` is None for an engine built with skip_tokenizer_init: prompts must then be token ids.
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, eos_token_id: int | None, seed: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._seeds = random.Random(seed)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids)."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self._encode(prompt["prompt"])
        raise ValueError(
            f"prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, got "
            f"{type(prompt).__name__}"
        )

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                "prompt is text, but the engine has no tokenizer (skip_tokenizer_init=True): "
                "pass {'prompt_token_ids': [...]}"
            )
        return self.tokenizer.encode(text)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (0 tokens)")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt (length {len(prompt_token_ids)} tokens) is too long: it must be shorter than "
                f"max_model_len={self.max_model_len} to leave room for at least one output token"
            )
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[:4]}")

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: stop strings and grammars need this engine's
        tokenizer, and a grammar must compile (StructuredOutputsError naming the member if not)."""
        if self.tokenizer is None and params.stop:
            raise ValueError(
                f"stop strings {params.stop!r} need a tokenizer to be matched, and the engine has none "
                "(skip_tokenizer_init=True): use stop_token_ids"
            )
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError(
                    "structured_outputs needs a tokenizer to build its token masks, and the engine has none "
                    "(skip_tokenizer_init=True)"
                )
            check_grammar(params.structured_outputs)

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[Request]:
        """One Request, or n children of parent `request_id` for n > 1 (sharing the prompt's blocks
        through the prefix cache)."""
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        params = dataclasses.replace(
            params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens)
        )
        is_parent = params.n > 1
        requests = []
        for i in range(params.n):
            rid = child_request_id(request_id, i) if is_parent else request_id
            seed = params.seed + i if params.seed is not None else self._seeds.getrandbits(32)
            requests.append(
                Request(
                    rid,
                    prompt_token_ids,
                    params,
                    eos_token_id=self.eos_token_id,
                    arrival_time=arrival_time,
                    priority=priority,
                    cache_salt=cache_salt,
                    sampling_seed=seed,
                    parent_id=request_id if is_parent else None,
                )
            )
        return requests

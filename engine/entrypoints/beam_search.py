"""Beam search over the engine, one token at a time, as vLLM's `LLM.beam_search` runs it.

Each step asks the engine for one token of every live beam (the beam's tokens as its prompt: the
prefix cache holds what a beam shares with its parent, so a step prefills little more than the tail of
a block) with the top 2 x beam_width logprobs, extends each beam by each of those tokens, and keeps the
beam_width best. A beam extended by the EOS token is set aside as finished (unless `ignore_eos`). After
max_tokens steps, or once no beam is live, the finished and the live beams are ranked together and the
best beam_width returned. Beams are ranked by vLLM's score (after Hugging Face's):
cum_logprob / len(tokens) ** length_penalty, where the tokens count the prompt's and not a final EOS.

`BeamSearch` is the search's bookkeeping only (no engine): `LLM.beam_search` drives it step by step.
Batch invariance (README) makes a search reproducible: a beam's logprobs do not depend on the beams and
requests beside it in a step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from xlaserve.outputs import Logprob
from xlaserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams (2 x beam_width <= the engine's max_logprobs:
    `check_width`), `max_tokens` steps; `temperature` shapes the steps' sampling (their logprobs are
    the model's); `include_stop_str_in_output`: the text keeps the EOS token's text."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    def check_width(self, max_logprobs: int) -> None:
        """ValueError unless a step's 2 x beam_width logprobs fit the engine's `max_logprobs`."""
        if 2 * self.beam_width > max_logprobs:
            raise ValueError(
                f"beam_width must be at most {max_logprobs // 2} (each step reads 2 x beam_width logprobs, "
                f"at most the engine's max_logprobs, {max_logprobs}), got {self.beam_width}"
            )

    def step_params(self) -> SamplingParams:
        """One step of every beam: one token, with the 2 x beam_width most likely beside it."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width)


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` (the prompt's, then the generated), `logprobs` (per generated token, its
    step's candidates), `cum_logprob` (the generated tokens' logprobs summed), `text` (the generated
    text, without a final EOS unless asked), `finish_reason` ("stop": EOS, or "length")."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score`: the cumulative logprob over the length (prompt included, a final
    EOS not) to the power `length_penalty`."""
    length = len(beam.tokens) - (beam.tokens[-1] == eos_token_id)
    return beam.cum_logprob / max(length, 1) ** length_penalty


class BeamSearch:
    """One prompt's search: the live `beams` and the `finished` ones; `advance` takes a step's
    logprobs (one dict per live beam, in order), `result` ranks them."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_id: int | None):
        self.params = params
        self.num_prompt_tokens = len(prompt_ids)
        self.eos_token_id = eos_token_id
        self.beams = [BeamSearchSequence(list(prompt_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def is_done(self) -> bool:
        return not self.beams or self.num_steps == self.params.max_tokens

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos_token_id, self.params.length_penalty)

    def advance(self, step_logprobs: list[dict[int, Logprob]]) -> None:
        """Extend every live beam by each token of its step's logprobs; keep the best beam_width."""
        candidates = []
        for beam, logprobs in zip(self.beams, step_logprobs, strict=True):
            for token_id, logprob in logprobs.items():
                extended = BeamSearchSequence(
                    beam.tokens + [token_id], beam.logprobs + [logprobs], beam.cum_logprob + logprob.logprob
                )
                if token_id == self.eos_token_id and not self.params.ignore_eos:
                    extended.finish_reason = "stop"
                    self.finished.append(extended)
                else:
                    candidates.append(extended)
        # A stable sort: of equal scores, the earlier beam's (then the likelier token's) candidate first.
        self.beams = sorted(candidates, key=self._score, reverse=True)[: self.params.beam_width]
        self.num_steps += 1

    def result(self, decode: Callable[[list[int]], str] | None) -> BeamSearchOutput:
        """The best beam_width of the finished and the live beams, best first, with their text
        (`decode` of the generated tokens; None: no tokenizer, no text)."""
        for beam in self.beams:
            beam.finish_reason = "length"
        best = sorted(self.finished + self.beams, key=self._score, reverse=True)[: self.params.beam_width]
        for beam in best:
            generated = beam.tokens[self.num_prompt_tokens :]
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated = generated[:-1]
            beam.text = decode(generated) if decode is not None else None
        return BeamSearchOutput(best)

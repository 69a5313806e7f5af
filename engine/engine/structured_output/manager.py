"""The structured-output manager: grammars compiled off the engine loop, one matcher per request, and
each step's token bitmask for the constrained rows.

Its hooks into the engine are narrow. `add_request` gives a constrained request a `RequestGrammar`
(the scheduler's `Grammar`: it skips the request while its grammar compiles, and advances it with
each sampled token); `grammar_bitmask(scheduled)` is the step's mask, None when no row is
constrained, so an unconstrained step runs the sampler it always ran. Compiling happens in a thread
pool (llguidance releases the GIL while it builds a grammar), cached by grammar text: a hundred
requests with one schema compile it once, and each copies the compiled matcher. With speculative
decoding, `check_drafts` cuts a request's drafts where its grammar rejects one, and the step's mask has
one row per verified position (engine/SPEC_DECODE.md, Structured outputs).
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import logging
import math
import os
import threading
import time
from collections.abc import Iterable

import llguidance
import llguidance.numpy
import numpy as np

from xlaserve.core.outputs import ScheduledRequest
from xlaserve.core.request import Request
from xlaserve.engine.structured_output.grammar import grammar_source
from xlaserve.structured_outputs_params import REASONING_END_MAX_GAP

logger = logging.getLogger(__name__)

_MAX_CACHED_GRAMMARS = 128
# A grammar usually compiles in a millisecond or two, but a request whose grammar is not ready when
# the scheduler looks waits a whole step. So before scheduling, the engine waits for the compiles in
# flight, up to this fraction of a step (the time since the previous wait) and this cap: running
# requests are slowed by a tenth of a step at most, and only while grammars compile.
_GRACE_STEP_FRACTION = 0.1
_MAX_GRACE_S = 0.05
# llguidance packs a mask into int32 words: bit i of word w stands for token 32 * w + i.
BITS_PER_WORD = 32


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask over `vocab_size` tokens."""
    return math.ceil(vocab_size / BITS_PER_WORD)


def make_ll_tokenizer(tokenizer, vocab_size: int, eos_token_id: int | None) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from our HF fast tokenizer's `tokenizers` backend (no torch).

    Its vocabulary is the model's (the logits' real width), or the tokenizer's when that is larger;
    EOS is the engine's, so the grammar allows exactly the token that ends a request."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"structured outputs need a fast tokenizer; {type(tokenizer).__name__} has no backend"
        )
    backend = copy.copy(backend)  # padding and truncation off on a copy, not on the engine's tokenizer
    backend.no_padding()
    backend.no_truncation()
    n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos_token_id)


class EndOfThinking:
    """Where a request's thinking ends: at `end_id` (a reasoning model's `</think>`), or with `prefix`,
    at the first `end_id` at most REASONING_END_MAX_GAP tokens after those ids (gpt-oss: the final
    channel's `<|channel|>final`, then its `<|message|>`). `history`: the prompt's last ids (a prompt may
    end inside the header)."""

    def __init__(self, end_id: int, prefix: Iterable[int] = (), history: Iterable[int] = ()):
        self.end_id, self.prefix = end_id, tuple(prefix)
        self._window = len(self.prefix) + REASONING_END_MAX_GAP if self.prefix else 0
        self._recent = list(history)[-self._window :] if self._window else []

    def ends_at(self, token_ids: list[int]) -> int | None:
        """The index among `token_ids` (next after those fed) of the id that ends the thinking, or None."""
        for i, token_id in enumerate(token_ids):
            if token_id == self.end_id and self._has_prefix(self._recent + list(token_ids[:i])):
                return i
        return None

    def _has_prefix(self, history: list[int]) -> bool:
        n = len(self.prefix)
        if not n:
            return True
        tail = history[-self._window :]
        return any(tuple(tail[j : j + n]) == self.prefix for j in range(len(tail) - n + 1))

    def feed(self, token_id: int) -> bool:
        """Advance by one sampled token; True when it ends the thinking."""
        ended = self.ends_at([token_id]) is not None
        if self._window:
            self._recent = (self._recent + [token_id])[-self._window :]
        return ended


class RequestGrammar:
    """One request's matcher (a copy of its compiled grammar), advanced by each sampled token.

    Its state depends on the output tokens alone: a preempted request keeps it, and recomputing the
    prompt and outputs never advances it again (only sampled tokens reach `accept_token`)."""

    def __init__(
        self, request_id: str, compiled: concurrent.futures.Future, reasoning_end: EndOfThinking | None = None
    ):
        self.request_id = request_id
        self._compiled = compiled
        self.matcher: llguidance.LLMatcher | None = None
        self.error: str | None = None
        self.is_terminated = False
        # While set, the request is still thinking: its tokens are free, and the grammar starts after the
        # token that ends the thinking (structured output applies to the answer, not the reasoning).
        self.reasoning_end = reasoning_end

    @property
    def is_reasoning(self) -> bool:
        return self.reasoning_end is not None

    @property
    def is_ready(self) -> bool:
        if self.matcher is None and self.error is None:
            if not self._compiled.done():
                return False
            try:
                self.matcher = self._compiled.result().deep_copy()
            except Exception as e:  # noqa: BLE001 - a grammar that compiled nowhere fails its request only
                self.error = f"the grammar did not compile: {e}"
                logger.warning("request %s: %s", self.request_id, self.error)
        return True

    def grammar_start(self, token_ids: list[int]) -> int:
        """Where the grammar starts among `token_ids` (drafts after the request's tokens): 0, or while
        the request reasons, just after the reasoning end id (the grammar never sees that id);
        len(token_ids) + 1 when they do not end the reasoning (every position is free)."""
        if not self.is_reasoning:
            return 0
        end = self.reasoning_end.ends_at(token_ids)
        return len(token_ids) + 1 if end is None else end + 1

    def num_valid_drafts(self, token_ids: list[int], keep_rejected: bool = False) -> int:
        """How many of `token_ids` (speculative drafts after the request's tokens) to keep: the prefix the
        grammar accepts, ending at the token that completes it (the request stops there: later drafts
        would only be verified to be dropped). `keep_rejected` keeps the first rejected draft too, for
        drafts sampled from a distribution q (a draft model): cutting a sampled draft by its value would
        bias the output, while verifying it rejects it for sure (p is 0 there) and draws from the
        residual, which is exact. The matcher is left exactly as it was (its walk is rolled back)."""
        if self.matcher is None or self.error is not None or self.is_terminated:
            return 0
        start = self.grammar_start(token_ids)
        if start > len(token_ids):
            return len(token_ids)
        drafts = token_ids[start:]
        num_valid = self.matcher.validate_tokens(drafts)
        is_cut_at_stop = False
        num_consumed = 0
        while num_consumed < num_valid:
            if not self.matcher.consume_token(drafts[num_consumed]):
                break  # validate_tokens said it would take it: never happens; rolled back below
            num_consumed += 1
            if self.matcher.is_stopped():
                num_valid, is_cut_at_stop = num_consumed, True
        if num_consumed and not self.matcher.rollback(num_consumed):
            self.error = f"the grammar could not roll back {num_consumed} drafts: {self.matcher.get_error()}"
            logger.error("request %s: %s", self.request_id, self.error)
            return 0
        num_valid = min(num_valid, num_consumed)
        if keep_rejected and not is_cut_at_stop and num_valid < len(drafts):
            num_valid += 1
        return start + num_valid

    def accept_token(self, token_id: int) -> None:
        if self.is_reasoning:
            if self.reasoning_end.feed(token_id):
                self.reasoning_end = None
            return
        if not self.matcher.consume_token(token_id):
            self.error = f"the grammar rejected token {token_id}: {self.matcher.get_error()}"
            logger.error("request %s: %s", self.request_id, self.error)
        elif self.matcher.is_stopped():
            self.is_terminated = True


class StructuredOutputManager:
    """Grammars for the requests of one engine (shared by its data-parallel ranks).

    `tokenizer` None (an engine without one) refuses constrained requests. `vocab_size` is the
    model's; the bitmask has one bit per token of it, or of the tokenizer where that is larger (the
    runner fits it to the logits' width).
    """

    def __init__(self, tokenizer=None, vocab_size: int = 0, eos_token_id: int | None = None):
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="grammar"
        )
        self._tokenizer_args = None if tokenizer is None else (tokenizer, vocab_size, eos_token_id)
        self._ll_tokenizer: concurrent.futures.Future | None = None  # built for the first grammar
        self._compiled: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._compiling: set[concurrent.futures.Future] = set()
        self._mask_executor: llguidance.LLExecutor | None = None
        # Data-parallel ranks step in threads of their own (dp_engine.py), each calling grammar_bitmask.
        self._mask_executor_lock = threading.Lock()
        self._last_schedule_time: float | None = None

    def add_request(self, request: Request) -> None:
        """Attach a grammar to a constrained request (compiling, or cached); ValueError if this engine
        cannot constrain it."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self._tokenizer_args is None:
            raise ValueError("structured_outputs needs a tokenizer, and this engine has none")
        if self._ll_tokenizer is None:
            # ~0.5 s for a 50k vocabulary, in the pool (never on the engine loop) and only once a request
            # asks for a grammar, as vLLM builds its grammar backend: most engines never need it.
            self._ll_tokenizer = self._pool.submit(make_ll_tokenizer, *self._tokenizer_args)
        reasoning_end = None
        if params.reasoning_end_token_id is not None:
            prefix = params.reasoning_end_prefix_ids or ()
            reasoning_end = EndOfThinking(params.reasoning_end_token_id, prefix, request.prompt_token_ids)
        request.grammar = RequestGrammar(
            request.request_id, self._compile(grammar_source(params)), reasoning_end
        )

    def _compile(self, source: str) -> concurrent.futures.Future:
        future = self._compiled.get(source)
        if future is not None:  # compiled, compiling, or failed: either way, not again
            self._compiled.move_to_end(source)
            return future
        future = self._pool.submit(self._build_matcher, source)
        self._compiled[source] = future
        if len(self._compiled) > _MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)  # requests holding it keep their own reference
        self._compiling.add(future)
        return future

    def _build_matcher(self, source: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._ll_tokenizer.result(), source, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def wait_before_schedule(self) -> None:
        """Called by the engine before each schedule: give the grammars compiling a short grace (see
        _GRACE_STEP_FRACTION), so that their requests start in this step rather than the next."""
        now = time.perf_counter()
        step_s = _MAX_GRACE_S if self._last_schedule_time is None else now - self._last_schedule_time
        self.wait_for_grammars(min(_MAX_GRACE_S, _GRACE_STEP_FRACTION * step_s))
        self._last_schedule_time = time.perf_counter()

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block until the grammars being compiled are done, `timeout_s` at most; return at once when
        none is (what the engine does, instead of spinning, when every request it could run waits for
        its grammar)."""
        self._compiling = {f for f in self._compiling if not f.done()}
        if self._compiling:
            concurrent.futures.wait(self._compiling, timeout_s)

    def check_drafts(self, requests: Iterable[Request], keep_rejected: bool = False) -> None:
        """Cut each constrained request's `spec_token_ids` at the first draft its grammar rejects (after
        it with `keep_rejected`, see `RequestGrammar.num_valid_drafts`) and after one that completes the
        grammar: called after the proposer, before the scheduler takes the drafts. A greedy request
        never keeps a rejected draft (the verifier would emit the masked argmax there either way)."""
        for request in requests:
            if request.grammar is not None and request.spec_token_ids:
                keep = keep_rejected and not request.sampling_params.is_greedy
                num_valid = request.grammar.num_valid_drafts(request.spec_token_ids, keep)
                del request.spec_token_ids[num_valid:]

    def grammar_bitmask(self, scheduled: list[ScheduledRequest], num_positions: int = 1) -> np.ndarray | None:
        """The allowed tokens of each scheduled row, [len(scheduled), W] int32 (bit i of word
        w: token 32 * w + i), or None when no row samples under a grammar. Unconstrained rows, and rows
        that only prefill this step, or whose request is still reasoning, allow every token (-1).

        `num_positions` > 1 (speculative decoding: 1 + k): [len(scheduled), num_positions, W], where
        position j of a row is the mask after its drafts 0..j-1 (`ScheduledRequest.spec_token_ids`,
        which `check_drafts` cut), so the verifier samples each position under its own mask. Positions
        up to a reasoning end id among the drafts are free; positions past a row's drafts, or past one
        its grammar rejects, allow every token (they are never read)."""
        jobs = []  # (matcher, first mask row, drafts): llguidance's rows [first, first + len(drafts)]
        for row, s in enumerate(scheduled):
            grammar = s.request.grammar
            if not s.is_sampling or grammar is None:
                continue
            drafts = s.spec_token_ids if num_positions > 1 else []
            if len(drafts) >= num_positions:
                raise ValueError(f"{len(drafts)} drafts need more than {num_positions} positions")
            start = grammar.grammar_start(drafts)
            if start <= len(drafts):
                jobs.append((grammar.matcher, row * num_positions + start, list(drafts[start:])))
        if not jobs:
            return None
        width = bitmask_width(self._ll_tokenizer.result().vocab_size)  # built: a matcher exists
        bitmask = np.full((len(scheduled) * num_positions, width), -1, np.int32)
        with self._mask_executor_lock:
            if self._mask_executor is None:
                self._mask_executor = llguidance.LLExecutor()
        # llguidance fills the rows in parallel (without the GIL), in place; with drafts, each matcher
        # walks them, writing the mask before each one and after the last (stopping at one it rejects),
        # and rolls back to where it was.
        walks = [job for job in jobs if job[2]]  # llguidance's walk takes at least one draft
        plain = [(matcher, first) for matcher, first, drafts in jobs if not drafts]
        fill, fill_walks = (
            llguidance.numpy.fill_next_token_bitmask_par,
            (llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens),
        )
        if plain:
            fill(self._mask_executor, plain, bitmask)
        if walks:
            fill_walks(self._mask_executor, walks, bitmask)
        return bitmask if num_positions == 1 else bitmask.reshape(len(scheduled), num_positions, width)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

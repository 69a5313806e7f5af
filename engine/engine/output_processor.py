"""The front end's half of a step: EngineCoreOutputs (token ids) in, RequestOutputs (text) out.

The engine core knows token ids, EOS, stop token ids and max_tokens; it does not know text. Stop
strings are found here, after detokenization, so a request that hits one is finished here and
listed in `reqs_to_abort` for the caller to abort in the core.

Sampling n > 1 runs as n independent core requests (children whose `parent_id` is the user's
request id); a `ParentRequest` gathers their CompletionOutputs back under the parent's id.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from xlaserve.core.outputs import EngineCoreOutput
from xlaserve.core.request import FinishReason
from xlaserve.engine.detokenizer import (
    IncrementalDetokenizer,
    NoTextDetokenizer,
    make_detokenizer,
    special_token_ids,
)
from xlaserve.outputs import (
    CompletionOutput,
    IterationStats,
    LogprobsEntry,
    PromptLogprobs,
    RequestOutput,
    RequestStateStats,
    SampleLogprobs,
    make_logprob_dict,
)
from xlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# "final": one RequestOutput when the request finishes (offline generate).
# "delta": one per step, holding only what is new since the previous one (streaming).
# "cumulative": one per step, holding everything so far.
OUTPUT_KINDS = ("final", "delta", "cumulative")


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # finished here by a stop string; the core must drop them too


class ParentRequest:
    """Gathers the n child requests of one n > 1 request back into the parent's RequestOutputs."""

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.n = n
        self.child_ids: set[str] = set()  # children still in the processor
        self.num_finished = 0
        self.max_num_generation_tokens = 0  # the most tokens a finished child generated
        self._finished_outputs: dict[int, CompletionOutput] = {}

    def make_request_output(
        self, state: RequestState, completion: CompletionOutput | None, is_child_finished: bool
    ) -> RequestOutput | None:
        """The parent's output for this child step: in final mode only once all n are done."""
        if is_child_finished:
            self.num_finished += 1
        is_finished = self.num_finished == self.n
        if state.output_kind == "final":
            if is_child_finished:
                self._finished_outputs[completion.index] = completion
            if not is_finished:
                return None
            outputs = [self._finished_outputs[i] for i in sorted(self._finished_outputs)]
        elif completion is None:
            return None
        else:
            outputs = [completion]
        return state.wrap(self.request_id, outputs, is_finished)


@dataclass(eq=False)
class RequestState:
    """Everything the front end tracks for one core-level request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str
    detokenizer: IncrementalDetokenizer | NoTextDetokenizer
    stats: RequestStateStats
    parent: ParentRequest | None = None
    index: int = 0
    num_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0
    kv_transfer_params: dict | None = None  # a KV connector's, on the finished output
    prompt_logprobs: PromptLogprobs | None = None
    # None, not [], when not requested: vLLM's convention, and how callers tell the two apart.
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    # How much of each growing list the previous delta output already carried.
    _num_sent_tokens: int = 0
    _num_sent_logprobs: int = 0
    _num_sent_prompt_logprobs: int = 0

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None:
            # Position 0 has nothing to condition on (the core sends entries from position 1): a
            # one-token prompt's prompt logprobs are [None], not None (not asked), as vLLM's.
            self.prompt_logprobs = [None]

    def make_completion(self, finish_reason: str | None, stop_reason: int | str | None) -> CompletionOutput:
        """This request's CompletionOutput now: the new part in delta mode, else all of it."""
        is_finished = finish_reason is not None
        is_delta = self.output_kind == "delta"
        token_ids = self.detokenizer.token_ids
        logprobs = self.logprobs
        if is_delta:
            token_ids = token_ids[self._num_sent_tokens :]
            self._num_sent_tokens += len(token_ids)
            if logprobs is not None:
                logprobs = logprobs[self._num_sent_logprobs :]
                self._num_sent_logprobs += len(logprobs)
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.get_next_output_text(is_finished, is_delta),
            token_ids=list(token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if logprobs is None else list(logprobs),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )

    def wrap(self, request_id: str, outputs: list[CompletionOutput], is_finished: bool) -> RequestOutput:
        """A RequestOutput around `outputs` with this request's prompt, prompt logprobs and stats."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None and self.output_kind == "delta":
            # Prompt logprobs arrive chunk by chunk during prefill; each delta carries the new chunk.
            prompt_logprobs = prompt_logprobs[self._num_sent_prompt_logprobs :]
            self._num_sent_prompt_logprobs += len(prompt_logprobs)
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            outputs=outputs,
            finished=is_finished,
            num_cached_tokens=self.num_cached_tokens,
            num_cache_creation_tokens=self.num_cache_creation_tokens,
            metrics=replace(self.stats),  # a snapshot: the live stats keep changing while streaming
            kv_transfer_params=self.kv_transfer_params if is_finished else None,
        )

    def make_request_output(
        self, finish_reason: str | None, stop_reason: int | str | None, has_news: bool
    ) -> RequestOutput | None:
        """The output to emit after this step, or None when the output kind has nothing to say."""
        is_finished = finish_reason is not None
        if self.output_kind == "final" and not is_finished:
            return None
        completion = None
        if is_finished or has_news:
            completion = self.make_completion(finish_reason, stop_reason)
        if self.parent is not None:
            return self.parent.make_request_output(self, completion, is_finished)
        return None if completion is None else self.wrap(self.request_id, [completion], is_finished)


class OutputProcessor:
    """Per-request front-end state: detokenizers, logprobs, timing and n > 1 aggregation.

    `tokenizer` None (skip_tokenizer_init): outputs carry token ids, empty text, and logprobs
    without decoded tokens.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._special_ids = special_token_ids(tokenizer)
        # Logprob payloads repeat the same top tokens step after step; decode each id once.
        self._token_text_cache: dict[int, str] = {}
        self._stats = IterationStats()

    def add_parent_request(self, parent_id: str, n: int) -> ParentRequest:
        """Register an n > 1 request; then add each child with parent_id and its index."""
        if parent_id in self.parent_requests or parent_id in self.request_states:
            raise ValueError(f"request id {parent_id!r} is already in use")
        parent = ParentRequest(parent_id, n)
        self.parent_requests[parent_id] = parent
        return parent

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        parent_id: str | None = None,
        index: int = 0,
        output_kind: str = "final",
    ) -> None:
        """Start tracking a core-level request (child `index` of `parent_id` when that is set)."""
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        parent = None
        if parent_id is not None:
            parent = self.parent_requests.get(parent_id)
            if parent is None:
                raise ValueError(f"unknown parent request {parent_id!r}: call add_parent_request first")
            if not 0 <= index < parent.n:
                raise ValueError(f"child of {parent_id!r} must have index in [0, {parent.n}), got {index}")
            parent.child_ids.add(request_id)
        detokenizer = make_detokenizer(self.tokenizer, prompt_token_ids, params, self._special_ids)
        arrival_time = time.time() if arrival_time is None else arrival_time
        self.request_states[request_id] = RequestState(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            output_kind,
            detokenizer,
            RequestStateStats(arrival_time=arrival_time),
            parent,
            index,
        )

    def add_requests(
        self,
        request_id: str,
        requests: list,
        prompt: str | None,
        prompt_token_ids: list[int],
        arrival_time: float,
        output_kind: str = "final",
    ) -> None:
        """Track the core Requests made for one user request: one, or n children under a parent."""
        is_parent = len(requests) > 1
        if is_parent:
            self.add_parent_request(request_id, len(requests))
        for i, request in enumerate(requests):
            self.add_request(
                request.request_id,
                prompt,
                prompt_token_ids,
                request.sampling_params,
                arrival_time=arrival_time,
                parent_id=request_id if is_parent else None,
                index=i,
                output_kind=output_kind,
            )

    def process_outputs(
        self, engine_core_outputs: list[EngineCoreOutput], now: float | None = None
    ) -> ProcessedOutputs:
        """Apply one step's EngineCoreOutputs: detokenize, check stop strings, build RequestOutputs.

        `now` (default time.time(), the clock of arrival_time) timestamps the step's tokens.
        """
        now = time.time() if now is None else now
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        for core_output in engine_core_outputs:
            state = self.request_states.get(core_output.request_id)
            if state is None:
                continue  # aborted by the caller while the core was computing this step
            try:
                request_output = self._process_output(state, core_output, reqs_to_abort, now)
            except Exception:
                # One request's text (a detokenizer, a logprob payload) must not stop the others:
                # it finishes with an error here and the core drops it.
                logger.exception(
                    "request %r failed in output processing; it finishes with an error", state.request_id
                )
                if not core_output.is_finished and state.request_id not in reqs_to_abort:
                    reqs_to_abort.append(state.request_id)
                request_output = self._finish_with_error(state, now)
            if request_output is not None:
                request_outputs.append(request_output)
        return ProcessedOutputs(request_outputs, reqs_to_abort)

    def _process_output(
        self, state: RequestState, core_output: EngineCoreOutput, reqs_to_abort: list[str], now: float
    ) -> RequestOutput | None:
        new_token_ids = list(core_output.new_token_ids)
        if state.stats.scheduled_time is None:
            state.stats.scheduled_time = core_output.scheduled_time
        if core_output.num_cached_tokens and not state.num_cached_tokens:
            state.num_cached_tokens = core_output.num_cached_tokens
        self._stats.record_tokens(
            state.stats,
            len(state.prompt_token_ids),
            len(new_token_ids),
            now,
            state.num_cached_tokens,
            core_output.num_external_computed_tokens,
        )
        if core_output.num_cache_creation_tokens and not state.num_cache_creation_tokens:
            state.num_cache_creation_tokens = core_output.num_cache_creation_tokens
        if core_output.kv_transfer_params is not None:
            state.kv_transfer_params = core_output.kv_transfer_params
        self._append_logprobs(state, core_output.new_logprobs)
        self._append_prompt_logprobs(state, core_output.new_prompt_logprobs)

        finish_reason = core_output.finish_reason
        stop_reason = core_output.stop_reason
        stop_string = state.detokenizer.update(
            new_token_ids,
            # A grammar that completed ends with a token of its text, not a stop token to hide.
            stop_terminated=finish_reason == FinishReason.STOP and not core_output.is_grammar_complete,
            finished=finish_reason is not None,
        )
        if stop_string is not None:
            num_dropped = getattr(state.detokenizer, "num_dropped_tokens", 0)
            if num_dropped and state.logprobs:  # their logprobs go with them
                dropped = state.logprobs[-num_dropped:]
                del state.logprobs[-num_dropped:]
                state.cumulative_logprob -= sum(next(iter(d.values())).logprob for d in dropped)
            if finish_reason is None:
                reqs_to_abort.append(state.request_id)
            finish_reason, stop_reason = FinishReason.STOP, stop_string
        # Plain strings for users: a str-enum's repr would leak into their logs and JSON.
        finish_reason = None if finish_reason is None else str(finish_reason)

        has_news = bool(new_token_ids) or bool(core_output.new_prompt_logprobs)
        request_output = state.make_request_output(finish_reason, stop_reason, has_news)
        if finish_reason is not None:
            self._record_finish(state, finish_reason, now)
            self._remove(state.request_id)
        return request_output

    def _finish_with_error(self, state: RequestState, now: float) -> RequestOutput | None:
        """The request's last output, finish_reason "error", built without its (failed) detokenizer."""
        self._remove(state.request_id)
        reason = str(FinishReason.ERROR)
        completion = CompletionOutput(index=state.index, text="", token_ids=[], finish_reason=reason)
        if state.parent is not None:
            output = state.parent.make_request_output(state, completion, is_child_finished=True)
        else:
            output = state.wrap(state.request_id, [completion], is_finished=True)
        self._record_finish(state, reason, now)
        return output

    def _record_finish(self, state: RequestState, finish_reason: str, now: float) -> None:
        """A finished core-level request's stats; and its user request's, once that has ended (its
        parent's output counted this child's finish already: make_request_output)."""
        stats, parent = state.stats, state.parent
        num_prompt_tokens = len(state.prompt_token_ids)
        self._stats.record_finish(
            stats, finish_reason, now, num_prompt_tokens, state.params.max_tokens, state.num_cached_tokens
        )
        if parent is None:
            self._stats.n_params.append(1)
            self._stats.max_num_generation_tokens.append(stats.num_generation_tokens)
            return
        parent.max_num_generation_tokens = max(parent.max_num_generation_tokens, stats.num_generation_tokens)
        if parent.num_finished == parent.n:
            self._stats.n_params.append(parent.n)
            self._stats.max_num_generation_tokens.append(parent.max_num_generation_tokens)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (a parent id aborts all its children); returns the core-level ids removed."""
        removed = []
        for request_id in request_ids:
            parent = self.parent_requests.get(request_id)
            child_ids = sorted(parent.child_ids) if parent is not None else [request_id]
            for child_id in child_ids:
                if self._remove(child_id):
                    removed.append(child_id)
            self.parent_requests.pop(request_id, None)
        return removed

    def abort_outputs(self, request_id: str) -> list[RequestOutput]:
        """The outputs that end `request_id` (a parent's children included) with finish_reason "abort",
        before abort_requests forgets them: in delta mode what is new since the last output, in final
        mode everything generated so far (a parent's once all its n have ended)."""
        parent = self.parent_requests.get(request_id)
        child_ids = sorted(parent.child_ids) if parent is not None else [request_id]
        outputs = []
        for child_id in child_ids:
            state = self.request_states.get(child_id)
            output = None if state is None else state.make_request_output("abort", None, has_news=False)
            if output is not None:
                outputs.append(output)
        return outputs

    def get_num_unfinished_requests(self) -> int:
        """Core-level requests still tracked (each child of an n > 1 request counts)."""
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still tracked."""
        return bool(self.request_states)

    def drain_stats(self) -> IterationStats:
        """The metric samples since the last call, starting a fresh collection."""
        stats, self._stats = self._stats, IterationStats()
        return stats

    def _remove(self, request_id: str) -> bool:
        state = self.request_states.pop(request_id, None)
        if state is None:
            return False
        parent = state.parent
        if parent is not None:
            parent.child_ids.discard(request_id)
            if not parent.child_ids:
                self.parent_requests.pop(parent.request_id, None)
        return True

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    def _text_of(self, state: RequestState):
        """A logprob's decoded_token for `state`'s request (None throughout without text)."""
        return self._token_text if state.params.detokenize else _no_text

    def _append_logprobs(self, state: RequestState, entries: list[LogprobsEntry] | None) -> None:
        if not entries or state.logprobs is None:
            return
        text_of = self._text_of(state)
        for entry in entries:
            state.logprobs.append(make_logprob_dict(entry, text_of))
            state.cumulative_logprob += float(entry[1][0])

    def _append_prompt_logprobs(self, state: RequestState, entries: list[LogprobsEntry] | None) -> None:
        if not entries or state.prompt_logprobs is None:
            return
        text_of = self._text_of(state)
        state.prompt_logprobs.extend(None if e is None else make_logprob_dict(e, text_of) for e in entries)


def _no_text(token_id: int) -> None:
    return None

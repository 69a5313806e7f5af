"""vLLM's `use_beam_search` on the completions and chat routes: the search of `LLM.beam_search`
(entrypoints/beam_search.py) driven over the AsyncLLM, as a request stream the routes read like any
other (one final RequestOutput: the best beams as its n completions).

Each step adds every live beam as a request of one token (its tokens as the prompt, under the request's
priority, cache salt and adapter) and waits for them all; a client that leaves, or an error, aborts the
step's requests. Fields the search does not apply are refused by name (`check_beam_search`), not ignored.
"""

from __future__ import annotations

from xlaserve.entrypoints.beam_search import BeamSearch, BeamSearchParams
from xlaserve.entrypoints.serving.engine_io import check_finish, engine_error, final_outputs
from xlaserve.entrypoints.serving.errors import bad_request
from xlaserve.entrypoints.serving.protocol import SamplingFields
from xlaserve.entrypoints.serving.state import ServerState
from xlaserve.outputs import CompletionOutput, RequestOutput

# Request fields whose non-default values a beam search would not apply (vLLM ignores them silently).
_NOT_APPLIED = (
    "stop", "stop_token_ids", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "top_p", "top_k", "min_p", "seed", "response_format", "structured_outputs", "kv_transfer_params",
    "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs",
)  # fmt: skip


def beam_search_params(
    req: SamplingFields, max_tokens: int, max_logprobs: int, *, forced_grammar: bool = False
) -> BeamSearchParams:
    """The request's BeamSearchParams (`n` beams; `temperature` 0 unless given), after its checks: each
    field the search would not apply is a 400 naming it, and so is an `n` past the engine's
    `max_logprobs` / 2. Streamed (chat only: completions refuse it, as vLLM's), the search's answer comes
    whole, as one chunk per beam, once it ends."""
    defaults = type(req).model_fields
    for name in _NOT_APPLIED:
        value = getattr(req, name)
        if value is not None and value != defaults[name].default:
            raise bad_request(f"{name} cannot be combined with use_beam_search", name)
    if forced_grammar:  # a forced tool call is a grammar
        raise bad_request(
            "a required or named tool_choice cannot be combined with use_beam_search", "tool_choice"
        )
    try:
        params = BeamSearchParams(
            beam_width=req.n,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            temperature=0.0 if req.temperature is None else req.temperature,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
        params.check_width(max_logprobs)
        return params
    except ValueError as e:
        raise bad_request(str(e).replace("beam_width", "n", 1), "n") from None


class BeamSearchStream:
    """A beam search as a request stream: iterating runs the search and yields one final RequestOutput;
    `close()` ends it (the step in flight is aborted by the iteration's own cancellation)."""

    def __init__(
        self, state: ServerState, ids: list[int], params: BeamSearchParams, request_id: str, **kwargs
    ):
        """`kwargs`: AsyncLLM.add_request's prompt, priority, cache_salt, lora_request, mm_features."""
        self.state, self.ids, self.params, self.request_id = state, ids, params, request_id
        self.prompt = kwargs.pop("prompt", None)
        self.kwargs = kwargs
        self.is_finished = False

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished:
            raise StopAsyncIteration
        self.is_finished = True
        return await self._search()

    def close(self) -> None:
        self.is_finished = True

    async def _search(self) -> RequestOutput:
        engine = self.state.engine
        eos = engine.input_processor.eos_token_id
        search = BeamSearch(self.ids, self.params, eos)
        step_params = self.params.step_params()
        num_cached = 0
        while not search.is_done:
            streams = []
            try:
                for j, beam in enumerate(search.beams):
                    rid = f"{self.request_id}-{search.num_steps}-{j}"
                    streams.append(
                        engine.add_request(beam.tokens, step_params, rid, output_kind="final", **self.kwargs)
                    )
            except Exception as e:  # noqa: BLE001 - every failure becomes an API error
                for stream in streams:
                    stream.close()
                raise engine_error(e) from None
            finals = await final_outputs(streams)
            for output in finals:
                check_finish(output)
            if search.num_steps == 0:
                num_cached = finals[0].num_cached_tokens
            search.advance([output.outputs[0].logprobs[0] for output in finals])
        tokenizer = engine.tokenizer
        best = search.result(None if tokenizer is None else tokenizer.decode).sequences
        outputs = [
            CompletionOutput(
                index=i,
                text=beam.text or "",
                token_ids=beam.tokens[len(self.ids) :],
                cumulative_logprob=beam.cum_logprob,
                logprobs=beam.logprobs,
                finish_reason=beam.finish_reason,
                stop_reason=eos if beam.finish_reason == "stop" else None,
            )
            for i, beam in enumerate(best)
        ]
        return RequestOutput(
            self.request_id, self.prompt, self.ids, None, outputs, finished=True, num_cached_tokens=num_cached
        )

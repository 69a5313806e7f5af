"""When a request stops: checked after each token the scheduler appends (vLLM's `check_stop`).

In order: a grammar that rejects the token (a bug: the mask should have kept it out) or is complete
(whatever min_tokens says: nothing more may follow); then, once min_tokens are out, a stop token
id or EOS; then the length limits, max_tokens and max_model_len.
"""

from __future__ import annotations

from xlaserve.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> None:
    """Set `request.status` (and `stop_reason`) when its last output token finishes it."""
    params = request.sampling_params
    token_id = request.output_token_ids[-1]
    grammar = request.grammar
    if grammar is not None:
        grammar.accept_token(token_id)
        if grammar.error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            return
        if grammar.is_terminated:
            request.status = RequestStatus.FINISHED_STOPPED
            return
    if request.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
            return
        if not params.ignore_eos and token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH


def is_grammar_complete(request: Request) -> bool:
    """The request's last token completed its grammar: that token is text, unlike EOS or a stop id."""
    grammar = request.grammar
    return (
        grammar is not None and grammar.is_terminated and request.output_token_ids[-1] != request.eos_token_id
    )

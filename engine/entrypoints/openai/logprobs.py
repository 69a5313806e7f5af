"""Logprobs as OpenAI's routes show them: the chat route's `logprobs.content` entries (also the Responses
API's output_text `logprobs`), the completions route's legacy lists, and vLLM's `prompt_logprobs`.

`as_ids` (vLLM's `return_tokens_as_token_ids`) names each token "token_id:{id}" instead of its text, so a
client reads the exact ids (a token that is part of a character has no text of its own).
"""

from __future__ import annotations

from xlaserve.entrypoints.openai.protocol import (
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)
from xlaserve.entrypoints.openai.sse import MIN_LOGPROB
from xlaserve.entrypoints.serving.state import ServerState
from xlaserve.outputs import CompletionOutput, Logprob, PromptLogprobs


def token_text(state: ServerState, token_id: int, logprob: Logprob | None, as_ids: bool = False) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return state.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _floored(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)  # JSON has no -inf


def token_logprobs(
    state: ServerState, completion: CompletionOutput, top_n: int, as_ids: bool = False
) -> list[ChatTokenLogprob]:
    """Each generated token's logprob with its `top_n` alternatives, as OpenAI's chat `logprobs.content`
    (and the Responses API's output_text `logprobs`) hold them."""
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs or []):
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        chosen = entry.get(token_id)
        token = token_text(state, token_id, chosen, as_ids)
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=_floored(chosen.logprob if chosen is not None else MIN_LOGPROB),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(
                        token=(text := token_text(state, tid, lp, as_ids)),
                        logprob=_floored(lp.logprob),
                        bytes=list(text.encode("utf-8")),
                    )
                    for tid, lp in ranked
                    if (lp.rank or 0) <= top_n
                ][:top_n],
            )
        )
    return content


def completion_logprobs(
    state: ServerState,
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    top_n: int,
    text_offset: int = 0,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs: per token its text, logprob, top-n alternatives and text offset."""
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id) if entry else None
        token = token_text(state, token_id, chosen, as_ids)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)
        if entry is None or chosen is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_floored(chosen.logprob))
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        top = {
            token_text(state, tid, lp, as_ids): _floored(lp.logprob)
            for tid, lp in ranked
            if (lp.rank or 0) <= top_n
        }
        top.setdefault(token, result.token_logprobs[-1])  # the sampled token is always listed
        result.top_logprobs.append(top)
    return result


def prompt_logprobs(entries: PromptLogprobs | None) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (the first has none: null) its id's logprob, rank and
    text, and the top-n alternatives', keyed by token id."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): PromptLogprob(
                logprob=_floored(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]

"""Anthropic's event stream: message_start, ping, then each content block's content_block_start,
content_block_delta (text_delta, thinking_delta, input_json_delta) and content_block_stop, then
message_delta (stop_reason, stop_sequence, usage) and message_stop. An error after the headers is an
`error` event in Anthropic's shape, and the stream ends."""

from __future__ import annotations

import json

from xlaserve.entrypoints.anthropic.output import PREWARMED, Piece, stop_reason
from xlaserve.entrypoints.anthropic.protocol import Usage
from xlaserve.entrypoints.anthropic.reading import partial_object
from xlaserve.entrypoints.serving.engine_io import check_finish, engine_error, merge_streams


def sse(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Blocks:
    """The open content block and the events that open, extend and close blocks; `made`, the blocks
    as a client reading the events puts them together (a call's input the partial parse of its JSON)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.has_tool_use = False
        self.made: list[dict] = []
        self._json = ""  # the open call's input so far

    def events(self, piece: Piece) -> list[str]:
        out = []
        starts_call = piece.kind in ("tool_use", "mcp_tool_use") and piece.id is not None
        if piece.kind != self.kind or starts_call:
            out += self.close()
            self.index += 1
            self.kind = piece.kind
            start = {"type": "content_block_start", "index": self.index, "content_block": _empty_block(piece)}
            out.append(sse("content_block_start", start))
            self.made.append(start["content_block"])
            self.has_tool_use = self.has_tool_use or piece.kind == "tool_use"
        if piece.text:
            delta = {"type": "content_block_delta", "index": self.index, "delta": _delta(piece)}
            out.append(sse("content_block_delta", delta))
            if piece.kind in ("text", "thinking"):
                self.made[-1][piece.kind] += piece.text
            else:
                self._json += piece.text
        return out

    def whole(self, block: dict) -> list[str]:
        """A block sent whole (an mcp_tool_result): its start, with its content, and its stop."""
        out = self.close()
        self.index += 1
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        out.append(sse("content_block_start", start))
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.made.append(block)
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        if self.kind in ("tool_use", "mcp_tool_use"):
            self.made[-1]["input"], self._json = partial_object(self._json), ""
        self.kind = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def _empty_block(piece: Piece) -> dict:
    if piece.kind == "text":
        return {"type": "text", "text": ""}
    if piece.kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if piece.kind == "mcp_tool_use":
        return {
            "type": "mcp_tool_use",
            "id": piece.id,
            "name": piece.name,
            "server_name": piece.server_name,
            "input": {},
        }
    return {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}


def _delta(piece: Piece) -> dict:
    if piece.kind == "text":
        return {"type": "text_delta", "text": piece.text}
    if piece.kind == "thinking":
        return {"type": "thinking_delta", "thinking": piece.text}
    return {"type": "input_json_delta", "partial_json": piece.text}


def message_start(request_id: str, model: str, usage: Usage) -> list[str]:
    """The message's first events, once the engine's first output says what the prefix cache held (vLLM's
    message_start carries the same usage as its message_delta, less the output tokens)."""
    message = {
        "id": request_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage.model_dump(),
    }
    return [
        sse("message_start", {"type": "message_start", "message": message}),
        sse("ping", {"type": "ping"}),
    ]


def message_end(reason: str, sequence: str | None, usage: Usage) -> list[str]:
    delta = {"stop_reason": reason, "stop_sequence": sequence}
    return [
        sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage.model_dump()}),
        sse("message_stop", {"type": "message_stop"}),
    ]


class Turn:
    """One model turn read from its engine stream: `events()`, its blocks' events (`translate` may turn
    its pieces into others first; `start(turn)`'s before them, once the first output is read), then
    `completion` (its last output) and `num_generated`."""

    def __init__(self, stream, reader, blocks: Blocks, translate=None, start=None):
        self.stream, self.reader, self.blocks = stream, reader, blocks
        self.translate = translate or (lambda pieces: pieces)
        self.start = start
        self.completion = None
        self.num_generated = 0
        self.num_cached_tokens = 0  # the prompt's tokens the prefix cache held
        self.num_cache_creation_tokens = 0  # and those it added to it

    async def events(self):
        merged = merge_streams([self.stream])
        try:
            async for _, output in merged:
                check_finish(output)
                (self.completion,) = output.outputs
                self.num_generated += len(self.completion.token_ids)
                self.num_cached_tokens = output.num_cached_tokens
                self.num_cache_creation_tokens = output.num_cache_creation_tokens
                if self.start is not None:
                    for event in self.start(self):
                        yield event
                    self.start = None
                pieces = self.reader.feed(self.completion.text)
                if self.completion.finish_reason is not None:
                    pieces += self.reader.flush()
                for piece in self.translate(pieces):
                    for event in self.blocks.events(piece):
                        yield event
        finally:
            await merged.aclose()
        for event in self.blocks.close():
            yield event


async def event_stream(
    request_id: str,
    model: str,
    stream,
    num_prompt_tokens: int,
    reader,
    *,
    with_details: bool,
    is_prewarm: bool = False,
):
    """The message's events; pre-warming (`is_prewarm`, max_tokens 0), no block: only the stop.
    with_details: usage has the prefix cache's buckets (--enable-prompt-tokens-details)."""

    def start(turn: Turn) -> list[str]:
        return message_start(request_id, model, Usage.of(num_prompt_tokens, 0, turn, with_details))

    blocks = Blocks()
    turn = Turn(stream, reader, blocks, (lambda pieces: []) if is_prewarm else None, start)
    try:
        async for event in turn.events():
            yield event
        reason, sequence = PREWARMED if is_prewarm else stop_reason(turn.completion, blocks.has_tool_use)
        num_generated = 0 if is_prewarm else turn.num_generated
        usage = Usage.of(num_prompt_tokens, num_generated, turn, with_details)
        for event in message_end(reason, sequence, usage):
            yield event
    except Exception as e:  # noqa: BLE001 - after the headers, errors go out as an event
        yield sse("error", engine_error(e).to_anthropic())

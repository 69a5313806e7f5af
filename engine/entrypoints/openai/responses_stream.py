"""The Responses API's typed event stream (`event: <type>` then `data: <json>`, each with a
`sequence_number` counting from 0; no `[DONE]`):

  response.created, response.in_progress
  per output item, in order:
    response.output_item.added
    a message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
    reasoning:   response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                 response.content_part.done
    a call:      response.function_call_arguments.delta..., response.function_call_arguments.done
    an MCP call: response.mcp_call_arguments.delta..., response.mcp_call_arguments.done, and once the
                 model's turn has ended, response.mcp_call.in_progress, the call, then
                 response.mcp_call.completed (or .failed)
    the tools an MCP server listed: response.mcp_list_tools.in_progress, response.mcp_list_tools.completed
    an MCP call that waits for the client's approval (an mcp_approval_request): nothing between
                 added and done, both sent once the model has written the call
    response.output_item.done
  response.completed (or response.incomplete, as OpenAI ends a response cut by max_output_tokens)

An error after the headers is an `error` event, and the stream ends. The items streamed are the
items of the final response object (`OutputStream.items`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from xlaserve.entrypoints.openai.responses_output import (
    FunctionCallOutput,
    McpApprovalRequestOutput,
    McpCallOutput,
    McpListToolsOutput,
    OutputItem,
    OutputMessage,
    OutputTextPart,
    ReasoningOutput,
    ReasoningTextPart,
)
from xlaserve.entrypoints.serving.chat_parsing import ChoiceDelta

APPROVAL_REQUEST = "mcpr"  # the prefix of an mcp_approval_request's id


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class EventWriter:
    """Server-sent events numbered in the order written."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class OutputStream:
    """Output items as events, from the chat path's ChoiceDeltas: thinking opens a reasoning item,
    answer text a message item, each call's first delta a function_call item (an mcp_call item when
    `mcp_label` names the server of its tool); a new item closes the open one. Where the model writes
    several messages (gpt-oss's harmony: `ChoiceDelta.message`), each message is its own item: two
    analysis messages two reasoning items, a commentary preamble and the final answer two messages.

    An MCP call the model finished is left open in `pending` (with its model's call id in `call_ids`)
    until the server has made it: `call_started`, then `call_finished`, or `not_made`.

    Token logprobs (when the request's `include` asks for them) belong to the message text their tokens
    wrote: a token's logprob waits until the parser lets its text out (a token may write nothing alone:
    part of a character, text the parser holds back) and goes with the message text written then, in
    that text's delta event and in the message's output_text part; the tokens of reasoning and of a call
    are dropped, with those that write nothing while one is open (`</think>`, a call's markup) and the
    stop token. A step of several tokens (speculative decoding)
    whose text is both reasoning and answer gives all its tokens to the answer."""

    def __init__(
        self,
        write: EventWriter,
        mcp_label: Callable[[str], str | None] = lambda name: None,
        waits: Callable[[str], bool] = lambda name: False,
        include_reasoning: bool = True,
    ):
        self.write = write
        self._include_reasoning = include_reasoning  # False: the request's include_reasoning (no items)
        self._waits = waits
        self.items: list[OutputItem] = []  # every item opened, in output order
        self.pending: list[McpCallOutput] = []
        self.call_ids: dict[str, str] = {}  # an mcp_call item's id -> the model's id for the call
        self._mcp_label = mcp_label
        self._open: OutputItem | None = None
        self._open_message: int | None = None  # the model's message it reads (ChoiceDelta.message)
        self._text = ""  # the open item's text, or a call's arguments
        self._logprobs: list[dict] = []  # the open message's tokens' logprobs
        self._unwritten: list[dict] = []  # the logprobs of tokens whose text has not come out yet

    def feed(self, delta: ChoiceDelta | None, logprobs: list[dict] = ()) -> list[str]:
        """The events of `delta` (None: the step's tokens wrote nothing yet); `logprobs`: its tokens'."""
        self._unwritten += logprobs
        if delta is None:
            if self._open is not None and not isinstance(self._open, OutputMessage):
                self._unwritten = []  # the open item's (a reasoning's end tag, part of a call's markup)
            return []
        events = []
        if delta.reasoning and self._include_reasoning:
            events += self._add_text("reasoning", delta.reasoning, delta.message)
        if delta.content:
            events += self._add_text("message", delta.content, delta.message)
        elif delta.reasoning or delta.tool_calls:  # these tokens wrote no answer
            self._unwritten = []
        for call in delta.tool_calls:
            if call.id is not None:
                events += self.close("completed")
                name = call.function.name or ""
                label = self._mcp_label(name)
                if label is None:
                    item = FunctionCallOutput(
                        id=item_id("fc"), call_id=call.id, name=name, arguments="", status="in_progress"
                    )
                elif self._waits(name):  # announced whole once the model has written it
                    item = McpApprovalRequestOutput(
                        id=item_id(APPROVAL_REQUEST), server_label=label, name=name, arguments=""
                    )
                    self.call_ids[item.id] = item.id  # the id the client's approval names
                else:
                    item = McpCallOutput(
                        id=item_id("mcp"), server_label=label, name=name, arguments="", status="in_progress"
                    )
                    self.call_ids[item.id] = call.id
                events += self._open_item(item)
                self._open_message = delta.message
            pieces = call.function.arguments
            if pieces and isinstance(self._open, McpApprovalRequestOutput):
                self._text += pieces
            elif pieces and isinstance(self._open, FunctionCallOutput | McpCallOutput):
                self._text += pieces
                kind = "mcp_call" if isinstance(self._open, McpCallOutput) else "function_call"
                index = len(self.items) - 1
                events.append(
                    self.write(
                        f"response.{kind}_arguments.delta",
                        item_id=self._open.id,
                        output_index=index,
                        delta=pieces,
                    )
                )
        return events

    def finish(self, status: str, since: int = 0) -> list[str]:
        """Close the open item with `status` ("completed", or "incomplete" when cut); an answer without
        any output (no item from `since` on: its last turn's) gets an empty message, as the non-streamed
        answer does."""
        events = [] if self.items[since:] else self._add_text("message", "")
        return events + self.close(status)

    def listed(self, item: McpListToolsOutput) -> list[str]:
        """The events of the tools an MCP server listed (before the model's first turn)."""
        self.items.append(item)
        where = {"item_id": item.id, "output_index": len(self.items) - 1}
        added = item.model_copy(update={"tools": []}).model_dump()
        return [
            self.write("response.output_item.added", output_index=where["output_index"], item=added),
            self.write("response.mcp_list_tools.in_progress", **where),
            self.write("response.mcp_list_tools.completed", **where),
            self._done(item),
        ]

    def made(self, item: McpCallOutput) -> list[str]:
        """The events of a call made before the model's first turn (one the client approved)."""
        self.items.append(item)
        added = item.model_copy(update={"output": None, "error": None, "status": "in_progress"})
        where = {"item_id": item.id, "output_index": len(self.items) - 1}
        return [
            self.write(
                "response.output_item.added", output_index=where["output_index"], item=added.model_dump()
            ),
            self.write("response.mcp_call_arguments.done", **where, arguments=item.arguments),
            self.call_started(item),
            *self._call_ended(item),
        ]

    def call_started(self, item: McpCallOutput) -> str:
        return self.write("response.mcp_call.in_progress", item_id=item.id, output_index=self._index(item))

    def call_finished(self, item: McpCallOutput) -> list[str]:
        """An MCP call made (`item` holds its output, or its error)."""
        self.pending.remove(item)
        return self._call_ended(item)

    def _call_ended(self, item: McpCallOutput) -> list[str]:
        kind = "response.mcp_call.failed" if item.error is not None else "response.mcp_call.completed"
        return [self.write(kind, item_id=item.id, output_index=self._index(item)), self._done(item)]

    def not_made(self, item: McpCallOutput) -> str:
        """An MCP call left unmade (its turn was cut by max_output_tokens)."""
        self.pending.remove(item)
        item.status = "incomplete"
        return self._done(item)

    def _index(self, item: OutputItem) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    def _done(self, item: OutputItem) -> str:
        return self.write("response.output_item.done", output_index=self._index(item), item=item.model_dump())

    def close(self, status: str) -> list[str]:
        item = self._open
        if item is None:
            return []
        self._open = None
        index = len(self.items) - 1
        text, self._text = self._text, ""
        events = []
        if isinstance(item, McpApprovalRequestOutput):
            if status != "completed":  # cut while the model wrote it: never announced, not asked
                self.items.pop()
                del self.call_ids[item.id]
                return []
            item.arguments = text
            return [
                self.write("response.output_item.added", output_index=index, item=item.model_dump()),
                self._done(item),
            ]
        if isinstance(item, McpCallOutput):
            item.arguments = text
            done = {"item_id": item.id, "output_index": index}
            events.append(self.write("response.mcp_call_arguments.done", **done, arguments=text))
            if status == "completed":  # the server makes the call once the model's turn has ended
                self.pending.append(item)
                return events
            item.status = status
            return [*events, self._done(item)]
        if isinstance(item, FunctionCallOutput):
            item.arguments = text
            done = {"item_id": item.id, "output_index": index}
            events.append(
                self.write("response.function_call_arguments.done", **done, name=item.name, arguments=text)
            )
        else:
            is_message = isinstance(item, OutputMessage)
            logprobs, self._logprobs = self._logprobs, []
            part = (
                OutputTextPart(text=text, logprobs=logprobs) if is_message else ReasoningTextPart(text=text)
            )
            item.content = [part]
            where = {"item_id": item.id, "output_index": index, "content_index": 0}
            if is_message:
                events.append(self.write("response.output_text.done", **where, text=text, logprobs=logprobs))
            else:
                events.append(self.write("response.reasoning_text.done", **where, text=text))
            events.append(self.write("response.content_part.done", **where, part=part.model_dump()))
        item.status = status
        events.append(self._done(item))
        return events

    def _open_item(self, item: OutputItem) -> list[str]:
        self._open = item
        self.items.append(item)
        index = len(self.items) - 1
        if isinstance(item, McpApprovalRequestOutput):
            return []  # announced when closed, whole
        events = [self.write("response.output_item.added", output_index=index, item=item.model_dump())]
        if isinstance(item, FunctionCallOutput | McpCallOutput):
            return events
        part = OutputTextPart(text="") if isinstance(item, OutputMessage) else ReasoningTextPart(text="")
        where = {"item_id": item.id, "output_index": index, "content_index": 0}
        events.append(self.write("response.content_part.added", **where, part=part.model_dump()))
        return events

    def _add_text(self, kind: str, text: str, message: int | None = None) -> list[str]:
        """`text` of the open item of `kind`, or of a new one: another kind's is open, or the text
        begins another of the model's messages (`message`)."""
        events = []
        is_message = kind == "message"
        wanted = OutputMessage if is_message else ReasoningOutput
        if not isinstance(self._open, wanted) or message != self._open_message:
            events += self.close("completed")
            self._open_message = message
            if is_message:
                item = OutputMessage(id=item_id("msg"), status="in_progress", content=[])
            else:
                item = ReasoningOutput(id=item_id("rs"), status="in_progress", content=[])
            events += self._open_item(item)
        if text:
            self._text += text
            where = {"item_id": self._open.id, "output_index": len(self.items) - 1, "content_index": 0}
            if is_message:
                logprobs, self._unwritten = self._unwritten, []
                self._logprobs += logprobs
                events.append(
                    self.write("response.output_text.delta", **where, delta=text, logprobs=logprobs)
                )
            else:
                events.append(self.write("response.reasoning_text.delta", **where, delta=text))
        return events

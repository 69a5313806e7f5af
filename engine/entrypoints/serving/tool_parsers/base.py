"""What every tool parser shares: the call and delta types, the parse of one call's JSON object, and the
streaming that turns successive parses of the growing text into OpenAI's deltas.

A parser only says how its format splits a text into content and calls (`_parse`); streaming re-parses
the whole text at each step and sends what grew since the last one. So a stream and a one-shot parse
agree by construction, as long as a parse never takes back what it gave: content and a call's
arguments only ever grow. Hence the rules every `_parse` follows:
- the undecided tail (a possible start tag, a call whose name has not ended) is held back, not content;
- a call is announced (committed) once its name is a finished string and its arguments have started
  with "{": from then on its arguments go out as the raw text the model wrote, never re-serialised
  (pythonic's and olmo3's calls, whose values are checked as they end, go out only whole);
- whitespace before a call belongs to the call, so "Sure.\\n\\n<tool_call>..." has content "Sure."; content
  that resumes after a call keeps the whitespace that separated it from the call (so "Let me check.\\n
  <tool_call>...</tool_call>\\nDone." has content "Let me check.\\nDone."), once non-whitespace follows
  it and content came before; whitespace after the last call that nothing follows is dropped;
- a call that breaks before it was announced comes back as content; one that breaks after (the model
  wrote bad JSON inside its arguments, or stopped) keeps what was sent, and the text after the break is
  content. Only that last case can differ from the one-shot parse, which returns the whole region as
  content (the stream cannot take back what it sent).

vLLM's parsers treat the content around calls differently, one-shot and streamed: hermes, qwen3_coder and
mistral return the text before the first call as written (its whitespace too) and drop what follows
calls; hermes' stream drops it too while qwen3_coder's sends it. Here content is the same wherever it
sits and however it was read.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from xlaserve.entrypoints.serving.tool_parsers.json_scan import (
    ObjectScan,
    ObjectScanner,
    Status,
    scan_object,
    skip_ws,
)

Scan = Callable[[str, int], ObjectScan]  # scan_object, or a parser's resuming version


def make_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class FunctionCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ToolCall:
    function: FunctionCall
    id: str = field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class DeltaFunctionCall:
    name: str | None = None  # only in a call's first delta
    arguments: str | None = None  # the next piece of the arguments' text


@dataclass
class DeltaToolCall:
    index: int
    function: DeltaFunctionCall
    id: str | None = None  # only in a call's first delta
    type: Literal["function"] | None = None


@dataclass
class ToolDelta:
    """One streaming step's news: more content, more of some calls, or both."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass
class Call:
    """A call as parsed so far: `arguments` is a prefix of its final text until `is_complete`."""

    name: str
    arguments: str
    is_complete: bool


@dataclass
class Parsed:
    pieces: list[str | Call]  # content and calls, in the text's order
    is_held: bool = False  # the text's tail is undecided and held back


@dataclass
class CallRead:
    """The outcome of reading one call's JSON object at a position."""

    call: Call | None  # None: no call (broken before it was announced, or undecided)
    end: int  # past the object (complete), where it broke (broken), len(text) (open)
    status: Status


_ARGUMENT_KEYS = ("arguments", "parameters")


def read_call_object(text: str, pos: int, scan_at: Scan = scan_object) -> CallRead:
    """Read `{"name": ..., "arguments"|"parameters": {...}}` at text[pos]."""
    scan = scan_at(text, pos)
    name = _name_of(text, scan)
    args_key = next((k for k in _ARGUMENT_KEYS if k in scan.members), None)
    if scan.status is Status.COMPLETE:
        if name is None:
            return CallRead(None, scan.end, Status.INVALID)
        if args_key is None:
            return CallRead(Call(name, "{}", True), scan.end, Status.COMPLETE)
        raw = scan.value_text(text, args_key)
        if raw.startswith('"'):  # some models write the arguments as a JSON string holding the object
            raw = json.loads(raw)
            try:
                is_object = isinstance(json.loads(raw), dict)
            except ValueError:
                is_object = False
            if not is_object:
                return CallRead(None, scan.end, Status.INVALID)
        elif not raw.startswith("{"):
            return CallRead(None, scan.end, Status.INVALID)
        return CallRead(Call(name, raw, True), scan.end, Status.COMPLETE)
    # open or broken: a call only once it is announced (name ended, arguments begun as an object)
    if name is None or args_key is None:
        return CallRead(None, scan.end, scan.status)
    raw = scan.value_text(text, args_key)
    if not raw.startswith("{"):
        return CallRead(None, scan.end, scan.status)
    return CallRead(Call(name, raw, scan.is_closed(args_key)), scan.end, scan.status)


def read_call_list(
    text: str, pos: int, final: bool, keep_broken: bool, pieces: list, scan_at: Scan = scan_object
) -> tuple[int, bool]:
    """Read a JSON list of call objects at text[pos] == "[" into `pieces`; (where the text goes on, or
    -1 when this is not a list of calls; whether the rest is held back)."""
    found = 0
    pos += 1
    while True:
        pos = skip_ws(text, pos)
        read = read_call_object(text, pos, scan_at)
        if read.status is Status.COMPLETE:
            pieces.append(read.call)
            found += 1
            pos = skip_ws(text, read.end)
            if pos == len(text):
                return pos, not final
            if text[pos] == ",":
                pos += 1
                continue
            return pos + (text[pos] == "]"), False
        if read.status is Status.PARTIAL and not final:
            if read.call is not None:
                pieces.append(read.call)
            return len(text), read.call is None
        if keep_broken and read.call is not None:
            pieces.append(read.call)
            return read.end, False
        return (pos if found else -1), False


def parse_call_list(
    text: str, pos: int, final: bool, keep_broken: bool, scan_at: Scan = scan_object
) -> Parsed:
    """The text as a JSON list of calls starting at text[pos] (after whitespace), with what follows as
    content; all content where it is not one, nothing yet while it may become one."""
    if pos == len(text):
        return Parsed([text] if final else [], is_held=not final)
    if text[pos] != "[":
        return Parsed([text])
    pieces: list = []
    end, is_held = read_call_list(text, pos, final, keep_broken, pieces, scan_at)
    if end < 0:
        return Parsed([text])
    return Parsed(pieces if is_held else [*pieces, text[end:]], is_held=is_held)


def _name_of(text: str, scan) -> str | None:
    if not scan.is_closed("name"):
        return None
    name = json.loads(scan.value_text(text, "name"))
    return name if isinstance(name, str) and name else None


def held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (0: none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def is_start_of(text: str, pos: int, tags: tuple[str, ...]) -> bool:
    """text[pos:] is nothing yet or a proper start of one of `tags`."""
    rest = text[pos:]
    return any(tag.startswith(rest) and len(rest) < len(tag) for tag in tags)


BlockReader = Callable[[str, int, bool, bool, list], tuple[int, bool]]


def parse_tagged(
    text: str, start_tag: str, final: bool, keep_broken: bool, read_block: BlockReader
) -> Parsed:
    """Content with blocks of calls, each after `start_tag`. read_block(text, where the block starts,
    final, keep_broken, pieces) reads one into `pieces`: (where the content goes on, or -1 when the tag
    was just text; whether the rest is held back)."""
    pieces: list[str | Call] = []
    pos = 0
    while True:
        start = text.find(start_tag, pos)
        if start < 0:
            held = 0 if final else held_suffix(text, start_tag)
            pieces.append(text[pos : len(text) - held])
            return Parsed(pieces, is_held=held > 0)
        pieces.append(text[pos:start])
        pos = start + len(start_tag)
        end, is_held = read_block(text, pos, final, keep_broken, pieces)
        if is_held:
            return Parsed(pieces, is_held=True)
        if end < 0:
            pieces.append(start_tag)
        else:
            pos = end


class ToolParser:
    """Turns a model's text into OpenAI tool calls, one-shot or streamed. One instance per choice (it
    keeps the stream's state); `tokenizer` is for parsers that need token ids (none so far)."""

    name: ClassVar[str]
    # The parser needs special tokens kept in the text (its start tag is one).
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer
        self._sent_content = 0
        self._sent_calls: list[list] = []  # [id, length of arguments sent] per announced call
        self._scanners: dict[int, ObjectScanner] = {}  # the stream's JSON objects, by where they start
        self._resume = False  # scan_at resumes the stream's scanners (else scans afresh)

    # -- what a format defines --------------------------------------------------------------------

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        """Split `text` into content and calls. final: the text is whole (nothing held back);
        keep_broken: an announced call that then breaks stays a call (streaming)."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return make_tool_call_id()

    def scan_at(self, text: str, pos: int) -> ObjectScan:
        """`scan_object` for `_parse`: while streaming, each object is scanned once, only the new text
        each step (the stream's text only grows); one-shot, afresh."""
        if not self._resume:
            return scan_object(text, pos)
        scanner = self._scanners.get(pos)
        if scanner is None:
            scanner = self._scanners[pos] = ObjectScanner(pos)
        return scanner.scan(text)

    def _parse_streaming(self, text: str, final: bool) -> Parsed:
        self._resume = True
        try:
            return self._parse(text, final, True)
        finally:
            self._resume = False

    # -- the API --------------------------------------------------------------------------------

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCalls:
        content, calls = self._assemble(self._parse(model_output, True, False), True, request)
        tool_calls = [ToolCall(FunctionCall(c.name, c.arguments), id=self.new_call_id()) for c in calls]
        return ExtractedToolCalls(bool(tool_calls), tool_calls, content or None)

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: Any = None
    ) -> ToolDelta | None:
        """The news since the last call, for the text so far (None: nothing to send yet, e.g. while a
        possible start tag is held back). previous_text and delta_text are for parsers that want
        them; this one re-parses current_text."""
        return self._delta(self._parse_streaming(current_text, False), False, request)

    def finish_streaming(self, current_text: str, request: Any = None) -> ToolDelta | None:
        """The stream has ended with `current_text`: whatever was held back, decided."""
        return self._delta(self._parse_streaming(current_text, True), True, request)

    # -- shared machinery -------------------------------------------------------------------------

    @staticmethod
    def _assemble(parsed: Parsed, final: bool, request: Any) -> tuple[str, list[Call]]:
        pieces: list[str | Call] = []
        for piece in parsed.pieces:  # merge neighbouring content
            if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
                pieces[-1] += piece
            elif not (isinstance(piece, str) and not piece):
                pieces.append(piece)
        content: list[str] = []
        calls: list[Call] = []
        for i, piece in enumerate(pieces):
            if isinstance(piece, Call):
                calls.append(piece)
                continue
            is_last = i == len(pieces) - 1
            if not is_last or parsed.is_held or not final:  # before a call, or maybe before one
                piece = piece.rstrip()
            if i > 0 and not (any(content) and piece.strip()):  # after a call, nothing to separate
                piece = piece.lstrip()
            content.append(piece)
        if request is not None and getattr(request, "parallel_tool_calls", None) is False:
            calls = calls[:1]
        return "".join(content), calls

    def _delta(self, parsed: Parsed, final: bool, request: Any) -> ToolDelta | None:
        content, calls = self._assemble(parsed, final, request)
        delta = ToolDelta()
        if len(content) > self._sent_content:
            delta.content = content[self._sent_content :]
            self._sent_content = len(content)
        for index, call in enumerate(calls):
            if index == len(self._sent_calls):
                call_id = self.new_call_id()
                self._sent_calls.append([call_id, len(call.arguments)])
                function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
                delta.tool_calls.append(DeltaToolCall(index, function, id=call_id, type="function"))
            elif len(call.arguments) > self._sent_calls[index][1]:
                piece = call.arguments[self._sent_calls[index][1] :]
                self._sent_calls[index][1] = len(call.arguments)
                delta.tool_calls.append(DeltaToolCall(index, DeltaFunctionCall(arguments=piece)))
        return delta if delta.content or delta.tool_calls else None

    @property
    def num_calls_sent(self) -> int:
        return len(self._sent_calls)

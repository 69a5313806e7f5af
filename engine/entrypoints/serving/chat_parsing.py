"""One chat choice's text split as both APIs answer it: the thinking (the server's `--reasoning-parser`;
OpenAI's `reasoning_content`, Anthropic's thinking block), the answer, and the calls (the
`--tool-call-parser` under tool_choice "auto", or the JSON a grammar forced for "required" and a named
function).

The reasoning parser sees the whole text; the tool parser sees only the answer. Streamed, each piece
of text goes through both, and what they send is the chunk's delta; at the end `finish` releases what
they held back (a possible tag). A parser that fails is logged and its text passed on as content:
the stream never breaks.

Forced (tool_choice "required" or a named function: a grammar made the answer a call list), a choice
has no content: the only text the tool parser could leave is call JSON it could not take (a call cut
by max_tokens), never words for the user. Its one-shot parse is then the stream's own pieces put
together, so a stream and a one-shot answer agree, a cut call included (its arguments as far as they
were streamed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from xlaserve.entrypoints.serving.reasoning import ReasoningParser
from xlaserve.entrypoints.serving.tool_parsers import (
    DeltaToolCall,
    FunctionCall,
    NamedToolParser,
    RequiredToolParser,
    ToolCall,
    ToolParser,
)
from xlaserve.entrypoints.serving.tools import ToolPlan

logger = logging.getLogger("xlaserve.entrypoints.serving")


@dataclass
class ParsedChoice:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ChoiceDelta:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)
    # Which of the model's messages the text belongs to, where its format has several (gpt-oss's
    # harmony: each message is its own Responses output item); None: one undivided answer.
    message: int | None = None

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def make_tool_parser(
    plan: ToolPlan, tool_parser_cls: type[ToolParser] | None, tokenizer
) -> ToolParser | None:
    """The parser a request's tool plan reads its calls with (None: no calls are parsed)."""
    if plan.choice == "named":
        return NamedToolParser(plan.function_name, tokenizer)
    if plan.choice == "required":
        return RequiredToolParser(tokenizer)
    if plan.choice == "auto" and tool_parser_cls is not None:
        return tool_parser_cls(tokenizer)
    return None


class ChoiceParser:
    """Per choice: `parse(text)` once, or `feed(delta)` per piece then `finish()`. is_forced: the
    answer is calls only (no content, see above)."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        request: Any = None,
        is_forced: bool = False,
    ):
        self.reasoning = reasoning
        self.tools = tools
        self.request = request
        self.is_forced = is_forced
        self._text = ""
        self._answer = ""  # the content part so far, what the tool parser reads

    @property
    def num_calls_sent(self) -> int:
        return self.tools.num_calls_sent if self.tools is not None else 0

    def parse(self, text: str) -> ParsedChoice:
        if self.is_forced:
            return _assembled([self.feed(text), self.finish()])
        reasoning, content = None, text
        if self.reasoning is not None:
            try:
                reasoning, content = self.reasoning.extract_reasoning(text, self.request)
            except Exception:  # noqa: BLE001 - a parser bug must not cost the answer
                logger.exception("the reasoning parser failed; the text is returned as content")
        if self.tools is None or content is None:
            return ParsedChoice(reasoning, content)
        try:
            extracted = self.tools.extract_tool_calls(content, self.request)
        except Exception:  # noqa: BLE001
            logger.exception("the tool parser failed; the text is returned as content")
            return ParsedChoice(reasoning, content)
        return ParsedChoice(reasoning, extracted.content, extracted.tool_calls)

    def feed(self, delta_text: str) -> ChoiceDelta:
        return self._kept(self._feed(delta_text))

    def finish(self) -> ChoiceDelta:
        return self._kept(self._finish())

    def _kept(self, delta: ChoiceDelta) -> ChoiceDelta:
        if self.is_forced and delta.content is not None:
            delta.content = None
        return delta

    def _feed(self, delta_text: str) -> ChoiceDelta:
        previous, self._text = self._text, self._text + delta_text
        if self.reasoning is None:
            return self._answer_delta(None, delta_text)
        try:
            news = self.reasoning.extract_reasoning_streaming(previous, self._text, delta_text, self.request)
        except Exception:  # noqa: BLE001
            logger.exception("the reasoning parser failed; the rest is streamed as content")
            self.reasoning = None
            return self._answer_delta(None, delta_text)
        if news is None:
            return ChoiceDelta()
        return self._answer_delta(news.reasoning, news.content)

    def _finish(self) -> ChoiceDelta:
        reasoning = content = None
        if self.reasoning is not None:
            try:
                news = self.reasoning.finish_streaming(self._text, self.request)
            except Exception:  # noqa: BLE001
                logger.exception("the reasoning parser failed at the end of the stream")
                news = None
            if news is not None:
                reasoning, content = news.reasoning, news.content
        delta = self._answer_delta(reasoning, content)
        if self.tools is not None:
            try:
                last = self.tools.finish_streaming(self._answer, self.request)
            except Exception:  # noqa: BLE001
                logger.exception("the tool parser failed at the end of the stream")
                last = None
            if last is not None:
                delta.content = (delta.content or "") + (last.content or "") or None
                delta.tool_calls += last.tool_calls
        return delta

    def _answer_delta(self, reasoning: str | None, content: str | None) -> ChoiceDelta:
        if self.tools is None or not content:
            return ChoiceDelta(reasoning, content)
        previous, self._answer = self._answer, self._answer + content
        try:
            news = self.tools.extract_tool_calls_streaming(previous, self._answer, content, self.request)
        except Exception:  # noqa: BLE001
            logger.exception("the tool parser failed; the rest is streamed as content")
            self.tools = None
            return ChoiceDelta(reasoning, content)
        if news is None:
            return ChoiceDelta(reasoning)
        return ChoiceDelta(reasoning, news.content, list(news.tool_calls))


def _assembled(deltas: list[ChoiceDelta]) -> ParsedChoice:
    """A choice as a client accumulates the stream of `deltas`: the thinking joined, each call's
    arguments its pieces joined (complete, or as far as they went when the output was cut)."""
    reasoning = "".join(d.reasoning or "" for d in deltas) or None
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.id is not None:
                function = FunctionCall(piece.function.name or "", piece.function.arguments or "")
                calls[piece.index] = ToolCall(function, id=piece.id)
            elif piece.index in calls:
                calls[piece.index].function.arguments += piece.function.arguments or ""
    return ParsedChoice(reasoning, None, list(calls.values()))

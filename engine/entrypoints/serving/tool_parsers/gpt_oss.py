"""gpt-oss's tool calls (vLLM's `openai` parser): harmony messages addressed to a function.

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>   (one line in the text; cut here)

Each message whose recipient is `functions.NAME` is a call of NAME with its body as the arguments
(serving/harmony.py reads the messages); it is announced once its header has ended and its body has
begun. The bodies of the other messages are the content, except the analysis channel's: the thinking is
not for the user (the `openai_gptoss` reasoning parser returns it as reasoning). The format's markers
are special tokens, kept in the text for this parser.
"""

from __future__ import annotations

from xlaserve.entrypoints.serving.harmony import read_messages
from xlaserve.entrypoints.serving.tool_parsers.base import Call, Parsed, ToolParser


class OpenAIToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True

    def _parse(self, text: str, final: bool, keep_broken: bool) -> Parsed:
        messages, is_held = read_messages(text, final)
        pieces: list[str | Call] = []
        for message in messages:
            name = message.function_name
            if name is None:
                if message.channel != "analysis":
                    pieces.append(message.body)
                continue
            arguments = message.body.strip()  # stripping the open tail only delays its whitespace
            if arguments:
                pieces.append(Call(name, arguments, message.is_closed or final))
            elif not final:
                is_held = True  # its name is known, its arguments not begun: not announced yet
        return Parsed(pieces, is_held=is_held)

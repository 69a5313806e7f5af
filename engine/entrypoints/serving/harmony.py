"""OpenAI's harmony format (gpt-oss), read from an assistant turn's text with its special tokens kept.

The prompt ends with `<|start|>assistant`; the model then writes one or more messages:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>   (one line in the text; cut here)

or, answering, `...<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`. A message's
header (up to `<|message|>`) names its channel (analysis: the thinking; final: the answer; commentary:
tool calls and preambles), its recipient (`to=functions.NAME` makes it a call; it may stand before the
channel too) and a content type (`<|constrain|>json`). Its body runs to `<|end|>`, `<|call|>` or
`<|return|>` (the last two are stop tokens, so the output text usually ends without them) or to the
text's end. Text that is not in a message (a model that skipped the format) is read as a final
message without a header.

Both parsers of the format read messages here: the reasoning parser (`openai_gptoss`,
serving/reasoning/harmony.py) and the tool parser (`openai`, serving/tool_parsers/gpt_oss.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
HEADER_STARTS = (START, CHANNEL)
# Every special token the format writes: the output text must keep them (skip_special_tokens=False).
SPECIAL_TOKENS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass
class Message:
    channel: str | None  # None: text outside the format
    recipient: str | None  # "functions.get_weather" for a call
    body: str  # the body so far (without its end marker)
    start: int  # where the message begins in the text (its header included)
    end: int  # past its end marker (closed), or the end of what is read of it
    is_closed: bool

    @property
    def function_name(self) -> str | None:
        """The function this message calls, if it is a call."""
        if self.recipient and self.recipient.startswith("functions."):
            return self.recipient.removeprefix("functions.")
        return None


def read_messages(text: str, final: bool) -> tuple[list[Message], bool]:
    """The messages of `text` (an open last body included) and whether its tail is held back: a
    header not yet ended, or a possible marker at the very end, while the text may still grow
    (`final` False). A header the text ends inside, once final, is dropped: it is markup only."""
    messages: list[Message] = []
    pos = 0
    while pos < len(text):
        rest = text[pos:].lstrip()
        header_pos = len(text) - len(rest)
        if rest.startswith(HEADER_STARTS):
            header_end = text.find(MESSAGE, header_pos)
            if header_end < 0:
                return messages, not final
            header = text[header_pos:header_end]
            body_start = header_end + len(MESSAGE)
            channel = _CHANNEL.search(header)
            recipient = _RECIPIENT.search(header)
            channel_name = channel.group(1) if channel else "final"
            recipient_name = recipient.group(1) if recipient else None
        elif not final and any(marker.startswith(rest) for marker in HEADER_STARTS):
            return messages, True  # maybe a header's first marker
        else:  # text outside the format: up to the next message
            body_start = pos
            channel_name, recipient_name = None, None
        end, after = _body_end(text, body_start, within_format=channel_name is not None)
        if end is None:  # open: the body runs to the text's end
            held = 0 if final else _held_marker(text, body_start)
            body = text[body_start : len(text) - held]
            messages.append(Message(channel_name, recipient_name, body, pos, len(text), False))
            return messages, held > 0
        messages.append(Message(channel_name, recipient_name, text[body_start:end], pos, after, True))
        pos = after
    return messages, False


def _body_end(text: str, pos: int, within_format: bool) -> tuple[int | None, int]:
    """(where the body at `pos` ends, where the next message begins), or (None, len(text)) while it
    is open. A message ends at an end marker (or at a new message's start, when a model skips
    `<|end|>`); text outside the format ends where a message begins."""
    candidates = (*ENDS, START) if within_format else HEADER_STARTS
    found = [(i, m) for m in candidates if (i := text.find(m, pos)) >= 0]
    if not found:
        return None, len(text)
    end, marker = min(found)
    return end, end + len(marker) if marker in ENDS else end


def _held_marker(text: str, body_start: int) -> int:
    """Length of the end of `text` (past body_start) that may be the start of a marker."""
    for k in range(min(max(map(len, SPECIAL_TOKENS)) - 1, len(text) - body_start), 0, -1):
        if any(m.startswith(text[-k:]) for m in SPECIAL_TOKENS):
            return k
    return 0

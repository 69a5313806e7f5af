"""A Responses turn's text through its ChoiceParser, each delta marked with the model's message it
belongs to, where the model writes several (gpt-oss's harmony format, serving/harmony.py): vLLM and
OpenAI answer each harmony message as its own output item (analysis: a reasoning item; final, and a
commentary preamble: a message item; a message to `functions.NAME`: a function_call item), in the
order written. The chat route joins them (one reasoning_content, one content); this route does not.

The parser is split-invariant (a text fed in any pieces parses the same), so a piece of the stream
that spans a message's start (several tokens in one step) is fed in two, and each delta is marked with
the message the parser's text has reached: a message is counted once its header has ended, so a
held-back header's text comes out with its own message's index.
"""

from __future__ import annotations

import re

from xlaserve.entrypoints.serving.chat_parsing import ChoiceDelta, ChoiceParser
from xlaserve.entrypoints.serving.harmony import HEADER_STARTS, read_messages

_HEADER_START = re.compile("|".join(re.escape(marker) for marker in HEADER_STARTS))


class TurnParser:
    """`feed(text)` per piece of the model's text, then `finish()`: the deltas of `parser`, in order.
    Where the server's parsers read harmony, each delta carries `message`."""

    def __init__(self, parser: ChoiceParser):
        self.parser = parser
        self.is_harmony = _reads_harmony(parser)
        # The text from the first message not yet closed (a closed one never changes: its end marker is
        # read), and how many closed before it: each piece re-reads the open message only.
        self._text = ""
        self._num_closed = 0

    def feed(self, text: str) -> list[ChoiceDelta]:
        if not self.is_harmony:
            return [self.parser.feed(text)]
        cuts = [m.start() for m in _HEADER_START.finditer(text) if m.start() > 0]
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        deltas = []
        for piece in pieces:
            self._text += piece
            delta = self.parser.feed(piece)
            delta.message = self._message(final=False)
            deltas.append(delta)
        return deltas

    def finish(self) -> list[ChoiceDelta]:
        delta = self.parser.finish()
        if self.is_harmony:
            delta.message = self._message(final=True)
        return [delta]

    def _message(self, final: bool) -> int:
        """The index of the last message the text holds (one whose header has ended)."""
        messages, _ = read_messages(self._text, final)
        index = max(self._num_closed + len(messages) - 1, 0)
        closed = 0
        for message in messages:
            if not message.is_closed:
                break
            closed = message.end  # where the next one begins
            self._num_closed += 1
        self._text = self._text[closed:]
        return index


def _reads_harmony(parser: ChoiceParser) -> bool:
    reasoning = getattr(parser.reasoning, "name", None)
    tools = getattr(parser.tools, "name", None)
    return reasoning == "openai_gptoss" or tools == "openai"

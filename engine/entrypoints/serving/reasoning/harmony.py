"""gpt-oss's reasoning parser (vLLM's `openai_gptoss`): the harmony format's analysis channel is the
thinking, the rest is the answer (serving/harmony.py reads the messages).

The answer keeps each call message as the model wrote it (header and body, markers included), so that
the `openai` tool parser, which reads only the answer, still finds its recipient; every other message
gives its body alone. Without a tool parser a call therefore shows as its markup, as any family's call
syntax does. The format's markers are special tokens: the parser asks for them to be kept in the text.
"""

from __future__ import annotations

from typing import Any

from xlaserve.entrypoints.serving.harmony import CHANNEL, MESSAGE, START, read_messages
from xlaserve.entrypoints.serving.reasoning.base import ReasoningParser, single_token_id


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    starts_open = False
    keeps_special_tokens = True

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        prompt_token_ids: list[int] | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        # No single token ends the thinking: the final channel's header does, `<|channel|>final`, then
        # (after an optional `<|constrain|>json`) its `<|message|>`; structured output starts after it.
        self.start_token_id = self.end_token_id = None
        self.tokenizer = tokenizer
        if tokenizer is not None:
            channel, message = single_token_id(tokenizer, CHANNEL), single_token_id(tokenizer, MESSAGE)
            if channel is None or message is None:
                raise ValueError(
                    f"the {self.name} reasoning parser needs the harmony format's {CHANNEL!r} and "
                    f"{MESSAGE!r} as tokens of the model's vocabulary; this tokenizer lacks one"
                )
            self.end_token_id = message
            self.end_prefix_ids = [channel, *tokenizer.encode("final", add_special_tokens=False)]
        self._sent_reasoning = self._sent_content = 0

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """Has the last assistant message (from the last `<|start|>`) reached the body of a channel other
        than analysis in these ids? A prompt ends at `<|start|>assistant`: not yet."""
        if self.tokenizer is None or single_token_id(self.tokenizer, MESSAGE) not in token_ids:
            return False
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        messages, _ = read_messages(text[max(text.rfind(START), 0) :], final=False)
        return any(m.channel not in (None, "analysis") for m in messages)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        messages, _ = read_messages(text, final)
        reasoning, content = [], []
        for message in messages:
            if message.channel == "analysis":
                reasoning.append(message.body)
            elif message.recipient is not None:  # a call, whole, for the tool parser
                content.append(text[message.start : message.end])
            else:
                content.append(message.body)
        return "".join(reasoning), "".join(content)

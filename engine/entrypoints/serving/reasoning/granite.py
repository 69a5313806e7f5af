"""Granite 3.2+'s reasoning parser (vLLM's `granite`): with `chat_template_kwargs={"thinking": true}` the
template asks the model to write "Here is my thought process:", its thinking, then "Here is my
response:" and its answer, in plain words (vLLM also takes "Here's" for either, which quantized models
were seen to write).

An output that does not open with the thought marker is all answer; one cut before the response
marker is all thinking (as vLLM streams it; vLLM's one-shot parse gives such an output as content, a
stream and a one-shot parse here agree). Streamed, a possible marker is held back until it is one or
is not.

Structured output waits for the canonical "Here is my response:" when the request asked for thinking:
its words' ids, then the ":" id (`end_prefix_ids` beside `end_token_id`, the rule gpt-oss's channel
header uses); without thinking the answer starts at the first token.
"""

from __future__ import annotations

from typing import Any

from xlaserve.entrypoints.serving.reasoning.base import ReasoningParser, single_token_id
from xlaserve.entrypoints.serving.tool_parsers.base import held_suffix

THOUGHT_MARKERS = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_MARKERS = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    starts_open = False

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        prompt_token_ids: list[int] | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        self.start_token_id = self.end_token_id = None
        self.is_thinking = bool((chat_template_kwargs or {}).get("thinking"))
        if tokenizer is not None:
            words, colon = RESPONSE_MARKERS[0][:-1], RESPONSE_MARKERS[0][-1]
            self.end_token_id = single_token_id(tokenizer, colon)
            if self.end_token_id is None:
                raise ValueError(
                    f"the {self.name} reasoning parser needs {colon!r} as one token of the model's "
                    "vocabulary; this tokenizer has none"
                )
            self.end_prefix_ids = list(tokenizer.encode(words, add_special_tokens=False))
        self._sent_reasoning = self._sent_content = 0

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """The prompt is not read (the thinking template's system prompt quotes both markers): a request
        with thinking waits for the response marker, one without has none to wait for."""
        return not self.is_thinking

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        thought = next((m for m in THOUGHT_MARKERS if stripped.startswith(m)), None)
        if thought is None:
            if not final and any(m.startswith(stripped) for m in THOUGHT_MARKERS):
                return "", ""  # maybe the thought marker
            return "", text
        pos = len(text) - len(stripped) + len(thought)
        found = [(i, m) for m in RESPONSE_MARKERS if (i := text.find(m, pos)) >= 0]
        if not found:
            held = 0 if final else max(held_suffix(text, m) for m in RESPONSE_MARKERS)
            return text[pos : len(text) - held], ""
        end, marker = min(found)
        return text[pos:end], text[end + len(marker) :].lstrip()

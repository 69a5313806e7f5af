"""MiniMax-M2's reasoning parsers (vLLM's `minimax_m2` and `minimax_m2_append_think`).

Its template opens `<think>` in the prompt, so the model writes its thinking, `</think>`, then the
answer. `minimax_m2` splits them as DeepSeek-R1's parser does (all text before `</think>` is thinking;
an output cut before it is all thinking), and drops the `</think>` the model sometimes writes again in
its answer, as vLLM does. `minimax_m2_append_think` splits nothing: the whole output is content with
the template's `<think>` put back in front, for clients that send the thinking back in the next turn's
assistant message, as MiniMax asks for its interleaved thinking.
"""

from __future__ import annotations

from xlaserve.entrypoints.serving.reasoning.base import DeepSeekR1ReasoningParser
from xlaserve.entrypoints.serving.tool_parsers.base import held_suffix


class MiniMaxM2ReasoningParser(DeepSeekR1ReasoningParser):
    name = "minimax_m2"

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = super()._split(text, final)
        content = content.replace(self.end_tag, "")
        held = 0 if final else held_suffix(content, self.end_tag)  # maybe another one
        return reasoning, content[: len(content) - held].lstrip()


class MiniMaxM2AppendThinkReasoningParser(DeepSeekR1ReasoningParser):
    name = "minimax_m2_append_think"

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        return "", self.start_tag + text

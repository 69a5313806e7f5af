"""Reasoning parsers: a thinking model's text -> (reasoning, content), one-shot or streamed.

The formats here write the thinking between a start and an end tag (`<think>` and `</think>`;
Magistral's `[THINK]` and `[/THINK]`); they differ in where the thinking may start. Whether the output
starts inside the thinking is read from the prompt when it is known (a template that ends the prompt
with `<think>` opened it; one that ends with `<think></think>`, as Qwen3's does for
enable_thinking=false, closed it); otherwise the family's default applies (`starts_open`). An output
that starts outside it is thinking only if it opens with the start tag (Magistral's: wherever it is).
Where thinking is a template switch (DeepSeek-V3.1's `thinking`), the request's chat_template_kwargs say.

Streaming re-parses the text so far and sends what grew, holding back a possible tag, so a stream and
a one-shot parse give the same split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from xlaserve.entrypoints.serving.tool_parsers.base import held_suffix


@dataclass
class ReasoningDelta:
    reasoning: str | None = None
    content: str | None = None


class ReasoningParser:
    """One instance per choice (it keeps the stream's state). `tokenizer` gives the tags' token ids
    (`is_reasoning_end`; a tokenizer without them as single tokens is a ValueError); `prompt_token_ids`
    tell whether the output starts inside the thinking; `chat_template_kwargs` are the request's (as
    vLLM hands them to its parsers: where the family's thinking is a template switch, they tell)."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    starts_open: ClassVar[bool]  # the output starts inside the thinking when the prompt does not say
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens: keep them in the text

    reads_prompt: ClassVar[bool] = True  # the prompt's last tag says whether the output starts inside

    # Where one token does not end the thinking: the ids before end_token_id that mark it
    # (StructuredOutputsParams.reasoning_end_prefix_ids; gpt-oss's `<|channel|>final`).
    end_prefix_ids: list[int] | None = None

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        prompt_token_ids: list[int] | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.start_token_id = self.end_token_id = None
        if tokenizer is not None:
            self._find_token_ids(tokenizer)
        self.is_open = self.starts_open
        if self.reads_prompt and prompt_token_ids is not None and self.end_token_id is not None:
            last_start = _last_index(prompt_token_ids, self.start_token_id)
            last_end = _last_index(prompt_token_ids, self.end_token_id)
            if last_start >= 0 or last_end >= 0:
                self.is_open = last_start > last_end
        self._sent_reasoning = self._sent_content = 0

    def _find_token_ids(self, tokenizer: Any) -> None:
        """The ids structured output's gate and `is_reasoning_end` read: the tags', the end tag one token
        of the vocabulary (else a ValueError)."""
        self.start_token_id = single_token_id(tokenizer, self.start_tag)
        self.end_token_id = single_token_id(tokenizer, self.end_tag)
        if self.end_token_id is None:
            raise ValueError(
                f"the {self.name} reasoning parser needs {self.end_tag!r} as one token of the "
                "model's vocabulary; this tokenizer has none"
            )

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        """Has the thinking ended in these ids (a prompt's followed by an output's)? True once an end tag
        comes after the last start tag."""
        last_end = _last_index(token_ids, self.end_token_id)
        return last_end >= 0 and last_end > _last_index(token_ids, self.start_token_id)

    def extract_reasoning(self, text: str, request: Any = None) -> tuple[str | None, str | None]:
        reasoning, content = self._split(text, final=True)
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self, previous_text: str, current_text: str, delta_text: str, request: Any = None
    ) -> ReasoningDelta | None:
        """The news since the last call for the text so far; None while nothing can be sent."""
        return self._delta(*self._split(current_text, final=False))

    def finish_streaming(self, current_text: str, request: Any = None) -> ReasoningDelta | None:
        return self._delta(*self._split(current_text, final=True))

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        pos = 0
        if not self.is_open:
            stripped = text.lstrip()
            if not stripped.startswith(self.start_tag):
                if not final and self.start_tag.startswith(stripped):
                    return "", ""  # maybe the start tag
                return "", text
            pos = len(text) - len(stripped) + len(self.start_tag)
        elif text.startswith(self.start_tag):  # the model wrote the tag the template already had
            pos = len(self.start_tag)
        elif not final and self.start_tag.startswith(text):
            return "", ""  # maybe that tag
        end = text.find(self.end_tag, pos)
        if end < 0:
            held = 0 if final else held_suffix(text, self.end_tag)
            return text[pos : len(text) - held], ""
        return text[pos:end], text[end + len(self.end_tag) :].lstrip()

    def _delta(self, reasoning: str, content: str) -> ReasoningDelta | None:
        delta = ReasoningDelta()
        if len(reasoning) > self._sent_reasoning:
            delta.reasoning = reasoning[self._sent_reasoning :]
            self._sent_reasoning = len(reasoning)
        if len(content) > self._sent_content:
            delta.content = content[self._sent_content :]
            self._sent_content = len(content)
        return delta if delta.reasoning or delta.content else None


def single_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` if the vocabulary has it as one token (a lookup, not a copy of the vocabulary:
    this runs per request)."""
    if hasattr(tokenizer, "convert_tokens_to_ids"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
            return None  # an unknown token maps to <unk>
        return int(token_id)
    token_id = tokenizer.get_vocab().get(token)
    return int(token_id) if token_id is not None else None


def _last_index(ids: list[int], token_id: int | None) -> int:
    if token_id is None or token_id not in ids:
        return -1
    return len(ids) - 1 - ids[::-1].index(token_id)  # C loops: prompts can be long


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: its template opens the thinking in the prompt (older ones let the model write
    `<think>`), so all text before `</think>` is thinking, and an output cut before it is all thinking."""

    name = "deepseek_r1"
    starts_open = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model opens `<think>` itself (enable_thinking=false closes it in the prompt); the
    2507 Thinking models' template opens it in the prompt, which the prompt's ids reveal."""

    name = "qwen3"
    starts_open = False


class Glm45ReasoningParser(Qwen3ReasoningParser):
    """GLM-4.5/4.6/4.7 (vLLM's `glm45`): Qwen3's tags and start (the model opens `<think>`;
    enable_thinking=false closes it in the prompt), but its template writes `<think></think>` into every
    earlier assistant turn, so the thinking has ended only at a `</think>` after the last
    `<|assistant|>`. An output cut inside its thinking is thinking, streamed or not (vLLM's one-shot
    parse gives it as content; a stream and a one-shot parse here agree)."""

    name = "glm45"
    turn_tag: ClassVar[str] = "<|assistant|>"

    def _find_token_ids(self, tokenizer: Any) -> None:
        super()._find_token_ids(tokenizer)
        self.turn_token_id = single_token_id(tokenizer, self.turn_tag)
        if self.turn_token_id is None:
            raise ValueError(
                f"the {self.name} reasoning parser needs {self.turn_tag!r} as one token of the model's "
                "vocabulary; this tokenizer has none"
            )

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        return _last_index(token_ids, self.end_token_id) > _last_index(token_ids, self.turn_token_id)


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    """DeepSeek-V3.1: thinking is the request's switch, `chat_template_kwargs` `thinking` (or
    `enable_thinking`, which vLLM takes too): on, the output is DeepSeek-R1's; off (the default), it
    is all answer, a stray `</think>` included, and structured output applies from its first token."""

    name = "deepseek_v3"

    @property
    def is_thinking(self) -> bool:
        switches = self.chat_template_kwargs
        return bool(switches.get("thinking")) or bool(switches.get("enable_thinking"))

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        return not self.is_thinking or super().is_reasoning_end(token_ids)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        return super()._split(text, final) if self.is_thinking else ("", text)


class MistralReasoningParser(ReasoningParser):
    """Magistral: `[THINK]` ... `[/THINK]`, special tokens (kept in the text for this parser). As vLLM's:
    the thinking starts where the model writes `[THINK]` (its system prompt asks it to, and closes both
    tags there); text before it is answer too, and without `[THINK]` a stray `[/THINK]` is dropped."""

    name = "mistral"
    start_tag = "[THINK]"
    end_tag = "[/THINK]"
    starts_open = False
    keeps_special_tokens = True

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.is_open:  # a prompt that ends inside [THINK]
            return super()._split(text, final)
        start = text.find(self.start_tag)
        before = text if start < 0 else text[:start]
        if start < 0 and not final:  # hold what may become either tag
            held = max(held_suffix(before, tag) for tag in (self.start_tag, self.end_tag))
            before = before[: len(before) - held]
        stray = before.find(self.end_tag)
        if stray >= 0:
            before = before[:stray] + before[stray + len(self.end_tag) :]
        if start < 0:
            return "", before
        pos = start + len(self.start_tag)
        end = text.find(self.end_tag, pos)
        if end < 0:
            held = 0 if final else held_suffix(text, self.end_tag)
            return text[pos : len(text) - held], before
        return text[pos:end], before + text[end + len(self.end_tag) :]


class Olmo3ReasoningParser(DeepSeekR1ReasoningParser):
    """Olmo 3 Think: its template opens `<think>` in the prompt, and the tags are plain text (the
    vocabulary has no token of them), so no prompt ids are read: the output starts inside the thinking,
    a `<think>` the model writes anyway is dropped, and an output without `</think>` is all thinking (as
    vLLM's olmo3 streams it; its one-shot parse gives that as content). No token id ends the thinking:
    structured output is refused with this parser (the engine's gate is a token id)."""

    name = "olmo3"
    reads_prompt = False

    def _find_token_ids(self, tokenizer: Any) -> None:
        pass  # none: the tags are text

    def is_reasoning_end(self, token_ids: list[int]) -> bool:
        return False

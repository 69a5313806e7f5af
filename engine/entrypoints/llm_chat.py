"""The offline `LLM.chat`'s prompts: each conversation rendered through the chat template, with its
images and videos loaded, as vLLM's LLM.chat renders them (the server's chat path is
entrypoints/serving/chat_template.py's)."""

from __future__ import annotations

from typing import Any

from xlaserve.config import CONTENT_FORMATS
from xlaserve.engine.media import MediaPolicy, load_image
from xlaserve.engine.mm_processor import content_format, flatten_content
from xlaserve.engine.video import load_video

Conversation = list[dict[str, Any]]
# What chat() itself passes to the tokenizer's apply_chat_template: not for chat_template_kwargs.
_CHAT_TEMPLATE_ARGS = frozenset(
    {"conversation", "chat_template", "tools", "add_generation_prompt", "continue_final_message", "tokenize"}
)


class ChatRenderer:
    """One chat() call's rendering arguments, checked once (a ValueError naming the argument); `prompt`
    renders each of its conversations. `mm_processor`: the input processor's (None: a text model)."""

    def __init__(
        self,
        tokenizer,
        mm_processor,
        policy: MediaPolicy,
        *,
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict] | None,
        chat_template_kwargs: dict[str, Any] | None,
        chat_template_content_format: str,
    ):
        if continue_final_message and add_generation_prompt:
            raise ValueError("chat(): continue_final_message=True needs add_generation_prompt=False")
        self.extra = dict(chat_template_kwargs or {})
        taken = sorted(set(self.extra) & _CHAT_TEMPLATE_ARGS)
        if taken:
            raise ValueError(f"chat(): chat_template_kwargs cannot set {taken}: they are chat()'s arguments")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat(): chat_template_content_format must be one of {CONTENT_FORMATS}, "
                f"got {chat_template_content_format!r}"
            )
        template = chat_template or tokenizer.chat_template
        self.as_parts = bool(template) and content_format(template, chat_template_content_format) == "openai"
        self.tokenizer, self.mm, self.policy = tokenizer, mm_processor, policy
        self.template_args = {
            "chat_template": chat_template,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }

    def prompt(self, conversation: Conversation) -> dict:
        """The conversation's prompt for the input processor: its text and media, or, text only, its
        token ids as the template wrote them (special tokens included)."""
        mm, policy = self.mm, self.policy
        conversation, images, videos = flatten_content(
            conversation,
            mm and mm.chat_placeholder,
            lambda url, field: load_image(url, policy, field),
            video_placeholder=mm and mm.chat_video_placeholder,
            load_video=lambda url, field: load_video(url, policy, field),
            as_parts=self.as_parts,
        )
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, **self.template_args, **self.extra
        )
        if images or videos:
            return {"prompt": text, "multi_modal_data": {"image": images, "video": videos}}
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

"""Reasoning through `xlaserve serve --reasoning-parser qwen3` with a tiny random Qwen3 whose chat
template opens the thinking (or closes it for {"enable_thinking": false}): the split of the model's
raw text, streamed and not, and structured output that starts only after the thinking. The model
directory carries a generation_config.json: requests' default sampling."""

from __future__ import annotations

import json
import os
import re

import httpx
import openai
import pytest

from helpers.sdk_clients import anthropic_prompt_tokens
from helpers.server_harness import ServerProcess
from helpers.tiny_models import TINY_PROCESS_ENV, save_tiny_thinking_model
from xlaserve.entrypoints.serving.reasoning import get_reasoning_parser
from xlaserve.models.loader import load_tokenizer

pytestmark = pytest.mark.slow  # a server of its own (a tiny model)

CHAT = [{"role": "user", "content": "Is 17 prime?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 12}
THINKING = {True: {}, False: {"chat_template_kwargs": {"enable_thinking": False}}}


# Qwen3's generation_config.json recommends this sampling (vLLM's --generation-config auto makes it
# every request's default); the max_new_tokens is this module's.
GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 9}


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory, server_cache_dir):
    model = save_tiny_thinking_model(str(tmp_path_factory.mktemp("tiny-thinking")))
    with open(os.path.join(model, "generation_config.json")) as f:
        generation_config = json.load(f)
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({**generation_config, **GENERATION_CONFIG}, f)
    proc = ServerProcess(
        str(tmp_path_factory.mktemp("thinking-logs")),
        server_cache_dir,
        # Few buckets (the prompts are short), and no warm-up (nothing here is about it): only the
        # programs the requests below run are compiled, when they first run.
        extra_args=[
            "--enforce-eager",
            "--reasoning-parser",
            "qwen3",
            "--served-model-name",
            "tiny",
            "--max-num-batched-tokens",
            "32",
            "--max-num-seqs",
            "4",
            "--max-model-len",
            "256",
        ],  # fmt: skip
        model=model,
        env=TINY_PROCESS_ENV,
    )
    proc.wait_ready()
    proc.model_dir = model
    yield proc
    assert proc.stop() == 0, proc.log_tail()


@pytest.fixture(scope="module")
def client(thinking_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def raw_output(server, extra: dict) -> tuple[list[int], str]:
    """The chat prompt's ids (/tokenize renders it as the chat does) and the model's raw greedy text."""
    body = {"messages": CHAT, **extra}
    ids = httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    completion = httpx.post(server.url + "/v1/completions", json={"prompt": ids, **GREEDY}, timeout=300)
    return ids, completion.json()["choices"][0]["text"]


def streamed(client, **kwargs) -> tuple[str | None, str | None]:
    reasoning = content = ""
    for chunk in client.chat.completions.create(model="tiny", messages=CHAT, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    return reasoning or None, content or None


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "enable_thinking-false"])
def test_thinking_goes_to_reasoning_content(thinking_server, client, thinking):
    extra = THINKING[thinking]
    ids, text = raw_output(thinking_server, extra)
    tokenizer = load_tokenizer(thinking_server.model_dir)
    expected = get_reasoning_parser("qwen3")(tokenizer, prompt_token_ids=ids).extract_reasoning(text)
    if thinking:  # the template opened the thinking: the output starts inside it
        assert ids[-2:] == tokenizer.encode("<think>\n", add_special_tokens=False)
        assert expected[0] is not None
    else:  # chat_template_kwargs reached the template, which closed it: all answer
        assert expected == (None, text or None)
    message = client.chat.completions.create(model="tiny", messages=CHAT, extra_body=extra, **GREEDY)
    message = message.choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == expected
    assert streamed(client, extra_body=extra, **GREEDY) == expected
    if thinking:  # include_reasoning=false (vLLM's): the same answer, without its thinking
        dropped = {**extra, "include_reasoning": False}
        message = client.chat.completions.create(model="tiny", messages=CHAT, extra_body=dropped, **GREEDY)
        message = message.choices[0].message
        assert (getattr(message, "reasoning_content", None), message.content) == (None, expected[1])
        assert streamed(client, extra_body=dropped, **GREEDY) == (None, expected[1])
        # The Responses API's include_reasoning (vLLM's too): no reasoning item, its tokens still counted.
        kept, left_out = (
            client.responses.create(
                model="tiny",
                input=CHAT,
                temperature=0.0,
                max_output_tokens=GREEDY["max_tokens"],
                store=False,
                extra_body={"include_reasoning": include},
            )
            for include in (True, False)
        )
        assert [item.type for item in kept.output][0] == "reasoning"
        assert kept.output[0].content[0].text == expected[0]
        assert "reasoning" not in [item.type for item in left_out.output]
        assert left_out.output_text == kept.output_text == (expected[1] or "")
        reasoning_tokens = kept.usage.output_tokens_details.reasoning_tokens
        assert left_out.usage.output_tokens_details.reasoning_tokens == reasoning_tokens > 0


def test_the_models_generation_config_is_every_requests_default(thinking_server, client):
    """What a request leaves out samples as the model's generation_config.json says (vLLM's
    --generation-config auto), on the chat and completions routes: as a request naming those values
    (the same seeded tokens, max_new_tokens as max_tokens), not as the engine's own defaults would."""
    with open(thinking_server.log_path, errors="replace") as f:
        assert "requests' default sampling is {'temperature': 0.6, 'top_p': 0.95" in f.read()
    seeded = {"seed": 5, "logprobs": True}
    named = {"temperature": 0.6, "top_p": 0.95, "max_tokens": 9}
    engine_own = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 9}
    answers = [
        client.chat.completions.create(
            model="tiny", messages=CHAT, **seeded, **fields, extra_body={"ignore_eos": True, **top_k}
        )
        for fields, top_k in (({}, {}), (named, {"top_k": 20}), (engine_own, {"top_k": 0}))
    ]
    left_out, given, own = [(a.choices[0].logprobs.content, a.usage.completion_tokens) for a in answers]
    assert left_out == given and left_out[1] == 9
    assert [t.token for t in own[0]] != [t.token for t in left_out[0]]
    texts = [
        client.completions.create(model="tiny", prompt="Is 17 prime?", seed=5, **fields, extra_body=extra)
        for fields, extra in (({}, {"ignore_eos": True}), (named, {"ignore_eos": True, "top_k": 20}))
    ]
    assert texts[0].choices[0].text == texts[1].choices[0].text and texts[0].usage.completion_tokens == 9


def test_structured_output_starts_after_the_thinking(client):
    """A regex under thinking: the reasoning is the model's free text (the grammar waits for
    </think>); with the thinking closed in the prompt, the answer follows the regex at once."""
    regex = {"structured_outputs": {"regex": "[0-9]{3} is the answer"}}
    free = client.chat.completions.create(model="tiny", messages=CHAT, **GREEDY).choices[0].message
    gated = client.chat.completions.create(model="tiny", messages=CHAT, extra_body=regex, **GREEDY)
    gated = gated.choices[0].message
    assert gated.reasoning_content == free.reasoning_content and gated.reasoning_content
    if free.content is not None:  # the random model ended its thinking: then the grammar held (cut short)
        content = gated.content or ""
        assert re.fullmatch("[0-9]{0,3}", content) or " is the answer".startswith(content[3:]), content
    direct = client.chat.completions.create(
        model="tiny", messages=CHAT, extra_body={**regex, **THINKING[False]}, temperature=0.0, max_tokens=20
    )
    assert re.fullmatch("[0-9]{3} is the answer", direct.choices[0].message.content)
    assert direct.choices[0].finish_reason == "stop"


def test_auto_tool_choice_is_on_by_default_for_the_family(thinking_server, client):
    """This server runs without --enable-auto-tool-choice: a Qwen3's calls are hermes', so auto tool choice
    is on by default with that parser, and says so at start. tool_choice "auto", or tools without a
    tool_choice (as pydantic-ai, litellm and the Agents SDK send them), are answered, not a 400."""
    with open(thinking_server.log_path, errors="replace") as f:
        assert "auto tool choice on, parser hermes (by default" in f.read()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for choice in ({"tool_choice": "auto"}, {}):
        answer = client.chat.completions.create(model="tiny", messages=CHAT, tools=[tool], **choice, **GREEDY)
        assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
    prompt = httpx.post(thinking_server.url + "/tokenize", json={"messages": CHAT, "tools": [tool]}).json()
    text = httpx.post(thinking_server.url + "/detokenize", json={"tokens": prompt["tokens"]}).json()["prompt"]
    assert "<tools>" in text and '"name": "f"' in text
    # --enable-tokenizer-info-endpoint is off here: the route does not exist
    assert httpx.get(thinking_server.url + "/tokenizer_info").status_code == 404


def test_anthropic_messages_give_a_thinking_block(thinking_server):
    """/v1/messages on the same server: the thinking is a thinking block before the text, streamed as
    thinking_delta events, and the anthropic client's stream helper gives the same message."""
    import anthropic  # only this test speaks Anthropic's API

    ids, text = raw_output(thinking_server, {})
    tokenizer = load_tokenizer(thinking_server.model_dir)
    reasoning, content = get_reasoning_parser("qwen3")(tokenizer, prompt_token_ids=ids).extract_reasoning(
        text
    )
    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="none", max_retries=0, timeout=300)
    fields = {
        "model": "tiny",
        "messages": CHAT,
        "max_tokens": GREEDY["max_tokens"],
        "extra_body": {"temperature": 0},
    }
    message = client.messages.create(**fields)
    expected = [{"type": "thinking", "thinking": reasoning, "signature": ""}]
    expected += [{"type": "text", "text": content}] if content else []
    assert [block.model_dump(exclude_none=True) for block in message.content] == expected
    assert anthropic_prompt_tokens(message.usage) == len(ids) and message.stop_reason in (
        "max_tokens",
        "end_turn",
    )
    with client.messages.stream(**fields) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    # Not the cache's hit: the stream finds the blocks the message left.
    uncompared = {
        "id": True,
        "usage": {"input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"},
    }
    assert streamed.model_dump(exclude=uncompared) == message.model_dump(exclude=uncompared)
    assert events[:4] == ["message_start", "content_block_start", "content_block_delta", "thinking"]
    # Anthropic's thinking switch reaches the template as enable_thinking: the answer has no thinking,
    # and is the chat route's answer to the same request (asked next, so both find the prompt cached:
    # this random model's near-ties can flip with the prefill's chunking).
    ids = raw_output(thinking_server, THINKING[False])[0]
    closed = client.messages.create(**fields, thinking={"type": "disabled"})
    chat = httpx.post(
        thinking_server.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": CHAT, **GREEDY, **THINKING[False]},
        timeout=300,
    ).json()["choices"][0]["message"]
    assert chat.get("reasoning_content") is None
    answer = [{"type": "text", "text": chat["content"]}] if chat["content"] else []
    assert [block.model_dump(exclude_none=True) for block in closed.content] == answer
    assert anthropic_prompt_tokens(closed.usage) == len(ids)


def test_chat_template_kwargs_reach_the_responses_and_anthropic_templates(thinking_server, client):
    """vLLM's chat_template_kwargs on the Responses API and on Anthropic's messages (and count_tokens),
    as on the chat route: {"enable_thinking": false} closes the thinking in the prompt, and the reasoning
    parser, told so too, gives the whole answer as text: the chat route's answer. Anthropic's own
    `thinking` field sets enable_thinking over them."""
    url = thinking_server.url
    opened = raw_output(thinking_server, {})[0]
    closed = raw_output(thinking_server, THINKING[False])[0]  # asked first: every route finds it cached
    assert len(closed) > len(opened)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, extra_body=THINKING[False], **GREEDY)
    content = chat.choices[0].message.content
    assert getattr(chat.choices[0].message, "reasoning_content", None) is None
    answer = client.responses.create(
        model="tiny",
        input=CHAT,
        temperature=0.0,
        max_output_tokens=GREEDY["max_tokens"],
        store=False,
        extra_body=THINKING[False],
    )
    assert "reasoning" not in [item.type for item in answer.output]
    assert answer.output_text == (content or "") and answer.usage.input_tokens == len(closed)
    assert answer.usage.output_tokens_details.reasoning_tokens == 0
    body = {"model": "tiny", "messages": CHAT, "max_tokens": GREEDY["max_tokens"], "temperature": 0}
    message = httpx.post(url + "/v1/messages", json={**body, **THINKING[False]}, timeout=300).json()
    assert message["content"] == ([{"type": "text", "text": content}] if content else [])
    assert anthropic_prompt_tokens(message["usage"]) == len(closed)
    count = {"model": "tiny", "messages": CHAT, **THINKING[False]}
    assert httpx.post(url + "/v1/messages/count_tokens", json=count).json()["input_tokens"] == len(closed)
    thinking = {**count, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert httpx.post(url + "/v1/messages/count_tokens", json=thinking).json()["input_tokens"] == len(opened)

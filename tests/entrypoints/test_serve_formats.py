"""Serve paths on a family's own chat format, end to end: `xlaserve serve` with a scripted tiny Llama
(tests/helpers/scripted_model.py: its greedy answer is a fixed text, so a parser meets exactly what
the family's model writes), driven by the official openai client.

- Llama 3.1's format through `--tool-call-parser llama3_json`, with n-gram speculation (the answer is
  in the prompt, so drafts come and are accepted: the metrics say so, the text is the script's) and
  `--scheduling-policy priority` (a request's `priority` reaches the scheduler: the urgent one of two
  queued requests runs first).
- Mistral's format through `--tool-call-parser mistral` (two calls after [TOOL_CALLS]), on
  `--data-parallel-size 2` (two fake CPU devices: two requests run at once, one per rank).
- DeepSeek-R1's format through `--reasoning-parser deepseek_r1` (the template opens the thinking).
- gpt-oss's harmony format through `--reasoning-parser openai_gptoss --tool-call-parser openai`: its
  markers are special tokens, kept in the text the parsers read (the script is one call message: a
  script's token occurs once, and harmony repeats its markers from message to message).
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time

import httpx
import openai
import pytest

from helpers.scripted_model import save_scripted_llama
from helpers.server_harness import ServerProcess
from helpers.tiny_models import TINY_PROCESS_XLA_FLAGS

pytestmark = pytest.mark.slow  # three servers of their own (tiny models)

# Small shapes, no warm-up: only the programs the requests below run are compiled.
SERVER_FLAGS = [
    "--enforce-eager", "--served-model-name", "tiny", "--dtype", "bfloat16",
    "--max-model-len", "512", "--max-num-batched-tokens", "64", "--kv-cache-memory", str(2**22),
]  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython\nYou may call these functions: {{ tools | tojson }}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA3_ANSWER = ["<|python_tag|>", '{"name": "get_weather", ', '"parameters": ', '{"city": "Paris"}}']
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% if loop.last and tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ m['content'] }}[/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
MISTRAL_ANSWER = [
    "[TOOL_CALLS]",
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, ',
    '{"name": "get_time", "arguments": {"zone": "CET"}}]',
]
R1_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY_ANSWER = [
    "<|channel|>",
    "commentary to=functions.get_weather ",
    "<|constrain|>",
    "json",
    "<|message|>",
    '{"city": "Paris"}',
]  # then EOS: <|call|> is a stop token, not in the text
HARMONY_SPECIAL = ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|constrain|>", "<|call|>"]
LONG_TOKENS = 4000  # the priority test's running request: cancelled once the others queue
R1_ANSWER = ["Seventeen has no divisor", " but one and itself.", "</think>", "Yes, 17 is prime."]


def _start(tmp_path_factory, cache_dir, name, model, flags, device_count=1) -> ServerProcess:
    xla_flags = f"--xla_force_host_platform_device_count={device_count} {TINY_PROCESS_XLA_FLAGS}"
    proc = ServerProcess(
        str(tmp_path_factory.mktemp(f"{name}-logs")),
        cache_dir,
        extra_args=SERVER_FLAGS + flags,
        model=model,
        env={"XLA_FLAGS": xla_flags},  # a tiny model: compile fast (helpers/tiny_models.py)
    )
    proc.wait_ready()
    return proc


@pytest.fixture(scope="module")
def llama3_server(tmp_path_factory, server_cache_dir):
    model = save_scripted_llama(
        str(tmp_path_factory.mktemp("llama3")),
        chat_template=LLAMA3_TEMPLATE,
        answer=LLAMA3_ANSWER,
        special_tokens=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"],
        bos_token="<|begin_of_text|>",
    )
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    flags = [
        "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice", "--scheduling-policy", "priority",
        "--speculative-config", json.dumps(spec), "--max-num-seqs", "1",
        "--max-model-len", str(LONG_TOKENS + 64),
    ]  # fmt: skip
    proc = _start(tmp_path_factory, server_cache_dir, "llama3", model, flags)
    yield proc
    assert proc.stop() == 0, proc.log_tail()


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory, server_cache_dir):
    model = save_scripted_llama(
        str(tmp_path_factory.mktemp("mistral")),
        chat_template=MISTRAL_TEMPLATE,
        answer=MISTRAL_ANSWER,
        special_tokens=[
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]",
            "</s>",
        ],
        bos_token="<s>",
    )
    flags = [
        "--tool-call-parser",
        "mistral",
        "--enable-auto-tool-choice",
        "--data-parallel-size",
        "2",
        "--max-num-seqs",
        "1",
    ]
    proc = _start(tmp_path_factory, server_cache_dir, "mistral", model, flags, device_count=2)
    yield proc
    assert proc.stop() == 0, proc.log_tail()


@pytest.fixture(scope="module")
def r1_server(tmp_path_factory, server_cache_dir):
    model = save_scripted_llama(
        str(tmp_path_factory.mktemp("r1")),
        chat_template=R1_TEMPLATE,
        answer=R1_ANSWER,
        special_tokens=["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
        added_tokens=["<think>"],  # as DeepSeek's vocabulary has it: a token that decodes as text
        bos_token="<｜begin▁of▁sentence｜>",
    )
    proc = _start(tmp_path_factory, server_cache_dir, "r1", model, ["--reasoning-parser", "deepseek_r1"])
    yield proc
    assert proc.stop() == 0, proc.log_tail()


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory, server_cache_dir):
    model = save_scripted_llama(
        str(tmp_path_factory.mktemp("harmony")),
        chat_template=HARMONY_TEMPLATE,
        answer=HARMONY_ANSWER,
        special_tokens=HARMONY_SPECIAL,
    )
    flags = [
        "--reasoning-parser",
        "openai_gptoss",
        "--tool-call-parser",
        "openai",
        "--enable-auto-tool-choice",
    ]
    proc = _start(tmp_path_factory, server_cache_dir, "harmony", model, flags)
    yield proc
    assert proc.stop() == 0, proc.log_tail()


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def metric(server, name: str, before_first: float | None = None) -> float:
    """xlaserve:`name` (vLLM's names, the project's prefix) summed over its series; `before_first`: its
    value while it has no series yet (the speculative counters appear with the first verification)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = re.findall(rf"^xlaserve:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    if not values and before_first is not None:
        return before_first
    assert values, f"xlaserve:{name} is not in /metrics"
    return sum(float(v) for v in values)


def streamed_calls(client, **kwargs) -> tuple[list[tuple[str, str, str]], str | None, str]:
    """(id, name, arguments) of each streamed call, the streamed content and the finish reason."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", "", ""])
                entry[0] += call.id or ""
                entry[1] += (call.function and call.function.name) or ""
                entry[2] += (call.function and call.function.arguments) or ""
            finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], content or None, finish


# -- Llama 3.1: llama3_json tool calls, speculation, priority -----------------------------------------


def test_llama3_json_tool_call_streamed_and_not(llama3_server):
    client = client_of(llama3_server)
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER],
        "temperature": 0.0,
        "max_tokens": 16,
    }
    answer = client.chat.completions.create(**kwargs).choices[0]
    assert answer.finish_reason == "tool_calls"
    assert answer.message.content is None
    [call] = answer.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    [(call_id, name, arguments)], content, finish = streamed_calls(client, **kwargs)
    assert (name, json.loads(arguments), content, finish) == (
        "get_weather",
        {"city": "Paris"},
        None,
        "tool_calls",
    )
    assert re.fullmatch("call_[0-9a-f]{24}", call_id)


def test_llama3_ngram_speculation_through_serve(llama3_server):
    """The user's message holds the answer's text, so after its first piece the n-gram proposer drafts
    the rest from the prompt: drafts are proposed and accepted, and the text is the script's."""
    script = "".join(LLAMA3_ANSWER[1:])  # without the special tag, which the text skips
    drafts, accepted = (
        metric(llama3_server, "spec_decode_num_draft_tokens_total", before_first=0),
        metric(llama3_server, "spec_decode_num_accepted_tokens_total", before_first=0),
    )
    answer = client_of(llama3_server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"Repeat: {''.join(LLAMA3_ANSWER)}"}],
        temperature=0.0,
        max_tokens=16,
    )  # no tools: the answer is text
    assert answer.choices[0].message.content == script
    assert answer.usage.completion_tokens == len(LLAMA3_ANSWER) + 1  # the pieces and EOS
    assert metric(llama3_server, "spec_decode_num_draft_tokens_total") > drafts
    assert metric(llama3_server, "spec_decode_num_accepted_tokens_total") >= accepted + 2


def test_priority_through_the_api(llama3_server):
    """One sequence at a time: while a long request runs, a request of priority 5 and then one of
    priority -5 queue; when the long one is cancelled, the urgent one (lower value, as in vLLM) runs
    first, though it came second."""
    client = client_of(llama3_server)
    finished: list[str] = []
    started, cancel = threading.Event(), threading.Event()

    def run(name: str, priority: int, max_tokens: int) -> None:
        stream = client.completions.create(
            model="tiny", prompt=f"request {name}", temperature=0.0, max_tokens=max_tokens, stream=True,
            extra_body={"priority": priority, "ignore_eos": True},
        )  # fmt: skip
        for _ in stream:
            started.set()
            if cancel.is_set():  # the client goes away: the server aborts the request
                stream.close()
                break
        finished.append(name)

    def wait_for(name: str, value: float) -> None:
        deadline = time.monotonic() + 120
        while metric(llama3_server, name) != value:
            assert time.monotonic() < deadline, f"xlaserve:{name} never reached {value}"
            time.sleep(0.05)

    # Long enough to outlast the queueing below on a loaded machine (n-gram drafts speed it up).
    threads = [threading.Thread(target=run, args=("long", 0, LONG_TOKENS))]
    threads[0].start()
    assert started.wait(120)
    wait_for("num_requests_running", 1)
    # 32 tokens each: the order is read as the client threads finish, and a thread woken late on a
    # loaded machine must not let a 4-token request run and finish before it notices (seen once).
    for args, num_waiting in ((("later", 5, 32), 1), (("urgent", -5, 32), 2)):
        threads.append(threading.Thread(target=run, args=args))
        threads[-1].start()
        wait_for("num_requests_waiting", num_waiting)
    assert finished == []  # the long request still runs: both others queued behind it
    cancel.set()
    for thread in threads:
        thread.join(300)
    assert finished == ["long", "urgent", "later"]


# -- Mistral: mistral tool calls, data parallelism -----------------------------------------------------


def test_mistral_tool_calls_streamed_and_not(mistral_server):
    client = client_of(mistral_server)
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": "auto",
        "temperature": 0.0,
        "max_tokens": 16,
    }
    answer = client.chat.completions.create(**kwargs).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    # Mistral's call ids are 9 letters and digits (its template refuses others)
    assert all(re.fullmatch("[a-zA-Z0-9]{9}", c.id) for c in answer.message.tool_calls)
    streamed, content, finish = streamed_calls(client, **kwargs)
    assert [(name, json.loads(args)) for _, name, args in streamed] == calls
    assert (content, finish) == (None, "tool_calls")


def test_data_parallel_through_serve(mistral_server):
    """Two ranks of one sequence each: two long requests run at the same time (one rank would hold one
    and queue the other), and both answer in full. The gauges are read until they show both running
    and none waiting (a scrape may come a step before the server's stats say so, or after a tiny
    model's requests ended: they are read while the requests stream)."""
    client = client_of(mistral_server)
    first_tokens = threading.Barrier(3, timeout=120)
    texts: list[str] = []

    def run(i: int) -> None:
        stream = client.completions.create(
            model="tiny", prompt=f"request {i}", temperature=0.0, max_tokens=256, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        pieces = []
        for n, chunk in enumerate(stream):
            pieces.append(chunk.choices[0].text)
            if n == 0:
                first_tokens.wait()
        texts.append("".join(pieces))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    first_tokens.wait()  # both requests have streamed a token: both are running
    seen = []
    while any(t.is_alive() for t in threads) and (2, 0) not in seen:
        seen.append(
            (metric(mistral_server, "num_requests_running"), metric(mistral_server, "num_requests_waiting"))
        )
    assert (2, 0) in seen, seen
    for thread in threads:
        thread.join(300)
    assert len(texts) == 2


# -- DeepSeek-R1: deepseek_r1 reasoning --------------------------------------------------------------------


def test_deepseek_r1_reasoning_streamed_and_not(r1_server):
    client = client_of(r1_server)
    kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "Is 17 prime?"}], "temperature": 0.0}
    expected = ("".join(R1_ANSWER[:2]), R1_ANSWER[3])
    message = client.chat.completions.create(max_tokens=16, **kwargs).choices[0].message
    assert (getattr(message, "reasoning_content", None), message.content) == expected
    reasoning = content = ""
    for chunk in client.chat.completions.create(max_tokens=16, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == expected
    # Cut inside the thinking (DeepSeek-R1's template opened it): all of it is reasoning, no answer.
    cut = client.chat.completions.create(max_tokens=1, **kwargs).choices[0]
    assert (cut.message.reasoning_content, cut.message.content, cut.finish_reason) == (
        R1_ANSWER[0],
        None,
        "length",
    )


# -- gpt-oss: harmony (openai_gptoss reasoning, openai tool calls) ----------------------------------------


def test_harmony_tool_call_streamed_and_not(harmony_server):
    client = client_of(harmony_server)
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "temperature": 0.0,
        "max_tokens": 16,
    }
    answer = client.chat.completions.create(**kwargs).choices[0]
    assert answer.finish_reason == "tool_calls"
    assert (answer.message.content, getattr(answer.message, "reasoning_content", None)) == (None, None)
    [call] = answer.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    [(_, name, arguments)], content, finish = streamed_calls(client, **kwargs)
    assert (name, json.loads(arguments), content, finish) == (
        "get_weather",
        {"city": "Paris"},
        None,
        "tool_calls",
    )
    # Without tools the same text is the call's markup, special tokens and all, as content.
    no_tools = {k: v for k, v in kwargs.items() if k != "tools"}
    plain = client.chat.completions.create(**no_tools).choices[0].message.content
    assert plain == "".join(HARMONY_ANSWER)
    # A response_format's grammar waits for the final channel's `<|message|>`: this answer never opens
    # it, so the grammar never starts and the text is the same (from the first token, a JSON grammar
    # would have masked `<|channel|>` away).
    formatted = client.chat.completions.create(**no_tools, response_format={"type": "json_object"})
    assert formatted.choices[0].message.content == plain


def test_harmony_grammar_starts_after_the_final_channel_header(tmp_path):
    """Offline, a script that opens the final channel with `<|constrain|>json` in its header: the header
    is free, the body follows the schema (the script would write "hello there"), and the request ends
    with the grammar. The reasoning end comes from the openai_gptoss parser, as the server sets it."""
    from xlaserve import LLM, SamplingParams, StructuredOutputsParams
    from xlaserve.entrypoints.serving.reasoning.harmony import GptOssReasoningParser

    header = ["<|channel|>", "final", "<|constrain|>", "json", "<|message|>"]
    model = save_scripted_llama(
        str(tmp_path / "final"),
        chat_template=HARMONY_TEMPLATE,
        answer=[*header, "hello there"],
        special_tokens=HARMONY_SPECIAL,
    )
    llm = LLM(model, dtype="float32", max_model_len=128, kv_cache_memory=2**22, enforce_eager=True)
    parser = GptOssReasoningParser(llm.tokenizer)
    schema = {"type": "string", "enum": ["yes", "no"]}
    spec = StructuredOutputsParams(
        json=schema,
        reasoning_end_token_id=parser.end_token_id,
        reasoning_end_prefix_ids=parser.end_prefix_ids,
    )
    messages = [{"role": "user", "content": "Is 17 prime?"}]
    free = SamplingParams(temperature=0.0, max_tokens=12, skip_special_tokens=False)
    assert llm.chat(messages, free, use_tqdm=False)[0].outputs[0].text == "".join(header) + "hello there"
    out = llm.chat(messages, dataclasses.replace(free, structured_outputs=spec), use_tqdm=False)
    text = out[0].outputs[0].text
    assert text.startswith("".join(header)) and json.loads(text[len("".join(header)) :]) in ("yes", "no")
    assert out[0].outputs[0].finish_reason == "stop"

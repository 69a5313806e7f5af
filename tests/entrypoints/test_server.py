"""`xlaserve serve` end to end, through the official `openai` client: results, streams, concurrency,
disconnects, metrics and cache isolation. The server runs once per session (see server_harness.py)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from helpers.server_harness import MODEL_NAME, metric, metrics, wait_for_metrics
from helpers.smollm2 import ENGINE_ARGS
from xlaserve import SamplingParams


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


def test_models_version_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/version").json()["version"]


def test_chat_completion(client):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_completion_tokens=12,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 5 and 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_token_id_past_the_vocabulary_is_a_400_and_the_server_goes_on(client, server):
    # This request once raised IndexError inside the step (the min_tokens ban indexes [R, vocab]
    # with the stop id), the engine core exited, and every later request failed.
    body = {
        "model": MODEL_NAME,
        "prompt": "Hello",
        "max_tokens": 4,
        "min_tokens": 1,
        "stop_token_ids": [49152],
    }
    response = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop_token_ids" and "49152" in error["message"]
    response = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length") and response.usage.completion_tokens >= 1


def test_completion_usage_and_n(client, server):
    prompt = "The three primary colors are"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=server.headers).json()[
        "tokens"
    ]
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=8,
        n=2,
        temperature=0.8,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == 16
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=server.headers).json()[
        "prompt"
    ]
    assert text == prompt


def test_streaming_matches_non_streaming(client):
    kwargs = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Name two planets."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    stream = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in stream)
    assert (
        streamed
        == client.completions.create(
            model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=0
        )
        .choices[0]
        .text
    )


def test_greedy_equals_offline_llm(client, llm):
    messages = [{"role": "user", "content": "Explain paged attention in one sentence."}]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    offline = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    online = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0)
    assert online.choices[0].message.content == offline.text
    assert online.usage.completion_tokens == len(offline.token_ids)

    prompt = "The capital of France is"
    offline = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    online = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
    assert online.choices[0].text == offline.text


def test_logprobs_and_echo(client):
    response = client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    choice = response.choices[0]
    assert choice.text.startswith("Hello there")
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(
        len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content
    )


def test_echo_with_max_tokens_0_answers_the_prompt_alone(client):
    """echo with max_tokens 0 (vLLM's, as lm-eval's loglikelihood sends it): the prompt alone, with its
    tokens' logprobs, no completion token in the text or the usage; without echo, 0 stays a 400."""
    prompt = "The capital of France is"
    ask = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, "echo": True, "logprobs": 1}
    alone = client.completions.create(**ask, max_tokens=0)
    one = client.completions.create(**ask, max_tokens=1)
    (choice,) = alone.choices
    assert choice.text == prompt and alone.usage.completion_tokens == 0
    num_prompt = alone.usage.prompt_tokens
    assert choice.logprobs.tokens == one.choices[0].logprobs.tokens[:num_prompt]
    assert choice.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs[:num_prompt]
    streamed = list(client.completions.create(**ask, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"


def test_streamed_logprobs_text_offsets_run_on(client):
    """A streamed choice's text_offset counts from the start of its text, not of each chunk (vLLM's), so
    it is the non-streamed answer's and each offset points at its token in the joined text."""
    ask = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 4, "seed": 7, "n": 2}
    whole = client.completions.create(**ask, echo=True, logprobs=0)
    texts, offsets, tokens = {}, {}, {}
    for chunk in client.completions.create(**ask, echo=True, logprobs=0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
    for c in whole.choices:
        assert texts[c.index] == c.text and offsets[c.index] == c.logprobs.text_offset
        assert all(c.text[o : o + len(t)] == t for o, t in zip(offsets[c.index], tokens[c.index]))
    assert offsets[0][-1] > len("Hello there")


def test_chat_echo_puts_the_continued_message_first(client):
    """Chat's echo (vLLM's): where the answer goes on with the last message (its role is the answer's,
    continue_final_message), that message's text comes first, streamed or not; a user's last message is
    not echoed. With continuous usage stats every chunk, the role's and the echo's too, has a usage."""
    start = "The capital of France is"
    ask = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0}
    messages = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": start}]
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**ask, messages=messages, extra_body=go_on)
    echoed = client.chat.completions.create(**ask, messages=messages, extra_body={**go_on, "echo": True})
    assert echoed.choices[0].message.content == start + plain.choices[0].message.content
    usage_always = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(
            **ask,
            messages=messages,
            extra_body={**go_on, "echo": True},
            stream=True,
            stream_options=usage_always,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == echoed.choices[0].message.content
    assert all(c.usage is not None for c in chunks)
    user_last = client.chat.completions.create(
        **ask, messages=[{"role": "user", "content": start}], extra_body={"echo": True}
    )
    assert not user_last.choices[0].message.content.startswith(start)


def test_continuous_usage_is_each_choices_own(client):
    """With continuous_usage_stats a chunk's usage is its choice's: its prompt's tokens and its own so far
    (vLLM's), streamed completions of two prompts and a chat alike; the closing usage is the request's."""
    usage_always = {"include_usage": True, "continuous_usage_stats": True}
    ask = {"model": MODEL_NAME, "max_tokens": 3, "n": 2, "stream": True, "stream_options": usage_always}
    extra = {"ignore_eos": True, "return_token_ids": True}
    streams = [
        (client.completions.create(**ask, prompt=[[1, 2, 3], [4]], extra_body=extra), [3, 3, 1, 1]),
        (
            client.chat.completions.create(
                **ask, messages=[{"role": "user", "content": "Hi"}], extra_body=extra
            ),
            None,
        ),
    ]
    for stream, prompt_lengths in streams:
        chunks = list(stream)
        counted: dict[int, int] = {}
        for chunk in chunks[:-1]:
            (choice,) = chunk.choices
            counted[choice.index] = counted.get(choice.index, 0) + len(
                getattr(choice, "token_ids", None) or []
            )
            assert chunk.usage.completion_tokens == counted[choice.index]
            if prompt_lengths is not None:
                assert chunk.usage.prompt_tokens == prompt_lengths[choice.index]
        assert chunks[-1].usage.completion_tokens == sum(counted.values()) == 3 * len(counted)


def test_stop_strings_and_token_prompts(client, server):
    response = client.completions.create(
        model=MODEL_NAME, prompt="1, 2, 3, 4, 5,", max_tokens=20, temperature=0, stop=[" 8"]
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and " 8" not in choice.text
    ids = httpx.post(
        server.url + "/tokenize", json={"prompt": "The quick brown fox"}, headers=server.headers
    ).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(
        model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(
        model=MODEL_NAME, prompt=["The quick brown fox", "Les chats sont"], max_tokens=4, temperature=0
    )
    assert sorted(c.index for c in batch.choices) == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text[: len(batch.choices[0].text)]


def test_cache_salt_isolates_prefix_cache(client):
    prompt = "You are a careful assistant. Answer in one short sentence. " * 6 + "What is 2 + 2?"

    def cached(salt: str) -> int:
        response = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": salt}
        )
        details = response.usage.prompt_tokens_details
        # vLLM's created_cache_tokens: the prompt's whole blocks the prefix cache did not serve.
        block = ENGINE_ARGS.get("block_size", 16)
        whole_blocks = response.usage.prompt_tokens // block * block
        assert details.created_cache_tokens == whole_blocks - details.cached_tokens
        return details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same prompt, other tenant: no shared blocks
    assert cached("tenant-a") >= 64  # the first tenant's own prefix is reused


def test_streamed_usage_sums_every_prompts_cache_hit_as_the_one_shot(client):
    prompt = "Summarize the rules of chess for a child who has never played before. " * 4
    fields = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0, "extra_body": {"cache_salt": "sum"}}
    single = client.completions.create(prompt=prompt, **fields).usage  # computes the blocks
    one_shot = client.completions.create(prompt=[prompt, prompt], **fields).usage
    chunks = client.completions.create(
        prompt=[prompt, prompt], stream=True, stream_options={"include_usage": True}, **fields
    )
    streamed = [c.usage for c in chunks if c.usage is not None][-1]
    hit = one_shot.prompt_tokens_details.cached_tokens
    block = ENGINE_ARGS.get("block_size", 16)
    assert hit == 2 * ((single.prompt_tokens - 1) // block * block) > 0  # each prompt's whole blocks
    assert streamed.prompt_tokens_details == one_shot.prompt_tokens_details
    assert streamed.prompt_tokens == one_shot.prompt_tokens == 2 * single.prompt_tokens


@pytest.mark.slow
def test_32_concurrent_streams_match_non_streaming(async_client):
    topics = ["volcanoes", "chess", "bees", "compilers", "rainbows", "tea", "marathons", "the moon"]
    conversations = [
        [{"role": "user", "content": f"Give me fact number {i % 4 + 1} about {topics[i % 8]}."}]
        for i in range(32)
    ]

    async def stream(messages) -> tuple[str, str, int]:
        chunks = await async_client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = [], None, None
        async for chunk in chunks:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return "".join(text), finish, usage

    async def full(client, messages) -> tuple[str, str, int]:
        r = await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0
        )
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    async def run():
        streamed = await asyncio.gather(*(stream(m) for m in conversations))
        # A second client, on new connections: reusing the 32 streams' idle keep-alive connections
        # raced uvicorn's 5 s keep-alive timeout on a loaded machine (the client sent on a connection
        # the server was closing: ReadError, with retries off).
        fresh = openai.AsyncOpenAI(
            base_url=async_client.base_url, api_key=async_client.api_key, max_retries=0
        )
        complete = await asyncio.gather(*(full(fresh, m) for m in conversations))
        return streamed, complete

    streamed, complete = asyncio.run(run())
    assert len(streamed) == 32 and all(s[0] for s in streamed)
    for i, (s, c) in enumerate(zip(streamed, complete)):
        assert s == c, f"conversation {i}: stream {s!r} != non-stream {c!r}"


def test_client_disconnect_frees_blocks(client, server):
    before = metrics(server)
    expected = (
        client.completions.create(
            model=MODEL_NAME, prompt="In 1969, Neil Armstrong", max_tokens=24, temperature=0
        )
        .choices[0]
        .text
    )
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time, in a land far away,",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(3), stream):
        pass
    busy = wait_for_metrics(server, lambda m: metric(m, "num_requests_running") == 1, "the stream running")
    assert metric(busy, "kv_cache_usage_perc") > 0

    async def other_and_disconnect():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=server.api_key, max_retries=0
        ) as c:
            other = asyncio.create_task(
                c.completions.create(
                    model=MODEL_NAME, prompt="In 1969, Neil Armstrong", max_tokens=24, temperature=0
                )
            )
            await asyncio.sleep(0.2)
            stream.close()  # the client goes away mid-stream
            return (await other).choices[0].text

    assert asyncio.run(other_and_disconnect()) == expected  # the other request is unaffected
    after = wait_for_metrics(
        server,
        lambda m: (
            metric(m, "num_requests_running") == 0
            and metric(m, "kv_cache_usage_perc") == 0
            and metric(m, "request_success_total", finished_reason="abort")
            == metric(before, "request_success_total", finished_reason="abort") + 1
        ),
        "the aborted stream's blocks freed",
    )
    generated = metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total")
    assert generated < 24 + 24 + 400, "the disconnected stream ran to completion"


def test_metrics_names(server):
    samples = metrics(server)
    names = {name for name, _ in samples}
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_sum",
        "request_time_per_output_token_seconds_count",
        "request_queue_time_seconds_count",
        "request_prefill_time_seconds_sum",
        "request_decode_time_seconds_bucket",
        "request_inference_time_seconds_count",
        "request_prompt_tokens_bucket",
        "request_generation_tokens_sum",
        "iteration_tokens_total_count",
        "request_params_n_count",
        "request_params_max_tokens_sum",
        "request_max_num_generation_tokens_bucket",
        "cache_config_info",
    ):
        assert "xlaserve:" + name in names, name
    # What the engine holds: SmolLM2's ~135M weights, and the KV blocks of its budget.
    assert 1e8 < metric(samples, "model_weight_bytes") < 1e9
    assert metric(samples, "num_kv_blocks") >= 2
    (info,) = [dict(labels) for name, labels in samples if name == "xlaserve:cache_config_info"]
    assert info["num_gpu_blocks"] == str(int(metric(samples, "num_kv_blocks"))) and info["block_size"] == "16"
    assert metric(samples, "generation_tokens_total") > 0
    assert metric(samples, "request_success_total", finished_reason="length") > 0


def test_overload_and_disconnect_soak_leaves_nothing_behind(server):
    """48 streams at once, every other one dropped by its client after its first chunk: every stream
    ends (nothing hangs), the kept ones run to their length, and afterwards no request runs or waits
    and no KV block is held."""
    before = metrics(server)
    body = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}

    async def one(client: httpx.AsyncClient, i: int) -> int | None:
        request = {**body, "prompt": f"Soak request {i}: list some numbers."}
        async with client.stream("POST", server.url + "/v1/completions", json=request) as response:
            assert response.status_code == 200, await response.aread()
            chunks = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if i % 2:
                        return None  # the client goes away mid-stream
            return chunks

    async def soak():
        headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=300, headers=headers, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(48))), 600)

    results = asyncio.run(soak())
    kept = [r for r in results if r is not None]
    assert len(kept) == 24 and all(chunks >= 1 for chunks in kept)
    after = wait_for_metrics(
        server,
        _is_idle,
        "every request gone and every block free after the soak",
    )
    finished = metric(after, "request_success_total", finished_reason="length") - metric(
        before, "request_success_total", finished_reason="length"
    )
    aborted = metric(after, "request_success_total", finished_reason="abort") - metric(
        before, "request_success_total", finished_reason="abort"
    )
    # The kept streams ran to max_tokens; a dropped one was aborted, or had just finished.
    assert finished >= 24 and finished + aborted == 48


_STORY = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "ignore_eos": True, "temperature": 0}
_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "List numbers."}], "temperature": 0}
# A grammar no answer of max_tokens 300 completes (one digit a token): the request cannot end first.
_DIGITS = {"regex": "[0-9]{400}"}
# n > 1 samples (greedy children are refused, as vLLM's).
_SAMPLED = {"temperature": 0.8, "seed": 7}
# What test_client_disconnect_frees_blocks and the soak leave out: (case, path, bodies sent at once, whether
# /metrics, against /metrics before, shows them all under way). Each max_tokens is far more than it gets to
# make. A beam search's step requests (one token each) finish within their step: its first steps have ended.
_DROPPED = [
    ("n=3 stream", "/v1/completions", [{**_STORY, **_SAMPLED, "n": 3, "max_tokens": 300, "stream": True}],
        lambda m, _: metric(m, "num_requests_running") == 3),
    ("grammar stream", "/v1/chat/completions", [{**_CHAT, "max_tokens": 300, "stream": True,
        "structured_outputs": _DIGITS}], lambda m, _: metric(m, "num_requests_running") == 1),
    ("beam search", "/v1/completions", [{**_STORY, "n": 2, "max_tokens": 300, "use_beam_search": True}],
        lambda m, before: _num_finished(m, "length") >= _num_finished(before, "length") + 4),
    ("n=2 chat", "/v1/chat/completions",
        [{**_CHAT, **_SAMPLED, "n": 2, "max_tokens": 300, "ignore_eos": True}],
        lambda m, _: metric(m, "num_requests_running") == 2),
    ("streams queued behind max_num_seqs", "/v1/completions",
        [{**_STORY, "prompt": f"Story {i}:", "max_tokens": 300, "stream": True} for i in range(20)],
        lambda m, _: metric(m, "num_requests_waiting") == 20 - ENGINE_ARGS["max_num_seqs"]),
]  # fmt: skip


@pytest.mark.parametrize("case, path, bodies, is_under_way", _DROPPED, ids=[c[0] for c in _DROPPED])
def test_every_kind_of_dropped_request_is_aborted_and_leaves_nothing_behind(
    server, client, case, path, bodies, is_under_way
):
    """Clients that leave once their requests run (or wait): each request is aborted, counted as such, well
    short of its max_tokens; then no request runs or waits, no KV block is held, and the next request's
    ids are a lone run's."""
    ask = {"model": MODEL_NAME, "prompt": "In 1969, Neil Armstrong", "max_tokens": 8, "temperature": 0}
    lone = client.completions.create(**ask, extra_body={"return_token_ids": True}).choices[0].token_ids
    before = wait_for_metrics(server, lambda m: metric(m, "num_requests_running") == 0, "an idle server")

    async def send(http: httpx.AsyncClient, body: dict) -> None:
        async with http.stream("POST", server.url + path, json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for _ in response.aiter_lines():
                pass
        pytest.fail(f"{case}: the request ended before its client left")

    async def drop_once_under_way() -> None:
        limits = httpx.Limits(max_connections=len(bodies))
        async with httpx.AsyncClient(timeout=300, headers=server.headers, limits=limits) as http:
            sent = [asyncio.create_task(send(http, body)) for body in bodies]
            while not is_under_way(metrics(server), before):
                assert not any(task.done() for task in sent), [t.result() for t in sent if t.done()]
                await asyncio.sleep(0.1)
            for task in sent:
                task.cancel()  # the client goes away
            await asyncio.gather(*sent, return_exceptions=True)

    asyncio.run(asyncio.wait_for(drop_once_under_way(), 300))
    after = wait_for_metrics(
        server,
        lambda m: _is_idle(m) and _num_finished(m, "abort") >= _num_finished(before, "abort") + len(bodies),
        f"{case}: every request aborted and every block free",
    )
    generated = metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total")
    assert generated < 300, f"{case}: {generated} tokens made after the client left"
    assert (
        client.completions.create(**ask, extra_body={"return_token_ids": True}).choices[0].token_ids == lone
    )


def _is_idle(samples) -> bool:
    """No request runs or waits, and no KV block is held."""
    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    return all(metric(samples, name) == 0 for name in gauges)


def _num_finished(samples, reason: str) -> float:
    return metric(samples, "request_success_total", finished_reason=reason)


def _token_ids(server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(server.url + "/tokenize", json=body, headers=server.headers, timeout=60).json()[
        "tokens"
    ]


def test_logit_bias_and_allowed_token_ids_through_the_client(server, client):
    """OpenAI's logit_bias (token ids as strings): -100 on the greedy first token makes the answer start
    otherwise; vLLM's allowed_token_ids (extra_body) keeps every token in the set."""
    ask = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**ask, logprobs=2)
    first = plain.choices[0].logprobs.tokens[0]
    top_two = list(plain.choices[0].logprobs.top_logprobs[0])
    ids = {token: _token_ids(server, token) for token in top_two}
    banned = client.completions.create(**ask, logit_bias={str(ids[first][0]): -100})
    assert banned.choices[0].text != plain.choices[0].text
    assert not banned.choices[0].text.startswith(first)
    allowed = [i for token in top_two for i in ids[token]]
    kept = client.completions.create(**ask, logprobs=1, extra_body={"allowed_token_ids": allowed})
    assert set(kept.choices[0].logprobs.tokens) <= set(top_two)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say yes."}],
        max_completion_tokens=3,
        temperature=0,
        logit_bias={str(ids[first][0]): 100},
    )
    assert chat.choices[0].message.content == first * 3
    assert first.strip() == "Paris"  # vLLM's bad_words: never said
    barred = client.completions.create(**{**ask, "max_tokens": 8}, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in barred.choices[0].text and barred.choices[0].text != plain.choices[0].text


def test_token_ids_and_prompt_logprobs_for_rl_clients(server, client):
    """vLLM's extras for trainers: `return_token_ids` (the prompt's ids and each choice's, streamed as
    each chunk's), `return_tokens_as_token_ids` (logprobs name "token_id:{id}"), `prompt_logprobs`
    (per prompt token; the first has none) on both routes; streamed prompt logprobs are a 400."""
    prompt = "The capital of France is"
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1}
    ask = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0, "logprobs": 1}
    answer = client.completions.create(prompt=prompt, **ask, extra_body=extra).choices[0]
    prompt_ids = _prompt_ids(server, {"prompt": prompt})
    assert answer.prompt_token_ids == prompt_ids and len(answer.token_ids) == 5
    assert answer.logprobs.tokens == [f"token_id:{i}" for i in answer.token_ids]
    assert _detokenize(server, answer.token_ids) == answer.text
    assert answer.prompt_logprobs[0] is None and len(answer.prompt_logprobs) == len(prompt_ids)
    echoed = client.completions.create(prompt=prompt, **{**ask, "max_tokens": 1, "logprobs": 0}, echo=True)
    for token_id, entry, logprob in zip(
        prompt_ids[1:], answer.prompt_logprobs[1:], echoed.choices[0].logprobs.token_logprobs[1:]
    ):
        assert entry[str(token_id)]["logprob"] == pytest.approx(logprob, abs=1e-6)
    messages = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=6, temperature=0, extra_body=extra
    )
    chat_ids = _prompt_ids(server, {"messages": messages})
    assert chat.prompt_token_ids == chat_ids and len(chat.prompt_logprobs) == len(chat_ids)
    (choice,) = chat.choices
    assert _detokenize(server, choice.token_ids) == choice.message.content
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    assert chunks[0].prompt_token_ids == chat_ids
    streamed = [i for c in chunks for ch in c.choices for i in (getattr(ch, "token_ids", None) or [])]
    assert streamed == choice.token_ids
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_completion_tokens=2, stream=True, extra_body=extra
        )
    assert refused.value.body["param"] == "prompt_logprobs"


def _prompt_ids(server, body: dict) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json=body, headers=server.headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def _detokenize(server, ids: list[int]) -> str:
    response = httpx.post(
        server.url + "/detokenize", json={"tokens": ids}, headers=server.headers, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, client):
    """vLLM's truncate_prompt_tokens: the completion of the prompt's last N tokens, as if sent alone
    (echo shows what was kept); a chat's rendered prompt is cut alike."""
    prompt = "List of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23,"
    ids = _prompt_ids(server, {"prompt": prompt})
    ask = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0}
    cut = client.completions.create(prompt=prompt, echo=True, extra_body={"truncate_prompt_tokens": 7}, **ask)
    alone = client.completions.create(prompt=ids[-7:], **ask)
    assert (
        cut.usage.prompt_tokens == 7
        and cut.choices[0].text == _detokenize(server, ids[-7:]) + alone.choices[0].text
    )
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=3, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage.prompt_tokens == 5 < len(_prompt_ids(server, {"messages": messages}))


def test_truncate_prompt_tokens_minus_one_leaves_room_for_max_tokens(client):
    """-1 keeps as much of a long prompt as the context holds beside max_tokens (vLLM's), not the whole
    context (which left no room: a 400 blaming the prompt)."""
    prompt = "word " * 600
    completion = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": -1}
    )
    assert completion.usage.prompt_tokens == 510 and completion.usage.completion_tokens == 2
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": prompt}],
        max_completion_tokens=2,
        extra_body={"truncate_prompt_tokens": -1},
    )
    assert chat.usage.prompt_tokens == 510

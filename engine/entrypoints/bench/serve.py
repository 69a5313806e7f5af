"""`xlaserve bench serve`: load a running server with the fixed chat workload, modelled on `vllm bench serve`.

Requests go out at a Poisson rate (`--request-rate`) or as fast as `--max-concurrency` allows; each
is a streamed chat completion (greedy, `ignore_eos`, so every request produces exactly
`--output-len` tokens, as in `xlaserve bench throughput`). Reported: throughput and the p50/p90/p99
of time to first token (TTFT), time per output token after the first (TPOT), inter-token latency
(ITL, one sample per streamed chunk) and end-to-end latency. `--structured-output-ratio R` sends
that share of the requests (spread evenly) with a JSON schema as `response_format`, each its own
schema (so each compiles: nothing is served from the grammar cache) and one longer than
`--output-len` (so constrained requests produce as many tokens as the others); their TTFT is also
reported apart from the rest's. Several loads (`--max-concurrency 1,4,16`)
make a sweep; `--plot FILE.png` draws the latency percentiles against load (needs matplotlib:
`pip install xlaserve[bench]`).

`--images-per-request N` loads a vision-language server: each request's user turn also carries N images
of `--image-size WxH` (random pixels, a PNG data URL each, different for every request and image, so the
encoder cache serves none of them; vLLM's random-mm dataset in one flag), made before the clock starts;
the report adds images/s.

`--long-prompt-ratio R` mixes long prompts in (that share of the requests, spread evenly, each with a
context of `--long-prompt-len` words of its own, so no prefix cache serves it): TTFT and TPOT are then
also reported for the long and the short requests apart, the short requests' TPOT being what long
prefills cost the decodes beside them (disaggregated prefill's measure: README "Disaggregated
prefill"). `--peer-base-url URL` runs every load on a second server too, right after, and reports the
first's p50 TTFT, TPOT and throughput as ratios of the peer's (e.g. a router in front of a producer
and a consumer against one server).

`--backend openai-embeddings` (vLLM's name) loads a pooling server instead: each request embeds one
prompt (the workload's user turn) on /v1/embeddings; reported: requests/s, input tokens/s and the
end-to-end latency percentiles (nothing streams, so no TTFT, TPOT or ITL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time

from xlaserve.entrypoints.bench.offline import workload
from xlaserve.entrypoints.bench.report import (
    RequestResult,
    peer_ratios,
    plot,
    print_serve_run,
    serve_summary,
)


def is_structured(index: int, ratio: float) -> bool:
    """Whether request `index` carries a schema: `ratio` of the requests, spread evenly."""
    return math.floor((index + 1) * ratio) > math.floor(index * ratio)


def long_context(index: int, num_words: int) -> str:
    """A context of `num_words` words unique to request `index` (its first words name it)."""
    words = [f"Document {index}."] + [_FILLER[(index + j) % len(_FILLER)] for j in range(num_words - 2)]
    return " ".join(words) + "\n\n"


_FILLER = (
    "the river runs past old mills and quiet farms toward a harbor where ships wait for the tide".split()
)


def with_long_prompts(conversations: list, ratio: float, num_words: int) -> list:
    """`ratio` of the conversations (spread evenly) with a long context before their user turn."""
    out = []
    for index, messages in enumerate(conversations):
        if is_structured(index, ratio):
            turn = messages[-1]
            messages = [*messages[:-1], dict(turn, content=long_context(index, num_words) + turn["content"])]
        out.append(messages)
    return out


def bench_schema(index: int) -> dict:
    """A JSON schema unique to request `index` (a property named after it), whose shortest valid
    document (32 records) is longer than any --output-len a run uses: the request always runs to
    max_tokens under the grammar's mask."""
    record = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 10**6},
            "name": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["id", "name", "tags", "score"],
        "additionalProperties": False,
    }
    records = {"type": "array", "items": record, "minItems": 32}
    return {
        "type": "object",
        "properties": {f"records_{index}": records},
        "required": [f"records_{index}"],
        "additionalProperties": False,
    }


async def _one_request(client, url: str, headers: dict, body: dict) -> RequestResult:
    content = body["messages"][-1]["content"]
    is_long = isinstance(content, str) and content.startswith("Document ")
    result = RequestResult(
        is_structured="response_format" in body, is_long=is_long, start=time.perf_counter()
    )
    last = result.start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0]["delta"].get("content"):
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - result.start
                else:
                    result.itls.append(now - last)
                last = now
        result.e2e = time.perf_counter() - result.start
        result.is_ok = result.output_tokens > 0
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _one_embedding(client, url: str, headers: dict, body: dict) -> RequestResult:
    """One /v1/embeddings request, not streamed: its latency is its end to end."""
    result = RequestResult(start=time.perf_counter())
    try:
        response = await client.post(url, json=body, headers=headers)
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:200]!r}"
            return result
        reply = response.json()
        result.e2e = time.perf_counter() - result.start
        result.prompt_tokens = reply["usage"]["prompt_tokens"]
        result.is_ok = bool(reply["data"]) and bool(reply["data"][0]["embedding"])
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
    return result


def random_image_parts(index: int, num_images: int, size: tuple[int, int]) -> list[dict]:
    """Request `index`'s image_url parts: `num_images` PNGs of random pixels (width, height), each its
    own (seeded by the request and the image), as data URLs."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    parts = []
    for j in range(num_images):
        rng = np.random.default_rng((index, j))
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def with_images(conversations: list, num_images: int, size: tuple[int, int]) -> list:
    """The conversations, each last (user) turn's content as its text then its images."""
    if not num_images:
        return conversations
    out = []
    for index, messages in enumerate(conversations):
        *earlier, last = messages
        content = [{"type": "text", "text": last["content"]}, *random_image_parts(index, num_images, size)]
        out.append([*earlier, {**last, "content": content}])
    return out


def parse_size(text: str) -> tuple[int, int]:
    """--image-size "WxH" -> (width, height)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--image-size must be WIDTHxHEIGHT (e.g. 336x336), got {text!r}") from None
    if width < 1 or height < 1:
        raise SystemExit(f"--image-size must be positive, got {text!r}")
    return width, height


async def run_load(args, conversations, *, max_concurrency: int | None, request_rate: float) -> dict:
    import httpx

    if args.backend == "openai-embeddings":
        return await _run_embeddings(args, conversations, max_concurrency, request_rate)
    num_images = getattr(args, "images_per_request", 0)
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(max_concurrency or len(conversations))
    rng = random.Random(args.seed)
    timeout = httpx.Timeout(args.timeout)
    limits = httpx.Limits(max_connections=max_concurrency or len(conversations))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def limited(index: int, messages):
            body = {
                "model": args.model,
                "messages": messages,
                "max_tokens": args.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if is_structured(index, args.structured_output_ratio):
                schema = {"name": f"records_{index}", "schema": bench_schema(index)}
                body["response_format"] = {"type": "json_schema", "json_schema": schema}
            async with limit:
                return await _one_request(client, url, headers, body)

        await _one_request(
            client,
            url,
            headers,
            {  # touch: connections, first-request costs
                "model": args.model,
                "messages": conversations[0],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        tasks = []
        start = time.perf_counter()
        for index, messages in enumerate(conversations):
            tasks.append(asyncio.create_task(limited(index, messages)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    run = serve_summary(results, elapsed, max_concurrency, request_rate)
    if num_images:
        run["images_per_request"] = num_images
        run["images_per_s"] = num_images * sum(r.is_ok for r in results) / elapsed
    return run


async def _run_embeddings(args, conversations, max_concurrency: int | None, request_rate: float) -> dict:
    """The load on /v1/embeddings: one request per conversation's user turn, after one untimed."""
    import httpx

    url = args.base_url.rstrip("/") + "/v1/embeddings"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    bodies = [{"model": args.model, "input": messages[-1]["content"]} for messages in conversations]
    limit = asyncio.Semaphore(max_concurrency or len(bodies))
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=max_concurrency or len(bodies))
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:

        async def limited(body):
            async with limit:
                return await _one_embedding(client, url, headers, body)

        await _one_embedding(client, url, headers, bodies[0])  # touch: connections, first-request costs
        tasks, start = [], time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    summary = serve_summary(results, elapsed, max_concurrency, request_rate)
    for key in ("ttft_s", "ttft_s_structured", "ttft_s_unstructured", "tpot_s", "itl_s"):
        summary[key] = {}  # nothing streams
    summary["input_tokens_per_s"] = sum(r.prompt_tokens for r in results if r.is_ok) / elapsed
    return summary


def _values(text: str | None, kind) -> list:
    return [kind(v) for v in text.split(",")] if text else []


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if not 0.0 <= args.structured_output_ratio <= 1.0:
        raise SystemExit(f"--structured-output-ratio must be in [0, 1], got {args.structured_output_ratio}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the report
    if args.images_per_request < 0:
        raise SystemExit(f"--images-per-request must be >= 0, got {args.images_per_request}")
    if args.images_per_request and args.backend != "openai-chat":
        raise SystemExit("--images-per-request needs --backend openai-chat (a vision-language server)")
    if not 0.0 <= args.long_prompt_ratio <= 1.0:
        raise SystemExit(f"--long-prompt-ratio must be in [0, 1], got {args.long_prompt_ratio}")
    conversations = with_images(
        workload(args.num_prompts), args.images_per_request, parse_size(args.image_size)
    )
    conversations = with_long_prompts(conversations, args.long_prompt_ratio, args.long_prompt_len)
    concurrencies = _values(args.max_concurrency, int) or [None]
    rates = _values(args.request_rate, float) or [math.inf]
    loads = [(c, r) for c in concurrencies for r in rates]
    runs = []
    for max_concurrency, rate in loads:
        run = asyncio.run(run_load(args, conversations, max_concurrency=max_concurrency, request_rate=rate))
        print_serve_run(run, args.num_prompts, args.output_len)
        if args.peer_base_url:
            peer_args = argparse.Namespace(**{**vars(args), "base_url": args.peer_base_url})
            peer = asyncio.run(
                run_load(peer_args, conversations, max_concurrency=max_concurrency, request_rate=rate)
            )
            print(f"-- peer {args.peer_base_url} --")
            print_serve_run(peer, args.num_prompts, args.output_len)
            run["peer"] = peer
            run["vs_peer"] = peer_ratios(run, peer)
            print("vs peer (this / peer): " + ", ".join(f"{k} {v:.3f}" for k, v in run["vs_peer"].items()))
        runs.append(run)
    results = {
        "bench": "serve",
        "backend": args.backend,
        "base_url": args.base_url,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "structured_output_ratio": args.structured_output_ratio,
        "images_per_request": args.images_per_request,
        "image_size": args.image_size,
        "long_prompt_ratio": args.long_prompt_ratio,
        "long_prompt_len": args.long_prompt_len,
        "peer_base_url": args.peer_base_url,
        "runs": runs,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")
    return 0 if all(r["num_failed"] == 0 for r in runs) else 1


def add_serve_parser(bench_sub) -> None:
    b = bench_sub.add_parser("serve", help="load a running server: TTFT, TPOT, ITL, E2E percentiles")
    b.add_argument("--base-url", default="http://127.0.0.1:8000")
    b.add_argument("--model", default=None, help="the served model name (default: the server's)")
    b.add_argument("--api-key", default=None)
    b.add_argument(
        "--backend",
        choices=["openai-chat", "openai-embeddings"],
        default="openai-chat",
        help="openai-embeddings: one prompt per /v1/embeddings request (a pooling server)",
    )
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument(
        "--max-concurrency",
        default=None,
        help="at most this many requests in flight; a list (1,4,16) runs a sweep",
    )
    b.add_argument(
        "--request-rate",
        default=None,
        help="Poisson arrivals, requests/s (default: all at once); a list runs a sweep",
    )
    b.add_argument(
        "--structured-output-ratio",
        type=float,
        default=0.0,
        help="the share of requests sent with a JSON schema (response_format), 0 to 1",
    )
    b.add_argument(
        "--images-per-request",
        type=int,
        default=0,
        help="images in each request's user turn (a vision-language server; random pixels, PNG data URLs)",
    )
    b.add_argument("--image-size", default="336x336", help="WIDTHxHEIGHT of --images-per-request's images")
    b.add_argument(
        "--long-prompt-ratio",
        type=float,
        default=0.0,
        help="the share of requests with a long context of their own (--long-prompt-len words), 0 to 1",
    )
    b.add_argument("--long-prompt-len", type=int, default=1024, help="words of a long prompt's context")
    b.add_argument(
        "--peer-base-url",
        default=None,
        help="run every load on this server too, and report ratios against it",
    )
    b.add_argument("--seed", type=int, default=0, help="of the Poisson arrival times")
    b.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    b.add_argument("--output-json", default=None)
    b.add_argument("--plot", default=None, metavar="FILE.png", help="latency percentiles against load")
    b.set_defaults(func=cmd_bench_serve)

"""The pooling routes on a real pooling server (`xlaserve serve --runner pooling`, one subprocess for the
module, a tiny random Llama): /v1/embeddings through the official `openai` client and LangChain's
OpenAIEmbeddings against Hugging Face,
/pooling (its tasks: token_embed's rows against Hugging Face), /score, /rerank (three paths), chat-style
input (`messages`) against its rendered template (a request's own `chat_template` too, which this server
trusts), and bad input (the chat fields' wrong types among it) as 400s naming the field. The server warms up
under the strict compile guard, so every answer here also proves pooling compiled nothing after it.
`xlaserve run-batch` on the same model answers its embeddings, score and rerank lines as this server does.
"""

from __future__ import annotations

import base64
import json
import re

import httpx
import numpy as np
import openai
import pytest
import torch

from helpers.family_cases import make_hf_model, one_torch_thread, save_hf_model, word_tokenizer  # noqa: F401
from helpers.server_harness import engine_flags, running_server
from helpers.tiny_models import TINY_PROCESS_ENV, TINY_PROCESS_XLA_FLAGS
from xlaserve.entrypoints.cli import main

TOL = 1e-4
NAME = "tiny-embed"
FLAGS = ["--runner", "pooling", "--served-model-name", NAME, "--max-model-len", "128",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--block-size", "8",
         "--kv-cache-memory", str(4 * 2**20),
         # A template, so that chat reaches the engine, which refuses generation on a pooling runner.
         "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
         "--trust-request-chat-template"]  # fmt: skip


@pytest.fixture(scope="module")
def pooling_model(tmp_path_factory):
    """(the Hugging Face model, its saved directory): a Matryoshka embedder of sizes 4 and 8 (what its
    config.json says: vLLM's matryoshka_dimensions), so that `dimensions` may cut it there."""
    model = make_hf_model("LlamaForCausalLM", seed=3)
    model.config.matryoshka_dimensions = [4, 8]
    return model, save_hf_model(model, tmp_path_factory.mktemp("pooling_model"))


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory, server_cache_dir, pooling_model):
    model, path = pooling_model
    logs = str(tmp_path_factory.mktemp("pooling-logs"))
    with running_server(logs, server_cache_dir, extra_args=FLAGS, model=path, env=TINY_PROCESS_ENV) as proc:
        yield proc, model


@pytest.fixture(scope="module")
def http(pooling_server):
    with httpx.Client(base_url=pooling_server[0].url, timeout=120) as client:
        yield client


def _hf_last(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()


def _unit(x):
    return x / np.linalg.norm(x)


def _close(actual, expected) -> None:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape and np.abs(actual - expected).max() <= TOL


def test_openai_client_embeddings_match_hf(pooling_server):
    proc, model = pooling_server
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused")
    tok = word_tokenizer(model.config.vocab_size)
    texts = ["w5 w6 w7 w8", "w9 " * 40]  # the second prefills in three chunks
    ids = [tok.encode(t) for t in texts]
    floats = client.embeddings.create(model=NAME, input=texts, encoding_format="float")
    default = client.embeddings.create(model=NAME, input=texts)  # the client asks for base64 and decodes it
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for i, (f, d) in enumerate(zip(floats.data, default.data)):
        assert f.index == i and f.embedding == d.embedding
        _close(f.embedding, _unit(_hf_last(model, ids[i])))
    raw = client.embeddings.create(model=NAME, input=ids[0], encoding_format="base64").data[0].embedding
    assert np.frombuffer(base64.b64decode(raw), "<f4").tolist() == floats.data[0].embedding
    # vLLM's use_activation: false embeds the last hidden state as it is, not normalized.
    raw = client.embeddings.create(model=NAME, input=ids[1], extra_body={"use_activation": False})
    _close(raw.data[0].embedding, _hf_last(model, ids[1]))
    short = client.embeddings.create(model=NAME, input=[ids[0], ids[1]], dimensions=8)
    for i, d in enumerate(short.data):
        _close(d.embedding, _unit(_hf_last(model, ids[i])[:8]))
    # vLLM's truncate_prompt_tokens: each prompt's last N tokens, the short one whole.
    cut = client.embeddings.create(model=NAME, input=texts, extra_body={"truncate_prompt_tokens": 6})
    assert cut.usage.prompt_tokens == len(ids[0]) + 6
    _close(cut.data[0].embedding, floats.data[0].embedding)
    _close(cut.data[1].embedding, _unit(_hf_last(model, ids[1][-6:])))


def test_langchain_openai_embeddings_match_hf(pooling_server):
    """LangChain's OpenAIEmbeddings (a RAG pipeline's embedder) pointed at the server: documents and a
    query embed as Hugging Face's last hidden state, normalized."""
    from langchain_openai import OpenAIEmbeddings

    proc, model = pooling_server
    embedder = OpenAIEmbeddings(
        model=NAME,
        base_url=proc.url + "/v1",
        api_key="unused",
        max_retries=0,
        # Else it splits texts with tiktoken, whose encodings are downloaded: the server tokenizes.
        check_embedding_ctx_length=False,
    )
    tok = word_tokenizer(model.config.vocab_size)
    texts = ["w5 w6 w7 w8", "w11 w12"]
    documents = embedder.embed_documents(texts)
    assert len(documents) == len(texts)
    for text, vector in zip(texts, documents, strict=True):
        _close(vector, _unit(_hf_last(model, tok.encode(text))))
    assert embedder.embed_query(texts[1]) == documents[1]


def test_pooling_score_and_rerank(pooling_server, http):
    _, model = pooling_server
    tok = word_tokenizer(model.config.vocab_size)
    pooled = http.post("/pooling", json={"input": [[5, 6, 7]]}, headers={"X-Request-Id": "p1"}).json()
    _close(pooled["data"][0]["data"], _hf_last(model, [5, 6, 7]))
    assert pooled["id"] == "pool-p1"  # a client's X-Request-Id after the route's prefix, as vLLM's
    query, docs = "w5 w6", ["w7 w8 w9", "w5 w6 w10", "w11"]
    emb = {t: _unit(_hf_last(model, tok.encode(t))) for t in [query, *docs]}
    expected = [float(emb[query] @ emb[d]) for d in docs]
    scores = http.post(
        "/score", json={"text_1": query, "text_2": docs}, headers={"X-Request-Id": "s1"}
    ).json()
    assert [round(d["score"], 4) for d in scores["data"]] == [round(s, 4) for s in expected]
    assert scores["id"] == "score-s1"
    order = sorted(range(3), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = http.post(
            path, json={"query": query, "documents": docs, "top_n": 2}, headers={"X-Request-Id": "r1"}
        ).json()
        assert [r["index"] for r in body["results"]] == order[:2] and body["id"] == "rerank-r1"
        assert body["results"][0]["document"]["text"] == docs[order[0]]
    bare = http.post("/rerank", json={"query": query, "documents": docs, "return_documents": False}).json()
    assert len(bare["results"]) == 3 and bare["results"][0].get("document") is None
    # vLLM's truncate_prompt_tokens on /score and /rerank: each text embedded from its last N tokens.
    cut = {t: _unit(_hf_last(model, tok.encode(t)[-2:])) for t in [query, *docs]}
    expected = [float(cut[query] @ cut[d]) for d in docs]
    scores = http.post(
        "/v1/score", json={"text_1": query, "text_2": docs, "truncate_prompt_tokens": 2}
    ).json()
    assert [round(d["score"], 4) for d in scores["data"]] == [round(s, 4) for s in expected]
    assert scores["usage"]["prompt_tokens"] == 2 + 2 + 2 + 1  # the query and each document, once
    body = http.post("/v2/rerank", json={"query": query, "documents": docs, "truncate_prompt_tokens": 2})
    by_index = {r["index"]: r["relevance_score"] for r in body.json()["results"]}
    assert [round(by_index[i], 4) for i in range(3)] == [round(s, 4) for s in expected]


def test_pooling_tasks(pooling_server, http):
    """/pooling's `task`: token_embed gives a normalized row per token (computed whole, though a
    prefix of it is cached), encode the last token's state; a task this embedder does not serve is a
    400 naming `task`."""
    _, model = pooling_server
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # two chunks of 16
    embedded = http.post("/v1/embeddings", json={"input": ids}, headers={"X-Request-Id": "e1"})
    assert embedded.json()["id"] == "embd-e1"  # and its first blocks are now in the prefix cache
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].numpy()
    rows = http.post("/pooling", json={"input": ids, "task": "token_embed"}).json()["data"][0]["data"]
    _close(rows, hidden / np.linalg.norm(hidden, axis=-1, keepdims=True))
    short = http.post("/pooling", json={"input": ids, "task": "token_embed", "dimensions": 4}).json()
    _close(short["data"][0]["data"], hidden[:, :4] / np.linalg.norm(hidden[:, :4], axis=-1, keepdims=True))
    encoded = http.post("/pooling", json={"input": ids, "task": "encode"}).json()["data"][0]["data"]
    _close(encoded, hidden[-1])
    packed = http.post("/pooling", json={"input": ids, "task": "token_embed", "encoding_format": "base64"})
    flat = np.frombuffer(base64.b64decode(packed.json()["data"][0]["data"]), "<f4")
    assert flat.tolist() == np.asarray(rows, np.float32).reshape(-1).tolist()
    for task in ("classify", "token_classify", "reward"):
        response = http.post("/pooling", json={"input": ids, "task": task})
        assert response.status_code == 400 and response.json()["error"]["param"] == "task", response.text
        assert (
            f"pooling_task '{task}' is not served by this embed model" in response.json()["error"]["message"]
        )


def test_a_requests_own_chat_template(http):
    """`chat_template` in a request (this server runs --trust-request-chat-template): /tokenize,
    /v1/embeddings and /pooling render the messages with it; a template that does not parse is a 400
    naming it."""
    template = "{% for m in messages %}{{ m['content'] }} w11 {% endfor %}"
    ids = http.post("/tokenize", json={"messages": CHAT, "chat_template": template}).json()["tokens"]
    assert ids == [5, 6, 11, 7, 8, 9, 11]
    # A template that loops over a message's content gets it as a list of parts (vLLM's "openai" content
    # format, which --chat-template-content-format auto picks for it): a string as one text part.
    parts = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }} {% endfor %}w11 {% endfor %}"
    two_parts = [CHAT[0], {"role": "user", "content": [{"type": "text", "text": t} for t in ("w7", "w8")]}]
    as_parts = http.post("/tokenize", json={"messages": two_parts, "chat_template": parts}).json()["tokens"]
    assert as_parts == [5, 6, 11, 7, 8, 11]
    for path, key in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
        own = http.post(path, json={"messages": CHAT, "chat_template": template}).json()
        assert own["data"][0][key] == http.post(path, json={"input": ids}).json()["data"][0][key]
    for path in ("/tokenize", "/v1/embeddings"):
        response = http.post(path, json={"messages": CHAT, "chat_template": "{% for m in messages %}"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "chat_template" and "not a valid Jinja template" in error["message"]


# What a client-facing message must never show (as test_server_hostile.py's INTERNALS).
INTERNALS = re.compile(r"Traceback|\w+(Request|Error|Exception)\b|\bpid\b|/work/|\.py\b")
CHAT = [{"role": "system", "content": "w5 w6 "}, {"role": "user", "content": "w7 w8 w9"}]


def test_messages_embed_as_their_rendered_template(http):
    # The suite's template joins the contents: "w5 w6 w7 w8 w9"; /tokenize renders it as the routes do.
    ids = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert ids == [5, 6, 7, 8, 9]
    # vLLM's return_token_strs: each id's vocabulary string; absent (null) unless asked, as vLLM's.
    strs = http.post("/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    assert strs["token_strs"] == ["w5", "w6", "w7", "w8", "w9"] and strs["tokens"] == ids
    plain = http.post("/tokenize", json={"prompt": "w7 w8", "return_token_strs": True}).json()
    assert plain == {"count": 2, "max_model_len": 128, "tokens": [7, 8], "token_strs": ["w7", "w8"]}
    assert (
        http.post("/tokenize", json={"prompt": "w7", "return_token_strs": False}).json()["token_strs"] is None
    )
    for path, key in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
        chat = http.post(path, json={"messages": CHAT}).json()
        as_ids = http.post(path, json={"input": ids}).json()
        as_text = http.post(path, json={"input": "w5 w6 w7 w8 w9", "add_special_tokens": False}).json()
        assert chat["data"][0][key] == as_ids["data"][0][key] == as_text["data"][0][key]
        assert chat["usage"]["prompt_tokens"] == len(ids)
    prefill = {"messages": [*CHAT, {"role": "assistant", "content": " w10"}], "continue_final_message": True}
    ids = http.post("/tokenize", json={**prefill, "add_generation_prompt": False}).json()["tokens"]
    assert ids == [5, 6, 7, 8, 9, 10]
    continued = http.post("/v1/embeddings", json=prefill).json()["data"][0]["embedding"]
    assert continued == http.post("/v1/embeddings", json={"input": ids}).json()["data"][0]["embedding"]


# vLLM's chat-style fields, with the wrong JSON types the hostile suite sends (test_server_hostile.py).
# vLLM's embed_dtype -> torch's dtype, and the integer view of its bits (vLLM's tensor2binary).
TORCH_EMBED_DTYPES = {
    "float32": (torch.float32, torch.int32),
    "float16": (torch.float16, torch.int16),
    "bfloat16": (torch.bfloat16, torch.int16),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
    "fp8_e5m2": (torch.float8_e5m2, torch.uint8),
}


def _torch_bytes(values, embed_dtype: str, endianness: str) -> bytes:
    dtype, bits = TORCH_EMBED_DTYPES[embed_dtype]
    array = torch.tensor(values, dtype=torch.float32).to(dtype).flatten().view(bits).numpy()
    return (array.byteswap() if endianness == "big" else array).tobytes()  # this host is little-endian


def test_vllm_encodings_and_usage(http):
    """vLLM's embed_dtype and endianness (base64, and the `bytes` format: the body and its `metadata`
    header), byte for byte as torch casts the float answer; usage as vLLM's UsageInfo (rerank's: two
    counts)."""
    inputs = ["w5 w6 w7 w8", "w9 w10 w11"]
    floats = http.post("/v1/embeddings", json={"input": inputs}).json()
    num_tokens = floats["usage"]["prompt_tokens"]
    assert floats["usage"] == {
        "prompt_tokens": num_tokens,
        "total_tokens": num_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    vectors = [d["embedding"] for d in floats["data"]]
    for embed_dtype in TORCH_EMBED_DTYPES:
        for endianness in ("native", "little", "big"):
            fields = {"encoding_format": "base64", "embed_dtype": embed_dtype, "endianness": endianness}
            body = http.post("/v1/embeddings", json={"input": inputs, **fields}).json()
            for d, vector in zip(body["data"], vectors, strict=True):
                assert base64.b64decode(d["embedding"]) == _torch_bytes(vector, embed_dtype, endianness)
    reply = http.post(
        "/v1/embeddings",
        json={"input": inputs, "encoding_format": "bytes", "embed_dtype": "bfloat16", "endianness": "big"},
        headers={"X-Request-Id": "b1"},
    )
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/octet-stream"
    metadata = json.loads(reply.headers["metadata"])
    assert (metadata["id"], metadata["model"]) == ("embd-b1", NAME)
    assert metadata["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    assert reply.content == b"".join(_torch_bytes(v, "bfloat16", "big") for v in vectors)
    width = 2 * len(vectors[0])
    assert metadata["data"] == [
        {"index": i, "embed_dtype": "bfloat16", "endianness": "big", "start": i * width,
         "end": (i + 1) * width, "shape": [len(vectors[0])]}
        for i in range(2)
    ]  # fmt: skip
    # /pooling's token rows: one output of [tokens, hidden], row after row.
    token_embed = {"input": [5, 6, 7], "task": "token_embed"}
    rows = http.post("/pooling", json=token_embed).json()["data"][0]["data"]
    reply = http.post("/pooling", json={**token_embed, "encoding_format": "bytes"})
    item = json.loads(reply.headers["metadata"])["data"][0]
    assert item["shape"] == [3, len(rows[0])] and item["end"] == len(reply.content) == 3 * 4 * len(rows[0])
    assert np.frombuffer(reply.content, np.float32).reshape(3, -1).tolist() == rows
    reranked = http.post("/rerank", json={"query": "w5", "documents": "w6 w7"}).json()
    assert reranked["usage"] == {"prompt_tokens": 1 + 2, "total_tokens": 1 + 2}
    assert [r["document"]["text"] for r in reranked["results"]] == ["w6 w7"]  # one document, as vLLM's


def test_score_aliases_truncation_side_and_cache_salt(pooling_server, http):
    """/score under vLLM's other names (queries with documents or items, data_1 with data_2) scores as
    text_1 with text_2; truncation_side "right" keeps each prompt's first tokens (against Hugging
    Face); a cache_salt shares the prefix cache only with its own salt."""
    _, model = pooling_server
    query, docs = "w5 w6", ["w7 w8 w9", "w5 w6 w10"]
    expected = http.post("/score", json={"text_1": query, "text_2": docs}).json()
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        body = http.post("/v1/score", json={first: query, second: docs}).json()
        assert body["data"] == expected["data"] and body["usage"] == expected["usage"], (first, second)
    tok = word_tokenizer(model.config.vocab_size)
    text = "w9 w10 w11 w12 w13 w14"
    ids = tok.encode(text)
    right = {"truncate_prompt_tokens": 3, "truncation_side": "right"}
    cut = http.post("/v1/embeddings", json={"input": text, **right}).json()
    assert cut["usage"]["prompt_tokens"] == 3
    _close(cut["data"][0]["embedding"], _unit(_hf_last(model, ids[:3])))
    left = http.post("/v1/embeddings", json={"input": text, **right, "truncation_side": "left"}).json()
    _close(left["data"][0]["embedding"], _unit(_hf_last(model, ids[-3:])))
    scores = http.post("/score", json={"text_1": query, "text_2": docs, **right, "truncate_prompt_tokens": 1})
    cut = {t: _unit(_hf_last(model, tok.encode(t)[:1])) for t in [query, *docs]}
    expected = [round(float(cut[query] @ cut[d]), 4) for d in docs]
    assert [round(d["score"], 4) for d in scores.json()["data"]] == expected

    def hits() -> float:
        lines = http.get("/metrics").text.splitlines()
        return sum(
            float(line.split()[-1]) for line in lines if line.startswith("xlaserve:prefix_cache_hits_total")
        )

    def embed(salt: str) -> list[float]:
        body = http.post("/pooling", json={"input": prompt, "task": "embed", "cache_salt": salt}).json()
        return body["data"][0]["data"]

    prompt = list(range(30, 50))  # two whole blocks of 8 to cache, and a tail
    salted = embed("a")
    before = hits()
    _close(embed("b"), salted)
    assert hits() == before  # another salt: nothing shared
    _close(embed("a"), salted)
    assert hits() == before + 16  # its own salt: both blocks


CHAT_FIELD_TYPES = {
    "messages": ["w5", 5, True, {"role": "user", "content": "w5"}],
    "add_generation_prompt": ["yes", 1, [True], {"value": True}],
    "continue_final_message": ["yes", 1, [True], {"value": True}],
    "add_special_tokens": ["yes", 1, [True], {"value": True}],
    "chat_template_kwargs": ["x", 5, True, [{}]],
    "chat_template": [5, True, ["x"], {"name": "x"}, ""],
}


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_chat_fields_of_the_wrong_type_are_400_naming_them(http, path):
    for field, values in CHAT_FIELD_TYPES.items():
        for value in values:
            response = http.post(path, json={"messages": CHAT, field: value})
            assert response.status_code == 400, (field, value, response.text)
            error = response.json()["error"]
            assert error["param"] == field and not INTERNALS.search(error["message"]), (field, value, error)


def _image_part():
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


BAD_MESSAGES = [  # (route, body, the param named, words of the message)
    ("/v1/embeddings", {"input": "w5", "messages": CHAT}, "messages", "not both"),
    ("/pooling", {"input": [5], "messages": CHAT}, "messages", "not both"),
    ("/v1/embeddings", {}, "input", "messages"),
    ("/pooling", {"encoding_format": "float"}, "input", "messages"),
    ("/v1/embeddings", {"messages": []}, "messages", None),
    ("/v1/embeddings", {"messages": [{"role": "robot", "content": "w5"}]}, "messages[0].role", None),
    ("/pooling", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
    ("/v1/embeddings", {"messages": [{"role": "user"}]}, "messages", "empty"),
    ("/v1/embeddings", {"messages": [{"role": "user", "text": "w5"}]}, "messages[0].text", None),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "w5 " * 128}]}, "messages", "128"),
    (
        "/v1/embeddings",
        {"messages": [{"role": "user", "content": [_image_part()]}]},
        "messages[0].content[0].image_url",
        "text messages only",
    ),
    (
        "/v1/embeddings",
        {"messages": CHAT, "continue_final_message": True},
        "continue_final_message",
        None,
    ),
    (
        "/pooling",
        {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True},
        "continue_final_message",
        None,
    ),
    (
        "/v1/embeddings",
        {"input": "w5", "add_generation_prompt": False},
        "add_generation_prompt",
        "messages",
    ),
    ("/pooling", {"input": "w5", "chat_template_kwargs": {}}, "chat_template_kwargs", "messages"),
    ("/v1/embeddings", {"input": "w5", "chat_template": "{{ 1 }}"}, "chat_template", "messages"),
    ("/v1/embeddings", {"messages": CHAT, "dimensions": 49}, "dimensions", "one of [4, 8]"),
    ("/pooling", {"messages": [5]}, "messages[0]", None),
    (
        "/v1/embeddings",
        {"messages": [{"role": "user", "content": "w5 \ud800"}]},
        "messages[0].content",
        "Unicode",
    ),
    (
        "/pooling",
        {"messages": CHAT, "chat_template_kwargs": {"x": "\ud800"}},
        "chat_template_kwargs",
        "Unicode",
    ),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "w5"}] * 1025}, "messages", "1024"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_MESSAGES)
def test_bad_messages_are_400_naming_the_field(http, path, body, param, words):
    # json.dumps escapes a lone surrogate (httpx's json= cannot encode one)
    body = json.dumps({"model": NAME, **body})
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and not INTERNALS.search(error["message"]), error
    assert words is None or words in error["message"], error


BAD_INPUT = [  # (route, body, the param named, words of the message)
    ("/v1/embeddings", {"input": ""}, "input", "empty"),
    ("/v1/embeddings", {"input": []}, "input", None),
    ("/v1/embeddings", {"input": ["w5", ""]}, "input[1]", "empty"),
    ("/v1/embeddings", {"input": [5] * 128}, "input", "max_model_len=128"),
    ("/v1/embeddings", {"input": [[5, 6], [7, 101]]}, "input[1]", "[0, 101)"),
    ("/v1/embeddings", {"input": "w5", "dimensions": 6}, "dimensions", "one of [4, 8]"),
    ("/v1/embeddings", {"input": "w5", "dimensions": 0}, "dimensions", None),
    ("/v1/embeddings", {"input": "w5", "encoding_format": "int8"}, "encoding_format", None),
    ("/v1/embeddings", {"input": "w5", "encoding_format": "bytes_only"}, "encoding_format", None),
    ("/v1/embeddings", {"input": "w5", "embed_dtype": "int8"}, "embed_dtype", None),
    ("/pooling", {"input": "w5", "embed_dtype": 32}, "embed_dtype", None),
    ("/v1/embeddings", {"input": "w5", "endianness": "middle"}, "endianness", None),
    ("/pooling", {"input": "w5", "endianness": ["big"]}, "endianness", None),
    ("/v1/embeddings", {"input": "w5", "truncation_side": "middle"}, "truncation_side", None),
    ("/classify", {"input": "w5", "truncation_side": True}, "truncation_side", None),
    ("/v1/embeddings", {"input": "w5", "cache_salt": ""}, "cache_salt", None),
    ("/pooling", {"input": "w5", "cache_salt": "s" * 1025}, "cache_salt", None),
    ("/v1/rerank", {"query": "w5", "documents": ["w6"], "cache_salt": 5}, "cache_salt", None),
    ("/score", {"text_1": "w5", "text_2": "w6", "cache_salt": ["s"]}, "cache_salt", None),
    ("/v1/embeddings", {"input": "w5", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "or -1"),
    ("/pooling", {"input": "w5", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", None),
    ("/classify", {"input": "w5"}, "model", "embed model"),
    ("/pooling", {"input": "w5", "task": "bogus"}, "task", None),
    ("/pooling", {"input": "w5", "task": "score"}, "task", None),
    ("/pooling", {"input": "w5", "task": "token_embed", "dimensions": 0}, "dimensions", None),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "items"),
    ("/score", {"queries": ["a", "b"], "items": ["c", "d", "e"]}, "queries", "items"),
    ("/score", {"data_1": "w5", "data_2": []}, "data_2", None),
    ("/score", {"documents": 5, "queries": "w5"}, "documents", None),
    ("/score", {}, "text_1", "queries"),
    ("/score", {"text_1": "w5"}, "text_2", "required with text_1"),
    ("/v1/score", {"queries": "w5"}, "documents", "required with queries"),
    ("/v1/score", {"text_1": "w5", "documents": "w6"}, "text_1", "does not pair with documents"),
    ("/score", {"queries": "w5", "documents": "w6", "items": "w7"}, "items", "does not pair"),
    ("/rerank", {"query": "w5", "documents": []}, "documents", None),
    ("/rerank", {"query": "w5", "documents": ["w6", ""]}, "documents[1]", "empty"),
    ("/v1/score", {"queries": ["w5", "w6"], "documents": ["w7", ""]}, "documents[1]", "empty"),
    (
        "/score",
        {"text_1": "w5", "text_2": "w6", "truncate_prompt_tokens": 0},
        "truncate_prompt_tokens",
        None,
    ),
    (
        "/v1/score",
        {"text_1": "w5", "text_2": "w6", "truncate_prompt_tokens": "2"},
        "truncate_prompt_tokens",
        None,
    ),
    (
        "/rerank",
        {"query": "w5", "documents": ["w6"], "truncate_prompt_tokens": -2},
        "truncate_prompt_tokens",
        None,
    ),
    (
        "/v2/rerank",
        {"query": "w5", "documents": ["w6"], "truncate_prompt_tokens": True},
        "truncate_prompt_tokens",
        None,
    ),
    (
        "/rerank",
        {"query": "w5", "documents": ["w6 " * 130], "truncate_prompt_tokens": 129},
        "truncate_prompt_tokens",
        None,
    ),
    ("/v1/embeddings", {"input": "w5", "use_activation": "yes"}, "use_activation", None),
    ("/pooling", {"input": "w5", "use_activation": 1}, "use_activation", None),
    (
        "/v1/rerank",
        {"query": "w5", "documents": ["w6"], "use_activation": [True]},
        "use_activation",
        None,
    ),
    ("/tokenize", {"prompt": "w5", "return_token_strs": "yes"}, "return_token_strs", None),
    ("/tokenize", {"messages": CHAT, "return_token_strs": 1}, "return_token_strs", None),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 1}, "model", "runner='pooling'"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w5"}]},
        "model",
        "runner='pooling'",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_INPUT)
def test_bad_input_is_400_naming_the_field(http, path, body, param, words):
    response = http.post(path, json={"model": NAME, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words is None or words in error["message"], error


def test_bench_serve_loads_the_embeddings_route(pooling_server, tmp_path):
    """`xlaserve bench serve --backend openai-embeddings`: every prompt embedded once (after one untimed
    request), the input tokens counted from the server's usage, the latency percentiles end to end."""
    from xlaserve.entrypoints import cli
    from xlaserve.entrypoints.bench.offline import workload

    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", pooling_server[0].url, "--backend", "openai-embeddings",
            "--model", NAME, "--num-prompts", "4", "--max-concurrency", "2",
            "--output-json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert (run["num_requests"], run["num_failed"], run["max_concurrency"]) == (4, 0, 2)
    texts = [messages[-1]["content"] for messages in workload(4)]
    with httpx.Client(base_url=pooling_server[0].url, timeout=120) as http:
        tokens = sum(len(http.post("/tokenize", json={"prompt": t}).json()["tokens"]) for t in texts)
    assert run["input_tokens_per_s"] == pytest.approx(tokens / run["elapsed_s"])
    assert run["e2e_s"]["p50"] > 0 and run["ttft_s"] == {} and run["output_tokens_per_s"] == 0


def _split_floats(body):
    """The body less its per-request id and time, its floats zeroed; and those floats, in order."""
    floats = []

    def split(x):
        if isinstance(x, float):
            floats.append(x)
            return 0.0
        if isinstance(x, dict):
            return {k: split(v) for k, v in x.items() if k not in ("id", "created")}
        return [split(v) for v in x] if isinstance(x, list) else x

    return split(body), floats


def test_run_batch_lines_are_the_servers(pooling_model, http, tmp_path, monkeypatch):
    """`xlaserve run-batch` on this model (in process, its own engine, compiled as the server's): its
    /v1/embeddings, /v1/score and /v1/rerank lines, and a chat line the pooling runner refuses, are
    answered as this server answers the same bodies."""
    lines = {
        "embed": ("/v1/embeddings", {"model": NAME, "input": ["w5 w6 w7 w8", "w11 w12"]}),
        "score": ("/v1/score", {"model": NAME, "text_1": "w5 w6", "text_2": ["w7 w8 w9", "w11"]}),
        "rerank": ("/v1/rerank", {"model": NAME, "query": "w5 w6", "documents": ["w7 w8 w9", "w11"]}),
        "chat": ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "w5"}]}),
    }
    with open(tmp_path / "in.jsonl", "w") as f:
        for custom_id, (url, body) in lines.items():
            f.write(json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n")
    monkeypatch.setenv("XLA_FLAGS", TINY_PROCESS_XLA_FLAGS)  # the engine core's, as the server's
    argv = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    argv += ["--model", pooling_model[1], *engine_flags(tiny=True), *FLAGS, "--disable-progress-bar"]
    assert main(argv) == 0
    with open(tmp_path / "out.jsonl") as f:
        results = [json.loads(line) for line in f]
    assert [r["custom_id"] for r in results] == list(lines)
    for result, (url, body) in zip(results, lines.values(), strict=True):
        reply = http.post(url, json=body)
        assert result["response"]["status_code"] == reply.status_code
        got, got_floats = _split_floats(result["response"]["body"])
        expected, expected_floats = _split_floats(reply.json())
        assert got == expected
        assert got_floats == pytest.approx(expected_floats, abs=TOL)
    assert [r["response"]["status_code"] for r in results] == [200, 200, 200, 400]

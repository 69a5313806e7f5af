"""An encoder-only cross-encoder on a real pooling server (`xlaserve serve --runner pooling`, one
subprocess for the module, a tiny random BertForSequenceClassification): /rerank scores against Hugging
Face, /classify's `label` from config.json's id2label, /classify's chat-style input (`messages`) and its
bad forms, and a prompt over max_model_len as a 400 naming the field. The server warms up under the
strict compile guard: the encoder compiles nothing after it.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from helpers.encoder_cases import make_encoder
from helpers.family_cases import one_torch_thread  # noqa: F401 (autouse: HF on one thread)
from helpers.server_harness import running_server
from helpers.tiny_models import TINY_PROCESS_ENV

TOL = 1e-4
NAME = "tiny-cross-encoder"
FLAGS = ["--runner", "pooling", "--served-model-name", NAME, "--max-model-len", "32",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--block-size", "8",
         # A template for /classify's chat-style input: [CLS], the contents joined, [SEP].
         "--chat-template", "[CLS]{% for m in messages %} {{ m['content'] }}{% endfor %} [SEP]"]  # fmt: skip


@pytest.fixture(scope="module")
def encoder_server(tmp_path_factory, server_cache_dir):
    model, tokenizer, path = make_encoder(
        tmp_path_factory,
        "bert_ce_server",
        "BertConfig",
        "BertForSequenceClassification",
        seed=4,
        num_labels=1,
    )
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "id2label": {"0": "relevant"}, "label2id": {"relevant": 0}}, f)
    logs = str(tmp_path_factory.mktemp("encoder-logs"))
    with running_server(logs, server_cache_dir, extra_args=FLAGS, model=path, env=TINY_PROCESS_ENV) as proc:
        with httpx.Client(base_url=proc.url, timeout=120) as client:
            yield client, model, tokenizer


def _hf_score(model, tokenizer, query: str, document: str) -> float:
    with torch.no_grad():
        return torch.sigmoid(
            model(**tokenizer(query, text_pair=document, return_tensors="pt")).logits[0, 0]
        ).item()


def test_rerank_matches_hf(encoder_server):
    http, model, tokenizer = encoder_server
    query, documents = "w5 w6 w7", ["w8 w9", "w10 w11 w12 w13 w14", "w20"]
    response = http.post("/rerank", json={"model": NAME, "query": query, "documents": documents})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert len(results) == 3
    for r in results:
        assert abs(r["relevance_score"] - _hf_score(model, tokenizer, query, documents[r["index"]])) < TOL
    # vLLM's use_activation: false scores with the logit itself, and classifies with the logits.
    body = {"model": NAME, "text_1": query, "text_2": documents[0], "use_activation": False}
    (logit,) = http.post("/v1/score", json=body).json()["data"]
    with torch.no_grad():
        expected = model(**tokenizer(query, text_pair=documents[0], return_tensors="pt")).logits[0, 0].item()
    assert abs(logit["score"] - expected) < TOL
    body = {"model": NAME, "input": [query, documents[0]], "use_activation": False}
    raw = http.post("/classify", json=body).json()["data"]
    with torch.no_grad():
        logits = [model(**tokenizer(t, return_tensors="pt")).logits[0, 0].item() for t in body["input"]]
    assert [abs(r["probs"][0] - x) < TOL for r, x in zip(raw, logits, strict=True)] == [True, True]


def test_classify_labels_come_from_id2label(encoder_server):
    http, model, tokenizer = encoder_server
    response = http.post("/classify", json={"model": NAME, "input": ["w5 w6", "w7"]})
    assert response.status_code == 200, response.text
    for item, text in zip(response.json()["data"], ["w5 w6", "w7"]):
        assert item["label"] == "relevant" and item["num_classes"] == 1
        with torch.no_grad():
            logit = model(**tokenizer(text, return_tensors="pt")).logits[0, 0]
        assert abs(item["probs"][0] - torch.sigmoid(logit).item()) < TOL


CHAT = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8"}]


def test_classify_takes_messages_as_their_rendered_template(encoder_server):
    """vLLM's chat-style /classify: `messages` rendered with the chat template (as /tokenize renders
    them) classify as the same token ids sent as `input`."""
    http, model, tokenizer = encoder_server
    ids = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert ids == tokenizer("w5 w6 w7 w8")["input_ids"]  # [CLS] w5 w6 w7 w8 [SEP]
    chat = http.post("/classify", json={"model": NAME, "messages": CHAT})
    assert chat.status_code == 200, chat.text
    as_ids = http.post("/classify", json={"model": NAME, "input": ids}).json()
    assert chat.json()["data"][0]["probs"] == as_ids["data"][0]["probs"]
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "w5", "messages": CHAT}, "messages", "not both"),
        ({}, "input", "messages"),
        ({"messages": []}, "messages", None),
        ({"messages": [{"role": "robot", "content": "w5"}]}, "messages[0].role", None),
        ({"input": "w5", "add_generation_prompt": True}, "add_generation_prompt", "messages"),
        ({"messages": CHAT, "chat_template_kwargs": 5}, "chat_template_kwargs", None),
        ({"messages": [{"role": "user", "content": "w5 " * 40}]}, "messages", "max_model_len=32"),
    ],
)
def test_bad_classify_messages_are_400_naming_the_field(encoder_server, body, param, words):
    http, _, _ = encoder_server
    response = http.post("/classify", json={"model": NAME, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words is None or words in error["message"], error
    assert http.get("/health").status_code == 200


def test_prompt_over_max_model_len_is_400(encoder_server):
    http, _, _ = encoder_server
    response = http.post("/classify", json={"model": NAME, "input": " ".join(["w5"] * 40)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and "max_model_len=32" in error["message"], error

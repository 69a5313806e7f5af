"""Encoder-only pooling models offline (models/encoder.py, bert.py, modernbert.py): tiny random BERT,
ModernBERT and XLM-RoBERTa embedders and cross-encoders against Hugging Face (float32, 1e-4), a
sentence-transformers directory's defaults, whole-prompt scheduling, the limits, and batch invariance
in bfloat16.

Engines run enforce_eager (each compiles only the buckets it uses) and are shared per module."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from helpers.encoder_cases import VOCAB, make_encoder
from helpers.family_cases import one_torch_thread  # noqa: F401 (autouse: HF on one thread)
from xlaserve import LLM
from xlaserve.pooling_params import PoolingParams

TOL = 1e-4
ARGS = {
    "runner": "pooling",
    "dtype": "float32",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,  # the prompts below (5-42 tokens) never fit two by two: no chunks
    "block_size": 8,
    "enforce_eager": True,
}
# Lengths (with [CLS] and [SEP]): 5, 42, 3, 30 and 20 tokens.
TEXTS = [
    " ".join(f"w{5 + (7 * i + j) % (VOCAB - 5)}" for j in range(n)) for i, n in enumerate((3, 40, 1, 28, 18))
]


def _close(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    diff = float(np.abs(actual - expected).max())
    assert diff <= TOL * max(1.0, np.abs(expected).max())
    return diff


def _hidden(model, tokenizer, text, text_pair=None) -> np.ndarray:
    enc = tokenizer(text, text_pair=text_pair, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).last_hidden_state[0].numpy()


def _normalized(x):
    return x / np.linalg.norm(x)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_encoder(tmp_path_factory, "bert", "BertConfig", "BertModel", seed=0)


@pytest.fixture(scope="module")
def bert_llm(bert):
    return LLM(bert[2], **ARGS)


def test_bert_cls_embeddings_match_hf(bert, bert_llm):
    """CLS pooling (a BERT's default), normalized; prompts whole in one step beside others."""
    model, tokenizer, _ = bert
    assert bert_llm.engine_core.runner.pooler.pooling_type == "CLS"
    outputs = bert_llm.embed(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, outputs):
        assert out.prompt_token_ids == tokenizer(text)["input_ids"]
        _close(out.outputs.embedding, _normalized(_hidden(model, tokenizer, text)[0]))
    raw = bert_llm.encode(TEXTS[:2], pooling_task="encode", use_tqdm=False)
    for text, out in zip(TEXTS[:2], raw):
        _close(out.outputs.data, _hidden(model, tokenizer, text)[0])


def test_bert_mean_pooling_matches_hf(bert):
    model, tokenizer, path = bert
    llm = LLM(path, **ARGS, pooler_config={"pooling_type": "MEAN", "normalize": False})
    for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
        _close(out.outputs.embedding, _hidden(model, tokenizer, text).mean(0))


def test_encoder_limits_name_the_field(bert, bert_llm):
    too_long = [{"prompt_token_ids": [2] + [5] * 64 + [3]}]
    with pytest.raises(ValueError, match="too long"):
        bert_llm.embed(too_long)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(bert[2], **{**ARGS, "max_model_len": 66, "max_num_batched_tokens": 32})
    with pytest.raises(
        ValueError, match=r"\(encoder-only\) runs with tensor_parallel_size=1, pipeline_parallel_size=1"
    ):
        LLM(bert[2], **ARGS, pipeline_parallel_size=2)
    # Not a Matryoshka model (its config.json says nothing of it): no `dimensions`, as vLLM's.
    with pytest.raises(ValueError, match="^dimensions needs a Matryoshka model"):
        bert_llm.embed(TEXTS[:1], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="^pooler_config.dimensions needs a Matryoshka model"):
        LLM(bert[2], **ARGS, pooler_config={"dimensions": 8})
    assert not bert_llm.engine_core.has_unfinished_requests()


def test_bert_cross_encoder_scores_match_hf(tmp_path_factory):
    """BertForSequenceClassification with one label: pooler -> classifier on [CLS], sigmoid; the
    pair's second text has token type 1 (after the first [SEP])."""
    model, tokenizer, path = make_encoder(
        tmp_path_factory, "bert_ce", "BertConfig", "BertForSequenceClassification", seed=1, num_labels=1
    )
    llm = LLM(path, **ARGS)
    query, documents = TEXTS[0], TEXTS[1:4]
    for doc, out in zip(documents, llm.score(query, documents, use_tqdm=False)):
        enc = tokenizer(query, text_pair=doc, return_tensors="pt")
        with torch.no_grad():
            expected = torch.sigmoid(model(**enc).logits[0, 0]).item()
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()
        assert abs(out.outputs.score - expected) < TOL


def test_xlm_roberta_classifier_matches_hf(tmp_path_factory):
    """XLMRobertaForSequenceClassification (3 labels): positions from pad_token_id + 1, RoBERTa's
    dense -> tanh -> out_proj head; raw logits and softmax."""
    model, tokenizer, path = make_encoder(
        tmp_path_factory,
        "xlmr_cls",
        "XLMRobertaConfig",
        "XLMRobertaForSequenceClassification",
        seed=2,
        num_labels=3,
        pad_token_id=0,
        type_vocab_size=1,
    )
    llm = LLM(path, **ARGS)
    raw = llm.classify(TEXTS, PoolingParams(activation=False), use_tqdm=False)
    probs = llm.classify(TEXTS, use_tqdm=False)
    for text, r, p in zip(TEXTS, raw, probs):
        with torch.no_grad():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        _close(r.outputs.probs, logits.numpy())
        _close(p.outputs.probs, torch.softmax(logits, -1).numpy())


def test_bert_token_classifier_and_token_embeddings_match_hf(tmp_path_factory, bert, bert_llm):
    """BertForTokenClassification (5 labels): its `classifier` on every token's state (no pooler),
    per-token logits and softmax; and a BERT embedder's token_embed, one normalized row a token."""
    model, tokenizer, path = make_encoder(
        tmp_path_factory, "bert_tok", "BertConfig", "BertForTokenClassification", seed=3, num_labels=5
    )
    llm = LLM(path, **ARGS)
    raw = llm.encode(TEXTS, PoolingParams(task="token_classify", activation=False), use_tqdm=False)
    probs = llm.encode(TEXTS, pooling_task="token_classify", use_tqdm=False)
    for text, r, p in zip(TEXTS, raw, probs):
        with torch.no_grad():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        assert r.outputs.data.shape == (len(tokenizer(text)["input_ids"]), 5)
        _close(r.outputs.data, logits.numpy())
        _close(p.outputs.data, torch.softmax(logits, -1).numpy())
    embedder, embed_tokenizer, _ = bert
    for text, out in zip(TEXTS[:2], bert_llm.encode(TEXTS[:2], pooling_task="token_embed", use_tqdm=False)):
        hidden = _hidden(embedder, embed_tokenizer, text)
        _close(out.outputs.data, hidden / np.linalg.norm(hidden, axis=-1, keepdims=True))


MODERNBERT = dict(
    local_attention=8,  # a window of 4 positions either side on the local layer
    global_attn_every_n_layers=2,  # layer 0 global, layer 1 local
    pad_token_id=0,
    cls_token_id=2,
    sep_token_id=3,
    bos_token_id=2,
    eos_token_id=3,
)


def test_modernbert_embeddings_match_hf(tmp_path_factory):
    """ModernBertModel: pre-norm layers without biases, rotary positions, a global layer then a local
    one whose window (4 positions either side) masks most keys of these 20-42-token prompts, GeGLU, a
    final norm. CLS (its default) and MEAN pooling against Hugging Face's last hidden state."""
    model, tokenizer, path = make_encoder(
        tmp_path_factory,
        "modernbert",
        "ModernBertConfig",
        "ModernBertModel",
        seed=3,
        **MODERNBERT,
    )
    assert model.config.layer_types == ["full_attention", "sliding_attention"]

    def hidden(text):
        enc = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            return model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state[
                0
            ]

    cls_llm = LLM(path, **ARGS)
    assert cls_llm.engine_core.runner.pooler.pooling_type == "CLS"
    mean_llm = LLM(path, **ARGS, pooler_config={"pooling_type": "MEAN", "normalize": False})
    for text, cls, mean in zip(
        TEXTS, cls_llm.embed(TEXTS, use_tqdm=False), mean_llm.embed(TEXTS, use_tqdm=False)
    ):
        expected = hidden(text).numpy()
        _close(cls.outputs.embedding, _normalized(expected[0]))
        _close(mean.outputs.embedding, expected.mean(0))


def test_modernbert_classifier_matches_hf(tmp_path_factory):
    """ModernBertForSequenceClassification (3 labels, classifier_pooling "mean"): the head (dense ->
    GELU -> LayerNorm -> classifier) on the host, on the MEAN-pooled state its config names; raw logits
    and softmax."""
    model, tokenizer, path = make_encoder(
        tmp_path_factory,
        "modernbert_cls",
        "ModernBertConfig",
        "ModernBertForSequenceClassification",
        seed=4,
        num_labels=3,
        classifier_pooling="mean",
        **MODERNBERT,
    )
    llm = LLM(path, **ARGS)
    assert llm.engine_core.runner.pooler.pooling_type == "MEAN"
    raw = llm.classify(TEXTS, PoolingParams(activation=False), use_tqdm=False)
    probs = llm.classify(TEXTS, use_tqdm=False)
    for text, r, p in zip(TEXTS, raw, probs):
        enc = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[0]
        _close(r.outputs.probs, logits.numpy())
        _close(p.outputs.probs, torch.softmax(logits, -1).numpy())


def test_sentence_transformers_defaults(tmp_path_factory):
    """An XLM-RoBERTa (bge-m3 style) sentence-transformers directory: MEAN pooling from
    1_Pooling/config.json, normalized by its Normalize module; max_model_len 64 (66 positions less
    pad_token_id + 1)."""
    model, tokenizer, path = make_encoder(
        tmp_path_factory,
        "xlmr_st",
        "XLMRobertaConfig",
        "XLMRobertaModel",
        seed=3,
        pad_token_id=0,
        type_vocab_size=1,
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}, f)
    llm = LLM(path, **ARGS)
    pooler = llm.engine_core.runner.pooler
    assert (pooler.pooling_type, pooler.normalize, llm.engine_core.max_model_len) == ("MEAN", True, 64)
    for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
        _close(out.outputs.embedding, _normalized(_hidden(model, tokenizer, text).mean(0)))


def test_pooled_bits_alone_and_batched_in_bfloat16(bert):
    """A prompt alone (bucket 16) and at offset 5 among others (bucket 32): the same embedding, bit
    for bit."""
    llm = LLM(bert[2], **{**ARGS, "dtype": "bfloat16"})
    alone = llm.embed(TEXTS[2:3], use_tqdm=False)[0].outputs.embedding
    batched = llm.embed([TEXTS[0], TEXTS[2], TEXTS[4]], use_tqdm=False)[1].outputs.embedding
    assert np.array_equal(alone, batched)


def test_pooling_bench_pairs_the_engine_with_hf(bert, tmp_path):
    """`xlaserve bench throughput --runner pooling --backend hf`: both backends pool the same token ids
    (the chat workload's user turns, tokenized by the model's tokenizer), the ratio is of their
    sequences/s, and the pooled states agree (a fast wrong answer is not a result)."""
    import json

    from xlaserve.entrypoints import cli

    out = tmp_path / "pooling.json"
    engine = ["--runner", "pooling", "--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens",
              "64", "--block-size", "8", "--enforce-eager"]  # fmt: skip
    argv = ["bench", "throughput", "--model", bert[2], "--backend", "hf", "--num-prompts", "6"]
    assert cli.main([*argv, *engine, "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    ours, theirs = report["xlaserve"], report["hf"]
    assert (report["task"], report["pooling_type"]) == ("embed", "CLS")
    assert ours["num_requests"] == theirs["num_requests"] == 6
    assert ours["input_tokens"] == theirs["input_tokens"] > 6 * 3
    assert report["ratio_requests_per_s"] == pytest.approx(ours["requests_per_s"] / theirs["requests_per_s"])
    assert report["max_abs_diff"] < TOL

"""Pooling models offline (runner="pooling"): embeddings, classification and scores of tiny random
decoders against Hugging Face (float32, 1e-4), chunked prefill against whole prompts (bfloat16,
bit for bit), and the embedded SmolLM2 as a LAST-pooled embedder.

The engines run enforce_eager (each compiles only the buckets it uses); the pooling server's tests
(test_pooling_server.py) warm up under the strict compile guard: pooling adds no program to the step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from helpers.family_cases import (
    BASE,
    FAMILIES,
    make_hf_model,
    one_torch_thread,  # noqa: F401 (autouse: HF on one thread)
    save_hf_model,
    word_tokenizer,
)
from helpers.smollm2 import ENGINE_ARGS
from xlaserve import LLM
from xlaserve.config import ModelConfig
from xlaserve.pooling_params import PoolerConfig, PoolingParams
from xlaserve.worker.pooler import ClassifierHead, Pooler

TOL = 1e-4
ARGS = {
    "runner": "pooling",
    "dtype": "float32",
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,  # prompts of 20-45 tokens prefill in chunks
    "block_size": 8,
    "kv_cache_memory": 4 * 2**20,
    "enforce_eager": True,
}


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)  # ids from 3: no pad (0) inside a prompt (HF's classifiers look for it)
    return [rng.integers(3, BASE["vocab_size"], n).tolist() for n in (45, 7, 23, 1)]


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _hf_hidden(backbone, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return backbone(torch.tensor([ids])).last_hidden_state[0].float().numpy()


def _normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _close(actual, expected) -> None:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    assert np.abs(actual - expected).max() <= TOL * max(1.0, np.abs(expected).max())


def _classifier(architecture: str, num_labels: int, seed: int):
    config_class, kwargs = (
        ("LlamaConfig", BASE) if architecture.startswith("Llama") else FAMILIES["Qwen3ForCausalLM"]
    )
    config = getattr(transformers, config_class)(**kwargs, num_labels=num_labels, attn_implementation="eager")
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.2 * torch.randn_like(param)) if name.endswith(
                "norm.weight"
            ) else param.normal_(0, 0.15)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = make_hf_model("LlamaForCausalLM", seed=3)
    model.config.is_matryoshka = True  # in its config.json: `dimensions` may cut it (vLLM's rule)
    return model, save_hf_model(model, tmp_path_factory.mktemp("llama_embed"))


@pytest.fixture(scope="module")
def llama_last(llama):
    return LLM(llama[1], **ARGS)


def test_last_pooling_matches_hf(llama, llama_last):
    model, _ = llama
    prompts = _prompts(0)
    outputs = llama_last.embed(_ids(prompts), use_tqdm=False)
    for p, out in zip(prompts, outputs):
        assert out.prompt_token_ids == p
        _close(out.outputs.embedding, _normalized(_hf_hidden(model.model, p)[-1]))
    # Unnormalized, Matryoshka-truncated (then renormalized), and the raw pooled states.
    raw = llama_last.embed(_ids(prompts[:1]), PoolingParams(normalize=False), use_tqdm=False)[0]
    _close(raw.outputs.embedding, _hf_hidden(model.model, prompts[0])[-1])
    short = llama_last.embed(_ids(prompts[:1]), PoolingParams(dimensions=8), use_tqdm=False)[0]
    _close(short.outputs.embedding, _normalized(_hf_hidden(model.model, prompts[0])[-1][:8]))
    encoded = llama_last.encode(_ids(prompts[:1]), pooling_task="encode", use_tqdm=False)[0]
    _close(encoded.outputs.data, _hf_hidden(model.model, prompts[0])[-1])


def test_token_embeddings_match_hf_and_skip_the_prefix_cache(llama, llama_last):
    """token_embed: every prompt token's embedding (normalized rows, Matryoshka per row) from the
    LAST-pooled engine, beside plain embeddings in the same steps (a PoolingParams per prompt); a
    prompt whose prefix the cache holds (embedded just before) is computed whole, every row there."""
    model, _ = llama
    prompts = _prompts(8)
    llama_last.embed(_ids(prompts[:1]), use_tqdm=False)  # its blocks now in the prefix cache
    params = [
        PoolingParams(task="token_embed"),
        PoolingParams(task="embed"),
        PoolingParams(task="token_embed", dimensions=8),
        PoolingParams(task="embed", dimensions=8),
    ]
    outputs = llama_last.encode(_ids(prompts), params, use_tqdm=False)
    for p, pp, out in zip(prompts, params, outputs):
        hf = _hf_hidden(model.model, p)[:, : pp.dimensions]
        _close(out.outputs.data, _normalized(hf) if pp.task == "token_embed" else _normalized(hf[-1]))
    with pytest.raises(ValueError, match="pooling_params: 2 given for 4 prompts"):
        llama_last.encode(_ids(prompts), params[:2])


def test_embedding_scores_are_cosines(llama_last):
    a, b, c = _prompts(1)[:3]
    scores = llama_last.score(a, [b, c], use_tqdm=False)
    ea, eb, ec = (np.array(o.outputs.embedding) for o in llama_last.embed(_ids([a, b, c]), use_tqdm=False))
    assert [round(s.outputs.score, 5) for s in scores] == [round(float(ea @ eb), 5), round(float(ea @ ec), 5)]


def test_bad_pooling_requests_name_the_field(llama_last):
    p = _ids(_prompts(2)[:1])
    with pytest.raises(ValueError, match="dimensions must be <= 48"):
        llama_last.embed(p, PoolingParams(dimensions=49))
    with pytest.raises(ValueError, match="pooling_task 'classify' is not served by this embed model"):
        llama_last.classify(p)
    with pytest.raises(ValueError, match="pooling_task 'token_classify' is not served by this embed model"):
        llama_last.encode(p, pooling_task="token_classify")
    with pytest.raises(ValueError, match="step_tag_id needs an engine started with pooling_type 'STEP'"):
        llama_last.embed(p, PoolingParams(step_tag_id=5))
    with pytest.raises(ValueError, match="generate\\(\\) needs runner='generate'"):
        llama_last.generate(p)
    with pytest.raises(ValueError, match="prompt_token_ids must be token ids in \\[0, 101\\)"):
        llama_last.embed([{"prompt_token_ids": [5, 101]}])
    with pytest.raises(ValueError, match="too long"):
        llama_last.embed([{"prompt_token_ids": [5] * 128}])
    with pytest.raises(ValueError, match="empty"):
        llama_last.embed([{"prompt_token_ids": []}])
    assert not llama_last.engine_core.has_unfinished_requests()


def test_mean_pooling_matches_hf(llama):
    model, path = llama
    llm = LLM(path, **ARGS, pooler_config={"pooling_type": "MEAN"})
    assert llm.config.cache.enable_prefix_caching is False  # pooled tokens must all be computed
    prompts = _prompts(3)
    for p, out in zip(prompts, llm.embed(_ids(prompts), use_tqdm=False)):
        _close(out.outputs.embedding, _normalized(_hf_hidden(model.model, p).mean(0)))


@pytest.mark.parametrize(
    ("architecture", "num_labels"),
    [("Qwen3ForSequenceClassification", 1), ("LlamaForSequenceClassification", 3)],
)
def test_sequence_classifiers_match_hf(tmp_path, architecture, num_labels):
    model = _classifier(architecture, num_labels, seed=5)
    model.config.pad_token_id = 0
    path = save_hf_model(model, tmp_path)
    llm = LLM(path, **ARGS)
    prompts = _prompts(4)
    with torch.no_grad():
        logits = [model(torch.tensor([p])).logits[0].numpy() for p in prompts]
    raw = llm.classify(_ids(prompts), PoolingParams(activation=False), use_tqdm=False)
    probs = llm.classify(_ids(prompts), use_tqdm=False)
    for expected, r, pr in zip(logits, raw, probs):
        _close(r.outputs.probs, expected)
        activated = (
            torch.sigmoid(torch.tensor(expected))
            if num_labels == 1
            else torch.softmax(torch.tensor(expected), -1)
        )
        _close(pr.outputs.probs, activated.numpy())
    # token_classify: the sequence classifier's head on every token's state (softmax or sigmoid per row).
    rows = llm.encode(_ids(prompts[:1]), pooling_task="token_classify", use_tqdm=False)[0].outputs.data
    with torch.no_grad():
        logits = model.score(model.model(torch.tensor([prompts[0]])).last_hidden_state[0])
    activate = torch.sigmoid if num_labels == 1 else (lambda x: torch.softmax(x, -1))
    _close(rows, activate(logits).numpy())
    if num_labels == 1:  # a cross-encoder's score: the probability of the joined pair
        tok = word_tokenizer(BASE["vocab_size"])
        score = llm.score("w5 w6 w7", ["w8 w9", "w10"], use_tqdm=False)
        for s, second in zip(score, ["w8 w9", "w10"]):
            ids = tok("w5 w6 w7", text_pair=second)["input_ids"]
            with torch.no_grad():
                expected = torch.sigmoid(model(torch.tensor([ids])).logits[0, 0]).item()
            assert s.prompt_token_ids == ids and abs(s.outputs.score - expected) < TOL
    else:
        with pytest.raises(ValueError, match="one label"):
            llm.score("w5", "w6", use_tqdm=False)


def test_qwen3_reranker_layout_scores_with_its_yes_and_no_tokens(tmp_path):
    """Qwen3-Reranker's layout (a Qwen3ForCausalLM that answers "yes" or "no"), read as a one-label
    sequence classifier through vLLM's hf_overrides: its score is the two-way softmax of the last
    token's "no" and "yes" logits (here w8 and w9), against Hugging Face's causal LM."""
    model = make_hf_model("Qwen3ForCausalLM", seed=12)
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["w8", "w9"],
        "is_original_qwen3_reranker": True,
    }
    llm = LLM(save_hf_model(model, tmp_path), **ARGS, hf_overrides=overrides)
    assert llm.input_processor.pooling_task == "classify"
    tok = word_tokenizer(BASE["vocab_size"])
    no, yes = tok.convert_tokens_to_ids(["w8", "w9"])
    docs = ["w8 w9 w10", "w11 w12", "w13"]
    for doc, out in zip(docs, llm.score("w5 w6 w7", docs, use_tqdm=False)):
        ids = tok("w5 w6 w7", text_pair=doc)["input_ids"]
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1]
        assert out.prompt_token_ids == ids
        assert abs(out.outputs.score - torch.softmax(last[[no, yes]], -1)[1].item()) < TOL
    with pytest.raises(ValueError, match="classifier_from_token: \\['w9999'\\] are not tokens"):
        LLM(tmp_path, **ARGS, hf_overrides={**overrides, "classifier_from_token": ["w8", "w9999"]})
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        LLM(tmp_path, **ARGS, hf_overrides="[1]")


def test_token_classifiers_match_hf(tmp_path):
    """A *ForTokenClassification decoder (Hugging Face's generic one: `score` with its bias on every
    token's state): per-token logits and probabilities."""
    model = _classifier("Qwen3ForTokenClassification", 4, seed=9)
    llm = LLM(save_hf_model(model, tmp_path / "token"), **ARGS)
    assert llm.input_processor.pooling_task == "token_classify"
    prompts = _prompts(10)
    raw = llm.encode(_ids(prompts), PoolingParams(task="token_classify", activation=False), use_tqdm=False)
    probs = llm.encode(_ids(prompts), pooling_task="token_classify", use_tqdm=False)
    for p, r, pr in zip(prompts, raw, probs):
        with torch.no_grad():
            logits = model(torch.tensor([p])).logits[0]
        assert r.outputs.data.shape == (len(p), 4)
        _close(r.outputs.data, logits.numpy())
        _close(pr.outputs.data, torch.softmax(logits, -1).numpy())
    with pytest.raises(ValueError, match="pooling_task 'classify' is not served by this token_classify"):
        llm.classify(_ids(prompts[:1]))


def test_step_pooling_keeps_the_step_tags_rows_and_the_returned_columns(tmp_path):
    """A process reward model (vLLM's STEP pooling): the score head's outputs at the prompt's step tags,
    cut to returned_token_ids, against numpy on Hugging Face's hidden states; encode cuts the hidden
    states the same way. The Llama shapes of the tests above: their compiled programs serve it."""
    model = _classifier("LlamaForSequenceClassification", 3, seed=6)
    step, returned = 7, [2, 0]
    config = {"pooling_type": "STEP", "step_tag_id": step, "returned_token_ids": returned}
    llm = LLM(save_hf_model(model, tmp_path), **ARGS, convert="reward", pooler_config=config)
    assert llm.config.cache.enable_prefix_caching is False  # the steps' rows must all be computed
    prompts = [[5, 9, step, 11, 12, step, 4] * 4, [5, 6, 8], [step]]  # the first prefills in chunks
    rewards = llm.reward(_ids(prompts), use_tqdm=False)
    hidden = llm.encode(_ids(prompts), pooling_task="encode", use_tqdm=False)
    for p, reward, states in zip(prompts, rewards, hidden):
        hf = _hf_hidden(model.model, p)[np.asarray(p) == step]  # [num_steps, D]
        with torch.no_grad():
            logits = model.score(torch.from_numpy(hf)).numpy()  # [num_steps, 3]
        assert reward.outputs.data.shape == (p.count(step), len(returned))
        assert states.outputs.data.shape == (p.count(step), len(returned))
        if p.count(step):  # a prompt without a step tag: no rows
            _close(reward.outputs.data, logits[:, returned])
            _close(states.outputs.data, hf[:, returned])
    # A request's own STEP settings (vLLM's PoolingParams.step_tag_id, returned_token_ids) over the
    # engine's: another tag, another column.
    other = PoolingParams(task="reward", step_tag_id=11, returned_token_ids=[1])
    out = llm.reward(_ids(prompts[:1]), other, use_tqdm=False)[0]
    hf = _hf_hidden(model.model, prompts[0])[np.asarray(prompts[0]) == 11]
    with torch.no_grad():
        logits = model.score(torch.from_numpy(hf)).numpy()
    assert out.outputs.data.shape == (4, 1)
    _close(out.outputs.data, logits[:, [1]])
    with pytest.raises(ValueError, match="returned_token_ids must be < 3 \\(the width of this reward"):
        llm.reward(_ids(prompts[:1]), PoolingParams(task="reward", returned_token_ids=[3]))
    with pytest.raises(ValueError, match="returned_token_ids must be a non-empty list"):
        PoolingParams(task="reward", returned_token_ids=[])


def test_step_pooling_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="step_tag_id needs pooling_type 'STEP', got pooling_type='ALL'"):
        PoolerConfig(pooling_type="ALL", step_tag_id=7)
    with pytest.raises(ValueError, match="returned_token_ids must be a non-empty list of ints >= 0"):
        PoolerConfig(pooling_type="STEP", returned_token_ids=[1, -1])
    with pytest.raises(ValueError, match="step_tag_id must be a token id"):
        PoolerConfig(pooling_type="STEP", step_tag_id=True)
    head = ClassifierHead(out_weight=np.zeros((3, 48), np.float32))
    config = ModelConfig(runner="pooling", pooler_config={"pooling_type": "STEP", "returned_token_ids": [3]})
    with pytest.raises(ValueError, match="returned_token_ids must be < 3 \\(the width of this reward"):
        Pooler.from_config(config, "reward", head, hidden_size=48)
    assert Pooler.from_config(config, "embed", None, hidden_size=48).returned_token_ids == (3,)


def test_chunked_prefill_pools_the_same_bits_in_bfloat16(llama):
    """A prompt alone in one step, and split across steps beside another: the same embedding, bit for
    bit (batch invariance); a prefix-cache hit (LAST pooling keeps the cache) too."""
    _, path = llama
    llm = LLM(path, **{**ARGS, "dtype": "bfloat16", "long_prefill_token_threshold": 0})
    first, second = _prompts(6)[2][:10], _prompts(7)[2][:14]  # the second is split 6 + 8 beside the first
    alone = llm.embed(_ids([second]), use_tqdm=False)[0].outputs.embedding
    crowded = llm.embed(_ids([first, second]), use_tqdm=False)[1].outputs.embedding
    cached = llm.embed(_ids([second]), use_tqdm=False)[0].outputs.embedding
    assert np.array_equal(alone, crowded) and np.array_equal(alone, cached)


def test_smollm2_as_a_last_pooled_embedder(hf_model):
    """The embedded SmolLM2 (the session engine's shapes, so its programs are the generate engine's)."""
    llm = LLM(**{**ENGINE_ARGS, "runner": "pooling", "enforce_eager": True, "strict_compile_guard": False})
    texts = ["The capital of France is", "Embeddings map text to vectors."]
    outputs = llm.embed(texts, use_tqdm=False)
    for out in outputs:
        assert out.outputs.hidden_size == hf_model.config.hidden_size
        _close(out.outputs.embedding, _normalized(_hf_hidden(hf_model.model, out.prompt_token_ids)[-1]))

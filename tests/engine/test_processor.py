"""InputProcessor: every token id a request carries is checked against the vocabulary at admission.

An id past the vocabulary used to reach the step (the min_tokens ban indexes a [R, V] array with it)
and kill the engine core; here it is a ValueError that names the field and the limit.
"""

from __future__ import annotations

import numpy as np
import pytest

from xlaserve.core.limits import RequestLimits
from xlaserve.engine.processor import InputProcessor
from xlaserve.sampling_params import SamplingParams

VOCAB = 100


@pytest.fixture
def processor():
    return InputProcessor(tokenizer=None, max_model_len=64, vocab_size=VOCAB, eos_token_id=2, seed=0)


def test_stop_token_id_past_the_vocabulary_is_rejected(processor):
    params = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[VOCAB])
    with pytest.raises(ValueError, match=r"^stop_token_ids must be token ids in \[0, 100\).*\[100\]"):
        processor.make_requests("r", [1, 2, 3], params)


def test_valid_ids_pass(processor):
    params = SamplingParams(max_tokens=4, stop_token_ids=[0, VOCAB - 1])
    (request,) = processor.make_requests("r", [0, VOCAB - 1], params)
    assert request.sampling_params.stop_token_ids == [0, VOCAB - 1]


def test_numpy_prompt_token_ids_are_ints(processor):
    """vLLM takes a prompt of numpy integers (its checks compare them); on the wire they are ints."""
    _, ids = processor.tokenize({"prompt_token_ids": np.array([1, 2, 3], dtype=np.int32)})
    (request,) = processor.make_requests("r", ids, SamplingParams(max_tokens=1))
    assert request.prompt_token_ids == [1, 2, 3] and all(type(t) is int for t in request.prompt_token_ids)


@pytest.mark.parametrize("bad", [VOCAB, 10**9, -1, True, 1.0])
def test_prompt_token_ids_outside_the_vocabulary(processor, bad):
    with pytest.raises(ValueError, match=r"^prompt_token_ids must be token ids in \[0, 100\)"):
        processor.make_requests("r", [1, bad], SamplingParams(max_tokens=1))


@pytest.mark.parametrize(
    "field, value",
    [
        ("logit_bias", {VOCAB: 1.0}),
        ("logit_bias", {3: -1.0, VOCAB + 7: 1.0}),
        ("allowed_token_ids", [3, VOCAB + 5]),
        ("bad_words_token_ids", [[3, 4], [VOCAB]]),
    ],
)
def test_every_token_id_field_is_checked(processor, field, value):
    params = SamplingParams(max_tokens=1, **{field: value})
    with pytest.raises(ValueError, match=rf"^{field} must be token ids in \[0, {VOCAB}\)"):
        processor.make_requests("r", [1], params)
    processor.validate_params(SamplingParams(max_tokens=1, **{field: _in_range(value)}))


def _in_range(value):
    if isinstance(value, dict):
        return {5: 1.0}
    return [[3]] if isinstance(value[0], list) else [3]


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
        (
            {"logit_bias": {5: float("inf")}},
            "logit_bias values must be finite float32 numbers, got inf for token 5",
        ),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values must be finite float32 numbers"),
        ({"logit_bias": {5: 1e39}}, "logit_bias values must be finite float32 numbers"),
        ({"logit_bias": {5: True}}, "logit_bias values must be finite float32 numbers"),
        ({"logit_bias": [5]}, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"allowed_token_ids": [3, -2]}, r"allowed_token_ids must be ints >= 0, got -2"),
    ],
)
def test_logit_bias_and_allowed_token_ids_are_checked(fields, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**fields)


def test_sampling_params_take_vllms_bias_and_refuse_greedy_children():
    """vLLM's constructor: a bias past OpenAI's [-100, 100] is kept as given (the HTTP routes clamp it),
    and n > 1 at temperature 0 is refused (every child would be the same sequence); a tiny temperature is
    raised to vLLM's 0.01 first, so it samples."""
    assert SamplingParams(logit_bias={5: 250.0, 6: -1e9}).logit_bias == {5: 250.0, 6: -1e9}
    for temperature in (0.0, 0):
        with pytest.raises(ValueError, match=r"^n must be 1 when using greedy sampling, got 2$"):
            SamplingParams(n=2, temperature=temperature)
    assert SamplingParams(n=2, temperature=1e-6).temperature == 0.01
    assert SamplingParams(n=1, temperature=0.0).is_greedy


def test_seed_minus_one_is_unseeded(processor):
    """seed=-1 is vLLM's "no seed": every request (and each of its n samples) draws a seed of its own,
    not the fixed seed -1 (which gave every such request the same tokens)."""
    assert SamplingParams(seed=-1).seed is None
    seeds = [
        r.sampling_seed
        for _ in range(2)
        for r in processor.make_requests("r", [1, 2], SamplingParams(n=2, seed=-1, max_tokens=1))
    ]
    assert len(set(seeds)) == 4
    assert [r.sampling_seed for r in processor.make_requests("s", [1], SamplingParams(seed=5, n=2))] == [5, 6]


def test_the_generation_configs_eos_ids_stop_every_request():
    """The generation config's EOS ids past the tokenizer's (Llama 3's <|eot_id|>) join each request's
    stop_token_ids, after its own and once each, so min_tokens keeps them out and one ends the request
    (vLLM's update_from_generation_config); ignore_eos leaves them out; ids past the vocabulary are
    dropped."""
    processor = InputProcessor(
        None,
        max_model_len=64,
        vocab_size=VOCAB,
        eos_token_id=2,
        seed=0,
        generation_eos_token_ids=(2, 7, 9, VOCAB),
    )
    (request,) = processor.make_requests(
        "r", [1], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[9, 5])
    )
    assert request.sampling_params.stop_token_ids == [9, 5, 7]
    (request,) = processor.make_requests("s", [1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert request.sampling_params.stop_token_ids == []


def test_check_fits_names_the_context_and_the_cache():
    # 64 tokens of context, blocks of 4, 10 blocks in the cache: 40 tokens at most per request.
    processor = InputProcessor(None, 64, VOCAB, 2, 0, RequestLimits(64, 4, 10))
    processor.check_fits(30, 10)  # 40 tokens: 10 blocks, fits
    with pytest.raises(ValueError, match=r"maximum context length is 64 tokens, but 65 were requested"):
        processor.check_fits(60, 5)
    with pytest.raises(ValueError, match=r"^max_tokens: the request needs 11 KV cache blocks .* only 10"):
        processor.check_fits(30, 11)
    InputProcessor(None, 64, VOCAB, 2, 0).check_fits(30, 20)  # no limits given: the context alone


def test_bad_words_become_token_ids_by_vllms_rule():
    """vLLM's rule: each bad word left-stripped (its trailing whitespace kept), and after a space only
    where that gives a new first token and as many tokens; checked against the vocabulary. A word of
    several tokens makes the ban follow the output (no drafts, core/spec_decode)."""
    from helpers.tiny_models import small_byte_tokenizer

    tokenizer = small_byte_tokenizer()
    processor = InputProcessor(tokenizer, 64, len(tokenizer), 2, 0)

    def bad_words_token_ids(*words):
        (request,) = processor.make_requests("r", [1, 2], SamplingParams(max_tokens=4, bad_words=list(words)))
        return request.sampling_params.bad_words_token_ids

    # This tokenizer: "tags" [314], " tags" [260, 273] (two tokens: left out); "cd" [266], " cd" [272];
    # "ab" [265], " ab" [221, 265] (the space its own token: left out); "cd " [266, 221].
    assert bad_words_token_ids("tags", "cd") == [[314], [266], [272]]
    assert bad_words_token_ids("ab") == [[265]]
    assert bad_words_token_ids(" cd ") == [[266, 221], [272, 221]]
    assert bad_words_token_ids("tag") == [[84, 259], [260, 259]]
    (request,) = processor.make_requests("r", [1, 2], SamplingParams(max_tokens=4, bad_words=["cd"]))
    assert not request.sampling_params.bans_follow_output
    (request,) = processor.make_requests("r", [1, 2], SamplingParams(max_tokens=4, bad_words=["tag"]))
    assert request.sampling_params.bans_follow_output
    with pytest.raises(ValueError, match="^bad_words need a tokenizer"):
        InputProcessor(None, 64, VOCAB, 2, 0).make_requests("r", [1], SamplingParams(bad_words=["x"]))


def test_dimensions_only_on_a_matryoshka_model_and_its_sizes():
    """vLLM's rule: `dimensions` needs config.json's is_matryoshka (any size up to the hidden size) or
    matryoshka_dimensions (those sizes only); the message names the field, which the routes' 400 name."""
    from xlaserve.pooling_params import PoolingParams

    def embedder(**matryoshka):
        return InputProcessor(None, 64, VOCAB, 2, 0, pooling_task="embed", hidden_size=48, **matryoshka)

    embedder().validate_pooling(PoolingParams())
    with pytest.raises(ValueError, match="^dimensions needs a Matryoshka model"):
        embedder().validate_pooling(PoolingParams(dimensions=8))
    embedder(is_matryoshka=True).validate_pooling(PoolingParams(task="token_embed", dimensions=7))
    with pytest.raises(ValueError, match="^dimensions must be <= 48"):
        embedder(is_matryoshka=True).validate_pooling(PoolingParams(dimensions=49))
    listed = embedder(is_matryoshka=True, matryoshka_dimensions=[8, 16])
    listed.validate_pooling(PoolingParams(dimensions=16))
    with pytest.raises(ValueError, match=r"^dimensions must be one of \[8, 16\] .*, got 12"):
        listed.validate_pooling(PoolingParams(dimensions=12))


def test_truncation_side_keeps_the_first_or_the_last_tokens(processor):
    ids = list(range(10, 20))
    assert processor.truncate(ids, 3) == [17, 18, 19]  # vLLM's default side: left
    assert processor.truncate(ids, 3, side="right") == [10, 11, 12]
    assert processor.truncate(ids, 30, side="right") == ids
    assert processor.truncate(ids, -1, side="right", num_output_tokens=58) == ids[:6]

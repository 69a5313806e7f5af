"""Gemma 3 with images, offline: a tiny random Gemma3ForConditionalGeneration (SigLIP tower, pooled
projector, one sliding and one global decoder layer) against Hugging Face's, whose mask lets an image's
tokens attend to each other both ways. One engine for the module (float32, steps of 16 tokens, strict
compile guard); the prompts put an image across a 16-token chunk boundary, so the scheduler must move
the chunk's end to the image's first token."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.tiny_models import elemental_emitters
from helpers.tiny_vlm import (
    ENGINE_ARGS,
    GEMMA3_TOKENS_PER_IMAGE,
    hf_greedy,
    image_chat,
    random_image,
    save_tiny_gemma3,
)
from xlaserve import LLM, SamplingParams

STEP = ENGINE_ARGS["max_num_batched_tokens"]
# The image's four tokens sit at positions 15..18 (after the text and the "\n\n<start_of_image>" the
# processor puts before them), across the first chunk's end; 34 tokens in all.
PROMPT = "The quick brown fox. <start_of_image> What is it?"
SHORT = "The quick brown fox. <start_of_image> Why?"  # 27 tokens: one whole block, ending in the image
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_gemma3(str(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="module")
def llm(model_dir):
    with elemental_emitters():  # its tests compare it with Hugging Face's outputs only
        return LLM(model_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    import transformers

    from xlaserve.engine.mm_processor import MultiModalProcessor

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return model, MultiModalProcessor.for_model(model_dir, tokenizer).hf_processor


def _hf(hf, text: str, images: list, *, bidirectional: bool = True):
    """(greedy tokens, prompt ids, prompt logprobs): with the processor's token_type_ids (an image's
    tokens see each other), or without them (causal everywhere)."""
    model, processor = hf
    inputs = processor(text=text, images=images, return_tensors="pt")
    if not bidirectional:
        inputs.pop("token_type_ids")
    return hf_greedy(model, inputs)


def _mm(text: str, *images):
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def test_greedy_tokens_and_prompt_logprobs_match_hugging_face(llm, hf):
    image = random_image(1)
    hf_tokens, hf_ids, hf_logprobs = _hf(hf, PROMPT, [image])
    image_token_id = llm.input_processor.mm_processor.image_token_id
    first = hf_ids.index(image_token_id)
    assert first < STEP < first + GEMMA3_TOKENS_PER_IMAGE  # the image straddles the first chunk's end
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0)
    out = llm.generate(_mm(PROMPT, image), params, use_tqdm=False)[0]
    assert out.prompt_token_ids == hf_ids
    assert list(out.outputs[0].token_ids) == hf_tokens
    ours = np.array([entry[tid].logprob for entry, tid in zip(out.prompt_logprobs[1:], hf_ids[1:])])
    np.testing.assert_allclose(ours, hf_logprobs, atol=2e-4)
    # The check has teeth: a causal mask over the image moves these logprobs well past the tolerance.
    _, _, causal = _hf(hf, PROMPT, [image], bidirectional=False)
    assert np.abs(causal - hf_logprobs).max() > 1e-2
    assert llm.engine_core.runner.guard.num_unexpected == 0


def test_two_images_in_one_prompt_match_hugging_face(llm, hf):
    images = [random_image(2, (64, 40)), random_image(3)]
    text = "First <start_of_image> then <start_of_image> compare."
    hf_tokens, _, _ = _hf(hf, text, images)
    out = llm.generate(_mm(text, *images), GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_tokens


def test_a_prefix_hit_ending_inside_an_image_computes_the_rest_of_it(llm, hf):
    """The second run hits the first block (16 tokens: the first of the image's four), and computes
    the image's other three in its first chunk, attending to the cached one: HF's tokens again;
    another image shares nothing (the first block holds one of its tokens)."""
    llm.reset_prefix_cache()
    image = random_image(5)
    hf_tokens, hf_ids, _ = _hf(hf, SHORT, [image])
    first = llm.generate(_mm(SHORT, image), GREEDY, use_tqdm=False)[0]
    again = llm.generate(_mm(SHORT, image), GREEDY, use_tqdm=False)[0]
    image_token_id = llm.input_processor.mm_processor.image_token_id
    assert hf_ids.index(image_token_id) < STEP < hf_ids.index(image_token_id) + GEMMA3_TOKENS_PER_IMAGE
    assert again.num_cached_tokens == STEP
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == hf_tokens
    other = llm.generate(_mm(SHORT, random_image(6)), GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0


def test_a_causal_only_attention_is_refused_by_name(model_dir):
    """The reference and the Pallas kernel take `attend_ahead`; an attention that does not (the Triton
    kernel, context parallelism) is refused when the model is built, naming the backend."""
    import dataclasses
    import json

    from flax import nnx

    from xlaserve.kernels.backend import get_attention_backend
    from xlaserve.models.gemma3_vl import Gemma3ForConditionalGeneration, Gemma3VisionLanguageConfig

    with open(f"{model_dir}/config.json") as f:
        cfg = Gemma3VisionLanguageConfig.from_hf(json.load(f))
    assert get_attention_backend("reference").serves_attend_ahead
    assert get_attention_backend("pallas").serves_attend_ahead
    causal = dataclasses.replace(
        get_attention_backend("reference"), name="jax-triton", serves_attend_ahead=False
    )
    with pytest.raises(ValueError, match=r"^attention_backend 'jax-triton' does not serve Gemma 3's images"):
        Gemma3ForConditionalGeneration(cfg, causal, rngs=nnx.Rngs(0))


def test_chat_with_a_data_url_image_part(llm, hf):
    """An OpenAI image part becomes Gemma 3's `<start_of_image>` in the chat template's text."""
    image = random_image(30)
    out = llm.chat(image_chat(image), GREEDY, use_tqdm=False)[0]
    text = hf[1].tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is in it? <start_of_image>\n"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    hf_tokens, hf_ids, _ = _hf(hf, text, [image])
    assert out.prompt_token_ids == hf_ids
    assert list(out.outputs[0].token_ids) == hf_tokens


def test_bfloat16_bits_alone_and_among_companions(model_dir):
    """Batch invariance with images at the dtype users run: a prompt with an image alone, then among
    companions (with images and without: other token and request buckets, other chunk cuts, steps
    mixing prefill chunks and decodes), then again through the prefix cache: the same greedy tokens
    and logprobs, bit for bit. Every row of such a model takes the reference's jnp path (decode rows
    too), so no token's bits depend on how long its step's chunk was."""
    llm = LLM(
        model_dir,
        **{**ENGINE_ARGS, "dtype": "bfloat16", "kv_cache_memory": 2**20, "strict_compile_guard": False},
        enforce_eager=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    mine = _mm(PROMPT, random_image(7))
    others = [
        _mm(SHORT, random_image(8)),
        {"prompt": "Only text, a little longer than the others are."},
        _mm("First <start_of_image> then <start_of_image> compare.", random_image(9), random_image(10)),
    ]

    def numbers(prompts, row):
        o = llm.generate(prompts, params, use_tqdm=False)[row]
        entries = [sorted((i, lp.logprob) for i, lp in e.items()) for e in o.outputs[0].logprobs]
        return o.outputs[0].token_ids, entries, o.num_cached_tokens

    tokens, logprobs, _ = numbers([mine], 0)
    assert numbers(others[:1] + [mine], 1)[:2] == (tokens, logprobs)
    again = numbers(others + [mine], 3)
    assert again[:2] == (tokens, logprobs) and again[2] > 0


def test_a_prefill_cap_below_an_image_runs_on_to_its_end(model_dir, hf):
    """long_prefill_token_threshold 2, under the image's 4 tokens: the chunk that reaches the image runs
    on to its end (the step's budget holds it) instead of waiting forever; HF's tokens."""
    args = {**ENGINE_ARGS, "long_prefill_token_threshold": 2, "strict_compile_guard": False}
    llm = LLM(model_dir, **args, enforce_eager=True)
    image = random_image(11)
    hf_tokens, _, _ = _hf(hf, SHORT, [image])
    out = llm.generate(_mm(SHORT, image), GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_tokens

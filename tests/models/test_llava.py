"""LLaVA end to end, offline: a tiny random LlavaForConditionalGeneration against Hugging Face's, the
encoder cache and image-aware prefix caching. One engine for the module (float32, two token buckets,
strict compile guard: nothing compiles after warm-up, images included). A prompt's chunks are 16
tokens, so an image's placeholders span two of them."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.tiny_vlm import (
    ENGINE_ARGS,
    TOKENS_PER_IMAGE,
    hf_greedy,
    image_chat,
    random_image,
    save_tiny_llava,
)
from xlaserve import LLM, SamplingParams

BLOCK = ENGINE_ARGS["block_size"]
# Text before the image long enough for one whole block of text only.
PROMPT = "The quick brown fox jumps over the lazy dog 0123456789. <image> What is it?"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llava(str(tmp_path_factory.mktemp("tiny-llava")))


@pytest.fixture(scope="module")
def llm(model_dir):
    # The settings of test_server_images.py's server, so that whichever starts second loads the
    # programs the first stored (tests/helpers/server_harness.py: the suite's program store).
    return LLM(model_dir, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    import transformers

    from xlaserve.engine.mm_processor import MultiModalProcessor

    model = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return model, MultiModalProcessor.for_model(model_dir, tokenizer).hf_processor


def _hf_greedy(hf, text: str, images: list, max_tokens: int = 8):
    model, processor = hf
    return hf_greedy(model, processor(text=text, images=images, return_tensors="pt"), max_tokens)


def _mm(text: str, *images):
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def test_greedy_tokens_and_prompt_logprobs_match_hugging_face(llm, hf):
    image = random_image(1)
    hf_tokens, hf_ids, hf_logprobs = _hf_greedy(hf, PROMPT, [image])
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0)
    out = llm.generate(_mm(PROMPT, image), params, use_tqdm=False)[0]
    assert out.prompt_token_ids == hf_ids
    assert hf_ids.count(llm.input_processor.mm_processor.image_token_id) == TOKENS_PER_IMAGE
    assert list(out.outputs[0].token_ids) == hf_tokens
    ours = np.array([entry[tid].logprob for entry, tid in zip(out.prompt_logprobs[1:], hf_ids[1:])])
    np.testing.assert_allclose(ours, hf_logprobs, atol=2e-4)
    assert llm.engine_core.runner.guard.num_unexpected == 0  # the image's programs were warm


def test_two_images_in_one_prompt_match_hugging_face(llm, hf):
    images = [random_image(2, (64, 40)), random_image(3)]
    text = "First <image> then <image> compare."
    hf_tokens, _, _ = _hf_greedy(hf, text, images)
    out = llm.generate(_mm(text, *images), GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_tokens


def test_a_different_image_never_shares_the_image_blocks(llm):
    llm.reset_prefix_cache()
    first = llm.generate(_mm(PROMPT, random_image(10)), GREEDY, use_tqdm=False)[0]
    other = llm.generate(_mm(PROMPT, random_image(11)), GREEDY, use_tqdm=False)[0]
    image_offset = first.prompt_token_ids.index(llm.input_processor.mm_processor.image_token_id)
    assert other.prompt_token_ids == first.prompt_token_ids  # the same ids: only the pixels differ
    assert other.num_cached_tokens == image_offset // BLOCK * BLOCK  # the text block only
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_the_same_image_twice_hits_the_prefix_cache_and_the_encoder_cache(llm):
    llm.reset_prefix_cache()
    image = random_image(20)
    encoder = llm.engine_core.runner.mm_encoder
    manager = llm.engine_core.scheduler.encoder_cache
    manager.make_stats()
    encoded = encoder.num_encoded
    first = llm.generate(_mm(PROMPT, image), GREEDY, use_tqdm=False)[0]
    # The prompt's two chunks both read the image: it was encoded once.
    assert encoder.num_encoded == encoded + 1
    again = llm.generate(_mm(PROMPT, image), GREEDY, use_tqdm=False)[0]
    num_prompt = len(first.prompt_token_ids)
    assert again.num_cached_tokens == (num_prompt - 1) // BLOCK * BLOCK
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Other text before the same image: no prefix hit on its blocks, but no second encode either.
    other = llm.generate(_mm("Look: <image> What is it?", image), GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    assert encoder.num_encoded == encoded + 1
    stats = manager.make_stats()
    assert (stats.num_encoded, stats.num_hits) == (1, 1)


def test_preempted_requests_with_images_match_their_runs_alone(llm):
    """Four prompts with images at once need more KV blocks than the cache holds: they preempt each
    other, recompute with their images from the encoder cache, and end as each does alone."""
    prompts = [
        _mm(f"Item {i}: <image> describe it in detail please.", random_image(40 + i)) for i in range(4)
    ]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    scheduler, encoder = llm.engine_core.scheduler, llm.engine_core.runner.mm_encoder
    preemptions, encoded = scheduler.num_preemptions_total, encoder.num_encoded
    together = llm.generate(prompts, params, use_tqdm=False)
    num_preempted = scheduler.num_preemptions_total - preemptions
    assert num_preempted > 0
    # Once each, but for a preempted request whose image lost its slot meanwhile (never per chunk).
    assert 4 <= encoder.num_encoded - encoded <= 4 + num_preempted
    alone = [llm.generate(prompt, params, use_tqdm=False)[0] for prompt in prompts]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_chat_with_a_data_url_image_part(llm, hf):
    image = random_image(30)
    out = llm.chat(image_chat(image), GREEDY, use_tqdm=False)[0]
    text = hf[1].tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is in it? <image>\n"}], add_generation_prompt=True, tokenize=False
    )
    # The PNG round trip is lossless: the same pixels as the image itself.
    hf_tokens, hf_ids, _ = _hf_greedy(hf, text, [image])
    assert out.prompt_token_ids == hf_ids
    assert list(out.outputs[0].token_ids) == hf_tokens


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (_mm("no placeholder", random_image(1)), "0 <image> placeholders for 1 images"),
        (_mm("<image> <image>", random_image(1)), "2 <image> placeholders for 1 images"),
        (_mm("tiny <image>", random_image(1, (1, 1))), "each side must be at least"),
        ({"prompt": "x", "multi_modal_data": {"audio": [1]}}, "multi_modal_data must be"),
    ],
)
def test_bad_image_prompts_are_refused_naming_the_field(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY, use_tqdm=False)

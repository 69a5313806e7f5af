"""Gemma 3 with images, offline: a tiny random Gemma3ForConditionalGeneration (SigLIP tower, pooled
projector, one sliding and one global decoder layer) against Hugging Face's, whose mask lets an image's
tokens attend to each other both ways. One engine for the module (float32, steps of 16 tokens, strict
compile guard); the prompts put an image across a 16-token chunk boundary, so the scheduler must move
the chunk's end to the image's first token."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.tiny_vlm import ENGINE_ARGS, GEMMA3_TOKENS_PER_IMAGE, data_url, random_image, save_tiny_gemma3
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
    import torch

    model, processor = hf
    inputs = processor(text=text, images=images, return_tensors="pt")
    if not bidirectional:
        inputs.pop("token_type_ids")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        logits = model(**inputs).logits[0].float()
    ids = inputs["input_ids"][0]
    logprobs = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]
    return out[0, len(ids) :].tolist(), ids.tolist(), logprobs.numpy()


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


def test_a_causal_kernel_is_refused_by_name(model_dir):
    with pytest.raises(ValueError, match=r"^attention_backend 'pallas' does not serve Gemma 3's images"):
        LLM(model_dir, **ENGINE_ARGS, attention_backend="pallas")


def test_chat_with_a_data_url_image_part(llm, hf):
    """An OpenAI image part becomes Gemma 3's `<start_of_image>` in the chat template's text."""
    image = random_image(30)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in it? "},
                {"type": "image_url", "image_url": {"url": data_url(image)}},
            ],
        }
    ]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = hf[1].tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is in it? <start_of_image>\n"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    hf_tokens, hf_ids, _ = _hf(hf, text, [image])
    assert out.prompt_token_ids == hf_ids
    assert list(out.outputs[0].token_ids) == hf_tokens

"""Qwen2.5-VL, Qwen3-VL and Qwen3.5 end to end, offline: tiny random checkpoints against Hugging Face's
classes. Images keep their own sizes (a token per 8 x 8 pixels here, at most 64 tokens: larger images are
resized down by the processor) and the decoder rotates by M-RoPE positions; Qwen2.5-VL's tower attends within
windows of 2 x 2 tokens but in its last block, Qwen3-VL's to the whole image, with a learned position
table and DeepStack features added to the decoder's first two layers. One engine per family (float32,
steps of 16 tokens, so an image's tokens span several chunks; strict compile guard: every patch bucket
compiled at warm-up). Videos: Qwen2.5-VL's frame pairs along M-RoPE's time axis, Qwen3-VL's with their
times in the text, its prompt ids Qwen3VLProcessor's own. Qwen3.5: Qwen3-VL's tower without DeepStack
before a hybrid decoder (a Gated DeltaNet layer, then a gated attention layer rotating by M-RoPE),
whose state is snapshotted for the prefix cache. Qwen3-VL-MoE: Qwen3-VL with experts in each decoder layer
(its checkpoint's fused experts in the releases' layout), end to end and its config and expert layouts
read; what it shares with Qwen3-VL alone is tested on Qwen3-VL."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.tiny_vlm import (
    ENGINE_ARGS,
    hf_greedy,
    image_chat,
    random_image,
    save_tiny_qwen2_5_vl,
    save_tiny_qwen3_5_vl,
    save_tiny_qwen3_vl,
    save_tiny_qwen3_vl_moe,
)
from xlaserve import LLM, SamplingParams

BLOCK = ENGINE_ARGS["block_size"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
PROMPT = f"The quick brown fox jumps over the lazy dog 0123456789. {IMAGE} What is it?"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


FAMILIES = {
    "qwen2_5_vl": (save_tiny_qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": (save_tiny_qwen3_vl, "Qwen3VLForConditionalGeneration"),
    "qwen3_5": (save_tiny_qwen3_5_vl, "Qwen3_5ForConditionalGeneration"),
    "qwen3_vl_moe": (save_tiny_qwen3_vl_moe, "Qwen3VLMoeForConditionalGeneration"),
}
# Qwen3VLProcessor's videos: each frame pair's time in the text.
TIMED_VIDEOS = ("qwen3_vl", "qwen3_5", "qwen3_vl_moe")


def _skip_qwen3_vl_moe(family: str) -> None:
    """Qwen3-VL-MoE's tower, front end and sizing are Qwen3-VL's (its experts' batch invariance:
    tests/models/test_moe_families.py), so a test of those alone runs for Qwen3-VL only."""
    if family == "qwen3_vl_moe":
        pytest.skip("Qwen3-VL's tower and front end, tested on Qwen3-VL")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, family):
    return FAMILIES[family][0](str(tmp_path_factory.mktemp(f"tiny-{family}")))


def _cache_memory(family: str, blocks: int) -> int:
    """kv_cache_memory for `blocks` blocks' worth, and Qwen3.5's state slots beside them (a slot per
    request and prefix-cache snapshots of the DeltaNet layer's state)."""
    return (blocks + 40 * (family == "qwen3_5")) * 8192


@pytest.fixture(scope="module")
def llm(model_dir, family):
    # Room for a video's prompt: Qwen3-VL's spells each frame pair's time (`<1.2 seconds>`) in the text.
    return LLM(
        model_dir, **{**ENGINE_ARGS, "kv_cache_memory": _cache_memory(family, 24), "max_model_len": 192}
    )


@pytest.fixture(scope="module")
def hf(model_dir, family):
    import torch
    import transformers

    hf_class = getattr(transformers, FAMILIES[family][1])
    return hf_class.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_inputs(llm, text: str, images: list, videos: list = ()) -> dict:
    """Hugging Face's model inputs for `text`, `images` and `videos`, made by the engine's processor (the
    same image processor and placeholder expansion as Qwen2_5_VLProcessor's)."""
    import torch

    mm = llm.input_processor.mm_processor
    out = mm.hf_processor(text=text, images=images, videos=list(videos) or None)
    ids = torch.tensor(out["input_ids"])
    inputs = {name: torch.tensor(value) for name, value in out.items() if name != "input_ids"}
    # What get_rope_index reads: 1 for an image's tokens, 2 for a video's.
    types = (ids == mm.image_token_id).long() + 2 * (ids == (mm.video_token_id or -1)).long()
    return {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}


def _mm(text: str, *images):
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def test_greedy_tokens_and_prompt_logprobs_match_hugging_face(llm, hf):
    image = random_image(1)  # 40 x 48 pixels: 5 x 6 tokens, windows cut short at the edges
    inputs = _hf_inputs(llm, PROMPT, [image])
    assert inputs["image_grid_thw"].tolist() == [[1, 12, 10]]
    hf_tokens, hf_ids, hf_logprobs = hf_greedy(hf, inputs)
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0)
    out = llm.generate(_mm(PROMPT, image), params, use_tqdm=False)[0]
    assert out.prompt_token_ids == hf_ids
    assert list(out.outputs[0].token_ids) == hf_tokens
    ours = np.array([entry[tid].logprob for entry, tid in zip(out.prompt_logprobs[1:], hf_ids[1:])])
    np.testing.assert_allclose(ours, hf_logprobs, atol=2e-4)
    assert llm.engine_core.runner.guard.num_unexpected == 0  # every patch bucket was warm


def test_images_of_two_sizes_in_one_prompt_match_hugging_face(llm, hf):
    """A wide image and one past max_pixels (resized down): their tokens, M-RoPE positions and the
    text between and after them (each image moves the text's positions by its longer side)."""
    images = [random_image(2, (64, 40)), random_image(3, (120, 90))]
    text = f"First {IMAGE} then {IMAGE} compare."
    inputs = _hf_inputs(llm, text, images)
    grids = inputs["image_grid_thw"].tolist()
    assert grids[0] == [1, 10, 16] and grids[1][1] * grids[1][2] * 16 <= 64 * 64  # resized down
    hf_tokens, _, _ = hf_greedy(hf, inputs)
    out = llm.generate(_mm(text, *images), GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_tokens


def test_mrope_positions_are_hugging_faces(llm, hf):
    """`mrope_positions` of every prompt position, chunk by chunk, and of the tokens after the prompt,
    against Hugging Face's get_rope_index and its decode delta."""
    from xlaserve.models.qwen2_5_vl import mrope_positions

    images = [random_image(4, (64, 40)), random_image(5, (32, 48))]
    text = f"a {IMAGE} b c {IMAGE}"  # the prompt ends with an image: the delta is its own
    inputs = _hf_inputs(llm, text, images)
    expected, delta = hf.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    _, features = llm.input_processor.mm_processor.process(text, images)
    n = inputs["input_ids"].shape[1]
    chunks = [mrope_positions(features, start, min(start + 7, n + 3), 2, n) for start in range(0, n + 3, 7)]
    ours = np.concatenate(chunks, axis=1)
    np.testing.assert_array_equal(ours[:, :n], expected[:, 0].numpy())
    np.testing.assert_array_equal(ours[:, n:], np.tile(np.arange(n, n + 3) + int(delta[0, 0]), (3, 1)))
    assert int(delta[0, 0]) < 0  # images hold fewer positions than tokens


def test_the_towers_attention_is_each_images_own_wherever_it_is_packed():
    """At the default dtype and a released tower's head width (16 x 80): an image's attention rows are
    the same bits alone in its own bucket as packed behind another image in a larger one, in a window
    layer and a full layer (it starts a query block, and its blocks read a key window from its first
    patch: models/qwen_vl_tower.attend_patches); in float32 they match a float64 reference."""
    from functools import partial

    import jax
    import jax.numpy as jnp

    from xlaserve.models.qwen_vl_tower import QwenVisionConfig, attend_patches, pack_images
    from xlaserve.models.rope import rope_cos_sin, rotate_halves

    heads, head_dim = 16, 80
    # A patch is one value, its number (to follow it through the packing); windows of 2 x 2 tokens.
    vision = QwenVisionConfig(
        1, 1, heads, 1, 1, patch_size=1, temporal_patch_size=1, in_channels=1, window_size=4
    )
    grids, first = {"a": (1, 20, 16), "b": (1, 10, 10)}, {"a": 0, "b": 320}  # 320 and 100 patches
    rng = np.random.default_rng(0)
    qkv_all = rng.standard_normal((420, 3 * heads * head_dim)).astype(np.float32)
    angles_all = rng.standard_normal((420, head_dim // 2)).astype(np.float32)

    # One program a bucket and dtype, its inputs' conversions and rotation angles inside it (op by op,
    # each would compile on its own).
    @partial(jax.jit, static_argnums=(1, 5))
    def attend(qkv, heads, angles, ids, block_starts, dtype):
        out = attend_patches(qkv.astype(dtype), heads, rope_cos_sin(angles), ids, block_starts)
        return out.astype(jnp.float32)

    def run(names: list[str], bucket: int, dtype, ids: str) -> tuple[np.ndarray, np.ndarray]:
        """Each patch's attention output and id, by patch number."""
        sizes = {n: int(np.prod(grids[n])) for n in names}
        images = [
            (grids[n], first[n] + np.arange(sizes[n])[:, None], np.zeros(sizes[n] // 4, int)) for n in names
        ]
        packed = pack_images(vision, images, bucket)
        real = packed["image_ids"] >= 0
        number = np.where(real, packed["patches"][:, 0], 0).astype(np.int64)
        qkv = np.where(real[:, None], qkv_all[number], 0)
        out = attend(qkv, heads, angles_all[number], packed[ids], packed["block_starts"], dtype)
        order = np.argsort(np.where(real, number, len(number) + len(qkv_all)))[: real.sum()]
        return np.asarray(out)[order], packed[ids][order]

    q, k, v = (qkv_all.reshape(-1, 3, heads, head_dim)[:, i] for i in range(3))
    rotate = jax.jit(lambda x, angles: rotate_halves(x, rope_cos_sin(angles)))
    q, k = (np.asarray(rotate(x, angles_all), np.float64) for x in (q, k))
    for ids in ("window_ids", "image_ids"):
        alone, _ = run(["a"], 512, jnp.bfloat16, ids)
        packed, _ = run(["b", "a"], 1024, jnp.bfloat16, ids)  # a from patch 128, after b's 100
        assert np.array_equal(packed[:320], alone), ids
        out, patch_ids = run(["b", "a"], 1024, jnp.float32, ids)
        scores = np.einsum("qhd,khd->hqk", q, k) * head_dim**-0.5
        scores = np.where(patch_ids[:, None] == patch_ids[None, :], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        expected = np.einsum("hqk,khd->qhd", probs / probs.sum(-1, keepdims=True), v).reshape(420, -1)
        np.testing.assert_allclose(out, expected, atol=2e-5)


def test_packed_images_encode_as_hugging_faces_tower(llm, hf, family):
    """Three images of three sizes packed into one call: each token's row as Hugging Face's (and its
    DeepStack features after it, Qwen3-VL's)."""
    _skip_qwen3_vl_moe(family)
    import jax
    import torch
    from flax import nnx

    runner = llm.engine_core.runner
    model = nnx.merge(runner.graphdef, runner.params)
    # One program, as the engine's encoder runs (op by op, each of the tower's ops compiles on its own).
    encode = jax.jit(lambda params, inputs: nnx.merge(runner.graphdef, params).encode_images(**inputs))
    images = [random_image(6, (40, 48)), random_image(7, (32, 32)), random_image(8, (48, 40))]
    out = llm.input_processor.mm_processor.hf_processor(text="", images=images)
    grids = [tuple(g) for g in out["image_grid_thw"].tolist()]
    counts = [int(np.prod(g)) // 4 for g in grids]
    pixels = np.split(out["pixel_values"], np.cumsum([c * 4 for c in counts])[:-1])
    rows = np.split(np.arange(sum(counts)), np.cumsum(counts)[:-1])
    packed = model.cfg.vision.pack(list(zip(grids, pixels, rows)), 384)  # 120, 64, 120 from blocks of 128
    encoded = np.asarray(encode(runner.params, {k: v for k, v in packed.items() if k != "dest"}))
    ours = np.zeros((sum(counts), encoded.shape[1]), np.float32)
    real = packed["dest"] >= 0
    ours[packed["dest"][real]] = encoded[real]
    with torch.no_grad():
        features = hf.model.get_image_features(
            pixel_values=torch.tensor(out["pixel_values"]), image_grid_thw=torch.tensor(out["image_grid_thw"])
        )
    expected = [torch.cat(list(features.pooler_output))]
    for deepstack in getattr(features, "deepstack_features", None) or []:  # Qwen3-VL's, one per layer
        expected.append(torch.cat(list(deepstack)) if isinstance(deepstack, (list, tuple)) else deepstack)
    expected = torch.cat(expected, dim=-1).numpy()
    assert ours.shape == expected.shape == (sum(counts), model.cfg.encoder_output_width)
    np.testing.assert_allclose(ours, expected, atol=1e-5)


def test_the_same_image_twice_hits_both_caches_and_another_image_neither(llm, family):
    llm.reset_prefix_cache()
    encoder = llm.engine_core.runner.mm_encoder
    image = random_image(20)
    encoded = encoder.num_encoded
    first = llm.generate(_mm(PROMPT, image), GREEDY, use_tqdm=False)[0]
    assert encoder.num_encoded == encoded + 1  # once, though its tokens span three chunks
    again = llm.generate(_mm(PROMPT, image), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert encoder.num_encoded == encoded + 1
    other = llm.generate(_mm(PROMPT, random_image(21)), GREEDY, use_tqdm=False)[0]
    image_offset = first.prompt_token_ids.index(llm.input_processor.mm_processor.image_token_id)
    text_blocks = image_offset // BLOCK * BLOCK
    if family == "qwen3_5":
        # Its DeltaNet state is snapshotted where a prompt's last block ends, so the text block is no hit
        # yet; the prompt stops at that branch point once, and the next image's prompt hits it.
        assert other.num_cached_tokens == 0
        third = llm.generate(_mm(PROMPT, random_image(22)), GREEDY, use_tqdm=False)[0]
        assert third.num_cached_tokens == text_blocks
        assert encoder.num_encoded == encoded + 3
    else:
        assert other.num_cached_tokens == text_blocks  # the text block only
        assert encoder.num_encoded == encoded + 2


def test_chat_with_a_data_url_image_part_matches_hugging_face(llm, hf, model_dir):
    import transformers

    image = random_image(30, (56, 40))
    out = llm.chat(image_chat(image), GREEDY, use_tqdm=False)[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is in it? {IMAGE}\n"}], add_generation_prompt=True, tokenize=False
    )
    hf_tokens, hf_ids, _ = hf_greedy(hf, _hf_inputs(llm, text, [image]))
    assert out.prompt_token_ids == hf_ids
    assert list(out.outputs[0].token_ids) == hf_tokens


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (_mm("no placeholder", random_image(1)), "0 <|image_pad|> placeholders for 1 images"),
        (_mm(f"{IMAGE} {IMAGE}", random_image(1)), "2 <|image_pad|> placeholders for 1 images"),
        (_mm(f"tiny {IMAGE}", random_image(1, (1, 1))), "each side must be at least"),
    ],
)
def test_bad_image_prompts_are_refused_naming_the_field(llm, prompt, message):
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        llm.generate(prompt, GREEDY, use_tqdm=False)


def test_bfloat16_an_image_request_is_the_same_alone_and_packed_with_others(model_dir, family):
    """At the default dtype, with batch invariance (the default): a request's image encoded alone (its
    own patch bucket) or packed with another image of another size in one tower call (a larger bucket),
    its prompt among others: the same tokens and bitwise the same logprobs."""
    _skip_qwen3_vl_moe(family)
    args = {**ENGINE_ARGS, "dtype": "bfloat16", "kv_cache_memory": 48 * 8192, "max_num_batched_tokens": 128}
    args["enforce_eager"] = True  # the buckets the two engines use, compiled as used
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, prompt_logprobs=0)
    target = _mm(f"Look {IMAGE} what?", random_image(50))
    others = [
        _mm(f"See {IMAGE} and?", random_image(51, (64, 40))),
        _mm(f"x {IMAGE} y", random_image(52, (32, 32))),
    ]

    def logprobs(out) -> list[float]:
        prompt = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        return prompt + [e[t].logprob for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]

    alone = LLM(model_dir, **args).generate(target, params, use_tqdm=False)[0]
    together_llm = LLM(model_dir, **args)
    encoder = together_llm.engine_core.runner.mm_encoder
    together = together_llm.generate([others[0], target, others[1]], params, use_tqdm=False)[1]
    # One step: the 64 x 40 image's 160 patches alone (a bucket holds 256), the target's 120 with the
    # 32 x 32 image's 64 in the next call.
    assert encoder.num_encoded == 3 and encoder.num_encode_calls == 2
    assert together.outputs[0].token_ids == alone.outputs[0].token_ids
    assert logprobs(together) == logprobs(alone)


def _hf_qwen3_vl_inputs(llm, text: str, images: list, videos: list) -> dict:
    """Hugging Face's Qwen3VLProcessor's own inputs (its placeholder expansion: each frame pair's time in
    the text, then its tokens in vision marks), its video processor (torchvision's) standing in as the
    engine's frames: theirs at the directory's fps, each frame's index its own (frames given as sampled)."""
    import torch
    from transformers import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    mm = llm.input_processor.mm_processor
    ours = mm.hf_processor(text="", videos=videos)  # the frames' patches and grids, no text

    class Frames:
        merge_size, temporal_patch_size = 2, 2

        def __call__(self, videos, **kwargs):
            metadata = [
                VideoMetadata(
                    total_num_frames=len(v), fps=mm.hf_processor.fps, frames_indices=list(range(len(v)))
                )
                for v in videos
            ]
            grids = {"video_grid_thw": ours["video_grid_thw"], "video_metadata": metadata}
            return {"pixel_values_videos": ours["pixel_values_videos"], **grids}

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)  # __init__ would look up a video processor class
    processor.image_processor, processor.tokenizer, processor.video_processor = (
        mm.hf_processor.image_processor,
        mm.hf_processor.tokenizer,
        Frames(),
    )
    for name in ("image", "video", "vision_start", "vision_end"):  # what its __init__ sets
        token = {"image": "<|image_pad|>", "video": "<|video_pad|>"}.get(name, f"<|{name}|>")
        setattr(processor, f"{name}_token", token)
        setattr(processor, f"{name}_token_id", mm.hf_processor.tokenizer.convert_tokens_to_ids(token))
    out = processor(text=text, images=images or None, videos=videos, return_tensors="np")
    return {name: torch.tensor(value) for name, value in out.items()}


def test_a_video_matches_hugging_face(llm, hf, family):
    """5 frames (the last repeated to 6: 3 frame pairs, each its own attention segment in the tower's full
    blocks) after an image, the prompt ending with the video. Qwen2.5-VL: the pairs' temporal positions
    4 apart (2 tokens a second x 2 s a pair at 2 fps), the last pair's setting the decode delta. Qwen3-VL:
    the prompt's ids are Qwen3VLProcessor's (each pair's time in the text, `<0.2 seconds>` ... `<2.0
    seconds>`, then the pair in vision marks), each pair placed as an image, DeepStack on its tokens."""
    frames = np.stack([np.asarray(random_image(60 + t, (40, 32))) for t in range(5)])  # [T, H, W, 3]
    text = f"An image {IMAGE} and a video {VIDEO}"
    prompt = {"prompt": text, "multi_modal_data": {"image": random_image(59), "video": frames}}
    inputs = _hf_inputs(llm, text, [random_image(59)], [list(frames)])
    assert inputs["video_grid_thw"].tolist() == [[3, 8, 10]]
    if family in TIMED_VIDEOS:
        theirs = _hf_qwen3_vl_inputs(llm, text, [random_image(59)], [list(frames)])
        assert theirs["input_ids"].tolist() == inputs["input_ids"].tolist()
        assert theirs["mm_token_type_ids"].tolist() == inputs["mm_token_type_ids"].tolist()
        decoded = llm.get_tokenizer().decode(theirs["input_ids"][0])
        assert [decoded.count(f"<{t} seconds><|vision_start|>") for t in ("0.2", "1.2", "2.0")] == [1, 1, 1]
        inputs = theirs
    hf_tokens, hf_ids, hf_logprobs = hf_greedy(hf, inputs)
    params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0)
    encoder = llm.engine_core.runner.mm_encoder
    encoded = encoder.num_encoded
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert encoder.num_encoded == encoded + (4 if family in TIMED_VIDEOS else 2)  # Qwen3-VL's: a pair each
    assert out.prompt_token_ids == hf_ids
    assert list(out.outputs[0].token_ids) == hf_tokens
    ours = np.array([entry[tid].logprob for entry, tid in zip(out.prompt_logprobs[1:], hf_ids[1:])])
    np.testing.assert_allclose(ours, hf_logprobs, atol=2e-4)


def test_video_mrope_positions_and_decode_delta_are_hugging_faces(llm, hf, family):
    """Chunk by chunk (7 tokens, so chunks cut the video's pairs and the times between them) and past
    the prompt, as get_rope_index's. Qwen2.5-VL: the video's temporal positions (pairs 4 apart) reach
    past the text after it, so the decode delta is the prompt's largest position + 1 - its length.
    Qwen3-VL: each pair is an image of one frame, its time's text between."""
    from xlaserve.models.qwen2_5_vl import mrope_positions

    frames = [random_image(70 + t, (32, 32)) for t in range(6)]  # 3 pairs of 4 x 4 tokens
    text = f"a {IMAGE} b {VIDEO} c"
    images = [random_image(69, (48, 32))]
    inputs = (_hf_qwen3_vl_inputs if family in TIMED_VIDEOS else _hf_inputs)(llm, text, images, [frames])
    timing = {k: inputs[k] for k in ("second_per_grid_ts",) if k in inputs}  # Qwen2.5-VL's only
    expected, delta = hf.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        video_grid_thw=inputs["video_grid_thw"],
        **timing,
    )
    ids, features = llm.input_processor.mm_processor.process(text, images, [frames])
    assert ids == inputs["input_ids"][0].tolist()
    n, cfg = len(ids), llm.engine_core.runner.model_config
    if family == "qwen2_5_vl":
        assert features[1].seconds_per_grid == 1.0  # 2 frames a pair at the directory's 2 fps
    tps = cfg.vision.tokens_per_second
    chunks = [
        mrope_positions(features, s, min(s + 7, n + 3), 2, n, cfg.video_interval, tps)
        for s in range(0, n + 3, 7)
    ]
    ours = np.concatenate(chunks, axis=1)
    np.testing.assert_array_equal(ours[:, :n], expected[:, 0].numpy())
    np.testing.assert_array_equal(ours[:, n:], np.tile(np.arange(n, n + 3) + int(delta[0, 0]), (3, 1)))
    if family == "qwen2_5_vl":
        assert int(expected[0, 0].max()) > int(expected[1, 0].max())  # the frames reach past the text
    else:  # one feature a pair, in prompt order after the image
        assert [(f.modality, f.grid) for f in features] == [("image", (1, 8, 12))] + [
            ("video", (1, 8, 8))
        ] * 3


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"video": [random_image(1), random_image(2, (32, 32))]},
            r"video\[0\]: a video's frames must share one size",
        ),
        ({"video": [[random_image(1)], [random_image(2)]]}, r"video: 2 videos in one prompt; at most 1"),
        ({"image": random_image(1)}, r"video: the prompt has 1 <\|video_pad\|> placeholders for 0 videos"),
        (
            {"image": random_image(1), "video": np.zeros((4, 48, 48, 3), np.uint8)},
            r"video\[0\]: 72 tokens; a video may have at most 64",
        ),
    ],
)
def test_bad_videos_are_refused_naming_the_field(llm, family, data, message):
    if family in TIMED_VIDEOS and "tokens" in message:
        pytest.skip(
            "Qwen3-VL, Qwen3.5: each frame pair is an encoder item of its own, at most an image's tokens"
        )
    prompt = {"prompt": f"{IMAGE} {VIDEO}", "multi_modal_data": data}
    with pytest.raises(ValueError, match=f"multi_modal_data.{message}"):
        llm.generate(prompt, GREEDY, use_tqdm=False)


def test_a_release_config_json_reads_as_transformers_5s():
    """Qwen2.5-VL's released config.json (top-level decoder fields, `rope_scaling` of type "mrope",
    transformers 4's spelling) reads as the config transformers 5 writes: M-RoPE sections, plain RoPE
    frequencies, the processor's largest image."""
    from xlaserve.models.qwen2_5_vl import Qwen2_5_VLConfig

    release = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_attention_heads": 16,
        "num_hidden_layers": 36,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 128000,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": True,
        "image_token_id": 151655,
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                          "out_hidden_size": 2048, "tokens_per_second": 2, "window_size": 112,
                          "fullatt_block_indexes": [7, 15, 23, 31]},
        "preprocessor_config": {"min_pixels": 3136, "max_pixels": 12845056},
    }  # fmt: skip
    cfg = Qwen2_5_VLConfig.from_hf(release)
    assert (cfg.mrope_section, cfg.rope_scaling, cfg.rope_theta) == ((16, 24, 24), None, 1000000.0)
    assert cfg.tie_word_embeddings and cfg.attention_bias and cfg.image_token_id == 151655
    assert cfg.max_image_tokens == 16384 and cfg.vision.fullatt_block_indexes == (7, 15, 23, 31)
    assert cfg.video_interval == 2.0  # 2 tokens a second x 2 frames / 2 fps


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_head_is_tied_by_the_flag_hugging_face_ties_it_by(family):
    """Hugging Face's composite model ties the head by the top level's `tie_word_embeddings` (off when
    left out), whatever the text config's says; Qwen2.5-VL's config also takes the text config's on
    (pre-v5 saves wrote it there). Read through `complete_config` as a checkpoint's config.json is: flags
    on, off or left out, against transformers 5's reading of the same dict."""
    import copy

    import transformers

    from xlaserve.models.loader import complete_config
    from xlaserve.models.registry import get_model_class

    theirs = getattr(transformers, FAMILIES[family][1].replace("ForConditionalGeneration", "Config"))
    ours = get_model_class(FAMILIES[family][1]).config_class
    base = theirs().to_dict()
    for top, text in [(None, None), (None, True), (False, True), (True, False)]:
        hf = copy.deepcopy(base)
        for config, flag in ((hf, top), (hf["text_config"], text)):
            config.pop("tie_word_embeddings", None)
            if flag is not None:
                config["tie_word_embeddings"] = flag
        expected = theirs(**copy.deepcopy(hf)).tie_word_embeddings
        assert expected == (top or family == "qwen2_5_vl" and bool(text))  # what the cases are for
        assert ours.from_hf(complete_config(hf)).tie_word_embeddings == expected, (top, text)


def test_mm_processor_kwargs_size_the_front_end_and_the_engine_alike(model_dir, hf, family):
    """vLLM's --mm-processor-kwargs over the directory's settings: a smaller max_pixels resizes images
    down in the front end and sizes the engine's encoder-cache slots and tower buckets to match, and the
    tokens still match Hugging Face's with the same settings."""
    if family == "qwen3_5":
        pytest.skip("the Qwen VL families share the front end and the engine's sizing: two of them cover it")
    _skip_qwen3_vl_moe(family)
    from xlaserve.config import ModelConfig

    with pytest.raises(ValueError, match="mm_processor_kwargs must be a JSON object"):
        ModelConfig(mm_processor_kwargs="[1024]")
    # Images of 6,250,000 patches: a query block of the tower's attention would need 12 GiB; the error
    # says what to set.
    with pytest.raises(
        ValueError, match=r'mm_processor_kwargs: .* needs 12 GiB a block .*\{"max_pixels": \d+\}'
    ):
        LLM(model_dir, **{**ENGINE_ARGS, "mm_processor_kwargs": {"max_pixels": 10**8}})
    kwargs = {"max_pixels": 32 * 32}  # 16 tokens at most
    small = LLM(model_dir, **{**ENGINE_ARGS, "kv_cache_memory": 24 * 8192, "mm_processor_kwargs": kwargs})
    mm = small.input_processor.mm_processor
    assert mm.tokens_per_image == small.engine_core.runner.model_config.max_image_tokens == 16
    assert small.engine_core.runner.mm_encoder.buckets == [64]  # one bucket: 16 tokens of 4 patches
    image = random_image(80)  # 40 x 48 pixels: 30 tokens at the directory's settings
    out = small.generate(_mm(PROMPT, image), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(mm.image_token_id) <= 16
    inputs = _hf_inputs(small, PROMPT, [image])
    hf_tokens, hf_ids, _ = hf_greedy(hf, inputs)
    assert out.prompt_token_ids == hf_ids and list(out.outputs[0].token_ids) == hf_tokens


def test_qwen3_vl_moe_reads_its_config_and_both_expert_layouts_as_hugging_face():
    """Qwen3-VL-MoE's config.json as Hugging Face reads it: the head tied by the top level's flag (off)
    over the text config's (on), the top-k weights renormalized whatever `norm_topk_prob` says; its
    fused experts in the releases' layout ([E, D, 2F], [E, F, D]) and in transformers 5's ([E, 2F, D],
    [E, D, F]) stacked alike, and a square one (D = 2F) read as transformers 5's, as its loader does.
    Dense layers among the sparse ones are refused naming the family loaded."""
    import transformers

    from xlaserve.models.qwen3_vl_moe import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    def config(moe_intermediate_size: int) -> Qwen3VLMoeConfig:
        hf = transformers.Qwen3VLMoeConfig(
            text_config=dict(hidden_size=8, num_experts=4, moe_intermediate_size=moe_intermediate_size)
        ).to_dict()
        hf["text_config"]["norm_topk_prob"] = False
        assert hf["text_config"]["tie_word_embeddings"] and not hf["tie_word_embeddings"]
        return Qwen3VLMoeConfig.from_hf(hf)

    cfg = config(moe_intermediate_size=3)
    assert (cfg.num_experts, cfg.norm_topk_prob, cfg.tie_word_embeddings) == (4, True, False)
    rng = np.random.default_rng(0)
    gate_up, down = rng.standard_normal((4, 6, 8)), rng.standard_normal((4, 8, 3))  # transformers 5's
    block = "model.language_model.layers.0.mlp.experts."
    theirs = {block + "gate_up_proj": gate_up, block + "down_proj": down}
    release = {name: np.swapaxes(t, 1, 2) for name, t in theirs.items()}
    stacks = [Qwen3VLMoeForConditionalGeneration.prepare_hf_tensors(cfg, t) for t in (theirs, release)]
    ours = "model.layers.0.mlp.experts_"
    for stacked in stacks:  # [E, out, in], as the loader takes a checkpoint's matrices
        assert sorted(stacked) == [ours + "down.weight", ours + "gate.weight", ours + "up.weight"]
        np.testing.assert_array_equal(stacked[ours + "gate.weight"], gate_up[:, :3])
        np.testing.assert_array_equal(stacked[ours + "up.weight"], gate_up[:, 3:])
        np.testing.assert_array_equal(stacked[ours + "down.weight"], down)
    square = {block + "gate_up_proj": rng.standard_normal((4, 8, 8))}
    stacked = Qwen3VLMoeForConditionalGeneration.prepare_hf_tensors(config(4), square)
    np.testing.assert_array_equal(stacked[ours + "gate.weight"], square[block + "gate_up_proj"][:, :4])
    dense = transformers.Qwen3VLMoeConfig(text_config=dict(mlp_only_layers=[1])).to_dict()
    with pytest.raises(ValueError, match=r"^Qwen3-VL-MoE with dense layers \(mlp_only_layers=\[1\]"):
        Qwen3VLMoeConfig.from_hf(dense)

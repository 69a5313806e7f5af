"""A tiny random LLaVA (CLIP vision tower, projector, Llama) with its processor, written offline.

The images are 32x32 (patches of 8: 16 image tokens each), the vocabulary the small byte-level one
plus `<image>`: cheap programs, so a test engine warms up in seconds.
"""

from __future__ import annotations

import base64
import io
import os

import numpy as np

IMAGE_SIZE = 32
# The engine the tests run it on (offline and served): float32, steps of 16 tokens (buckets 1, 4, 16),
# chunks not capped below the step, 10 KV blocks of 16 tokens (8 KiB each: 2 layers x K, V x 4 heads x
# 8 dims x float32; block 0 is the null block), so four prompts with images at once preempt each other;
# nothing compiles after warm-up.
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 128,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "long_prefill_token_threshold": 0,
    "block_size": 16,
    "kv_cache_memory": 10 * 8192,
    "strict_compile_guard": True,
}
TOKENS_PER_IMAGE = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_tiny_llava(directory: str, *, seed: int = 0) -> str:
    """A random LlavaForConditionalGeneration (float32 safetensors), its tokenizer and LlavaProcessor
    (CLIPImageProcessorPil) in `directory`."""
    import torch
    import transformers

    tokenizer = vlm_tokenizer(["<image>"])
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=8,
        projection_dim=32,
    )
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=TOKENS_PER_IMAGE,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not all near-ties
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    processor = make_processor(tokenizer)
    processor.save_pretrained(directory)
    return directory


GEMMA3_TOKENS_PER_IMAGE = 4  # 4 x 4 patches pooled 2 x 2
GEMMA3_SPECIAL = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}


def save_tiny_gemma3(directory: str, *, seed: int = 0, sliding_window: int = 16) -> str:
    """A random Gemma3ForConditionalGeneration (SigLIP tower, pooled projector, Gemma 3 decoder with one
    sliding and one global layer), its tokenizer (the image tokens as Gemma 3's: `<start_of_image>` in
    the text, expanded to `<image_soft_token>`s) and Gemma3Processor (Gemma3ImageProcessorPil)."""
    import json

    import torch
    import transformers

    tokenizer = vlm_tokenizer(list(GEMMA3_SPECIAL.values()))
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        settings = json.load(f)
    with open(path, "w") as f:  # Gemma 3's tokenizer names its image tokens (tokenizer.boi_token, ...)
        json.dump({**settings, "extra_special_tokens": GEMMA3_SPECIAL}, f)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=8,
    )
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.convert_tokens_to_ids(GEMMA3_SPECIAL["eoi_token"]),
        image_token_index=tokenizer.image_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not all near-ties
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=GEMMA3_TOKENS_PER_IMAGE,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(directory)
    return directory


def make_processor(tokenizer):
    import transformers

    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def vlm_tokenizer(special: list[str]):
    """The small byte-level tokenizer with a model's image tokens and the tests' chat template."""
    from helpers.tiny_models import small_byte_tokenizer

    tokenizer = small_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def image_chat(image, text: str = "What is in it? ") -> list[dict]:
    """One user message of `text` and `image` as an OpenAI data-URL image part."""
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    return [{"role": "user", "content": content}]


def hf_greedy(model, inputs: dict, max_tokens: int = 8) -> tuple[list[int], list[int], np.ndarray]:
    """Hugging Face's (greedy tokens, prompt ids, prompt logprobs [n - 1]) for a vision-language model's
    processed `inputs` (torch tensors, batch of one)."""
    import torch

    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        logits = model(**inputs).logits[0].float()
    ids = inputs["input_ids"][0]
    logprobs = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]
    return out[0, len(ids) :].tolist(), ids.tolist(), logprobs.numpy()


def random_image(seed: int, size: tuple[int, int] = (40, 48)):
    """A PIL image of noise (width, height)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_prompts(model_dir: str) -> list[dict]:
    """Three prompts for the tiny model in `model_dir` (its image placeholder by architecture): one
    image, two images, and text only."""
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        architecture = json.load(f)["architectures"][0]
    image, size = {
        "Gemma3ForConditionalGeneration": ("<start_of_image>", (40, 48)),
        "Qwen2_5_VLForConditionalGeneration": ("<|vision_start|><|image_pad|><|vision_end|>", (32, 40)),
        "Qwen3VLForConditionalGeneration": ("<|vision_start|><|image_pad|><|vision_end|>", (32, 40)),
        "Qwen3VLMoeForConditionalGeneration": ("<|vision_start|><|image_pad|><|vision_end|>", (32, 40)),
    }.get(architecture, ("<image>", (40, 48)))
    text = f"The quick brown fox jumps over the lazy dog. {image} What is it?"
    two = [random_image(2, size), random_image(3, size)]
    return [
        {"prompt": text, "multi_modal_data": {"image": [random_image(1, size)]}},
        {"prompt": f"{text} {image}", "multi_modal_data": {"image": two}},
        {"prompt": "No image here, only text."},
    ]


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


QWEN_VL_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Patches of 4 pixels merged 2 x 2: one token per 8 x 8 pixels, images of 64 to 16 x 16 tokens (32 x 32 to
# 128 x 128 pixels: a 40 x 48 noise image is 5 x 6 = 30 tokens); windows of 2 x 2 tokens.
QWEN_VL_PIXELS = {"min_pixels": 32 * 32, "max_pixels": 64 * 64}


def save_tiny_qwen2_5_vl(directory: str, *, seed: int = 0) -> str:
    """A random Qwen2_5_VLForConditionalGeneration (a 3-block windowed tower, the last block attending to
    the whole image; a 2-layer Qwen2 decoder with M-RoPE), its tokenizer and Qwen2VLImageProcessorPil
    settings (Qwen2_5_VLProcessor itself needs torchvision for its video processor)."""
    import transformers

    vision = transformers.Qwen2_5_VLVisionConfig(
        **QWEN_VL_TOWER, window_size=16, out_hidden_size=64, fullatt_block_indexes=[2]
    )
    return _save_tiny_qwen_vl(directory, seed, "Qwen2_5_VL", vision, mrope_section=[2, 3, 3])


def save_tiny_qwen3_vl(
    directory: str, *, seed: int = 0, num_layers: int = 2, deepstack_visual_indexes: tuple = (0, 1)
) -> str:
    """A random Qwen3VLForConditionalGeneration (a 3-block tower with a 4 x 4 position table, DeepStack
    features from its first two blocks added after both layers of a Qwen3 decoder with interleaved
    M-RoPE, by default), with the same tokens and image settings as `save_tiny_qwen2_5_vl`."""
    import transformers

    vision = transformers.Qwen3VLVisionConfig(
        **QWEN_VL_TOWER,
        out_hidden_size=64,
        num_position_embeddings=16,
        deepstack_visual_indexes=list(deepstack_visual_indexes),
    )
    return _save_tiny_qwen_vl(
        directory, seed, "Qwen3VL", vision, [4, 2, 2], num_hidden_layers=num_layers, head_dim=16
    )


def save_tiny_qwen3_vl_moe(directory: str, *, seed: int = 0) -> str:
    """A random Qwen3VLMoeForConditionalGeneration: `save_tiny_qwen3_vl`'s tower and decoder with 8
    experts of width 16 (top 2) in place of each layer's MLP, its experts written as the releases store
    them (`gate_up_proj` [E, D, 2F], `down_proj` [E, F, D]: transformers 5 saves its own [E, 2F, D] and
    [E, D, F], and transposes the releases' at load)."""
    import transformers
    from safetensors.numpy import load_file, save_file

    vision = transformers.Qwen3VLMoeVisionConfig(
        **QWEN_VL_TOWER, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0, 1]
    )
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    _save_tiny_qwen_vl(directory, seed, "Qwen3VLMoe", vision, [4, 2, 2], head_dim=16, **experts)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        tensors[name] = np.ascontiguousarray(np.swapaxes(tensors[name], 1, 2))
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


def save_tiny_qwen3_5_vl(directory: str, *, seed: int = 0) -> str:
    """A random Qwen3_5ForConditionalGeneration: Qwen3-VL's tower without DeepStack before a hybrid
    decoder of a Gated DeltaNet layer and a gated attention layer (rotating a quarter of its 64-dim heads by
    interleaved M-RoPE), with the same tokens and image settings as `save_tiny_qwen2_5_vl`."""
    import transformers

    vision = transformers.Qwen3_5VisionConfig(**QWEN_VL_TOWER, out_hidden_size=64, num_position_embeddings=16)
    return _save_tiny_qwen_vl(
        directory,
        seed,
        "Qwen3_5",
        vision,
        [4, 2, 2],
        head_dim=64,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )


# The tiny towers' shared sizes: 3 blocks of width 32, patches of 4 pixels merged 2 x 2.
QWEN_VL_TOWER = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
)


def _save_tiny_qwen_vl(directory: str, seed: int, family: str, vision, mrope_section: list, **text) -> str:
    """A random `{family}ForConditionalGeneration` over `vision` and a decoder of width 64 (2 layers
    unless `text` says), its tokenizer (the byte-level one with Qwen's vision tokens) and image
    processor settings."""
    import torch
    import transformers

    tokenizer = vlm_tokenizer(QWEN_VL_SPECIAL)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL}
    text_config = getattr(transformers, f"{family}TextConfig")(
        vocab_size=len(tokenizer),
        **{"num_hidden_layers": 2, **text},
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = getattr(transformers, f"{family}Config")(
        vision_config=vision.to_dict(),
        text_config=text_config.to_dict(),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not all near-ties
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, **QWEN_VL_PIXELS
    )
    image_processor.save_pretrained(directory)
    return directory


def colour_frames(num_frames: int, size: int = 32) -> np.ndarray:
    """uint8 [T, size, size, 3]: frame t a solid colour of its own (a step around the colour wheel and
    up in brightness) under a left-to-right gradient, so every frame differs and each is smooth enough
    for a video codec to keep close."""
    ramp = np.linspace(0, 60, size, dtype=np.float32)[None, :, None]  # [1, W, 1]
    frames = []
    for t in range(num_frames):
        colour = np.array([(70 * t) % 180, (40 + 50 * t) % 180, 150 - 12 * t], np.float32)
        frames.append(np.broadcast_to(colour + ramp, (size, size, 3)))
    return np.stack(frames).clip(0, 255).astype(np.uint8)


def encode_video(frames: np.ndarray, rate: int, codec: str = "libx264", container: str = "mp4") -> bytes:
    """`frames` uint8 [T, H, W, 3] as a video file of `rate` frames per second (PyAV; H and W even)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():  # flush
            out.mux(packet)
    return buffer.getvalue()


def empty_video() -> bytes:
    """An mp4 whose video track holds no frame (its header written, nothing encoded)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        out.start_encoding()
    return buffer.getvalue()


def video_data_url(data: bytes, container: str = "mp4") -> str:
    return f"data:video/{container};base64," + base64.b64encode(data).decode()

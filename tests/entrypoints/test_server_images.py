"""Images through the real server: /v1/chat/completions with `image_url` parts (the official openai
client, data URLs) against Hugging Face's LLaVA, and hostile images, each a 400 in OpenAI's error shape
naming the part, the server serving afterwards. One module server: a tiny LLaVA, float32, two buckets,
at most 2 images per prompt, file:// allowed under one directory, one allowed (unreachable) domain."""

from __future__ import annotations

import base64
import io
import re
import struct
import zlib

import httpx
import openai
import pytest
from PIL import Image
from test_server_hostile import check_error, check_still_serving, send

from helpers.server_harness import MODEL_NAME, running_server
from helpers.tiny_models import TINY_PROCESS_ENV
from helpers.tiny_vlm import (
    ENGINE_ARGS,
    TOKENS_PER_IMAGE,
    data_url,
    random_image,
    save_tiny_gemma3,
    save_tiny_llava,
    save_tiny_qwen2_5_vl,
    save_tiny_qwen3_vl,
)

NAME = "tiny-llava"
# vLLM's object form of a limit (the sizes are its profiling's dummy images): 2 images a prompt.
LIMITS = '{"image": {"count": 2, "width": 32, "height": 32}}'


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    random_image(7).save(path / "cat.png")
    return path


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, server_cache_dir, media_dir):
    model = save_tiny_llava(str(tmp_path_factory.mktemp("tiny-llava-server")))
    flags = ["--served-model-name", NAME, "--limit-mm-per-prompt", LIMITS,
             "--allowed-local-media-path", str(media_dir),
             "--allowed-media-domains", "images.example.com"]  # fmt: skip
    for key, value in ENGINE_ARGS.items():  # the offline test's engine (tests/models/test_llava.py)
        flags += ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
    logs = str(tmp_path_factory.mktemp("vlm-logs"))
    # A tiny model against Hugging Face's: compile fast (helpers/tiny_models.py).
    with running_server(logs, server_cache_dir, extra_args=flags, model=model, env=TINY_PROCESS_ENV) as proc:
        with httpx.Client(base_url=proc.url, timeout=120) as client:
            yield proc, client, model


def _chat(*parts, model=NAME):
    content = [{"type": "text", "text": "What is it? "}, *parts]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    }


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _hf_tokens(model_dir: str, image) -> list[int]:
    """Hugging Face's greedy tokens for `_chat`'s message with `image` (the class of the checkpoint's
    architecture; the processor's own chat placeholder in the template's text)."""
    import json

    import torch
    import transformers

    from xlaserve.engine.mm_processor import MultiModalProcessor

    with open(f"{model_dir}/config.json") as f:
        architecture = json.load(f)["architectures"][0]
    hf = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = MultiModalProcessor.for_model(
        model_dir, transformers.AutoTokenizer.from_pretrained(model_dir)
    )
    text = processor.hf_processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is it? {processor.chat_placeholder}\n"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    inputs = processor.hf_processor(text=text, images=[image], return_tensors="pt")
    inputs = {name: torch.as_tensor(value) for name, value in inputs.items()}
    if "image_grid_thw" in inputs:  # Qwen2.5-VL: which tokens are the image's, for its M-RoPE
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == processor.image_token_id).long()
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=4, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_openai_client_sends_a_data_url_image(vlm):
    proc, _, model_dir = vlm
    image = random_image(5)
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none")
    response = client.chat.completions.create(**_chat(_image(data_url(image))))
    assert response.choices[0].finish_reason == "length"
    hf_text = _decode(model_dir, _hf_tokens(model_dir, image))
    assert response.choices[0].message.content == hf_text
    assert response.usage.prompt_tokens > 16  # the 16 image tokens are counted


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl", "qwen3_vl"])
def test_other_families_through_the_openai_client(tmp_path_factory, server_cache_dir, family):
    """A Gemma 3 server (its images attend both ways) and a Qwen2.5-VL one (images of their own sizes,
    M-RoPE) answer a data-URL image part as Hugging Face's model does."""
    save = {"gemma3": save_tiny_gemma3, "qwen2_5_vl": save_tiny_qwen2_5_vl, "qwen3_vl": save_tiny_qwen3_vl}[
        family
    ]
    model = save(str(tmp_path_factory.mktemp(f"tiny-{family}-server")))
    # One request: compile only the programs it runs, not the warm-up's 15-17 (the strict guard over
    # these families' warm-up is their offline tests', tests/models/test_gemma3_vl.py, test_qwen_vl.py).
    flags = ["--served-model-name", f"tiny-{family}", "--enforce-eager"]
    for key, value in ENGINE_ARGS.items():
        if key != "strict_compile_guard":
            flags += ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
    image = random_image(12)
    logs = str(tmp_path_factory.mktemp(f"{family}-logs"))
    with running_server(logs, server_cache_dir, extra_args=flags, model=model, env=TINY_PROCESS_ENV) as proc:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none")
        response = client.chat.completions.create(**_chat(_image(data_url(image)), model=f"tiny-{family}"))
    assert response.choices[0].message.content == _decode(model, _hf_tokens(model, image))


def _decode(model_dir: str, ids: list[int]) -> str:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=True)


def _anthropic(*blocks, max_tokens=4):
    content = [{"type": "text", "text": "What is it? "}, *blocks]
    return {
        "model": NAME,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }


def _anthropic_image(image) -> dict:
    data = data_url(image).split(",", 1)[1]
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def test_anthropic_image_blocks_answer_as_the_chat_route_does(vlm):
    _, client, _ = vlm
    image = random_image(6)
    chat = client.post("/v1/chat/completions", json=_chat(_image(data_url(image))))
    response = client.post("/v1/messages", json=_anthropic(_anthropic_image(image)))
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["text"] == chat.json()["choices"][0]["message"]["content"]
    body = _anthropic(_anthropic_image(image))
    counted = client.post("/v1/messages/count_tokens", json={"model": NAME, "messages": body["messages"]})
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    refused = client.post(
        "/v1/messages",
        json=_anthropic(
            {"type": "image", "source": {"type": "url", "url": "https://evil.example.net/x.png"}}
        ),
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[1].source" in refused.json()["error"]["message"]


def test_responses_input_image_answers_as_the_chat_route_does(vlm):
    """The Responses API's `input_image` (the official client's `responses.create`): the same greedy
    text and prompt tokens as the chat route's image_url part; a follow-up through previous_response_id
    carries the image along; file_id, an image outside a user message and a refused URL are 400s naming
    the part."""
    proc, client, _ = vlm
    image = data_url(random_image(8))
    chat = client.post("/v1/chat/completions", json=_chat(_image(image))).json()
    sdk = openai.OpenAI(base_url=proc.url + "/v1", api_key="none")
    content = [{"type": "input_text", "text": "What is it? "}, {"type": "input_image", "image_url": image}]
    response = sdk.responses.create(
        model=NAME, input=[{"role": "user", "content": content}], max_output_tokens=4, temperature=0
    )
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    follow = sdk.responses.create(
        model=NAME, input="And now?", previous_response_id=response.id, max_output_tokens=2, temperature=0
    )
    assert follow.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens
    cases = [
        (
            {"type": "input_image", "file_id": "file-123"},
            "user",
            "input[0].content[1].image_url",
            "Files API",
        ),
        ({"type": "input_image", "image_url": image}, "assistant", "input[0].content[1]", "user message"),
        (
            {"type": "input_image", "image_url": "https://evil.example.net/x.png"},
            "user",
            "input[0].content[1].image_url",
            None,
        ),
        (
            {"type": "input_image", "image_url": image, "detail": "huge"},
            "user",
            "input[0].content[1].detail",
            None,
        ),
    ]
    for part, role, param, words in cases:
        body = {
            "model": NAME,
            "input": [{"role": role, "content": [content[0], part]}],
            "max_output_tokens": 2,
        }
        refused = client.post("/v1/responses", json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == param and (words is None or words in error["message"]), error


def test_bench_serve_sends_images(vlm, tmp_path):
    """`xlaserve bench serve --images-per-request 2`: every request answered, each prompt two images'
    placeholders longer than the text-only workload's (16 tokens an image here), the images/s counted."""
    import json

    from xlaserve.entrypoints import cli

    proc, _, _ = vlm
    runs = {}
    for images in (0, 2):
        out = tmp_path / f"serve-{images}.json"
        argv = ["bench", "serve", "--base-url", proc.url, "--model", NAME, "--num-prompts", "2",
                "--output-len", "2", "--max-concurrency", "2", "--images-per-request", str(images),
                "--image-size", "40x48", "--output-json", str(out)]  # fmt: skip
        assert cli.main(argv) == 0
        runs[images] = json.loads(out.read_text())["runs"][0]
    plain, imaged = runs[0], runs[2]
    assert (imaged["num_requests"], imaged["num_failed"]) == (2, 0)
    assert imaged["images_per_s"] == pytest.approx(4 / imaged["elapsed_s"])
    # total tokens per second x elapsed: the prompts' and outputs' tokens; the images add 2 x 16 each.
    extra = (
        imaged["total_tokens_per_s"] * imaged["elapsed_s"] - plain["total_tokens_per_s"] * plain["elapsed_s"]
    )
    assert extra == pytest.approx(2 * 2 * 16, abs=2 * 2 * 2)  # each image also adds its newline
    assert "images_per_s" not in plain


def test_a_local_file_under_the_allowed_path_is_read(vlm, media_dir):
    _, client, _ = vlm
    response = client.post("/v1/chat/completions", json=_chat(_image((media_dir / "cat.png").as_uri())))
    assert response.status_code == 200, response.text


def _huge_png_header(width: int, height: int) -> bytes:
    """A few hundred bytes of PNG whose header claims width x height (Pillow reads the size lazily)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)  # the first rows' start; the rest is never there
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _truncated_png() -> bytes:
    buffer = io.BytesIO()
    random_image(3).save(buffer, format="PNG")
    return buffer.getvalue()[:80]


def _b64(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


PART = "messages[0].content[1].image_url"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,!!!not-base64", "not valid base64"),
        (_b64(b"plain text, not an image at all"), "not an image"),
        (_b64(_huge_png_header(10_000, 10_000)), "at most 40000000 pixels"),
        (_b64(_huge_png_header(30_000, 30_000)), "at most 40000000 pixels"),  # past Pillow's own bound
        (_b64(_huge_png_header(40, 40))[:-1], "not valid base64"),  # unpadded: vLLM's decoder refuses it too
        ("https://images.example.com/cat.png", "could not be downloaded"),  # allowed; no network here
        (_b64(_truncated_png()), "corrupt or truncated"),
        ("https://evil.example.net/cat.png", "not in --allowed-media-domains"),
        ("file:///etc/passwd", "outside --allowed-local-media-path"),
        ("ftp://images.example.com/cat.png", "must be a data: URL"),
    ],
)
def test_hostile_images_are_a_400_naming_the_part(vlm, url, message):
    _, client, _ = vlm
    response, port = send(client, "/v1/chat/completions", _chat(_image(url)))
    error = check_error(response, 400, PART)
    assert message in error["message"]
    check_still_serving(client, port)


def _logprobs(client, *parts, role: str = "user") -> tuple[int, list[float]]:
    """(prompt tokens, the greedy tokens' logprobs) of `_chat`'s message with `parts`, sent as `role`'s."""
    body = {**_chat(*parts), "logprobs": True}
    if role != "user":
        body["messages"] = [{"role": role, "content": body["messages"][0]["content"]}]
        body["messages"].append({"role": "user", "content": "And?"})
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    logprobs = [t["logprob"] for t in answer["choices"][0]["logprobs"]["content"]]
    return answer["usage"]["prompt_tokens"], logprobs


def test_media_uuids_are_accepted_and_not_trusted(vlm):
    """vLLM's `uuid` of a media part (its clients' cache key) is taken, but the image's content hash keys
    the encoder and prefix caches: two images sent under one uuid each answer as they do without it."""
    _, client, _ = vlm
    answers = []
    for seed in (21, 22):
        url = data_url(random_image(seed))
        answers.append(_logprobs(client, _image(url)))
        assert _logprobs(client, {**_image(url), "uuid": "one-uuid"}) == answers[-1]
    assert answers[0][1] != answers[1][1]
    video = {**_video_part(), "uuid": "clip"}  # the field is taken; LLaVA then refuses the video itself
    response, _ = send(client, "/v1/chat/completions", _chat(video))
    assert (
        "takes images, not videos"
        in check_error(response, 400, "messages[0].content[1].video_url")["message"]
    )


def test_a_model_whose_processor_takes_no_request_settings_refuses_them(vlm):
    """LLaVA's processor has no per-request settings (the Qwen VL families': test_server_videos.py)."""
    _, client, _ = vlm
    body = {**_chat(_image(data_url(random_image(21)))), "mm_processor_kwargs": {"max_pixels": 1024}}
    response, port = send(client, "/v1/chat/completions", body)
    error = check_error(response, 400)
    assert error["param"] == "mm_processor_kwargs.max_pixels", error
    assert "takes no per-request settings" in error["message"]
    check_still_serving(client, port)


def test_an_animated_gif_is_read_as_its_first_frame(vlm):
    """A GIF of many frames is one image, its first frame (vLLM's Pillow load does the same); the frames
    after it are never decoded."""
    _, client, _ = vlm
    frames = [random_image(seed, (32, 32)) for seed in range(200)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=10)
    gif = "data:image/gif;base64," + base64.b64encode(buffer.getvalue()).decode()
    first = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    assert _logprobs(client, _image(gif)) == _logprobs(client, _image(data_url(first)))


def test_images_are_read_wherever_the_conversation_holds_them(vlm):
    """Images before, between and after text, and in a system or an assistant message (vLLM renders
    each): every image adds its placeholder's tokens to the prompt."""
    _, client, _ = vlm
    url = data_url(random_image(23))
    text, _ = _logprobs(client)
    one, _ = _logprobs(client, _image(url))
    per_image = one - text
    assert per_image >= TOKENS_PER_IMAGE
    for role in ("system", "assistant"):
        assert _logprobs(client, _image(url), role=role)[0] - _logprobs(client, role=role)[0] == per_image
    body = _chat(_image(url))
    body["messages"][0]["content"] = [_image(url), {"type": "text", "text": "Which? "}, _image(url)]
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] >= 2 * per_image


def test_a_1x1_image_is_refused(vlm):
    _, client, _ = vlm
    response, port = send(client, "/v1/chat/completions", _chat(_image(data_url(random_image(1, (1, 1))))))
    assert "at least 4 pixels" in check_error(response, 400, PART)["message"]
    check_still_serving(client, port)


def test_more_images_than_the_limit_are_refused(vlm):
    _, client, _ = vlm
    url = data_url(random_image(2))
    response, port = send(client, "/v1/chat/completions", _chat(_image(url), _image(url), _image(url)))
    error = check_error(response, 400, "messages[0].content[3].image_url")
    assert "at most 2 (--limit-mm-per-prompt)" in error["message"]
    check_still_serving(client, port)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ('{"image": {"count": -1}}', "limit_mm_per_prompt.image must be an integer >= 0, got -1"),
        ('{"image": {"num_frames": 4}}', "limit_mm_per_prompt.image.num_frames is not an option"),
        ('{"video": {"width": 0}}', "limit_mm_per_prompt.video.width must be an integer > 0, got 0"),
        ('{"video": {"height": "64"}}', "limit_mm_per_prompt.video.height must be an integer > 0"),
    ],
)
def test_bad_limit_options_are_refused_naming_them(limits, message):
    from xlaserve.config.multimodal import parse_mm_limits

    assert parse_mm_limits(LIMITS) == {"image": 2, "video": 1}
    assert parse_mm_limits('{"video": {"num_frames": 8, "width": 64}}')["video"] == 1  # the default count
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_mm_limits(limits)


def test_an_image_part_to_a_text_only_model_is_refused(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        response, port = send(
            client, "/v1/chat/completions", _chat(_image(data_url(random_image(2))), model=MODEL_NAME)
        )
        assert "takes text only" in check_error(response, 400, PART)["message"]
        check_still_serving(client, port)


def _video_part() -> dict:
    from helpers.tiny_vlm import colour_frames, encode_video, video_data_url

    return {"type": "video_url", "video_url": {"url": video_data_url(encode_video(colour_frames(4), 4))}}


def test_a_video_part_to_a_model_of_images_only_is_refused(vlm):
    """LLaVA takes images, not videos: a video_url part is a 400 naming it, before it is read."""
    _, client, _ = vlm
    response, port = send(client, "/v1/chat/completions", _chat(_video_part()))
    error = check_error(response, 400, "messages[0].content[1].video_url")
    assert "this model takes images, not videos" in error["message"]
    check_still_serving(client, port)


def test_a_video_part_to_a_text_only_model_is_refused(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        response, port = send(client, "/v1/chat/completions", _chat(_video_part(), model=MODEL_NAME))
        error = check_error(response, 400, "messages[0].content[1].video_url")
        assert "takes text only: video parts are not supported" in error["message"]
        check_still_serving(client, port)

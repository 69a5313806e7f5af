"""Videos through the real server: /v1/chat/completions with `video_url` parts (vLLM's; the official
openai client, data URLs of mp4 files made here with PyAV) on a tiny Qwen2.5-VL, against the offline
engine given the same decoded frames and against Hugging Face's `pixel_values_videos` path; the frame
sampling (--media-io-kwargs) on files whose frames are known; hostile videos, each a 400 in OpenAI's
error shape naming the part, the server serving afterwards. One module server: float32, at most one
video a prompt, 4 frames kept of each, file:// allowed under one directory."""

from __future__ import annotations

import sys

import httpx
import numpy as np
import openai
import pytest
from test_server_hostile import check_error, check_still_serving, send

from helpers.server_harness import running_server
from helpers.tiny_models import TINY_PROCESS_ENV, elemental_emitters
from helpers.tiny_vlm import (
    ENGINE_ARGS,
    colour_frames,
    data_url,
    empty_video,
    encode_video,
    hf_greedy,
    random_image,
    save_tiny_qwen2_5_vl,
    save_tiny_qwen3_vl,
    video_data_url,
)
from xlaserve import LLM, SamplingParams
from xlaserve.engine import media, video
from xlaserve.engine.media import MediaError, MediaPolicy

NAME = "tiny-qwen2_5_vl"
NUM_FRAMES = 4  # the server's --media-io-kwargs
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
QUESTION = "Describe it. "
# 10 frames at 10 frames a second: one second, 4 kept (0, 3, 6, 9), so 4 fps -- not the directory's 2,
# which would put the second frame pair 2 temporal positions on instead of 1.
RATE, LENGTH, KEPT_FPS = 10, 10, 4.0
MEDIA_IO = f'{{"video": {{"num_frames": {NUM_FRAMES}}}}}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("tiny-qwen2_5_vl-video")))


@pytest.fixture(scope="module")
def clip() -> bytes:
    return encode_video(colour_frames(LENGTH), RATE)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory, clip):
    path = tmp_path_factory.mktemp("videos")
    (path / "clip.mp4").write_bytes(clip)
    return path


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, server_cache_dir, model_dir, media_dir):
    flags = ["--served-model-name", NAME, "--limit-mm-per-prompt", '{"image": 1, "video": 1}',
             "--media-io-kwargs", MEDIA_IO, "--allowed-local-media-path", str(media_dir)]  # fmt: skip
    for key, value in ENGINE_ARGS.items():  # the offline tests' engine (tests/models/test_qwen_vl.py)
        flags += ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
    logs = str(tmp_path_factory.mktemp("video-logs"))
    with running_server(logs, server_cache_dir, extra_args=flags, model=model_dir, env=TINY_PROCESS_ENV) as p:
        with httpx.Client(base_url=p.url, timeout=120) as client:
            yield p, client


@pytest.fixture(scope="module")
def llm(model_dir):
    # Compared with the server (compiled with the same emitters: TINY_PROCESS_XLA_FLAGS) and Hugging Face.
    with elemental_emitters():
        return LLM(model_dir, **ENGINE_ARGS, media_io_kwargs=MEDIA_IO)


def _video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def _messages(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts]}]


def _chat(*parts) -> dict:
    return {"model": NAME, "messages": _messages(*parts), "max_tokens": 4, "temperature": 0}


# -- frame sampling ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_frames", "indices"),
    [(4, [0, 3, 6, 9]), (3, [0, 4, 9]), (32, list(range(10))), (-1, list(range(10)))],
)
@pytest.mark.parametrize(("codec", "container"), [("libx264", "mp4"), ("libvpx-vp9", "webm")])
def test_frames_are_sampled_uniformly_at_their_own_rate(num_frames, indices, codec, container):
    """vLLM's sampling (linspace over the file's frames, rounded down; every frame when it has no more
    than num_frames): which frames come back, told apart by their colours, and their rate: frames kept
    over the file's one second."""
    source = colour_frames(LENGTH)
    frames, metadata = video.decode_video(encode_video(source, RATE, codec, container), "f", num_frames)
    assert metadata["frames_indices"] == indices and metadata["total_num_frames"] == LENGTH
    assert metadata["duration"] == pytest.approx(1.0) and metadata["fps"] == pytest.approx(len(indices))
    assert frames.shape == (len(indices), 32, 32, 3) and frames.dtype == np.uint8
    error = np.abs(frames.astype(np.int32) - source[indices].astype(np.int32)).mean(axis=(1, 2, 3))
    others = np.abs(frames[:, None].astype(np.int32) - source[None].astype(np.int32)).mean(axis=(2, 3, 4))
    assert (others.argmin(axis=1) == indices).all() and (error < 6).all(), error  # lossy, but that frame


def test_sample_indices():
    assert video.sample_indices(100, 5).tolist() == [0, 24, 49, 74, 99]
    assert video.sample_indices(3, 32).tolist() == [0, 1, 2]


def test_without_pyav_a_video_is_refused_saying_what_to_install(monkeypatch, clip):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(
        MediaError, match=r"v: decoding a video needs PyAV: .*pip install 'xlaserve\[video\]'"
    ):
        video.load_video(video_data_url(clip), MediaPolicy(), "v")


def test_a_video_past_the_byte_limit_is_refused(monkeypatch, media_dir, clip):
    monkeypatch.setattr(video, "MAX_VIDEO_BYTES", len(clip) - 1)
    policy = MediaPolicy(str(media_dir))
    for url in (video_data_url(clip), (media_dir / "clip.mp4").as_uri()):
        with pytest.raises(MediaError, match=f"v: the video is larger than {len(clip) - 1} bytes"):
            video.load_video(url, policy, "v")
    assert media.MAX_VIDEO_BYTES == 256 * 2**20


# -- the server against the offline engine and Hugging Face -------------------------------------------


def _hf_inputs(mm, text: str, frames: np.ndarray, fps: float) -> dict:
    """Hugging Face's inputs for `text` and the video `frames` at `fps`, made by the engine's processor
    (Qwen2_5_VLProcessor's placeholder expansion; second_per_grid_ts = 2 / fps)."""
    import torch
    from PIL import Image

    out = mm.hf_processor(text=text, videos=[[Image.fromarray(f) for f in frames]], fps=[fps])
    ids = torch.tensor(out["input_ids"])
    inputs = {name: torch.tensor(value) for name, value in out.items() if name != "input_ids"}
    types = 2 * (ids == mm.video_token_id).long()  # get_rope_index: 2 marks a video's tokens
    return {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}


def test_openai_client_video_matches_offline_and_hugging_face(vlm, llm, model_dir, clip):
    """The official client's data-URL video: the same greedy tokens and logprobs as LLM.chat's video_url
    and as LLM.generate given the decoded, sampled frames at their 4 fps; the same tokens as Hugging
    Face's Qwen2_5_VLForConditionalGeneration on those frames with second_per_grid_ts = 2 / 4, and the
    offline prompt logprobs within 2e-4 of its. The frames' own rate matters: at the directory's 2 fps
    the prompt's logprobs differ."""
    import torch
    import transformers

    proc, _ = vlm
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none")
    response = client.chat.completions.create(
        **_chat(_video(video_data_url(clip))), logprobs=True, extra_body={"return_token_ids": True}
    )
    choice = response.choices[0]
    served_ids = choice.to_dict()["token_ids"]
    served_logprobs = np.array([entry.logprob for entry in choice.logprobs.content])
    assert len(served_ids) == 4 and choice.finish_reason == "length"

    frames, metadata = video.decode_video(clip, "f", NUM_FRAMES)
    assert metadata["fps"] == KEPT_FPS and metadata["frames_indices"] == [0, 3, 6, 9]
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{QUESTION}{VIDEO}\n"}], add_generation_prompt=True, tokenize=False
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0)
    chat = llm.chat(_messages(_video(video_data_url(clip))), params, use_tqdm=False)[0]
    prompt = {"prompt": text, "multi_modal_data": {"video": (frames, {"fps": metadata["fps"]})}}
    offline = llm.generate(prompt, params, use_tqdm=False)[0]
    for out in (chat, offline):
        ids = list(out.outputs[0].token_ids)
        assert ids == served_ids
        logprobs = [entry[tid].logprob for entry, tid in zip(out.outputs[0].logprobs, ids)]
        np.testing.assert_allclose(logprobs, served_logprobs, atol=1e-5)
    assert response.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert offline.prompt_token_ids.count(llm.input_processor.mm_processor.video_token_id) == 2 * 16

    mm = llm.input_processor.mm_processor
    inputs = _hf_inputs(mm, text, frames, KEPT_FPS)
    assert inputs["video_grid_thw"].tolist() == [[2, 8, 8]]
    assert inputs["second_per_grid_ts"].tolist() == [0.5]
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    hf_tokens, hf_ids, hf_logprobs = hf_greedy(hf.eval(), inputs, max_tokens=4)
    assert offline.prompt_token_ids == hf_ids and hf_tokens == served_ids
    ours = np.array([entry[tid].logprob for entry, tid in zip(offline.prompt_logprobs[1:], hf_ids[1:])])
    np.testing.assert_allclose(ours, hf_logprobs, atol=2e-4)

    at_two = llm.generate({"prompt": text, "multi_modal_data": {"video": frames}}, params, use_tqdm=False)[0]
    theirs = np.array([entry[tid].logprob for entry, tid in zip(at_two.prompt_logprobs[1:], hf_ids[1:])])
    assert np.abs(theirs - ours).max() > 1e-3  # the text after the video sees other positions
    assert llm.engine_core.runner.guard.num_unexpected == 0


def test_a_qwen3_vl_video_url_is_timed_at_its_kept_rate(tmp_path, clip):
    """Qwen3-VL's video_url part (LLM.chat): each frame pair's time in the prompt's text is at the kept
    frames' own rate (4 fps: pairs at 0.125 and 0.625 s), and the answer is LLM.generate's on the decoded
    frames with that fps, token for token and logprob for logprob."""
    # Two requests: compiled as they run, not warmed up (test_qwen_vl.py's qwen3_vl engine guards that).
    args = {**ENGINE_ARGS, "strict_compile_guard": False, "enforce_eager": True}
    llm = LLM(save_tiny_qwen3_vl(str(tmp_path / "qwen3-vl")), **args, media_io_kwargs=MEDIA_IO)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
    chat = llm.chat(_messages(_video(video_data_url(clip))), params, use_tqdm=False)[0]
    frames, metadata = video.decode_video(clip, "f", NUM_FRAMES)
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{QUESTION}{VIDEO}\n"}], add_generation_prompt=True, tokenize=False
    )
    prompt = {"prompt": text, "multi_modal_data": {"video": (frames, {"fps": metadata["fps"]})}}
    offline = llm.generate(prompt, params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == offline.prompt_token_ids
    prompt_text = llm.tokenizer.decode(offline.prompt_token_ids)
    assert "<0.1 seconds>" in prompt_text and "<0.6 seconds>" in prompt_text  # not 2 fps's 0.2, 1.2
    assert chat.outputs[0].token_ids == offline.outputs[0].token_ids
    assert [e[t].logprob for e, t in zip(chat.outputs[0].logprobs, chat.outputs[0].token_ids)] == [
        e[t].logprob for e, t in zip(offline.outputs[0].logprobs, offline.outputs[0].token_ids)
    ]


def test_a_local_video_file_under_the_allowed_path_is_read(vlm, media_dir, clip):
    _, client = vlm
    by_file = client.post("/v1/chat/completions", json=_chat(_video((media_dir / "clip.mp4").as_uri())))
    by_data = client.post("/v1/chat/completions", json=_chat(_video(video_data_url(clip))))
    assert by_file.status_code == 200, by_file.text
    assert by_file.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]


def _responses(*parts) -> dict:
    content = [{"type": "input_text", "text": QUESTION}, *parts]
    body = {"model": NAME, "input": [{"role": "user", "content": content}], "store": False}
    return body | {"max_output_tokens": 4, "temperature": 0, "include": ["message.output_text.logprobs"]}


def test_a_responses_video_url_part_answers_as_the_chat_route(vlm, clip):
    """The Responses API takes chat's `video_url` part in a user message's content (OpenAI's defines no
    video part): the same prompt, tokens and logprobs as the chat route's; a refusal names the
    Responses part."""
    _, client = vlm
    url = video_data_url(clip)
    chat = client.post("/v1/chat/completions", json={**_chat(_video(url)), "logprobs": True})
    answer = client.post("/v1/responses", json=_responses(_video(url)))
    assert chat.status_code == 200 and answer.status_code == 200, answer.text
    chat, answer = chat.json(), answer.json()
    (text,) = answer["output"][0]["content"]
    assert text["text"] == chat["choices"][0]["message"]["content"]
    served = [(e["token"], e["logprob"]) for e in chat["choices"][0]["logprobs"]["content"]]
    assert [(e["token"], e["logprob"]) for e in text["logprobs"]] == served and len(served) == 4
    assert answer["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    response, port = send(client, "/v1/responses", _responses(_video(url), _video(url)))
    error = check_error(response, 400, "input[0].content[2].video_url")
    assert "2 videos in one request; at most 1 (--limit-mm-per-prompt)" in error["message"]
    response, port = send(client, "/v1/responses", _responses(_video("file:///etc/passwd")))
    assert (
        "outside --allowed-local-media-path"
        in check_error(response, 400, "input[0].content[1].video_url")["message"]
    )
    check_still_serving(client, port)


# -- refusals ------------------------------------------------------------------------------------------

PART = "messages[0].content[1].video_url"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:video/mp4;base64,!!!not-base64", "not valid base64"),
        (video_data_url(b"plain text, not a video at all"), "not a video PyAV can decode"),
        ("EMPTY", "the video has no frames"),
        # 64 x 64 frames are 64 tokens a pair: 4 frames kept, 2 pairs, 128 tokens.
        ("LARGE", "128 tokens; a video may have at most 64"),
        ("https://videos.example.com/clip.mp4", "not in --allowed-media-domains"),
        ("file:///etc/passwd", "outside --allowed-local-media-path"),
        ("ftp://videos.example.com/clip.mp4", "the video URL must be a data: URL"),
    ],
)
def test_hostile_videos_are_a_400_naming_the_part(vlm, url, message):
    _, client = vlm
    if url == "EMPTY":
        url = video_data_url(empty_video())
    elif url == "LARGE":
        url = video_data_url(encode_video(colour_frames(4, size=64), 4))
    response, port = send(client, "/v1/chat/completions", _chat(_video(url)))
    error = check_error(response, 400, PART)
    assert message in error["message"], error
    check_still_serving(client, port)


def test_more_videos_than_the_limit_are_refused(vlm, clip):
    _, client = vlm
    url = video_data_url(clip)
    response, port = send(client, "/v1/chat/completions", _chat(_video(url), _video(url)))
    error = check_error(response, 400, "messages[0].content[2].video_url")
    assert "2 videos in one request; at most 1 (--limit-mm-per-prompt)" in error["message"]
    check_still_serving(client, port)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"video": {"num_frames": 0}}', "num_frames must be an integer >= 1 or -1"),
        ('{"audio": {}}', r"modalities \['audio'\] are not supported"),
        ('{"video": {"fps": 2}}', "media_io_kwargs.video must be like"),
    ],
)
def test_bad_media_io_kwargs_are_refused_at_start(value, message):
    from xlaserve.config import ModelConfig

    with pytest.raises(ValueError, match=message):
        ModelConfig(media_io_kwargs=value)


# -- a request's mm_processor_kwargs, media named by uuid ----------------------------------------------

# A 40 x 48 image: 30 tokens at the server's bounds, 4 x 3 (24 x 32 pixels) under these.
SMALL = {"max_pixels": 32 * 32}


def _image_part(url: str | None, **extra) -> dict:
    return {"type": "image_url", "image_url": None if url is None else {"url": url}, **extra}


def _answer(client, part, **fields) -> tuple[int, list[int], list[float]]:
    """(prompt tokens, greedy tokens, their logprobs) of a chat with `part`."""
    body = {**_chat(part), "logprobs": True, "return_token_ids": True, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    choice = answer["choices"][0]
    logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
    return answer["usage"]["prompt_tokens"], choice["token_ids"], logprobs


def test_a_requests_mm_processor_kwargs_resize_its_image_as_hugging_face(vlm, llm, model_dir):
    """vLLM's per-request mm_processor_kwargs: max_pixels 1024 makes a 40 x 48 image 12 tokens, not 30,
    for that request alone (the same image before and after answers as it did: the feature's hash is of
    the pixels made, so the caches keep the two encodings apart); the served answer is LLM.chat's with
    the same kwargs, and Hugging Face's Qwen2VLImageProcessorPil at those bounds with its model gives the
    same tokens and prompt logprobs within 2e-4."""
    import torch
    import transformers

    _, client = vlm
    image = random_image(7)
    part = _image_part(data_url(image))
    plain = _answer(client, part)
    small = _answer(client, part, mm_processor_kwargs=SMALL)
    assert plain[0] - small[0] == 30 - 12 and small[2] != plain[2]
    assert _answer(client, part) == plain

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0)
    out = llm.chat(_messages(part), params, use_tqdm=False, mm_processor_kwargs=SMALL)[0]
    ids = list(out.outputs[0].token_ids)
    assert ids == small[1] and len(out.prompt_token_ids) == small[0]
    mm = llm.input_processor.mm_processor
    mm.processor_for({"max_pixels": 4096})  # the server's bounds are as they were (else a MediaError)
    # One build per kwargs: a route's check and its processing (and later requests) share it.
    assert mm.processor_for(dict(SMALL)) is mm.processor_for(SMALL) is not mm.hf_processor
    np.testing.assert_allclose(
        [e[t].logprob for e, t in zip(out.outputs[0].logprobs, ids)], small[2], atol=1e-5
    )

    hf_processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=32 * 32
    )
    pixels = hf_processor(images=[image], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 8, 6]]  # patches: 4 x 3 tokens of 2 x 2
    prompt = torch.tensor([out.prompt_token_ids])
    is_image = (prompt == llm.input_processor.mm_processor.image_token_id).long()
    assert int(is_image.sum()) == 12
    inputs = {
        **pixels,
        "input_ids": prompt,
        "attention_mask": torch.ones_like(prompt),
        "mm_token_type_ids": is_image,
    }
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    hf_tokens, hf_ids, hf_logprobs = hf_greedy(hf.eval(), inputs, max_tokens=4)
    assert hf_tokens == ids
    ours = [entry[tid].logprob for entry, tid in zip(out.prompt_logprobs[1:], hf_ids[1:])]
    np.testing.assert_allclose(ours, hf_logprobs, atol=2e-4)


def test_offline_prompts_take_mm_processor_kwargs_and_multi_modal_uuids(llm):
    """A prompt's `fps` setting times frames that state no rate as their own rate does; multi_modal_uuids
    name a video, and a None video with its uuid is the one last sent under it; bad ones are refused."""
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{QUESTION}{VIDEO}\n"}], add_generation_prompt=True, tokenize=False
    )
    frames = colour_frames(4)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def run(data: dict, **fields) -> list[float]:
        out = llm.generate({"prompt": text, "multi_modal_data": data, **fields}, params, use_tqdm=False)[0]
        return [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]

    timed = run({"video": (frames, {"fps": 4.0})})
    assert run({"video": frames}, mm_processor_kwargs={"fps": 4.0}) == timed
    assert run({"video": frames}) != timed  # the directory's 2 fps
    assert run({"video": [(frames, {"fps": 4.0})]}, multi_modal_uuids={"video": "clip"}) == timed
    assert run({"video": [None]}, multi_modal_uuids={"video": ["clip"]}) == timed
    for fields, error, message in [
        (
            {"multi_modal_uuids": {"video": ["a", "b"]}},
            ValueError,
            r"multi_modal_uuids.video must hold one uuid",
        ),
        ({"multi_modal_uuids": {"image": "a"}}, ValueError, "for modalities of multi_modal_data"),
        (
            {"mm_processor_kwargs": {"max_pixels": 5000}},
            MediaError,
            "mm_processor_kwargs.max_pixels: at most 4096",
        ),
    ]:
        with pytest.raises(error, match=message):
            run({"video": frames}, **fields)
    with pytest.raises(MediaError, match="no video was sent under uuid 'other'"):
        run({"video": [None]}, multi_modal_uuids={"video": ["other"]})


def test_a_uuid_alone_names_the_image_last_sent_under_it(vlm):
    """vLLM's reference: a part with `image_url` null and a `uuid` is the image last sent under that uuid
    (processed with this request's settings); a uuid sent again with another image names that one, and
    never answers a request that sends its image with the other's encoding."""
    _, client = vlm
    first, second = (data_url(random_image(seed)) for seed in (11, 12))
    reference = _image_part(None, uuid="pet")
    answer = _answer(client, _image_part(first, uuid="pet"))
    assert _answer(client, reference) == answer
    assert _answer(client, reference, mm_processor_kwargs=SMALL)[0] == answer[0] - 18
    again = _answer(client, _image_part(second, uuid="pet"))
    assert again != answer and again == _answer(client, _image_part(second))
    assert _answer(client, reference) == again
    for part, message in [
        (_image_part(None, uuid="never-sent"), "no image was sent under uuid 'never-sent'"),
        (_image_part(None), "needs the uuid of one sent before"),
    ]:
        response, port = send(client, "/v1/chat/completions", _chat(part))
        error = check_error(response, 400)
        assert error["param"] == "messages[0].content[1].image_url" and message in error["message"], error
        check_still_serving(client, port)


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"max_pixels": 4097}, "max_pixels", "at most 4096, the server's max_pixels"),
        ({"max_pixels": "big"}, "max_pixels", "must be a positive integer"),
        ({"min_pixels": 4096, "max_pixels": 1024}, "min_pixels", "4096 is more than max_pixels (1024)"),
        ({"fps": -2}, "fps", "must be a number of frames a second > 0"),
        ({"do_resize": False}, "do_resize", "not a per-request setting of this model's processor"),
    ],
)
def test_hostile_mm_processor_kwargs_are_a_400_naming_the_key(vlm, kwargs, param, message):
    _, client = vlm
    for body in (
        _chat(_image_part(data_url(random_image(7)))),
        {**_chat(), "messages": [{"role": "user", "content": "Hi"}]},
    ):
        response, port = send(client, "/v1/chat/completions", {**body, "mm_processor_kwargs": kwargs})
        error = check_error(response, 400)
        assert error["param"] == f"mm_processor_kwargs.{param}" and message in error["message"], error
        check_still_serving(client, port)

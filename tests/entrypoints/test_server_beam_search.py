"""`use_beam_search` on /v1/completions and /v1/chat/completions (serving/beam_search.py), on the session
server: one beam is greedy decoding, several come best first by vLLM's score with the logprobs a
teacher-forced prompt gives their tokens, streamed answers equal whole ones, and the fields a search
would not apply are 400s naming them."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.server_harness import MODEL_NAME

PROMPT = "Once upon a time, in a small village,"


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        server.url + path, json={"model": MODEL_NAME, **body}, headers=server.headers, timeout=300
    )


def _completion(server, **fields) -> dict:
    response = _post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_one_beam_is_greedy_decoding(server):
    beam = _completion(server, use_beam_search=True, n=1, ignore_eos=True)
    greedy = _completion(server, ignore_eos=True)
    assert beam["choices"][0]["text"] == greedy["choices"][0]["text"] and beam["choices"][0]["text"]
    assert beam["usage"] == greedy["usage"] | {
        "prompt_tokens_details": beam["usage"]["prompt_tokens_details"]
    }


def test_beams_come_best_first_with_their_teacher_forced_logprobs(server):
    answer = _completion(server, use_beam_search=True, n=3, logprobs=2)
    num_prompt = answer["usage"]["prompt_tokens"]
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and len({c["text"] for c in choices}) == 3
    assert answer["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in choices)
    scores = []
    for choice in choices:
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]) == choice["text"] and choice["finish_reason"] == "length"
        assert all(len(top) >= 2 for top in logprobs["top_logprobs"])
        scores.append(sum(logprobs["token_logprobs"]) / (num_prompt + len(logprobs["tokens"])))
        # The same tokens fed back as a prompt: the prompt logprobs of the beam's tokens (float32, the
        # session server's dtype: batch invariance is bitwise in bfloat16, test_beam_search.py).
        ids = _tokens(server, PROMPT) + _tokens(server, choice["text"], special=False)
        forced = _completion(server, prompt=ids, max_tokens=1, echo=True, logprobs=0)["choices"][0][
            "logprobs"
        ]
        assert forced["token_logprobs"][num_prompt : num_prompt + 6] == pytest.approx(
            logprobs["token_logprobs"], abs=5e-5
        )
    assert scores == sorted(scores, reverse=True)


def _tokens(server, text: str, special: bool = True) -> list[int]:
    response = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": special})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_chat_beams_and_the_stream_equal_the_whole_answer(server):
    body = {
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_completion_tokens": 8,
        "use_beam_search": True,
        "n": 2,
    }
    whole = _post(server, "/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    choices = whole.json()["choices"]
    assert len(choices) == 2 and all(c["message"]["content"] for c in choices)
    assert choices[0]["message"]["content"] != choices[1]["message"]["content"]
    streamed: dict[int, str] = {}
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={"model": MODEL_NAME, **body, "stream": True},
        headers=server.headers,
        timeout=300,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    streamed[choice["index"]] = streamed.get(choice["index"], "") + (
                        choice["delta"].get("content") or ""
                    )
    assert streamed == {c["index"]: c["message"]["content"] for c in choices}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": ["\n"]}, "stop"),
        ({"top_p": 0.5}, "top_p"),
        ({"seed": 3}, "seed"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 11}, "n"),
        ({"length_penalty": 11}, "length_penalty"),
    ],
)
def test_what_a_search_would_not_apply_is_a_400(server, fields, param):
    response = _post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, **fields}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_forced_tool_call_is_a_400_naming_tool_choice(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [tool],
        "tool_choice": "required",
        "use_beam_search": True,
    }
    response = _post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tool_choice"


def test_a_streamed_completion_search_is_vllms_400(server):
    """vLLM refuses a streamed beam search on /v1/completions (its chat route streams it whole, above)."""
    response = _post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, "stream": True},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["message"], error["param"]) == (
        "Streaming is not currently supported with beam search",
        "stream",
    )

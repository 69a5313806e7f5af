"""Start-up against a KV cache too small for the context length: an error naming both numbers and
the flags when the user set max_model_len, else the length lowered to what the cache holds."""

from __future__ import annotations

import logging

import pytest

from xlaserve.worker.kv_cache import fit_max_model_len


def test_fit_max_model_len():
    assert fit_max_model_len(512, 32, 16, is_user_set=True) == 512
    assert fit_max_model_len(8192, 9, 16, is_user_set=False) == 144
    with pytest.raises(ValueError) as e:
        fit_max_model_len(8192, 9, 16, is_user_set=True)
    message = str(e.value)
    assert message.startswith("max_model_len (8192) is larger than the maximum number of tokens")
    assert "(144" in message and "kv_cache_memory" in message and "--max-model-len" in message


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("torch")
    from helpers.tiny_models import save_tiny_llama

    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))  # max_position_embeddings 512


def test_user_max_model_len_the_cache_cannot_hold_fails_at_start(tiny_llama):
    from xlaserve import LLM

    with pytest.raises(ValueError, match=r"max_model_len \(512\) is larger .* KV cache \(48"):
        LLM(tiny_llama, max_model_len=512, num_gpu_blocks_override=4, enforce_eager=True)


def test_model_max_len_is_lowered_to_the_cache(tiny_llama, caplog):
    from xlaserve import LLM, SamplingParams

    with caplog.at_level(logging.WARNING):
        llm = LLM(tiny_llama, num_gpu_blocks_override=4, enforce_eager=True)  # 3 usable blocks of 16
    assert llm.max_model_len == llm.engine_core.max_model_len == 48
    assert "max_model_len lowered from 512" in caplog.text
    with pytest.raises(ValueError, match="max_model_len=48"):
        llm.generate({"prompt_token_ids": [5] * 48}, use_tqdm=False)
    [output] = llm.generate({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=8), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8


def test_without_chunked_prefill_each_prompt_is_computed_whole(tiny_llama, caplog):
    """vLLM's --no-enable-chunked-prefill: max_model_len is held to max_num_batched_tokens (a user's
    larger one refused naming both), and a prompt longer than the chunk cap is computed in one step
    beside a decoding request, where the default splits it into capped chunks; the tokens and
    logprobs are the same bits either way (batch invariance: float32's dots too, which is not the default;
    without it the bits held on an AVX2-only CPU and differed on an AVX-512 one, whose GEMM blocks a
    32-row dot's sum otherwise than a 16-row one's)."""
    from xlaserve import LLM, SamplingParams

    args = {
        "max_num_batched_tokens": 32,
        "enforce_eager": True,
        "dtype": "float32",
        "batch_invariant_float32": True,
    }
    with pytest.raises(
        ValueError,
        match=r"max_model_len \(64\) exceeds max_num_batched_tokens \(32\): this model computes each "
        r"prompt whole in one step \(enable_chunked_prefill is off\)",
    ):
        LLM(tiny_llama, max_model_len=64, enable_chunked_prefill=False, **args)
    prompts = [{"prompt_token_ids": [5, 9, 13, 2]}, {"prompt_token_ids": list(range(3, 27))}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    runs = {}
    for chunked in (False, True):
        with caplog.at_level(logging.WARNING):
            llm = LLM(tiny_llama, enable_chunked_prefill=chunked, long_prefill_token_threshold=8, **args)
        assert (llm.max_model_len == 32) == (not chunked)
        scheduler, steps = llm.engine_core.scheduler, []
        schedule = scheduler.schedule

        def recorded(schedule=schedule, steps=steps):
            output = schedule()
            steps.append({s.request.request_id: s.num_new_tokens for s in output.scheduled})
            return output

        scheduler.schedule = recorded
        outs = llm.generate(prompts, params, use_tqdm=False)
        long_id = outs[1].request_id
        chunks = [step[long_id] for step in steps if long_id in step][:3]
        runs[chunked] = chunks, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert "max_model_len lowered from 512 to max_num_batched_tokens (32)" in caplog.text
    assert runs[False][0][0] == 24 and runs[True][0] == [8, 8, 8]
    assert runs[False][1] == runs[True][1]

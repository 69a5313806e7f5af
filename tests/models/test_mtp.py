"""Speculative decoding with a checkpoint's multi-token prediction layer (`{"method": "mtp"}`,
worker/mtp.py) on a tiny Qwen3.5: every draft the engine proposes is the one Hugging Face's own layer
classes compute for that MTP wiring (helpers/mtp_cases.py), greedy output keeps the target's tokens and
logprobs bit for bit in bfloat16, and an MTP layer that predicts the target is accepted."""

from __future__ import annotations

import pytest

from helpers.family_cases import ENGINE_ARGS, NUM_GREEDY, hf_greedy, prompts
from helpers.mtp_cases import (
    hf_drafts,
    record_drafts,
    save_deepseek_v3_with_mtp,
    save_qwen3_5_vl_with_mtp,
    save_qwen3_5_with_mtp,
)
from helpers.tiny_models import elemental_emitters
from xlaserve import LLM, SamplingParams

VOCAB = 101
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True, logprobs=1)


def _numbers(out):
    first = out.outputs[0]
    return list(first.token_ids), [e[t].logprob for e, t in zip(first.logprobs, first.token_ids)]


@pytest.mark.parametrize("family", ["Qwen3_5", "Qwen3Next", "DeepseekV3", "Glm4Moe"])
def test_every_draft_is_the_mtp_layers_own(tmp_path, family):
    """k = 2, float32, one request at a time: each step's two drafts (the first from the target's
    hidden state, the second from the layer's own output) equal Hugging Face's layers' for the same
    positions, and the tokens are Hugging Face's greedy ones. Qwen3-Next's MTP layer has its experts
    (stacked at load as the decoder's are); DeepSeek V3's is its decoder layer `num_hidden_layers` (MLA
    over its own one-layer latent cache, MoE), plain norms, the embedding zeroed at position 0; GLM-4.5's
    is stored and wired as DeepSeek's, its layer GQA (biases, half-rotary heads, q/k norm) over plain K/V."""
    first, second = prompts(VOCAB, seed=2)[:2]
    if family in ("DeepseekV3", "Glm4Moe"):
        path, hf, layer, mtp = save_deepseek_v3_with_mtp(str(tmp_path), family=family)
        second = second[:4]  # short: the embedding zeroed at position 0 shows in drafts 5, 9 and 10
    else:
        path, hf, layer, mtp = save_qwen3_5_with_mtp(str(tmp_path), family=family)
    batch = [{"prompt_token_ids": first}, {"prompt_token_ids": second}]
    expected = [hf_greedy(hf, p["prompt_token_ids"]) for p in batch]
    with elemental_emitters():  # compared with Hugging Face's layers only
        llm = LLM(path, **ENGINE_ARGS, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    seen = record_drafts(llm)
    for prompt, tokens in zip(batch, expected):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert _numbers(out)[0] == tokens
        seq = prompt["prompt_token_ids"] + tokens
        steps = [(p, d) for p, d in seen[out.request_id] if p < len(seq) - 1]
        assert len(steps) >= len(tokens) // 2  # a proposal after (nearly) every step
        assert [d for _, d in steps] == hf_drafts(hf, layer, mtp, seq, [p for p, _ in steps], 2)


def test_drafts_after_an_image_rotate_by_the_targets_mrope_positions(tmp_path):
    """A Qwen3.5 release (images before the hybrid decoder) with its MTP layer, k = 2: over an image
    prompt the layer rotates each position by the target's M-RoPE streams (the image's rows and columns,
    the text after it shifted), and its drafts past the prompt by their position plus that shift: every
    draft is the one Hugging Face's layers compute with get_rope_index's positions, and the tokens are
    Hugging Face's greedy ones."""
    import torch

    from helpers.tiny_vlm import ENGINE_ARGS as VL_ARGS
    from helpers.tiny_vlm import hf_greedy as hf_vl_greedy
    from helpers.tiny_vlm import random_image

    path, hf, layer, mtp = save_qwen3_5_vl_with_mtp(str(tmp_path))
    # Room for the state slots and the MTP layer's K/V too; programs compiled as used.
    args = {**VL_ARGS, "kv_cache_memory": 4 * 2**20, "enforce_eager": True, "strict_compile_guard": False}
    with elemental_emitters():  # compared with Hugging Face's layers only
        llm = LLM(path, **args, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    seen = record_drafts(llm)
    image, text = random_image(1), "Look <|vision_start|><|image_pad|><|vision_end|> and say"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False)[0]
    processed = llm.input_processor.mm_processor.hf_processor(text=text, images=[image])
    images = {name: torch.tensor(processed[name]) for name in ("pixel_values", "image_grid_thw")}
    ids = torch.tensor(processed["input_ids"])
    types = (ids == hf.config.image_token_id).long()  # what get_rope_index reads
    inputs = {**images, "input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}
    tokens = list(out.outputs[0].token_ids)
    assert tokens == hf_vl_greedy(hf, inputs, max_tokens=NUM_GREEDY)[0]
    seq = out.prompt_token_ids + tokens
    steps = [(p, d) for p, d in seen[out.request_id] if p < len(seq) - 1]
    assert len(steps) >= len(tokens) // 2
    images["image_token_id"] = hf.config.image_token_id
    assert [d for _, d in steps] == hf_drafts(hf, layer, mtp, seq, [p for p, _ in steps], 2, images)


def _acceptance(llm) -> tuple[float, float]:
    metrics = {(m.name, tuple(m.labels.items())): m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (
        metrics[("xlaserve:spec_decode_num_accepted_tokens", ())],
        metrics[("xlaserve:spec_decode_num_draft_tokens", ())],
    )


def test_an_mtp_layer_that_predicts_the_target_is_accepted_and_changes_no_bit(tmp_path):
    """bfloat16 (batch invariance on, the default): an MTP layer whose drafts are the target's own next
    tokens (helpers/mtp_cases.py `oracle`) is accepted at both draft positions, and four requests in
    flight decode the plain engine's tokens and logprobs bit for bit. The research stack reaches the
    layer: after sleep(2) and wake_up the same bits; an update of its `mtp.*` tensors is what it drafts
    with (their fc zeroed: drafts rejected; the checkpoint's again: accepted), and only whole."""
    import numpy as np
    from safetensors.numpy import load_file

    path, *_ = save_qwen3_5_with_mtp(str(tmp_path), oracle=True)
    args = {**ENGINE_ARGS, "dtype": "bfloat16"}
    batch = [{"prompt_token_ids": p} for p in prompts(VOCAB, seed=3)]
    expected = [_numbers(o) for o in LLM(path, **args).generate(batch, GREEDY, use_tqdm=False)]
    llm = LLM(path, **args, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [_numbers(o) for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected
    accepted, drafted = _acceptance(llm)
    assert drafted > 0 and accepted >= 0.8 * drafted, (accepted, drafted)
    metrics = {(m.name, tuple(m.labels.items())): m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics[("xlaserve:spec_decode_num_accepted_tokens_per_pos", (("position", "1"),))] > 0

    def run_and_count() -> tuple[float, float]:
        before = _acceptance(llm)
        assert [_numbers(o) for o in llm.generate(batch, GREEDY, use_tqdm=False)] == expected
        return tuple(now - then for now, then in zip(_acceptance(llm), before))

    # The drafter's cache and q buffer, and its layer's weights, freed too; its embedding and head read
    # from the target's weights placed back, not the deleted ones.
    slept = llm.sleep(2)
    assert llm.wake_up().device_bytes == slept.device_bytes
    accepted, drafted = run_and_count()
    assert accepted >= 0.8 * drafted, (accepted, drafted)

    layer = {name: t for name, t in load_file(f"{path}/model.safetensors").items() if name.startswith("mtp.")}
    with pytest.raises(ValueError, match=r"the MTP layer's tensors \(mtp\.\*\) are updated whole"):
        llm.update_weights({"mtp.fc.weight": layer["mtp.fc.weight"]})
    llm.update_weights({**layer, "mtp.fc.weight": np.zeros_like(layer["mtp.fc.weight"])})
    accepted, drafted = run_and_count()
    assert accepted < 0.5 * drafted, (accepted, drafted)
    llm.update_weights_from_path(path)
    accepted, drafted = run_and_count()
    assert accepted >= 0.8 * drafted, (accepted, drafted)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"speculative_config": {"method": "mtp", "model": "x"}}, "speculative_config.model is for method"),
        (
            {"speculative_config": {"method": "mtp"}, "pipeline_parallel_size": 2},
            "pipeline_parallel_size=2 cannot be combined with speculative_config method 'mtp'",
        ),
    ],
)
def test_mtp_settings_refused_at_start(args, message):
    from xlaserve.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("smollm2", **args)


def test_a_model_without_an_mtp_layer_is_refused_naming_the_method(tmp_path):
    from helpers.tiny_models import save_tiny_llama

    path = save_tiny_llama(str(tmp_path))
    with pytest.raises(
        ValueError, match=r"speculative_config.method 'mtp': LlamaForCausalLM has no multi-token"
    ):
        LLM(path, **ENGINE_ARGS, speculative_config={"method": "mtp", "num_speculative_tokens": 1})

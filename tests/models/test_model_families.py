"""Every dense family against Hugging Face, through the registry and the engine.

For each architecture a tiny random HF model (float32, 3 layers, odd MLP width, GQA where the
family has it, sliding windows short enough to matter for a 45-token prompt, each family's own
switches set so that they show: soft caps, YaRN, LongRoPE, partial RoPE, ...; see
`family_cases.FAMILIES`) is saved as safetensors with a word-level tokenizer, loaded by
`LLM(directory)`, and compared with transformers in float32: prefill logits through the paged cache
in chunks (max relative error 1e-4), and 16 greedy tokens for four requests in flight with chunked
prefill and prefix caching, equal to `generate`.

The engines run with enforce_eager: warm-up would compile every bucket and sampler variant per
family (~17 s each); lazily, a family compiles the few programs its tests use.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from helpers.family_cases import (
    ENGINE_ARGS,
    FAMILIES,
    LONGROPE_FROM,
    MAX_REL_ERR,
    NUM_GREEDY,
    chunk_bounds,
    engine_prefill_logits,
    hf_chunked_logits,
    hf_greedy,
    hf_logits,
    make_hf_model,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prompts,
    rel_err,
    save_hf_model,
)
from helpers.tiny_models import elemental_emitters
from xlaserve import LLM, SamplingParams


@dataclasses.dataclass
class Family:
    architecture: str
    hf_model: object
    llm: LLM
    directory: str


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    architecture = request.param
    hf_model = make_hf_model(architecture, seed=list(FAMILIES).index(architecture))
    directory = save_hf_model(hf_model, tmp_path_factory.mktemp(architecture))
    with elemental_emitters():  # its tests compare it with Hugging Face's outputs only
        llm = LLM(directory, **ENGINE_ARGS)
    return Family(architecture, hf_model, llm, directory)


# -- tests ---------------------------------------------------------------------------------------


def test_prefill_logits_match_hugging_face(family):
    ids = prompts(family.hf_model.config.vocab_size, seed=1)[0]
    ours = engine_prefill_logits(family.llm, ids, first_chunk=11)
    expected = hf_logits(family.hf_model, ids)
    assert ours.shape == expected.shape
    err = rel_err(ours, expected)
    assert err <= MAX_REL_ERR, f"{family.architecture}: prefill logits rel err {err:.2e}"


@pytest.mark.slow
def test_greedy_tokens_match_hugging_face(family):
    batch = prompts(family.hf_model.config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True)
    outputs = family.llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    expected = [hf_greedy(family.hf_model, p) for p in batch]
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert outputs[2].num_cached_tokens == 24  # the shared prefix of prompts 0 and 2
    # Again, every full prompt block now cached: the same tokens.
    again = family.llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == expected
    assert again[0].num_cached_tokens == 40


@pytest.mark.parametrize("family", ["Phi3ForCausalLM"], indirect=True)
def test_longrope_long_sequences(family):
    """Past original_max_position_embeddings LongRoPE switches to its long factors for the whole
    forward in Hugging Face, for us per sequence by its length after the step: the same thing for a
    prompt fed chunk by chunk. (HF's `generate` also recomputes the cache when a sequence crosses the
    threshold; the paged cache keeps the keys as they were written.)"""
    ids = np.random.default_rng(4).integers(3, family.hf_model.config.vocab_size, 80).tolist()
    ours = engine_prefill_logits(family.llm, ids, first_chunk=11)
    expected = hf_chunked_logits(family.hf_model, ids, chunk_bounds(len(ids), 11, 16))
    err = rel_err(ours, expected)
    assert err <= MAX_REL_ERR, f"LongRoPE past {LONGROPE_FROM} tokens: rel err {err:.2e}"
    short_only = rel_err(ours[: LONGROPE_FROM - 5], hf_logits(family.hf_model, ids[: LONGROPE_FROM - 5]))
    assert short_only <= MAX_REL_ERR

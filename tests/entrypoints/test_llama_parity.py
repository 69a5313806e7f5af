"""Our `LlamaForCausalLM` against Hugging Face's on tiny random checkpoints, logit by logit.

Each variant builds a random HF model in float32, loads its state_dict through `load_params`, and
runs prefills through the paged cache (built by `build_step_batch`, as the engine does): one chunk,
two chunks (the second attending to the cached first), and two sequences in one flat batch. Every
call of a variant uses the same padded shapes, so each variant compiles once.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from helpers.step_fakes import prompt_chunk
from xlaserve.kernels import KVCache, get_attention_backend
from xlaserve.models.config import TransformerConfig
from xlaserve.models.llama import LlamaForCausalLM
from xlaserve.models.weights import load_params
from xlaserve.worker.input_batch import build_step_batch

BLOCK_SIZE = 8
NUM_TOKENS = 64  # the padded token count of every call
NUM_SEQS = 4  # the padded sequence count of every call
MAX_BLOCKS_PER_SEQ = NUM_TOKENS // BLOCK_SIZE
NUM_BLOCKS = 24  # per layer; block 0 is the null block
MAX_REL_ERR = 1e-4

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 101,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

VARIANTS = {
    "gqa2_untied": dict(BASE),
    # head_dim 16, 3 query heads on 1 KV head, odd MLP width.
    "mqa_tied_linear": dict(
        BASE,
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=1,
        intermediate_size=97,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    # original_max_position_embeddings=32 (not 16) puts the head_dim-16 frequencies in all three
    # llama3 bands: wavelengths 6.3 (< 32/4, kept), 19.9 (blended), 62.8 and up (divided by 8).
    "mha_llama3": dict(
        BASE,
        num_key_value_heads=4,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "gqa2_dynamic": dict(
        BASE, max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    ),
}
PROMPT_LEN = 48  # longer than the dynamic variant's max_position_embeddings
SECOND_PROMPT_LEN = 15  # the other sequence of the two-sequence batch (48 + 15 <= NUM_TOKENS)
FIRST_CHUNK = 10


@dataclasses.dataclass
class Variant:
    name: str
    hf_model: object
    cfg: TransformerConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    prompt: np.ndarray  # [PROMPT_LEN]
    second_prompt: np.ndarray  # [SECOND_PROMPT_LEN]


def make_hf_model(kwargs: dict, seed: int):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**kwargs, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that every one of them shows in the logits
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    return model


def state_dict_numpy(hf_model) -> dict[str, np.ndarray]:
    return {name: t.detach().cpu().numpy().copy() for name, t in hf_model.state_dict().items()}


def load_ours(hf_model, tensors):
    cfg = TransformerConfig.from_hf(hf_model.config.to_dict())
    backend = get_attention_backend("reference")
    graphdef, params = load_params(
        LlamaForCausalLM,
        cfg,
        tensors,
        dtype=jnp.float32,
        make_model=lambda: LlamaForCausalLM(cfg, backend, dtype=jnp.float32, rngs=nnx.Rngs(0)),
    )
    return cfg, graphdef, params


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> Variant:
    seed = list(VARIANTS).index(request.param)
    hf_model = make_hf_model(VARIANTS[request.param], seed)
    cfg, graphdef, params = load_ours(hf_model, state_dict_numpy(hf_model))
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg.vocab_size, PROMPT_LEN)
    second_prompt = rng.integers(0, cfg.vocab_size, SECOND_PROMPT_LEN)
    return Variant(request.param, hf_model, cfg, graphdef, params, prompt, second_prompt)


# -- running our model -----------------------------------------------------------------------------


@partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, params, kv_cache, input_ids, positions, md):
    model = nnx.merge(graphdef, params)
    hidden, kv_cache = model(input_ids, positions, kv_cache, md)
    return model.compute_logits(hidden), kv_cache


def empty_cache(cfg: TransformerConfig) -> KVCache:
    shape = (cfg.num_layers * NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))


def scheduled(prompt, num_computed: int, num_new: int, block_ids):
    """A ScheduledRequest-like object, as build_step_batch reads it."""
    return prompt_chunk(prompt, num_computed, num_new, block_ids)


def run(v: Variant, batch: list, kv_cache: KVCache) -> tuple[list[np.ndarray], KVCache]:
    """One step; -> the logits [num_new, V] of each scheduled sequence, and the updated cache."""
    step = build_step_batch(batch, NUM_TOKENS, NUM_SEQS, MAX_BLOCKS_PER_SEQ, BLOCK_SIZE)
    logits, kv_cache = _forward(v.graphdef, v.params, kv_cache, step.input_ids, step.positions, step.md)
    logits = np.asarray(logits)
    starts = np.cumsum([0] + [s.num_new_tokens for s in batch])
    return [logits[a:b] for a, b in itertools.pairwise(starts)], kv_cache


def blocks_for(num_tokens: int, rng: np.random.Generator, taken: set[int]) -> list[int]:
    """Shuffled, non-contiguous block ids, never the null block 0 nor one already taken."""
    free = [b for b in rng.permutation(np.arange(1, NUM_BLOCKS)) if b not in taken]
    blocks = [int(b) for b in free[: -(-num_tokens // BLOCK_SIZE)]]
    taken.update(blocks)
    return blocks


def prefill_one_chunk(v: Variant, prompt) -> np.ndarray:
    key = (v.name, "ours", tuple(map(int, prompt)))
    if key not in _memo:
        blocks = blocks_for(len(prompt), np.random.default_rng(0), set())
        (_memo[key],), _ = run(v, [scheduled(prompt, 0, len(prompt), blocks)], empty_cache(v.cfg))
    return _memo[key]


# -- Hugging Face reference ------------------------------------------------------------------------


def hf_logits(hf_model, prompt) -> np.ndarray:
    with torch.no_grad():
        out = hf_model(torch.as_tensor(np.asarray(prompt)[None], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def hf_logits_incremental(hf_model, prompt, first: int) -> np.ndarray:
    """The first `first` tokens in one forward, then one token at a time on HF's KV cache: how
    dynamic NTK behaves while decoding (each step rescales with the length so far)."""
    # transformers 5.x renamed past_key_values to cache (argument and output field).
    cache_arg = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    ids = torch.as_tensor(np.asarray(prompt)[None], dtype=torch.long)
    with torch.no_grad():
        out = hf_model(ids[:, :first], use_cache=True)
        logits = [out.logits[0]]
        for t in range(first, ids.shape[1]):
            out = hf_model(ids[:, t : t + 1], use_cache=True, **{cache_arg: getattr(out, cache_arg)})
            logits.append(out.logits[0])
    return torch.cat(logits).float().numpy()


def reference_logits(v: Variant, prompt) -> np.ndarray:
    key = (v.name, "hf", tuple(map(int, prompt)))
    if key not in _memo:
        if v.cfg.rope_scaling_dict.get("rope_type") == "dynamic":
            # One HF forward over the whole prompt rescales every position by the full length; a
            # serving engine cannot (cached keys keep their rotation): compare with HF's decode loop.
            # HF's rotary module is stateful: it returns to the default base only on a forward
            # shorter than max_position_embeddings, so the first chunk stays below it.
            first = min(len(prompt), v.cfg.max_position_embeddings - 1)
            _memo[key] = hf_logits_incremental(v.hf_model, prompt, first)
        else:
            _memo[key] = hf_logits(v.hf_model, prompt)
    return _memo[key]


_memo: dict[tuple, np.ndarray] = {}


def rel_err(actual, expected) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


# -- tests -----------------------------------------------------------------------------------------


def test_prefill_matches_hugging_face(variant):
    ours = prefill_one_chunk(variant, variant.prompt)
    expected = reference_logits(variant, variant.prompt)
    assert ours.shape == expected.shape == (PROMPT_LEN, variant.cfg.vocab_size)
    assert rel_err(ours, expected) <= MAX_REL_ERR, f"{variant.name}: rel err {rel_err(ours, expected):.2e}"


def test_two_chunks_match_one(variant):
    """The second chunk attends to the first through the cache, as a chunked prefill does."""
    blocks = blocks_for(PROMPT_LEN, np.random.default_rng(1), set())
    cache = empty_cache(variant.cfg)
    (first,), cache = run(variant, [scheduled(variant.prompt, 0, FIRST_CHUNK, blocks)], cache)
    rest = PROMPT_LEN - FIRST_CHUNK
    (second,), _ = run(variant, [scheduled(variant.prompt, FIRST_CHUNK, rest, blocks)], cache)
    chunked = np.concatenate([first, second])
    one_chunk = prefill_one_chunk(variant, variant.prompt)
    assert rel_err(chunked, one_chunk) <= MAX_REL_ERR
    assert rel_err(chunked, reference_logits(variant, variant.prompt)) <= MAX_REL_ERR


def test_two_sequences_in_one_batch_match_each_alone(variant):
    rng, taken = np.random.default_rng(2), set()
    batch = [
        scheduled(variant.second_prompt, 0, SECOND_PROMPT_LEN, blocks_for(SECOND_PROMPT_LEN, rng, taken)),
        scheduled(variant.prompt, 0, PROMPT_LEN, blocks_for(PROMPT_LEN, rng, taken)),
    ]
    (second, first), _ = run(variant, batch, empty_cache(variant.cfg))
    assert rel_err(first, prefill_one_chunk(variant, variant.prompt)) <= MAX_REL_ERR
    assert rel_err(second, prefill_one_chunk(variant, variant.second_prompt)) <= MAX_REL_ERR
    assert rel_err(second, reference_logits(variant, variant.second_prompt)) <= MAX_REL_ERR


def test_decode_after_prefill_matches_hugging_face(variant):
    """A mixed step: one sequence decodes its next token while another prefills."""
    rng, taken = np.random.default_rng(3), set()
    long_blocks = blocks_for(PROMPT_LEN, rng, taken)
    cache = empty_cache(variant.cfg)
    _, cache = run(variant, [scheduled(variant.prompt, 0, PROMPT_LEN - 1, long_blocks)], cache)
    batch = [
        scheduled(variant.prompt, PROMPT_LEN - 1, 1, long_blocks),
        scheduled(variant.second_prompt, 0, SECOND_PROMPT_LEN, blocks_for(SECOND_PROMPT_LEN, rng, taken)),
    ]
    (decoded, prefilled), _ = run(variant, batch, cache)
    expected = reference_logits(variant, variant.prompt)[-1:]
    assert rel_err(decoded, expected) <= MAX_REL_ERR
    assert rel_err(prefilled, reference_logits(variant, variant.second_prompt)) <= MAX_REL_ERR


# -- loader errors ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_checkpoint():
    kwargs = dict(BASE, num_hidden_layers=2)
    model = make_hf_model(kwargs, seed=10)
    return model, state_dict_numpy(model)


def test_loader_names_a_missing_tensor(small_checkpoint):
    model, tensors = small_checkpoint
    tensors = dict(tensors)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        load_ours(model, tensors)


def test_loader_names_an_unexpected_tensor(small_checkpoint):
    model, tensors = small_checkpoint
    tensors = dict(tensors, **{"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)})
    with pytest.raises(
        ValueError, match=r"unexpected tensors \['model\.layers\.0\.self_attn\.q_norm\.weight'\]"
    ):
        load_ours(model, tensors)


def test_loader_names_a_tensor_of_the_wrong_shape(small_checkpoint):
    model, tensors = small_checkpoint
    tensors = dict(tensors)
    tensors["model.norm.weight"] = np.ones(63, np.float32)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_ours(model, tensors)


def test_loader_untied_head_is_required_tied_head_is_optional(small_checkpoint):
    model, tensors = small_checkpoint
    without_head = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_ours(model, without_head)
    model.config.tie_word_embeddings = True
    try:
        cfg, _, _ = load_ours(model, without_head)
        assert cfg.tie_word_embeddings
        load_ours(model, tensors)  # a tied checkpoint may still carry the head (HF saves both)
    finally:
        model.config.tie_word_embeddings = False

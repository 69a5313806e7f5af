"""Mixtral, Qwen3-MoE, gpt-oss, DeepSeek V2/V3, OLMoE, Granite MoE, Qwen2-MoE, MiniMax-M2 and GLM-4.5
against Hugging Face, on tiny random checkpoints.

Each family: a random HF model (float32, a few layers, 4-8 experts with top-2, GQA where the family
has it; DeepSeek with a dense first layer, grouped routing, small LoRA ranks, V3 with YaRN) saved as
safetensors with a small byte-level BPE tokenizer, then
- loaded through the registry by `LLM(dir)` (one engine per family, enforce_eager, both tests):
- its compiled forward prefills a prompt in chunks into shuffled blocks: logits within 1e-4 (max
  relative error) of HF's;
- it serves four requests in flight, prefills chunked by max_num_batched_tokens=16, prefix caching
  on (a second pass hits the cache): 16 greedy tokens each, equal to HF's `generate`.
Plus the pieces alone: the ragged_dot expert path and the routers against dense numpy, the MLA
kernel against full (unabsorbed) attention, and the expert-stacking loader's errors.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.family_cases import (
    engine_prefill_logits,
    one_torch_thread,  # noqa: F401 - an autouse fixture
)
from helpers.tiny_models import elemental_emitters
from xlaserve import LLM, SamplingParams
from xlaserve.kernels.mla import mla_paged_attention, write_latent
from xlaserve.models.loader import load_checkpoint
from xlaserve.models.moe import MoEConfig, grouped_expert_mlp, route, stack_expert_tensors
from xlaserve.models.registry import get_model_class, model_config_from_hf

MAX_REL_ERR = 1e-4
# A bfloat16 greedy token may trail float32's best by this much of the logits' range (a near tie).
BFLOAT16_TIE = 5e-3
VOCAB_SIZE = 320
NUM_NEW_TOKENS = 16
BLOCK_SIZE = 8

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
_DEEPSEEK = dict(
    _COMMON,
    num_hidden_layers=3,
    first_k_dense_replace=1,  # one dense layer, then two MoE layers: two layer stacks
    num_key_value_heads=4,  # HF's eager MLA needs kv heads == heads; ours has one latent "head"
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)
# name -> (transformers config class, model class, config kwargs)
FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    # Sinks, a sliding layer (8 tokens: the 54-token prompt's queries see past it) beside a full one,
    # biased router and experts, a clamp low enough to bind (1.5), YaRN.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        ),
    ),
    # Two of four groups, the score bias, routed_scaling_factor 2.5; biases on q_a, kv_a and o_proj.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _DEEPSEEK,
            topk_group=2,
            attention_bias=True,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            q_lora_rank=32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,  # != mscale: both the cos/sin factor and the softmax scale show
            },
        ),
    ),
    # Softmax routing: top 3 in the two of four groups with the best expert (k above topk_group, where
    # the limit can change the choice); q_proj whole, biases on kv_a and o_proj.
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            _DEEPSEEK,
            topk_method="group_limited_greedy",
            num_experts_per_tok=3,
            topk_group=2,
            n_shared_experts=2,
            q_lora_rank=None,
            attention_bias=True,
        ),
    ),
    # q and k normed over all heads at once, q/k/v clamped (tight enough to bind), no renormalization.
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=2,
            clip_qkv=1.5,
        ),
    ),
    # Granite's scalings around the experts (softmax over the top k logits), its fused expert names.
    "granite_moe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            intermediate_size=40,
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=6.0,
            attention_multiplier=0.125,
            residual_multiplier=0.25,
            logits_scaling=3.0,
        ),
    ),
    # Qwen2's q/k/v biases; top 2 of 6 not renormalized; the shared expert scaled by its sigmoid gate.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=6,
            num_experts_per_tok=2,
        ),
    ),
    # q and k normed over all heads at once, half of each head rotated (rotary_dim), the biased sigmoid
    # router renormalized over the top 2 of 8.
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            rotary_dim=8,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    # GLM-4.5: GQA with q/k/v biases, half of each head rotated, q/k normed; a dense first layer, then
    # DeepSeek V3's routing (two of four groups, the score bias, a shared expert).
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
        ),
    ),
}


def make_tokenizer():
    """A byte-level BPE of VOCAB_SIZE tokens trained on a few sentences (offline, milliseconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Paged attention keeps keys and values in fixed-size blocks.",
        "One two three four five six seven eight nine ten.",
        "def route(x): return top_k(softmax(x @ w), k)",
    ]
    tokenizer.train_from_iterator(corpus * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    assert len(fast) == VOCAB_SIZE
    return fast


def make_hf_model(name: str, seed: int = 0, **overrides):
    """The family's tiny random model; `overrides` change its config's fields."""
    import torch
    import transformers

    config_class, model_class, kwargs = FAMILIES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**(kwargs | overrides), attn_implementation="eager")
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # weights large enough that every one of them (and the routing) shows
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model


@dataclasses.dataclass
class Family:
    name: str
    directory: str
    hf_model: object
    prompts: list[list[int]]  # 29, 41, 54 and 9 tokens; the first three share a 3-block prefix
    llm: object  # the engine both tests of the family run (one set of compiled programs)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tokenizer, tmp_path_factory) -> Family:
    name = request.param
    directory = str(tmp_path_factory.mktemp(name))
    hf_model = make_hf_model(name, seed=list(FAMILIES).index(name))
    hf_model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    rng = np.random.default_rng(1)
    prefix = rng.integers(2, VOCAB_SIZE, 3 * BLOCK_SIZE).tolist()
    prompts = [prefix + rng.integers(2, VOCAB_SIZE, n).tolist() for n in (5, 17, 30)]
    prompts.append(rng.integers(2, VOCAB_SIZE, 9).tolist())
    with elemental_emitters():  # its tests compare it with Hugging Face's outputs only
        llm = LLM(
            directory,
            max_model_len=128,
            max_num_seqs=4,
            dtype="float32",
            max_num_batched_tokens=16,  # three of the prompts prefill in chunks; buckets 1, 4, 16
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
            kv_cache_memory=2 * 2**20,
            enforce_eager=True,  # compile only the buckets these steps use
        )
    return Family(name, directory, hf_model, prompts, llm)


def hf_logits(hf_model, prompt) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(torch.as_tensor([prompt]), use_cache=False).logits[0].float().numpy()


def bfloat16_weights(hf_model):
    """A float32 copy of `hf_model` with its parameters rounded to bfloat16, as a bfloat16 engine holds
    them (buffers, DeepSeek V3's score bias among them, stay float32, as the engine keeps it)."""
    import torch

    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    return model


def hf_greedy(hf_model, prompts: list[list[int]]) -> list[list[int]]:
    """HF's greedy `generate` of NUM_NEW_TOKENS for each prompt, one left-padded batch."""
    import torch

    width = max(map(len, prompts))
    ids = torch.as_tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.as_tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,  # 16 tokens whatever they are, like ignore_eos
            pad_token_id=0,
        )
    return out[:, width:].tolist()


def rel_err(actual, expected) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


# -- through the registry --------------------------------------------------------------------------


def test_prefill_logits_match_hugging_face(family):
    """Loaded through the registry, prefilled by the engine's own compiled forward in chunks (11
    tokens, then 16: later chunks read the earlier ones from the paged cache) into shuffled,
    non-contiguous blocks."""
    checkpoint = load_checkpoint(family.directory, progress=False)
    cfg = model_config_from_hf(checkpoint.hf_config)
    assert get_model_class(cfg.architecture).__name__ == FAMILIES[family.name][1]
    runner = family.llm.engine_core.runner
    assert type(nnx.merge(runner.graphdef, runner.params)).__name__ == FAMILIES[family.name][1]
    prompt = family.prompts[2]  # 54 tokens
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    blocks = np.random.default_rng(0).permutation(np.arange(1, runner.num_blocks))[:num_blocks]
    ours = engine_prefill_logits(family.llm, prompt, first_chunk=11, block_ids=blocks.tolist())
    expected = hf_logits(family.hf_model, prompt)
    assert ours.shape == expected.shape
    assert rel_err(ours, expected) <= MAX_REL_ERR, f"{family.name}: rel err {rel_err(ours, expected):.2e}"


@pytest.mark.slow
def test_engine_greedy_matches_hugging_face(family):
    llm = family.llm
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    expected = hf_greedy(family.hf_model, family.prompts)
    first = llm.generate([{"prompt_token_ids": p} for p in family.prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in first] == expected
    # Again, in reverse order: the finished requests' blocks are cached, so the prefixes are hits.
    second = llm.generate([{"prompt_token_ids": p} for p in family.prompts[::-1]], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in second] == expected[::-1]
    assert all(o.num_cached_tokens >= 3 * BLOCK_SIZE for o in second[1:])


# -- the MoE block alone ---------------------------------------------------------------------------


def moe_config(**changes) -> MoEConfig:
    base = {
        "architecture": "test",
        "vocab_size": 8,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_layers": 1,
        "num_heads": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e4,
        "rope_scaling": None,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 12,
    }
    return MoEConfig(**{**base, **changes})


def route_numpy(cfg: MoEConfig, logits: np.ndarray, bias: np.ndarray | None):
    """Hugging Face's routers, one token at a time."""
    weights, ids = [], []
    for row in logits.astype(np.float64):
        scores = (
            np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            if cfg.scoring_func == "softmax"
            else 1 / (1 + np.exp(-row))
        )
        choice = scores + (0 if bias is None else bias)
        groups = choice.reshape(cfg.n_group, -1)
        group_scores = groups.max(-1) if cfg.group_score == "max" else np.sort(groups, -1)[:, -2:].sum(-1)
        kept = np.argsort(-group_scores, kind="stable")[: cfg.topk_group]
        masked = np.full_like(groups, -np.inf if cfg.scoring_func == "sigmoid" else 0.0)
        masked[kept] = groups[kept]
        top = np.argsort(-masked.reshape(-1), kind="stable")[: cfg.num_experts_per_tok]
        w = scores[top]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        weights.append(w * cfg.routed_scaling_factor)
        ids.append(top)
    return np.array(weights), np.array(ids)


ROUTERS = {
    "mixtral": {},
    "qwen3_unnormalized": {"norm_topk_prob": False},
    "deepseek_v2_group_limited": {
        "norm_topk_prob": False,
        "num_experts_per_tok": 3,  # above topk_group: by their best expert, k <= topk_group is greedy
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.5,
    },
    "deepseek_v3": {
        "scoring_func": "sigmoid",
        "group_score": "top2_sum",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "has_score_correction_bias": True,
    },
}


@pytest.mark.parametrize("router", list(ROUTERS))
def test_route_matches_hugging_face_rule(router):
    cfg = moe_config(**ROUTERS[router])
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, cfg.num_experts)).astype(np.float32)
    bias = (
        rng.normal(scale=0.3, size=cfg.num_experts).astype(np.float32)
        if cfg.has_score_correction_bias
        else None
    )
    # Jitted, as the model runs it (op by op, each jnp op would compile its own program).
    weights, ids = jax.jit(route, static_argnums=0)(
        cfg, jnp.asarray(logits), None if bias is None else jnp.asarray(bias)
    )
    expected_weights, expected_ids = route_numpy(cfg, logits, bias)
    # The order of the k chosen experts is not part of the rule: compare sorted by expert id.
    order, expected_order = np.argsort(ids, axis=1), np.argsort(expected_ids, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1), np.sort(expected_ids, 1))
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, 1),
        np.take_along_axis(expected_weights, expected_order, 1),
        rtol=1e-5,
    )


def test_grouped_expert_mlp_matches_dense_numpy():
    rng = np.random.default_rng(0)
    num_tokens, top_k, num_experts, d, f = 37, 2, 6, 16, 12
    x = rng.normal(size=(num_tokens, d)).astype(np.float32)
    ids = np.stack(
        [rng.choice(num_experts - 1, top_k, replace=False) for _ in range(num_tokens)]
    )  # expert 5: idle
    weights = rng.uniform(size=(num_tokens, top_k)).astype(np.float32)
    w_gate, w_up = (rng.normal(size=(num_experts, d, f)).astype(np.float32) for _ in range(2))
    w_down = rng.normal(size=(num_experts, f, d)).astype(np.float32)
    out = jax.jit(grouped_expert_mlp)(x, weights, ids.astype(np.int32), w_gate, w_up, w_down)
    expected = np.zeros((num_tokens, d))
    for t in range(num_tokens):
        for k in range(top_k):
            e = ids[t, k]
            gate, up = x[t] @ w_gate[e], x[t] @ w_up[e]
            expected[t] += weights[t, k] * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_stack_expert_tensors_stacks_and_names_a_missing_expert():
    tensors = {
        f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight": np.full((3, 2), e, np.float32)
        for e in range(4)
    }
    tensors["model.norm.weight"] = np.ones(2, np.float32)
    stacked = stack_expert_tensors(tensors, num_experts=4)
    assert sorted(stacked) == ["model.layers.0.block_sparse_moe.experts_gate.weight", "model.norm.weight"]
    np.testing.assert_array_equal(
        stacked["model.layers.0.block_sparse_moe.experts_gate.weight"][:, 0, 0], range(4)
    )
    del tensors["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.block_sparse_moe\.experts\.2\.w1\.weight"):
        stack_expert_tensors(tensors, num_experts=4)


# -- the MLA kernel alone --------------------------------------------------------------------------


def test_mla_paged_attention_matches_unabsorbed_attention():
    """Two sequences in one flat batch (a decode token after 20 cached, a 13-token prefill chunk
    after 6 cached), against per-head K = W_uk c (+ k_pe), V = W_uv c attention in numpy."""
    rng = np.random.default_rng(0)
    heads, rank, rope, nope, v_dim, block_size, num_blocks = 3, 10, 4, 6, 5, 4, 16
    contexts, new = [21, 19], [1, 13]
    latents = [rng.normal(size=(n, rank + rope)).astype(np.float32) for n in contexts]
    w_uk = rng.normal(size=(rank, heads, nope)).astype(np.float32)
    w_uv = rng.normal(size=(rank, heads, v_dim)).astype(np.float32)
    q_nope = [rng.normal(size=(n, heads, nope)).astype(np.float32) for n in new]
    q_rope = [rng.normal(size=(n, heads, rope)).astype(np.float32) for n in new]
    blocks = rng.permutation(np.arange(1, num_blocks))
    tables = [blocks[:6], blocks[6:11]]
    slots = [
        table[np.arange(n) // block_size] * block_size + np.arange(n) % block_size
        for table, n in zip(tables, contexts)
    ]
    cache = np.full((num_blocks, block_size, 1, rank + rope), np.nan, np.float32)  # stale slots are NaN
    cache = jax.jit(write_latent)(
        jnp.asarray(cache), jnp.asarray(np.concatenate(latents)), jnp.asarray(np.concatenate(slots))
    )
    block_tables = np.zeros((4, 8), np.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = table
    query_start_loc = np.array([0, 1, 14, 14, 14], np.int32)
    kv_lens = np.array([*contexts, 0, 0], np.int32)
    scale = 0.3
    q_latent = np.concatenate([np.einsum("thd,rhd->thr", q, w_uk) for q in q_nope])

    def padded(a):  # to 16 tokens
        return np.concatenate([a, np.zeros((16 - len(a), *a.shape[1:]), np.float32)])

    attention = jax.jit(partial(mla_paged_attention, sm_scale=scale, tokens_per_chunk=8))  # several chunks
    out = attention(
        jnp.asarray(padded(q_latent)),
        jnp.asarray(padded(np.concatenate(q_rope))),
        cache,
        jnp.asarray(kv_lens),
        jnp.asarray(block_tables),
        jnp.asarray(query_start_loc),
        jnp.int32(2),
    )
    out = np.einsum("thr,rhv->thv", np.asarray(out), w_uv)
    expected = []
    for latent, qn, qr, n in zip(latents, q_nope, q_rope, new):
        k = np.concatenate(
            [np.einsum("sr,rhd->shd", latent[:, :rank], w_uk), np.repeat(latent[:, None, rank:], heads, 1)],
            -1,
        )
        v = np.einsum("sr,rhv->shv", latent[:, :rank], w_uv)
        q = np.concatenate([qn, qr], -1)
        s = np.einsum("thd,shd->ths", q, k) * scale
        pos = len(latent) - n + np.arange(n)
        s = np.where(np.arange(len(latent))[None, None, :] <= pos[:, None, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        expected.append(np.einsum("ths,shv->thv", p / p.sum(-1, keepdims=True), v))
    expected = np.concatenate(expected)
    np.testing.assert_allclose(out[:14], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    assert not np.any(out[14:])  # padding tokens


# float32 (its invariance asked for) on DeepSeek V3 alone: its router, experts and latent attention cover
# what float32 adds (each dot through `matmul`), V2's softmax router (Mixtral's) being the same code.
@pytest.mark.parametrize(
    ("name", "dtype"), [("deepseek_v2", "bfloat16"), ("deepseek_v3", "bfloat16"), ("deepseek_v3", "float32")]
)
def test_tokens_and_logprobs_are_the_same_bits_alone_and_among_companions(name, dtype, tokenizer, tmp_path):
    """Batch invariance for DeepSeek V2 and V3 (MoE with grouped routing, latent attention), at the dtype
    users run (bfloat16) and in float32 (`dtype="auto"` on a CPU without AVX512-BF16 or AMX): a request's
    greedy tokens and logprobs alone equal, bit for bit, those it gets among 1 and 6 companions (other
    token and request buckets, steps mixing prefill chunks and decodes: routing, the grouped experts and
    the latent attention see other row counts). In bfloat16 each greedy token is also Hugging Face's
    choice in float32 over the same bfloat16 weights, teacher-forced on the same tokens (a near tie may
    swap; with float32 weights, a rounded router score flips a near-tied expert and the logits move by
    a tenth of their range)."""
    hf_model = make_hf_model(name, seed=list(FAMILIES).index(name))
    hf_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(
        str(tmp_path),
        dtype=dtype,
        batch_invariant_float32=dtype == "float32",  # float32's dots too (not by default: their cost)
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=16,  # token buckets 1, 4, 16; request buckets 1, 4, 8
        block_size=BLOCK_SIZE,
        kv_cache_memory=2**20,
    )
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, VOCAB_SIZE, n).tolist() for n in (21, 6, 40, 13, 27, 9, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)

    def numbers(batch: list[list[int]]):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [
            (
                o.outputs[0].token_ids,
                [sorted((i, lp.logprob) for i, lp in e.items()) for e in o.outputs[0].logprobs],
            )
            for o in outs
        ]

    alone = numbers(prompts[:1])[0]
    if dtype == "bfloat16":
        tokens = list(alone[0])
        logits = hf_logits(bfloat16_weights(hf_model), prompts[0] + tokens[:-1])[len(prompts[0]) - 1 :]
        gaps = logits.max(-1) - logits[np.arange(len(tokens)), tokens]
        assert gaps.max() <= BFLOAT16_TIE * np.ptp(logits), f"{name}: float32 logit gaps {gaps}"
    assert numbers(prompts[:2])[0] == alone
    assert numbers(prompts[1:4] + prompts[:1] + prompts[4:])[3] == alone


def test_minimax_m2_reads_its_released_config():
    """MiniMax-M2's config.json as released: `rotary_dim` without partial_rotary_factor, its MTP modules
    counted, routing by biased sigmoid; a config its layer does not implement is refused by name."""
    released = {
        "architectures": ["MiniMaxM2ForCausalLM"],
        **{k: v for k, v in _COMMON.items() if k != "num_attention_heads"},
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rotary_dim": 64,
        "rope_theta": 5000000,
        "num_hidden_layers": 62,
        "intermediate_size": 1536,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "shared_intermediate_size": 0,
        "num_mtp_modules": 3,
    }
    cfg = model_config_from_hf(released)
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.num_mtp_modules) == (64, 5e6, 3)
    assert (cfg.scoring_func, cfg.has_score_correction_bias, cfg.norm_topk_prob) == ("sigmoid", True, True)
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.n_group, cfg.routed_scaling_factor) == (
        256,
        1536,
        1,
        1,
    )
    # The MTP modules' layers (62-64) are not the decoder's; the score bias moves into the router.
    tensors = {f"model.layers.{i}.input_layernorm.weight": np.ones(2, np.float32) for i in (61, 62, 64, 65)}
    tensors["model.layers.0.block_sparse_moe.e_score_correction_bias"] = np.zeros(256, np.float32)
    kept = get_model_class(cfg.architecture).prepare_hf_tensors(cfg, tensors)
    assert sorted(kept) == [
        "model.layers.0.mlp.gate.e_score_correction_bias",
        "model.layers.61.input_layernorm.weight",
        "model.layers.65.input_layernorm.weight",  # past them: the loader reports it as unexpected
    ]
    with pytest.raises(ValueError, match="qk_norm_type='per_head'"):
        model_config_from_hf({**released, "qk_norm_type": "per_head"})
    with pytest.raises(ValueError, match="shared_intermediate_size=512"):
        model_config_from_hf({**released, "shared_intermediate_size": 512})

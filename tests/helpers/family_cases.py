"""The dense families' tiny random Hugging Face models, and how the tests run them both ways.

Shared by test_model_families.py (parity per architecture) and test_weight_formats.py (GGUF and
orbax checkpoints of the same models).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from helpers.step_fakes import prompt_chunk
from xlaserve import LLM, SamplingParams
from xlaserve.worker.input_batch import build_step_batch

MAX_REL_ERR = 1e-4
NUM_GREEDY = 16
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,  # prompts of 21-45 tokens prefill in chunks
    "block_size": 8,
    "kv_cache_memory": 4 * 2**20,
    "enable_prefix_caching": True,
    "enforce_eager": True,
}
BASE = {
    "vocab_size": 101,
    "hidden_size": 48,
    "intermediate_size": 71,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
WINDOW = 12
LONGROPE_FROM = 64  # Phi3's original_max_position_embeddings

# architecture -> (transformers config class, its kwargs)
FAMILIES = {
    "MistralForCausalLM": ("MistralConfig", dict(BASE, sliding_window=WINDOW)),
    # Layer 0 full, layers 1-2 sliding; QKV biases; MQA; tied head.
    "Qwen2ForCausalLM": (
        "Qwen2Config",
        dict(
            BASE,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        ),
    ),
    # q/k norms; YaRN RoPE (its attention factor scales cos and sin) from 32 to 128 positions.
    "Qwen3ForCausalLM": (
        "Qwen3Config",
        dict(
            BASE,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 5e5,
            },
        ),
    ),
    # Fused qkv_proj / gate_up_proj, RoPE on half of each head; LongRoPE whose long factors start
    # past 64 tokens (prompt + generation stay short: see test_longrope_long_sequences).
    "Phi3ForCausalLM": (
        "Phi3Config",
        dict(
            BASE,
            original_max_position_embeddings=LONGROPE_FROM,
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.5, 2.0],
                "long_factor": [3.0, 5.0, 9.0],
                "original_max_position_embeddings": LONGROPE_FROM,
                "partial_rotary_factor": 0.5,
                "rope_theta": 10000.0,
            },
        ),
    ),
    # Sliding, full, sliding; soft caps small enough to bite; query_pre_attn_scalar != head_dim.
    "Gemma2ForCausalLM": (
        "Gemma2Config",
        dict(
            BASE,
            tie_word_embeddings=True,
            sliding_window=WINDOW,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        ),
    ),
    # Two sliding layers (local RoPE base) then a global one (linear-scaled RoPE); q/k norms.
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        dict(
            BASE,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            final_logit_softcapping=8.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        ),
    ),
    # Norms after each block; q and k normed over all heads at once (their weights random: see
    # make_hf_model); OLMo 3 slides a window on layers 0 and 1, its full layer with YaRN RoPE.
    "Olmo2ForCausalLM": ("Olmo2Config", BASE),
    "Olmo3ForCausalLM": (
        "Olmo3Config",
        dict(
            BASE,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "rope_theta": 5e5,
                },
            },
        ),
    ),
    # Layer 1 without RoPE (NoPE), YaRN on the others.
    "SmolLM3ForCausalLM": (
        "SmolLM3Config",
        dict(
            BASE,
            no_rope_layers=[1, 0, 1],
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 5e5,
            },
        ),
    ),
    # Granite's four scalings, each far enough from 1 to show: the embeddings, the scores (in place of
    # head_dim^-0.5 = 0.29), each residual branch and the logits.
    "GraniteForCausalLM": (
        "GraniteConfig",
        dict(
            BASE,
            embedding_multiplier=6.0,
            attention_multiplier=0.125,
            residual_multiplier=0.25,
            logits_scaling=3.0,
        ),
    ),
}


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer whose ids cover the whole vocabulary (w3 ... wN), no hub needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


# Plain Llama, for tests of what surrounds the families (the registry, the tokenizer options).
LLAMA = ("LlamaConfig", BASE)


def make_hf_model(architecture: str, seed: int = 0, **overrides):
    """A random HF model in float32 with weights large enough that each one shows in the logits
    (`architecture`: a key of FAMILIES, or "LlamaForCausalLM")."""
    config_class, kwargs = LLAMA if architecture == "LlamaForCausalLM" else FAMILIES[architecture]
    config = getattr(transformers, config_class)(**dict(kwargs, **overrides), attn_implementation="eager")
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    return randomize_weights(model, norm_center=0.0 if architecture.startswith("Gemma") else 1.0)


def randomize_weights(model, norm_center: float = 1.0):
    """`model`'s weights, in place, from torch's global generator: norms around `norm_center` (Gemma's
    norms scale by (1 + w): 0), everything else N(0, 0.15), large enough to show in the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(norm_center + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    return model


def save_hf_model(model, directory) -> str:
    model.save_pretrained(directory)
    word_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return str(directory)


def prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """Four prompts; two share a 24-token prefix (three blocks of 8) for the prefix cache."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab_size, 24).tolist()
    return [
        shared + rng.integers(3, vocab_size, 21).tolist(),  # 45 tokens: past every sliding window
        rng.integers(3, vocab_size, 33).tolist(),
        shared + rng.integers(3, vocab_size, 9).tolist(),
        rng.integers(3, vocab_size, 21).tolist(),
    ]


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def hf_chunked_logits(model, ids: list[int], bounds: list[int]) -> np.ndarray:
    """HF's logits over `ids` fed in chunks through its KV cache (each chunk one forward)."""
    logits, cache = [], None
    with torch.no_grad():
        for start, stop in itertools.pairwise(bounds):
            out = model(torch.tensor([ids[start:stop]]), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0].float().numpy())
            cache = out.past_key_values
    return np.concatenate(logits)


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NUM_GREEDY,
            min_new_tokens=NUM_GREEDY,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def assert_greedy_and_prompt_logprobs_match(llm: LLM, hf_model, batch: list[list[int]]) -> None:
    """`llm`'s greedy tokens (NUM_GREEDY of each prompt, all in flight) equal `hf_model`'s, and its
    prompt logprobs equal HF's log-softmax within 1e-4."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(hf_model, p) for p in batch]
    for ids, out in zip(batch, outputs):
        ours = np.array([entry[t].logprob for t, entry in zip(ids[1:], out.prompt_logprobs[1:])])
        expected = torch.log_softmax(torch.tensor(hf_logits(hf_model, ids)), -1).numpy()
        np.testing.assert_allclose(ours, expected[np.arange(len(ids) - 1), ids[1:]], rtol=0, atol=1e-4)


def tokens_with_a_preemption(llm: LLM, victim: list[int], other: list[int], params) -> dict[str, list[int]]:
    """Greedy tokens of two requests run step by step (`llm` with async_scheduling off), the "victim"
    preempted once it has 5 tokens (its blocks freed; recomputed from position 0 later)."""
    from xlaserve.core.outputs import SchedulerOutput
    from xlaserve.core.request import Request

    core = llm.engine_core
    core.add_request(Request("other", other, params, eos_token_id=2))
    core.add_request(Request("victim", victim, params, eos_token_id=2))
    tokens: dict[str, list[int]] = {"other": [], "victim": []}
    is_preempted = False
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
        if not is_preempted and len(tokens["victim"]) == 5:
            scheduler = core.scheduler
            index = next(i for i, r in enumerate(scheduler.running) if r.request_id == "victim")
            scheduler._preempt(index, SchedulerOutput())
            is_preempted = True
    assert is_preempted and core.scheduler.num_preemptions_total >= 1
    return tokens


def prefix_hits_against_hugging_face(llm: LLM, hf_model, vocab: int) -> dict[str, int]:
    """Four prompts run one after the other with chunks of 16 (the fixture's 4 would end on every
    block boundary of 8): a (39 tokens), b and c sharing a's first 26 tokens, d = a's prompt and 10
    more (a next turn). Asserts each one's greedy tokens are Hugging Face's, with logprobs within 1e-4
    (so a hit's copied state is the state it stands for), and that no block or state slot leaks;
    returns each one's num_cached_tokens."""
    rng = np.random.default_rng(11)
    shared = rng.integers(3, vocab, 26).tolist()
    a, b, c = (shared + rng.integers(3, vocab, n).tolist() for n in (13, 9, 17))
    d = a + rng.integers(3, vocab, 10).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True, logprobs=0)
    cached = {}
    scheduler = llm.engine_core.scheduler
    threshold, scheduler.long_prefill_token_threshold = scheduler.long_prefill_token_threshold, 16
    try:
        for name, prompt in zip("abcd", (a, b, c, d)):
            request_output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            out = request_output.outputs[0]
            tokens = list(out.token_ids)
            assert tokens == hf_greedy(hf_model, prompt), name
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            expected = torch.log_softmax(logits.double(), -1)[torch.arange(len(tokens)), tokens].numpy()
            actual = [entry[token].logprob for entry, token in zip(out.logprobs, tokens)]
            np.testing.assert_allclose(actual, expected, atol=1e-4, err_msg=name)
            cached[name] = request_output.num_cached_tokens
    finally:
        scheduler.long_prefill_token_threshold = threshold
    manager = llm.engine_core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    for group in manager.coordinator.managers:
        assert group.pool.get_num_free_blocks() == group.pool.num_usable_blocks
    return cached


def speculation_prompts(vocab: int) -> list[list[int]]:
    """`speculation_against_hugging_face`'s prompts: a repeated 4-token pattern and a random tail."""
    rng = np.random.default_rng(5)
    return [
        [*rng.integers(3, vocab, 4).tolist()] * 5 + rng.integers(3, vocab, n).tolist() for n in (1, 6, 11)
    ]


def speculation_against_hugging_face(
    model_dir: str, hf_model, vocab: int, speculative_config: dict | None = None
) -> list[tuple[int, int]]:
    """A state model under speculative decoding (n-gram unless `speculative_config` says otherwise, 3
    drafts a step): prompts of a repeated pattern (n-gram drafts proposed from the start) and random
    tails. Asserts every greedy token is Hugging Face's and that no state slot or block leaks; returns
    each verification's (drafts, accepted)."""
    from xlaserve.core.spec_decode import SpecDecodingStats

    seen: list[tuple[int, int]] = []
    observe = SpecDecodingStats.observe

    def record(stats, num_draft_tokens, num_accepted_tokens):
        seen.append((num_draft_tokens, num_accepted_tokens))
        observe(stats, num_draft_tokens, num_accepted_tokens)

    llm = LLM(
        model_dir,
        **ENGINE_ARGS,
        speculative_config=speculative_config or {"method": "ngram", "num_speculative_tokens": 3},
    )
    batch = speculation_prompts(vocab)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True)
    SpecDecodingStats.observe = record
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    finally:
        SpecDecodingStats.observe = observe
    for prompt, output in zip(batch, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, prompt)
    manager = llm.engine_core.kv_cache_manager
    for group in manager.coordinator.managers:
        assert group.pool.get_num_free_blocks() == group.pool.num_usable_blocks
    return seen


def rel_err(actual, expected) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Hugging Face's tiny models run ~20x faster on one thread than on two cores shared with XLA."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- our prefill, through the engine's own compiled forward -------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits(graphdef, params, hidden):
    return nnx.merge(graphdef, params).compute_logits(hidden)


def chunk_bounds(num_tokens: int, first_chunk: int, chunk: int) -> list[int]:
    return [0, *range(first_chunk, num_tokens, chunk), num_tokens]


def engine_prefill_logits(llm: LLM, ids: list[int], first_chunk: int, block_ids=None) -> np.ndarray:
    """Logits of every prompt position, prefilled in chunks (`first_chunk` tokens, then as many as
    the engine's largest bucket holds; later chunks read earlier ones from the paged cache), on a
    fresh cache shaped like the engine's (K/V, or DeepSeek's latents), through the engine's compiled
    forward. `block_ids`: the sequence's blocks (default 1, 2, ...; block 0 is the null block). A model
    of several windows gives each further group of layers the blocks after the previous group's."""
    runner = llm.engine_core.runner
    num_tokens = runner.token_buckets[-1]
    num_seqs = runner._num_seqs_for(num_tokens)
    cache = jax.tree.map(jnp.zeros_like, runner.kv_cache)
    if block_ids is None:
        block_ids = list(range(1, 1 + -(-len(ids) // runner.block_size)))
    layout = runner.cache_layout
    num_groups = 1 if layout is None else layout.num_groups
    last = max(block_ids) + 1
    group_block_ids = [
        [last + (g - 1) * len(block_ids) + i for i in range(len(block_ids))] for g in range(1, num_groups)
    ]
    bounds = chunk_bounds(len(ids), first_chunk, num_tokens)
    logits = []
    for start, stop in itertools.pairwise(bounds):
        scheduled = prompt_chunk(ids, start, stop - start, block_ids, group_block_ids)
        batch = build_step_batch(
            [scheduled],
            num_tokens,
            num_seqs,
            runner.max_blocks_per_seq,
            runner.block_size,
            layout=layout,
            num_blocks=runner.num_blocks,
        )
        hidden, _, cache = runner.forward(cache, batch)
        logits.append(np.asarray(_logits(runner.graphdef, runner.params, hidden))[: stop - start])
    return np.concatenate(logits)


HYBRID_VOCAB = 101
# Tiny hybrid configs (tests/models/test_qwen3_5.py, tests/sharding/test_hybrid_tensor_parallel.py).
QWEN3_5_TEXT = dict(
    vocab_size=HYBRID_VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention"] * 2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


# Granite 4.0-H: Mamba2 beside attention, experts, a shared MLP (tests/models/test_qwen3_5.py, test_lora.py).
GRANITE_HYBRID = dict(
    vocab_size=HYBRID_VOCAB,
    hidden_size=32,
    intermediate_size=16,
    shared_intermediate_size=24,
    num_hidden_layers=4,
    layer_types=["mamba", "attention", "mamba", "attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_d_state=8,
    mamba_n_groups=2,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    embedding_multiplier=2.0,
    logits_scaling=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


FALCON_H1_TEXT = dict(
    vocab_size=HYBRID_VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_d_ssm=32,  # not expand * hidden_size (64): the mixer's own width
    mamba_n_heads=4,
    mamba_d_state=8,
    mamba_n_groups=2,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    # muP multipliers, none of them 1, so that each one shows.
    embedding_multiplier=2.0,
    lm_head_multiplier=0.5,
    key_multiplier=0.7,
    attention_in_multiplier=1.3,
    attention_out_multiplier=0.8,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.9,
    ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
    mlp_multipliers=[1.5, 0.6],
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

"""Every dense family against Hugging Face, through the registry and the engine; GGUF and orbax.

For each architecture a tiny random HF model (float32, 3 layers, odd MLP width, GQA where the
family has it, sliding windows short enough to matter for a 45-token prompt, each family's own
switches set so that they show: soft caps, YaRN, LongRoPE, partial RoPE, ...) is saved as
safetensors with a word-level tokenizer, loaded by `LLM(directory)`, and compared with
transformers in float32: prefill logits through the paged cache in chunks (max relative error
1e-4), and 16 greedy tokens for four requests in flight with chunked prefill and prefix caching,
equal to `generate`. Then the weight formats: qwen GGUF files written with gguf.GGUFWriter, and
`xlaserve convert` to orbax and back.

The engines run with enforce_eager: warm-up would compile every bucket and sampler variant per
family (~17 s each); lazily, a family compiles the few programs its tests use. The GGUF and orbax
Qwen3 models have the Qwen3 family's exact config, so they reuse its compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from engine import LLM, SamplingParams
from engine.batch import build_step_batch
from engine.model_runner import _forward
from kernels import KVCache

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


def make_hf_model(architecture: str, seed: int = 0, **overrides):
    """A random HF model in float32 with weights large enough that each one shows in the logits."""
    config_class, kwargs = FAMILIES[architecture]
    config = getattr(transformers, config_class)(**dict(kwargs, **overrides), attn_implementation="eager")
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    is_gemma = architecture.startswith("Gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms scale by (1 + w)
                param.copy_((0.0 if is_gemma else 1.0) + 0.2 * torch.randn_like(param))
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


def rel_err(actual, expected) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@dataclasses.dataclass
class Family:
    architecture: str
    hf_model: object
    llm: LLM
    directory: str


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Hugging Face's tiny models run ~20x faster on one thread than on two cores shared with XLA."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    architecture = request.param
    hf_model = make_hf_model(architecture, seed=list(FAMILIES).index(architecture))
    directory = save_hf_model(hf_model, tmp_path_factory.mktemp(architecture))
    return Family(architecture, hf_model, LLM(directory, **ENGINE_ARGS), directory)


# -- our prefill, through the engine's own compiled forward -------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits(graphdef, params, hidden):
    return nnx.merge(graphdef, params).compute_logits(hidden)


def chunk_bounds(num_tokens: int, first_chunk: int, chunk: int) -> list[int]:
    return [0, *range(first_chunk, num_tokens, chunk), num_tokens]


def engine_prefill_logits(llm: LLM, ids: list[int], first_chunk: int) -> np.ndarray:
    """Logits of every prompt position, prefilled in chunks (`first_chunk` tokens, then as many as
    the engine's largest bucket holds; later chunks read earlier ones from the paged cache), on a
    fresh cache shaped like the engine's, through the engine's compiled forward."""
    runner = llm.engine_core.runner
    num_tokens = runner.token_buckets[-1]
    num_seqs = runner._num_seqs_for(num_tokens)
    cache = KVCache(jnp.zeros_like(runner.kv_cache.k), jnp.zeros_like(runner.kv_cache.v))
    block_ids = list(range(1, 1 + -(-len(ids) // runner.block_size)))  # block 0 is the null block
    bounds = chunk_bounds(len(ids), first_chunk, num_tokens)
    logits = []
    for start, stop in itertools.pairwise(bounds):
        scheduled = SimpleNamespace(
            request=SimpleNamespace(all_token_ids=ids),
            num_computed_tokens=start,
            num_new_tokens=stop - start,
            block_ids=block_ids,
        )
        batch = build_step_batch(
            [scheduled], num_tokens, num_seqs, runner.max_blocks_per_seq, runner.block_size
        )
        hidden, _, cache = _forward(
            runner.graphdef,
            runner.params,
            cache,
            batch.input_ids,
            batch.positions,
            batch.logits_indices,
            batch.md,
        )
        logits.append(np.asarray(_logits(runner.graphdef, runner.params, hidden))[: stop - start])
    return np.concatenate(logits)


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


# -- weight formats: GGUF (qwen2, qwen3) and converted (orbax) checkpoints ----------------------

# Our (HF) tensor names -> llama.cpp's, as its converter writes them for qwen2 / qwen3.
_GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(path, hf_model, arch: str, qtypes: dict[str, object] | None = None) -> dict[str, np.ndarray]:
    """`hf_model` as llama.cpp's converter writes a qwen2/qwen3 model (no q/k permutation: these
    rotate halves in llama.cpp too), float32 unless `qtypes` names a tensor's quantization.
    Returns the float32 HF tensors the file should read back as."""
    import gguf

    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if config.rope_parameters["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(config.rope_parameters["original_max_position_embeddings"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    tokens = ["<pad>", "<s>", "</s>", *(f"w{i}" for i in range(3, config.vocab_size))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    expected = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        value = tensor.detach().numpy().astype(np.float32)
        module, _, suffix = name.rpartition(".")
        if module.startswith("model.layers."):
            _, _, layer, key = module.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[key]}.{suffix}"
        else:
            gguf_name = f"{_GGUF_NAMES[module]}.{suffix}"
        qtype = (qtypes or {}).get(gguf_name)
        if qtype is None:
            writer.add_tensor(gguf_name, value)
            expected[name] = value
        else:
            data = gguf.quants.quantize(value, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
            expected[name] = gguf.quants.dequantize(data, qtype).reshape(value.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The Qwen3 family's model again (same seed, same weights) and its safetensors directory."""
    hf_model = make_hf_model("Qwen3ForCausalLM", seed=list(FAMILIES).index("Qwen3ForCausalLM"))
    return hf_model, save_hf_model(hf_model, tmp_path_factory.mktemp("qwen3"))


def assert_engine_matches_hf(llm: LLM, hf_model) -> None:
    batch = prompts(hf_model.config.vocab_size, seed=3)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(hf_model, p) for p in batch]


def test_gguf_qwen3_round_trip(qwen3, tmp_path):
    """A qwen3 GGUF (q/k norms, head_dim from key_length, YaRN) loads to the same model: same tokens."""
    from models.loader import load_checkpoint

    hf_model, _ = qwen3
    path = tmp_path / "tiny-qwen3.gguf"
    expected = write_gguf(path, hf_model, "qwen3")
    checkpoint = load_checkpoint(str(path), progress=False)
    assert checkpoint.hf_config["architectures"] == ["Qwen3ForCausalLM"]
    assert set(checkpoint.tensors) == set(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(checkpoint.tensors[name], want, err_msg=name)
    assert_engine_matches_hf(LLM(str(path), **ENGINE_ARGS), hf_model)


@pytest.mark.parametrize("qtype_name", ["F16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_qwen2_quantized_tensors(tmp_path, qtype_name):
    """A qwen2 GGUF (QKV biases, tied head) with quantized projections reads back as llama.cpp
    dequantizes them, under HF names, into a config Qwen2 accepts."""
    import gguf

    from models.config import TransformerConfig
    from models.loader import load_checkpoint

    # Quantized blocks hold 32 values along a row: q_proj's and o_proj's rows have 64.
    hf_model = make_hf_model("Qwen2ForCausalLM", seed=5, hidden_size=64, head_dim=16)
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    qtypes = {"blk.0.attn_q.weight": qtype, "blk.1.attn_output.weight": qtype}
    expected = write_gguf(tmp_path / "tiny-qwen2.gguf", hf_model, "qwen2", qtypes)
    checkpoint = load_checkpoint(str(tmp_path / "tiny-qwen2.gguf"), progress=False)
    assert set(checkpoint.tensors) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(checkpoint.tensors[name], want, rtol=0, atol=1e-6, err_msg=name)
    cfg = TransformerConfig.from_hf(checkpoint.hf_config)
    assert cfg == TransformerConfig.from_hf(hf_model.config.to_dict()).replace(
        sliding_window=None,
        layer_types=(),  # llama.cpp keeps no sliding window
    )


def test_orbax_round_trip(qwen3, tmp_path):
    """`xlaserve convert` writes our pytree; loading it gives the same parameters and tokens."""
    from engine import cli
    from models.loader import load_checkpoint
    from models.orbax_checkpoint import ConvertedParams

    hf_model, directory = qwen3
    out_dir = tmp_path / "converted"
    assert cli.main(["convert", directory, str(out_dir)]) == 0
    checkpoint = load_checkpoint(str(out_dir))
    assert isinstance(checkpoint.tensors, ConvertedParams)
    q_proj = checkpoint.tensors[("layers", "self_attn", "q_proj", "kernel")]  # stacked, [in, out]
    want = np.stack([hf_model.model.layers[i].self_attn.q_proj.weight.detach().numpy().T for i in range(3)])
    np.testing.assert_array_equal(q_proj, want)
    assert checkpoint.tokenizer.convert_ids_to_tokens([5, 100]) == ["w5", "w100"]
    assert_engine_matches_hf(LLM(str(out_dir), **ENGINE_ARGS), hf_model)
    # Converting again into the same directory is refused; bfloat16 halves the stored size.
    assert cli.main(["convert", directory, str(out_dir)]) == 2
    assert cli.main(["convert", str(out_dir), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    bf16 = load_checkpoint(str(tmp_path / "bf16"))
    assert {a.dtype.name for a in bf16.tensors.values()} == {"bfloat16"}
    assert "bfloat16" in bf16.source


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    directory = save_hf_model(make_hf_model("MistralForCausalLM"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, architectures=["FooForCausalLM"])))
    with pytest.raises(
        ValueError, match=r"'FooForCausalLM' is not supported; supported: .*Gemma2ForCausalLM.*Phi3"
    ):
        LLM(directory, **ENGINE_ARGS)

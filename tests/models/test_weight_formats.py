"""Weight formats: qwen2/qwen3 GGUF files written with gguf.GGUFWriter, `xlaserve convert` to orbax
and back, and the error for an architecture we do not have.

The Qwen3 model here is the Qwen3 family's of test_model_families.py (same seed and config), so in
one session its engines reuse that family's compiled programs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.family_cases import (
    ENGINE_ARGS,
    FAMILIES,
    NUM_GREEDY,
    hf_greedy,
    make_hf_model,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prompts,
    save_hf_model,
)
from helpers.tiny_models import GGUF_NAMES, add_word_tokenizer, gguf_writer
from xlaserve import LLM, SamplingParams


def write_gguf(path, hf_model, arch: str, qtypes: dict[str, object] | None = None) -> dict[str, np.ndarray]:
    """`hf_model` as llama.cpp's converter writes a qwen2/qwen3 model (no q/k permutation: these
    rotate halves in llama.cpp too), float32 unless `qtypes` names a tensor's quantization.
    Returns the float32 HF tensors the file should read back as."""
    import gguf

    config = hf_model.config
    writer = gguf_writer(path, config, arch)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if config.rope_parameters["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(config.rope_parameters["original_max_position_embeddings"])
    add_word_tokenizer(writer, config.vocab_size)
    expected = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        value = tensor.detach().numpy().astype(np.float32)
        module, _, suffix = name.rpartition(".")
        if module.startswith("model.layers."):
            _, _, layer, key = module.split(".", 3)
            gguf_name = f"blk.{layer}.{GGUF_NAMES[key]}.{suffix}"
        else:
            gguf_name = f"{GGUF_NAMES[module]}.{suffix}"
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
    from xlaserve.models.loader import load_checkpoint

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

    from xlaserve.models.loader import load_checkpoint
    from xlaserve.models.registry import model_config_from_hf

    # Quantized blocks hold 32 values along a row: q_proj's and o_proj's rows have 64.
    hf_model = make_hf_model("Qwen2ForCausalLM", seed=5, hidden_size=64, head_dim=16)
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    qtypes = {"blk.0.attn_q.weight": qtype, "blk.1.attn_output.weight": qtype}
    expected = write_gguf(tmp_path / "tiny-qwen2.gguf", hf_model, "qwen2", qtypes)
    checkpoint = load_checkpoint(str(tmp_path / "tiny-qwen2.gguf"), progress=False)
    assert set(checkpoint.tensors) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(checkpoint.tensors[name], want, rtol=0, atol=1e-6, err_msg=name)
    cfg = model_config_from_hf(checkpoint.hf_config)  # as Qwen2's config class reads it
    assert cfg.attention_bias and not cfg.attention_out_bias
    assert cfg == model_config_from_hf(hf_model.config.to_dict()).replace(
        sliding_window=None,
        layer_types=(),  # llama.cpp keeps no sliding window
    )


def test_orbax_round_trip(qwen3, tmp_path):
    """`xlaserve convert` writes our pytree; loading it gives the same parameters and tokens."""
    from xlaserve.entrypoints import cli
    from xlaserve.models.loader import load_checkpoint
    from xlaserve.models.orbax_checkpoint import ConvertedParams

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

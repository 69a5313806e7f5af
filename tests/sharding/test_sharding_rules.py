"""Sharding that cannot be silently wrong: under tensor parallelism every matrix has a rule, fused
projections are split by head, and an odd vocabulary is padded, its padding ids never sampled.

The rules and layouts are checked here in numpy; the engines run on 8 fake CPU devices in the
session's worker process (helpers/tp_run.py)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.family_cases import BASE, FALCON_H1_TEXT, make_hf_model, save_hf_model
from xlaserve.models.config import TransformerConfig
from xlaserve.models.orbax_checkpoint import ConvertedParams
from xlaserve.models.phi3 import group_qkv_by_kv_head
from xlaserve.models.registry import get_model_class, model_config_from_hf
from xlaserve.sharding.kv_heads import checkpoint_heads_size, replicate_kv_heads
from xlaserve.sharding.layout import checkpoint_shape, lay_out_for_mesh
from xlaserve.sharding.rules import param_logical_axes
from xlaserve.sharding.vocab import mask_padded_vocab, pad_vocab, padded_vocab_size

# -- rules, layouts and padding, in numpy --------------------------------------------------------


def test_matrices_without_a_rule_have_no_axes_vectors_are_replicated():
    assert param_logical_axes(("layers", "mlp", "extra_proj", "kernel"), 3, is_stacked=True) is None
    assert param_logical_axes(("extra_proj", "kernel"), 2, is_stacked=False) is None
    # A stacked norm is [L, D]: a vector per layer, replicated.
    assert param_logical_axes(("layers", "input_layernorm", "weight"), 2, is_stacked=True) == (None, None)
    assert param_logical_axes(("norm", "weight"), 1, is_stacked=False) == (None,)
    assert param_logical_axes(("layers", "mlp", "gate_up_proj", "kernel"), 3, is_stacked=True) == (
        None,
        "embed",
        "mlp",
    )
    with pytest.raises(ValueError, match=r"layers/self_attn/q_proj/kernel has 3 dims per layer"):
        param_logical_axes(("layers", "self_attn", "q_proj", "kernel"), 4, is_stacked=True)


@pytest.mark.parametrize(
    ("vocab", "tp", "padded"),
    [(257, 1, 257), (257, 2, 320), (32001, 2, 32064), (32002, 8, 32064), (49152, 4, 49152), (101, 3, 192)],
)
def test_vocabulary_pads_to_a_multiple_of_lcm_64_tp(vocab, tp, padded):
    assert padded_vocab_size(vocab, tp) == padded


def test_pad_vocab_appends_zero_rows_in_both_layouts():
    rng = np.random.default_rng(0)
    hf = {
        "model.embed_tokens.weight": rng.normal(size=(5, 3)),
        "lm_head.weight": rng.normal(size=(5, 3)),
        "model.norm.weight": np.ones(3),
    }
    out = pad_vocab(hf, 5, 8)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert out[name].shape == (8, 3) and not out[name][5:].any()
        np.testing.assert_array_equal(out[name][:5], hf[name])
    assert out["model.norm.weight"] is hf["model.norm.weight"]
    ours = ConvertedParams(
        {("embed_tokens", "weight"): np.ones((5, 3)), ("lm_head", "kernel"): np.ones((3, 5))}
    )
    out = pad_vocab(ours, 5, 8)
    assert isinstance(out, ConvertedParams)
    assert out[("embed_tokens", "weight")].shape == (8, 3) and out[("lm_head", "kernel")].shape == (3, 8)
    with pytest.raises(ValueError, match="has 5 vocabulary entries; the config says 6"):
        pad_vocab(hf, 6, 8)


def test_mask_padded_vocab_keeps_real_ids_and_drops_padding():
    logits = np.arange(8, dtype=np.float32)[None].repeat(2, axis=0)
    masked = np.asarray(mask_padded_vocab(logits, 5))
    np.testing.assert_array_equal(masked[:, :5], logits[:, :5])
    assert np.all(masked[:, 5:] == -np.inf)
    assert mask_padded_vocab(logits, 8) is logits


def _phi3_config(num_heads: int, num_kv_heads: int, head_dim: int) -> TransformerConfig:
    hf = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 11,
        "hidden_size": 6,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
    }
    return TransformerConfig.from_hf(hf)


def test_fused_qkv_regrouping_commutes_with_kv_head_replication():
    # A converted (regrouped) Phi-3 checkpoint widened for TP 4 must equal the HF checkpoint widened
    # for TP 4, then regrouped: both loaders must arrive at the same weights.
    cfg = _phi3_config(num_heads=8, num_kv_heads=2, head_dim=3)
    hf_weight = np.random.default_rng(0).normal(size=((8 + 2 * 2) * 3, 6))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    wide_cfg, hf_wide = replicate_kv_heads(cfg, {name: hf_weight}, 4)
    assert wide_cfg.num_kv_heads == 4 and hf_wide[name].shape == ((8 + 2 * 4) * 3, 6)
    via_hf = group_qkv_by_kv_head(hf_wide[name], wide_cfg).T  # [D, columns], our layout
    converted = ConvertedParams(
        {("layers", "self_attn", "qkv_proj", "kernel"): group_qkv_by_kv_head(hf_weight, cfg).T[None]}
    )
    _, ours_wide = replicate_kv_heads(cfg, converted, 4)
    np.testing.assert_array_equal(ours_wide[("layers", "self_attn", "qkv_proj", "kernel")][0], via_hf)
    # The inverse an update's shapes are checked by (worker/weight_update.py): k and v's rows unrepeated.
    for key in (name, ("layers", "self_attn", "qkv_proj", "kernel")):
        assert checkpoint_heads_size(key, (8 + 2 * 4) * 3, wide_cfg, 2) == (8 + 2 * 2) * 3
    assert checkpoint_heads_size(name.replace("qkv", "k"), 4 * 3, wide_cfg, 2) == 2 * 3


# The checkpoints whose tensors the mesh widens under TP 4 (its 2 KV heads, a vocabulary of 101): Phi-3's
# fused qkv, OLMo-2's and MiniMax-M2's k_norm over every head, Falcon-H1's B and C (2 groups) copied.
_WIDENED = {
    "Phi3ForCausalLM": ("Phi3Config", {}),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "MiniMaxM2ForCausalLM": (
        "MiniMaxM2Config",
        dict(num_local_experts=4, num_experts_per_tok=2, rotary_dim=6, intermediate_size=16),
    ),
    "FalconH1ForCausalLM": ("FalconH1Config", FALCON_H1_TEXT),
}


@pytest.mark.parametrize("architecture", _WIDENED)
def test_an_updates_shapes_are_checked_by_the_inverse_of_every_layout_rule(architecture):
    # Each tensor as the load widens it for TP 4 (lay_out_for_mesh, then the family's rewrite), taken
    # back by `checkpoint_shape` (worker/weight_update.py checks a caller's tensors by it): the shape
    # the checkpoint holds.
    import torch
    import transformers

    config_class, overrides = _WIDENED[architecture]
    hf_config = getattr(transformers, config_class)(
        **(overrides if "vocab_size" in overrides else BASE | overrides)
    )
    hf_config.architectures = [architecture]
    with torch.device("meta"):
        model = getattr(transformers, architecture)(hf_config)
    tensors = {name: np.zeros(t.shape, np.float32) for name, t in model.state_dict().items()}
    cfg = model_config_from_hf(hf_config.to_dict())
    wide_cfg, laid, _ = lay_out_for_mesh(cfg, tensors, 4)
    laid = get_model_class(architecture).prepare_hf_tensors(wide_cfg, dict(laid))
    widened = set()
    for name, tensor in tensors.items():
        if name in laid:
            shape = np.shape(laid[name])
            assert checkpoint_shape(name, shape, wide_cfg, cfg, 4) == tensor.shape, name
            widened |= {name.split(".")[-2]} if shape != tensor.shape else set()
    assert {"embed_tokens", "lm_head"} <= widened
    expected = {"Phi3ForCausalLM": {"qkv_proj"}, "FalconH1ForCausalLM": {"in_proj", "conv1d", "k_proj"}}
    assert expected.get(architecture, {"k_proj", "v_proj", "k_norm"}) <= widened, widened


# -- engines on fake devices ---------------------------------------------------------------------


def test_matrix_without_a_rule_under_tensor_parallelism_is_an_error_naming_it(tp_worker, tiny_llama_2kv):
    # o_proj's rule removed: one device loads it; TP 2 refuses rather than replicate it.
    one, two = tp_worker.run(
        "missing_rule",
        tiny_llama_2kv,
        {"drop": ["o_proj", "kernel"], "layouts": [{}, {"tensor_parallel_size": 2}]},
    )
    assert one == "loaded"
    assert "parameter layers/self_attn/o_proj/kernel [2, 64, 64] matches no sharding rule" in two
    assert "tensor_parallel_size=2" in two


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    # 4 query heads over 2 KV heads (head_dim 12), an MLP of 72, vocabulary 101 (padded under TP).
    model = make_hf_model("Phi3ForCausalLM", seed=3, intermediate_size=72)
    return save_hf_model(model, tmp_path_factory.mktemp("tiny_phi3"))


def test_phi3_fused_projections_split_by_head(tp_worker, tiny_phi3):
    # Each device's slice of qkv_proj holds its query heads and its KV heads' k and v (TP 4 repeats
    # the 2 KV heads), and its slice of gate_up_proj matching gate and up columns.
    tp2, tp4 = tp_worker.run(
        "fused_shards", tiny_phi3, [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 4}]
    )
    # TP 2: one KV head per device, with its 2 query heads: (2 + 2) * 12 columns; TP 4: (1 + 2) * 12.
    for shards, tp, qkv_width in ((tp2, 2, 48), (tp4, 4, 36)):
        assert [s["rank"] for s in shards["qkv_proj"]] == list(range(tp))
        assert all(s["shape"] == [3, 48, qkv_width] and s["holds_its_heads"] for s in shards["qkv_proj"])
        assert [s["rank"] for s in shards["gate_up_proj"]] == list(range(tp))
        assert all(s["shape"] == [3, 48, 144 // tp] and s["holds_its_heads"] for s in shards["gate_up_proj"])


def test_phi3_tensor_parallel_matches_one_device_and_gathers_no_weight(tp_worker, tiny_phi3):
    greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 3}
    # Four prompts of 29 tokens in all: one prefill step (token bucket 32, the one the HLO below is
    # read from), then decode steps of bucket 4: the fewest programs per engine.
    rng = np.random.default_rng(5)
    prompt_ids = [rng.integers(3, 101, n).tolist() for n in (9, 7, 5, 8)]
    results = tp_worker.run(
        "generate_ids",
        tiny_phi3,
        {
            "layouts": [{}, {"tensor_parallel_size": 2}, {"tensor_parallel_size": 4}],
            "prompts": prompt_ids,
            "params": [greedy],
        },
    )
    _assert_same_greedy(results)
    kinds = [op for _, op in tp_worker.run("hlo", tiny_phi3, {"tensor_parallel_size": 2})]
    assert "all-gather" not in kinds, kinds  # q, k, v and gate, up are split where each device is


def _assert_same_greedy(results):
    base = results[0]["runs"][0]
    for result in results[1:]:
        run = result["runs"][0]
        assert run["tokens"] == base["tokens"], result["layout"]
        for ours, theirs in zip(run["logprobs"], base["logprobs"]):
            for a, b in zip(ours, theirs):
                assert [i for i, _ in a] == [i for i, _ in b], result["layout"]
                np.testing.assert_allclose([v for _, v in a], [v for _, v in b], atol=1e-5)


def test_odd_vocabulary_under_tensor_parallelism_pads_and_never_samples_padding(tp_worker, tiny_llama_257):
    vocab = 257
    rng = np.random.default_rng(0)
    prompt_ids = [rng.integers(0, vocab, n).tolist() for n in (5, 17, 30, 9)]
    greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 5}
    sampled = {
        "temperature": 1.0,
        "max_tokens": 64,
        "ignore_eos": True,
        "seed": 1,
        "logprobs": 20,
        "prompt_logprobs": 20,
    }
    # The slow path: penalties ([R, V] tensors as wide as the padded logits), top-k and top-p.
    penalized = dict(sampled, repetition_penalty=1.3, frequency_penalty=0.5, top_k=300, top_p=0.95)
    one, two = tp_worker.run(
        "generate_ids",
        tiny_llama_257,
        {
            "layouts": [{}, {"tensor_parallel_size": 2}],
            "prompts": prompt_ids,
            "params": [greedy, sampled, penalized],
        },
    )
    for run in two["runs"][1:]:
        tokens = [t for seq in run["tokens"] for t in seq]
        assert len(tokens) == 4 * 64 and max(tokens) < vocab
        logprob_ids = {i for seq in run["logprobs"] for entry in seq for i, _ in entry}
        assert max(logprob_ids) < vocab and len(logprob_ids) > 20
        assert max(run["prompt_logprob_ids"]) < vocab
        assert all(np.isfinite(v) for seq in run["logprobs"] for entry in seq for _, v in entry)
    _assert_same_greedy([one, two])
    # Prompt ids are checked against the real vocabulary: a padding id is refused.
    assert two["out_of_vocab_prompt"] != "accepted" and str(vocab) in two["out_of_vocab_prompt"]


def test_every_glm4_moe_matrix_has_the_rule_its_name_shares():
    """GLM-4.5 names no parameter of its own: attention (q/k/v biases, q/k norms), the dense first
    layer's MLP, the experts, the shared experts and the router take the rules the other families'
    same names have, so it shards by head and by expert as they do."""
    from flax import nnx

    from xlaserve.models.glm4_moe import Glm4MoeForCausalLM
    from xlaserve.models.registry import model_config_from_hf

    hf = {
        "architectures": ["Glm4MoeForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
    }
    hf |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": True}
    hf |= {"use_qk_norm": True, "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2}
    cfg = model_config_from_hf(hf)
    # Read as Hugging Face's Glm4MoeConfig fills what config.json omits: half of each head rotated, one
    # dense first layer, one shared expert.
    assert (cfg.rotary_dim, cfg.first_k_dense_replace, cfg.n_shared_experts) == (4, 1, 1)
    model = nnx.eval_shape(lambda: Glm4MoeForCausalLM(cfg, None, rngs=nnx.Rngs(0)))
    stacks = set(Glm4MoeForCausalLM.layer_stacks(cfg))
    assert stacks == {"dense_layers", "moe_layers"}
    axes = {
        path: param_logical_axes(path, len(param.shape), is_stacked=path[0] in stacks)
        for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    assert [path for path, a in axes.items() if a is None] == []
    assert axes["moe_layers", "self_attn", "k_proj", "bias"] == (None, "kv_heads")
    assert axes["moe_layers", "self_attn", "o_proj", "kernel"] == (None, "q_heads", "embed")
    assert axes["dense_layers", "mlp", "down_proj", "kernel"] == (None, "mlp", "embed")
    assert axes["moe_layers", "mlp", "experts_gate", "kernel"] == (None, "expert", "embed", "expert_mlp")
    assert axes["moe_layers", "mlp", "shared_experts", "up_proj", "kernel"] == (None, "embed", "mlp")
    assert axes["moe_layers", "mlp", "gate", "kernel"] == (None, "embed", "router")

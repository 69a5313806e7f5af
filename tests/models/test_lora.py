"""Multi-LoRA against PEFT: tiny random Llama, Qwen3, Phi-3 (fused qkv_proj / gate_up_proj), Gemma 3,
Qwen3-MoE (attention targets; its routed experts are refused) and the hybrids Qwen3.5 (Gated DeltaNet
beside attention: attention and MLP targets) and Granite 4.0-H (Mamba2 beside attention: attention
targets; the mixers' projections are refused) with three random adapters each (different ranks,
targets, alpha and rsLoRA; B not zero), in float32.

Each adapter's greedy tokens and their logprobs equal PEFT's; one batch mixing the three adapters
and the base model gives each request what it gets alone; the three adapters in one step's slots
(max_loras=3), and a fourth adapter waits for a slot without losing anything.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from helpers.family_cases import (
    ENGINE_ARGS,
    GRANITE_HYBRID,
    NUM_GREEDY,
    QWEN3_5_TEXT,
    make_hf_model,
    one_torch_thread,  # noqa: F401 - an autouse fixture
    prompts,
    randomize_weights,
    save_hf_model,
)
from helpers.lora_adapters import make_adapter
from helpers.tiny_models import elemental_emitters
from xlaserve import LLM, LoRARequest, SamplingParams
from xlaserve.models.lora_adapter import LoRAAdapterError, read_adapter_config

peft = pytest.importorskip("peft")

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# architecture -> three adapters: (rank, alpha, use_rslora, targets)
ADAPTERS = {
    "LlamaForCausalLM": [
        (4, 8, False, ["q_proj", "v_proj"]),
        (8, 16, True, ATTN + MLP),
        (2, 4, False, ["o_proj", "down_proj", "up_proj"]),
    ],
    "Qwen3ForCausalLM": [
        (8, 4, False, ["k_proj", "gate_proj"]),
        (3, 6, True, ATTN),
        (6, 12, False, MLP + ["q_proj"]),
    ],
    "Phi3ForCausalLM": [
        (4, 8, False, ["qkv_proj"]),
        (8, 8, True, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        (2, 4, False, ["gate_up_proj"]),
    ],
    "Gemma3ForCausalLM": [
        (4, 8, False, ["q_proj", "down_proj"]),
        (8, 16, True, ATTN + MLP),
        (2, 4, False, ["v_proj", "gate_proj"]),
    ],
    # Hugging Face's Qwen3-MoE keeps each layer's experts as fused parameters, not modules: PEFT's
    # target_modules reach the attention projections only (the router, `gate`, is refused by name).
    "Qwen3MoeForCausalLM": [
        (4, 8, False, ["q_proj", "v_proj"]),
        (8, 16, True, ATTN),
        (2, 4, False, ["o_proj", "k_proj"]),
    ],
    # Hybrid models: the attention layers' projections, and the MLP's in every layer (Qwen3.5's Gated
    # DeltaNet layers too); the recurrent mixers' projections are no target (refused by name, below).
    "Qwen3_5ForCausalLM": [
        (4, 8, False, ["q_proj", "v_proj", "down_proj"]),
        (8, 16, True, ATTN + MLP),
        (2, 4, False, ["o_proj", "gate_proj"]),
    ],
    # Granite 4.0-H: its shared MLP is fused (input_linear) and its experts are parameters: attention only.
    "GraniteMoeHybridForCausalLM": [
        (4, 8, False, ["q_proj", "v_proj"]),
        (8, 16, True, ATTN),
        (2, 4, False, ["o_proj", "k_proj"]),
    ],
}
HYBRIDS = {  # architecture -> (config class, config, zero-centred norms)
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", QWEN3_5_TEXT, True),
    # Granite 4.0-H with its shared MLP alone (no experts: the adapters never reach them anyway).
    "GraniteMoeHybridForCausalLM": (
        "GraniteMoeHybridConfig",
        dict(GRANITE_HYBRID, num_local_experts=0),
        False,
    ),
}
MOE = {  # a tiny Qwen3-MoE: 4 experts, 2 per token
    "vocab_size": 101,
    "hidden_size": 48,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
MAX_RANK = 8


def peft_greedy(model, ids: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each one's logprob, from full forwards (no cache)."""
    tokens = list(ids)
    logprobs = []
    with torch.no_grad():
        for _ in range(NUM_GREEDY):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            token = int(torch.argmax(lp))
            tokens.append(token)
            logprobs.append(float(lp[token]))
    return tokens[len(ids) :], np.asarray(logprobs)


def make_base(architecture: str):
    import transformers

    if architecture in HYBRIDS:
        config_class, fields, zero_centred = HYBRIDS[architecture]
        config = getattr(transformers, config_class)(**fields)
        config.architectures = [architecture]
        torch.manual_seed(7)
        model = getattr(transformers, architecture)(config).eval()
        return randomize_weights(model, norm_center=0.0 if zero_centred else 1.0)
    if architecture != "Qwen3MoeForCausalLM":
        return make_hf_model(architecture, seed=7)

    config = transformers.Qwen3MoeConfig(**MOE, attn_implementation="eager")
    config.architectures = [architecture]
    torch.manual_seed(7)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    return randomize_weights(model)


# Llama runs in the quick tier; Qwen3 (q/k norms), Phi-3 (fused projections), Gemma 3 (sandwich norms,
# GeGLU) and Qwen3-MoE (routed experts) with the slow tests.
@pytest.fixture(
    scope="module",
    params=[
        "LlamaForCausalLM",
        pytest.param("Qwen3ForCausalLM", marks=pytest.mark.slow),
        pytest.param("Phi3ForCausalLM", marks=pytest.mark.slow),
        pytest.param("Gemma3ForCausalLM", marks=pytest.mark.slow),
        pytest.param("Qwen3MoeForCausalLM", marks=pytest.mark.slow),
        pytest.param("Qwen3_5ForCausalLM", marks=pytest.mark.slow),
        pytest.param("GraniteMoeHybridForCausalLM", marks=pytest.mark.slow),
    ],
)
def case(request, tmp_path_factory):
    architecture = request.param
    base = make_base(architecture)
    root = tmp_path_factory.mktemp(architecture)
    directory = save_hf_model(base, root / "base")
    loras, references = [], []
    the_prompts = prompts(base.config.vocab_size, seed=3)[1:]  # three prompts
    for i, (rank, alpha, rslora, targets) in enumerate(ADAPTERS[architecture]):
        path = str(root / f"adapter{i}")
        model = make_adapter(base, rank, alpha, rslora, targets, path, seed=i)
        loras.append(LoRARequest(f"adapter{i}", i + 1, path))
        references.append([peft_greedy(model, p) for p in the_prompts])
    references.append([peft_greedy(base, p) for p in the_prompts])  # the base model
    with elemental_emitters():  # its tests compare it with peft's outputs only
        llm = LLM(directory, **ENGINE_ARGS, enable_lora=True, max_loras=3, max_lora_rank=MAX_RANK)
    return llm, loras + [None], references, the_prompts, root


def ours(llm, the_prompts, loras):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY, ignore_eos=True, logprobs=0)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in the_prompts], params, use_tqdm=False, lora_request=loras
    )
    return [
        (
            list(o.outputs[0].token_ids),
            np.asarray([next(iter(d.values())).logprob for d in o.outputs[0].logprobs]),
        )
        for o in outs
    ]


def test_each_adapter_matches_peft(case):
    llm, loras, references, the_prompts, _ = case
    for lora, expected in zip(loras, references):
        got = ours(llm, the_prompts, lora)
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected):
            assert tokens == ref_tokens, lora
            np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)
    # The adapters change the output: B is not zero.
    assert len({tuple(ref[0][0]) for ref in references}) > 1


def test_mixed_batch_gives_each_request_its_solo_output(case):
    llm, loras, references, the_prompts, _ = case
    # Every prompt with every adapter and the base model, in one batch (4 x 3 requests).
    batch_prompts = [p for p in the_prompts for _ in loras]
    batch_loras = [lora for _ in the_prompts for lora in loras]
    got = ours(llm, batch_prompts, batch_loras)
    for i, (tokens, logprobs) in enumerate(got):
        ref_tokens, ref_logprobs = references[i % len(loras)][i // len(loras)]
        assert tokens == ref_tokens, (i, batch_loras[i])
        np.testing.assert_allclose(logprobs, ref_logprobs, atol=2e-4)


def test_more_adapters_than_slots_wait_their_turn(case, tmp_path):
    """Four adapters with max_loras=3: the scheduler holds the fourth back until a slot frees;
    every request still gets its own output."""
    llm, loras, references, the_prompts, _ = case
    extra = LoRARequest("adapter0-again", 9, loras[0].lora_path)  # same weights under another id
    batch = [loras[0], loras[1], loras[2], extra]
    manager = llm.engine_core.runner.lora
    loads = manager.num_loads
    got = ours(llm, [the_prompts[0]] * 4, batch)
    for lora, (tokens, _) in zip(batch, got):
        index = 0 if lora is extra else loras.index(lora)
        assert tokens == references[index][0][0]
    assert manager.num_loads > loads  # the fourth adapter took a freed slot
    assert manager.num_host_loras <= 3  # max_cpu_loras defaults to max_loras: least recently used out


def test_targets_the_model_lacks_are_refused_naming_the_module(case):
    """Checked when the adapter is first seen (before any step): a module of the right name where this
    family has none, e.g. a MoE's routed experts (older PEFT adapters name them `experts.0.gate_proj`)
    or q_proj on Phi-3's fused qkv_proj."""
    llm, _, _, the_prompts, root = case
    layout = next(iter(llm.engine_core.runner.lora.layout.values()))
    module = "self_attn.q_proj" if "self_attn.qkv_proj" in layout else "mlp.experts.0.gate_proj"
    prefix = f"base_model.model.model.layers.1.{module}"
    tensors = {
        f"{prefix}.lora_A.weight": np.zeros((4, 48), np.float32),
        f"{prefix}.lora_B.weight": np.zeros((48, 4), np.float32),
    }
    path = _write_adapter(
        root / "bad-target", {"r": 4, "target_modules": [module.rsplit(".", 1)[-1]]}, tensors
    )
    bad = LoRARequest("bad-target", 77, path)
    with pytest.raises(ValueError, match=f"'bad-target'.*module '{module}' \\(layer 1\\) is not supported"):
        llm.generate([{"prompt_token_ids": the_prompts[0]}], SamplingParams(max_tokens=2), lora_request=bad)


def test_a_recurrent_mixers_projections_are_refused_naming_the_module(case):
    """A hybrid model's state layers take adapters on their MLP only: one on Gated DeltaNet's or Mamba2's
    own projections is refused when it is first seen, naming the module."""
    llm, _, _, the_prompts, root = case
    module = {
        "Qwen3_5ForCausalLM": "linear_attn.in_proj_qkv",
        "GraniteMoeHybridForCausalLM": "mamba.in_proj",
    }.get(llm.engine_core.runner.model_config.architecture)
    if module is None:
        pytest.skip("not a hybrid model")
    prefix = f"base_model.model.model.layers.0.{module}"
    tensors = {
        f"{prefix}.lora_A.weight": np.zeros((4, 32), np.float32),
        f"{prefix}.lora_B.weight": np.zeros((64, 4), np.float32),
    }
    name = module.rsplit(".", 1)[-1]
    path = _write_adapter(root / "mixer-target", {"r": 4, "target_modules": [name]}, tensors)
    bad = LoRARequest("mixer-target", 78, path)
    with pytest.raises(ValueError, match=rf"'mixer-target'.*target_modules: \['{name}'\] not supported"):
        llm.generate([{"prompt_token_ids": the_prompts[0]}], SamplingParams(max_tokens=2), lora_request=bad)


def _write_adapter(directory, config: dict, tensors: dict | None = None):
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    tensors = tensors or {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 48), np.float32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((48, 4), np.float32),
    }
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    return str(directory)


@pytest.mark.parametrize(
    ("config", "tensors", "field"),
    [
        ({"r": 32, "target_modules": ["q_proj"]}, None, "r: rank 32 is above max_lora_rank=8"),
        ({"r": 4, "target_modules": ["q_proj", "lm_head"]}, None, "target_modules: ['lm_head']"),
        (
            {"r": 4, "target_modules": ["embed_tokens"]},
            {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 101), np.float32)},
            "target_modules",
        ),
        ({"r": 4, "use_dora": True}, None, "use_dora"),
        ({"r": 4, "bias": "all"}, None, "bias"),
        ({"r": 4, "modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"r": 0}, None, "r: must be a positive integer"),
    ],
)
def test_bad_adapters_are_errors_naming_the_field(tmp_path, config, tensors, field):
    path = _write_adapter(tmp_path / "bad", config, tensors)
    with pytest.raises(LoRAAdapterError, match=f"'bad'.*{field}".replace("[", r"\[").replace("]", r"\]")):
        read_adapter_config("bad", path, MAX_RANK)


def test_delta_forms_agree_and_base_tokens_get_no_delta():
    """The benchmark's forms (engine/entrypoints/bench/lora_forms.py) compute one delta: the one-hot
    form the engine runs (with and without its skip), a per-token gather and ragged_dot agree, in
    float32, on tokens spread over 3 slots and the base model; base-only tokens get the base output."""
    import jax.numpy as jnp

    from xlaserve.entrypoints.bench.lora_forms import _forms

    forms = _forms(16, 8, 24, num_slots=3, rank=4, dtype=jnp.float32)
    x = jnp.asarray(np.random.default_rng(0).normal(0, 1, (7, 16)), jnp.float32)
    mixed = jnp.asarray([0, 1, 2, 3, 1, 0, 3], jnp.int32)
    base = forms["base"](x, mixed)
    ref = forms["one-hot"](x, mixed)
    for name in ("one-hot + skip", "gathered", "ragged_dot"):
        for got, want in zip(forms[name](x, mixed), ref):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    for got, want in zip(ref, base):  # rows 0 and 5 are the base model's, the others are not
        np.testing.assert_array_equal(got[np.array([0, 5])], want[np.array([0, 5])])
        assert np.abs(np.asarray(got - want)[np.array([1, 2, 3])]).max() > 1e-6
    none = jnp.zeros(7, jnp.int32)
    for name in ("one-hot", "one-hot + skip", "gathered", "ragged_dot"):
        for got, want in zip(forms[name](x, none), base):
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_bfloat16_mixed_batch_is_bitwise_each_requests_solo_run(case):
    """At the dtype users run, batch invariance covers the adapters' dots too (models/lora.py: through
    `dtype_ops.matmul`, a decode step's few rows padded as the projections' are): every prompt with every
    adapter and the base model in one batch gives the first prompt's requests (each adapter's delta beside
    the others' in the batch's steps) their solo tokens and logprobs bit for bit."""
    _, loras, _, the_prompts, root = case
    if not root.name.startswith("LlamaForCausalLM"):
        pytest.skip("one family suffices: the adapters' dots are the same code for every family")
    args = {**ENGINE_ARGS, "dtype": "bfloat16"}
    llm = LLM(str(root / "base"), **args, enable_lora=True, max_loras=3, max_lora_rank=MAX_RANK)
    batch_prompts = [p for p in the_prompts for _ in loras]
    batch_loras = [lora for _ in the_prompts for lora in loras]
    solo = [ours(llm, [the_prompts[0]], [lora])[0] for lora in loras]
    batch = ours(llm, batch_prompts, batch_loras)[: len(loras)]  # the first prompt's, with each adapter
    for i, ((tokens, logprobs), (solo_tokens, solo_logprobs)) in enumerate(zip(batch, solo, strict=True)):
        assert tokens == solo_tokens, (i, batch_loras[i])
        np.testing.assert_array_equal(logprobs, solo_logprobs, err_msg=str((i, batch_loras[i])))
    llm.shutdown()

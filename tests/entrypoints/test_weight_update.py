"""The research stack's calls on a running engine (worker/weight_update.py): `update_weights` equals a
fresh engine on the updated checkpoint token for token and logprob for logprob (bfloat16: batch
invariance makes that exact), in one call or in parts, from arrays or from a path, with nothing
compiled after warm-up; a refused update names the weight and both shapes and changes nothing;
`sleep` / `wake_up` hand the device memory back and restore the same outputs. An engine that quantizes
at load (int8, fp8) quantizes an update as its load does: the same bits as a fresh quantized engine."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from xlaserve import LLM, SamplingParams
from xlaserve.kernels import cpu_dot
from xlaserve.worker.compile_guard import num_compiles
from xlaserve.worker.weight_update import update_weights

ARGS = {
    "dtype": "bfloat16",
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "block_size": 8,
    "kv_cache_memory": 2**20,
    "enable_prefix_caching": True,
    "strict_compile_guard": True,
}
PROMPTS = [[5, 17, 33, 4, 60, 8, 21, 90, 11, 3, 44, 70], [9, 9, 31, 50, 2, 77, 13, 64, 40]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)


def numbers(llm: LLM):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [sorted((i, lp.logprob) for i, lp in e.items()) for e in o.outputs[0].logprobs],
        )
        for o in outs
    ]


@pytest.fixture(scope="module")
def dirs(llama_checkpoints):
    """Checkpoints A (the engine starts on it) and B (the trainer's next weights): conftest.py."""
    return llama_checkpoints


@pytest.fixture(scope="module")
def expected(dirs):
    """What fresh engines on A and on B answer."""
    return [numbers(LLM(d, **ARGS)) for d in dirs]


@pytest.fixture(scope="module")
def llm(dirs):
    return LLM(dirs[0], **ARGS)


def packed_leaves(llm: LLM) -> int:
    leaves = jax.tree.leaves(llm.engine_core.runner.params, is_leaf=cpu_dot.is_packed)
    return sum(cpu_dot.is_packed(x) for x in leaves)


def tensors(directory) -> dict[str, np.ndarray]:
    return load_file(f"{directory}/model.safetensors")


def test_update_equals_a_fresh_engine_on_the_new_weights(llm, dirs, expected):
    a, b = dirs
    assert expected[0] != expected[1]  # the two checkpoints answer differently
    assert numbers(llm) == expected[0]
    new = tensors(b)
    # In two parts (a partial update each), one of them as (name, array) pairs of jax arrays (made
    # first: jnp.asarray compiles its own little programs).
    names = sorted(new)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    on_device = [(n, jnp.asarray(new[n])) for n in second]
    before = num_compiles()
    assert llm.update_weights({n: new[n] for n in first}) == first  # numpy: placed, nothing compiled
    assert num_compiles() == before
    # jax arrays are converted on the devices: small programs, once per shape (a trainer's next
    # update reuses them); the step programs take the new weights as arguments and never recompile.
    assert llm.update_weights(on_device) == second
    # Where the CPU's dot is built, the projections and the head stay packed for it (kernels/cpu_dot.py):
    # the update wrote the layers it names into their strips (weight_update._write_packed).
    assert packed_leaves(llm) == (8 if cpu_dot.usable(jnp.bfloat16, 1) else 0)
    before = num_compiles()
    assert numbers(llm) == expected[1]
    assert num_compiles() == before
    assert llm.engine_core.runner.guard.num_unexpected == 0
    # From a path: back to A; then the jax arrays again, through the conversions already compiled.
    llm.update_weights_from_path(a)
    assert numbers(llm) == expected[0]
    llm.update_weights(on_device)
    llm.update_weights_from_path(a)
    assert num_compiles() == before


def test_the_prefix_cache_goes_with_the_old_weights(llm, dirs, expected):
    def hits():
        return sum(m.value for m in llm.get_metrics() if m.name == "xlaserve:prefix_cache_hits")

    numbers(llm)
    before = hits()
    numbers(llm)  # the prompts' full blocks come from the cache the first run filled
    assert hits() > before
    llm.update_weights_from_path(dirs[1])
    assert numbers(llm) == expected[1]  # had a cached block of A's K/V been read, this would differ
    llm.update_weights_from_path(dirs[0])
    assert numbers(llm) == expected[0]


def test_a_refused_update_names_the_weight_and_changes_nothing(llm, dirs, expected):
    a = tensors(dirs[0])
    name = "model.layers.0.self_attn.q_proj.weight"
    wrong = np.zeros((a[name].shape[0], a[name].shape[1] + 1), np.float32)
    good = {"model.layers.1.mlp.down_proj.weight": tensors(dirs[1])["model.layers.1.mlp.down_proj.weight"]}
    with pytest.raises(ValueError, match=rf"{name}.*\(48, 49\).*\(48, 48\)"):
        llm.update_weights(good | {name: wrong})  # a good tensor beside it is not applied either
    with pytest.raises(ValueError, match="model.layers.0.self_attn.not_a_weight"):
        llm.update_weights({"model.layers.0.self_attn.not_a_weight": a[name]})
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        llm.update_weights({"model.layers.9.self_attn.q_proj.weight": a[name]})  # past the last layer
    assert numbers(llm) == expected[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wake_up_restores_the_outputs(llm, expected, level):
    runner = llm.engine_core.runner
    kv_bytes = sum(x.nbytes for x in __import__("jax").tree.leaves(runner.kv_cache))
    asleep = llm.sleep(level)
    freed = kv_bytes + (runner.weight_bytes if level == 2 else 0)
    assert asleep.device_bytes == freed and asleep.seconds >= 0
    with pytest.raises(ValueError, match="asleep"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep(level)
    assert not llm.engine_core.has_unfinished_requests()  # the refused request was never queued
    with pytest.raises(ValueError, match="asleep: call wake_up"):  # level 2 would put the old ones back
        llm.update_weights({"model.norm.weight": np.ones(48, np.float32)})
    compiles = num_compiles()
    awake = llm.wake_up()
    assert awake.device_bytes == freed
    if level == 2:  # the second round: the cache's fill was compiled by the first
        assert num_compiles() == compiles
    assert numbers(llm) == expected[0]
    with pytest.raises(ValueError, match="not asleep"):
        llm.wake_up()


# A partial update: the quantized table, one layer of a quantized stack, another's, a float norm.
SOME = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_a_quantized_engine_quantizes_an_update_as_its_load_does(dirs, quantization, tmp_path):
    import jax.numpy as jnp

    a, b = dirs
    # Compiled lazily (the three engines share one config: the second and third find the first's
    # programs in the persistent cache); nothing compiled after warm-up is the bfloat16 test's. Here:
    # once the prompts have run, neither the updates nor the steps after them compile anything.
    args = ARGS | {"quantization": quantization, "enforce_eager": True}
    mixed = shutil.copytree(b, tmp_path / "mixed")  # B with SOME of A's tensors
    old, new = tensors(a), tensors(b)
    save_file(new | {n: old[n] for n in SOME}, f"{mixed}/model.safetensors", metadata={"format": "pt"})
    fresh_b, fresh_mixed = (numbers(LLM(d, **args)) for d in (b, mixed))
    llm = LLM(a, **args)
    on_a = numbers(llm)
    assert on_a != fresh_b != fresh_mixed
    # One of them a jax array (fetched: quantized on the host, as the load does).
    some = {n: old[n] for n in SOME} | {SOME[1]: jnp.asarray(old[SOME[1]])}
    compiles = num_compiles()
    assert llm.update_weights(new) == sorted(new)
    assert numbers(llm) == fresh_b  # token ids and logprobs, bit for bit
    assert llm.update_weights(some) == sorted(SOME)
    assert numbers(llm) == fresh_mixed
    assert num_compiles() == compiles and llm.engine_core.runner.guard.num_unexpected == 0
    wrong = np.zeros((48, 49), np.float32)
    with pytest.raises(ValueError, match=r"q_proj.weight.*\(48, 49\).*\(48, 48\)"):
        llm.update_weights({SOME[2]: old[SOME[2]], "model.layers.1.self_attn.q_proj.weight": wrong})
    llm.update_weights_from_path(a)
    assert numbers(llm) == on_a


@pytest.mark.parametrize(
    ("method", "hf_config", "why"),
    [
        (None, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "came"),
        ("fp8", {"quantization_config": {"quant_method": "fp8"}}, "came quantized from its checkpoint"),
        ("gguf", {}, "GGUF's own quantized blocks"),
    ],
    ids=["fp8-blocks", "fp8-per-tensor", "gguf"],
)
def test_an_engine_whose_weights_arrived_quantized_refuses_updates(method, hf_config, why):
    config = SimpleNamespace(model=SimpleNamespace(quantization=method))
    runner = SimpleNamespace(config=config, hf_config=hf_config)  # refused before its weights are read
    with pytest.raises(ValueError, match=why):
        update_weights(runner, {"model.norm.weight": np.ones(48, np.float32)})

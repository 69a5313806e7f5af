"""The research stack's calls on a running engine (worker/weight_update.py): `update_weights` equals a
fresh engine on the updated checkpoint token for token and logprob for logprob (bfloat16: batch
invariance makes that exact), in one call or in parts, from arrays or from a path, with nothing
compiled after warm-up; a refused update names the weight and both shapes and changes nothing; a
router's subscriber to the engine's KV cache events (--kv-events-config) rebuilds its prefix cache;
`sleep` / `wake_up` hand the device memory back and restore the same outputs. An engine that quantizes
at load (int8, fp8) quantizes an update as its load does: the same bits as a fresh quantized engine.
Pipeline stages take each weight where it lives (their engines: tests/sharding/test_pipeline_parallel.py;
here the stages' loads on this process's one device, for a tied head's copies), and with another
process's stage, check and write only their own, in two phases (the engines across two processes:
tests/sharding/test_multihost.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save, save_file

from helpers import vllm_kv_events
from helpers.tiny_vlm import save_tiny_llava
from xlaserve import LLM, SamplingParams
from xlaserve.config import EngineConfig
from xlaserve.engine.metrics import PREFIX
from xlaserve.kernels import cpu_dot
from xlaserve.models.loader import load_checkpoint
from xlaserve.models.safetensors_loader import CheckpointTensor
from xlaserve.worker.compile_guard import num_compiles
from xlaserve.worker.model_loader import load_model
from xlaserve.worker.pipeline_runner import PipelineRunner, PipelineStage
from xlaserve.worker.pipeline_stage import split_layers
from xlaserve.worker.weight_update import abort_update, commit_update, prepare_update, update_weights

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
ENCODER = ("vision_tower", "multi_modal_projector")  # LLaVA's encoder modules


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
def events_sub():
    """A router's subscriber to the engine's KV cache events (--kv-events-config)."""
    sub, endpoint = vllm_kv_events.subscribe()
    yield sub, endpoint
    sub.close()


@pytest.fixture(scope="module")
def llm(dirs, events_sub):
    kv_events = {"enable_kv_cache_events": True, "endpoint": events_sub[1], "topic": "kv"}
    return LLM(dirs[0], kv_events_config=kv_events, **ARGS)


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


def test_apply_model_and_collective_rpc_see_the_weights_the_engine_runs(llm, dirs, expected):
    """vLLM's apply_model: func of the NNX module the programs run (a view of the engine's own arrays,
    so it follows an update); collective_rpc: a runner method by name, or a function of the runner."""

    def table(model):
        return np.asarray(model.embed_tokens.weight[...])

    def row(model):  # the module runs: its embedding's own call
        return np.asarray(model.embed_tokens(jnp.asarray([PROMPTS[0][0]])))[0]

    for directory in (*dirs, dirs[0]):
        llm.update_weights_from_path(directory)
        want = tensors(directory)["model.embed_tokens.weight"].astype(jnp.bfloat16)
        (got,) = llm.apply_model(table)
        assert got.dtype == want.dtype and np.array_equal(got, want)
        assert np.array_equal(llm.apply_model(row)[0], want[PROMPTS[0][0]])
    assert numbers(llm) == expected[0]
    runner = llm.engine_core.runner
    assert llm.collective_rpc(lambda r, k: r.num_blocks * k, args=(2,)) == [2 * runner.num_blocks]
    assert llm.collective_rpc("param_sets")[0][0].params is runner.params
    with pytest.raises(ValueError, match="timeout must be None"):
        llm.collective_rpc("param_sets", timeout=5.0)


def test_a_router_follows_the_prefix_cache_through_kv_events(llm, events_sub):
    """The engine's KV cache events, decoded with vLLM's structs (helpers/vllm_kv_events.py), rebuild
    what its prefix cache holds; a reset (as a weight update makes) clears a router's view."""
    sub = events_sub[0]
    seen = vllm_kv_events.receive(sub, timeout_ms=500)  # what the engine published before
    assert list(seen) == list(range(len(seen)))  # numbered from 0, none missed
    assert llm.reset_prefix_cache()
    shared = PROMPTS[0][:8] + PROMPTS[1][:8]  # two full blocks both prompts share
    prompts = [shared + PROMPTS[0][8:], shared + PROMPTS[1]]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], PARAMS, use_tqdm=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], PARAMS, use_tqdm=False)
    batches = vllm_kv_events.receive(sub)
    assert list(batches) == list(range(len(seen), len(seen) + len(batches)))
    decoded = [vllm_kv_events.DECODER.decode(batches[seq]) for seq in sorted(batches)]
    assert all(batch.data_parallel_rank == 0 for batch in decoded)
    events = [event for batch in decoded for event in batch.events]
    assert events[0] == vllm_kv_events.AllBlocksCleared()
    assert all(isinstance(event, vllm_kv_events.BlockStored) for event in events[1:])  # none evicted

    held: dict[int, list[int]] = {}  # a router's view: each block's tokens under its hash
    for event in events[1:]:
        assert event.parent_block_hash is None or event.parent_block_hash in held  # chained to one seen
        assert (event.block_size, event.medium, event.group_idx) == (8, "GPU", 0)
        assert event.extra_keys == [None] * len(event.block_hashes)  # vLLM's: a plain block's is None
        for i, block_hash in enumerate(event.block_hashes):
            assert block_hash not in held  # each block stored once
            held[block_hash] = event.token_ids[i * 8 : (i + 1) * 8]
    cached = llm.engine_core.kv_cache_manager.cached_blocks()
    assert sorted(held) == sorted(int.from_bytes(h[-8:], "big") for h, _ in cached)
    # The first prompt: 20 tokens and 9 of its 10 outputs' K/V (the last output's is never computed), 3
    # blocks; the second (25 tokens) hits the shared two and stores its next two, chained to them.
    assert len(held) == 5
    assert events[1].token_ids == shared and events[1].parent_block_hash is None
    second = [e for e in events[1:] if e.token_ids[:8] == PROMPTS[1][:8]]
    assert second and second[0].parent_block_hash == events[1].block_hashes[1]
    assert llm.reset_prefix_cache()
    [payload] = vllm_kv_events.receive(sub).values()
    assert vllm_kv_events.DECODER.decode(payload).events == [vllm_kv_events.AllBlocksCleared()]


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


def rewrite_in_place(path: str, data: bytes) -> None:
    """`data` over the file at `path`, as a trainer's save does: the same file, truncated, then written."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


def is_mapped(path: str) -> bool:
    """Whether this process (the engine's: LLM runs it here) maps the file at `path`."""
    with open("/proc/self/maps") as f:
        return any(line.split(maxsplit=5)[5:] == [os.path.realpath(path) + "\n"] for line in f)


def test_a_checkpoint_rewritten_in_place_under_the_engine(llm, dirs, expected):
    """The engine started from A's file holds copies of its tensors, never a mapping of it: a trainer's
    next checkpoint saved over that file in place, smaller then larger, neither faults the engine
    (a mapped page past the new end is a SIGBUS) nor changes its answers, and each is what
    update_weights_from_path then reads (B in bfloat16, the engine's dtype: B's answers)."""
    a, b = dirs
    path = f"{a}/model.safetensors"
    with open(path, "rb") as f:
        original = f.read()
    smaller = save({n: t.astype(ml_dtypes.bfloat16) for n, t in tensors(b).items()})
    larger = save(tensors(a), metadata={"padding": "x" * len(original)})
    assert len(smaller) < len(original) < len(larger)
    assert not is_mapped(path)
    try:
        rewrite_in_place(path, smaller)
        assert numbers(llm) == expected[0]
        llm.update_weights_from_path(a)
        assert not is_mapped(path)
        assert numbers(llm) == expected[1]
        rewrite_in_place(path, larger)
        assert numbers(llm) == expected[1]
        llm.update_weights_from_path(a)
        assert numbers(llm) == expected[0]
    finally:
        rewrite_in_place(path, original)  # the session's checkpoint, for the tests after this one


def test_an_update_from_a_trainers_pytorch_state_dict(llm, dirs, expected, tmp_path):
    """A trainer's `torch.save(state_dict)`, weights alone (no config.json): B's as pytorch_model.bin
    shards with their index, read as a start reads them (models/torch_bin_loader.py), answer as B's
    safetensors do, bit for bit; A's with one tensor of a wrong shape is refused naming it, and
    nothing changes (its good tensors included)."""
    torch = pytest.importorskip("torch")
    b = tensors(dirs[1])
    names = sorted(b)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, part in shards.items():
        torch.save({n: torch.from_numpy(b[n]) for n in part}, tmp_path / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert llm.update_weights_from_path(str(tmp_path)) == names
    assert numbers(llm) == expected[1]
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    name = "model.layers.1.mlp.down_proj.weight"
    a = {n: torch.from_numpy(t) for n, t in tensors(dirs[0]).items()}
    a[name] = torch.zeros(a[name].shape[0], a[name].shape[1] - 1)
    torch.save(a, wrong / "pytorch_model.bin")
    with pytest.raises(ValueError, match=rf"{name}.*\(48, 70\).*\(48, 71\)"):
        llm.update_weights_from_path(str(wrong))
    assert numbers(llm) == expected[1]
    llm.update_weights_from_path(dirs[0])  # A again, for the tests after this one


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wake_up_restores_the_outputs(llm, expected, level):
    runner = llm.engine_core.runner
    kv_bytes = sum(x.nbytes for x in __import__("jax").tree.leaves(runner.kv_cache))
    with pytest.raises(ValueError, match="mode must be one of abort, wait, keep, got 'pause'"):
        llm.sleep(level, mode="pause")
    assert sleep_state(llm) == "awake"
    asleep = llm.sleep(level)
    assert sleep_state(llm) == ("weights_offloaded", "discard_all")[level - 1]  # vLLM's gauge
    freed = kv_bytes + (runner.weight_bytes if level == 2 else 0)
    assert asleep.device_bytes == freed and asleep.seconds >= 0
    with pytest.raises(ValueError, match="asleep"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep(3 - level)
    assert sleep_state(llm) == ("weights_offloaded", "discard_all")[level - 1]  # a refused call moves nothing
    assert not llm.engine_core.has_unfinished_requests()  # the refused request was never queued
    assert llm.is_sleeping()
    with pytest.raises(ValueError, match="apply_model: the engine is asleep"):  # level 2: no weights
        llm.apply_model(lambda model: model)
    with pytest.raises(ValueError, match="asleep: call wake_up"):  # level 2 would put the old ones back
        llm.update_weights({"model.norm.weight": np.ones(48, np.float32)})
    compiles = num_compiles()
    awake = llm.wake_up()
    assert awake.device_bytes == freed and sleep_state(llm) == "awake"
    if level == 2:  # the second round: the cache's fill was compiled by the first
        assert num_compiles() == compiles
    assert numbers(llm) == expected[0]
    with pytest.raises(ValueError, match="not asleep"):
        llm.wake_up()
    assert not llm.is_sleeping()


def sleep_state(llm) -> str:
    """The engine_sleep_state series at 1 in `LLM.get_metrics()`."""
    (state,) = [
        m.labels["sleep_state"]
        for m in llm.get_metrics()
        if m.name == PREFIX + "engine_sleep_state" and m.value == 1
    ]
    return state


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


class Stages(SimpleNamespace):
    """What the research stack reads of a PipelineRunner, its own methods included, around stages
    loaded one after the other on this process's one device (no programs: nothing runs)."""

    param_sets = PipelineRunner.param_sets
    models = PipelineRunner.models
    set_param_sets = PipelineRunner.set_param_sets
    drafter = None  # as a PipelineRunner's: no drafter runs on stages

    def set_params(self, params, head_dv) -> None:
        self.head_params = (params, head_dv)


def staged(directory, config: EngineConfig) -> Stages:
    with open(f"{directory}/config.json") as f:
        hf_config = json.load(f)
    layouts = split_layers(hf_config["num_hidden_layers"], config.parallel.pipeline_parallel_size)
    models = [load_model(config, hf_config, tensors(directory), jax.devices()[:1], stage=s) for s in layouts]
    return Stages(
        config=config,
        hf_config=hf_config,
        model_config=models[-1].model_config,
        padded_vocab_size=models[-1].padded_vocab_size,
        dtype=models[-1].dtype,
        stages=[PipelineStage(layout, None, model, None) for layout, model in zip(layouts, models)],
    )


def host_bits(runner: Stages) -> list[dict[str, np.ndarray]]:
    """Each stage's (parameters, tied head copy), leaf by leaf on the host, by path ("[0]['norm']..." a
    parameter, "[1]..." the head copy, packed strips included)."""
    return [
        {
            jax.tree_util.keystr(path): np.asarray(x)
            for path, x in jax.tree.leaves_with_path((s.params, s.head_dv))
        }
        for s in runner.param_sets()
    ]


def changed(before: list[dict], after: list[dict]) -> list[set[str]]:
    return [{k for k in old if not np.array_equal(old[k], new[k])} for old, new in zip(before, after)]


def tied(directory, out) -> str:
    """The checkpoint at `directory` with its LM head tied to its embedding (lm_head.weight dropped)."""
    shutil.copytree(directory, out)
    with open(f"{out}/config.json") as f:
        hf_config = json.load(f)
    with open(f"{out}/config.json", "w") as f:
        json.dump(hf_config | {"tie_word_embeddings": True}, f)
    weights = {n: a for n, a in tensors(directory).items() if n != "lm_head.weight"}
    save_file(weights, f"{out}/model.safetensors", metadata={"format": "pt"})
    return str(out)


def test_pipeline_stages_take_each_weight_where_it_lives(dirs, tmp_path):
    """A tied Llama of 3 layers in 2 stages (layers 0-1, layer 2), bfloat16: the table lives on stage 0
    and on the last stage, with the head's [D, V] copy there (worker/model_loader.py). An update of the
    table writes both and the copy, nothing else; a layer goes to its stage; an update with a wrong
    shape on the last stage's norm writes no stage; a whole checkpoint leaves every stage holding a
    fresh load's bits."""
    a, b = (tied(d, tmp_path / name) for d, name in zip(dirs, ("tied_a", "tied_b")))
    config = EngineConfig.from_kwargs(a, dtype="bfloat16", pipeline_parallel_size=2)
    runner, fresh_b = staged(a, config), staged(b, config)
    assert [len(s.layout.layers) for s in runner.stages] == [2, 1]
    assert runner.stages[0].model.head_dv is None and runner.stages[1].model.head_dv is not None
    new = tensors(b)
    start, params = host_bits(runner), [s.params for s in runner.param_sets()]
    good = {"model.layers.0.mlp.down_proj.weight": new["model.layers.0.mlp.down_proj.weight"]}
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(49,\), the model's is \(48,\)"):
        update_weights(runner, good | {"model.norm.weight": np.ones(49, np.float32)})
    with pytest.raises(ValueError, match="tied to model.embed_tokens.weight"):
        update_weights(runner, good | {"lm_head.weight": new["model.embed_tokens.weight"]})
    assert all(s.params is p for s, p in zip(runner.param_sets(), params))  # no stage was written
    table = {"model.embed_tokens.weight": new["model.embed_tokens.weight"]}
    assert update_weights(runner, table) == list(table)
    embedding = "[0]['embed_tokens']['weight'].value"
    head_copy = {k for k in start[1] if k.startswith("[1]")}
    assert head_copy and changed(start, host_bits(runner)) == [{embedding}, {embedding} | head_copy]
    before = host_bits(runner)
    update_weights(
        runner, {"model.layers.2.self_attn.o_proj.weight": new["model.layers.2.self_attn.o_proj.weight"]}
    )
    o_proj = "[0]['layers']['self_attn']['o_proj']['kernel'].value"  # packed for the CPU's dot: its strips
    assert [[k.startswith(o_proj) for k in c] for c in changed(before, host_bits(runner))] == [[], [True]]
    update_weights(runner, new)
    # apply_model's modules, one a stage: the tied table on both, the new one.
    tables = [np.asarray(m.embed_tokens.weight[...]) for m in runner.models()]
    assert len(tables) == 2 and all(
        np.array_equal(t, new["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16)) for t in tables
    )
    for ours, theirs in zip(host_bits(runner), host_bits(fresh_b)):
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert ours[key].dtype == theirs[key].dtype and np.array_equal(ours[key], theirs[key]), key


def test_a_process_checks_and_writes_only_its_own_stages_in_two_phases(dirs):
    """Pipeline stages across processes as process 0 sees them (stage 1, layer 2 and the head, another
    process's: no model here). Its own stage's tensors are checked and written; the other stage's names
    are known, their shapes left to their process (a wrong one is not refused here); a name of no stage
    is refused. `prepare_update` installs nothing until `commit_update`; `abort_update` drops it."""
    a, b = dirs
    runner = staged(a, EngineConfig.from_kwargs(a, dtype="bfloat16", pipeline_parallel_size=2))
    runner.stages[1] = dataclasses.replace(runner.stages[1], model=None)
    new, start = tensors(b), host_bits(runner)
    assert start[1] == {}  # nothing of stage 1 here
    mine = {k: v for k, v in new.items() if k.startswith("model.layers.0.")}
    theirs = {"model.norm.weight": np.ones(49, np.float32), "model.layers.2.mlp.up_proj.weight": np.ones(3)}
    assert prepare_update(runner, mine | theirs) == sorted(mine | theirs)
    assert changed(start, host_bits(runner)) == [set(), set()]  # prepared, not installed
    commit_update(runner)
    written = changed(start, host_bits(runner))
    assert written[0] and all("['layers']" in k for k in written[0]) and written[1] == set()
    assert runner.prepared_update is None
    with pytest.raises(ValueError, match="'model.layers.3.mlp.up_proj.weight' is not a weight"):
        prepare_update(runner, {"model.layers.3.mlp.up_proj.weight": np.ones(3)})
    before = host_bits(runner)
    prepare_update(runner, {"model.embed_tokens.weight": new["model.embed_tokens.weight"]})
    abort_update(runner)
    assert changed(before, host_bits(runner)) == [set(), set()] and runner.prepared_update is None


def test_text_only_stages_hold_no_encoder_and_skip_its_tensors(tmp_path, monkeypatch):
    """A LLaVA (encoder modules vision_tower, multi_modal_projector) in vLLM's text-only mode, loaded by
    PipelineRunner's own load as 2 stages (both on this process's one device): no stage holds a tower
    or projector weight, nor reads one from the checkpoint, so the weight bytes are the language model's;
    a trainer's full checkpoint is accepted, its text weights written where they live and the encoder's
    skipped."""
    directory = save_tiny_llava(str(tmp_path / "llava"))
    limits = {"image": 0, "video": 0}
    # float32 named: "auto" is bfloat16 on a CPU with AVX512-BF16 or AMX.
    config = EngineConfig.from_kwargs(
        directory, pipeline_parallel_size=2, limit_mm_per_prompt=limits, dtype="float32"
    )
    with open(f"{directory}/config.json") as f:
        hf_config = json.load(f)
    checkpoint = load_checkpoint(directory, skip_tokenizer_init=True, progress=False).tensors
    read = set()  # the tensors read from the file, by their offsets in it
    unread = CheckpointTensor.read
    monkeypatch.setattr(CheckpointTensor, "read", lambda t: read.add(t.offset) or unread(t))
    runner = Stages(config=config, hf_config=hf_config)
    model = PipelineRunner._load_model(runner, config, hf_config, checkpoint, jax.devices()[:1] * 2)
    assert read == {t.offset for n, t in checkpoint.items() if not n.startswith(ENCODER)}
    runner.model_config, runner.padded_vocab_size, runner.dtype = (
        model.model_config,
        model.padded_vocab_size,
        model.dtype,
    )

    def encoder_sizes():
        return [
            {leaf.size for path, leaf in jax.tree.leaves_with_path(s.params) if path[0].key in ENCODER}
            for s in runner.param_sets()
        ]

    assert encoder_sizes() == [{0}, {0}]  # placeholders only
    text = {n: a for n, a in checkpoint.items() if not n.startswith(ENCODER)}
    assert len(text) < len(checkpoint)
    assert model.weight_bytes == sum(a.size * 4 for a in text.values())  # float32
    norm = "language_model.model.norm.weight"
    new = checkpoint | {norm: checkpoint[norm] + 1}
    start = host_bits(runner)
    assert update_weights(runner, new) == sorted(new)
    assert changed(start, host_bits(runner)) == [set(), {"[0]['norm']['weight'].value"}]
    assert encoder_sizes() == [{0}, {0}]


def test_a_follower_runs_only_the_calls_it_knows_by_name():
    """Process 0 names a call between steps (executor/follower_calls.Call); a follower looks the name up in a
    fixed table, never among a module's attributes: an unknown name is refused at both ends."""
    from xlaserve.executor.follower_calls import Call

    weights = {"model.norm.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}
    received = Call.from_frames(Call("prepare_update", weights=weights).to_frames())
    assert received.method == "prepare_update" and received.args == ()
    np.testing.assert_array_equal(received.weights["model.norm.weight"], weights["model.norm.weight"])

    put = []
    runner = SimpleNamespace(lora=SimpleNamespace(put_in_slot=lambda slot, lora: put.append((slot, lora))))
    Call.from_frames(Call("put_lora_in_slot", (1, "a", 7, "/adapters/a")).to_frames()).run(runner)
    assert [(slot, lora.lora_name, lora.lora_int_id, lora.lora_path) for slot, lora in put] == [
        (1, "a", 7, "/adapters/a")
    ]

    with pytest.raises(ValueError, match="no call 'load_model' between steps"):
        Call("load_model")
    frames = Call("wake_up").to_frames()
    frames[0] = frames[0].replace(b'"wake_up"', b'"__class__"')
    with pytest.raises(ValueError, match="no call '__class__'"):
        Call.from_frames(frames)

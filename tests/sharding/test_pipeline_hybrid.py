"""Hybrid models on pipeline stages, on fake CPU devices (helpers/pp_worker.py `hybrid`, one call for the
module): a tiny Qwen3.5 of 6 layers (Gated DeltaNet and attention alternating: stages L F L | F L F, so
the boundary falls inside a period and each stage runs the period rotated) and a tiny Granite 4.0-H
of 4 layers (Mamba2, attention, Mamba2, Mamba2: stages M A | M M, the second holding no attention layer)
give PP=1's tokens and logprobs bit for bit under PP=2: three requests in flight, one prefilled in
chunks across steps, then the same prompts again, hitting the state snapshots the first run left
(prefix caching: each stage copies its own layers' state rows); Qwen3.5 in bfloat16 with two
micro-batches in flight, Granite in float32. The PP=2 engines are warmed up under the strict compile
guard and compile nothing afterwards (Qwen3.5's, and across processes; Granite's runs eager); each
stage's cache holds its own layers' K/V blocks and state slots only, with the same block and slot ids. The
research stack on the Qwen3.5 PP=2 engine: a wrong shape on either stage is refused with no stage changed,
`update_weights_from_path` to a second checkpoint gives a fresh engine's bits on it (snapshot hits
included), sleep/wake_up at both levels the same bits again, nothing compiled. And across two processes
(helpers/pp_process.py: jax.distributed over loopback, one stage and one CPU device each, one launch,
warmed up under the strict compile guard in both): Qwen3.5 in bfloat16 gives one device's bits, its
snapshot hits included (process 0 holds the first stage and copies its own state rows without the last
stage's program), and the research stack on it gives one device's bits on the second checkpoint, after
sleep/wake_up, after refusals on either process's stage (nothing changed on either), and back on the
first.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from helpers.family_cases import GRANITE_HYBRID, QWEN3_5_TEXT, randomize_weights, save_hf_model

# Five engines in the fake-mesh worker (one warmed up whole), and one launch of two processes.
pytestmark = pytest.mark.slow

PP1, PP2 = {}, {"pipeline_parallel_size": 2}
BF16 = {"dtype": "bfloat16"}
# Qwen3.5 in bfloat16 (its stacked weights packed for the CPU's dot, read in place at each layer's index:
# kernels/dtype_ops.py `stack_entry`), Granite 4.0-H in float32; Qwen3.5's PP=2 engine warmed up whole
# (Granite's too took ~25 s of the suite's CPU for the same stage programs' property).
LAYOUTS = {"qwen3_5": [BF16, {**BF16, **PP2}], "qwen3_5_b": [BF16], "granite": [PP1, PP2]}
GUARDED = {"qwen3_5": {**BF16, **PP2}}
# Two micro-batches in flight, each step another mix of requests than PP=1's: bitwise only where the
# model is batch-invariant, bfloat16 (float32's chunked delta rule takes its chunk size from the step).
MICRO_BATCHES = {"qwen3_5": {**BF16, **PP2}}
# 16 tokens a step: the 40-token prompt prefills in three chunks, beside the others' decodes.
SHAPE = {"max_num_batched_tokens": 16, "max_num_seqs": 4}
PROMPTS = [[5, 17, 33, 4, 60], [(7 * i) % 98 + 3 for i in range(40)], [44, 20, 7, 81, 15, 9, 66] * 3]
# The research stack on Qwen3.5's guarded PP=2 engine, to "qwen3_5_b" (a fresh PP=1 engine's numbers
# there: LAYOUTS): each refusal a good tensor of one stage (doubled) beside a wrong shape on the other.
REFUSALS = [
    ["model.layers.0.linear_attn.out_proj.weight", "model.layers.4.linear_attn.in_proj_qkv.weight"],
    ["model.layers.3.self_attn.o_proj.weight", "model.layers.2.linear_attn.in_proj_z.weight"],
]
RESEARCH = {"qwen3_5": {"other": "qwen3_5_b", "refusals": REFUSALS}}


def _save(tmp_path_factory, name: str, config_class: str, architecture: str, fields: dict, seed=3) -> str:
    config = getattr(transformers, config_class)(**fields)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    zero_centred = architecture.startswith("Qwen")  # Qwen3.5's norms scale by 1 + w
    model = randomize_weights(
        getattr(transformers, architecture)(config).eval(), 0.0 if zero_centred else 1.0
    )
    return save_hf_model(model, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """{model: directory}: the tiny Qwen3.5, another of its shapes (seed 4), the tiny Granite 4.0-H."""
    qwen = dict(QWEN3_5_TEXT, num_hidden_layers=6, layer_types=["linear_attention", "full_attention"] * 3)
    granite = dict(GRANITE_HYBRID, layer_types=["mamba", "attention", "mamba", "mamba"])
    qwen3_5 = ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", qwen)
    return {
        "qwen3_5": _save(tmp_path_factory, "pp_qwen3_5", *qwen3_5),
        "qwen3_5_b": _save(tmp_path_factory, "pp_qwen3_5_b", *qwen3_5, seed=4),
        "granite": _save(
            tmp_path_factory, "pp_granite", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", granite
        ),
    }


@pytest.fixture(scope="module")
def runs(tp_worker, models) -> dict[str, list[dict]]:
    """{model: [result per layout of LAYOUTS]}."""
    arg = {"models": models, "layouts": LAYOUTS, "guarded": GUARDED, "shape": SHAPE, "prompts": PROMPTS}
    arg |= {"micro_batches": MICRO_BATCHES, "research": RESEARCH}
    return tp_worker.run("pipeline_hybrid", "", arg)


@pytest.fixture(scope="module")
def two_processes(models) -> dict:
    """helpers/pp_process.py's two processes: the Qwen3.5 PP=2 engine (the guarded layout, warmed up under
    the strict compile guard: a step that compiles, in either process, fails the run) with its prompts
    twice and the research stack. (Granite 4.0-H after it, in the same processes, gave one device's bits
    too, by hand; it took the launch from 45 to 75 s.)"""
    from helpers.two_processes import run_two_processes

    layout = {**GUARDED["qwen3_5"], "enforce_eager": False, "strict_compile_guard": True}
    arg = {"model": models["qwen3_5"], "layout": layout, "shape": SHAPE, "prompts": PROMPTS, "again": True}
    arg["research"] = {"other": models["qwen3_5_b"], "refusals": REFUSALS}
    return run_two_processes("pp_process.py", arg, 1)


@pytest.mark.parametrize(("model", "dtype"), [("qwen3_5", BF16), ("granite", {})])
def test_stages_are_bitwise_one_device(runs, model, dtype):
    one, staged = (runs[model][LAYOUTS[model].index({**dtype, **layout})] for layout in (PP1, PP2))
    assert staged["layout"] == {**dtype, **PP2}
    # Two micro-batches of the three requests in flight where MICRO_BATCHES says, else one step.
    assert staged["peak_steps_in_flight"] == (2 if staged["layout"] == MICRO_BATCHES.get(model) else 1)
    for run_one, run_staged in zip(one["runs"], staged["runs"], strict=True):
        assert run_staged["tokens"] == run_one["tokens"]
        assert run_staged["logprobs"] == run_one["logprobs"]  # every float, exactly
        assert run_staged["num_cached_tokens"] == run_one["num_cached_tokens"]
    first, again = one["runs"]
    assert len({tuple(t) for t in first["tokens"]}) == len(PROMPTS)  # the prompts differ in output
    # The second run starts the two longer prompts from snapshots, and gives the first run's tokens (in
    # bfloat16 its bits: batch-invariant; float32's chunked delta rule and SSD take chunks from the step).
    assert first["num_cached_tokens"] == [0, 0, 0] and again["num_cached_tokens"][1:] == [32, 16]
    assert again["tokens"] == first["tokens"]
    if dtype == BF16:
        assert again["logprobs"] == first["logprobs"]


def test_each_stage_holds_its_layers_rows_and_nothing_compiles_after_warm_up(runs):
    """Qwen3.5's stages: 1 attention + 2 DeltaNet layers, then 2 + 1; Granite's: 1 + 1, then 0 + 2 (an
    empty K/V array). Every stage has every block id and state slot."""
    expected = {"qwen3_5": [(1, 2), (2, 1)], "granite": [(1, 1), (0, 2)]}
    for model, counts in expected.items():
        staged = runs[model][-1]
        assert staged["layout"].get("pipeline_parallel_size") == 2
        if model in GUARDED:
            assert staged["compiles_after_warm_up"] == 0
        blocks, slots = staged["num_blocks"], staged["num_state_slots"]
        assert slots == 2 * SHAPE["max_num_seqs"] + 1  # the live ones, the null slot, the snapshots
        assert staged["cache_rows"] == [[a * blocks, a * blocks, s * slots, s * slots] for a, s in counts]


def test_two_processes_are_bitwise_one_device(runs, two_processes):
    """Qwen3.5 at PP=2 over two processes of one device each (process 0: the first stage; process 1: the
    second and the sampler), bfloat16: one device's tokens, logprobs and cached tokens, the prompts twice
    (the 40-token one prefilled in chunks; the second time from the snapshots, each process copying its
    own stage's state rows)."""
    first, again = runs["qwen3_5"][0]["runs"]  # PP=1's
    assert again["num_cached_tokens"][1:] == [32, 16]
    for got, want in ((two_processes, first), (two_processes["again"], again)):
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == want["logprobs"]  # every float, exactly
        assert got["num_cached_tokens"] == want["num_cached_tokens"]


def _numbers(run: dict) -> dict:
    return {key: run[key] for key in ("tokens", "logprobs", "num_cached_tokens")}


def test_research_stack_on_stages_gives_a_fresh_engines_bits(runs):
    """Qwen3.5 at PP=2 (bfloat16, two micro-batches in flight): a wrong shape on either stage, beside a good
    tensor of the other, is refused naming the weight and both shapes, and no stage changes;
    `update_weights_from_path` to the second checkpoint then gives a fresh PP=1 engine's bits on it, its
    snapshot hits too; sleep/wake_up at levels 1 and 2 free and place every stage's cache (and weights)
    and give the same bits; nothing compiles for any of it."""
    staged = runs["qwen3_5"][LAYOUTS["qwen3_5"].index(GUARDED["qwen3_5"])]
    research, fresh = staged["research"], runs["qwen3_5_b"][0]["runs"]
    for good, bad in REFUSALS:
        assert f"weights: '{bad}' has shape" in research["refused"][bad]
    assert research["changed_by_refused"] == [{}, {}]
    assert research["updated"] > 0
    assert [_numbers(run) for run in research["after"]] == [_numbers(run) for run in fresh]
    assert fresh[0]["tokens"] != staged["runs"][0]["tokens"]  # the second checkpoint answers otherwise
    level_1, level_2 = research["sleep"]
    for level in (level_1, level_2):
        assert level["freed"] == level["placed"] == level["expected"]
        assert _numbers(level["numbers"]) == _numbers(fresh[0])
    assert level_2["freed"] > level_1["freed"]
    assert research["compiles"] == 0


def test_research_stack_across_two_processes_gives_one_devices_bits(runs, two_processes):
    """The same Qwen3.5 over two processes: `update_weights_from_path` (each process reads the checkpoint
    for its own stage) gives one device's bits on the second checkpoint, sleep(2)/wake_up the same; a
    wrong shape on process 1's stage beside a good tensor of process 0's, and the other way round, is
    refused with nothing changed on either (two phases: prepare everywhere, then commit); the first
    checkpoint's path brings its bits back."""
    run, fresh = two_processes, runs["qwen3_5_b"][0]["runs"][0]
    assert run["updated"] > 0
    for key in ("after", "woken", "after_refusals"):
        assert run[key] == _numbers(fresh), key
    assert run["freed"] > 0 and run["placed"] == run["freed"]
    late, early = (bad for _, bad in REFUSALS)  # on process 1's stage, on process 0's
    assert run["refused"][late].startswith(f"process 1: ValueError: weights: '{late}' has shape")
    assert "(nothing changed on any process)" in run["refused"][late]
    assert run["refused"][early].startswith(f"weights: '{early}' has shape")
    assert run["back"] == _numbers(runs["qwen3_5"][0]["runs"][0])

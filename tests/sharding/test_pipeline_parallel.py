"""Pipeline parallelism on 8 fake CPU devices (helpers/pp_worker.py, one call for the whole module):
stages compute what one device computes for their layers, in the same order, so PP=4 (a tiny
Qwen3-MoE: first, middle and last stages, the experts cut into stages) gives bitwise the same greedy
ids and logprobs as PP=1; PP=2 x TP=2 (a tiny Llama) matches within 1e-4 (tensor parallelism's
all-reduce sums in another order); each stage holds only its own weights and KV cache, on its own
devices; nothing compiles after warm-up. And PP=2 over two processes (jax.distributed over loopback,
one stage and one device each, helpers/pp_process.py) gives the one-device PP=1 run's bits too, and
PP=2 x TP=2 over two processes of two devices each the one-host PP=2 x TP=2 run's. PP=2 keeps two
micro-batches of different requests in flight (the stages of consecutive steps overlap): several
requests at once give PP=1's bits, where PP=1 runs them all in one batch. The research stack on that
PP=2 engine (its programs, from the persistent compilation cache): `update_weights` routes each tensor
to the stage holding it and equals a fresh engine on the new weights bit for bit, a refused update
changes no stage, and sleep/wake_up at both levels restore the answers. LoRA on PP=2 (each stage holds
its layers' adapter slots) gives PP=1's bits, two adapters and the base model in one batch, a third
adapter swapped into a slot at run time. Vision-language models on PP=2 (the encoder and its cache on the
first stage) give PP=1's bits for an image request, a two-image one and a text one in one batch:
Qwen3-VL of 4 layers (M-RoPE positions on every stage, DeepStack features added after layers 0-2, layer 2
on the second stage) and Gemma 3 (image spans seen both ways on every stage). And in
bfloat16, requests preempted and recomputed (all but a few KV blocks held aside) give the bits of the run
without preemption, on PP=1, PP=2 and PP=2 with micro-batches: the tiny Llama and Qwen3-VL; in float32 on
PP=1 too."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # eight engines in the fake-mesh worker, one warmed up; two two-process runs

PP1, PP2, PP4 = {}, {"pipeline_parallel_size": 2}, {"pipeline_parallel_size": 4}
PP2_TP2 = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}
# Each engine compiles its own programs (each stage's forward per bucket, ~2-4 s each on this machine):
# the fewest layouts that cover 4 stages (a first, two middle and a last: PP=2's two stages are PP=4's
# ends) of MoE experts, tensor parallelism inside the stages, and the compile guard.
LAYOUTS = {"llama": [PP1, PP2_TP2], "qwen3_moe": [PP1, PP4]}
GUARDED = {"llama": PP2_TP2}  # warmed up under the strict compile guard
# Four requests at once (max_num_seqs=4): PP=1 runs them in one batch, PP=2 in two micro-batches of two.
MICRO_BATCH_PROMPTS = [[5, 17, 33, 4, 60, 8, 21, 90, 13], [200, 9, 31, 250, 2], [44, 120, 7], [3, 99, 64, 12]]
MICRO_BATCH_SHAPE = {"max_num_batched_tokens": 32, "max_num_seqs": 4}

# LoRA: three requests in one batch (two adapters and the base model; 13 prompt tokens: one prefill step
# in bucket 16, decode steps in bucket 4), three adapters for two slots (rank, alpha, rsLoRA, targets).
LORA_SHAPE = {"max_num_batched_tokens": 16, "max_num_seqs": 4}
LORA_PROMPTS = [[5, 17, 33, 4, 60], [200, 9, 31, 250], [44, 120, 7, 81]]
LORA_ADAPTERS = [
    (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    (4, 8, False, ["q_proj", "v_proj", "down_proj"]),
    (2, 4, True, ["o_proj", "up_proj"]),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """{model: directory}: a tiny Llama and a tiny Qwen3-MoE of 4 layers each."""
    from helpers.tiny_models import save_tiny_llama, save_tiny_model, small_byte_tokenizer

    tokenizer = small_byte_tokenizer()  # a 320-token vocabulary: small logits and sampler programs
    llama = save_tiny_llama(
        str(tmp_path_factory.mktemp("pp_llama")),
        num_hidden_layers=4,
        num_key_value_heads=2,
        tokenizer=tokenizer,
    )
    moe = save_tiny_model(
        str(tmp_path_factory.mktemp("pp_qwen3_moe")),
        "Qwen3Moe",
        tokenizer=small_byte_tokenizer(),
        num_hidden_layers=4,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
    )
    return {"llama": llama, "qwen3_moe": moe}


@pytest.fixture(scope="module")
def runs(tp_worker, models):
    """{model: [result per layout of LAYOUTS]}."""
    arg = {"models": models, "layouts": LAYOUTS, "guarded": GUARDED}
    return tp_worker.run("pipeline", "", arg)


@pytest.fixture(scope="module")
def micro_batch_runs(tp_worker, models):
    """[PP=1, PP=2] on the tiny Llama, four requests at once."""
    arg = {
        "models": {"llama": models["llama"]},
        "layouts": {"llama": [PP1, PP2]},
        "guarded": {},
        "shape": MICRO_BATCH_SHAPE,
        "prompts": MICRO_BATCH_PROMPTS,
        "micro_batches": True,
    }
    return tp_worker.run("pipeline", "", arg)["llama"]


@pytest.fixture(scope="module")
def research_run(tp_worker, models, tmp_path_factory):
    """helpers/pp_worker.py `research`: the micro-batch case's PP=2 engine (its programs) on the tiny
    Llama takes another tiny Llama's weights (seed 1, the same shapes), sleeps and wakes."""
    from helpers.tiny_models import save_tiny_llama, small_byte_tokenizer

    other = save_tiny_llama(
        str(tmp_path_factory.mktemp("pp_llama_b")),
        seed=1,
        num_hidden_layers=4,
        num_key_value_heads=2,
        tokenizer=small_byte_tokenizer(),
    )
    arg = {
        "model": models["llama"],
        "other": other,
        "layout": PP2,
        "shape": MICRO_BATCH_SHAPE,
        "prompts": MICRO_BATCH_PROMPTS,
    }
    return tp_worker.run("pipeline_research", "", arg)


# Vision-language models: a step of 16 tokens holds an image's (helpers/tiny_vlm.py), four requests a batch.
# In float32 both layouts must schedule alike, so the KV budget (small_llm's 8 MiB) holds every request: a
# stage's budget is for its own layers, so PP=2 holds twice PP=1's blocks, and where PP=1 alone preempts,
# a recomputed request decodes beside other companions, which moves a float32 logprob by an ulp (the
# preemption case below runs in bfloat16; README, "Batch invariance").
VLM_SHAPE = {"max_num_batched_tokens": 16, "max_num_seqs": 4}
VLM_GUARDED = ["qwen3_vl"]  # its PP=2 warmed up under the strict compile guard (encoder, DeepStack rows)


@pytest.fixture(scope="module")
def vlm_models(tmp_path_factory) -> dict[str, str]:
    """{model: directory}: tiny random vision-language models (helpers/tiny_vlm.py)."""
    from helpers import tiny_vlm

    return {
        "qwen3_vl": tiny_vlm.save_tiny_qwen3_vl(
            str(tmp_path_factory.mktemp("pp_qwen3_vl")), num_layers=4, deepstack_visual_indexes=(0, 1, 2)
        ),
        "gemma3": tiny_vlm.save_tiny_gemma3(str(tmp_path_factory.mktemp("pp_gemma3"))),
    }


@pytest.fixture(scope="module")
def image_runs(tp_worker, vlm_models):
    """helpers/pp_worker.py `images`: {model: [PP=1, PP=2]} on tiny random vision-language models."""
    arg = {"models": vlm_models, "layouts": [PP1, PP2], "guarded": VLM_GUARDED, "shape": VLM_SHAPE}
    return tp_worker.run("pipeline_images", "", arg)


# Preemption on stages, in bfloat16: the dtype users run (float32 on one device below). All but 7 KV
# blocks held aside: the three requests (token-id prompts of 54, 45 and 15 tokens; Qwen3-VL's image
# prompts) preempt each other two to four times, mid-prompt and mid-decode, and recompute.
PREEMPTION_SHAPE = {"dtype": "bfloat16", "max_num_batched_tokens": 16, "max_num_seqs": 4}
PREEMPTION_PROMPTS = [
    [5, 17, 33, 4, 60, 8, 21, 90, 13] * 6,
    [200, 9, 31, 250, 2] * 9,
    [44, 120, 7, 81, 150] * 3,
]
PREEMPTION_FREE_BLOCKS = 7


@pytest.fixture(scope="module")
def preemption_runs(tp_worker, models, vlm_models):
    """helpers/pp_worker.py `preemption`: {model: [PP=1, PP=2]}, each engine's runs with the whole cache
    free and with PREEMPTION_FREE_BLOCKS (PP=2: also with its micro-batches in flight)."""
    arg = {
        "models": {"llama": models["llama"], "qwen3_vl": vlm_models["qwen3_vl"]},
        "layouts": [PP1, PP2],
        "shape": PREEMPTION_SHAPE,
        "prompts": PREEMPTION_PROMPTS,
        "free_blocks": PREEMPTION_FREE_BLOCKS,
    }
    return tp_worker.run("pipeline_preemption", "", arg)


@pytest.fixture(scope="module")
def float32_preemption_runs(tp_worker, models):
    """The preemption case in float32 on one device (PP=1), with float32's batch invariance asked for
    (`batch_invariant_float32`): what float32 adds is its dots (few rows padded, many in tiles:
    kernels/dtype_ops.py), which stages run alike."""
    arg = {
        "models": {"llama": models["llama"]},
        "layouts": [PP1],
        "shape": {**PREEMPTION_SHAPE, "dtype": "float32", "batch_invariant_float32": True},
        "prompts": PREEMPTION_PROMPTS,
        "free_blocks": PREEMPTION_FREE_BLOCKS,
    }
    return tp_worker.run("pipeline_preemption", "", arg)


@pytest.fixture(scope="module")
def lora_runs(tp_worker, models, tmp_path_factory):
    """helpers/pp_worker.py `lora`: [PP=1, PP=2 (warmed up under the strict compile guard)] on the tiny
    Llama with three random PEFT adapters of other ranks and targets, two slots."""
    pytest.importorskip("peft")
    import transformers

    from helpers.lora_adapters import make_adapter

    base = transformers.AutoModelForCausalLM.from_pretrained(models["llama"]).eval()
    adapters = []
    for seed, (rank, alpha, use_rslora, targets) in enumerate(LORA_ADAPTERS):
        directory = str(tmp_path_factory.mktemp(f"pp_lora_{seed}"))
        make_adapter(base, rank, alpha, use_rslora, targets, directory, seed=seed)
        adapters.append(directory)
    arg = {
        "model": models["llama"],
        "adapters": adapters,
        "layouts": [PP1, PP2],
        "guarded": PP2,
        "shape": LORA_SHAPE,
        "prompts": LORA_PROMPTS,
    }
    return tp_worker.run("pipeline_lora", "", arg)


def _max_logprob_diff(a: list, b: list) -> float:
    """The largest |difference| between two runs' logprobs of the same ids at the same positions."""
    return max(
        abs(x[1] - y[1])
        for seq_a, seq_b in zip(a, b)
        for pos_a, pos_b in zip(seq_a, seq_b)
        for x in pos_a
        for y in pos_b
        if x[0] == y[0]
    )


def test_pipeline_stages_are_bitwise_one_device(runs):
    one, staged = runs["qwen3_moe"][0], runs["qwen3_moe"][LAYOUTS["qwen3_moe"].index(PP4)]
    assert staged["layout"] == PP4
    assert staged["tokens"] == one["tokens"]
    assert staged["logprobs"] == one["logprobs"]  # every float, exactly
    assert len({tuple(t) for t in one["tokens"]}) == len(one["tokens"])  # the prompts differ in output


def test_micro_batches_in_flight_are_bitwise_one_device(micro_batch_runs):
    """Two micro-batches of two requests each were in flight at once (the engine core's count), and each
    request's tokens and logprobs are those of PP=1, which ran all four in every step."""
    one, staged = micro_batch_runs
    assert (one["layout"], staged["layout"]) == (PP1, PP2)
    assert staged["peak_steps_in_flight"] == 2
    assert one["peak_steps_in_flight"] == 1  # synchronous on a CPU
    assert staged["tokens"] == one["tokens"]
    assert staged["logprobs"] == one["logprobs"]  # every float, exactly
    assert len({tuple(t) for t in one["tokens"]}) == len(MICRO_BATCH_PROMPTS)


def test_pipeline_times_tensor_parallel_matches_one_device(runs):
    one, staged = runs["llama"][0], runs["llama"][LAYOUTS["llama"].index(PP2_TP2)]
    assert staged["tokens"] == one["tokens"]
    assert _max_logprob_diff(staged["logprobs"], one["logprobs"]) < 1e-4


def test_each_stage_holds_only_its_layers_and_nothing_compiles_after_warm_up(runs):
    guarded = runs["llama"][LAYOUTS["llama"].index(GUARDED["llama"])]
    assert guarded["compiles_after_warm_up"] == 0
    assert guarded["num_steps"] > 0
    assert guarded["token_buckets"] == [1, 16]  # the capture sizes chosen (helpers/pp_worker.py SHAPE)
    first, last = guarded["stages"]
    num_blocks = first["num_blocks"]
    # Two stages of 2 of the 4 layers, each on its own 2 devices (sharded there by tensor
    # parallelism), its KV cache of its 2 layers only.
    assert (first["devices"], last["devices"]) == ([0, 1], [2, 3])
    assert (first["layer_devices"], last["layer_devices"]) == ([0, 1], [2, 3])
    assert first["num_layers"] == last["num_layers"] == [2]
    assert first["kv_rows"] == last["kv_rows"] == [2 * num_blocks, 2 * num_blocks]
    # The embedding on the first stage, the final norm and the (untied) LM head on the last.
    assert (first["has_embedding"], first["has_norm"], first["has_lm_head"]) == (True, False, False)
    assert (last["has_embedding"], last["has_norm"], last["has_lm_head"]) == (False, True, True)
    # Each stage read only the tensors of what it holds: every one of the checkpoint's 4 x 9 layer
    # tensors, the embedding, final norm and head read once by one stage, none by both.
    assert guarded["tensor_reads"] == [1] * (4 * 9 + 3)


def _two_process_run(model: str, layout: dict, devices_per_process: int) -> dict:
    """helpers/pp_process.py's two processes: process 0's tokens and logprobs."""
    from helpers.pp_worker import SHAPE
    from helpers.two_processes import run_two_processes

    return run_two_processes(
        "pp_process.py", {"model": model, "layout": layout, "shape": SHAPE}, devices_per_process
    )


def test_two_processes_pipeline_parallel_2_are_bitwise_one_device(models, runs):
    """PP=2 across two jax.distributed processes of one CPU device each: stage 0 in process 0, stage 1
    (and the sampler) in process 1, the hidden states handed over by JAX's cross-host device_put. Warmed
    up under the strict compile guard in both processes: a compile after warm-up fails the run."""
    layout = {**PP2, "enforce_eager": False, "strict_compile_guard": True}
    result = _two_process_run(models["llama"], layout, devices_per_process=1)
    one = runs["llama"][0]
    assert one["layout"] == PP1
    assert result["tokens"] == one["tokens"]
    assert result["logprobs"] == one["logprobs"]  # every float, exactly


def test_two_processes_pipeline_times_tensor_parallel_are_bitwise_one_host(models, runs):
    """PP=2 x TP=2 across two processes of two devices each (a stage's all-reduces inside its process)
    computes what the same layout computes on one host's four devices, bit for bit."""
    result = _two_process_run(models["llama"], PP2_TP2, devices_per_process=2)
    one_host = runs["llama"][LAYOUTS["llama"].index(PP2_TP2)]
    assert result["tokens"] == one_host["tokens"]
    assert result["logprobs"] == one_host["logprobs"]


def test_update_weights_on_stages_equals_a_fresh_engine_on_the_new_weights(research_run, micro_batch_runs):
    """PP=2 on one process takes every tensor of another checkpoint: its tokens and logprobs are then a
    fresh PP=2 engine's on that checkpoint, bit for bit, with nothing compiled by the update or the steps
    after it; `update_weights_from_path` brings the first checkpoint's numbers back."""
    run = research_run
    assert run["executor"] == "PipelineExecutor"
    assert run["before"] == {k: micro_batch_runs[1][k] for k in ("tokens", "logprobs")}  # the same engine
    assert run["after"]["tokens"] != run["before"]["tokens"]
    assert run["after"] == run["fresh"]  # every token id and logprob, exactly
    assert run["update_compiles"] == 0
    assert run["back"] == run["before"]


def test_a_weight_goes_to_the_stage_holding_it(research_run):
    """Stages of layers 0-1 and 2-3: layer 3's q_proj is the last stage's stack's layer 1, the embedding
    stage 0's, the final norm the last stage's; no other stage or layer changes."""
    touched = research_run["touched"]
    q_proj = "['layers']['self_attn']['q_proj']['kernel']"
    assert [list(stage) for stage in touched["model.layers.3.self_attn.q_proj.weight"]] == [[], [q_proj]]
    assert next(iter(touched["model.layers.3.self_attn.q_proj.weight"][1].values())) == [1]
    assert research_run["layer_3_q_is_new"]
    assert [list(stage) for stage in touched["model.embed_tokens.weight"]] == [
        ["['embed_tokens']['weight']"],
        [],
    ]
    assert [list(stage) for stage in touched["model.norm.weight"]] == [[], ["['norm']['weight']"]]


def test_a_refused_update_names_the_weight_and_changes_no_stage(research_run):
    """A wrong shape on the last stage's norm, or an unknown name, beside a good tensor of stage 0: a
    ValueError naming the weight (and both shapes), and neither stage changes."""
    refused = research_run["refused"]
    assert refused["model.norm.weight"] is not None
    assert "'model.norm.weight' has shape (65,), the model's is (64,)" in refused["model.norm.weight"]
    assert "model.layers.3.self_attn.not_a_weight" in refused["model.layers.3.self_attn.not_a_weight"]
    assert research_run["changed_by_refused"] == [{}, {}]


def test_sleep_frees_every_stage_and_wake_up_restores_the_outputs(research_run):
    """Level 1 frees both stages' KV caches, level 2 their weights too (kept on the host); after each
    wake_up the answers are those before the sleep."""
    level_1, level_2 = research_run["sleep"]
    for level in (level_1, level_2):
        assert level["freed"] == level["placed"] == level["expected"]
        assert level["numbers"] == research_run["after"]
    assert (level_1["weights_deleted"], level_2["weights_deleted"]) == (False, True)
    assert level_2["freed"] > level_1["freed"]


def test_lora_on_stages_is_bitwise_one_device(lora_runs):
    """PP=2 with LoRA gives PP=1's tokens and logprobs bit for bit: two adapters and the base model in one
    batch, then a third adapter written at run time into the slot of one no request uses any more (on
    every stage). Each stage holds the slots of its own layers on its own device, and nothing compiles
    after the PP=2 engine's warm-up."""
    one, staged = lora_runs
    assert (one["layout"], staged["layout"]) == (PP1, PP2)
    for run in ("first", "swapped"):
        assert staged[run]["tokens"] == one[run]["tokens"]
        assert staged[run]["logprobs"] == one[run]["logprobs"]  # every float, exactly
    first, swapped = one["first"], one["swapped"]
    # Prompts 0 and 1 change adapter between the runs (1 -> 3, 2 -> 1), and their outputs with it;
    # prompt 2 is the base model's both times.
    assert first["tokens"][0] != swapped["tokens"][0] and first["tokens"][1] != swapped["tokens"][1]
    assert (first["tokens"][2], first["logprobs"][2]) == (swapped["tokens"][2], swapped["logprobs"][2])
    assert one["num_loads"] == staged["num_loads"] == 3  # two slots: the third adapter took one
    assert staged["compiles_after_warm_up"] == 0
    # [L, in, S, r] A stacks: PP=1's 4 layers on device 0; PP=2's stages 2 layers each, on devices 0, 1.
    (whole,) = one["slots"]
    assert [shape[0] for shape, _ in whole.values()] == [4] * len(whole)
    assert {tuple(devices) for _, devices in whole.values()} == {(0,)}
    for index, stage in enumerate(staged["slots"]):
        assert set(stage) == set(whole)
        for module, (shape, devices) in stage.items():
            assert shape == [2, *whole[module][0][1:]]
            assert devices == [index]


# Qwen3-VL (M-RoPE positions and DeepStack rows crossing the stage boundary) and Gemma 3 (its images'
# bidirectional attention, sliding windows): LLaVA's plain merge and Qwen2.5-VL's M-RoPE, once here too,
# ride the same stage path (~45 s of the suite's CPU for nothing more).
@pytest.mark.parametrize("model", ["qwen3_vl", "gemma3"])
def test_vision_language_models_on_stages_are_bitwise_one_device(image_runs, model):
    """The images are encoded once each, on the first stage's device (where PP=1's are, the only stage
    holding the encoder's weights), and the three requests' tokens and logprobs are PP=1's; the guarded
    engine compiled nothing after warm-up."""
    one, staged = image_runs[model]
    assert (one["layout"], staged["layout"]) == (PP1, PP2)
    assert one["num_encoded"] == staged["num_encoded"] == 3
    assert one["cache_devices"] == staged["cache_devices"] == [0]
    # The tower and projector on the first stage only, whole.
    (whole,), (first, second) = one["encoder_weights"], staged["encoder_weights"]
    assert (first, second) == (whole, 0) and whole > 0
    assert staged["tokens"] == one["tokens"]
    assert staged["logprobs"] == one["logprobs"]  # every float, exactly
    assert len({tuple(t) for t in one["tokens"]}) == 3  # the prompts differ in output
    if model in VLM_GUARDED:
        assert staged["compiles_after_warm_up"] == 0


@pytest.mark.parametrize("model", ["llama", "qwen3_vl"])
def test_preempted_requests_on_stages_are_bitwise_the_unpreempted_ones(preemption_runs, model):
    """bfloat16: requests preempted and recomputed (their companions in each step change with it; Qwen3-VL's
    image requests recompute their M-RoPE positions and DeepStack rows) give the bits of the run without
    preemption, on PP=1, on PP=2 and on PP=2 with two micro-batches in flight; no block leaks."""
    one, staged = preemption_runs[model]
    assert (one["layout"], staged["layout"]) == (PP1, PP2)
    roomy = one["roomy"]
    assert roomy["preemptions"] == staged["roomy"]["preemptions"] == [0, 0, 0]
    assert len({tuple(t) for t in roomy["tokens"]}) == 3  # the prompts differ in output
    assert staged["roomy"]["tokens"] == roomy["tokens"]
    assert staged["roomy"]["logprobs"] == roomy["logprobs"]
    for run in (one["tight"], staged["tight"], staged["tight_micro_batches"]):
        assert run["preemptions"][1] > 0 and sum(run["preemptions"]) >= 2  # Qwen3-VL's [1]: two images
        assert run["free_blocks_after"] == PREEMPTION_FREE_BLOCKS  # every block came back
        assert run["tokens"] == roomy["tokens"]
        assert run["logprobs"] == roomy["logprobs"]  # every float, exactly
    assert staged["tight_micro_batches"]["peak_steps_in_flight"] == 2


def test_preempted_float32_requests_are_bitwise_the_unpreempted_ones(float32_preemption_runs):
    """float32 (`batch_invariant_float32`): the preempted and recomputed requests decode beside other
    companions than without preemption, and still give its bits (without float32's dots padded, a logprob
    moves by an ulp, 4.8e-7)."""
    (one,) = float32_preemption_runs["llama"]
    roomy, tight = one["roomy"], one["tight"]
    assert roomy["preemptions"] == [0, 0, 0]
    assert len({tuple(t) for t in roomy["tokens"]}) == 3
    assert tight["preemptions"][1] > 0 and sum(tight["preemptions"]) >= 2
    assert tight["free_blocks_after"] == PREEMPTION_FREE_BLOCKS
    assert tight["tokens"] == roomy["tokens"]
    assert tight["logprobs"] == roomy["logprobs"]  # every float, exactly


def test_pooling_on_stages_is_bitwise_one_device(tp_worker, models):
    """runner='pooling' on PP=2 (the pooler reads the last stage's hidden states, as it reads one
    device's): LAST embeddings of prompts prefilled in chunks, two micro-batches in flight, and one
    prompt's token embeddings (every row, as MEAN pooling reads them) are PP=1's bits (bfloat16)."""
    prompts = [
        [5, 17, 33, 4, 60, 8, 21, 90, 13, 200, 9, 31, 250, 2, 44, 120, 7, 3],
        [99, 64, 12],
        [7] * 9,
        [42],
    ]
    one, two = tp_worker.run("pipeline_pooling", models["llama"], {"layouts": [PP1, PP2], "prompts": prompts})
    assert two == one
    assert len(one["token_embed"]) == len(prompts[0]) and len(one["LAST"]) == 4
    assert one["token_embed"][-1] != one["token_embed"][0]


def test_ngram_speculation_on_stages_is_bitwise_one_device(tp_worker, models):
    """N-gram speculation on PP=2 (drafts from the host, verified on the last stage as one device's step
    verifies them): PP=1's greedy and seeded sampled outputs with speculation, bit for bit (bfloat16),
    drafts accepted alike (and greedy speculation gives the outputs without it: tests/entrypoints/
    test_spec_decode_llm.py)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    prompts = [([5, 17, 33, 4] * 6)[:n] for n in (24, 13, 9)] + [[7, 8, 9, 7, 8, 9, 7, 8]]
    runs = [[PP1, ngram], [PP2, ngram]]
    one, two = tp_worker.run("pipeline_speculative", models["llama"], {"runs": runs, "prompts": prompts})
    assert two["outputs"] == one["outputs"]
    assert two["accepted"] == one["accepted"] > 0

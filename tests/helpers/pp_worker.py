"""The "pipeline" case of helpers/tp_worker.py (8 fake CPU devices): every pipeline-parallel layout of
tests/sharding/test_pipeline_parallel.py in one call, so its engines share the process's start.

Per model and layout: the greedy ids and every (id, logprob) of the top-2 logprobs of a few token-id
prompts. For one layout per model (`guarded`), the engine is warmed up with the strict compile guard
and reports the compiles after warm-up (none allowed), what each stage holds: its devices, its
layers' weights, its KV cache, and which of the embedding, final norm and LM head it keeps, and how
often its start read each of the checkpoint's tensors."""

import collections
import contextlib
import time

# Every prompt over 4 tokens: its forward runs in token bucket 16, never in 4 (a program fewer a stage).
PROMPTS = [[5, 17, 33, 4, 60, 8, 21, 90, 13], [200, 9, 31, 250, 2], [44, 120, 7, 81, 150]]
# One sequence a step: a prompt's forward in bucket 16, its decode steps in bucket 1, one sampler
# program (the fewest programs per engine); a guarded engine compiles those two buckets only, not 4.
SHAPE = {"max_num_batched_tokens": 16, "max_num_seqs": 1, "cudagraph_capture_sizes": [1, 16]}


def _stage_report(runner) -> list:
    """What each stage holds (placeholders are empty arrays)."""
    import jax

    report = []
    for stage, cache in zip(runner.stages, runner.kv_cache):
        params = stage.model.params
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]

        def sizes(top: str) -> list:
            return [int(x.size) for path, x in leaves if str(getattr(path[0], "key", "")) == top]

        stacked = [x for path, x in leaves if str(getattr(path[0], "key", "")) == "layers"]
        report.append(
            {
                "devices": sorted(d.id for d in stage.model.mesh.devices.flat),
                "num_layers": sorted({int(x.shape[0]) for x in stacked}),
                "layer_devices": sorted({d.id for x in stacked for d in x.devices()}),
                "has_embedding": any(sizes("embed_tokens")),
                "has_norm": any(sizes("norm")),
                "has_lm_head": any(sizes("lm_head")),
                "kv_rows": [int(a.shape[0]) for a in jax.tree.leaves(cache)],
                "num_blocks": runner.num_blocks,
            }
        )
    return report


@contextlib.contextmanager
def _counted_reads():
    """{(file, offset): times read} of the safetensors tensors read inside the block (each stage's
    load reads the tensors of what it holds)."""
    from xlaserve.models.safetensors_loader import CheckpointTensor

    reads = collections.Counter()
    read = CheckpointTensor.read

    def counted(tensor):
        reads[(tensor.path, tensor.offset)] += 1
        return read(tensor)

    CheckpointTensor.read = counted
    try:
        yield reads
    finally:
        CheckpointTensor.read = read


def main(arg: dict, small_llm) -> dict:
    """arg: {"models": {name: directory}, "layouts": {name: [layout, ...]}, "guarded": {name: layout}},
    optionally "shape" (the engines' max_num_batched_tokens and max_num_seqs) and "prompts" (token ids);
    returns {name: [result per layout]}. `small_llm`: tp_worker.py's engine factory."""
    from xlaserve import SamplingParams
    from xlaserve.worker.compile_guard import num_compiles

    prompts = [{"prompt_token_ids": ids} for ids in arg.get("prompts", PROMPTS)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    shape = arg.get("shape", SHAPE)
    results = {}
    for name, model_dir in arg["models"].items():
        results[name] = []
        for layout in arg["layouts"][name]:
            guarded = layout == arg["guarded"].get(name)
            extra = {"enforce_eager": False, "strict_compile_guard": True} if guarded else {}
            t0 = time.perf_counter()
            with _counted_reads() as reads:
                llm = small_llm(model_dir, layout, **shape, **extra)
            if arg.get("micro_batches") and llm.engine_core.executor.max_concurrent_batches > 1:
                # Off by default on a CPU (the fake devices share its cores): on, to check the bits.
                llm.engine_core.set_num_micro_batches(llm.engine_core.executor.max_concurrent_batches)
            compiles = num_compiles()
            outs = llm.generate(prompts, params, use_tqdm=False)
            result = {
                "layout": layout,
                **_numbers_of(outs),
                # The most steps (micro-batches) dispatched and not yet applied at once.
                "peak_steps_in_flight": llm.engine_core.peak_steps_in_flight,
            }
            if guarded:
                runner = llm.engine_core.runner
                result["compiles_after_warm_up"] = num_compiles() - compiles
                result["num_steps"] = runner.num_steps
                result["token_buckets"] = runner.token_buckets
                result["stages"] = _stage_report(runner)
                result["num_layers"] = llm.engine_core.runner.model_config.num_layers
                result["tensor_reads"] = sorted(reads.values())  # each tensor read: how many times
            results[name].append(result)
            result["seconds"] = round(time.perf_counter() - t0, 1)
            del llm
    return results


def _numbers(llm, prompts, params, **kwargs) -> dict:
    return _numbers_of(llm.generate(prompts, params, use_tqdm=False, **kwargs))


def _numbers_of(outs) -> dict:
    """Each request's greedy tokens and, per token, its top logprobs as sorted [id, logprob] pairs."""
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [
            [sorted([i, lp.logprob] for i, lp in d.items()) for d in o.outputs[0].logprobs] for o in outs
        ],
    }


def _stage_arrays(runner) -> list[dict]:
    """Each stage's parameters on the host, by path ("['layers']['mlp']['down_proj']['kernel']")."""
    import jax
    import numpy as np

    return [
        {
            jax.tree_util.keystr(path).removesuffix(".value"): np.asarray(x)
            for path, x in jax.tree_util.tree_leaves_with_path(s.model.params)
        }
        for s in runner.stages
    ]


def _changes(before: list[dict], after: list[dict]) -> list[dict]:
    """Per stage, {parameter path: the indices of its stack's layers that changed ([-1]: unstacked)}."""
    import numpy as np

    changes = []
    for old, new in zip(before, after):
        changed = {}
        for key, value in old.items():
            if not np.array_equal(value, new[key]):
                is_stack = key.startswith("['layers']")
                changed[key] = (
                    [i for i in range(len(value)) if not np.array_equal(value[i], new[key][i])]
                    if is_stack
                    else [-1]
                )
        changes.append(changed)
    return changes


def research(arg: dict, small_llm) -> dict:
    """The research stack on a pipelined engine (`arg["layout"]`, micro-batches on, as the "pipeline"
    case's micro-batch engine: its programs). arg: {"model", "other" (the same shapes, other weights),
    "layout", "shape", "prompts"}. The engine on `model`: its numbers; a refused update (a wrong shape
    on the last stage's norm beside a good stage-0 tensor; an unknown name) and the stages after it;
    which stage and layer each of three single-tensor updates changed; its numbers after `other`'s
    tensors, with the compiles they cost; after sleep/wake_up at levels 1 and 2 (and the bytes each
    reported); after `update_weights_from_path(model)`. Then a fresh engine's on `other`."""
    import jax
    import numpy as np
    from safetensors.numpy import load_file

    from xlaserve import SamplingParams
    from xlaserve.worker.compile_guard import num_compiles

    prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)

    def engine(model_dir):
        llm = small_llm(model_dir, arg["layout"], **arg["shape"])
        llm.engine_core.set_num_micro_batches(llm.engine_core.executor.max_concurrent_batches)
        return llm

    new = load_file(f"{arg['other']}/model.safetensors")
    llm = engine(arg["model"])
    runner = llm.engine_core.runner
    result = {"executor": type(llm.engine_core.executor).__name__, "before": _numbers(llm, prompts, params)}
    start = _stage_arrays(runner)
    good = {"model.layers.0.mlp.down_proj.weight": new["model.layers.0.mlp.down_proj.weight"]}
    refused = {}
    for name, value in [
        ("model.norm.weight", np.ones(new["model.norm.weight"].shape[0] + 1, np.float32)),
        ("model.layers.3.self_attn.not_a_weight", new["model.layers.3.self_attn.q_proj.weight"]),
    ]:
        try:
            llm.update_weights(good | {name: value})
            refused[name] = None
        except ValueError as e:
            refused[name] = str(e)
    result["refused"] = refused
    result["changed_by_refused"] = _changes(start, _stage_arrays(runner))
    result["touched"] = {}
    for name in ["model.layers.3.self_attn.q_proj.weight", "model.embed_tokens.weight", "model.norm.weight"]:
        before = _stage_arrays(runner)
        llm.update_weights({name: new[name]})
        result["touched"][name] = _changes(before, _stage_arrays(runner))
    # The layer-3 update sits at index 1 of the last stage's stack (layers 2-3), as [in, out]; fetched
    # whole (an index would compile a program).
    q = np.asarray(runner.stages[-1].model.params["layers"]["self_attn"]["q_proj"]["kernel"][...])
    result["layer_3_q_is_new"] = bool(np.array_equal(q[1], new["model.layers.3.self_attn.q_proj.weight"].T))
    compiles = num_compiles()
    llm.update_weights(new)
    result["after"] = _numbers(llm, prompts, params)
    result["update_compiles"] = num_compiles() - compiles
    kv_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.kv_cache))
    result["sleep"] = []
    for level in (1, 2):
        asleep = llm.sleep(level)
        is_freed = all(x.is_deleted() for x in jax.tree.leaves([s.model.params for s in runner.stages]))
        awake = llm.wake_up()
        result["sleep"].append(
            {
                "freed": asleep.device_bytes,
                "placed": awake.device_bytes,
                "expected": kv_bytes + (runner.weight_bytes if level == 2 else 0),
                "weights_deleted": is_freed,
                "numbers": _numbers(llm, prompts, params),
            }
        )
    llm.update_weights_from_path(arg["model"])
    result["back"] = _numbers(llm, prompts, params)
    del llm, runner
    result["fresh"] = _numbers(engine(arg["other"]), prompts, params)
    return result


def lora(arg: dict, small_llm) -> list[dict]:
    """LoRA adapters on pipeline stages. arg: {"model", "adapters": [directory, ...] (three), "layouts",
    "guarded" (the layout warmed up under the strict compile guard), "shape", "prompts"}. Per layout,
    with max_loras=2: the greedy numbers of the prompts on [adapter 1, adapter 2, the base model] in one
    batch, then on [adapter 3, adapter 1, the base model] (adapter 3 takes adapter 2's slot); the
    adapters written into slots, the compiles after warm-up (guarded), and each set of slots' A shapes
    and devices (one set per stage)."""
    from xlaserve import LoRARequest, SamplingParams
    from xlaserve.worker.compile_guard import num_compiles

    prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    a1, a2, a3 = (LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(arg["adapters"]))
    lora_args = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    results = []
    for layout in arg["layouts"]:
        guarded = layout == arg["guarded"]
        extra = {"enforce_eager": False, "strict_compile_guard": True} if guarded else {}
        t0 = time.perf_counter()
        llm = small_llm(arg["model"], layout, **arg["shape"], **lora_args, **extra)
        manager = llm.engine_core.runner.lora
        compiles = num_compiles()
        result = {"layout": layout}
        for run, loras in (("first", [a1, a2, None]), ("swapped", [a3, a1, None])):
            result[run] = _numbers(llm, prompts, params, lora_request=loras)
        result["num_loads"] = manager.num_loads
        result["compiles_after_warm_up"] = num_compiles() - compiles if guarded else None
        result["slots"] = [
            {
                module: [list(a.shape), sorted(d.id for d in a.devices())]
                for module, a in stacks["layers"].a.items()
            }
            for stacks in manager.stacks
        ]
        result["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(result)
        del llm, manager
    return results


def images(arg: dict, small_llm) -> dict:
    """Vision-language models on pipeline stages. arg: {"models": {name: directory}, "layouts", "guarded":
    [name, ...] (their last layout warmed up under the strict compile guard), "shape"}. Per model and
    layout: the greedy numbers of helpers/tiny_vlm.py's three prompts (one image, two, text only) in one
    batch, the images encoded, the encoder cache's devices, the encoder's weights each stage holds, the
    compiles after warm-up (guarded)."""
    from tiny_vlm import image_prompts  # beside this file, on sys.path as the script's folder

    from xlaserve import SamplingParams
    from xlaserve.worker.compile_guard import num_compiles

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    results = {}
    for name, model_dir in arg["models"].items():
        results[name] = []
        for layout in arg["layouts"]:
            guarded = name in arg["guarded"] and layout == arg["layouts"][-1]
            extra = {"enforce_eager": False, "strict_compile_guard": True} if guarded else {}
            t0 = time.perf_counter()
            llm = small_llm(model_dir, layout, **arg["shape"], **extra)
            encoder = llm.engine_core.runner.mm_encoder
            compiles = num_compiles()
            result = {"layout": layout, **_numbers(llm, image_prompts(model_dir), params)}
            result["compiles_after_warm_up"] = num_compiles() - compiles if guarded else None
            result["num_encoded"] = encoder.num_encoded
            result["cache_devices"] = sorted(d.id for d in encoder.cache.devices())
            result["encoder_weights"] = _encoder_weights(llm.engine_core.runner)
            result["seconds"] = round(time.perf_counter() - t0, 1)
            results[name].append(result)
            del llm, encoder
    return results


def _encoder_weights(runner) -> list[int]:
    """The number of encoder (tower and projector) weights per stage (one "stage" for PP=1)."""
    import jax

    from xlaserve.models.registry import get_model_class

    modules = get_model_class(runner.model_config.architecture).encoder_modules
    models = [s.model.params for s in runner.stages] if hasattr(runner, "stages") else [runner.params]
    return [
        sum(
            int(x.size)
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if path[0].key in modules
        )
        for params in models
    ]


def preemption(arg: dict, small_llm) -> dict:
    """Preemption on pipeline stages. arg: {"models": {name: directory}, "layouts", "shape", "prompts" (token
    ids; a vision-language model takes helpers/tiny_vlm.py's three image prompts instead), "free_blocks"}.
    Per model and layout, one engine: the greedy numbers of the prompts in one batch with the whole KV
    cache free ("roomy"), then with all but `free_blocks` blocks held aside so that the requests preempt
    each other and recompute ("tight"), and on a PP engine again with its micro-batches in flight
    ("tight_micro_batches"); each run's preemptions per prompt, and the blocks free after it (none
    leaked)."""
    import json
    import os

    from tiny_vlm import image_prompts  # beside this file, on sys.path as the script's folder

    from xlaserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    results = {}
    for name, model_dir in arg["models"].items():
        with open(os.path.join(model_dir, "config.json")) as f:
            is_vlm = "vision_config" in json.load(f)
        prompts = (
            image_prompts(model_dir) if is_vlm else [{"prompt_token_ids": ids} for ids in arg["prompts"]]
        )
        results[name] = []
        for layout in arg["layouts"]:
            t0 = time.perf_counter()
            llm = small_llm(model_dir, layout, **arg["shape"])
            core = llm.engine_core
            preempted = _noting_preemptions(core.scheduler)
            result = {"layout": layout}
            is_staged = layout.get("pipeline_parallel_size", 1) > 1
            for run in ["roomy", "tight"] + (["tight_micro_batches"] if is_staged else []):
                if run == "tight_micro_batches":
                    core.set_num_micro_batches(core.executor.max_concurrent_batches)
                llm.reset_prefix_cache()  # each run computes its prompts (a hit would skip the recompute)
                pool = core.scheduler.kv_cache_manager.block_pool
                num_held = 0 if run == "roomy" else pool.get_num_free_blocks() - arg["free_blocks"]
                held = pool.get_new_blocks(num_held)
                preempted.clear()
                outs = llm.generate(prompts, params, use_tqdm=False)
                result[run] = {
                    **_numbers_of(outs),
                    "preemptions": [preempted.count(o.request_id) for o in outs],
                    "free_blocks_after": pool.get_num_free_blocks(),
                    "peak_steps_in_flight": core.peak_steps_in_flight,
                }
                pool.free_blocks(held)
            result["seconds"] = round(time.perf_counter() - t0, 1)
            results[name].append(result)
            del llm, core
    return results


def hybrid(arg: dict, small_llm) -> dict:
    """Hybrid models (state layers beside attention) on pipeline stages. arg: {"models": {name:
    directory}, "layouts": {name: [layout, ...]}, "guarded": {name: layout}, "micro_batches": {name:
    layout}, "shape", "prompts"}. Per model and layout: the prompts' greedy numbers twice (the second run
    hits the state snapshots the first left: prefix caching), each run's cached tokens, and the most
    steps in flight (the micro-batches layout keeps as many as it has stages). The guarded layout is
    warmed up under the strict compile guard and reports its compiles after warm-up and each stage's
    cache arrays' rows (K, V, conv state, recurrent state); where arg["research"] names the model
    ({"other": the name of another of `models`, of the same shapes, "refusals"}), the research stack
    runs on it after that (`_hybrid_research`)."""
    import jax

    from xlaserve import SamplingParams
    from xlaserve.worker.compile_guard import num_compiles

    prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    results = {}
    for name, model_dir in arg["models"].items():
        results[name] = []
        for layout in arg["layouts"][name]:
            guarded = layout == arg["guarded"].get(name)
            extra = {"enforce_eager": False, "strict_compile_guard": True} if guarded else {}
            t0 = time.perf_counter()
            llm = small_llm(model_dir, layout, **arg["shape"], **extra)
            core = llm.engine_core
            if layout == arg["micro_batches"].get(name):  # off by default on a CPU: on, to check the bits
                core.set_num_micro_batches(core.executor.max_concurrent_batches)
            compiles = num_compiles()
            runs = [_cached_numbers(llm, prompts, params) for _ in range(2)]
            result = {"layout": layout, "runs": runs, "peak_steps_in_flight": core.peak_steps_in_flight}
            if guarded:
                result["compiles_after_warm_up"] = num_compiles() - compiles
            if layout.get("pipeline_parallel_size", 1) > 1:
                runner = core.runner
                result["num_blocks"] = runner.num_blocks
                result["num_state_slots"] = runner.kv_spec.num_state_slots
                result["cache_rows"] = [
                    [int(a.shape[0]) for a in jax.tree.leaves(c)] for c in runner.kv_cache
                ]
                if name in arg.get("research", {}):
                    research = arg["research"][name]
                    other = arg["models"][research["other"]]
                    result["research"] = _hybrid_research(
                        llm, model_dir, other, research["refusals"], prompts
                    )
            result["seconds"] = round(time.perf_counter() - t0, 1)
            results[name].append(result)
            del llm, core
    return results


def _cached_numbers(llm, prompts, params) -> dict:
    """`_numbers` and each prompt's prefix-cache hit."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {**_numbers_of(outs), "num_cached_tokens": [o.num_cached_tokens for o in outs]}


def _hybrid_research(llm, model_dir: str, other: str, refusals: list, prompts) -> dict:
    """The research stack on a hybrid model's pipelined engine: each refused update (a good tensor of one
    stage doubled beside a wrong shape, its last column cut, on another) and what it changed on the stages;
    the numbers after `update_weights_from_path(other)`, twice (the second run hits the snapshots the first
    left); then after sleep/wake_up at levels 1 and 2, with the bytes each reported; and the compiles all
    that cost."""
    import jax
    from safetensors.numpy import load_file

    from xlaserve import SamplingParams
    from xlaserve.worker.compile_guard import num_compiles

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    t0, runner = time.perf_counter(), llm.engine_core.runner
    first = load_file(f"{model_dir}/model.safetensors")
    compiles, start, refused = num_compiles(), _stage_arrays(runner), {}
    for good, bad in refusals:
        try:
            llm.update_weights({good: 2 * first[good], bad: first[bad][..., :-1]})
            refused[bad] = None
        except ValueError as e:
            refused[bad] = str(e)
    result = {"refused": refused, "changed_by_refused": _changes(start, _stage_arrays(runner))}
    result["updated"] = len(llm.update_weights_from_path(other))
    result["after"] = [_cached_numbers(llm, prompts, params) for _ in range(2)]
    kv_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.kv_cache))
    result["sleep"] = []
    for level in (1, 2):
        asleep = llm.sleep(level)
        awake = llm.wake_up()
        result["sleep"].append(
            {
                "freed": asleep.device_bytes,
                "placed": awake.device_bytes,
                "expected": kv_bytes + (runner.weight_bytes if level == 2 else 0),
                "numbers": _cached_numbers(llm, prompts, params),
            }
        )
    result["compiles"] = num_compiles() - compiles
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def _noting_preemptions(scheduler) -> list[str]:
    """The ids of the requests `scheduler` preempts from now on, once per preemption."""
    preempted = []
    schedule = scheduler.schedule

    def schedule_and_note():
        output = schedule()
        preempted.extend(output.preempted_req_ids)
        return output

    scheduler.schedule = schedule_and_note
    return preempted

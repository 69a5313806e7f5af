"""The cases of the fake-mesh tests, served by one long-lived process with 8 fake CPU devices
(helpers/tp_run.py): one JSON request per line on stdin, {"id", "mode", "model_dir", "arg"}, answered
by one line `RESULT <id> {"ok": <result>}` (or {"error": <traceback>}) on the original stdout. With
arguments (`tp_worker.py MODE MODEL_DIR ARG_JSON`), it runs that one case and prints its line."""

import gc
import json
import os
import sys
import time
import traceback

# Tiny models on 8 fake devices, compiled at XLA's backend optimization level 0: the cases' CPU fell
# 661 -> 432 s (helpers/tiny_models.FAST_COMPILE_XLA_FLAGS says why; set here before jax imports).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
# Rarer cyclic collections over a large heap (tests/conftest.py says why). Each case ends with a full
# collection (answer()). tiny_models (beside this file, on sys.path as the script's folder) imports numpy.
from tiny_models import (  # noqa: E402
    GC_THRESHOLDS,
    compile_with_elemental_emitters_when,
    warm_up_what_the_cases_run,
)

gc.set_threshold(*GC_THRESHOLDS)


def hlo(model_dir: str, layout: dict) -> list:
    """The collectives of the compiled forward of one bucket: 32, which the cases' prefills of more than
    16 tokens run, so that after a `generate` case on the same model and layout (small_llm's settings)
    the program loads from the persistent compilation cache instead of compiling."""
    import re

    llm = small_llm(model_dir, layout)
    text = llm.engine_core.runner.compiled_forward_text(32)
    ops = re.findall(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(", text)
    return [[shape, op] for shape, op in ops]


def kernel_operands(_model_dir: str, tp: int) -> dict:
    """The operand shapes of the Pallas kernel's Triton custom call, lowered for CUDA on a
    tensor-parallel mesh, without and with the shard_map over KV heads."""
    import functools
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from xlaserve.kernels import ragged_paged_attention as pallas
    from xlaserve.kernels import reference
    from xlaserve.kernels.backend import AttentionBackend
    from xlaserve.kernels.synthetic import StepShape, synthetic_step
    from xlaserve.sharding import make_mesh
    from xlaserve.sharding.attention import shard_attention_over_kv_heads
    from xlaserve.sharding.rules import KV_CACHE_AXES, logical_to_mesh, to_partition_spec

    mesh = make_mesh(tp)
    rules = logical_to_mesh(False)
    shape = StepShape(
        seqs=((37, 1), (16, 16)),
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=64,
        num_tokens=32,
        num_padded_seqs=4,
        dtype="bfloat16",
    )
    specs = [to_partition_spec((None, "q_heads", None), rules)] + [
        to_partition_spec(KV_CACHE_AXES, rules)
    ] * 2
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(synthetic_step(shape, 0), specs)]
    args += synthetic_step(shape, 0)[3:]
    kernel = functools.partial(pallas.ragged_paged_attention, interpret=False)
    plain = AttentionBackend("pallas", kernel, reference.write_kv, "test")
    result = {}
    for name, backend in (("plain", plain), ("sharded", shard_attention_over_kv_heads(plain, mesh))):
        # A traced window, as under the layer scan (Gemma's alternating layers).
        fn = jax.jit(
            lambda *a, attention=backend.attention: attention(*a[:-1], sm_scale=0.125, sliding_window=a[-1])
        )
        text = fn.trace(*args, jnp.int32(100)).lower(lowering_platforms=("cuda",)).as_text()
        calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
        result[name] = [re.findall(r"tensor<([0-9x]+)xbf16>", call) for call in calls]
    return result


def param_shards(model_dir: str, layout: dict) -> dict:
    """Each parameter's global and per-device shapes."""
    import jax

    from xlaserve import LLM

    llm = LLM(
        model_dir, dtype="float32", max_model_len=128, enforce_eager=True, kv_cache_memory=2**23, **layout
    )
    flat = jax.tree_util.tree_flatten_with_path(llm.engine_core.runner.params)[0]
    shapes = {
        "/".join(str(k.key) for k in path if getattr(k, "key", ".value") != ".value"): [
            list(x.shape),
            list(x.addressable_shards[0].data.shape),
        ]
        for path, x in flat
    }
    return shapes


def error(model_dir: str, layout: dict) -> str:
    """The ValueError that loading under the layout raises."""
    from xlaserve import LLM

    try:
        LLM(
            model_dir, dtype="float32", max_model_len=128, enforce_eager=True, kv_cache_memory=2**23, **layout
        )
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{layout} loaded")


def missing_rule(model_dir: str, arg: dict) -> list:
    """Load under each layout with one sharding rule removed: the errors (or "loaded"). The rule is put
    back afterwards (the rules are read at each load), so the cases after this one see them all."""
    from xlaserve import LLM
    from xlaserve.sharding import rules

    key = tuple(arg["drop"])
    dropped = rules.PARAM_AXES.pop(key)
    results = []
    try:
        for layout in arg["layouts"]:
            try:
                LLM(
                    model_dir,
                    dtype="float32",
                    max_model_len=128,
                    enforce_eager=True,
                    kv_cache_memory=2**23,
                    **layout,
                )
                results.append("loaded")
            except ValueError as e:
                results.append(str(e))
    finally:
        rules.PARAM_AXES[key] = dropped
    return results


def fused_shards(model_dir: str, layouts: list[dict]) -> list:
    """Per layout and device, the shape of its shard of Phi-3's qkv_proj and gate_up_proj kernels, and whether
    it holds exactly the checkpoint rows of its own heads (q of its query heads, k and v of its KV
    heads) and of its own MLP columns (gate and up), computed here from the HF tensors."""
    import numpy as np
    from safetensors.numpy import load_file

    from xlaserve import LLM

    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    num_layers, num_heads, num_kv = (
        hf["num_hidden_layers"],
        hf["num_attention_heads"],
        hf["num_key_value_heads"],
    )
    hd, ffn = hf["head_dim"], hf["intermediate_size"]

    def expected_qkv(rank: int, tp: int) -> np.ndarray:  # [L, D, columns of this rank]
        kv_heads = max(num_kv, tp)  # KV heads repeated up to tp (sharding/kv_heads.py)
        q_per_kv = num_heads // kv_heads
        layers = []
        for i in range(num_layers):
            w = tensors[f"model.layers.{i}.self_attn.qkv_proj.weight"]  # [(H + 2K) * hd, D]
            rows = []
            for kv in range(rank * kv_heads // tp, (rank + 1) * kv_heads // tp):
                source = kv * num_kv // kv_heads  # the checkpoint's KV head this one copies
                for h in range(kv * q_per_kv, (kv + 1) * q_per_kv):
                    rows.append(w[h * hd : (h + 1) * hd])
                rows.append(w[(num_heads + source) * hd : (num_heads + source + 1) * hd])
                rows.append(w[(num_heads + num_kv + source) * hd : (num_heads + num_kv + source + 1) * hd])
            layers.append(np.concatenate(rows).T)
        return np.stack(layers)

    def expected_gate_up(rank: int, tp: int) -> np.ndarray:
        layers = []
        for i in range(num_layers):
            w = tensors[f"model.layers.{i}.mlp.gate_up_proj.weight"]  # [2F, D]: gate, then up
            rows = [w[j] for f in range(rank * ffn // tp, (rank + 1) * ffn // tp) for j in (f, ffn + f)]
            layers.append(np.stack(rows).T)
        return np.stack(layers)

    results = []
    for layout in layouts:
        tp = layout["tensor_parallel_size"]
        llm = LLM(
            model_dir, dtype="float32", max_model_len=128, enforce_eager=True, kv_cache_memory=2**23, **layout
        )
        params = llm.engine_core.runner.params["layers"]
        result = {}
        for name, kernel, expected in (
            ("qkv_proj", params["self_attn"]["qkv_proj"]["kernel"], expected_qkv),
            ("gate_up_proj", params["mlp"]["gate_up_proj"]["kernel"], expected_gate_up),
        ):
            kernel = kernel[...]
            width = kernel.shape[-1] // tp
            result[name] = []
            for shard in sorted(kernel.addressable_shards, key=lambda s: s.index[-1].start or 0):
                rank = (shard.index[-1].start or 0) // width
                data = np.asarray(shard.data)
                holds = data.shape == expected(rank, tp).shape and np.array_equal(data, expected(rank, tp))
                result[name].append({"rank": rank, "shape": list(data.shape), "holds_its_heads": bool(holds)})
        results.append(result)
        del llm
    return results


def small_llm(model_dir: str, layout: dict, **overrides):
    """The cases' engine on `layout`: float32, short sequences, few buckets, compiled only as used."""
    from xlaserve import LLM

    args = {
        "dtype": "float32",
        "max_model_len": 128,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 4,
        "kv_cache_memory": 2**23,
        "enforce_eager": True,  # compile only the buckets the case's short run uses
    }
    return LLM(model_dir, **{**args, **overrides, **layout})


def generate_ids(model_dir: str, arg: dict) -> list:
    """Generate from token-id prompts under each layout, once per sampling-parameter set: the tokens,
    every (id, logprob) of the sampled logprobs, and every id of the prompt logprobs.
    arg: {"layouts", "prompts", "params": [SamplingParams kwargs, ...]}."""
    from xlaserve import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
    results = []
    for layout in arg["layouts"]:
        llm = small_llm(model_dir, layout)
        runs = []
        for kwargs in arg["params"]:
            params = SamplingParams(**kwargs)
            outs = llm.generate(prompts, params, use_tqdm=False)
            run = {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "num_cached_tokens": [o.num_cached_tokens for o in outs],
            }
            if params.logprobs is not None:
                run["logprobs"] = [
                    [sorted([i, lp.logprob] for i, lp in d.items()) for d in o.outputs[0].logprobs]
                    for o in outs
                ]
            if params.prompt_logprobs is not None:
                run["prompt_logprob_ids"] = sorted(
                    {i for o in outs for d in o.prompt_logprobs if d is not None for i in d}
                )
            runs.append(run)
        try:  # an id past the real vocabulary (a padding id under TP) is no valid prompt
            llm.generate({"prompt_token_ids": [3, llm.input_processor.vocab_size]}, use_tqdm=False)
            refused = "accepted"
        except ValueError as e:
            refused = str(e)
        results.append({"layout": layout, "runs": runs, "out_of_vocab_prompt": refused})
        del llm
    return results


def speculative(model_dir: str, arg: dict) -> list:
    """Greedy tokens from token-id prompts under each layout (a layout may carry a speculative_config;
    a draft "model" of "self" is the target itself), with the speculative counters.
    arg: {"layouts", "prompts", "max_tokens"}."""
    from xlaserve import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=arg["max_tokens"], ignore_eos=True)
    results = []
    for layout in arg["layouts"]:
        spec = layout.get("speculative_config")
        if spec is not None and spec.get("model") == "self":
            layout = {**layout, "speculative_config": {**spec, "model": model_dir}}
        llm = small_llm(model_dir, layout, max_num_batched_tokens=16, kv_cache_memory=2**22)
        outs = llm.generate(prompts, params, use_tqdm=False)
        metrics = {
            m.name.removeprefix("xlaserve:spec_decode_"): m.value
            for m in llm.get_metrics()
            if m.name.startswith("xlaserve:spec_decode_") and not m.labels
        }
        results.append(
            {
                "layout": layout,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "metrics": metrics,
                "num_devices": int(llm.engine_core.runner.mesh.devices.size),
            }
        )
        del llm
    return results


def generate(model_dir: str, layouts: list[dict]) -> list:
    """Greedy tokens and top logprobs of four text prompts under each layout."""
    from xlaserve import SamplingParams

    prompts = ["The capital of France is", "def f(x):", "One two three four five six seven", "Hi"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    return _greedy_under_layouts(lambda layout: small_llm(model_dir, layout), layouts, prompts, params)


def _greedy_under_layouts(make_llm, layouts: list[dict], prompts, params) -> list:
    """Each layout's engine (`make_llm(layout)`, one at a time): its tokens and top logprobs."""
    results = []
    for layout in layouts:
        llm = make_llm(layout)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            {
                "layout": layout,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [
                    [max(lp.logprob for lp in d.values()) for d in o.outputs[0].logprobs] for o in outs
                ],
            }
        )
        del llm
    return results


def generate_images(model_dir: str, layouts: list[dict]) -> list:
    """A tiny LLaVA's (Gemma 3's, Qwen2.5-VL's) greedy tokens and sampled logprobs for prompts with images
    (one, two, none), under each layout: the vision tower and projector run in the encoder's program on
    the layout's mesh."""
    from tiny_vlm import ENGINE_ARGS, image_prompts  # beside this file, on sys.path as the script's folder

    from xlaserve import LLM, SamplingParams

    prompts = image_prompts(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    # Only the programs these requests run (the module's engines warm up every bucket).
    args = {**ENGINE_ARGS, "strict_compile_guard": False, "enforce_eager": True, "kv_cache_memory": 24 * 8192}
    return _greedy_under_layouts(lambda layout: LLM(model_dir, **args, **layout), layouts, prompts, params)


def update_weights(model_dir: str, arg: dict) -> dict:
    """arg: {"other_dir", "layout"[, "prompts"]}: an engine on `model_dir` under `layout` takes
    `other_dir`'s tensors by `update_weights` (KV heads repeated, vocabulary padded, shards placed as a
    load would): its greedy ids, before and after, and a fresh engine's on `other_dir`."""
    from safetensors.numpy import load_file

    from xlaserve import LLM, SamplingParams
    from xlaserve.worker.compile_guard import num_compiles

    ids_of = arg.get("prompts", [[5, 17, 33, 4, 60, 8, 21], [200, 9, 31, 250, 2]])
    prompts = [{"prompt_token_ids": p} for p in ids_of]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    args = dict(
        dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2, enforce_eager=True
    )
    args |= dict(kv_cache_memory=2**23, **arg["layout"])

    def ids(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    llm = LLM(model_dir, **args)
    before = ids(llm)
    compiles = num_compiles()
    llm.update_weights(load_file(f"{arg['other_dir']}/model.safetensors"))
    after = ids(llm)
    recompiled = num_compiles() - compiles
    del llm
    return {
        "before": before,
        "after": after,
        "fresh": ids(LLM(arg["other_dir"], **args)),
        "compiles": recompiled,
    }


def update_weights_on_mesh(model_dir: str, arg: dict) -> dict:
    """arg: {"other_dir", "num_devices"}: the engine shares a trainer's ("fsdp",) mesh of num_devices
    (`LLM(mesh=...)`), and takes `other_dir`'s tensors as the trainer holds them, sharded over that
    mesh, device to device: no transfer to the host is allowed during the update."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from safetensors.numpy import load_file

    from xlaserve import LLM, SamplingParams

    mesh = Mesh(np.array(jax.devices()[: arg["num_devices"]]), ("fsdp",))
    args = dict(
        dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2, enforce_eager=True
    )
    args |= dict(kv_cache_memory=2**23)
    prompts = ["The capital of France is", "def f(x):"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def ids(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    def on_mesh(array):
        spec = PartitionSpec("fsdp") if array.shape[0] % mesh.size == 0 else PartitionSpec()
        return jax.device_put(array, NamedSharding(mesh, spec))

    trainer = {name: on_mesh(a) for name, a in load_file(f"{arg['other_dir']}/model.safetensors").items()}
    llm = LLM(model_dir, mesh=mesh, **args)
    runner = llm.engine_core.runner
    devices = sorted(d.id for d in runner.mesh.devices.flat)
    before = ids(llm)
    with jax.transfer_guard_device_to_host("disallow"):
        llm.update_weights(trainer)
    after = ids(llm)
    del llm
    fresh = ids(LLM(arg["other_dir"], tensor_parallel_size=arg["num_devices"], **args))
    return {"before": before, "after": after, "fresh": fresh, "devices": devices}


def lora(model_dir: str, arg: dict) -> list:
    """arg: {"adapter_dir", "sizes"}: see helpers/lora_tp_worker.py."""
    from lora_tp_worker import main as lora_main  # beside this file, on sys.path as the script's folder

    return lora_main(model_dir, arg["adapter_dir"], arg["sizes"])


def data_parallel(model_dir: str, layouts: list[dict]) -> list:
    """See helpers/dp_tp_worker.py."""
    from dp_tp_worker import main as dp_main  # beside this file, on sys.path as the script's folder

    return dp_main(model_dir, layouts, small_llm)


def context_parallel(model_dir: str, arg: dict) -> list:
    """arg: {"layouts", "prompts"[, "guarded": layout]}: per layout, the greedy tokens and top logprobs
    of the prompts, run twice (the second run hits the prefix cache's blocks), the engine's KV blocks,
    one device's shard of the K cache, and the compiled forward's (16-token bucket) collectives and dots'
    row counts. The `guarded` layout's engine is warmed up under the strict compile guard: the programs
    it compiles after warm-up are counted."""
    import re

    import jax

    from xlaserve import SamplingParams
    from xlaserve.worker.compile_guard import num_compiles

    prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    results = []
    for layout in arg["layouts"]:
        guarded = layout == arg.get("guarded")
        warm = {"enforce_eager": False, "strict_compile_guard": True} if guarded else {}
        # 16 tokens a step: the prompts prefill in chunks, in the bucket whose HLO is read below (at
        # small_llm's 32, each layout compiled a 32-token forward too).
        llm = small_llm(model_dir, layout, max_num_batched_tokens=16, **warm)
        compiles = num_compiles()
        runs = []
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append(
                {
                    "tokens": [list(o.outputs[0].token_ids) for o in outs],
                    "logprobs": [
                        [max(lp.logprob for lp in d.values()) for d in o.outputs[0].logprobs] for o in outs
                    ],
                    "num_cached_tokens": [o.num_cached_tokens for o in outs],
                }
            )
        compiles_after_warm_up = num_compiles() - compiles if guarded else None
        runner = llm.engine_core.runner
        hlo_text = runner.compiled_forward_text(16)
        results.append(
            {
                "layout": layout,
                "runs": runs,
                "num_blocks": runner.num_blocks,
                # One device's shard of the K cache (of the latent cache, for latent attention).
                "k_shard": list(
                    jax.tree_util.tree_leaves(runner.kv_cache)[0].addressable_shards[0].data.shape
                ),
                "k_dtype": str(jax.tree_util.tree_leaves(runner.kv_cache)[0].dtype),
                "collectives": {op: hlo_text.count(f" {op}(") for op in ("all-gather", "all-reduce")},
                "dot_rows": sorted(
                    {int(rows) for rows in re.findall(r"= f32\[(\d+),[^=]*? dot\(", hlo_text)}
                ),
                "compiles_after_warm_up": compiles_after_warm_up,
            }
        )
        del llm
    return results


def context_parallel_offload(model_dir: str, arg: dict) -> list:
    """arg: {"layouts", "prompts"}: per layout, an engine with a host tier (kv_offloading_size) and a
    device cache of 11 usable blocks of 8 tokens runs the prompts one at a time, then the first again
    (the others evicted its blocks from the device): each run's greedy tokens, top logprobs and
    num_cached_tokens, the offload's metrics, and whether every block is free after."""
    from xlaserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    tight = {"max_model_len": 64, "max_num_seqs": 2, "max_num_batched_tokens": 16, "block_size": 8}
    results = []
    for layout in arg["layouts"]:
        llm = small_llm(model_dir, layout, **tight, num_gpu_blocks_override=12, kv_offloading_size=2**-10)
        runs = []
        for ids in [*arg["prompts"], arg["prompts"][0]]:
            (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            runs.append(
                {
                    "tokens": list(out.outputs[0].token_ids),
                    "logprobs": [max(lp.logprob for lp in d.values()) for d in out.outputs[0].logprobs],
                    "num_cached_tokens": out.num_cached_tokens,
                }
            )
        llm._step()  # records the engine's stats into its metrics
        metrics = {(m.name, *m.labels.values()): getattr(m, "value", None) for m in llm.get_metrics()}
        manager = llm.engine_core.kv_cache_manager
        results.append(
            {
                "layout": layout,
                "runs": runs,
                "bytes_per_block": llm.engine_core.runner.kv_bytes_per_block(),
                "host_hits": metrics[("xlaserve:external_prefix_cache_hits",)],
                "loaded_bytes": metrics[("xlaserve:kv_offload_total_bytes", "host_to_device")],
                "all_free": not manager.req_to_blocks
                and manager.num_free_blocks == manager.num_usable_blocks,
            }
        )
        llm.shutdown()
    return results


def transfer_across_layouts(model_dir: str, arg: dict) -> dict:
    """arg: {"layouts": [A, B, ...], "prompts", "chain" (optional)}: an engine of role kv_both per layout;
    A's own greedy run (the reference), then along `chain` (indices of the engines; by default each once,
    in order) each engine's blocks prefilled for the next to decode from, its prefix cache reset first (so
    an engine coming back in the chain fetches every block too). -> the reference's and each consumer's
    tokens, top logprobs and num_cached_tokens, its fetches by outcome and bytes fetched, whether its
    blocks are all free after (on every data-parallel rank) and its producer holds no copy (on any), the
    port each prompt's kv_transfer_params named less its producer's kv_port, and each engine's bytes per
    moved block."""
    import socket

    from xlaserve import SamplingParams

    def free_ports(num: int) -> int:
        """The first of `num` consecutive free ports (a producer's data-parallel ranks serve on each)."""
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                first = s.getsockname()[1]
            try:
                for port in range(first, first + num):
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", port))
                return first
            except OSError:
                continue

    def ranks(llm) -> list:
        return getattr(llm.engine_core, "ranks", [llm.engine_core])

    def numbers(outs) -> dict:
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[max(lp.logprob for lp in d.values()) for d in o.outputs[0].logprobs] for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
        }

    prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
    decode = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 1}
    engines = []
    for layout in arg["layouts"]:
        role = {
            "kv_connector": "JaxConnector",
            "kv_role": "kv_both",
            "kv_ip": "127.0.0.1",
            "kv_port": free_ports(layout.get("data_parallel_size", 1)),
        }
        engines.append(small_llm(model_dir, layout, block_size=8, kv_transfer_config=role))
    result = {
        "reference": numbers(engines[0].generate(prompts, SamplingParams(**decode), use_tqdm=False)),
        "bytes_per_block": [llm.engine_core.executor.kv_bytes_per_block for llm in engines],
        "consumers": [],
    }
    chain = [engines[i] for i in arg.get("chain", range(len(engines)))]
    for producer, consumer in zip(chain, chain[1:]):
        consumer.reset_prefix_cache()
        prefill = SamplingParams(
            temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
        )
        handed = [o.kv_transfer_params for o in producer.generate(prompts, prefill, use_tqdm=False)]
        params = [SamplingParams(**decode, extra_args={"kv_transfer_params": p}) for p in handed]
        got = numbers(consumer.generate(prompts, params, use_tqdm=False))
        kv_port = producer.config.cache.kv_transfer.kv_port
        got["port_offsets"] = [p["remote_port"] - kv_port for p in handed]
        consumer._step()  # records the engine's stats into its metrics
        metrics = {(m.name, *m.labels.values()): getattr(m, "value", None) for m in consumer.get_metrics()}
        got["fetches"] = {o: metrics[("xlaserve:kv_transfer_fetches", o)] for o in ("loaded", "recomputed")}
        got["bytes_fetched"] = metrics[("xlaserve:kv_transfer_total_bytes", "fetched")]
        got["all_free"] = all(
            not r.kv_cache_manager.req_to_blocks
            and r.kv_cache_manager.num_free_blocks == r.kv_cache_manager.num_usable_blocks
            for r in ranks(consumer)
        )
        got["copies_held"] = sum(len(r.runner.kv_connector.server) for r in ranks(producer))
        result["consumers"].append(got)
    for llm in engines:
        llm.shutdown()
    return result


def transfer_across_stages(model_dir: str, arg: dict) -> dict:
    """`transfer_across_layouts`, compiled as the pipeline's cases are (DEFAULT_EMITTER_MODES), so that
    an engine on stages gives one device's bits."""
    return transfer_across_layouts(model_dir, arg)


def pipeline_pooling(model_dir: str, arg: dict) -> list:
    """arg: {"layouts", "prompts"}: per layout, a bfloat16 pooling engine's LAST embeddings of the prompts
    (all at once: chunked, in micro-batches on stages) and its token embeddings (every row's hidden state,
    as MEAN pooling reads them) of the first."""
    from xlaserve.pooling_params import PoolingParams

    prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
    results = []
    for layout in arg["layouts"]:
        llm = small_llm(model_dir, layout, runner="pooling", dtype="bfloat16", max_num_batched_tokens=16)
        outs = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
        tokens = llm.encode(prompts[:1], pooling_task="token_embed", use_tqdm=False)[0].outputs.data
        results.append(
            {
                "LAST": [[float(v) for v in o.outputs.embedding] for o in outs],
                "token_embed": [[float(v) for v in row] for row in tokens],
            }
        )
        llm.shutdown()
    return results


def pipeline_speculative(model_dir: str, arg: dict) -> list:
    """arg: {"runs": [[layout, speculative_config or None], ...], "prompts"}: per run, a bfloat16 engine's
    greedy and seeded sampled outputs (token ids, each token's logprob) of the prompts, all at once, and
    its speculation metrics."""
    from xlaserve import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    sampled = SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True, logprobs=1)
    results = []
    for layout, spec in arg["runs"]:
        llm = small_llm(
            model_dir, layout, dtype="bfloat16", max_num_batched_tokens=16, speculative_config=spec
        )
        outs = llm.generate(prompts * 2, [greedy] * len(prompts) + [sampled] * len(prompts), use_tqdm=False)
        metrics = {(m.name, *m.labels.values()): getattr(m, "value", None) for m in llm.get_metrics()}
        results.append(
            {
                "outputs": [
                    [
                        list(o.outputs[0].token_ids),
                        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                    ]
                    for o in outs
                ],
                "accepted": metrics.get(("xlaserve:spec_decode_num_accepted_tokens",), 0),
            }
        )
        llm.shutdown()
    return results


def pipeline(_model_dir: str, arg: dict) -> dict:
    """See helpers/pp_worker.py."""
    from pp_worker import main as pp_main  # beside this file, on sys.path as the script's folder

    return pp_main(arg, small_llm)


def pipeline_research(_model_dir: str, arg: dict) -> dict:
    """See helpers/pp_worker.py `research`."""
    from pp_worker import research

    return research(arg, small_llm)


def pipeline_images(_model_dir: str, arg: dict) -> dict:
    """See helpers/pp_worker.py `images`."""
    from pp_worker import images

    return images(arg, small_llm)


def pipeline_preemption(_model_dir: str, arg: dict) -> dict:
    """See helpers/pp_worker.py `preemption`."""
    from pp_worker import preemption

    return preemption(arg, small_llm)


def pipeline_lora(_model_dir: str, arg: dict) -> list:
    """See helpers/pp_worker.py `lora`."""
    from pp_worker import lora as pp_lora

    return pp_lora(arg, small_llm)


def pipeline_hybrid(_model_dir: str, arg: dict) -> dict:
    """See helpers/pp_worker.py `hybrid`."""
    from pp_worker import hybrid

    return hybrid(arg, small_llm)


MODES = {
    "context_parallel": context_parallel,
    "context_parallel_offload": context_parallel_offload,
    "transfer_across_layouts": transfer_across_layouts,
    "transfer_across_stages": transfer_across_stages,
    "generate": generate,
    "hlo": hlo,
    "error": error,
    "kernel_operands": kernel_operands,
    "param_shards": param_shards,
    "missing_rule": missing_rule,
    "fused_shards": fused_shards,
    "generate_ids": generate_ids,
    "generate_images": generate_images,
    "speculative": speculative,
    "lora": lora,
    "data_parallel": data_parallel,
    "pipeline": pipeline,
    "pipeline_research": pipeline_research,
    "pipeline_images": pipeline_images,
    "pipeline_lora": pipeline_lora,
    "pipeline_preemption": pipeline_preemption,
    "pipeline_hybrid": pipeline_hybrid,
    "pipeline_pooling": pipeline_pooling,
    "pipeline_speculative": pipeline_speculative,
    "update_weights": update_weights,
    "update_weights_on_mesh": update_weights_on_mesh,
}


class _CaseProfile:
    """Under XLASERVE_SUITE_PROFILE (helpers/suite_profile.py), each case's wall and CPU time and XLA
    compiles in this process, one line per case in <folder>/tp-worker.jsonl (the suite's profile counts
    this process's CPU only when it exits, and never its compiles)."""

    def __init__(self, folder: str) -> None:
        import jax.monitoring

        os.makedirs(folder, exist_ok=True)
        self._out = open(os.path.join(folder, "tp-worker.jsonl"), "a")
        self.compiles, self.compile_s = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        if os.environ.get("XLASERVE_SUITE_PROFILE_HLO"):
            from suite_profile import log_compiled_modules  # beside this file

            log_compiled_modules(folder)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1
            self.compile_s += duration

    def record(self, request: dict, wall_s: float, cpu_s: float, compiles: int, compile_s: float) -> None:
        name = f"tp_worker.py::{request['mode']}[{os.path.basename(request['model_dir'])}]"
        record = {"nodeid": name, "phase": "case", "wall_s": round(wall_s, 3), "cpu_s": round(cpu_s, 3)}
        record |= {"compiles": compiles, "compile_s": round(compile_s, 3)}
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()


# The engines' programs of every case but the pipeline's compile with XLA:CPU's elemental emitters for
# fusions: their compiles take ~60% less time (three context-parallel layouts: 14.9 -> 6.1 s of XLA
# compile, 21 -> 13 s of CPU), and what those cases compare (one layout against another, all compiled
# alike; collectives and shapes) does not depend on the emitter. The pipeline's cases keep XLA's
# default: their stages are compared with one device bit for bit, and with two processes compiling as
# users do (test_pipeline_parallel.py), and under the elemental emitters a stage's bits differ.
DEFAULT_EMITTER_MODES = {
    "pipeline",
    "pipeline_research",
    "pipeline_lora",
    "pipeline_images",
    "pipeline_preemption",
    "pipeline_hybrid",
    "transfer_across_stages",
}
_default_emitters = True


_profile: _CaseProfile | None = None


def share_compiles_across_devices() -> None:
    """Key XLA's persistent cache without the devices a program is compiled for. jax keys it by the
    device assignment on a CPU (it strips it on a GPU only), so a program whose text another case or
    engine compiled for other fake devices compiled again: the middle stages of PP=4, the second rank
    of DP=2. Loaded from the cache, an executable is bound to the devices it is called on (jax passes
    them to `deserialize_executable`), so each stage and rank still runs on its own."""
    from jax._src import cache_key

    hash_options = cache_key._hash_serialized_compile_options

    def without_devices(hash_obj, compile_options, strip_device_assignment=False):
        return hash_options(hash_obj, compile_options, strip_device_assignment=True)

    cache_key._hash_serialized_compile_options = without_devices


def answer(request: dict) -> dict:
    global _profile, _default_emitters
    if _profile is None and os.environ.get("XLASERVE_SUITE_PROFILE"):
        _profile = _CaseProfile(os.environ["XLASERVE_SUITE_PROFILE"])
    _default_emitters = request["mode"] in DEFAULT_EMITTER_MODES
    start = (time.perf_counter(), sum(os.times()[:2]), _profile.compiles if _profile else 0)
    start_compile_s = _profile.compile_s if _profile else 0.0
    try:
        return {"ok": MODES[request["mode"]](request["model_dir"], request["arg"])}
    except Exception:
        return {"error": traceback.format_exc()}
    finally:
        gc.collect()  # the case's engines and their device buffers go before the next case starts
        # What outlives a case (the modules, jax's caches) is moved out of the cyclic collector's reach,
        # as the engine core does (engine/core_proc.py): the next case's full collection scans only what
        # it allocated (~0.3 -> ~0.005 s of CPU a case).
        gc.freeze()
        if _profile is not None:
            wall, cpu = time.perf_counter() - start[0], sum(os.times()[:2]) - start[1]
            _profile.record(
                request, wall, cpu, _profile.compiles - start[2], _profile.compile_s - start_compile_s
            )


def serve() -> None:
    # Results go to a private copy of stdout; fd 1 itself points at stderr, so that nothing else printed
    # (by Python or by C++ libraries) can break into a result line.
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    for line in sys.stdin:
        request = json.loads(line)
        results.write(f"RESULT {request['id']} {json.dumps(answer(request))}\n")
        results.flush()


if __name__ == "__main__":
    compile_with_elemental_emitters_when(lambda: not _default_emitters)
    share_compiles_across_devices()
    warm_up_what_the_cases_run()
    if len(sys.argv) == 1:
        serve()
    else:
        request = {"id": 0, "mode": sys.argv[1], "model_dir": sys.argv[2], "arg": json.loads(sys.argv[3])}
        print(f"RESULT 0 {json.dumps(answer(request))}")

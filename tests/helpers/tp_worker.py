"""Runs in a subprocess with 8 fake CPU devices: greedy tokens and logprobs of a tiny model under
several parallel layouts, printed as JSON for tests/test_sharding.py."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"


def hlo(model_dir: str, layout: dict) -> None:
    """Print the collectives of the compiled forward of one bucket."""
    import re

    from xlaserve import LLM

    llm = LLM(
        model_dir,
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        enforce_eager=True,
        kv_cache_memory=2**23,
        **layout,
    )
    text = llm.engine_core.runner.compiled_forward_text(16)
    ops = re.findall(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(", text)
    print("RESULT " + json.dumps([[shape, op] for shape, op in ops]))


def kernel_operands(_model_dir: str, tp: int) -> None:
    """Print the operand shapes of the Pallas kernel's Triton custom call, lowered for CUDA on a
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
    print("RESULT " + json.dumps(result))


def param_shards(model_dir: str, layout: dict) -> None:
    """Print each parameter's global and per-device shapes."""
    import jax

    from xlaserve import LLM

    llm = LLM(model_dir, max_model_len=128, enforce_eager=True, kv_cache_memory=2**23, **layout)
    flat = jax.tree_util.tree_flatten_with_path(llm.engine_core.runner.params)[0]
    shapes = {
        "/".join(str(k.key) for k in path if getattr(k, "key", ".value") != ".value"): [
            list(x.shape),
            list(x.addressable_shards[0].data.shape),
        ]
        for path, x in flat
    }
    print("RESULT " + json.dumps(shapes))


def error(model_dir: str, layout: dict) -> None:
    from xlaserve import LLM

    try:
        LLM(model_dir, max_model_len=128, enforce_eager=True, kv_cache_memory=2**23, **layout)
    except ValueError as e:
        print("RESULT " + json.dumps(str(e)))


def main(model_dir: str, layouts: list[dict]) -> None:
    from xlaserve import LLM, SamplingParams

    prompts = ["The capital of France is", "def f(x):", "One two three four five six seven", "Hi"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    results = []
    for layout in layouts:
        llm = LLM(
            model_dir,
            max_model_len=128,
            max_num_batched_tokens=32,
            max_num_seqs=4,
            kv_cache_memory=2**23,
            enforce_eager=True,  # compile only the buckets this short run uses
            **layout,
        )
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
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    mode, model_dir, arg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    {
        "generate": main,
        "hlo": hlo,
        "error": error,
        "kernel_operands": kernel_operands,
        "param_shards": param_shards,
    }[mode](model_dir, arg)

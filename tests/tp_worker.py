"""Runs in a subprocess with 8 fake CPU devices: greedy tokens and logprobs of a tiny model under
several parallel layouts, printed as JSON for tests/test_sharding.py."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"


def hlo(model_dir: str, layout: dict) -> None:
    """Print the collectives of the compiled forward of one bucket."""
    import re

    from engine import LLM

    llm = LLM(model_dir, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, enforce_eager=True,
              kv_cache_memory=2**23, **layout)
    text = llm.engine_core.runner.compiled_forward_text(16)
    ops = re.findall(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(", text)
    print("RESULT " + json.dumps([[shape, op] for shape, op in ops]))


def error(model_dir: str, layout: dict) -> None:
    from engine import LLM

    try:
        LLM(model_dir, max_model_len=128, enforce_eager=True, kv_cache_memory=2**23, **layout)
    except ValueError as e:
        print("RESULT " + json.dumps(str(e)))


def main(model_dir: str, layouts: list[dict]) -> None:
    from engine import LLM, SamplingParams

    prompts = ["The capital of France is", "def f(x):", "One two three four five six seven", "Hi"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    results = []
    for layout in layouts:
        llm = LLM(model_dir, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory=2**23,
                  enforce_eager=True,  # compile only the buckets this short run uses
                  **layout)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            {
                "layout": layout,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [[max(lp.logprob for lp in d.values()) for d in o.outputs[0].logprobs] for o in outs],
            }
        )
        del llm
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    mode, model_dir, arg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    {"generate": main, "hlo": hlo, "error": error}[mode](model_dir, arg)

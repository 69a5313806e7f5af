"""One process of a pipeline over two processes (tests/sharding/test_pipeline_parallel.py), run as
`python pp_process.py ARG_JSON`: process 0 generates helpers/pp_worker.py's prompts and prints the tokens
and (id, logprob) pairs as one JSON line; the other process follows its steps until it stops.

arg: {"model", "node_rank", "port", "layout": engine kwargs, "shape": engine kwargs}."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # `helpers` as the suite imports it


def main(arg: dict) -> None:
    from helpers.pp_worker import PROMPTS
    from helpers.two_processes import engine_of_two
    from xlaserve import SamplingParams

    engine = {
        "dtype": "float32",
        "max_model_len": 128,
        "kv_cache_memory": 2**23,
        "enforce_eager": True,
        **arg["shape"],
        **arg["layout"],
    }
    llm = engine_of_two(arg["model"], arg, **engine)
    if llm is None:  # process 1: followed to the end
        return
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [
            [sorted([i, lp.logprob] for i, lp in d.items()) for d in o.outputs[0].logprobs] for o in outs
        ],
    }
    print("RESULT " + json.dumps(result), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

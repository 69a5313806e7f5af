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
    from xlaserve import LLM, SamplingParams
    from xlaserve.entrypoints.llm import serve_follower

    engine = {
        "dtype": "float32",
        "max_model_len": 128,
        "kv_cache_memory": 2**23,
        "enforce_eager": True,
        "nnodes": 2,
        "node_rank": arg["node_rank"],
        "master_addr": "127.0.0.1",
        "master_port": arg["port"],
        **arg["shape"],
        **arg["layout"],
    }
    if arg["node_rank"]:
        serve_follower(arg["model"], **engine)
        return
    llm = LLM(arg["model"], **engine)
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

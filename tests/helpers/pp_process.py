"""One process of a pipeline over two processes (tests/sharding/test_pipeline_parallel.py,
test_pipeline_hybrid.py), run as `python pp_process.py ARG_JSON`: process 0 generates the prompts and
prints the tokens, (id, logprob) pairs and cached tokens as one JSON line; the other process follows its
steps and calls until it stops.

arg: {"model", "node_rank", "port", "layout": engine kwargs, "shape": engine kwargs}, optionally
"prompts" (token ids; helpers/pp_worker.py's by default), "again" (the prompts run again: a hybrid
model's second run hits the state snapshots the first left), "research": {"other": a checkpoint of the
model's shapes, "refusals": [[good name, bad name], ...]} (then the research stack runs: `research`)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # `helpers` as the suite imports it


def numbers(llm, prompts: list[list[int]]) -> dict:
    """helpers/pp_worker.py's numbers of `prompts`, greedy, and each one's prefix-cache hit."""
    from xlaserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [
            [sorted([i, lp.logprob] for i, lp in d.items()) for d in o.outputs[0].logprobs] for o in outs
        ],
        "num_cached_tokens": [o.num_cached_tokens for o in outs],
    }


def research(llm, arg: dict, prompts: list[list[int]]) -> dict:
    """The research stack across the processes: the numbers after `update_weights_from_path(other)`,
    after sleep(2)/wake_up, after each refusal (a good tensor of one process's stage doubled beside a
    wrong shape, its last column cut, on the other's; the prefix cache reset, so that every token is
    computed by the weights held), and after `update_weights_from_path(model)`."""
    from safetensors.numpy import load_file

    research = arg["research"]
    result = {"updated": len(llm.update_weights_from_path(research["other"]))}
    result["after"] = numbers(llm, prompts)
    result["freed"] = llm.sleep(level=2).device_bytes
    result["placed"] = llm.wake_up().device_bytes
    result["woken"] = numbers(llm, prompts)
    first = load_file(os.path.join(arg["model"], "model.safetensors"))
    result["refused"] = {}
    for good, bad in research["refusals"]:
        try:
            llm.update_weights({good: 2 * first[good], bad: first[bad][..., :-1]})
            result["refused"][bad] = None
        except ValueError as e:
            result["refused"][bad] = str(e)
    llm.reset_prefix_cache()
    result["after_refusals"] = numbers(llm, prompts)
    llm.update_weights_from_path(arg["model"])
    result["back"] = numbers(llm, prompts)
    return result


def main(arg: dict) -> None:
    from helpers.pp_worker import PROMPTS
    from helpers.tiny_models import warm_up_what_the_cases_run
    from helpers.two_processes import engine_of_two

    warm_up_what_the_cases_run()  # a guarded layout's warm-up, in both processes

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
    prompts = arg.get("prompts", PROMPTS)
    result = numbers(llm, prompts)
    if arg.get("again"):  # a hybrid model's second run hits the state snapshots the first left
        result["again"] = numbers(llm, prompts)
    if "research" in arg:
        result |= research(llm, arg, prompts)
    print("RESULT " + json.dumps(result), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

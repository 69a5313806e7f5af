"""The two processes of tensor-parallel (and pipelined) engines over two processes
(tests/sharding/test_multihost.py), run as `python multihost_process.py ARG_JSON`
(helpers/two_processes.py): one launch builds the engines of its cases in turn over the same
jax.distributed session, each shut down (its follower released) before the next is built. The other
process follows process 0's steps and calls for each engine until it stops, and process 0 prints what
each case's answers were as one JSON line, keyed by the case's label.

- "generate": `xlaserve generate` (its argv, given) over both processes (TP 2), process 0's stdout.
- "research": process 0 answers PROMPTS, takes another checkpoint (`update_weights_from_path`), sleeps
  and wakes, takes its first checkpoint back by `update_weights` in two parts (layer 0 last: each part
  writes some layers of the stacks), and is refused a tensor of the wrong shape.
- "lora": PROMPTS with adapter A on the first and none on the second, then B, then A again, one adapter
  slot (each round writes the slot anew).
- "pool": a pooling engine's embeddings of PROMPTS (MEAN pooled: every row of each prompt read).
- "vlm": a vision-language model's answers to helpers/tiny_vlm.py's image prompts (one image, two, none).
- "speculative": PROMPTS answered to 16 tokens under the case's "engine" (its speculative_config), and
  the speculative decoding counters.
- "pipeline": pipeline stages instead (PP 2, a layer on each process) with two LoRA slots: PROMPTS and a
  third prompt with adapters A, B and none in one batch, then "research" (its refused tensors: one of
  the follower's stage, one of process 0's).

Process 1 joins jax.distributed itself before its first engine, as a user's script may (with the
cross-host transfers pipeline stages need), and its engines run over that session; process 0's first
engine joins it (sharding/distributed.py), with the transfers whatever that engine is, so that a pipelined
engine may follow a tensor-parallel one.

arg: {"cases": {label: case}, "node_rank", "port"}; a case: {"case", "model"} and "new_model" (research,
pipeline), "adapters" (lora, pipeline), "argv" (generate: the CLI's, without the multi-host flags);
"engine": engine arguments over the case's (vlm: pipeline stages instead)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # `helpers` as the suite imports it

PROMPTS = [[1, 5, 9, 14, 20, 7], [1, 30, 31, 32]]
ENGINE = {
    "dtype": "float32",
    "tensor_parallel_size": 2,
    "max_model_len": 128,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 2,
    "kv_cache_memory": 2**23,
    "enforce_eager": True,
}


LORA = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
# Two stages of one device each (process 0: layer 0 and the embedding; process 1: layer 1, the head and
# the sampler), two adapter slots, three requests a batch; warmed up under the strict compile guard (a
# step that compiles, in either process, fails the run).
PIPELINE = {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "max_num_seqs": 4, **LORA, "max_loras": 2}
WARMED = {"enforce_eager": False, "strict_compile_guard": True}
THIRD_PROMPT = [1, 40, 41, 42]


def answers(llm, lora_request=None, prompts=PROMPTS, max_tokens: int = 6) -> dict:
    from xlaserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": ids} for ids in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [
            [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs
        ],
    }


def spec_counters(llm) -> dict:
    """The speculative decoding counters (num_drafts, num_draft_tokens, num_accepted_tokens)."""
    return {
        m.name.removeprefix("xlaserve:spec_decode_"): m.value
        for m in llm.get_metrics()
        if m.name.startswith("xlaserve:spec_decode_") and not m.labels
    }


POOL = {"runner": "pooling", "pooler_config": '{"pooling_type": "MEAN"}'}


def image_answers(llm, model: str) -> dict:
    """helpers/tiny_vlm.py's three prompts (one image, two, none) answered together."""
    from helpers.tiny_vlm import image_prompts
    from xlaserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = llm.generate(image_prompts(model), params, use_tqdm=False)
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [
            [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs
        ],
    }


def embeddings(llm) -> list[list[float]]:
    """PROMPTS' embeddings."""
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    return [o.outputs.embedding for o in outputs]


def lora_rounds(llm, adapters: list[str]) -> list[dict]:
    """PROMPTS with adapter A, B, then A again on the first prompt (the base model on the second)."""
    from xlaserve import LoRARequest

    a, b = (LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(zip("ab", adapters)))
    return [answers(llm, [lora, None]) for lora in (a, b, a)]


def adapter_batch(llm, adapters: list[str]) -> dict:
    """PROMPTS and THIRD_PROMPT in one batch: adapter A, adapter B, the base model."""
    from xlaserve import LoRARequest

    a, b = (LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(zip("ab", adapters)))
    return answers(llm, [a, b, None], [*PROMPTS, THIRD_PROMPT])


# The case being run is on pipeline stages: its engine compiles with XLA's default emitters, as the
# one-device engine its bits are compared with does (in the suite's process). The tensor-parallel cases,
# compared within a tolerance (their all-reduces sum in another order), compile with the elemental
# emitters (helpers/tiny_models.py TINY_PROCESS_XLA_FLAGS says why), in both processes alike.
_on_stages = False


def _is_on_stages(case: dict) -> bool:
    return case["case"] == "pipeline" or case.get("engine", {}).get("pipeline_parallel_size", 1) > 1


def main(arg: dict) -> None:
    global _on_stages
    from helpers.tiny_models import compile_with_elemental_emitters_when, warm_up_what_the_cases_run

    compile_with_elemental_emitters_when(lambda: not _on_stages)
    warm_up_what_the_cases_run()  # the guarded engines' (pipeline, vlm_pipeline), in both processes
    if arg["node_rank"]:
        join_jax_distributed(arg["port"], arg["node_rank"])
    results = {}
    for label, case in arg["cases"].items():
        _on_stages = _is_on_stages(case)
        result = run_case({**case, "node_rank": arg["node_rank"], "port": arg["port"]})
        if result is not None:  # process 0
            results[label] = result
    if arg["node_rank"] == 0:
        print("RESULT " + json.dumps(results), flush=True)


def join_jax_distributed(port: int, node_rank: int) -> None:
    """The session the engines adopt (the address and ports they are given), as the user's code joins it."""
    import jax

    from xlaserve.sharding.distributed import transfer_port

    address = f"127.0.0.1:{transfer_port(port, node_rank)}"
    jax.config.update("jax_cross_host_transfer_socket_address", address)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=node_rank)


def run_case(arg: dict) -> dict | None:
    """One engine over both processes: process 0's answers, or None in process 1 once it has followed
    process 0's steps to the end (process 0 shut the engine down)."""
    from helpers.two_processes import engine_of_two

    if arg["case"] == "generate":
        return cli_generate(arg)
    extra = {"lora": LORA, "pool": POOL, "pipeline": PIPELINE | WARMED}.get(arg["case"], {})
    extra |= arg.get("engine", {})
    llm = engine_of_two(arg["model"], arg, **(ENGINE | extra))
    if llm is None:
        return None
    if arg["case"] == "pool":
        result = {"embeddings": embeddings(llm)}
    elif arg["case"] == "vlm":
        result = image_answers(llm, arg["model"])
    elif arg["case"] == "lora":
        result = {"rounds": lora_rounds(llm, arg["adapters"]), "loads": llm.engine_core.runner.lora.num_loads}
    elif arg["case"] == "speculative":
        result = {**answers(llm, max_tokens=16), "metrics": spec_counters(llm)}
    elif arg["case"] == "pipeline":
        result = {"adapters": adapter_batch(llm, arg["adapters"]), **research(llm, arg)}
        result["executor"] = type(llm.engine_core.executor).__name__
    else:
        result = research(llm, arg)
    llm.shutdown()
    return result


def cli_generate(arg: dict) -> dict | None:
    """`xlaserve generate` (arg["argv"]) with TP 2 over both processes: process 0's stdout; process 1
    returns once process 0 released it (a CLI error in either process fails the launch)."""
    import contextlib
    import io

    from xlaserve.entrypoints import cli

    multi = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(arg["port"])]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli.main(
            ["--log-level", "WARNING", *arg["argv"], *multi, "--node-rank", str(arg["node_rank"])]
        )
    if code != 0:
        raise SystemExit(f"xlaserve generate exited {code}")
    return {"stdout": stdout.getvalue()} if arg["node_rank"] == 0 else None


def research(llm, arg: dict) -> dict:
    from safetensors.numpy import load_file

    result = {"before": answers(llm)}
    result["updated"] = len(llm.update_weights_from_path(arg["new_model"]))
    result["after"] = answers(llm)
    result["freed"] = llm.sleep(level=2).device_bytes
    result["placed"] = llm.wake_up().device_bytes
    result["woken"] = answers(llm)
    first = load_file(os.path.join(arg["model"], "model.safetensors"))
    layer_0 = {k: v for k, v in first.items() if k.startswith("model.layers.0.")}
    llm.update_weights({k: v for k, v in first.items() if k not in layer_0})
    llm.update_weights(layer_0)
    result["back"] = answers(llm)
    # Under pipeline stages layer 1 is process 1's (refused there), layer 0 process 0's: each beside a
    # good tensor of the other process's stage.
    up = "model.layers.{}.mlp.up_proj.weight"
    name = "model.layers.1.self_attn.q_proj.weight"
    try:
        llm.update_weights({up.format(0): 2 * first[up.format(0)], name: first[name][:, :-1]})
    except ValueError as e:
        result["refused"] = str(e)
    wrong = {"model.layers.0.self_attn.q_proj.weight": first[name][:, :-1]}
    try:
        llm.update_weights({up.format(1): 2 * first[up.format(1)], **wrong})
    except ValueError as e:
        result["refused_first"] = str(e)
    result["after_refusal"] = answers(llm)
    for call in (lambda: llm.apply_model(len), lambda: llm.collective_rpc("param_sets")):
        try:
            call()
        except ValueError as e:  # the follower runs only the engine's own calls, by name
            result.setdefault("no_python_calls", []).append(str(e))
    return result


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

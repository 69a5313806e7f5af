"""The "data_parallel" case of helpers/tp_worker.py (fake CPU devices): one workload on one rank and on
two, which step together (every rank dispatches before any waits). Per layout: each completion's token
ids, the requests running in the middle of a stream (summed over the ranks), whether an abort gave
every KV block back, the steps each rank ran, and the prefix-cache hits of two prompts sent again."""


def _device_ids(runner) -> list[int]:
    """The devices a rank's runner computes on (a pipeline's: every stage's)."""
    meshes = [s.placement.mesh for s in runner.stages] if hasattr(runner, "stages") else [runner.mesh]
    return sorted(d.id for mesh in meshes for d in mesh.devices.flat)


def _cached_when_sent_again(llm) -> list[int]:
    """Two 40-token prompts sent together (each rank of two takes one), then each again with a token
    more, in the other order: the tokens each second request found in its rank's prefix cache."""
    from xlaserve import SamplingParams

    first, second = list(range(10, 50)), list(range(50, 90))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in (first, second)], params, use_tqdm=False)
    again = [{"prompt_token_ids": p + [7]} for p in (second, first)]
    return [o.num_cached_tokens for o in llm.generate(again, params, use_tqdm=False)]


def main(model_dir: str, layouts: list[dict], small_llm) -> list:
    """`small_llm`: tp_worker.py's engine factory."""
    from xlaserve import SamplingParams

    prompts = [
        "The capital of France is",
        "def f(x):",
        "One two three four five six seven",
        "Hi",
        "Write a haiku about the sea.",
        "Count to ten: one, two,",
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # Penalties read the output ids: their rank steps synchronously while the other stays async.
    penalized = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, presence_penalty=0.8)
    # n > 1: seeded children, kept on one rank.
    children = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, ignore_eos=True)
    params = [greedy, penalized, children, greedy, greedy, penalized]
    results = []
    for layout in layouts:
        llm = small_llm(model_dir, layout, max_num_batched_tokens=16)  # buckets 1, 4, 16
        core = llm.engine_core
        ranks = getattr(core, "ranks", [core])
        outs = llm.generate(prompts, params, use_tqdm=False)
        free = [r.kv_cache_manager.num_free_blocks for r in ranks]
        stream = llm.stream(
            "Tell me a long story about a dragon.", SamplingParams(temperature=0.0, max_tokens=30)
        )
        streamed = [next(stream) for _ in range(3)]
        num_running = core.make_stats().num_running
        stream.close()  # aborts the request mid-stream
        results.append(
            {
                "layout": layout,
                "tokens": [[list(c.token_ids) for c in o.outputs] for o in outs],
                "streamed": streamed,
                "num_running_mid_stream": num_running,
                "abort_freed_all": not core.has_unfinished_requests()
                and [r.kv_cache_manager.num_free_blocks for r in ranks] == free,
                "steps_per_rank": [r.runner.num_steps for r in ranks],
                "devices_per_rank": [_device_ids(r.runner) for r in ranks],
                # The engine goes on serving after the abort.
                "after_abort": list(
                    llm.generate(prompts[:2], greedy, use_tqdm=False)[1].outputs[0].token_ids
                ),
                "cached_when_sent_again": _cached_when_sent_again(llm),
            }
        )
        del llm
    return results

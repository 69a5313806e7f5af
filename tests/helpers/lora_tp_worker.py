"""The "lora" case of helpers/tp_worker.py (8 fake CPU devices): greedy tokens and logprobs of a tiny
model with and without a LoRA adapter under each tensor-parallel size, and how its LoRA slot stacks
are split."""


def main(model_dir: str, adapter_dir: str, sizes: list[int]) -> list:
    from xlaserve import LLM, LoRARequest, SamplingParams

    lora = LoRARequest("adapter", 1, adapter_dir)
    prompts = [{"prompt_token_ids": [5 + (i * 13 + j * 7) % 500 for j in range(20 + i)]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    results = []
    for tp in sizes:
        llm = LLM(
            model_dir,
            dtype="float32",
            max_model_len=128,
            max_num_batched_tokens=32,
            max_num_seqs=4,
            enforce_eager=True,
            kv_cache_memory=2**23,
            tensor_parallel_size=tp,
            enable_lora=True,
            max_loras=1,
            max_lora_rank=8,
        )
        outs = llm.generate(prompts * 2, params, use_tqdm=False, lora_request=[lora] * 3 + [None] * 3)
        stacks = llm.engine_core.runner.lora.stacks[0]["layers"]  # one set of slots (no pipeline)
        shards = {
            f"{which}:{module}": list(array.addressable_shards[0].data.shape)
            for which, arrays in (("a", stacks.a), ("b", stacks.b))
            for module, array in arrays.items()
        }
        results.append(
            {
                "tp": tp,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs],
                "shards": shards,
            }
        )
        del llm
    return results

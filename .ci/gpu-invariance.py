"""Batch invariance on the device at hand (run by .ci/gpu-check): each of a few prompts alone, then
the same prompts among companions in one crowded batch; greedy token ids and logprobs must be the same
bits. `python3 .ci/gpu-invariance.py MODEL [--load-format dummy] [--max-num-seqs 64]`: exits 1 on a
difference, printing the first token where a prompt diverged."""

import argparse
import sys
import time

from xlaserve import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--load-format", default="auto")
parser.add_argument("--max-num-seqs", type=int, default=64)
parser.add_argument("--max-tokens", type=int, default=32)
args = parser.parse_args()

llm = LLM(
    args.model,
    load_format=args.load_format,
    dtype="bfloat16",
    max_model_len=512,
    max_num_seqs=args.max_num_seqs,
    max_num_batched_tokens=256,  # crowded prompts are chunked
)
params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1, ignore_eos=True)
prompts = [f"Question {i}: explain, step by step, why {i} squared is {i * i}." for i in range(4)]
companions = [
    f"Tell me a story about the number {i} and a {i * 7}-sided die." for i in range(args.max_num_seqs - 4)
]


def numbers(output):
    o = output.outputs[0]
    return o.token_ids, [[(i, lp.logprob) for i, lp in entry.items()] for entry in o.logprobs]


t0 = time.perf_counter()
alone = [numbers(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
crowd = [numbers(o) for o in llm.generate(prompts + companions, params, use_tqdm=False)[: len(prompts)]]
failed = 0
for i, (a, c) in enumerate(zip(alone, crowd)):
    if a == c:
        continue
    failed += 1
    first = next((t for t, (x, y) in enumerate(zip(a[1], c[1])) if x != y), min(len(a[1]), len(c[1])) - 1)
    print(f"prompt {i}: alone and in the crowd differ from token {first}: {a[1][first]} vs {c[1][first]}")
print(
    f"batch invariance: {len(prompts) - failed}/{len(prompts)} prompts identical alone and among "
    f"{len(companions)} companions ({args.max_tokens} tokens, {time.perf_counter() - t0:.1f}s)"
)
sys.exit(1 if failed else 0)

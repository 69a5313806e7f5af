"""Speculative decoding in `xlaserve bench`: the copy workload, the acceptance figures, and a paired
run against the same engine without speculation.

The copy workload asks for code back with one small change, so most of each answer repeats the prompt:
where n-gram drafting pays. The chat workload (offline.py) is where it finds little to propose, so it
shows the overhead. `--baseline-without-speculation` builds a second engine without
`--speculative-config` in the same process and runs each prompt on both, one after the other, so the
TPOT ratio is paired (both see the same load).
"""

from __future__ import annotations

import time

_SNIPPETS = [
    '''def moving_average(values, window):
    """The mean of each window of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages''',
    """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None""",
    """def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1""",
    """def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda item: item[1], reverse=True)""",
    '''def fibonacci(n):
    """The first n Fibonacci numbers."""
    numbers = []
    a, b = 0, 1
    for _ in range(n):
        numbers.append(a)
        a, b = b, a + b
    return numbers


def is_prime(n):
    if n < 2:
        return False
    for d in range(2, int(n ** 0.5) + 1):
        if n % d == 0:
            return False
    return True''',
    """def merge_sorted(left, right):
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged""",
]
_CHANGES = [
    "rename the function to `rolling_mean`",
    "rename the class to `LifoStack`",
    "rename `middle` to `mid`",
    "rename the function to `count_words`",
    "rename `numbers` to `result`",
    "rename `merged` to `output`",
]


def copy_workload(num_prompts: int) -> list[list[dict]]:
    """N chat conversations asking for code back with one change (the same for every run)."""
    return [
        [
            {
                "role": "user",
                "content": f"Repeat this Python code exactly, but {_CHANGES[i % len(_CHANGES)]}. "
                f"Reply with the code only.\n\n```python\n{_SNIPPETS[i % len(_SNIPPETS)]}\n```",
            }
        ]
        for i in range(num_prompts)
    ]


def spec_counters(llm) -> dict[str, float]:
    """The engine's spec_decode_* counters (empty without speculative decoding)."""
    out = {}
    for metric in llm.get_metrics():
        name = metric.name.split(":", 1)[-1]
        if name.startswith("spec_decode_") and not metric.labels:
            out[name.removeprefix("spec_decode_")] = metric.value
    return out


def acceptance(before: dict, after: dict) -> dict:
    """vLLM's figures over a run: acceptance rate (accepted / drafted tokens) and mean acceptance length
    (1 + accepted per verification: tokens a request gains per step that verifies drafts)."""
    if not after:
        return {}
    drafts = after["num_drafts"] - before.get("num_drafts", 0)
    draft_tokens = after["num_draft_tokens"] - before.get("num_draft_tokens", 0)
    accepted = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
    }


def _tpot(output) -> float | None:
    n = len(output.outputs[0].token_ids)
    if n < 2:
        return None
    return (output.metrics.last_token_time - output.metrics.first_token_time) / (n - 1)


def run_paired(spec_llm, base_llm, prompts, output_len: int) -> dict:
    """Each prompt alone (batch 1) on the engine without speculation, then on the one with it."""
    from xlaserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for llm in (base_llm, spec_llm):
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    before = spec_counters(spec_llm)
    tpots = {"base": [], "spec": []}
    num_same = 0
    start = time.perf_counter()
    for prompt in prompts:
        base = base_llm.generate(prompt, params, use_tqdm=False)[0]
        spec = spec_llm.generate(prompt, params, use_tqdm=False)[0]
        num_same += base.outputs[0].token_ids == spec.outputs[0].token_ids
        for key, output in (("base", base), ("spec", spec)):
            if (t := _tpot(output)) is not None:
                tpots[key].append(t)
    base_tpot = sum(tpots["base"]) / len(tpots["base"])
    spec_tpot = sum(tpots["spec"]) / len(tpots["spec"])
    return {
        "elapsed_s": time.perf_counter() - start,
        "tpot_s_without": base_tpot,
        "tpot_s_with": spec_tpot,
        "tpot_ratio_without_over_with": base_tpot / spec_tpot,
        "num_identical_outputs": num_same,
        **acceptance(before, spec_counters(spec_llm)),
    }


def print_acceptance(figures: dict) -> None:
    if figures:
        print(
            f"{'':>9}  speculative decoding: acceptance rate {figures['acceptance_rate']:.1%} "
            f"({figures['num_accepted_tokens']} of {figures['num_draft_tokens']} draft tokens), "
            f"mean acceptance length {figures['mean_acceptance_length']:.2f}"
        )


def print_paired(paired: dict) -> None:
    print(
        f"   paired: TPOT without speculation {paired['tpot_s_without'] * 1e3:.1f} ms, with "
        f"{paired['tpot_s_with'] * 1e3:.1f} ms: {paired['tpot_ratio_without_over_with']:.2f}x; "
        f"{paired['num_identical_outputs']} identical outputs"
    )
    print_acceptance(paired)

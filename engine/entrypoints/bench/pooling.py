"""`xlaserve bench throughput --runner pooling [--backend hf]`: a pooling engine's sequences per second.

The prompts are the bench's (`--input-len N`: random token ids of length N; else the chat workload's
texts), pooled with the engine's task (`encode`: the pooled hidden states, the step's whole work). With
`--backend hf`, Hugging Face's `AutoModel` runs the same token ids in the same process, in batches of
`--max-num-seqs` padded rows (its best on a CPU: one forward per batch), after an untimed batch as the
engine gets an untimed request; the report gives both throughputs, their ratio, and how far the two
pooled outputs are apart (the largest absolute difference over every prompt, pooled the engine's way:
a fast wrong answer is not a result).
"""

from __future__ import annotations

import time

import numpy as np


def run_engine(llm, prompts: list[dict]) -> tuple[dict, list[np.ndarray]]:
    """-> (the report, each prompt's pooled hidden state), after one untimed prompt."""
    llm.encode(prompts[:1], pooling_task="encode", use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.encode(prompts, pooling_task="encode")
    elapsed = time.perf_counter() - start
    return _report(prompts, elapsed), [np.asarray(o.outputs.data, np.float32) for o in outputs]


def run_hf(model_path: str, prompts: list[dict], batch_size: int, pooling_type: str) -> tuple[dict, list]:
    """The same token ids through Hugging Face's `AutoModel` (float32), `batch_size` padded rows a
    forward (right padding, the attention mask); pooled as the engine pools (CLS, MEAN, LAST)."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()
    rows = [p["prompt_token_ids"] for p in prompts]

    def forward(batch: list[list[int]]) -> list[np.ndarray]:
        width = max(len(r) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
        return [_pool(h[: len(r)], pooling_type) for h, r in zip(hidden, batch)]

    forward(rows[:batch_size])  # untimed
    start = time.perf_counter()
    pooled = [p for i in range(0, len(rows), batch_size) for p in forward(rows[i : i + batch_size])]
    return _report(prompts, time.perf_counter() - start), pooled


def _pool(rows: np.ndarray, pooling_type: str) -> np.ndarray:
    if pooling_type == "CLS":
        return rows[0]
    if pooling_type == "MEAN":
        return rows.mean(axis=0)
    if pooling_type == "LAST":
        return rows[-1]
    raise ValueError(f"--backend hf compares CLS, MEAN or LAST pooling, got {pooling_type}")


def _report(prompts: list[dict], elapsed: float) -> dict:
    num_in = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {
        "num_requests": len(prompts),
        "input_tokens": num_in,
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "input_tokens_per_s": num_in / elapsed,
    }


def bench(llm, model_path: str | None, prompts: list[dict], backend: str, batch_size: int) -> dict:
    """The pooling bench's results (module docstring)."""
    pooler = llm.engine_core.runner.pooler
    results = {"runner": "pooling", "task": pooler.task, "pooling_type": pooler.pooling_type}
    results["xlaserve"], ours = run_engine(llm, prompts)
    if backend == "hf":
        if model_path is None:
            raise SystemExit("--backend hf with --runner pooling needs --model (a Hugging Face directory)")
        results["hf"], theirs = run_hf(model_path, prompts, batch_size, pooler.pooling_type)
        ours_per_s, theirs_per_s = results["xlaserve"]["requests_per_s"], results["hf"]["requests_per_s"]
        results["ratio_requests_per_s"] = ours_per_s / theirs_per_s
        results["max_abs_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs))
    return results


def print_results(results: dict) -> None:
    print(f"pooling ({results['task']}, {results['pooling_type']}):")
    for backend in ("xlaserve", "hf"):
        if backend in results:
            r = results[backend]
            print(
                f"  {backend:>8}: {r['num_requests']} prompts, {r['input_tokens']} tokens in "
                f"{r['elapsed_s']:.2f} s: {r['requests_per_s']:.1f} seq/s, "
                f"{r['input_tokens_per_s']:.0f} tok/s"
            )
    if "ratio_requests_per_s" in results:
        print(f"  sequences/s xlaserve / hf: {results['ratio_requests_per_s']:.2f}x")
        print(f"  largest |xlaserve - hf| of the pooled states: {results['max_abs_diff']:.2e}")

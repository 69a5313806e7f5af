"""`--backend hf`: Hugging Face transformers' `generate` as the engine's peer, for paired ratios.

`bench throughput|latency` (bench/offline.py) and `bench targets` (bench/targets.py) run the same
prompts through it in the same process as the engine, so each ratio is measured under the same
conditions. Like the engine it first runs one untimed request (the first prompt, WARM_UP_OUTPUT_LEN
tokens), reported as `warm_up_s`. `generate` gives no per-token times, so its time to first token is
a forward over the prompts alone (the prefill), and its time per output token is the rest of a timed
`generate` spread over the tokens after the first. torch is imported only here, when a run asks for it.
"""

from __future__ import annotations

import os
import time

from xlaserve.entrypoints.bench.report import WARM_UP_OUTPUT_LEN, run_report


def load_hf(model: str | None, dtype: str = "float32"):
    """The model (a folder, a hub name, a .gguf file; None or "smollm2": the packaged SmolLM2) as
    transformers' `AutoModelForCausalLM` in `dtype`, on every CPU core, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from xlaserve.models.loader import resolve_embedded_model_path

    torch.set_num_threads(os.cpu_count() or 1)
    if model is None or model == "smollm2":
        model = resolve_embedded_model_path()
    if model.endswith(".gguf"):
        hf = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model), gguf_file=os.path.basename(model), dtype=getattr(torch, dtype)
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    return hf.eval()


def run_hf(hf, tokenizer, prompts, output_len: int, batch: bool) -> dict:
    """The workload through `hf.generate`, after the warm-up the engine gets (WARM_UP_OUTPUT_LEN)."""
    import torch

    def generate(rows: list[list[int]], num_tokens: int = output_len) -> tuple[float, float]:
        width = max(map(len, rows))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            t0 = time.perf_counter()
            hf(input_ids=ids, attention_mask=mask)  # the prefill alone: time to first token
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            return ttft, time.perf_counter() - t0

    rows = [p["prompt_token_ids"] for p in prompts]
    num_in = sum(map(len, rows))
    warm_up_s = sum(generate(rows[:1], WARM_UP_OUTPUT_LEN))  # untimed: the warm-up
    if batch:
        ttft, elapsed = generate(rows)
        report = run_report(
            "hf",
            len(rows),
            num_in,
            len(rows) * output_len,
            elapsed,
            [ttft],
            [(elapsed - ttft) / (output_len - 1)],
        )
        return report | {"warm_up_s": warm_up_s}
    ttfts, tpots, total = [], [], 0.0
    for row in rows:
        ttft, elapsed = generate([row])
        ttfts.append(ttft)
        tpots.append((elapsed - ttft) / (output_len - 1))
        total += elapsed
    report = run_report("hf", len(rows), num_in, len(rows) * output_len, total, ttfts, tpots)
    return report | {"warm_up_s": warm_up_s}


def ratios(ours: dict, hf: dict) -> dict:
    """The engine's run report against Hugging Face's: output throughput, and TPOT (HF's over ours)."""
    return {
        "ratio_output_throughput": ours["output_tokens_per_s"] / hf["output_tokens_per_s"],
        "ratio_tpot_hf_over_xlaserve": hf["tpot_s"]["mean"] / ours["tpot_s"]["mean"],
    }


def print_ratios(results: dict) -> None:
    if "ratio_output_throughput" in results:
        print(f"output throughput xlaserve / hf: {results['ratio_output_throughput']:.2f}x")
        print(f"TPOT hf / xlaserve: {results['ratio_tpot_hf_over_xlaserve']:.2f}x")

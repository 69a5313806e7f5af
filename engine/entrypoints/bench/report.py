"""The report of one `bench throughput|latency` run, whichever backend ran it: the engine's
(bench/offline.py) or Hugging Face's (bench/hf_peer.py). Both fill the same fields after the same
untimed warm-up, so two reports divide into a ratio.
"""

from __future__ import annotations

import statistics

# Both backends start with one untimed request of the first prompt and this many tokens, so neither
# side's first-call costs (programs loaded, torch's thread pool and allocator, lazy inits) are timed.
WARM_UP_OUTPUT_LEN = 2


def run_report(
    backend: str,
    num_requests: int,
    num_in: int,
    num_out: int,
    elapsed: float,
    ttft: list[float],
    tpot: list[float],
) -> dict:
    """Rates over `elapsed` seconds (requests, output tokens, all tokens) and the percentiles of the
    time to first token and time per output token, each in seconds."""
    return {
        "backend": backend,
        "num_requests": num_requests,
        "elapsed_s": elapsed,
        "requests_per_s": num_requests / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "ttft_s": _percentiles(ttft),
        "tpot_s": _percentiles(tpot),
    }


def pooled_report(reports: list[dict]) -> dict:
    """Runs of the same requests as one report: their mean elapsed time, the rates over it, each
    percentile's mean (the means exactly: every run has as many requests), and the runs themselves."""
    elapsed = statistics.fmean(r["elapsed_s"] for r in reports)
    pooled = {**reports[0], "elapsed_s": elapsed, "rounds": reports}
    for rate in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        pooled[rate] = statistics.fmean(r[rate] * r["elapsed_s"] for r in reports) / elapsed
    for times in ("ttft_s", "tpot_s"):
        pooled[times] = {k: statistics.fmean(r[times][k] for r in reports) for k in reports[0][times]}
    return pooled


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"mean": statistics.fmean(values), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}

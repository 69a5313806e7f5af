"""The benches' reports. One `bench throughput|latency` run's, whichever backend ran it: the engine's
(bench/offline.py) or Hugging Face's (bench/hf_peer.py); both fill the same fields after the same
untimed warm-up, so two reports divide into a ratio. One `bench serve` load's (bench/serve.py): its
requests' latencies as percentiles, printed, plotted against load, and divided by a peer's.

Percentiles are nearest-rank (the smallest value with at least p% of the values at or below it).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

# Both backends start with one untimed request of the first prompt and this many tokens, so neither
# side's first-call costs (programs loaded, torch's thread pool and allocator, lazy inits) are timed.
WARM_UP_OUTPUT_LEN = 2
PERCENTILES = (50, 90, 99)


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
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
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


def percentiles(values: list[float]) -> dict[str, float]:
    """The mean and the PERCENTILES (nearest-rank) of `values`; {} for none."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {"mean": sum(ordered) / len(ordered)}
    for p in PERCENTILES:
        out[f"p{p}"] = ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]
    return out


@dataclass
class RequestResult:
    is_structured: bool = False
    is_long: bool = False
    is_ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itls: list[float] = field(default_factory=list)


def _with_tpot(results: list[RequestResult]):
    return [(r, (r.e2e - r.ttft) / (r.output_tokens - 1)) for r in results if r.output_tokens > 1]


def serve_summary(results: list[RequestResult], elapsed: float, max_concurrency, request_rate) -> dict:
    ok = [r for r in results if r.is_ok]
    num_out = sum(r.output_tokens for r in ok)
    num_in = sum(r.prompt_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "max_concurrency": max_concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "elapsed_s": elapsed,
        "requests_per_s": len(ok) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "num_structured": sum(r.is_structured for r in results),
        "ttft_s_structured": percentiles([r.ttft for r in ok if r.is_structured]),
        "ttft_s_unstructured": percentiles([r.ttft for r in ok if not r.is_structured]),
        "tpot_s": percentiles(tpots),
        "num_long": sum(r.is_long for r in results),
        "ttft_s_long": percentiles([r.ttft for r in ok if r.is_long]),
        "ttft_s_short": percentiles([r.ttft for r in ok if not r.is_long]),
        "tpot_s_long": percentiles([t for r, t in _with_tpot(ok) if r.is_long]),
        "tpot_s_short": percentiles([t for r, t in _with_tpot(ok) if not r.is_long]),
        "itl_s": percentiles([x for r in ok for x in r.itls]),
        "e2e_s": percentiles([r.e2e for r in ok]),
    }


def print_serve_run(run: dict, num_prompts: int, output_len: int) -> None:
    load = f"max concurrency {run['max_concurrency']}" if run["max_concurrency"] else "no concurrency limit"
    what = (
        f"{num_prompts} prompts embedded"
        if "input_tokens_per_s" in run
        else f"{num_prompts} prompts x {output_len} tokens"
    )
    print(f"\n== bench serve: {what}, {load}, request rate {run['request_rate']} ==")
    print(
        f"requests: {run['num_requests'] - run['num_failed']} ok, {run['num_failed']} failed "
        f"{run['errors'] or ''}"
    )
    if "input_tokens_per_s" in run:  # embeddings
        print(f"throughput: {run['requests_per_s']:.2f} req/s, {run['input_tokens_per_s']:.1f} input tok/s")
    else:
        print(
            f"throughput: {run['requests_per_s']:.2f} req/s, {run['output_tokens_per_s']:.1f} output tok/s, "
            f"{run['total_tokens_per_s']:.1f} total tok/s"
        )
    if "images_per_s" in run:
        print(f"images: {run['images_per_request']} a request, {run['images_per_s']:.2f} images/s")
    rows = [("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")]
    if run["num_structured"]:
        print(f"{run['num_structured']} requests with a JSON schema (response_format)")
        rows[1:1] = [("ttft_s_structured", "TTFT schema"), ("ttft_s_unstructured", "TTFT no schema")]
    if run.get("num_long"):
        print(f"{run['num_long']} requests with a long prompt")
        rows[1:1] = [("ttft_s_long", "TTFT long"), ("ttft_s_short", "TTFT short")]
        rows[-2:-2] = [("tpot_s_long", "TPOT long"), ("tpot_s_short", "TPOT short")]
    for key, name in rows:
        p = run[key]
        if p:
            print(
                f"{name:>14} ms: mean {p['mean'] * 1e3:8.1f}  "
                + "  ".join(f"p{q} {p[f'p{q}'] * 1e3:8.1f}" for q in PERCENTILES)
            )


def plot(runs: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib: pip install 'xlaserve[bench]' ({e})") from None
    by_rate = all(r["max_concurrency"] is None for r in runs)
    loads = [r["request_rate"] if by_rate else r["max_concurrency"] for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, (key, name) in zip(
        axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))
    ):
        for q in PERCENTILES:
            ax.plot(loads, [r[key].get(f"p{q}", float("nan")) * 1e3 for r in runs], marker="o", label=f"p{q}")
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("request rate (req/s)" if by_rate else "max concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("xlaserve bench serve: latency percentiles against load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def peer_ratios(run: dict, peer: dict) -> dict[str, float]:
    """This run's p50 latencies and throughput as ratios of the peer's (latency < 1: this is faster)."""
    ratios = {"output_tokens_per_s": run["output_tokens_per_s"] / max(peer["output_tokens_per_s"], 1e-9)}
    for key in ("ttft_s", "tpot_s", "ttft_s_long", "ttft_s_short", "tpot_s_short"):
        if run.get(key) and peer.get(key):
            ratios[f"{key}_p50"] = run[key]["p50"] / max(peer[key]["p50"], 1e-9)
    return ratios
